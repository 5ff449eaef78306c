"""A resumed run's run_best against faults: the earlier run killed between the two renames of its best.ckpt save
(only best.ckpt.old left), run_best itself killed at each step of copying the earlier best.ckpt over this run's
(SIGKILL, as a failing machine would), and a disk that refuses the copy."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
from kill_harness import killed_at
from lightning.pytorch.callbacks import ModelCheckpoint
from test_faults import files_limited_to

from onn.errors import UserError
from onn.training.checkpoints import META, TENSORS, load, run_best, save

HISTORY = [{"step": 4, "val/loss": 0.5}, {"step": 8, "val/loss": 0.7}]  # the earlier run's best: step 4, 0.5


def _runs(tmp_path: Path, size: int = 4) -> tuple[Path, Path, ModelCheckpoint]:
    """An earlier run (best.ckpt: weights 4.0, val/loss 0.5) and a run resumed from its last.ckpt into a folder of
    its own, whose own best.ckpt (weights 12.0) scored a worse 0.9, with the callback its fit leaves."""
    earlier, resumed = tmp_path / "earlier" / "checkpoints", tmp_path / "resumed" / "checkpoints"
    save(
        {"state_dict": {"w": torch.full((size,), 8.0)}, "global_step": 8, "onn": {"history": HISTORY}},
        earlier / "last.ckpt",
    )
    save({"state_dict": {"w": torch.full((size,), 4.0)}, "global_step": 4}, earlier / "best.ckpt")
    save({"state_dict": {"w": torch.full((size,), 12.0)}, "global_step": 12}, resumed / "best.ckpt")
    callback = ModelCheckpoint(dirpath=resumed, monitor="val/loss", mode="min")
    callback.best_model_path, callback.best_model_score = str(resumed / "best.ckpt"), torch.tensor(0.9)
    return earlier, resumed, callback


def _weight(path: Path) -> float:
    """The weight a whole checkpoint folder holds (both its files there, loaded)."""
    assert {p.name for p in path.iterdir()} == {TENSORS, META}, f"{path} is not a whole checkpoint"
    return load(path)["state_dict"]["w"][0].item()


def test_an_earlier_best_left_as_best_ckpt_old_by_a_kill_stays_the_runs_best(tmp_path):
    """A kill between save()'s renames of best.ckpt left the earlier run only best.ckpt.old: run_best looked for
    best.ckpt alone, and the resumed run reported its own worse checkpoint (0.9) as the run's best."""
    earlier, resumed, callback = _runs(tmp_path)
    (earlier / "best.ckpt").rename(earlier / "best.ckpt.old")  # the state SIGKILL leaves between the renames
    path, score = run_best(callback, earlier / "last.ckpt", tmp_path / "resumed", "val/loss", "min")
    assert (path, score) == (str(resumed / "best.ckpt"), 0.5)
    assert _weight(resumed / "best.ckpt") == 4.0  # the earlier run's weights, copied in


def test_run_best_killed_at_any_step_of_its_copy_leaves_a_whole_best_checkpoint(tmp_path):
    """Killed before each of its changes to the file system in turn, run_best leaves this run's best.ckpt whole, or
    (killed between its renames) best.ckpt.old whole: its own weights or the earlier run's, never a half folder.
    It removed this run's best.ckpt file by file before renaming the copy in: a kill there left half of one."""
    seen, step = set(), 0
    while True:
        step += 1
        earlier, resumed, callback = _runs(tmp_path / f"step{step}")
        killed = killed_at(step, partial(run_best, callback, earlier / "last.ckpt", resumed.parent, "val/loss", "min"))
        best = resumed / "best.ckpt"
        seen.add(_weight(best if best.exists() else best.with_name("best.ckpt.old")))
        if not killed:
            break
    assert _weight(best) == 4.0 and sorted(p.name for p in resumed.iterdir()) == ["best.ckpt"]
    assert seen == {4.0, 12.0} and step > 4  # kills landed before the swap and after it


def test_a_disk_that_refuses_the_copy_of_the_earlier_best_is_one_sentence(tmp_path):
    """A full disk while run_best copied the earlier best.ckpt in came out, after all the training, as copytree's
    shutil.Error (a list of tuples, no errno), and left best.ckpt.tmp behind. A file size limit refuses the write
    here as a full disk would, with no file system to mount: one sentence naming best.ckpt, this run's own best.ckpt
    untouched, nothing staged left."""
    earlier, resumed, callback = _runs(tmp_path, size=64 * 1024)  # 256 kB of tensors, past the limit
    with files_limited_to(64 * 1024), pytest.raises(UserError, match=r"^cannot write .*best\.ckpt: .*elsewhere\.$"):
        run_best(callback, earlier / "last.ckpt", tmp_path / "resumed", "val/loss", "min")
    assert sorted(p.name for p in resumed.iterdir()) == ["best.ckpt"] and _weight(resumed / "best.ckpt") == 12.0


def test_a_run_resumed_into_its_own_folder_takes_back_its_best_ckpt_old(tmp_path):
    """Resumed into its own folder (a sweep's job, a requeued SLURM job) after a kill between the renames of its
    best.ckpt save, the run has only best.ckpt.old there: run_best found no best.ckpt and reported no best at all."""
    earlier, _, _ = _runs(tmp_path)
    (earlier / "best.ckpt").rename(earlier / "best.ckpt.old")
    callback = ModelCheckpoint(dirpath=earlier, monitor="val/loss", mode="min")  # this run saved no best of its own
    path, score = run_best(callback, earlier / "last.ckpt", earlier.parent, "val/loss", "min")
    assert (path, score) == (str(earlier / "best.ckpt"), 0.5) and _weight(earlier / "best.ckpt") == 4.0
    assert sorted(p.name for p in earlier.iterdir()) == ["best.ckpt", "last.ckpt"]


def test_ckpt_last_is_the_newest_checkpoint_even_when_it_lost_its_tensors(tmp_path):
    """ckpt=last took the newest last.ckpt with both files, so a newest one that lost model.safetensors was passed
    over for an older run's, silently; it is found, and loading it says what is missing."""
    import os

    from onn.training.checkpoints import META, TENSORS, resolve

    older, newer = (tmp_path / run / "checkpoints" / "last.ckpt" for run in ("older", "newer"))
    for folder in (older, newer):
        folder.mkdir(parents=True)
        (folder / META).write_text("{}")
    (older / TENSORS).write_bytes(b"")
    os.utime(older / META, (1, 1))
    assert resolve("last", tmp_path) == newer
