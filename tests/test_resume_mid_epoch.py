"""A classifier run that trainer.max_steps stopped, resumed with `ckpt=RUN_DIR` and a larger trainer.max_steps: it
trains the steps an unbroken run of that many steps trains, with the same losses, whether it stopped within an epoch
or at an epoch's end, on resident or on streamed data.

Lightning counts an epoch that max_steps cut short as processed and completed, and the checkpoint written after fit
kept it so: resumed after 6 of 18 steps (4 a epoch), the run took the interrupted epoch for finished, trained a short
next epoch from that epoch's order (2 steps, then validated at step 8) and ran 6 epochs where the unbroken run ran 5,
with other losses from step 6 on (onn.training.callbacks.NextEpochAfterFit now restarts the interrupted epoch)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from test_streamed_resume import STREAMED
from test_vision_train import make_images, run

from onn.data.resident import held_out_share
from onn.training.checkpoints import load, read_meta

DATA = {"resident": ("data.resident=true",), "streamed": STREAMED}
STEPS = 18  # 17 training images of 21 (val_split 0.25, seed 0) in batches of 4: 4 steps an epoch (1 image left over)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Every run on one torch thread: the plan sizes torch's threads to the cores other processes leave free, and a
    run on 2 threads sums in another order than one on 1 (their losses parted at the fourth decimal)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        yield


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    """7 images a class: the seed-0 split (a hash of each name, see held_out_share) trains on 17 of the 21, 4 full
    batches of 4 an epoch, which the step figures below (stops at 6 and 8, validations at 4, 8, 12, 16) rely on."""
    names = [f"class{c}/{i:03d}.png" for c in range(3) for i in range(7)]
    assert sum(held_out_share(0, n) >= 0.25 for n in names) == 17
    return make_images(tmp_path_factory.mktemp("images"), train=7, test=1)


def steps_run(tmp: Path, images: Path, data: str, max_steps: int, *more: str, name: str) -> tuple[dict, list[float]]:
    """A run of the image classifier to trainer.max_steps (no epoch limit): its metrics and its per-step losses, as its
    final last.ckpt records them (a resumed run's include the steps before its resume)."""
    metrics, run_dir = run(
        tmp,
        *DATA[data],
        f"data.source={images}",
        "data.num_workers=0",
        "data.batch_size=4",
        "optim.schedule=constant",
        "trainer.max_epochs=-1",
        f"trainer.max_steps={max_steps}",
        *more,
        name=name,
    )
    return metrics, read_meta(run_dir / "checkpoints" / "last.ckpt")["onn"]["train_losses"]


@pytest.fixture(scope="module")
def unbroken(images, tmp_path_factory) -> Callable[[str], tuple[dict, list[float]]]:
    """A kind of data's unbroken run of STEPS steps, run once for the cases that compare with it."""
    tmp, done = tmp_path_factory.mktemp("unbroken"), {}

    def whole(data: str) -> tuple[dict, list[float]]:
        if data not in done:
            done[data] = steps_run(tmp, images, data, STEPS, name=data)
        return done[data]

    return whole


@pytest.mark.parametrize(
    ("data", "stop"),
    [
        # three runs through the runner each (~25-30 s), the unbroken run shared with the cases of its data: the
        # slow tier, which CI runs too (the fast suite stays under 10 minutes on 2 cores)
        pytest.param("resident", 6, id="resident-mid-epoch", marks=pytest.mark.slow),
        pytest.param("streamed", 6, id="streamed-mid-epoch", marks=pytest.mark.slow),
        pytest.param("resident", 8, id="resident-epoch-end", marks=pytest.mark.slow),
        pytest.param("streamed", 8, id="streamed-epoch-end", marks=pytest.mark.slow),
    ],
)
def test_a_run_stopped_by_max_steps_resumes_to_the_unbroken_runs_steps_and_losses(
    images, unbroken, tmp_path, data, stop
):
    """Stopped after step 6 (the second epoch's second of 4 batches) or 8 (the second epoch's end), then resumed to
    STEPS: the unbroken run's step count, epochs, validations and per-step losses."""
    whole, whole_losses = unbroken(data)
    first, _ = steps_run(tmp_path, images, data, stop, name="first")
    resumed, losses = steps_run(tmp_path, images, data, STEPS, f"ckpt={tmp_path / 'first'}", name="resumed")
    assert first["steps"] == stop and resumed["resumed_from"]
    assert whole["steps"] == resumed["steps"] == STEPS and resumed["epochs"] == whole["epochs"] == 5
    assert [h["step"] for h in resumed["val/history"]] == [4, 8, 12, 16]
    assert resumed["val/history"] == whole["val/history"]
    assert losses == pytest.approx(whole_losses, abs=1e-6) and len(losses) == STEPS


@pytest.mark.slow  # three runs through the runner (~25 s a kind of data), and the unbroken run
@pytest.mark.parametrize("data", ["resident", "streamed"])
def test_a_resume_with_no_step_left_records_and_keeps_the_stopped_run(images, unbroken, tmp_path, data):
    """Resumed with the trainer.max_steps it stopped at (within an epoch), a run trains nothing: it records the
    stopped run's epochs and losses, and its checkpoint keeps the stopped run's random generators (restored, never
    set, since training never started: it had saved the generators as the run's setup left them) and its place in
    the data (the loader, never iterated, had saved the first epoch's first batch): a run resumed from it trains the
    unbroken run's remaining steps."""
    first, first_losses = steps_run(tmp_path, images, data, 6, name="first")
    same, same_losses = steps_run(tmp_path, images, data, 6, f"ckpt={tmp_path / 'first'}", name="same")
    assert same["resumed_from"] and same["steps"] == 6 and same["epochs"] == first["epochs"] == 2
    assert same_losses == first_losses
    stopped, kept = (
        load(tmp_path / r / "checkpoints" / "last.ckpt")["callbacks"]["RandomState"] for r in ("first", "same")
    )
    assert torch.equal(kept["torch"], stopped["torch"]) and torch.equal(kept["numpy"]["keys"], stopped["numpy"]["keys"])
    assert kept["python"] == stopped["python"]
    whole, whole_losses = unbroken(data)
    resumed, losses = steps_run(tmp_path, images, data, STEPS, f"ckpt={tmp_path / 'same'}", name="resumed")
    assert resumed["steps"] == STEPS and resumed["epochs"] == whole["epochs"] == 5
    assert resumed["val/history"] == whole["val/history"]
    assert losses == pytest.approx(whole_losses, abs=1e-6)
