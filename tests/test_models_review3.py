"""The model area's third review (onn/models): pickle weights that transformers reads beside a folder's safetensors
(the file config.json names, a peft adapter) are refused unread, a truncated shard, a config.json transformers cannot
read and an unknown model_type are each one sentence, model.tokenizer naming no tokenizer says so, a layer map
override naming no blocks is refused, and a relative model.source is read from where run.py started under
hydra.job.chdir=true."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from conftest import compose, run_cli, tiny_llama

from onn.errors import UserError
from onn.models.layers import discover
from onn.models.load import architecture, finish_tokenizer, load
from onn.models.tokenizer import byte_tokenizer


def saved_llama(folder, **save) -> torch.nn.Module:
    """A tiny Llama saved as a Hugging Face folder, with the byte tokenizer beside it."""
    model = tiny_llama(vocab_size=259)  # the byte tokenizer gives ids up to 258
    model.save_pretrained(folder, **save)
    byte_tokenizer().save_pretrained(folder)
    return model


def folder_config(source, *overrides: str):
    return compose(
        "model=llama_tiny", f"model.source={source}", "model.architecture=null", "model.tokenizer=null", *overrides
    ).model


def edit_config_json(folder, **values) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **values}))


def test_a_pickle_weights_file_named_by_config_json_is_refused_unread(tmp_path):
    """config.json's transformers_weights may name adapter_model.bin, which transformers then unpickled (torch.load)
    in place of the folder's model.safetensors, use_safetensors=True notwithstanding."""
    model = saved_llama(tmp_path)
    other = {name: torch.zeros_like(t) for name, t in model.state_dict().items()}
    torch.save(other, tmp_path / "adapter_model.bin")  # written here only: ONN must never read it
    edit_config_json(tmp_path, transformers_weights="adapter_model.bin")
    with pytest.raises(UserError, match=r"config\.json names its weights file adapter_model\.bin .*not safetensors"):
        load(folder_config(tmp_path))
    edit_config_json(tmp_path, transformers_weights="model.safetensors")  # a safetensors file it names is read
    loaded, _ = load(folder_config(tmp_path))
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


def test_a_pickle_peft_adapter_beside_the_folders_model_is_refused_unread(tmp_path):
    """A folder with adapter_config.json: transformers loads the model, then peft's adapter from adapter_model.bin
    (a pickle) when there is no adapter_model.safetensors, and applies it without a word."""
    from peft import LoraConfig, get_peft_model

    saved_llama(tmp_path)
    adapted = get_peft_model(tiny_llama(), LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
    adapted.save_pretrained(tmp_path, safe_serialization=False)
    assert (tmp_path / "adapter_model.bin").is_file() and not (tmp_path / "adapter_model.safetensors").exists()
    with pytest.raises(UserError, match=r"holds a pickle adapter \(adapter_model\.bin\)"):
        load(folder_config(tmp_path))


@pytest.mark.parametrize("sharded", [True, False])
def test_a_truncated_weights_file_is_one_sentence_naming_it(tmp_path, sharded):
    """An interrupted copy leaves a shard (or model.safetensors) short: a bare SafetensorError from inside
    transformers. The sentence names the file."""
    saved_llama(tmp_path, **({"max_shard_size": "20KB"} if sharded else {}))
    files = sorted(tmp_path.glob("model-*-of-*.safetensors")) if sharded else [tmp_path / "model.safetensors"]
    cut = files[len(files) // 2]
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size - 100])
    with pytest.raises(UserError, match=rf"model\.source {cut} is not a readable safetensors file \(truncated"):
        load(folder_config(tmp_path))


def test_a_folder_whose_safetensors_are_not_a_transformers_models_is_one_sentence(tmp_path):
    """Mistral's consolidated.safetensors (or an adapter's file) without model.safetensors: a bare OSError."""
    saved_llama(tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "consolidated.safetensors")
    with pytest.raises(UserError, match=r"has no model\.safetensors \(nor a shard index\), only consolidated"):
        load(folder_config(tmp_path))


def test_a_config_json_transformers_cannot_read_is_one_sentence(tmp_path):
    """A model type this transformers does not know, a config.json without model_type, and one that is not JSON
    were bare ValueErrors and OSErrors (the first listing every model type on one line), planning or loading."""
    saved_llama(tmp_path)
    edit_config_json(tmp_path, model_type="llama9")
    cfg = folder_config(tmp_path)
    said = r"config\.json names model_type 'llama9', which transformers .* does not know; upgrade transformers"
    with pytest.raises(UserError, match=said):
        architecture(cfg)  # what task=plan reads
    with pytest.raises(UserError, match=said):
        load(cfg)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["model_type"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=r"config\.json has no model_type"):
        load(cfg)
    (tmp_path / "config.json").write_text('{"model_type": "llama",')
    with pytest.raises(UserError, match=r"config\.json is not a JSON object"):
        load(cfg)


def test_an_unknown_model_architecture_model_type_is_one_sentence():
    with pytest.raises(UserError, match=r"model\.architecture\.model_type=lama of 'llama_tiny' .*did you mean llama"):
        architecture(compose("model=llama_tiny", "model.architecture.model_type=lama").model)


def test_model_tokenizer_naming_no_tokenizer_says_so(tmp_path):
    """model.tokenizer=a folder that is not there (or holds no tokenizer) said the model had no tokenizer, and to
    set model.tokenizer, which the user had set."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"model\.tokenizer=.*/nowhere loads no tokenizer \(no such folder"):
        load(compose("model=llama_tiny", f"model.tokenizer={tmp_path / 'nowhere'}").model)
    with pytest.raises(UserError, match=r"model\.tokenizer=.*/empty loads no tokenizer \(the folder holds none\)"):
        load(compose("model=llama_tiny", f"model.tokenizer={tmp_path / 'empty'}").model)
    byte_tokenizer().save_pretrained(tmp_path / "bytes")
    _, tokenizer = load(compose("model=llama_tiny", f"model.tokenizer={tmp_path / 'bytes'}").model)
    assert tokenizer.decode(tokenizer("héllo")["input_ids"]) == "héllo"


def test_a_layer_map_override_naming_no_blocks_is_refused():
    """model.layer_map.blocks=model.norm (a leaf) gave a LayerMap of no blocks, and the planner failed on its first
    block with a bare IndexError."""
    model = tiny_llama()
    for path in ("model.norm", "model.layers.0.mlp.down_proj", "model.rotary_emb"):
        with pytest.raises(UserError, match=rf"model\.layer_map\.blocks: '{path}' \(\w+\) holds no blocks"):
            discover(model, path)
    assert discover(model, "model.layers").block_paths == ["model.layers.0", "model.layers.1"]


@pytest.mark.slow  # a run.py process: 20-25 s on 2 cores
def test_a_relative_model_source_is_read_from_where_run_py_started_under_hydra_chdir(tmp_path):
    """hydra.job.chdir=true runs the job in its run folder: model.source=hf (a folder beside the user) was looked
    for there, and the plan said it did not exist."""
    saved_llama(tmp_path / "hf")
    overrides = ("model.architecture=null", "model.tokenizer=null", "hardware=cpu_16gb")
    done = run_cli("task=plan", "model=llama_tiny", "model.source=hf", *overrides, "hydra.job.chdir=true", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "2 x LlamaDecoderLayer" in done.stdout + done.stderr


def test_a_hub_id_model_tokenizer_in_the_local_cache_loads(tmp_path, monkeypatch):
    """model.tokenizer=org/name names a hub id: read as a path under the working directory (to_absolute_path), it
    was refused as "no such folder, nor hub id in the cache" with the tokenizer in the cache."""
    import huggingface_hub.constants

    repo = tmp_path / "hub" / "models--someorg--sometok"
    snapshot = repo / "snapshots" / "abc123"
    byte_tokenizer().save_pretrained(snapshot)
    (snapshot / "config.json").write_text('{"model_type": "llama"}')
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    model_cfg = replace(compose("model=llama_tiny").model, tokenizer="someorg/sometok")
    tokenizer = finish_tokenizer(model_cfg, None, False)
    assert tokenizer("ab")["input_ids"][-2:] == byte_tokenizer()("ab")["input_ids"][-2:]
