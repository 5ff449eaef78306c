"""Faults a run must come through as if nothing happened, or say in one sentence: a resumed classifier picks the
whole run's best checkpoint, bench_chaos sees every figure that differs, a disk that refuses a write, a signal in the
middle of a checkpoint's renames."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import resource
import signal
from pathlib import Path

import pytest
import torch
from conftest import compose, read_metrics, run_cli

from onn.errors import UserError
from onn.training.checkpoints import load, read_meta, save


@contextlib.contextmanager
def files_limited_to(size: int):
    """This process may write no file past `size` bytes: a write past it is refused (EFBIG) as a full disk refuses
    one (ENOSPC), with no file system to mount. SIGXFSZ, which would end the process, is ignored meanwhile."""
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def test_a_resumed_run_keeps_the_earlier_runs_best_checkpoint_on_a_tie(tmp_path):
    """A classifier resumed with ckpt= whose own best val/acc only equalled the earlier run's kept its own best.ckpt
    (step 12), where the run never stopped keeps the first of equal scores (step 6), as Lightning does: its val/loss,
    scored on the best checkpoint, was 3e-05 against 0.63534. A score of its own that is better still wins; one equal
    to the history's (5 digits) is a tie, whatever float32 makes of it (0.6 is 0.6000000238)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from onn.training.checkpoints import run_best

    earlier, resumed = tmp_path / "earlier" / "checkpoints", tmp_path / "resumed" / "checkpoints"
    history = [{"epoch": 0, "step": 6, "val/acc": 0.6, "val/loss": 0.63534}]
    save({"state_dict": {"w": torch.zeros(1)}, "global_step": 6}, earlier / "best.ckpt")
    save({"state_dict": {"w": torch.zeros(1)}, "global_step": 6, "onn": {"history": history}}, earlier / "last.ckpt")
    cases = [("val/acc", "max", 0.6, 6), ("val/loss", "min", 0.63534, 6), ("val/acc", "max", 0.75, 12)]
    for monitor, mode, own, kept_step in [*cases, ("val/loss", "min", 0.5, 12)]:
        save({"state_dict": {"w": torch.ones(1)}, "global_step": 12}, resumed / "best.ckpt")  # this run's own best
        callback = ModelCheckpoint(dirpath=resumed, monitor=monitor, mode=mode)
        callback.best_model_path, callback.best_model_score = str(resumed / "best.ckpt"), torch.tensor(own)
        path, score = run_best(callback, earlier / "last.ckpt", tmp_path / "resumed", monitor, mode)
        assert path == str(resumed / "best.ckpt") and read_meta(path)["global_step"] == kept_step, (monitor, own)
        assert score == (history[0][monitor] if kept_step == 6 else pytest.approx(own))


def finished_run(folder: Path, val_loss: float, best_step: int = 6) -> Path:
    """A run folder as a finished classifier run leaves it: last and best checkpoints, and its metrics.json."""
    checkpoints = folder / "checkpoints"
    state = {"state_dict": {"w": torch.ones(3)}, "optimizer_states": [{"state": {0: {"exp_avg": torch.ones(3)}}}]}
    save({**state, "global_step": 18}, checkpoints / "last.ckpt")
    save({**state, "global_step": best_step}, checkpoints / "best.ckpt")
    history = [{"epoch": e, "step": 6 * (e + 1), "val/acc": 1.0} for e in range(3)]
    metrics = {
        "status": "ok",
        "steps": 18,
        "val/acc_best": 1.0,
        "val/history": history,
        "val/loss": val_loss,
        "checkpoint": str(checkpoints / "last.ckpt"),
        "checkpoint_best": str(checkpoints / "best.ckpt"),
        "wall_s": float(len(str(folder))),  # measured: a figure of its own in each run
        "samples_per_s": 10.0 + len(str(folder)),
        "peak_memory_mb": 500.0 + len(str(folder)),
    }
    (folder / "metrics.json").write_text(json.dumps(metrics))
    return folder


def test_bench_chaos_sees_a_resumed_run_that_ends_with_another_validation_figure(tmp_path):
    """bench_chaos compared a resumed run's last checkpoint and its metrics.json keys only: a classifier that resumed
    to another best checkpoint, and so another val/loss, was 'exact'. Its figures (all but paths in its own folder,
    timings and memory) and its best checkpoint's step are compared too."""
    from onn.bench.chaos import _compare, _final_state

    whole = _final_state(finished_run(tmp_path / "whole", 0.63534), sweep=False)
    assert _compare(whole, _final_state(finished_run(tmp_path / "same_run", 0.63534), False), 0.0) == ("exact", 0.0)
    other_val = _final_state(finished_run(tmp_path / "other_val", 3e-05), False)
    assert _compare(whole, other_val, 0.0) == ("mismatched", pytest.approx(0.63531))  # val/loss: 3e-05, not 0.63534
    assert _compare(whole, other_val, 1.0) == ("close", pytest.approx(0.63531))  # within a loose task.atol
    other_best = _final_state(finished_run(tmp_path / "other_best", 0.63534, best_step=12), False)
    assert _compare(whole, other_best, 1.0) == ("mismatched", None)


@pytest.mark.slow
def test_a_classifier_killed_and_resumed_ends_with_the_whole_runs_best_checkpoint(tmp_path, monkeypatch):
    """docs/outputs.md: a run killed and resumed ends with the same numbers as one that never stopped. The image
    classifier's validations all scored val/acc 1.0: the resumed run took its own first best (step 12), the whole
    run its first (step 6), so val/loss (the best checkpoint's) was 3e-05 against 0.63543; bench_chaos saw neither."""
    from onn.bench.chaos import _compare, _final_state
    from onn.bench.chaos_data import generate

    common = [
        *generate("images", tmp_path / "data", 0),
        "data=image",
        "model=v28_cnn",
        "data.batch_size=16",
        "trainer.max_epochs=3",
        "trainer.max_steps=-1",
        "checkpoint.every_n_steps=3",
        "tracking=none",
        f"paths.outputs={tmp_path / 'outputs'}",
    ]
    whole = run_cli(*common, f"hydra.run.dir={tmp_path / 'whole'}")
    assert whole.returncode == 0, whole.stderr[-2000:]
    monkeypatch.setenv("ONN_FAILPOINT", "checkpoint_write:4")  # SIGKILL inside the 4th checkpoint write
    killed = run_cli(*common, f"hydra.run.dir={tmp_path / 'killed'}")
    monkeypatch.delenv("ONN_FAILPOINT")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert read_meta(tmp_path / "killed" / "checkpoints" / "last.ckpt")["global_step"] == 6  # after one validation
    resumed = run_cli(*common, f"ckpt={tmp_path / 'killed'}", f"hydra.run.dir={tmp_path / 'resumed'}")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a, b = read_metrics(tmp_path / "whole"), read_metrics(tmp_path / "resumed")
    assert a["val/history"] == b["val/history"] and len({h["val/acc"] for h in a["val/history"]}) == 1  # ties
    best = [read_meta(tmp_path / run / "checkpoints" / "best.ckpt")["global_step"] for run in ("whole", "resumed")]
    assert best == [6, 6] and a["val/loss"] == b["val/loss"]
    outcome, _ = _compare(_final_state(tmp_path / "whole", False), _final_state(tmp_path / "resumed", False), 1e-6)
    assert outcome in ("exact", "close")


def test_a_text_file_the_disk_refuses_is_one_sentence_and_leaves_no_part(tmp_path):
    """write_text_atomically (hardware profiles, tuning results, an export's pipeline.json, a run's config.yaml and
    plan.yaml) let the OSError through as a traceback and left its NAME.PID.tmp behind."""
    from onn.hardware.disk import write_text_atomically

    path = tmp_path / "profile.json"
    write_text_atomically(path, "{}")
    with files_limited_to(1024), pytest.raises(UserError) as refused:
        write_text_atomically(path, "x" * 4096)
    assert str(refused.value) == f"cannot write {path}: File too large; write it elsewhere."
    assert [p.name for p in tmp_path.iterdir()] == ["profile.json"] and path.read_text() == "{}"


def test_a_decoded_data_cache_the_disk_refuses_is_a_warning_and_the_run_goes_on(tmp_path, caplog):
    """A folder of images decoded on a full disk failed the run with safetensors' raw SafetensorError ("No space left
    on device (os error 28)"); the decoded data is all the run needs: it goes on uncached, said once."""
    from onn.data.cache import cached_decode
    from onn.data.resident import Decoded

    def decode() -> dict[str, Decoded]:
        return {"all": Decoded(torch.zeros(4, 65536), torch.tensor([0, 1, 0, 1]), ["a", "b"], ["w", "x", "y", "z"])}

    with files_limited_to(64 * 1024), caplog.at_level(logging.WARNING, logger="onn"):
        decoded = cached_decode("images", {"k": 1}, tmp_path, decode, "src")
    assert decoded["all"].inputs.shape == (4, 65536) and decoded["all"].names == ["w", "x", "y", "z"]
    (warning,) = [r.getMessage() for r in caplog.records if "not cached" in r.getMessage()]
    assert warning.startswith(f"images: the decoded data is not cached: cannot write {tmp_path / 'images'}/")
    assert warning.endswith("File too large; write the cache (paths.cache) elsewhere.")
    assert [
        p for p in (tmp_path / "images").iterdir() if not p.name.startswith(".")
    ] == []  # no part of the file (its lock and mark aside)


def test_a_runs_config_yaml_the_disk_refuses_is_one_sentence_and_leaves_no_part(tmp_path):
    """A run started on a nearly full disk failed on its config.yaml (or plan.yaml) with pathlib's OSError and left
    it empty or cut short; they are written whole or not at all, in one sentence naming the file."""
    from onn.app import execute

    config = compose("task=plan", f"paths.outputs={tmp_path / 'outputs'}", f"paths.cache={tmp_path / 'cache'}")
    run_dir = tmp_path / "run"
    with files_limited_to(512), pytest.raises(UserError) as refused:
        execute(config, run_dir)
    said = f"cannot write {run_dir / 'config.yaml'}: File too large; write the run (hydra.run.dir) elsewhere."
    assert str(refused.value) == said and list(run_dir.iterdir()) == []


def test_a_signal_between_a_checkpoints_renames_waits_for_the_second(tmp_path, monkeypatch):
    """save() held SIGTERM and SIGINT around its two renames with pthread_sigmask, which holds them for one thread:
    the kernel gave the signal to another (the record's heartbeat) and Python ran the run's handler in the main
    thread between the renames, leaving last.ckpt.old and last.ckpt.tmp and no last.ckpt. The handler now runs once
    the renames are done: the run stops as it would, with its new checkpoint whole."""
    from onn.tasks.record import Interrupted, RunRecord

    path = tmp_path / "checkpoints" / "last.ckpt"
    save({"state_dict": {"w": torch.zeros(2)}, "global_step": 1}, path)
    record = RunRecord(tmp_path, {"status": "running", "error": None, "task": "train"})
    record.start()  # SIGTERM raises Interrupted from here on; its heartbeat is the thread the kernel may pick
    arrived, wake = os.pipe()
    os.set_blocking(wake, False)
    rename = Path.rename

    def rename_then_sigterm(self: Path, target: Path) -> Path:
        moved = rename(self, target)
        if Path(target).name == "last.ckpt.old":  # the first rename: `timeout` or a pre-emption sends SIGTERM now
            os.kill(os.getpid(), signal.SIGTERM)
            os.read(arrived, 1)  # a thread of this process took it: Python runs the handler at its next chance
        return moved

    monkeypatch.setattr(Path, "rename", rename_then_sigterm)
    before = signal.set_wakeup_fd(wake)
    try:
        with pytest.raises(Interrupted):
            save({"state_dict": {"w": torch.ones(2)}, "global_step": 2}, path)
    finally:
        signal.set_wakeup_fd(before)
        monkeypatch.undo()
        record.interrupted(signal.SIGTERM)
        os.close(arrived)
        os.close(wake)
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"]
    assert load(path)["global_step"] == 2 and read_metrics(tmp_path)["signal"] == "SIGTERM"
