"""Runs that die: a record from the start, SIGTERM ends as failed with the step, a SIGKILLed job is crashed
in the grid and runs again when the sweep is resumed; a run folder that is a file is one sentence."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, read_metrics, run_cli

from onn.bench.grid import collect
from onn.tasks.record import STALE_S, state

TRAIN = [
    "model=llama_tiny",
    "data.builtin.train_size=400",
    "data.builtin.val_size=20",
    "tracking=none",
    "task.validate_before=false",
    "task.exact_match_samples=0",
    "trainer.enable_progress_bar=false",
]


def start(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen(
        [sys.executable, str(ROOT / "run.py"), *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for(check, proc: subprocess.Popen, timeout: float = 240):
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        found = check()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(
        f"gave up waiting (exit {proc.poll()}): {proc.stderr.read()[-2000:] if proc.poll() is not None else ''}"
    )


def checkpoint_step(run_dir: Path) -> int:
    try:
        found = re.search(r'"global_step", (\d+)', (run_dir / "checkpoints" / "last.ckpt" / "meta.json").read_text())
    except OSError:  # not written yet, or being replaced
        return 0
    return int(found.group(1)) if found else 0


def test_a_dead_running_record_reads_as_crashed():
    now = time.time()
    me = {"status": "running", "pid": os.getpid(), "host": socket.gethostname(), "heartbeat": now}
    assert state(me, now) == "running"
    assert state({**me, "heartbeat": now - STALE_S - 1}, now) == "crashed"  # alive pid, but no heartbeat: a reused pid
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    assert state({**me, "pid": int(gone.stdout)}, now) == "crashed"
    elsewhere = {**me, "host": "another-machine", "pid": 1}
    assert state(elsewhere, now) == "running" and state({**elsewhere, "heartbeat": now - STALE_S - 1}, now) == "crashed"
    assert state({"status": "ok"}) == "ok" and state({"error": "boom"}) == "failed"


@pytest.mark.slow
def test_sigterm_ends_a_training_run_as_failed_with_its_step_and_a_whole_checkpoint(outputs):
    from onn.training.checkpoints import load

    run_dir = outputs / "term"
    proc = start(
        *TRAIN,
        "trainer.max_steps=100000",
        "checkpoint.every_n_steps=2",
        f"paths.outputs={outputs}",
        f"hydra.run.dir={run_dir}",
    )
    first = wait_for(lambda: (run_dir / "metrics.json").is_file() and read_metrics(run_dir), proc)
    assert first["status"] == "running" and first["pid"] == proc.pid  # a record from the start
    wait_for(lambda: checkpoint_step(run_dir) >= 4, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 128 + signal.SIGTERM
    m = read_metrics(run_dir)
    assert (
        m["status"] == "failed" and m["signal"] == "SIGTERM" and m["error"].startswith("stopped by SIGTERM after step")
    )
    saved = load(run_dir / "checkpoints" / "last.ckpt")  # whole: it loads
    assert 4 <= saved["global_step"] <= m["steps"] and "pid" not in m
    # what the plan chose, also in the record of a run that did not end (it kept strategy=auto's name)
    plan = yaml.safe_load((run_dir / "plan.yaml").read_text())
    assert m["strategy"] == plan["strategy"] != "auto" and m["predicted_peak_memory_mb"] > 0


@pytest.mark.slow
def test_a_sigkilled_job_is_crashed_in_the_grid_and_runs_again_when_the_sweep_resumes(outputs):
    sweep = outputs / "sweep"
    plan = [
        "-m",
        "task=plan",
        "model=llama_tiny",
        "hardware=cpu_16gb,gtx1650_4gb",
        f"paths.outputs={outputs}",
        f"hydra.sweep.dir={sweep}",
    ]
    proc = run_cli(*plan)
    assert proc.returncode == 0, proc.stderr[-2000:]
    kept = (sweep / "0" / "metrics.json").read_text()
    # job 1's folder now holds a training run that the OOM killer (here: SIGKILL) ends without a word
    killed = start(*TRAIN, "trainer.max_steps=100000", f"paths.outputs={outputs}", f"hydra.run.dir={sweep / '1'}")
    wait_for(
        lambda: (sweep / "1" / "metrics.json").is_file() and read_metrics(sweep / "1").get("task") == "train",
        killed,
    )
    killed.kill()
    killed.wait(30)
    assert read_metrics(sweep / "1")["status"] == "running"  # what a SIGKILL leaves
    rows = {r["job"]: r for r in collect(sweep)}
    assert rows["0"]["status"] == "ok" and rows["1"]["status"] == "crashed" and "runs it again" in rows["1"]["error"]
    proc = run_cli(*plan)  # the same command, into the same folder: resume
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (sweep / "0" / "metrics.json").read_text() == kept  # finished: not run again
    again = read_metrics(sweep / "1")
    assert again["status"] == "ok" and again["task"] == "plan" and again["hardware"] == "gtx1650_4gb"


def test_a_run_folder_that_is_a_file_is_one_sentence(tmp_path):
    blocker = tmp_path / "taken"
    blocker.write_text("a file, not a folder\n")
    proc = run_cli("task=plan", f"hydra.run.dir={blocker}", f"paths.outputs={tmp_path / 'out'}")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr + proc.stdout
    assert f"hydra.run.dir={blocker} is a file, so it cannot be a folder" in proc.stderr
    assert blocker.read_text() == "a file, not a folder\n"  # nothing it held is touched
    proc = run_cli("-m", "task=plan", f"hydra.sweep.dir={blocker / 'sweep'}", f"paths.outputs={tmp_path / 'out'}")
    assert proc.returncode == 1 and f"is under {blocker}, which is a file" in proc.stderr


def test_a_cache_folder_under_a_file_is_one_sentence(tmp_path):
    from conftest import compose

    from onn.app import execute
    from onn.errors import UserError

    blocker = tmp_path / "cachefile"
    blocker.write_text("x")
    cfg = compose("task=plan", "model=llama_tiny", f"paths.cache={blocker}/cache", f"paths.outputs={tmp_path / 'out'}")
    with pytest.raises(UserError, match=r"paths.cache=.*cachefile/cache is under .*cachefile, which is a file"):
        execute(cfg, tmp_path / "run")
    assert blocker.read_text() == "x"


def test_a_failed_data_auto_run_records_the_model_and_data_it_chose(tmp_path):
    from PIL import Image

    only = tmp_path / "photos" / "cats"  # one class: data=auto finds images, then the classifier refuses them
    only.mkdir(parents=True)
    for i in range(4):
        Image.new("RGB", (8, 8), (40 * i, 0, 0)).save(only / f"{i}.png")
    run_dir = tmp_path / "run"
    proc = run_cli(
        "data=auto",
        f"data.source={tmp_path / 'photos'}",
        "tracking=none",
        f"paths.outputs={tmp_path / 'out'}",
        f"hydra.run.dir={run_dir}",
    )
    assert proc.returncode == 1 and "a classifier needs two or more" in proc.stdout + proc.stderr, proc.stdout[-2000:]
    metrics = read_metrics(run_dir)
    assert (metrics["status"], metrics["model"], metrics["data"]) == ("failed", "v28_cnn", "image")


def fake_checkpoint(path: Path, age_s: float) -> Path:
    """A checkpoint folder's JSON half, written `age_s` seconds ago (what tells the newest of a run's checkpoints)."""
    path.mkdir(parents=True)
    (path / "meta.json").write_text("{}")
    written = time.time() - age_s
    os.utime(path / "meta.json", (written, written))
    return path


def test_the_checkpoint_lightnings_slurm_requeue_saves_is_an_earlier_runs_and_ends_as_last_ckpt(tmp_path):
    """Lightning's SLURM auto-requeue saves RUN_DIR/hpc_ckpt_N.ckpt: a run started into that folder without ckpt was
    not refused, and Lightning resumed from it on its own (the record said resumed_from null); left after a resume,
    Lightning loaded it again at the run's next validate(). A run into it is refused naming it; once fit ends the
    newest checkpoint is checkpoints/last.ckpt and no hpc_ckpt is left."""
    from onn.errors import UserError
    from onn.tasks.record import refuse_earlier_checkpoints
    from onn.training.trainer import keep_newest_as_last, newest_checkpoint

    run = tmp_path / "run"
    hpc = fake_checkpoint(run / "hpc_ckpt_1.ckpt", age_s=60)
    with pytest.raises(UserError, match=rf"holds an earlier run's checkpoints \(hpc_ckpt_1.ckpt\).* give ckpt={hpc} "):
        refuse_earlier_checkpoints(run, "hydra.run.dir")
    last = fake_checkpoint(run / "checkpoints" / "last.ckpt", age_s=120)
    newer = fake_checkpoint(run / "hpc_ckpt_2.ckpt", age_s=30)
    assert newest_checkpoint(run) == newer
    keep_newest_as_last(run)
    assert newest_checkpoint(run) == last and not list(run.glob("hpc_ckpt_*"))
    assert (last / "meta.json").stat().st_mtime > time.time() - 40  # hpc_ckpt_2's, not the older last.ckpt's
    fake_checkpoint(run / "hpc_ckpt_1.ckpt", age_s=300)  # older than last.ckpt: it goes, last.ckpt stays
    keep_newest_as_last(run)
    assert newest_checkpoint(run) == last and not list(run.glob("hpc_ckpt_*"))


@pytest.mark.slow
def test_a_requeued_slurm_job_resumes_from_the_checkpoint_its_signal_saved(tmp_path):
    """examples/slurm/train.sbatch: SIGUSR1 before the time limit, Lightning saves hpc_ckpt_1.ckpt and requeues the
    job (scontrol, here a stand-in that records the call), SLURM's SIGTERM ends it, and the requeued job runs the
    same command with SLURM_RESTART_COUNT set. It failed on the checkpoints its first run left (or resumed without
    a word when there was only Lightning's); it resumes from the newest, says so in its record and ends with it as
    last.ckpt."""
    from onn.training.checkpoints import read_meta

    bin_dir, calls, run_dir = tmp_path / "bin", tmp_path / "scontrol.calls", tmp_path / "run"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (bin_dir / "scontrol").chmod(0o755)
    slurm = {"SLURM_NTASKS": "1", "SLURM_NTASKS_PER_NODE": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
             "SLURM_NODEID": "0", "SLURM_NNODES": "1", "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "onn-train",
             "SLURM_NODELIST": "localhost"}  # fmt: skip
    env = {**os.environ, **slurm, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONWARNINGS": "ignore"}
    env["HF_HUB_OFFLINE"] = "1"
    command = [sys.executable, str(ROOT / "run.py"), *TRAIN, "trainer.max_steps=30", "checkpoint.every_n_steps=2",
               f"paths.outputs={tmp_path / 'outputs'}", f"hydra.run.dir={run_dir}"]  # fmt: skip
    first = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: checkpoint_step(run_dir) >= 2, first)  # training, Lightning's signal handlers set
    first.send_signal(signal.SIGUSR1)
    wait_for(lambda: (run_dir / "hpc_ckpt_1.ckpt" / "meta.json").is_file(), first)
    # Lightning saves, then requeues: SLURM's SIGTERM comes minutes later, here once the requeue is recorded (on a
    # loaded machine it came between the two, and the call was never made)
    wait_for(lambda: calls.is_file() and bool(calls.read_text().strip()), first)
    first.send_signal(signal.SIGTERM)
    assert first.wait(60) == 128 + signal.SIGTERM
    saved = read_meta(run_dir / "hpc_ckpt_1.ckpt")["global_step"]
    assert calls.read_text().split() == ["requeue", "4242"] and 2 <= saved < 30
    again = subprocess.run(
        command, env={**env, "SLURM_RESTART_COUNT": "1"}, capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 0, again.stderr[-3000:]
    record = read_metrics(run_dir)
    assert record["status"] == "ok" and record["steps"] == 30, record
    assert record["resumed_from"] == str(run_dir / "hpc_ckpt_1.ckpt") == record["checkpoint_used"]
    assert len(record["train/loss_curve"]) == 30  # the first run's steps, then the rest
    assert (
        not list(run_dir.glob("hpc_ckpt_*")) and read_meta(run_dir / "checkpoints" / "last.ckpt")["global_step"] == 30
    )


@pytest.mark.slow  # moved to the slow tier: the fast suite stays under 10 minutes on 2 cores
def test_a_sweep_of_other_sweeper_params_into_a_folder_of_finished_jobs_is_refused(tmp_path):
    """A sweep whose jobs differed only in hydra.sweeper.params (a recipe's sweep, `hydra.sweeper.params.strategy=`)
    passed the guard, which compared the command line's task overrides alone, and replaced the finished jobs."""
    sweep = tmp_path / "sweep"
    common = ("recipe=equitable_grid", "task=plan", "hydra.sweeper.params.model=llama_tiny", "hardware=cpu_16gb",
              f"paths.outputs={tmp_path}", f"hydra.sweep.dir={sweep}")  # fmt: skip
    first = run_cli(*common, "hydra.sweeper.params.strategy=full")
    assert first.returncode == 0, first.stderr[-2000:]
    before = (sweep / "0" / "metrics.json").read_text()
    other = run_cli(*common, "hydra.sweeper.params.strategy=lora")
    assert other.returncode == 1 and "Traceback" not in other.stderr
    assert f"hydra.sweep.dir={sweep} holds the finished jobs of another sweep: its job 0 ran" in other.stderr
    assert "strategy=full" in other.stderr and "where this sweep's job 0 is" in other.stderr
    assert (sweep / "0" / "metrics.json").read_text() == before and '"strategy": "full"' in before


def test_a_sweep_is_compared_with_the_finished_jobs_job_by_job(tmp_path):
    """Reordered sweep values (`data.max_length=32,48 strategy=full,lora` after `strategy=full,lora
    data.max_length=32,48`) give the same sorted overrides but other jobs in each folder: both were run again."""
    from omegaconf import OmegaConf

    from onn.tasks.record import BASIC_SWEEPER, other_sweep

    def refused(*overrides: str, params: dict | None = None) -> str | None:
        sweeper = {"_target_": BASIC_SWEEPER, "max_batch_size": None, "params": params}
        config = OmegaConf.create({"hydra": {"sweeper": sweeper, "overrides": {"task": list(overrides)}}})
        return other_sweep(tmp_path, config)

    jobs = [["task=plan", f"strategy={s}", f"data.max_length={n}"] for s in ("full", "lora") for n in (32, 48)]
    for num, overrides in enumerate(jobs):  # as Hydra's basic sweeper wrote them, each finished
        (tmp_path / str(num) / ".hydra").mkdir(parents=True)
        (tmp_path / str(num) / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
        (tmp_path / str(num) / "metrics.json").write_text('{"status": "ok"}')
    assert refused("task=plan", "strategy=full,lora", "data.max_length=32,48") is None
    swapped = refused("task=plan", "data.max_length=32,48", "strategy=full,lora")
    assert swapped and "its job 1 ran `task=plan strategy=full data.max_length=48`" in swapped
    assert "this sweep's job 1 is `task=plan data.max_length=32 strategy=lora`" in swapped
    # the sweeper's params are each job's first overrides: the same jobs pass, other ones are another sweep
    assert refused("strategy=full,lora", "data.max_length=32,48", params={"task": "plan"}) is None
    assert "its job 0 ran" in refused("data.max_length=32,48", params={"task": "plan", "strategy": "lora"})
    # fewer jobs: the finished ones left over would stand in this sweep's grid
    fewer = refused("task=plan", "strategy=full", "data.max_length=32,48")
    assert fewer and "its job 2 ran" in fewer and "this sweep has 2 job(s)" in fewer
    # jobs added after the finished ones (a value added to the first key) take none of theirs: it resumes
    assert refused("task=plan", "strategy=full,lora,sparse_lora", "data.max_length=32,48") is None
    for num in (1, 2, 3):  # failed jobs are run again, whatever they were
        (tmp_path / str(num) / "metrics.json").write_text('{"status": "failed"}')
    assert refused("task=plan", "strategy=full,lora", "data.max_length=32,48,64") is None


def test_a_run_whose_loss_went_nan_fails_in_one_sentence_exports_nothing_and_writes_strict_json(tmp_path):
    """A learning rate that blows the weights up trained on in NaN and ended `ok` ("train ok: train/loss_final
    nan"), exported the NaN weights, and wrote NaN, which no strict JSON reader takes, into metrics.json's loss
    curve."""
    import json

    run_dir = tmp_path / "run"
    done = run_cli(
        *TRAIN, "optim.lr=1e9", "trainer.max_steps=6", "export=safetensors", f"paths.outputs={tmp_path}",
        f"hydra.run.dir={run_dir}",
    )  # fmt: skip
    assert done.returncode == 1, done.stderr[-2000:]
    assert "training diverged: the loss of its last steps (train/loss_final) is nan" in done.stdout + done.stderr

    def refuse(word: str):
        raise AssertionError(f"metrics.json holds {word}, which strict JSON readers refuse")

    m = json.loads((run_dir / "metrics.json").read_text(), parse_constant=refuse)
    assert m["status"] == "failed" and m["error"].startswith("training diverged")
    assert m["train/loss_initial"] > 0 and None in m["train/loss_curve"]  # the figures stay beside the error
    assert (run_dir / "checkpoints" / "last.ckpt").exists() and not (run_dir / "export").exists()
