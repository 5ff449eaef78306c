"""The bench recipes' figures, reviewed again: bench_giant's limit counted at the work its steps held and its
generation ratio named by the batch it measured, and bench_media's timings waiting for the device only at their
window's ends (real training steps, real recordings)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import SHARED_DATA, compose
from test_bench_fixes import _job

FSDD = SHARED_DATA / "fsdd" / "recordings"


def _giant_job(tmp_path: Path, *overrides: str):
    """A streamed sparse-LoRA job on llama_tiny as app.run hands it to bench_giant: config, plan, spec, run folder."""
    return _job(tmp_path, "task=bench_giant", "strategy=sparse_lora", *overrides)


@pytest.mark.slow
def test_bench_giants_limit_counts_the_flops_of_the_batches_its_steps_held(tmp_path):
    """giant/limit_s's matmul time counted FLOPs at data.max_length x data.batch_size, a cap: steps on samples
    shorter than data.max_length (padded to their batch's longest) were held to work they never had, and
    giant/limit_efficiency came out as high as the cap was loose. Now each step's FLOPs are its batch's."""
    import torch

    from onn.bench.giant import _progress, _step_figures, _train
    from onn.planning.costs import streaming_step_flops

    job = _giant_job(
        tmp_path, "data.max_length=512", "data.batch_size=4", "data.builtin.train_size=16", "data.builtin.val_size=4"
    )
    assert job.plan.streaming is not None
    threads = torch.get_num_threads()
    try:  # the training phase as bench_giant's process runs it (here in this process), three real steps
        request = {"config": job.config, "plan": job.plan, "run_dir": str(job.run_dir / "train")}
        _train({**request, "validate": False, "max_steps": 3, "ckpt": None})
    finally:
        torch.set_num_threads(threads)
    steps = [s for s in _progress(job.run_dir / "train") if "step_s" in s]
    assert len(steps) == 3 and all(s["rows"] == 4 for s in steps)
    widths = [s["width"] for s in steps]
    assert max(widths) < 512, widths  # math problems cut at 512 tokens: each batch padded to its longest only
    figures, _, _ = _step_figures(job, steps, disk_mb_s=1000.0, start_gflops=50.0)
    held = sum(streaming_step_flops(job.spec, w, 4, job.plan.sparse_layers) for w in widths) / 3
    at_the_cap = streaming_step_flops(job.spec, 512, 4, job.plan.sparse_layers)  # what the limit counted
    assert figures["giant/step_gflop"] == pytest.approx(held / 1e9, abs=0.06)
    assert held < 0.8 * at_the_cap
    assert all(s["matmul_gflops"] and s["matmul_gflops"] > 0 for s in steps)  # timed at the step's own rows


def test_bench_giants_generation_ratio_is_named_by_the_batch_it_measured():
    """giant/gen_b8_over_b1 was written whatever task.gen_batch was: with gen_batch=4 it held 4 prompts' time
    per token over 1's, under 8's name, beside giant/gen_s_per_token_b4."""
    from onn.bench.giant import generation_figures

    generated = {
        "b1": {"token_s": 0.5, "tokens_per_s": 2.0},
        "bn": {"token_s": 0.75, "tokens_per_s": 5.33},
    }
    figures = generation_figures(generated, gen_batch=4)
    assert figures["giant/gen_b4_over_b1"] == 1.5 and figures["giant/gen_s_per_token_b4"] == 0.75
    assert not any("b8" in key for key in figures)
    assert "giant/gen_b8_over_b1" in generation_figures(generated, gen_batch=8)  # the recipe's own batch


@pytest.mark.skipif(not FSDD.is_dir(), reason="../shared/data/fsdd is absent")
def test_bench_medias_timings_wait_for_the_device_at_their_windows_ends_only(tmp_path, monkeypatch):
    """bench_media's pipeline and training loops waited for the GPU at every batch: neither side could queue its
    next batch while the GPU ran this one, and each side's host time added to its batches one for one (vision's and
    the overhead bench's loops wait at their window's two ends). Now both wait twice, whatever the steps."""
    from onn.bench import media, vision
    from onn.modalities import classification, get

    waits: list[str] = []
    for module in (vision, media):  # every name a stamp waits through, counted on any device
        for name in ("synchronize", "_sync"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, lambda device: waits.append(str(device)))
    recordings = tmp_path / "recordings"  # five of george's recordings of each digit
    recordings.mkdir()
    for digit in range(10):
        for index in range(5):
            name = f"{digit}_george_{index}.wav"
            (recordings / name).write_bytes((FSDD / name).read_bytes())
    cfg = compose(
        "recipe=bench_media",
        f"data.source={recordings}",
        "data.batch_size=16",
        "+model.kwargs.widths=[8,16]",
        f"paths.cache={tmp_path / 'cache'}",
    )
    audio = get("audio")
    dm = classification.setup_data(audio, cfg, "cpu")
    inputs = classification.data_inputs(audio, cfg, dm)
    transform = audio.transform(cfg, inputs)
    counts, rates = {}, []
    for steps in (2, 5):
        waits.clear()
        rates.append(media._pipeline(dm.train_dataloader(), steps, 1, transform, dm.device))
        counts["pipeline", steps] = len(waits)
        waits.clear()
        rates.append(media._train(audio, cfg, inputs, dm.train_dataloader(), steps, 1, transform, "32-true", dm.device))
        counts["train", steps] = len(waits)
    assert all(rate > 0 for rate in rates)
    assert set(counts.values()) == {2}, counts
