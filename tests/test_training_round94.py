"""Training under review: a monitored train/loss was an old step's (best.ckpt and early stopping compared a stale
value), a failed resume into a run's own folder replaced its finished record, trainer.devices=-1 on a CPU was
Lightning's TypeError after planning, two checkpoint tensors could share one name, and last.ckpt was written twice at
every validation."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import read_metrics, run_cli
from torch import nn

from onn.errors import UserError
from onn.tasks.record import RunRecord
from onn.training.callbacks import ThisRunsPatience, epoch_checkpoints
from onn.training.checkpoint_io import SafetensorsCheckpointIO
from onn.training.checkpoints import load, save, saved_score
from onn.training.module import ONNModule
from onn.training.record import log_train_loss

TINY = ["model=llama_tiny", "hardware=cpu_16gb", "tracking=none"]


class Regression(ONNModule):
    """A linear model fit to one batch: its loss falls at every step."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 1)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = ((self.net(x) - y) ** 2).mean()
        self.losses.append(float(loss))
        log_train_loss(self, loss, x.shape[0])
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        x, y = batch
        self.log("val/loss", ((self.net(x) - y) ** 2).mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.02)


class CountingIO(SafetensorsCheckpointIO):
    """ONN's checkpoint IO, noting each write (step, file name) before it writes."""

    def __init__(self):
        self.writes: list[tuple[int, str]] = []

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        self.writes.append((checkpoint["global_step"], Path(path).name))
        super().save_checkpoint(checkpoint, path, storage_options)


def fit(folder: Path, monitor: str, callbacks: list, io: SafetensorsCheckpointIO, steps: int, every: int) -> Regression:
    """`steps` steps on the same batch, validating every `every` steps, train/loss logged every 10th step."""
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    batch = (x, x.sum(1, keepdim=True))
    module = Regression()
    trainer = L.Trainer(
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*epoch_checkpoints(folder, monitor, "min", 4), *callbacks],
        plugins=[io],
        log_every_n_steps=10,
        val_check_interval=every,
        num_sanity_val_steps=0,
    )
    loader = torch.utils.data.DataLoader  # batch_size=None: each item is a whole batch
    trainer.fit(module, loader([batch] * steps, batch_size=None), loader([batch], batch_size=None))
    return module


def test_a_monitored_train_loss_is_each_steps_own(tmp_path: Path):
    """task.monitor=train/loss: early stopping (patience 2, a validation every 2 steps) stopped a run whose loss fell
    at every step, and best.ckpt's score was step 0's loss (train/loss refreshed every 10th step only)."""
    stop = ThisRunsPatience("train/loss", mode="min", patience=2, min_delta=0.0, check_on_train_epoch_end=False)
    module = fit(tmp_path, "train/loss", [stop], SafetensorsCheckpointIO(), steps=12, every=2)
    assert len(module.losses) == 12, "early stopping stopped a run whose loss fell at every step"
    assert all(a > b for a, b in zip(module.losses, module.losses[1:]))
    best = tmp_path / "checkpoints" / "best.ckpt"
    assert saved_score(best, "train/loss") == pytest.approx(module.losses[-1], rel=1e-6)
    # Lightning's callback state keys hold '/' ("ModelCheckpoint{'monitor': 'train/loss', ...}"): still stored whole
    states = load(best)["callbacks"]
    assert any("train/loss" in key for key in states)


def test_last_ckpt_is_written_once_per_validation(tmp_path: Path):
    """epoch_checkpoints' ModelCheckpoint of last.ckpt and StepCheckpoint both wrote last.ckpt at every validation."""
    io = CountingIO()
    fit(tmp_path, "val/loss", [], io, steps=12, every=4)
    lasts = [step for step, name in io.writes if name == "last.ckpt"]
    assert lasts == [4, 8, 12]
    assert load(tmp_path / "checkpoints" / "last.ckpt")["global_step"] == 12


@pytest.mark.parametrize(
    "extra",
    [{1: torch.ones(2), "1": torch.zeros(2)}, {"a/b": torch.full((2,), 5.0), "a": {"b": torch.full((2,), 7.0)}}],
)
def test_two_tensors_of_one_name_are_refused(tmp_path: Path, extra: dict):
    """Tensors are named by their '/'-joined path: the second of one name replaced the first, silently."""
    with pytest.raises(ValueError, match="is taken by another tensor"):
        save({"state_dict": {"w": torch.ones(1)}, "extra": extra}, tmp_path / "x.ckpt")
    assert not (tmp_path / "x.ckpt").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="-1 is every GPU on a GPU machine")
def test_devices_minus_one_on_a_cpu_is_one_sentence():
    """trainer.devices=-1 on a CPU passed the check and ended in Lightning's TypeError after planning."""
    from conftest import compose

    from onn.training.trainer import check

    trainer = compose(*TINY, "trainer.devices=-1").trainer
    with pytest.raises(UserError, match=r"trainer\.devices=-1 means every GPU.*trainer\.devices=1"):
        check(trainer)
    check(trainer, launches=False)  # task=plan plans for any machine: -1 is every GPU of the planned one
    with pytest.raises(UserError, match=r"trainer\.devices=-1 means every GPU"):
        check(trainer, planned="cpu")  # a CPU preset runs on the CPU, GPU or not
    check(trainer, planned="cuda")  # a GPU preset: its own sentence where there is no GPU (_accelerator), not this


def test_a_record_is_kept_only_for_a_run_that_never_started(tmp_path: Path):
    """A run failing before `start` leaves an earlier ok record; once started, its failure is the record."""
    earlier = {"status": "ok", "error": None, "task": "train", "val/acc_best": 0.93}
    (tmp_path / "metrics.json").write_text(json.dumps(earlier))
    RunRecord(tmp_path, {"status": "running", "error": None}).finish(status="failed", error="a typo")
    assert read_metrics(tmp_path) == earlier
    started = RunRecord(tmp_path, {"status": "running", "error": None})
    started.start()
    started.finish(status="failed", error="out of memory")
    assert read_metrics(tmp_path)["error"] == "out of memory"


@pytest.mark.slow
def test_a_failed_resume_into_its_own_folder_keeps_the_finished_record(tmp_path: Path):
    """`run.py task=train ckpt=RUN hydra.run.dir=RUN +trainer.max_stpes=100`: the typo's failed record replaced the
    finished run's figures. Now the error is said, the run exits 1 and metrics.json is the finished run's."""
    run = tmp_path / "runX"
    save({"state_dict": {"w": torch.arange(4.0)}, "global_step": 50}, run / "checkpoints" / "last.ckpt")
    earlier = {"status": "ok", "error": None, "task": "train", "steps": 50, "train/loss_final": 0.12}
    (run / "metrics.json").write_text(json.dumps(earlier))
    proc = run_cli(
        "task=train", f"ckpt={run}", f"hydra.run.dir={run}", "+trainer.max_stpes=100", *TINY,
        f"paths.outputs={tmp_path / 'outputs'}",
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-2000:]
    assert "max_stpes" in output
    assert read_metrics(run) == earlier
