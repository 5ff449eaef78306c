"""Model sources: offline only, safetensors only, and one clear error for each bad input."""

import dataclasses

import pytest
import torch

from onn.config.model import LanguageModelConfig, LayerMapOverride
from onn.errors import UserError
from onn.models.load import architecture, load, meta_model, source_kind
from onn.models.tokenizer import byte_tokenizer

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 320, "hidden_size": 32,
         "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 128, "bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 258}  # fmt: skip


def language_model(**keys) -> LanguageModelConfig:
    """A model config with these keys, the rest as conf/model's language models leave them."""
    unset = {
        "tokenizer": None,
        "dtype": "auto",
        "trust_remote_code": False,
        "layer_map": LayerMapOverride(blocks=None),
        "architecture": None,
    }
    return LanguageModelConfig(**{"name": "x", "source": "random", **unset, **keys})


def test_byte_tokenizer_round_trips_any_text():
    tok = byte_tokenizer()
    text = "Grüße, 世界! 17 + 25 = 42\n\ttabs"
    assert tok.decode(tok(text)["input_ids"]) == text and len(tok) == 259


def test_random_and_safetensors_sources(tmp_path):
    from safetensors.torch import save_file

    cfg = language_model(name="t", source="random", tokenizer="byte", architecture=LLAMA)
    model, tok = load(cfg)
    path = tmp_path / "w.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    again, _ = load(dataclasses.replace(cfg, source=str(path)))
    ids = torch.tensor([[1, 2, 3]])
    assert torch.allclose(model(ids).logits, again(ids).logits)
    truncated = tmp_path / "cut.safetensors"
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(UserError, match="truncated or corrupt"):
        load(dataclasses.replace(cfg, source=str(truncated)))


def test_python_builder_source(tmp_path):
    (tmp_path / "mine.py").write_text(
        "import torch.nn as nn\ndef build(width=4):\n"
        "    return nn.Sequential(nn.Embedding(10, width), *[nn.Sequential(nn.Linear(width, width), nn.ReLU()) "
        "for _ in range(3)], nn.Linear(width, 10))\n"
    )
    model = meta_model(language_model(name="mine", source=f"{tmp_path}/mine.py:build"))
    assert next(model.parameters()).is_meta and model[0].embedding_dim == 4


def test_an_architecture_key_the_config_class_does_not_read_is_one_sentence():
    """+model.architecture.num_hiden_layers=3 trained the full model (transformers keeps an unknown key as a bare
    attribute), and recipe=char_lstm model=llama_tiny carried the LSTM's cell and dropout into a Llama's config."""
    from conftest import compose

    with pytest.raises(
        UserError,
        match=r"^model\.architecture\.num_hiden_layers is not a key of llama's config \(LlamaConfig\) \(did you mean "
        r"model\.architecture\.num_hidden_layers\?\)",
    ):
        architecture(language_model(architecture={**LLAMA, "num_hiden_layers": 3}))
    with pytest.raises(UserError, match=r"^model\.architecture\.cell is not a key of llama's config"):
        architecture(compose("recipe=char_lstm", "model=llama_tiny").model)
    # keys the class takes and keeps as others (rope_theta in rope_parameters, torch_dtype as dtype), special token
    # ids and keys transformers reads off any config: not in to_dict() under their names, and not refused
    taken = {"rope_theta": 5e5, "torch_dtype": "float32", "attn_implementation": "eager", "num_labels": 3}
    config = architecture(language_model(architecture={**LLAMA, **taken, "sep_token_id": 1, "is_decoder": True}))
    assert config.rope_parameters["rope_theta"] == 5e5 and config.num_labels == 3
    assert architecture(compose("model=char_lstm").model).cell == "lstm"  # ONN's own transformers model: its keys
    assert architecture(compose("model=trocr_mini").model).decoder_start_token_id == 256  # an encoder-decoder's ids


def test_refusals(tmp_path, monkeypatch):
    pt = tmp_path / "model.pt"
    pt.write_bytes(b"\x80\x04")
    with pytest.raises(UserError, match="pickle checkpoint.*safetensors"):
        source_kind(str(pt))
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(UserError, match="only pickle weights"):
        load(language_model(source=str(folder)))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="not in the local Hugging Face cache.*huggingface-cli download"):
        load(language_model(source="someorg/not-downloaded"))
    with pytest.raises(UserError, match="does not exist"):
        source_kind(str(tmp_path / "missing.gguf"))


def test_truncated_gguf_is_refused(tmp_path):
    import numpy as np
    from gguf import GGUFWriter

    path = tmp_path / "tiny.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.ones((64, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size - 1000])
    with pytest.raises(UserError, match="truncated|not a readable GGUF"):
        load(language_model(source=str(cut)))


def test_a_folder_models_fingerprint_follows_the_files_inside_it(tmp_path):
    """The layer store and the tuner's cache are keyed by the fingerprint: weights copied over a folder model's
    file in place (the folder's own size and mtime unchanged) give a new key, so a stale store is never served."""
    import os

    from safetensors.torch import save_file

    from onn.models.load import model_fingerprint

    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    weights = folder / "model.safetensors"
    save_file({"w": torch.zeros(4, 4)}, str(weights))
    cfg = language_model(source=str(folder))
    before, folder_stat = model_fingerprint(cfg), folder.stat()
    with open(weights, "r+b") as f:  # new weights of the same size, written over the old file
        f.seek(weights.stat().st_size - 4)
        f.write(b"\x00\x00\x80\x3f")
    mtime = weights.stat().st_mtime_ns + 1_000_000_000
    os.utime(weights, ns=(mtime, mtime))
    os.utime(folder, ns=(folder_stat.st_atime_ns, folder_stat.st_mtime_ns))
    assert folder.stat().st_size == folder_stat.st_size and model_fingerprint(cfg) != before
    replaced = model_fingerprint(cfg)
    (folder / "tokenizer.json").write_text("{}")  # not weights: the store stays
    assert model_fingerprint(cfg) == replaced
    os.utime(folder / "config.json", ns=(mtime, mtime))
    assert model_fingerprint(cfg) != replaced
    random = language_model(architecture=LLAMA)
    assert model_fingerprint(random) == model_fingerprint(random)
    builder = tmp_path / "mine.py"
    builder.write_text("def build(): ...\n")
    built = language_model(source=f"{builder}:build")
    first = model_fingerprint(built)
    os.utime(builder, ns=(mtime, mtime))  # the builder edited: its weights may be others
    assert model_fingerprint(built) != first
