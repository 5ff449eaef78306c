"""A classifier whose data is streamed from disk (over data.resident_max_mb) resumed from a checkpoint: it trains the
unbroken run's batches, in the unbroken run's order, with any data.num_workers.

The streamed loader shuffled with its own RandomSampler on the loader's generator, which every new iterator also drew
its workers' base seed from: with data.num_workers=0 each epoch starts a new iterator, and a resumed run (which starts
others) shuffled its later epochs otherwise (resumed after the first of 3 epochs, its val/loss was 0.739 at the third
epoch against 0.970 unbroken). With workers, a run resumed at an epoch's end trained the next epoch in another order
too. Epoch e is now shuffled by seed + e, and a resumed run goes on from its place in that order."""

from __future__ import annotations

import shutil
from pathlib import Path

import lightning as L
import pytest
from conftest import compose
from test_resident_ddp import OPTIM, norm_first_cnn
from test_vision_train import make_images, run

STREAMED = ("data.resident=auto", "data.resident_max_mb=0.001")  # 27 images of 0.75 KB decoded: over it


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return make_images(tmp_path_factory.mktemp("images"), train=8, test=1)


class Seen(L.Callback):
    """Each training step's batch, as the pixel sums of its images; a copy of last.ckpt as it stood after each step
    in `keep` (StepCheckpoint writes it after every step, an epoch's last one at the epoch's end)."""

    def __init__(self, folder: Path, keep: tuple[int, ...] = ()):
        self.folder, self.keep = folder, keep
        self.batches: list[tuple[int, list[int]]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step = trainer.global_step
        if step in self.keep:
            shutil.copytree(self.folder / "last.ckpt", self.folder / f"step{step}.ckpt")
        self.batches.append((step, batch[0].flatten(1).long().sum(1).tolist()))


def fit(images: Path, folder: Path, workers: int, keep: tuple[int, ...] = (), ckpt: Path | None = None) -> Seen:
    """Three epochs of the image classifier on streamed data (4 steps each), checkpointed after every step."""
    from onn.modalities import get
    from onn.training.callbacks import StepCheckpoint
    from onn.training.checkpoint_io import SafetensorsCheckpointIO
    from onn.training.classifier import Classifier

    config = compose(
        "data=image",
        *STREAMED,
        f"data.source={images}",
        f"paths.cache={folder / 'cache'}",
        f"data.num_workers={workers}",
        "data.batch_size=4",
        "data.val_split=0.54",  # seed 0 draws 8 of these 24 names under 0.54 (held_out_share): 16 train
        root=folder,
    )
    data = get("image").datamodule(config, "cpu")
    data.setup()
    assert data.streamed and len(data.streamed["train"][1]) == 16  # 24 less the 8 held out: 4 batches an epoch
    seen = Seen(folder, keep)
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=3,
        logger=False,
        limit_val_batches=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[SafetensorsCheckpointIO()],
        callbacks=[StepCheckpoint(folder, every_n_steps=1), seen],
    )
    module = Classifier(norm_first_cnn(len(data.classes)), data.classes, OPTIM, {})
    # the schedule's length given, as the runner gives it: Lightning's estimate sets the data up before a resumed
    # run's loop state is restored, and never gives the loader its place back (onn.training.trainer.optimizer_steps)
    module.optimizer_steps = 12
    trainer.fit(module, datamodule=data, ckpt_path=ckpt)
    return seen


@pytest.mark.parametrize("workers", [0, 1])
def test_a_streamed_run_resumed_mid_epoch_or_at_an_epochs_end_trains_the_unbroken_runs_batches(
    images, tmp_path, workers
):
    """Resumed from within the first epoch, at its end and from within the second: each step from there on trains
    the batch the unbroken run trained at that step. A loader with workers draws its first batches' indices when
    Lightning starts its iterator, before Lightning sets the sampler's epoch: the resumed epoch's own order all the
    same."""
    whole = fit(images, tmp_path / "whole", workers, keep=(2, 4, 6)).batches
    assert [step for step, _ in whole] == list(range(12))
    assert len({tuple(batch) for _, batch in whole[:4]} | {tuple(batch) for _, batch in whole[4:8]}) == 8
    for step in (2, 4, 6):
        resumed = fit(images, tmp_path / f"from{step}", workers, ckpt=tmp_path / "whole" / f"step{step}.ckpt")
        assert resumed.batches == whole[step:], f"resumed after step {step}"


@pytest.mark.slow  # three runs through the runner: ~30 s
def test_a_streamed_run_resumed_after_its_first_epoch_validates_as_the_unbroken_run(images, tmp_path):
    """ckpt=RUN_DIR of a 1-epoch run given trainer.max_epochs=3: the same val/loss at every epoch as a 3-epoch run."""
    common = (
        *STREAMED,
        f"data.source={images}",
        "data.num_workers=0",
        "data.batch_size=4",
        "optim.lr=0.01",
        "optim.schedule=constant",
        "data.mean=[0.5,0.5,0.5]",
        "data.std=[0.25,0.25,0.25]",
    )
    whole, _ = run(tmp_path, *common, "trainer.max_epochs=3", name="whole")
    first, run_dir = run(tmp_path, *common, "trainer.max_epochs=1", name="first")
    resumed, _ = run(tmp_path, *common, "trainer.max_epochs=3", f"ckpt={run_dir}", name="resumed")
    assert whole["resident"] is False and resumed["resumed_from"]
    assert [h["epoch"] for h in resumed["val/history"]] == [0, 1, 2]
    assert resumed["val/history"] == whole["val/history"]


def _place(workers: int, shuffle: bool) -> dict:
    """A streamed loader's saved place after one batch: EpochShuffle's (shuffle false), or a loader shuffling with
    torchdata's RandomSampler, as ONN's did before EpochShuffle (shuffle true)."""
    import torch

    from onn.data.resident import EpochShuffle, StreamedLoader

    sampler = None if shuffle else EpochShuffle(12, 0)
    loader = StreamedLoader(list(range(12)), batch_size=2, shuffle=shuffle, sampler=sampler, num_workers=workers)
    next(iter(loader))
    state = loader.state_dict()
    assert torch.is_tensor(next(iter(loader)))  # (the place is a copy: the loader goes on)
    return state


def test_a_place_another_loader_kept_is_one_sentence_or_a_fresh_epoch(caplog):
    """torchdata asserted, with no message, on a checkpoint of another data.num_workers, and on one of an earlier ONN
    (its RandomSampler's place): the first is refused naming the key, the second trains its epoch from the start."""
    from onn.data.resident import EpochShuffle, StreamedLoader
    from onn.errors import UserError

    def fresh(workers: int) -> StreamedLoader:
        return StreamedLoader(list(range(12)), batch_size=2, sampler=EpochShuffle(12, 0), num_workers=workers)

    for saved, now in ((0, 1), (1, 0), (1, 2)):
        loader = fresh(now)
        with pytest.raises(UserError) as e:
            loader.load_state_dict(_place(saved, shuffle=False))
        assert str(e.value) == (
            f"the checkpoint's streamed data ran with data.num_workers={saved}; resume with the same "
            f"data.num_workers (not {now})."
        )
    for workers in (0, 1):
        loader = fresh(workers)
        loader.load_state_dict(_place(workers, shuffle=True))
        assert sorted(int(i) for batch in loader for i in batch) == list(range(12))  # the whole epoch, no assertion
        assert "trains from its first batch again" in caplog.text
    loader = fresh(0)
    loader.load_state_dict(_place(0, shuffle=False))  # its own place: goes on after the first batch
    assert len([int(i) for batch in loader for i in batch]) == 10
