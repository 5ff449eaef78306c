"""Checkpoints are safetensors + JSON, round-trip exactly, and never need pickle."""

import json
import shutil

import pytest
import torch

from onn.errors import UserError
from onn.training.checkpoints import load, resolve, save, saved_config


def test_round_trip_nested_state(tmp_path):
    shared = torch.randn(4, 3)
    state = {
        "state_dict": {"a.weight": shared, "b.weight": shared, "view": shared[1:]},  # tied weights and a view
        "optimizer_states": [
            {
                "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2)}},
                "param_groups": [{"betas": (0.9, 0.95), "lr": 1e-3, "params": [0]}],
            }
        ],
        "loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 1}}}},
        "dtype": torch.bfloat16,
        "none": None,
    }
    save(state, tmp_path / "x.ckpt")
    assert sorted(p.name for p in (tmp_path / "x.ckpt").iterdir()) == ["meta.json", "model.safetensors"]
    back = load(tmp_path / "x.ckpt")
    assert torch.equal(back["state_dict"]["a.weight"], shared) and torch.equal(back["state_dict"]["view"], shared[1:])
    opt = back["optimizer_states"][0]
    assert 0 in opt["state"] and opt["param_groups"][0]["betas"] == (0.9, 0.95)  # int keys and tuples survive
    assert back["dtype"] is torch.bfloat16 and back["none"] is None and back["loops"] == state["loops"]
    json.loads((tmp_path / "x.ckpt" / "meta.json").read_text())  # plain JSON


def test_overwrite_is_atomic_and_bad_paths_are_refused(tmp_path):
    save({"x": torch.zeros(1)}, tmp_path / "last.ckpt")
    save({"x": torch.ones(1)}, tmp_path / "last.ckpt")
    assert load(tmp_path / "last.ckpt")["x"].item() == 1.0
    assert not any(p.name.endswith((".tmp", ".old")) for p in tmp_path.iterdir())
    (tmp_path / "model.pt").write_bytes(b"\x80\x04pickle")
    with pytest.raises(UserError, match="pickle"):
        resolve(str(tmp_path / "model.pt"), tmp_path)
    with pytest.raises(UserError, match="no checkpoint"):
        resolve("last", tmp_path / "empty")


def test_a_save_killed_while_tidying_up_does_not_block_the_next(tmp_path):
    """SIGKILL during the removal of the replaced checkpoint leaves part of last.ckpt.old behind: the
    resumed run's next save replaces it (it failed with 'Directory not empty' on the bench's kill -9)."""
    save({"x": torch.zeros(1)}, tmp_path / "last.ckpt")
    leftover = tmp_path / "last.ckpt.old"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"half-deleted")
    save({"x": torch.ones(1)}, tmp_path / "last.ckpt")
    assert load(tmp_path / "last.ckpt")["x"].item() == 1.0
    assert not leftover.exists()


def test_a_checkpoint_of_another_modality_is_refused_in_one_sentence(tmp_path):
    """eval/infer of a diffusion or pairs run names the modality it needs, for another modality's checkpoint and
    for one another tool wrote alike; without a modality the saved config is read as it is."""
    config = {"modality": "image", "seed": 3, "model": {}, "strategy": {}, "data": {}}  # what every run's holds
    save({"onn": {"config": config}, "x": torch.zeros(1)}, tmp_path / "image.ckpt")
    save({"x": torch.zeros(1)}, tmp_path / "foreign.ckpt")
    assert saved_config(tmp_path / "image.ckpt")["seed"] == 3 and saved_config(tmp_path / "foreign.ckpt") == {}
    assert saved_config(tmp_path / "image.ckpt", "image")["modality"] == "image"
    for name in ("image", "foreign"):
        with pytest.raises(UserError, match=rf"ckpt .*{name}.ckpt was not written by a diffusion run; it cannot"):
            saved_config(tmp_path / f"{name}.ckpt", "diffusion")


def test_resolve_last_picks_newest(tmp_path):
    import os
    import time

    for name in ("a", "b"):
        save({"x": torch.zeros(1)}, tmp_path / name / "checkpoints" / "last.ckpt")
        time.sleep(0.01)
    os.utime(tmp_path / "a" / "checkpoints" / "last.ckpt" / "meta.json")
    assert resolve("last", tmp_path) == tmp_path / "a" / "checkpoints" / "last.ckpt"
    assert resolve(str(tmp_path / "b"), tmp_path) == tmp_path / "b" / "checkpoints" / "last.ckpt"


def test_no_pickle_in_the_package():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for path in [root / "run.py", *(root / "onn").rglob("*.py")]:
        text = path.read_text()
        assert "import pickle" not in text and "import joblib" not in text and "joblib.load" not in text, path
        for line in text.splitlines():
            if "torch.load(" in line and "weights_only=True" not in line and "st.save_file" not in line:
                pytest.fail(f"{path}: {line.strip()}")


def test_resumed_optim_is_the_checkpoints_and_says_which_of_the_configs_keys_go_unused(tmp_path, caplog):
    """The optimizer settings a resumed run builds its optimizer from, whose state the checkpoint holds."""
    from conftest import compose

    from onn.config import as_dict
    from onn.training.checkpoints import resumed_optim

    trained = compose("optim.name=sgd", "optim.lr=0.05", "optim.schedule=constant").optim
    config = {"modality": "text", "model": {}, "strategy": {}, "data": {}, "optim": as_dict(trained)}
    save({"onn": {"config": config}, "x": torch.zeros(1)}, tmp_path / "new.ckpt")
    save({"onn": {"config": {**config, "optim": None}}, "x": torch.zeros(1)}, tmp_path / "earlier.ckpt")
    given = compose("optim.lr=0.3").optim
    with caplog.at_level("WARNING", logger="onn"):
        assert resumed_optim(given, tmp_path / "new.ckpt") == trained
    assert "(optim.name=sgd, optim.lr=0.05, optim.schedule=constant); this run's optim.name=adamw, optim.lr=0.3" in (
        caplog.text
    )
    caplog.clear()
    assert resumed_optim(trained, tmp_path / "new.ckpt") == trained and not caplog.text
    assert resumed_optim(given, tmp_path / "earlier.ckpt") == given  # written before checkpoints held optim


@pytest.mark.slow  # two runs of the CLI: about 60 s on two busy cores
def test_a_resumed_run_trains_with_the_checkpoints_optimizer_and_says_the_configs_is_not_used(tmp_path):
    """ckpt= with another optim.name or optim.schedule than the checkpoint's failed with a KeyError ('momentum',
    'max_lr') after training had started: Lightning loaded the checkpoint's optimizer state into the config's
    optimizer. Another lr was silently not used, while the schedule's warm-up came from the config. The optimizer is
    the checkpoint's, as its model and strategy are, so `ckpt=RUN` alone resumes a run trained with SGD."""
    from conftest import read_metrics, run_cli

    common = [
        "model=llama_tiny",
        "tracking=none",
        "task.exact_match_samples=0",
        "task.validate_before=false",
        "data.builtin.train_size=16",
        "data.builtin.val_size=4",
        "trainer.enable_progress_bar=false",
        f"paths.outputs={tmp_path / 'outputs'}",
    ]
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    sgd = ["optim.name=sgd", "optim.schedule=constant", "optim.lr=0.05", "optim.warmup_steps=0"]
    trained = run_cli(*common, *sgd, "trainer.max_steps=2", f"hydra.run.dir={first}")
    assert trained.returncode == 0, trained.stderr[-2000:]
    proc = run_cli(*common, "trainer.max_steps=3", "optim.lr=0.3", f"ckpt={first}", f"hydra.run.dir={resumed}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = "the optimizer and its schedule are the checkpoint's (optim.name=sgd, optim.lr=0.05, optim.schedule=constant"
    assert said in proc.stdout and "this run's optim.name=adamw, optim.lr=0.3, optim.schedule=cosine" in proc.stdout
    assert read_metrics(resumed)["steps"] == 3
    checkpoint = load(resumed / "checkpoints" / "last.ckpt")
    assert checkpoint["onn"]["config"]["optim"]["name"] == "sgd"
    group = checkpoint["optimizer_states"][0]["param_groups"][0]
    assert group["lr"] == pytest.approx(0.05) and "momentum" in group


def test_a_failed_runs_record_keeps_the_last_step_it_reached(tmp_path, monkeypatch):
    """A run whose next checkpoint found the disk full had written its step-3 one, and its record said steps: null:
    the failed record did not read the last step reached, as the heartbeat and a signal's record do."""
    from onn.app import _finish_failed
    from onn.tasks.record import RunRecord
    from onn.training import progress

    monkeypatch.setattr(progress, "_last_step", 3)  # what the run's Progress callback said at its third step
    record = RunRecord(tmp_path, {"status": "running", "error": None, "task": "train", "steps": None})
    _finish_failed(record, f"cannot write {tmp_path}/checkpoints/last.ckpt: the disk is full")
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["status"] == "failed" and saved["steps"] == 3


@pytest.mark.slow  # 22-32 s on 2 cores (ci136)
def test_a_run_given_ckpt_does_not_write_into_another_runs_folder(tmp_path):
    """ckpt= turned the run folder's check off, whatever the task and whatever folder it named: an eval of a run's
    checkpoint into that run's own folder (its data.source missing) replaced the training's metrics.json, config.yaml
    and .hydra/, and a resume of run B into run A's folder replaced A's last.ckpt. Only the training that resumes
    the folder's own checkpoint may write into it; a run of another task never replaces a record."""
    from conftest import run_cli
    from omegaconf import OmegaConf

    from onn.tasks.record import refuse_earlier_run

    run_a, run_b = tmp_path / "a", tmp_path / "b"
    for run in (run_a, run_b):
        save({"x": torch.zeros(1)}, run / "checkpoints" / "last.ckpt")
        (run / "metrics.json").write_text(json.dumps({"status": "ok", "task": "train"}))
    files = lambda: {p: p.read_bytes() for p in sorted(run_a.rglob("*")) if p.is_file() and p.name != ".onn.lock"}  # noqa: E731
    before = files()
    common = ("tracking=none", f"paths.outputs={tmp_path}", f"hydra.run.dir={run_a}")
    for args, said in [
        (
            ("task=eval", f"ckpt={run_a}", f"data.source={tmp_path / 'missing.jsonl'}"),
            f"hydra.run.dir={run_a} holds an earlier run's checkpoints (last.ckpt) and its record, which this "
            "task=eval run would replace: choose another folder",
        ),
        (
            (f"ckpt={run_b}", "trainer.max_steps=3"),
            f"hydra.run.dir={run_a} holds an earlier run's checkpoints (last.ckpt) that this run would replace",
        ),
    ]:
        proc = run_cli(*args, *common)
        assert proc.returncode == 1 and said in proc.stderr, proc.stderr[-2000:]
    assert files() == before

    def check(folder, task: str, ckpt=None) -> None:
        config = {"ckpt": str(ckpt) if ckpt else None, "task": {"name": task}, "paths": {"outputs": str(tmp_path)}}
        refuse_earlier_run(folder, "hydra.run.dir", OmegaConf.create(config))

    check(run_a, "train", run_a)  # the resume of its own checkpoint: in
    check(run_a, "train", run_a / "checkpoints" / "last.ckpt")
    shutil.rmtree(run_a / "checkpoints")  # a training that failed before its first checkpoint: its record stays
    with pytest.raises(UserError, match=r"holds the record \(metrics.json\) of an earlier training run, which this"):
        check(run_a, "eval", run_b)
    check(run_a, "train")  # the training again: it had nothing to resume
    evaluated = tmp_path / "evaluated"
    evaluated.mkdir()
    (evaluated / "metrics.json").write_text(json.dumps({"status": "ok", "task": "eval"}))
    check(evaluated, "eval", run_a)  # an eval's record: replaced as before


@pytest.mark.slow  # three runs of the CLI, two of them training: about 90 s on two busy cores
def test_a_resumed_runs_val_loss_initial_and_a_failed_ckpt_runs_record_are_the_checkpoints(tmp_path):
    """A run with task.validate_before=false, resumed, reported its checkpoint's first periodic validation as
    val/loss_initial (a run that never stopped: null). A ckpt= run that failed once the checkpoint was read (a
    data.source that is not there) named the command line's defaults in its record (phi4_tiny, auto, no source),
    which the grids read, not the checkpoint's model it ran."""
    from conftest import read_metrics, run_cli

    common = ["tracking=none", "trainer.enable_progress_bar=false", f"paths.outputs={tmp_path / 'outputs'}"]
    train = ["model=llama_tiny", "task.exact_match_samples=0", "task.validate_before=false",
             "data.builtin.train_size=16", "data.builtin.val_size=4"]  # fmt: skip
    first, resumed, failed = tmp_path / "first", tmp_path / "resumed", tmp_path / "failed"
    proc = run_cli(*common, *train, "trainer.max_steps=2", "checkpoint.every_n_steps=1", f"hydra.run.dir={first}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    whole = read_metrics(first)
    assert whole["val/loss_initial"] is None and whole["val/loss_final"] is not None
    proc = run_cli(*common, *train, "trainer.max_steps=3", f"ckpt={first}", f"hydra.run.dir={resumed}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    again = read_metrics(resumed)
    assert again["steps"] == 3 and again["val/loss_initial"] is None and again["val/loss_final"] is not None
    missing = tmp_path / "missing.jsonl"
    proc = run_cli(*common, "task=eval", f"ckpt={first}", f"data.source={missing}", f"hydra.run.dir={failed}")
    assert proc.returncode == 1, proc.stderr[-2000:]
    record = read_metrics(failed)
    assert record["status"] == "failed" and str(missing) in record["error"]
    assert (record["model"], record["strategy"], record["data_source"]) == (
        "llama_tiny",
        whole["strategy"],
        str(missing),
    )
    assert record["checkpoint_used"] == str(first / "checkpoints" / "last.ckpt")
    assert record["from_checkpoint"] == {
        "model": "checkpoint",
        "strategy": "checkpoint",
        "data": "checkpoint, with data.source from the command line",
    }
