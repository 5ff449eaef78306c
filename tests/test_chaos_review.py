"""bench_chaos's own findings must say what happened: a resumed run whose weights turned NaN is not `exact`, a
checkpoint a resume would take is checked even when a kill left it as `last.ckpt.old`, a killed run that failed
on its own is the harness's finding (not a run that "ended first"), and a setting that cannot work is refused
before the first run, not after the earlier tracks' minutes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import compose

from onn.bench import chaos
from onn.errors import UserError
from onn.training import checkpoints


def _run_folder(folder: Path, weight: torch.Tensor, moment: torch.Tensor) -> Path:
    """A finished run as bench_chaos reads it: checkpoints/last.ckpt (weights, optimizer moments, step) and
    metrics.json."""
    state = {"state": {0: {"exp_avg": moment, "step": torch.tensor(8.0)}}, "param_groups": [{"lr": 0.1}]}
    checkpoint = {"state_dict": {"layer.weight": weight}, "optimizer_states": [state], "global_step": 8}
    checkpoints.save(checkpoint, folder / "checkpoints" / "last.ckpt")
    metrics = {"status": "ok", "steps": 8, "train/loss_curve": [2.0, 1.5, 1.2], "wall_s": 3.0}
    (folder / "metrics.json").write_text(json.dumps(metrics))
    return folder


def _outcome(tmp_path: Path, whole: tuple[torch.Tensor, torch.Tensor], resumed: tuple[torch.Tensor, torch.Tensor]):
    reference = chaos._final_state(_run_folder(tmp_path / "whole", *whole), sweep=False)
    return chaos._compare(reference, chaos._final_state(_run_folder(tmp_path / "resumed", *resumed), False), 1e-6)


def test_a_resumed_run_whose_weights_or_moments_turned_nan_is_mismatched_not_exact(tmp_path):
    """abs(a - b) of a NaN is NaN, and max(0.0, nan) is 0.0: a resumed run whose weights diverged counted as
    `exact`, bitwise the whole run's."""
    weight, moment = torch.tensor([[0.5, -1.0], [2.0, 0.25]]), torch.tensor([[0.1, 0.2], [0.3, 0.4]])
    nan_weight = weight.clone()
    nan_weight[0, 1] = float("nan")
    nan_moment = moment.clone()
    nan_moment[1, 0] = float("nan")
    assert _outcome(tmp_path / "a", (weight, moment), (nan_weight, moment)) == ("mismatched", None)
    assert _outcome(tmp_path / "b", (weight, moment), (weight, nan_moment)) == ("mismatched", None)
    # the same NaN and the same infinities in both runs are the same weights
    inf_moment = moment.clone()
    inf_moment[0, 0] = float("inf")
    assert _outcome(tmp_path / "c", (nan_weight, inf_moment), (nan_weight.clone(), inf_moment.clone())) == (
        "exact",
        0.0,
    )
    close = weight.clone()
    close[1, 1] += 1e-7
    outcome, diff = _outcome(tmp_path / "d", (weight, moment), (close, moment))
    assert outcome == "close" and 0 < diff <= 1e-6


def test_a_checkpoint_left_as_last_ckpt_old_is_what_a_resume_takes_and_is_checked(tmp_path):
    """Killed between a save's two renames, a run holds last.ckpt.old alone, which `ckpt=` resumes from: the kill
    was said to fall "before the first checkpoint", and a damaged .old was never counted corrupt."""
    killed = _run_folder(tmp_path / "killed", torch.ones(2, 2), torch.zeros(2, 2))
    ckpts = killed / "checkpoints"
    (ckpts / "last.ckpt").rename(ckpts / "last.ckpt.old")
    assert checkpoints.resolve(str(killed), tmp_path) == ckpts / "last.ckpt.old"  # what the resume loads
    assert chaos._where(killed, sweep=False) == "checkpoint write"
    assert chaos._corrupt(killed, sweep=False) == 0
    tensors = ckpts / "last.ckpt.old" / checkpoints.TENSORS
    tensors.write_bytes(tensors.read_bytes()[:40])  # truncated
    assert chaos._corrupt(killed, sweep=False) == 1


@pytest.mark.slow  # 14 s on 2 shared cores: the warm interpreter's start, and two runs
def test_a_killed_run_that_fails_on_its_own_is_the_harness_s_finding(tmp_path):
    """A run that ended with an error before its kill (or before its named kill point) was taken for one that
    finished first: tried again silently, and at last counted as a trial `finished before the kill`."""
    for kill in (120.0, "checkpoint_write:1"):
        folder = tmp_path / f"killed_{'point' if isinstance(kill, str) else 'timed'}"
        proc = chaos._start(["trainer.max_steps=-5"], folder, sweep=False)  # refused before any model is built
        with pytest.raises(UserError, match=rf"^bench_chaos: the run in {folder} ended with 1; its console ends: "):
            chaos._kill_at(proc, kill, folder, sweep=False, timeout_s=300.0)
        assert not proc.is_alive()


@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("task.tracks.image.data=imagez", r"^task\.tracks\.image\.data=imagez: give one of images, audio, jsonl"),
        ("task.kill_to=1.5", r"^task\.kill_to=1\.5: a share, give a number from 0 to 1\."),
        ("task.server.clients=0", r"^task\.server\.clients=0: give 1 or more\."),
        ("task.server.drop_share=0.98", r"^task\.server\.drop_share=0\.98 and malformed_share=0\.05 add up to more"),
        ("task.timeout_s=0", r"^task\.atol=1e-06 and task\.timeout_s=0: give"),
    ],
)
def test_a_setting_that_cannot_work_is_refused_before_the_first_run(override, said):
    """A misspelt data kind failed the bench only at its track's turn, after every earlier track's runs (minutes);
    task.server.clients=0 after every track, as ThreadPoolExecutor's traceback."""
    with pytest.raises(UserError, match=said):
        chaos.check_settings(compose("recipe=bench_chaos", override).task)
    chaos.check_settings(compose("recipe=bench_chaos").task)  # the recipe itself passes
