"""The planner's memory as a review measured it (2026-12-07): mixed-precision activations at 2 bytes an element
(autocast kept 2.78 with the norms' float32 values), "-true" precisions sized as float32, AdamW's state for every
optimizer, LoRA's target_modules and dropout ignored, and several CPU processes' "no setup fits" only printed."""

from __future__ import annotations

import pytest
from conftest import compose

from onn.hardware.profile import resolve
from onn.planning.costs import MB, MIXED_ACTIVATION_FACTOR, layer_activation_elements
from onn.planning.plan import make_plan
from onn.planning.scale import scale_plan
from onn.planning.spec import model_spec
from onn.planning.streaming import StreamShape, cpu_stream_memory


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    """llama_small (8 blocks, hidden 512) sized on the meta device, LoRA at rank 8."""
    return model_spec(compose("model=llama_small").model, 8, cache_dir=str(tmp_path_factory.mktemp("cache")))


def plan(tmp_path, spec, *overrides: str):
    cfg = compose("model=llama_small", f"paths.cache={tmp_path / 'cache'}", *overrides, root=tmp_path)
    hw = resolve(cfg.hardware, tmp_path / "cache", tmp_path)
    return make_plan(cfg, hw, spec, use_tuned=False)


GPU_FULL = ("hardware=rtx3060_12gb", "strategy=full", "strategy.micro_batch=4", "data.max_length=64")


def layer_bytes(p, spec, per_element: float) -> float:
    """A plan's block activations (MB) at `per_element` bytes: its micro-batch's tokens through every block."""
    return layer_activation_elements(spec) * spec.n_blocks * p.micro_batch * p.sequence_length * per_element / MB


def test_mixed_precision_activations_take_the_norms_float32_share(tmp_path, spec):
    """bf16-mixed keeps 2 x MIXED_ACTIVATION_FACTOR bytes per counted element (was 2: 39% low); 32-true keeps 4. The
    logits (float32 in both) are the same, so the difference is the blocks' alone."""
    mixed = plan(tmp_path, spec, *GPU_FULL, "strategy.precision=bf16-mixed")
    single = plan(tmp_path, spec, *GPU_FULL, "strategy.precision=32-true")
    difference = single.candidates["full"]["activations_mb"] - mixed.candidates["full"]["activations_mb"]
    assert difference == pytest.approx(layer_bytes(single, spec, 4 - 2 * MIXED_ACTIVATION_FACTOR), abs=0.2)


def test_cpu_stream_sizes_a_mixed_chunk_with_the_factor(tmp_path, spec):
    """A CPU stream's chunk under bf16-mixed autocast holds MIXED_ACTIVATION_FACTOR times bf16-true's block
    activations (the hidden states passed between chunks and the logits are the same)."""
    hw = resolve(compose("hardware=cpu_16gb", root=tmp_path).hardware, tmp_path / "cache", tmp_path)
    per_token = layer_activation_elements(spec)

    def activations(precision: str) -> float:
        shape = StreamShape(spec, hw, "bfloat16", 64, 2, 2, [0, 7], per_token, 0.0, precision=precision)
        return cpu_stream_memory(shape, "bfloat16", "cpu", "resident", "device", 2, 0)["activations"]

    grown = activations("bf16-mixed") - activations("bf16-true")
    assert grown == pytest.approx(per_token * 2 * 64 * 2 * 2 * (MIXED_ACTIVATION_FACTOR - 1))


def test_true_precisions_size_every_state_in_their_dtype(tmp_path, spec):
    """Lightning converts the module to a "-true" precision's dtype: weights, gradients and AdamW's two moments of
    bf16-true take 2 bytes each (planned at 4, 4 and 8), 64-true's 8 (planned at float32) with 8-byte activations."""
    params = spec.params / MB
    half = plan(tmp_path, spec, *GPU_FULL, "strategy.precision=bf16-true")
    double = plan(tmp_path, spec, *GPU_FULL, "strategy.precision=64-true")
    row = half.candidates["full"]
    assert (row["weights_mb"], row["trainable_mb"], row["optimizer_mb"]) == pytest.approx(
        (2 * params, 2 * params, 4 * params), abs=0.1
    )
    assert half.weights_dtype == "bfloat16"
    row = double.candidates["full"]
    assert (row["weights_mb"], row["trainable_mb"], row["optimizer_mb"]) == pytest.approx(
        (8 * params, 8 * params, 16 * params), abs=0.1
    )
    assert double.candidates["full"]["activations_mb"] - half.candidates["full"]["activations_mb"] == pytest.approx(
        layer_bytes(half, spec, 8 - 2), abs=0.2
    )


@pytest.mark.parametrize(("momentum", "states"), [(0.0, 0), (0.9, 1)])
def test_the_optimizer_state_is_the_configured_optimizers(tmp_path, spec, momentum, states):
    """SGD keeps one float32 buffer per weight with momentum and none without; the plan held AdamW's two for both."""
    sgd = ("optim.name=sgd", f"optim.momentum={momentum}", "optim.schedule=constant", "optim.warmup_steps=0")
    p = plan(tmp_path, spec, *GPU_FULL, "strategy.precision=32-true", *sgd)
    assert p.candidates["full"]["optimizer_mb"] == pytest.approx(4 * states * spec.params / MB, abs=0.1)
    lora = sum(spec.lora_params_per_block)
    assert p.candidates["lora"]["optimizer_mb"] == pytest.approx(4 * states * lora / MB, abs=0.05)


def test_lora_adapters_on_the_target_modules_only(tmp_path, spec):
    """target_modules=[q_proj] adapts each block's query projection (512 -> 512) alone, at rank 8: the plan sized
    every linear, the same as all-linear."""
    lora = ("hardware=rtx3060_12gb", "strategy=lora", "strategy.micro_batch=4", "data.max_length=64")
    q_only = plan(tmp_path, spec, *lora, "strategy.lora.target_modules=[q_proj]")
    every = plan(tmp_path, spec, *lora)
    adapters = 8 * (512 + 512) * spec.n_blocks
    assert q_only.candidates["lora"]["trainable_mb"] == pytest.approx(4 * adapters / MB, abs=0.05)
    assert every.candidates["lora"]["trainable_mb"] == pytest.approx(4 * sum(spec.lora_params_per_block) / MB, abs=0.05)


def test_lora_dropout_keeps_each_adapted_input(tmp_path, spec):
    """At dropout 0.1 each adapted linear keeps its dropped input (in the activations' dtype) and the one-byte mask:
    q_proj's 512 features per token and block at 4 + 1 bytes in 32-true; the plan was the same as at dropout 0."""
    lora = ("hardware=rtx3060_12gb", "strategy=lora", "strategy.micro_batch=4", "data.max_length=64")
    lora += ("strategy.precision=32-true", "strategy.lora.target_modules=[q_proj]")
    kept = plan(tmp_path, spec, *lora, "strategy.lora.dropout=0.1").candidates["lora"]["activations_mb"]
    plain = plan(tmp_path, spec, *lora, "strategy.lora.dropout=0.0").candidates["lora"]["activations_mb"]
    assert kept - plain == pytest.approx(512 * spec.n_blocks * 4 * 64 * (4 + 1) / MB, abs=0.05)


def test_processes_that_no_setup_fits_are_warned_of(tmp_path, spec):
    """Two DDP CPU processes share a 1,900 MB budget: the single-device plan (whole budget, global batch) fits, and
    the scale table's every setup needs more than a process's 950 MB. plan.reasons said nothing of it."""
    from onn.planning.plan import attach_scale  # (new: the other tests run on a planner without it)

    cfg = compose(
        "model=llama_small",
        "hardware=cpu_16gb",
        "strategy=full",
        "trainer.devices=2",
        "trainer.accelerator=cpu",
        "strategy.lightning=ddp",
        "data.batch_size=16",
        "hardware.budget_mb=1900",
        f"paths.cache={tmp_path / 'cache'}",
        root=tmp_path,
    )
    hw = resolve(cfg.hardware, tmp_path / "cache", tmp_path)
    p = make_plan(cfg, hw, spec, use_tuned=False)
    assert p.candidates["full"]["fits"]
    attach_scale(p, scale_plan(cfg, hw, spec))
    assert p.scale["chosen"] is None
    warned = [r for r in p.reasons if r.startswith("WARNING: trainer.devices=2")]
    assert len(warned) == 1 and "950 MB of the 1,900 MB budget" in warned[0]
