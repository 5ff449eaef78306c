"""export=safetensors: a Hugging Face folder with LoRA merged, loaded by transformers, computes what
ONN computes; a streamed model is exported from its layer store a block at a time; the adapter alone
round-trips through peft; a failed export damages nothing."""

from __future__ import annotations

import copy
import json
import logging
import weakref
from pathlib import Path

import pytest
import torch
from conftest import compose
from safetensors.torch import load_file

from onn.errors import UserError
from onn.export.hf import merged_model, save_adapter, save_folder

PROMPTS = ["What is 2 + 2?", "Hello there", "abc"]
SHARD = 100_000  # bytes: less than one llama_tiny block (~184 kB), so blocks span shards


def build_model(tmp: Path, *overrides: str):
    """The CausalLM module and tokenizer that train/infer build, with LoRA B set to random values
    (a fresh adapter is zero, which would make every merge a no-op)."""
    from onn.hardware.profile import resolve
    from onn.modalities.text.tasks import build
    from onn.planning.plan import make_plan
    from onn.planning.spec import model_spec

    cfg = compose("model=llama_tiny", "hardware=cpu_16gb", "tracking=none", *overrides, root=tmp)
    plan = make_plan(cfg, resolve(cfg.hardware, tmp / "cache", tmp), model_spec(cfg.model, 8))
    module, tokenizer = build(cfg, plan)
    g = torch.Generator().manual_seed(1)
    for name, p in module.model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.1, generator=g)
    return cfg, plan, module, tokenizer


def streamed_model(tmp: Path, *overrides: str):
    """As task=infer builds a streamed sparse_lora model: blocks loaded straight into a disk store,
    embeddings and head streamed too (edges=stream)."""
    from onn.modalities.text.tasks import streaming_settings
    from onn.streaming.strategy import build_engine

    cfg, plan, module, tokenizer = build_model(
        tmp,
        "strategy=sparse_lora",
        "strategy.layers=[0,1,-1]",
        "strategy.streaming.store=disk",
        "strategy.streaming.chunk_size=3",
        "strategy.streaming.edges=stream",
        *overrides,
    )
    engine = build_engine(module.model, streaming_settings(cfg, plan), module.store, "cpu", micro_batch=None)
    return module, tokenizer, engine


@pytest.fixture(scope="module")
def streamed(tmp_path_factory):
    return streamed_model(tmp_path_factory.mktemp("streamed"))


@pytest.fixture(scope="module")
def resident(tmp_path_factory):
    cfg, _, module, tokenizer = build_model(tmp_path_factory.mktemp("resident"), "strategy=lora")
    return cfg, module, tokenizer


def batch(tokenizer):
    tokenizer.padding_side = "left"
    return dict(tokenizer(PROMPTS, return_tensors="pt", padding=True))


def streamed_logits(engine, inputs):
    """The logits of ONN's streamed forward (the engine's chunk-outer pass, then the model's suffix)."""
    _, _, hidden = engine._forward([inputs], keep_from=None)
    with torch.no_grad(), engine._edges_loaded("suffix"):
        logits = engine.suffix(hidden[0], inputs).logits
    engine.release()
    return logits


def read_folder(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def test_streamed_export_loads_in_transformers_and_generates_what_onn_infer_does(streamed, tmp_path):
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from onn.modalities.text.generate import complete

    module, tokenizer, engine = streamed
    live = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    out = save_folder(module.model, tokenizer, tmp_path / "hf", engine=engine, max_shard_size=SHARD)
    folder = tmp_path / "hf"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert out["export/shards"] == len(shards) >= 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(index["weight_map"].values()) == set(shards) and out["export/folder"] == str(folder)
    tensors = read_folder(folder)
    assert set(index["weight_map"]) == set(tensors) and index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in tensors.values()
    )
    assert not [n for n in tensors if "lora_" in n or "base_layer" in n or n.startswith("base_model")]
    # block 0 has an adapter: its merged weight differs from the stored one; block 3 has none: equal
    block = {i: engine.store.decode(engine.store.read(i), torch.device("cpu"), torch.float32) for i in (0, 3)}
    assert not torch.equal(tensors["model.layers.0.self_attn.q_proj.weight"], block[0]["self_attn.q_proj.weight"])
    assert torch.equal(tensors["model.layers.3.mlp.down_proj.weight"], block[3]["mlp.down_proj.weight"])

    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    hf_tokenizer = AutoTokenizer.from_pretrained(folder)
    assert not any(isinstance(m, LoraLayer) for m in hf.modules())
    # the infer path: ONN's streamed generation vs transformers' generate on the exported folder
    want = complete(module.model, tokenizer, PROMPTS, max_new_tokens=8, engine=engine)
    assert complete(hf, hf_tokenizer, PROMPTS, max_new_tokens=8) == want and any(want)
    inputs = batch(tokenizer)
    got = hf.generate(
        **inputs,
        max_new_tokens=8,
        min_new_tokens=8,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
    )[:, inputs["input_ids"].shape[1] :]
    assert torch.equal(got, engine.generate(inputs["input_ids"], inputs["attention_mask"], max_new_tokens=8))
    with torch.no_grad():
        logits = hf(**inputs).logits
        torch.testing.assert_close(logits, streamed_logits(engine, inputs), atol=1e-5, rtol=0)
        # the resident merged model the ONNX exporter uses computes the same
        merged = merged_model(module, engine)
        assert not any(isinstance(m, LoraLayer) for m in merged.modules())
        torch.testing.assert_close(merged(**inputs).logits, logits, atol=1e-6, rtol=0)
    # the live model is untouched: same adapters, blocks still empty placeholders
    for name, p in module.model.named_parameters():
        assert torch.equal(p, live[name]), name
    assert all(p.numel() == 0 for p in engine.map.blocks[3].parameters())


def test_streamed_export_reads_the_store_one_block_at_a_time(streamed, tmp_path, monkeypatch):
    """Each block is read once, in order, and when the next is read nothing of the earlier ones is
    alive beyond what the shard being filled holds."""
    module, tokenizer, engine = streamed
    store = engine.store
    reads, alive_at_read, decoded = [], [], []
    read, decode = store.read, store.decode

    def spy_read(index):
        refs = [r() for r in decoded]
        alive_at_read.append(sum(t.numel() * t.element_size() for t in refs if t is not None))
        del refs
        reads.append(index)
        return read(index)

    def spy_decode(*args, **kwargs):
        out = decode(*args, **kwargs)
        decoded.extend(weakref.ref(t) for t in out.values())
        return out

    monkeypatch.setattr(store, "read", spy_read)
    monkeypatch.setattr(store, "decode", spy_decode)
    save_folder(module, tokenizer, tmp_path / "hf", engine=engine, max_shard_size=SHARD)
    assert reads == ["edges", *range(8), "edges"]
    block_bytes = sum(t.numel() * 4 for t in read(0).values())
    assert block_bytes > SHARD  # so holding a whole earlier block would fail the next check
    assert max(alive_at_read) <= SHARD, alive_at_read


def test_quantized_store_exports_dequantized_weights_and_says_so(tmp_path, caplog):
    from transformers import AutoModelForCausalLM

    module, tokenizer, engine = streamed_model(tmp_path, "strategy.streaming.store_dtype=int8")
    with caplog.at_level(logging.INFO, logger="onn"):
        save_folder(module, tokenizer, tmp_path / "hf", engine=engine)
    assert any("int8" in r.message and "float32" in r.message for r in caplog.records)
    assert (tmp_path / "hf" / "model.safetensors").is_file()  # one shard at the default 2GB
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert all(p.dtype == torch.float32 for p in hf.parameters())
    inputs = batch(tokenizer)
    with torch.no_grad():
        torch.testing.assert_close(hf(**inputs).logits, streamed_logits(engine, inputs), atol=1e-5, rtol=0)


@pytest.mark.parametrize("tied", [False, True])
def test_resident_lora_export_equals_peft_merge_and_unload(resident, tmp_path, tied):
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM

    if tied:
        _, _, module, tokenizer = build_model(tmp_path, "strategy=lora", "model.architecture.tie_word_embeddings=true")
    else:
        _, module, tokenizer = resident
    live = {n: t.clone() for n, t in module.model.state_dict().items()}
    want = copy.deepcopy(module.model).merge_and_unload().state_dict()
    save_folder(module, tokenizer, tmp_path / "hf")
    assert sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors")) == ["model.safetensors"]
    got = read_folder(tmp_path / "hf")
    assert set(got) == set(want) - ({"lm_head.weight"} if tied else set())
    for name, tensor in got.items():
        assert torch.equal(tensor, want[name]), name
    base = {n.removeprefix("base_model.model.").replace(".base_layer.", "."): t for n, t in live.items()}
    assert not torch.equal(
        got["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"]
    )
    # the live model is not merged or changed
    assert any(isinstance(m, LoraLayer) for m in module.model.modules())
    assert all(torch.equal(t, live[n]) for n, t in module.model.state_dict().items())
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert hf.lm_head.weight is hf.model.embed_tokens.weight if tied else "lm_head.weight" in got
    inputs = batch(tokenizer)
    with torch.no_grad():
        torch.testing.assert_close(hf(**inputs).logits, module.model(**inputs).logits, atol=1e-5, rtol=0)


def test_adapter_round_trips_through_peft(resident, tmp_path):
    from peft import PeftModel

    from onn.models.load import load

    cfg, module, tokenizer = resident
    out = save_adapter(module, tokenizer, tmp_path / "adapter")
    files = {p.name for p in (tmp_path / "adapter").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files and out["export/adapter_files"] == len(files)
    base, _ = load(cfg.model)  # the same random base, rebuilt from the model config
    loaded = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    inputs = batch(tokenizer)
    with torch.no_grad():
        assert torch.equal(loaded(**inputs).logits, module.model.eval()(**inputs).logits)
    plain = loaded.merge_and_unload()
    with pytest.raises(UserError, match="LlamaForCausalLM has no LoRA adapter to save; strategy=lora"):
        save_adapter(plain, tokenizer, tmp_path / "none")


def test_bad_outputs_and_a_failed_export_damage_nothing(resident, tmp_path, monkeypatch):
    import safetensors.torch

    _, module, tokenizer = resident
    missing = tmp_path / "no" / "such" / "hf"
    with pytest.raises(UserError, match=f"export output {missing}: its folder {missing.parent} does not exist"):
        save_folder(module, tokenizer, missing)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(UserError, match="exists and is not an earlier export"):
        save_folder(module, tokenizer, tmp_path / "notes")
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine"
    with pytest.raises(UserError, match="export.max_shard_size='lots'"):
        save_folder(module, tokenizer, tmp_path / "hf", max_shard_size="lots")

    folder = tmp_path / "hf"
    save_folder(module, tokenizer, folder, max_shard_size=SHARD)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    calls = []
    real = safetensors.torch.save_file

    def failing(*args, **kwargs):  # the disk fills up while the third shard is written
        calls.append(1)
        if len(calls) == 3:
            raise OSError("No space left on device (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", failing)
    with pytest.raises(OSError, match="simulated"):
        save_folder(module, tokenizer, folder, max_shard_size=SHARD)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "notes"]  # no temporary folder left behind
    monkeypatch.undo()
    save_folder(module, tokenizer, folder)  # a later export replaces the earlier one whole
    assert sorted(p.name for p in folder.glob("*.safetensors")) == ["model.safetensors"]


def test_an_export_replaces_or_removes_the_adapter_beside_its_folder(resident, tmp_path, monkeypatch):
    """hf-adapter/ always belongs to the weights in hf/: a later export of a model without an adapter removes an
    earlier export's, and one whose folder fails to write leaves both folders as they were."""
    import safetensors.torch

    from onn.config.export import SafetensorsExport
    from onn.export import export_model

    _, module, tokenizer = resident
    settings = SafetensorsExport(name="safetensors", output=None, max_shard_size="2GB", adapter=True)
    metrics = export_model(module, tmp_path / "hf", None, settings, tokenizer=tokenizer)
    assert metrics["export/adapter"] == str(tmp_path / "hf-adapter")
    assert (tmp_path / "hf-adapter" / "adapter_config.json").is_file()
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}

    def failing(*args, **kwargs):
        raise OSError("No space left on device (simulated)")

    monkeypatch.setattr(safetensors.torch, "save_file", failing)
    with pytest.raises(OSError, match="simulated"):
        export_model(module, tmp_path / "hf", None, settings, tokenizer=tokenizer)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before  # no temp folder either
    monkeypatch.undo()
    export_model(merged_model(module), tmp_path / "hf", None, settings, tokenizer=tokenizer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # the earlier adapter is gone with its weights


def test_a_folder_of_the_users_own_is_never_taken_for_an_earlier_export(resident, tmp_path):
    """Only a folder an export wrote (it holds onn_export.json) is replaced whole: a Hugging Face folder of the
    user's own (its config.json, their notes, an eval_results/ folder) is refused and left as it was, and so is an
    adapter folder of theirs beside it, where an export of a model without an adapter removes an earlier export's."""
    from dataclasses import replace

    from onn.config.export import SafetensorsExport
    from onn.export import export_model
    from onn.export.settings import check_settings

    _, module, tokenizer = resident

    def tree(folder: Path) -> dict[str, bytes | None]:
        return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in folder.rglob("*")}

    mine = tmp_path / "hf"
    (mine / "eval_results").mkdir(parents=True)
    (mine / "config.json").write_text('{"model_type": "llama"}')
    (mine / "NOTES.md").write_text("mine")
    before = tree(mine)
    with pytest.raises(UserError, match=rf"export output {mine} exists and is not an earlier export \(no onn_export"):
        save_folder(module, tokenizer, mine)
    with pytest.raises(UserError, match=rf"export output {mine} exists and is not an earlier export"):
        check_settings(replace(compose("export=safetensors").export, output=str(mine)))  # before any training
    assert tree(mine) == before

    settings = SafetensorsExport(name="safetensors", output=None, max_shard_size="2GB", adapter=True)
    plain = merged_model(module)  # no adapter: its export removes an earlier export's adapter folder only
    theirs = tmp_path / "out-adapter"  # the user's own adapter, where an export to out/ puts one
    theirs.mkdir()
    (theirs / "adapter_config.json").write_text("{}")
    export_model(plain, tmp_path / "out", None, settings, tokenizer=tokenizer)
    assert (theirs / "adapter_config.json").read_text() == "{}"
    export_model(module, tmp_path / "export", None, settings, tokenizer=tokenizer)  # hf and its adapter
    assert (tmp_path / "export-adapter" / "onn_export.json").is_file()
    export_model(plain, tmp_path / "export", None, settings, tokenizer=tokenizer)
    assert not (tmp_path / "export-adapter").exists()
    assert json.loads((tmp_path / "export" / "onn_export.json").read_text())["kind"] == "hf"


def test_an_onn_zoo_models_folder_loads_in_transformers_as_the_docs_say(tmp_path):
    """docs/export.md: a zoo architecture of ONN's own (char_lstm's onn_recurrent_lm) is not one transformers
    knows; the call the docs name registers it, and the exported folder then loads and computes what ONN does."""
    from transformers import AutoModelForCausalLM

    from onn.models.load import load, register_zoo_models

    docs = " ".join((Path(__file__).resolve().parents[1] / "docs" / "export.md").read_text().split())
    assert "from onn.models.load import register_zoo_models" in docs and "onn_recurrent_lm" in docs
    cfg = compose("model=char_lstm", "model.architecture.hidden_size=16", root=tmp_path)
    model, tokenizer = load(cfg.model)
    save_folder(model.eval(), tokenizer, tmp_path / "hf")
    register_zoo_models()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=1e-6, rtol=0)
