"""The benchmark figures' review: each test shows a figure measuring what its name says, or a bench ending in one
clear record where it ended in a traceback."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import compose

from onn.bench.scores import learned


def test_a_run_whose_loss_diverged_has_no_learning_p_value():
    """A NaN or infinite loss among the fifths the learning test compares: scipy's permutation test gave a NaN
    statistic a p of 0 (the grid showed `no (p=0)`), and an infinite first loss made `learned` true."""
    falling = [5.0 - 0.1 * i for i in range(20)]
    diverged = [*falling[:-1], float("nan")]
    started_at_inf = [float("inf"), *falling[1:]]
    assert learned(diverged) == (False, None)
    assert learned(started_at_inf) == (False, None)
    assert learned([*falling[:10], float("nan"), *falling[11:]])[0] is True  # a NaN outside the fifths is not read


def _job(tmp_path: Path, *overrides: str):
    """A job as app.run hands it to a task: the composed config, its plan and profile, its own run folder."""
    from onn.hardware.profile import resolve
    from onn.modalities import get
    from onn.modalities.base import Job

    config = compose(
        "model=llama_tiny",
        "hardware=cpu_16gb",
        "tracking=none",
        f"paths.outputs={tmp_path}",
        f"paths.cache={tmp_path / 'cache'}",
        *overrides,
    )
    hardware = resolve(config.hardware, tmp_path / "cache", tmp_path)
    plan, spec = get("text").plan(config, hardware, use_tuned=False)
    (tmp_path / "run").mkdir()
    return Job(config, tmp_path / "run", get("text"), hardware, plan, spec)


@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed"])
def test_the_runner_overhead_benchs_plain_loop_trains_what_onns_trainer_trains(precision, tmp_path):
    """Both sides of overhead/ratio do the same work, step by step: the same losses. Under bf16-true the plain loop
    autocast float32 weights where Lightning trains bf16 ones (and, under 16-mixed, left out Lightning's GradScaler
    and its wait for the GPU at each step), and ONN's schedule ran over trainer.max_steps, not the bench's steps."""
    import lightning as L

    from onn.bench.overhead import _onn, _plain

    job = _job(
        tmp_path,
        "task=bench_overhead",
        "strategy=full",
        f"strategy.precision={precision}",
        "data.builtin.train_size=64",
        "data.max_length=32",
    )
    L.seed_everything(job.config.seed, verbose=False)
    plain_rate, plain = _plain(job, steps=2, warmup=2)
    L.seed_everything(job.config.seed, verbose=False)
    onn_rate, onn = _onn(job, steps=2, warmup=2)
    assert plain_rate > 0 and onn_rate > 0
    assert len(plain) == len(onn) == 4
    assert plain == pytest.approx(onn, abs=1e-6), (plain, onn)


def test_the_runner_overhead_bench_waits_for_the_device_at_its_timed_windows_ends_only(tmp_path, monkeypatch):
    """Each side's stamps waited for the GPU at every step: neither could queue its next step while the GPU ran
    this one, and each side's host time (Lightning's loop on ONN's) added to its steps one for one. The waits
    are now the timed window's start and end, whatever the number of steps."""
    from onn.bench import overhead, vision

    waits: list[str] = []
    for module in (vision, overhead):  # every name a stamp waits through, counted on any device
        for name in ("synchronize", "_sync"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, lambda device: waits.append(str(device)))
    job = _job(tmp_path, "task=bench_overhead", "strategy=full", "data.builtin.train_size=64", "data.max_length=32")
    counts = {}
    for side, measure in (("plain", overhead._plain), ("onn", overhead._onn)):
        for steps in (2, 5):
            waits.clear()
            measure(job, steps=steps, warmup=1)
            counts[side, steps] = len(waits)
    assert counts["plain", 2] == counts["plain", 5] == 2 and counts["onn", 2] == counts["onn", 5] == 2, counts


@pytest.mark.slow
def test_a_child_run_killed_without_a_record_is_named_so_and_leaves_bench_gpus_figures_empty(tmp_path):
    """bench_gpu's overhead runs are run.py processes of their own. One killed without a word (the OOM killer,
    SIGKILL) leaves its `running` record, whose error is null: bench_gpu logged "did not finish (running): None".
    Now it says the child was stopped without its last record, with its exit and log, and its figures stay empty."""
    from onn.bench.gpu import _child, _figures

    config = compose("tracking=none", f"paths.outputs={tmp_path}", f"paths.cache={tmp_path / 'cache'}")
    job = SimpleNamespace(config=config, run_dir=tmp_path / "bench")
    job.run_dir.mkdir()
    record = job.run_dir / "endless" / "metrics.json"

    def kill_once_running() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                pid = json.loads(record.read_text())["pid"]
            except (OSError, ValueError, KeyError):
                time.sleep(0.2)
                continue
            os.kill(pid, signal.SIGKILL)
            return

    killer = threading.Thread(target=kill_once_running, daemon=True)
    killer.start()
    endless = ["model=llama_tiny", "hardware=cpu_16gb", "tracking=none", "trainer.max_steps=1000000"]
    ran = _child(job, "endless", endless)
    killer.join()
    assert json.loads(record.read_text())["status"] == "running"  # what the killed run left
    assert ran["status"] != "ok" and "endless" in ran["error"]
    assert _figures(ran, {"gpu/default_job_ratio": "overhead/ratio"}) == {"gpu/default_job_ratio": None}


def test_accelerate_is_not_measured_where_the_budget_leaves_it_no_gpu_memory():
    """bench_gpu gives accelerate the budget less the CUDA context and 1 GB: at hardware.budget_mb=1536 with a 742 MB
    context (the H200's) that was -230 MB, so accelerate placed every layer on the host and failed on the inputs
    sent to the GPU. The figure says why it is missing instead; nothing is built before."""
    from onn.bench.gpu import _accelerate

    plan = SimpleNamespace(budget_mb=1536.0, context_mb=742.0)
    job = SimpleNamespace(plan=plan, config=SimpleNamespace(task=SimpleNamespace(gen_tokens=8)))
    said = _accelerate(job, {}, None, [], {})["gpu/vs_accelerate"]
    assert said == "not measured: hardware.budget_mb=1536 leaves accelerate no GPU memory beside the context and 1 GB"
