"""The runner's records under review: a resumed sweep rewrote a finished job's ok record when its config changed, or
when its sweep_objective was misspelt; the heartbeat thread died on a key added while it wrote; task=plan said ok
for a checkpoint.every_n_steps that training refuses; `optim=null` was Hydra's five-line answer."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import ROOT, compose, read_metrics, run_cli
from hydra import compose as hydra_compose
from hydra import initialize_config_dir

import onn.tasks.record as record_module
from onn.config.registry import group_problem
from onn.errors import UserError
from onn.tasks.record import RunRecord
from onn.training.checkpoints import save

CONF = ROOT / "conf"
TINY = ["model=llama_tiny", "hardware=cpu_16gb", "tracking=none"]


def wait_for(condition, what: str, limit_s: float = 20.0) -> None:
    """Poll `condition` until it holds; a generous limit, only so that a broken run cannot hang the suite."""
    end = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < end, f"never happened: {what}"
        time.sleep(0.005)


def test_a_resumed_sweep_leaves_a_finished_job_of_another_config_as_it_was(tmp_path: Path):
    """A job folder holding an ok record and checkpoints of another config_digest (a recipe edited, a setting added
    by an upgrade): the refusal to resume it replaced the ok record with a failed one. Now it says so once and the
    record, the earlier run's result, stays."""
    sweep = tmp_path / "sweep"
    job = sweep / "0"
    overrides = [*TINY, "trainer.max_steps=2", f"paths.outputs={tmp_path / 'outputs'}"]
    save({"state_dict": {"w": torch.arange(4.0)}, "global_step": 2}, job / "checkpoints" / "last.ckpt")
    (job / ".hydra").mkdir()
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))  # the same job: other_sweep lets it in
    earlier = {
        "status": "ok",
        "error": None,
        "task": "train",
        "config_digest": "0123456789abcdef",
        "val/loss_final": 5.178,
    }
    (job / "metrics.json").write_text(json.dumps(earlier))

    proc = run_cli("-m", *overrides, f"hydra.sweep.dir={sweep}")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-2000:]
    assert read_metrics(job) == earlier
    assert output.count("holds the finished run (last.ckpt, metrics.json) of another config") == 1, output[-2000:]


@pytest.mark.slow  # two planning sweeps in run.py processes: about 10 s on two busy cores
def test_a_finished_sweep_job_run_again_with_a_misspelt_objective_stays_ok(tmp_path: Path):
    """sweep_objective=val/los: the finished job's record was rewritten as `failed: stopped: SystemExit 1` when the
    same sweep ran again, as _objective's exit came inside the run's try."""
    sweep = tmp_path / "sweep"
    command = ["-m", *TINY, "task=plan", "sweep_objective=val/los", f"paths.outputs={tmp_path / 'outputs'}"]
    for attempt in (1, 2):
        proc = run_cli(*command, f"hydra.sweep.dir={sweep}")
        assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert "sweep_objective=val/los is not a key" in proc.stdout + proc.stderr
        record = read_metrics(sweep / "0")
        assert record["status"] == "ok" and record["error"] is None, (attempt, record["error"])
        assert record["predicted_peak_memory_mb"] > 0  # the plan's figures stay


@pytest.fixture
def busy_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A large running record whose heartbeat writes as often as it can, with threads switched often."""
    monkeypatch.setattr(record_module, "HEARTBEAT_S", 0.0)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    record = RunRecord(tmp_path, {"status": "running", "error": None, **{f"k{i}": [1.0] * 20 for i in range(2000)}})
    record.start()
    yield record
    sys.setswitchinterval(interval)
    record.finish(status="ok")


def test_the_heartbeat_outlives_keys_added_to_the_record_while_it_writes(busy_record: RunRecord):
    """A key added to the record (execute's record.update(out)) while the heartbeat read it ended the heartbeat thread
    ("dictionary changed size during iteration"); 90 s later the live run read as crashed. The old code lost the
    thread within a few thousand additions in every try; the record is now copied at once under its lock."""
    for i in range(30000):
        busy_record.metrics[f"added{i}"] = i  # the unlocked path callers took
        assert busy_record._thread.is_alive(), f"the heartbeat died after {i} additions"
    busy_record.update({"through_update": 1})
    wait_for(lambda: "through_update" in read_metrics(busy_record.path.parent), "a beat after update()")
    assert busy_record._thread.is_alive()


def test_the_heartbeat_outlives_a_write_that_fails(tmp_path: Path, monkeypatch, caplog):
    """Only UserError was caught: any other error of a write (here a record JSON cannot hold) ended the heartbeat.
    It is said once in the log, and the next beat writes again."""
    monkeypatch.setattr(record_module, "HEARTBEAT_S", 0.001)
    record = RunRecord(tmp_path, {"status": "running", "error": None})
    record.start()
    with caplog.at_level(logging.WARNING, logger="onn"):
        record.update({"bad": {(1, 2): "a tuple key"}})
        wait_for(lambda: "the heartbeat could not write it (TypeError" in caplog.text, "the failed beat logged")
        record.update({"bad": None, "mended": True})
        wait_for(lambda: read_metrics(tmp_path).get("mended") is True, "a beat after the failure")
    assert record._thread.is_alive()
    record.finish(status="ok")
    assert caplog.text.count("the heartbeat could not write it") == 1
    assert read_metrics(tmp_path)["status"] == "ok"


@pytest.mark.parametrize("every", ["0", "-1"])
def test_a_plan_refuses_the_checkpoint_interval_training_refuses(tmp_path: Path, every: str):
    """task=plan said `plan ok` for checkpoint.every_n_steps=-1 (and 0), which task=train refused when it started."""
    from onn.app import execute

    config = compose(
        *TINY,
        "task=plan",
        f"checkpoint.every_n_steps={every}",
        f"paths.outputs={tmp_path}/o",
        f"paths.cache={tmp_path}/c",
    )
    with pytest.raises(UserError, match=rf"^checkpoint.every_n_steps={every}: give a whole number"):
        execute(config, tmp_path / "run")
    assert not (tmp_path / "run" / "plan.yaml").exists()  # refused before planning


@pytest.mark.parametrize("arg", ["optim=null", "checkpoint=null", "trainer.max_steps=null"])
def test_null_for_a_setting_that_cannot_be_null_is_one_sentence(arg: str):
    """`optim=null` printed Hydra's five lines ("Error merging override ... field 'optim' is not Optional")."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        with pytest.raises(Exception, match="Error merging override"):
            hydra_compose("config", overrides=["task=plan", arg])  # what Hydra says itself
        hydra_compose("config", overrides=["task=plan", "ckpt=null", "strategy.lora=null"])  # Optional: taken
    problem = group_problem(["task=plan", arg], CONF)
    key = arg.split("=")[0]
    assert problem is not None and problem.startswith(f"{arg}: ") and key in problem and "null" in problem
    assert len(problem.splitlines()) == 1
    assert (
        group_problem(["task=plan", "ckpt=null", "strategy.lora=null", "trainer.val_check_interval=null"], CONF) is None
    )
