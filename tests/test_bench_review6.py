"""bench_gpu and bench_overhead, reviewed again: the step's limit counted at the work the measured steps held, the
runner-overhead sides timed without each other's garbage, and bench_gpu's child runs kept to its time limit (real
child processes that finish, hang, or are never started)."""

from __future__ import annotations

import gc
import os
import signal
import time
import weakref
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
from conftest import compose

# run.py as bench_gpu's children find it under paths.root: `mode=ok` records figures at once; `mode=hang` starts a
# worker of its own (as a DataLoader does), writes its pid, then never ends
FAKE_RUN = """
import json, subprocess, sys, time
from pathlib import Path

args = dict(a.split("=", 1) for a in sys.argv[1:])
folder = Path(args["hydra.run.dir"])
folder.mkdir(parents=True)
if args["mode"] == "hang":
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    (folder / "worker.pid").write_text(str(worker.pid))
    (folder / "metrics.json").write_text(json.dumps({"status": "running"}))
    print("hanging", flush=True)
    time.sleep(600)
figures = {"overhead/ratio": 0.9, "overhead/onn_steps_per_s": 9.0, "overhead/plain_steps_per_s": 10.0}
figures.update({"vision/runner_overhead": 0.1, "vision/lightning_floor": 0.05, "vision/onn_samples_per_s": 90.0})
figures.update({"vision/plain_samples_per_s": 100.0})
(folder / "metrics.json").write_text(json.dumps({"status": "ok", **figures}))
"""


def _bench_job(tmp_path: Path) -> SimpleNamespace:
    """What bench_gpu's child runs read of a job: paths (root: the fake run.py's folder), the time limit, run_dir."""
    (tmp_path / "run.py").write_text(FAKE_RUN)
    paths = SimpleNamespace(root=str(tmp_path), outputs=str(tmp_path / "outputs"), cache=str(tmp_path / "cache"))
    config = SimpleNamespace(paths=paths, task=SimpleNamespace(time_limit_s=480))
    (tmp_path / "bench").mkdir()
    return SimpleNamespace(config=config, run_dir=tmp_path / "bench")


def _children(first: str, second: str) -> list:
    from onn.bench.gpu import OVERHEAD_FIGURES, VISION_FIGURES

    return [("overhead", [f"mode={first}"], OVERHEAD_FIGURES), ("vision", [f"mode={second}"], VISION_FIGURES)]


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_hung_child_run_is_killed_at_its_limit_with_what_it_started_and_its_figure_says_so(tmp_path):
    """A trial that hangs is stopped at its limit: subprocess's timeout killed run.py alone (its own processes ran
    on, orphaned), and the figures were None with the reason only in the log. Now its whole session is killed, its
    first figure says it was stopped, and the next child still runs."""
    from onn.bench.gpu import _run_children

    job = _bench_job(tmp_path)
    out = _run_children(job, _children("hang", "ok"), time.time() + 1000, least_s=1, most_s=10)  # (its worker up first)
    worker = int((job.run_dir / "overhead" / "worker.pid").read_text())
    try:
        deadline = time.monotonic() + 10  # a bound for the kernel to finish a SIGKILL, not a speed
        while not _gone(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(worker), "the hung run's own worker outlived it"
    finally:
        if not _gone(worker):
            os.kill(worker, signal.SIGKILL)
    said = out["gpu/default_job_ratio"]
    assert said == "not measured: overhead ran past its 10 s and was stopped; see overhead.log", said
    assert out["gpu/default_job_steps_per_s"] is None and out["gpu/plain_loop_steps_per_s"] is None
    assert "hanging" in (job.run_dir / "overhead.log").read_text()  # what it wrote before it was stopped
    assert out["gpu/vision_runner_overhead"] == 0.1 and out["gpu/vision_plain_samples_per_s"] == 100.0


def test_a_child_run_is_started_only_with_60_s_left_and_takes_what_the_first_left(tmp_path):
    """Each child may take an even share of what is left, at least 60 s where that is left, at most 300 s: with 59 s
    left neither is started (no process, no log) and the figures say why; with 100 s left the first takes 60 s (not
    its 50 s share), and what it leaves unused goes to the second, which runs too."""
    from onn.bench.gpu import _run_children, child_limit_s

    assert child_limit_s(59, 1) is None and child_limit_s(60, 1) == 60
    assert child_limit_s(100, 2) == 60 and child_limit_s(40, 1) is None  # of 100 s, one runs
    assert child_limit_s(500, 2) == 250 and child_limit_s(1000, 2) == 300

    job = _bench_job(tmp_path)
    out = _run_children(job, _children("hang", "hang"), time.time() + 59)
    assert out["gpu/default_job_ratio"] == "not measured: less than 60 s of task.time_limit_s=480 was left for it"
    assert out["gpu/vision_runner_overhead"].startswith("not measured: less than 60 s")
    assert out["gpu/plain_loop_steps_per_s"] is None and out["gpu/vision_plain_samples_per_s"] is None
    assert list(job.run_dir.iterdir()) == []  # nothing started

    out = _run_children(job, _children("ok", "ok"), time.time() + 100)
    assert out["gpu/default_job_ratio"] == 0.9 and out["gpu/vision_runner_overhead"] == 0.1


def test_the_gpu_steps_limit_counts_the_flops_of_the_batches_the_steps_held():
    """gpu/limit_s's matmul time counted FLOPs at plan.sequence_length (data.max_length, a cap): Phi-4's steps on
    short samples padded to their batch's longest, 96 and 160 tokens wide, were held to 320 tokens' work. Now each
    step's FLOPs are its batch's: samples x width."""
    from onn.bench.gpu import step_flops
    from onn.planning.costs import streaming_step_flops
    from onn.planning.spec import model_spec

    cfg = compose("recipe=bench_gpu", "data.max_length=320")
    spec = model_spec(cfg.model, 16)
    plan = SimpleNamespace(sequence_length=320, sparse_layers=[0, 20, 39])
    rows, widths = [128, 128], [96, 160]
    expected = (
        streaming_step_flops(spec, 96, 128, [0, 20, 39]) + streaming_step_flops(spec, 160, 128, [0, 20, 39])
    ) / 2
    assert step_flops(spec, plan, rows, widths) == pytest.approx(expected)
    at_the_cap = streaming_step_flops(spec, 320, 128, plan.sparse_layers)  # what the limit counted
    assert step_flops(spec, plan, rows, widths) < 0.6 * at_the_cap
    assert step_flops(spec, plan, [128], [320]) == pytest.approx(at_the_cap)  # full rows: the plan's count
    assert step_flops(spec, plan, [64], [320]) == pytest.approx(at_the_cap / 2)  # a short batch: its samples


def test_the_runner_overhead_benchs_sides_are_timed_without_each_others_garbage(tmp_path, monkeypatch):
    """task=bench_overhead alternates its sides in rounds, each building its own module (ONN's with a Trainer, whose
    reference cycles only the collector frees). Nothing collected between sides, so the last side's module was still
    alive when the next side's timed window started, and the collector freed it inside that window. Now every module
    an earlier side built is gone before a timed window starts."""
    from test_bench_fixes import _job

    from onn.bench import overhead
    from onn.modalities.text import tasks

    built: list[weakref.ref] = []
    alive_at_start: list[int] = []
    real_build, real_stamp = tasks.build, overhead.stamp

    def build(*args, **kwargs):
        module, tokenizer = real_build(*args, **kwargs)
        built.append(weakref.ref(module))
        return module, tokenizer

    def stamp(stamps, device, warmup, steps):
        if len(stamps) == warmup:  # the timed window's start: the modules of the sides before this one
            alive_at_start.append(sum(ref() is not None for ref in built[:-1]))
        real_stamp(stamps, device, warmup, steps)

    monkeypatch.setattr(tasks, "build", build)
    monkeypatch.setattr(overhead, "stamp", stamp)
    sizes = ["data.builtin.train_size=32", "data.max_length=32", "task.steps=2", "task.warmup=1", "task.repeats=2"]
    job = _job(tmp_path, "task=bench_overhead", "strategy=full", *sizes)
    gc.collect()
    overhead.run(job)
    assert len(built) == 4 and alive_at_start == [0, 0, 0, 0], alive_at_start
