"""A streamed network's precision (strategy=sparse_lora on a recurrent stack or a DiT) is chosen as a resident
network's is: bf16-mixed on a bf16 GPU (16-mixed on one without), strategy.precision honoured where given, and its
activations sized at 2 bytes under a half precision. It was 32-true whatever the config or the machine said."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml
from conftest import compose

STREAMED = ("recipe=fsdd_lstm", "strategy=sparse_lora", "strategy.layers=all", "model.kwargs.dropout=0")


def streamed_plan(tmp: Path, *overrides: str):
    """The audio LSTM stack's streamed plan for the hardware preset and precision `overrides` name."""
    from onn.hardware.profile import resolve
    from onn.modalities import get

    cfg = compose(*STREAMED, *overrides, root=tmp)
    plan, _ = get("audio").plan(cfg, resolve(cfg.hardware, tmp / "cache", tmp))
    return plan


def test_a_streamed_network_on_a_gpu_plans_half_precision_and_half_the_activations(tmp_path):
    """On an A100 (bf16) strategy.precision=auto gives bf16-mixed, its blocks computing in bfloat16 and its
    activations half of 32-true's, which strategy.precision=32-true still gets. The plan says which and why."""
    mixed = streamed_plan(tmp_path, "hardware=a100_80gb", "strategy.precision=auto")
    full = streamed_plan(tmp_path, "hardware=a100_80gb", "strategy.precision=32-true")
    assert mixed.precision == "bf16-mixed" and mixed.streaming.compute_dtype == "bfloat16"
    assert any(r.startswith("precision bf16-mixed: the GPU runs bf16 fast") for r in mixed.reasons)
    assert full.precision == "32-true" and full.streaming.compute_dtype == "float32"  # asked for: honoured
    assert any(r.startswith("precision 32-true: strategy.precision=32-true was asked for") for r in full.reasons)
    half_mb, full_mb = (p.candidates["sparse_lora"]["activations_mb"] for p in (mixed, full))
    assert 0 < half_mb < full_mb and half_mb == pytest.approx(full_mb / 2, abs=0.1)


def test_a_gpu_without_bf16_plans_16_mixed_and_a_cpu_honours_bf16_mixed(tmp_path):
    """A GTX 1650 (no bf16) streams under 16-mixed; on a CPU strategy.precision=bf16-mixed is honoured (it was
    replaced by 32-true without a word), the store still float32, and auto stays 32-true even with bf16 units."""
    turing = streamed_plan(tmp_path, "hardware=gtx1650_4gb", "strategy.precision=auto")
    assert turing.precision == "16-mixed" and turing.streaming.compute_dtype == "float16"
    asked = streamed_plan(tmp_path, "hardware=cpu_16gb", "strategy.precision=bf16-mixed")
    assert asked.precision == "bf16-mixed" and asked.streaming.compute_dtype == "bfloat16"
    assert asked.streaming.store_dtype == "float32"
    default = streamed_plan(tmp_path, "hardware=cpu_16gb", "hardware.bf16=true", "strategy.precision=auto")
    assert default.precision == "32-true" and default.streaming.compute_dtype == "float32"  # bf16 units or not


@pytest.mark.slow  # about 13 s on two shared cores: the runner's whole train, validate and test
def test_a_streamed_lstm_trains_two_steps_under_bf16_mixed_on_a_cpu(tmp_path):
    """The layer-streaming engine runs an LSTM stack's blocks under bf16-mixed on a CPU (Lightning's autocast in the
    forward, the engine's own in the backward's recompute): two steps, a finite loss that moved, a bf16 plan."""
    from test_audio import make_tones

    from onn.app import execute

    data = make_tones(tmp_path / "tones", per_class=4)
    cfg = compose(
        *STREAMED,
        *("tracking=none", f"paths.outputs={tmp_path / 'outputs'}", f"paths.cache={tmp_path / 'cache'}"),
        *("hardware=cpu_16gb", "strategy.precision=bf16-mixed", "trainer.enable_progress_bar=false"),
        *(f"data.source={data}", "data.label_from='^([a-z]+)_'", "data.classes=null", "data.test_pattern=_bob_"),
        *("data.clip_seconds=0.4", "data.batch_size=8", "data.val_split=0.2", "data.features.top_db=50"),
        *("model.kwargs.hidden=12", "model.kwargs.layers=2", "model.kwargs.conv_widths=[8,16]"),
        *("trainer.max_steps=2", "optim.schedule=constant", "optim.lr=0.3"),
    )
    metrics = execute(cfg, tmp_path / "run")
    plan = yaml.safe_load((tmp_path / "run" / "plan.yaml").read_text())
    assert plan["precision"] == "bf16-mixed" and plan["streaming"]["compute_dtype"] == "bfloat16"
    assert metrics["strategy"] == "sparse_lora" and metrics["steps"] == 2
    first, last = metrics["train/loss_initial"], metrics["train/loss_final"]
    assert math.isfinite(first) and math.isfinite(last) and first != last
