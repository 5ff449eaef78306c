"""Streaming engine fixes: a streamed network's blocks keep Lightning's mixed precision, a validation set that fits
is one pass, an all-padding validation row is skipped as the resident loss skips it, and task=infer's engine leaves
no loader thread behind."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from conftest import compose, execute_run
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

from onn.hardware.profile import resolve
from onn.models.layers import discover
from onn.streaming.engine import StreamingEngine
from onn.streaming.store import LayerStore
from onn.streaming.strategy import build_engine, layer_store
from onn.training.trainer import engine_settings


def lora_llama() -> torch.nn.Module:
    """A 4-block float32 Llama with LoRA on blocks 0 and 3: blocks 1 and 2 are frozen, so they stream."""
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        "llama", vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
    )  # fmt: skip
    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], layers_to_transform=[0, 3],
        layers_pattern="layers", lora_dropout=0.0, init_lora_weights=False,
    )  # fmt: skip
    return get_peft_model(AutoModelForCausalLM.from_config(cfg), lora).float()


def batch(rows: int = 5, width: int = 9, seed: int = 1) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 97, (rows, width), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    labels = ids.clone()
    labels[:, :4] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def held_out() -> list[dict[str, torch.Tensor]]:
    """Right-padded validation batches of varied lengths, as the text datamodule collates them."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(4):
        ids = torch.randint(3, 97, (2, 12), generator=g)
        mask = torch.ones_like(ids)
        for r, length in enumerate((12 - 2 * i, 11 - 2 * i)):
            mask[r, length:] = 0
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out


def resident_loss(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> float:
    """The token-weighted mean loss the resident model gives the batches."""
    total = count = 0
    with torch.no_grad():
        for b in batches:
            n = int((b["labels"][:, 1:] != -100).sum())
            total, count = total + float(model(**b).loss) * n, count + n
    return total / count


def streaming(model: torch.nn.Module) -> StreamingEngine:
    engine = StreamingEngine(model, discover(model), LayerStore("cpu", "float32"), 2, micro_batch=2, eval_tokens=None)
    engine.offload()
    return engine


def test_a_validation_set_without_a_budget_loads_each_chunk_once():
    """With no eval_tokens the pass was sized by the rows' real lengths but packed by their padded size, so a set
    that fits split into passes and every chunk loaded two or more times."""
    resident = lora_llama().eval()
    engine = streaming(copy.deepcopy(resident).eval())
    batches = held_out()
    try:
        total, count = engine.evaluate(batches)
    finally:
        engine.close()
    assert engine.times.history == list(range(len(engine.chunks)))
    assert total / count == pytest.approx(resident_loss(resident, batches), rel=1e-5)


def test_an_all_padding_validation_row_is_skipped_as_the_resident_loss_skips_it():
    """A row of padding alone (an empty sample) was cut to no tokens and grouped alone at width 0, and the blocks
    failed to reshape it: streamed validation crashed."""
    resident = lora_llama().eval()
    engine = streaming(copy.deepcopy(resident).eval())
    batches = held_out()
    batches[1]["attention_mask"][1] = 0
    batches[1]["labels"][1] = -100
    try:
        for group_tokens in (None, 9):
            total, count = engine.evaluate(batches, group_tokens=group_tokens)
            assert total / count == pytest.approx(resident_loss(resident, batches), rel=1e-5)
    finally:
        engine.close()


def test_a_streamed_networks_blocks_compute_in_lightnings_bf16_autocast(tmp_path):
    """Lightning runs a bf16-mixed network inside torch.autocast; the engine built from engine_settings wrapped each
    chunk in autocast(enabled=False), so its blocks' matmuls ran in float32 where the resident model's ran in bf16."""
    from onn.modalities import get

    cfg = compose("recipe=fsdd_lstm", "hardware=cpu_16gb", "strategy=sparse_lora", "strategy.layers=all",
                  "model.kwargs.dropout=0", "strategy.precision=bf16-mixed", root=tmp_path)  # fmt: skip
    plan, _ = get("audio").plan(cfg, resolve(cfg.hardware, tmp_path / "cache", tmp_path))
    assert plan.precision == "bf16-mixed"  # strategy.precision honoured (it was planned as 32-true)
    settings = engine_settings(cfg, plan)
    resident = lora_llama()
    streamed = copy.deepcopy(resident)
    seen: dict[str, list[torch.dtype]] = {"resident": [], "streamed": []}
    for name, model in (("resident", resident), ("streamed", streamed)):
        down = model.base_model.model.model.layers[1].mlp.down_proj  # a frozen, streamed block's matmul
        down.register_forward_hook(lambda m, i, o, name=name: seen[name].append(o.dtype))
    b = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # what Lightning's bf16-mixed wraps training_step in
        resident(**b).loss.backward()
    engine = build_engine(streamed, settings, layer_store(settings, tmp_path / "store"), "cpu", micro_batch=2)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            engine.train_step(engine.split(b))
    finally:
        engine.close()
    assert seen["resident"] == [torch.bfloat16]
    assert seen["streamed"] and set(seen["streamed"]) == {torch.bfloat16}


def loader_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("onn-prefetch") and t.is_alive()}


def test_infer_through_the_streaming_engine_leaves_no_loader_thread(tmp_path, monkeypatch):
    """task=infer's engine was never closed: its loader threads (and read buffers) lived as long as the engine did.
    The engine is held here (as a caller of the task may hold the model), so only close() ends its threads."""
    from onn.modalities.text import tasks

    built = []

    def language_model(job, checked=True):
        built.append(real(job, checked))
        return built[-1]

    real = tasks.language_model
    monkeypatch.setattr(tasks, "language_model", language_model)
    before = loader_threads()
    metrics = execute_run(tmp_path, tmp_path / "cache", "task=infer", "strategy=sparse_lora", "prompt=Once upon",
                          "task.max_new_tokens=3", "strategy.streaming.store=disk", "strategy.streaming.chunk_size=1",
                          "strategy.streaming.cache_blocks=0", name="infer")  # fmt: skip
    engine = built[0].engine
    assert "infer/completion" in metrics and engine is not None and engine.times.loads > 0
    assert loader_threads() - before == set()
