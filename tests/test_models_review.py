"""The model area's review (onn/models): tied embeddings load from a bare .safetensors file whichever name it kept
and char_lstm's tie_word_embeddings ties; special token ids and a tokenizer past the model's vocabulary, a sharded
folder missing a shard, a folder whose weights lack layers, and a text encoder whose heads do not divide its width
are each one sentence, not a traceback (or a device-side assert, or a model trained from a partly random init)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import compose, tiny_llama

from onn.errors import UserError
from onn.models.load import load, meta_model
from onn.models.tokenizer import byte_tokenizer
from onn.models.zoo.registry import build_zoo


def test_a_tied_model_saved_by_safetensors_save_model_loads_from_its_file(tmp_path):
    """safetensors' save_model keeps one name of a tied pair, lm_head.weight for a Llama: model.source=that file
    loads the same weights, the pair tied again, where it was refused as missing model.embed_tokens.weight."""
    from safetensors.torch import load_file, save_model

    tied = ("model=llama_tiny", "model.architecture.tie_word_embeddings=true")
    model, _ = load(compose(*tied).model)
    path = tmp_path / "tied.safetensors"
    save_model(model, str(path))
    assert "model.embed_tokens.weight" not in load_file(str(path))
    loaded, _ = load(compose(*tied, f"model.source={path}").model)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    for (name, want), got in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(want, got), name


def test_char_lstm_ties_its_head_to_its_embedding_when_asked():
    """model.architecture.tie_word_embeddings=true on char_lstm is one matrix for the embedding and the head (it was
    read and ignored): the planner counts it once, its first loss is near chance (ln 259 = 5.6; nn.Embedding's
    scale as the head's gave 30), and training moves it through both uses."""
    small = ("model=char_lstm", "model.architecture.hidden_size=16", "model.architecture.dropout=0")
    cfg = compose(*small, "model.architecture.tie_word_embeddings=true")
    model, tokenizer = load(cfg.model)
    assert model.head.weight is model.embed.weight
    untied, _ = load(compose(*small).model)
    planned = {id(p): p.numel() for p in meta_model(cfg.model).parameters()}
    assert sum(planned.values()) == sum(p.numel() for p in untied.parameters()) - 259 * 16
    ids = tokenizer(["abc abc", "cab"], return_tensors="pt", padding=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.train()
    losses = []
    for _ in range(2):
        optimizer.zero_grad()
        loss = model(**ids, labels=ids["input_ids"].masked_fill(ids["attention_mask"] == 0, -100)).loss
        loss.backward()
        losses.append(loss.item())
        # a byte the batch never holds reaches the embedding's row only through the head
        assert model.embed.weight.grad[ord("z")].abs().sum() > 0
        optimizer.step()
    assert model.head.weight is model.embed.weight and losses[0] < 7 and losses[1] < losses[0]


def test_a_special_token_id_past_the_vocabulary_is_one_sentence():
    """A smaller vocab_size than llama_tiny's byte ids (pad 258) failed on nn.Embedding's bare assertion."""
    cfg = compose("model=llama_tiny", "model.architecture.vocab_size=200")
    with pytest.raises(UserError, match=r"^model\.architecture\.bos_token_id=256 is past the vocabulary"):
        meta_model(cfg.model)


def test_a_tokenizer_with_more_tokens_than_the_model_embeds_is_one_sentence():
    """The byte tokenizer's 259 ids into 200 embeddings failed at the first batch: an IndexError on a CPU, a
    device-side assert on a GPU. The load says it, and what vocab_size to give."""
    ids = ("pad_token_id=0", "eos_token_id=1", "bos_token_id=2", "vocab_size=200")
    cfg = compose("model=llama_tiny", *(f"model.architecture.{kv}" for kv in ids))
    with pytest.raises(
        UserError, match=r"gives ids up to 258 and the model embeds 200; set model\.architecture\.vocab_size"
    ):
        load(cfg.model)
    model, tokenizer = load(compose("model=llama_tiny", "model.architecture.vocab_size=259").model)
    assert model(**tokenizer(["hello"], return_tensors="pt")).logits.shape == (1, 5, 259)


def test_a_layer_streamed_model_checks_its_vocabulary_as_a_resident_one(tmp_path):
    """A streamed model (strategy=sparse_lora) is built block by block into a layer store, not by load(): 200
    embeddings for 259 byte ids still failed at the first batch there."""
    from onn.streaming.loader import load_into_store
    from onn.streaming.store import LayerStore

    ids = ("pad_token_id=0", "eos_token_id=1", "bos_token_id=2", "vocab_size=200")
    small = compose("model=llama_tiny", *(f"model.architecture.{kv}" for kv in ids)).model
    store = LayerStore("disk", "float32", folder=tmp_path / "store")
    with pytest.raises(UserError, match=r"gives ids up to 258 and the model embeds 200"):
        load_into_store(small, torch.float32, None, store)
    model, _ = load_into_store(compose("model=llama_tiny").model, torch.float32, None, store)
    assert model.get_input_embeddings().num_embeddings >= 259


def saved_llama(folder, layers: int = 4, **save) -> torch.nn.Module:
    model = tiny_llama(num_hidden_layers=layers, vocab_size=259)  # the byte tokenizer gives ids up to 258
    model.save_pretrained(folder, **save)
    byte_tokenizer().save_pretrained(folder)
    return model


def folder_config(folder):
    return compose(
        "model=llama_tiny", f"model.source={folder}", "model.architecture=null", "model.tokenizer=null"
    ).model


def test_a_sharded_folder_loads_whole_and_one_missing_shard_is_one_sentence(tmp_path):
    """Every shard of a sharded folder is read; a shard its index names that is not there was a FileNotFoundError
    from inside transformers."""
    model = saved_llama(tmp_path, max_shard_size="20KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 2
    loaded, _ = load(folder_config(tmp_path))
    for (name, want), got in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(want, got), name
    shards[-1].unlink()
    with pytest.raises(UserError, match=rf"names {len(shards)} shards and 1 are not in the folder \({shards[-1].name}"):
        load(folder_config(tmp_path))


def test_a_folder_whose_weights_lack_layers_its_config_describes_is_refused(tmp_path):
    """Two layers' weights under a config of four loaded with layers 2 and 3 random (transformers printed a table),
    and training went on from them."""
    saved_llama(tmp_path, layers=2)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 4}))
    with pytest.raises(UserError, match=r"its weights lack 18 tensors its config\.json describes \(model\.layers\.2\."):
        load(folder_config(tmp_path))


def test_text_encoder_heads_that_do_not_divide_its_width_are_one_sentence():
    """model.kwargs.heads=3 with width 64 was nn.MultiheadAttention's bare AssertionError."""
    with pytest.raises(UserError, match=r"zoo:text_encoder: width=64 must split evenly into heads=3"):
        build_zoo("text_encoder", heads=3)
    assert build_zoo("text_encoder", heads=2, max_length=8)(torch.randint(0, 256, (1, 8))).shape == (1, 128)
