"""The model area's second review (onn/models): a QLoRA base from a folder whose weights lack layers is refused as
the resident load refuses it, a Hugging Face folder's own weights file (a shard, or model.safetensors beside its
config.json) given as model.source is that folder's model, shards without their index are one sentence, and the
recurrent LM trains and generates under float16 autocast on a CPU."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import compose, tiny_llama

from onn.errors import UserError
from onn.models.load import architecture, load, load_4bit
from onn.models.tokenizer import byte_tokenizer
from onn.models.zoo.recurrent_lm import RecurrentLMConfig, RecurrentLMForCausalLM


def saved_llama(folder, layers: int = 2, **save) -> torch.nn.Module:
    """A tiny Llama saved as a Hugging Face folder, with the byte tokenizer beside it."""
    model = tiny_llama(num_hidden_layers=layers, vocab_size=259)  # the byte tokenizer gives ids up to 258
    model.save_pretrained(folder, **save)
    byte_tokenizer().save_pretrained(folder)
    return model


def folder_config(source):
    return compose("model=llama_tiny", f"model.source={source}", "model.architecture=null", "model.tokenizer=null")


def same_weights(want: torch.nn.Module, got: torch.nn.Module) -> None:
    for (name, a), b in zip(want.state_dict().items(), got.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_a_qlora_base_whose_folder_lacks_layers_is_refused_as_the_resident_load_refuses_it(tmp_path):
    """load_4bit read a folder whose weights lack the layers its config.json describes with those layers random
    (transformers printed a table), and QLoRA trained adapters over them; load() refused the same folder."""
    pytest.importorskip("bitsandbytes")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    whole = tmp_path / "whole"
    saved_llama(whole)
    base, tokenizer = load_4bit(folder_config(whole).model, torch.float32, tmp_path / "cache", device)
    assert tokenizer is not None and base.model.layers[1].mlp.up_proj.weight.dtype == torch.uint8  # quantized
    partial = tmp_path / "partial"
    saved_llama(partial)
    config = json.loads((partial / "config.json").read_text())
    (partial / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    said = r"its weights lack 9 tensors its config\.json describes \(model\.layers\.2\."
    with pytest.raises(UserError, match=said):
        load(folder_config(partial).model)
    with pytest.raises(UserError, match=said):
        load_4bit(folder_config(partial).model, torch.float32, tmp_path / "cache", device)


def test_a_shard_file_given_as_model_source_is_its_folders_model(tmp_path):
    """model.source=.../model-00002-of-0000N.safetensors was read as a bare file: refused as needing a
    model.architecture, or, with one, as missing most of its tensors. A Hugging Face user means the folder's model."""
    model = saved_llama(tmp_path, max_shard_size="20KB")
    shards = sorted(tmp_path.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2
    cfg = folder_config(shards[1])
    assert architecture(cfg.model).num_hidden_layers == 2  # the planner reads the folder's config.json
    loaded, tokenizer = load(cfg.model)
    same_weights(model, loaded)
    assert tokenizer.decode(tokenizer("hi")["input_ids"]).endswith("hi")  # the folder's own tokenizer
    (tmp_path / "model.safetensors.index.json").unlink()
    with pytest.raises(UserError, match=rf"holds {len(shards)} shard\(s\) .* lacks model\.safetensors\.index\.json;"):
        load(cfg.model)
    shards[-1].unlink()
    with pytest.raises(UserError, match=rf"lacks model\.safetensors\.index\.json and 1 of the {len(shards)} shards"):
        load(cfg.model)


def test_model_safetensors_beside_its_config_json_is_its_folders_model(tmp_path):
    """model.source=folder/model.safetensors asked for a model.architecture that the config.json beside it gives;
    a .safetensors file that is not a folder's own (any other name, or no config.json) is still a bare file."""
    model = saved_llama(tmp_path / "hf")
    loaded, _ = load(folder_config(tmp_path / "hf" / "model.safetensors").model)
    same_weights(model, loaded)
    (tmp_path / "hf" / "model.safetensors").rename(tmp_path / "hf" / "weights.safetensors")
    with pytest.raises(UserError, match=r"is a bare \.safetensors file; add model\.architecture"):
        load(folder_config(tmp_path / "hf" / "weights.safetensors").model)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_the_recurrent_lm_trains_and_generates_under_float16_autocast_on_a_cpu(cell):
    """Under torch.autocast('cpu', float16) the LSTM failed in oneDNN (`could not create a primitive descriptor for
    the LSTM forward propagation primitive`): the recurrence now runs in float32 there, as on CUDA."""
    torch.manual_seed(0)
    model = RecurrentLMForCausalLM(RecurrentLMConfig(hidden_size=16, cell=cell, dropout=0.0))
    ids = torch.randint(0, 256, (2, 7))
    mask = torch.ones_like(ids)
    mask[0, 5:] = 0
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(torch.isfinite(p.grad).all() for p in model.parameters()) and losses[-1] < losses[0]
    model.eval()
    with torch.autocast("cpu", dtype=torch.float16):
        out = model.generate(ids[:, :3], attention_mask=mask[:, :3], max_new_tokens=4, do_sample=False)
    assert out.shape == (2, 7)
