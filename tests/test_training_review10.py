"""The training layer at resume: early stopping's patience after a resume is the resumed run's own."""

from __future__ import annotations

import copy
from pathlib import Path

import lightning as L
import torch
from conftest import compose

from onn.training.callbacks import run_callbacks
from onn.training.checkpoint_io import SafetensorsCheckpointIO
from onn.training.classifier import Classifier

torch.manual_seed(0)
NETWORK = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def data(samples: int, seed: int) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 6, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :3].argmax(1)), batch_size=16)


def fit_until_stopped(run_dir: Path, patience: int, ckpt: Path | None = None) -> L.Trainer:
    """A classifier at lr 0 (its val/loss never improves) fitted through ONN's epoch callbacks, with early stopping
    on val/loss after `patience` validations, resumed from `ckpt` when given; its last.ckpt saved after fit."""
    config = compose("optim.lr=0", "optim.clip_grad_norm=0", f"task.early_stopping={{patience: {patience}}}")
    module = Classifier(copy.deepcopy(NETWORK), ["a", "b", "c"], config.optim, {}, monitor="val/loss")
    trainer = L.Trainer(
        max_epochs=12, max_steps=-1, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, plugins=[SafetensorsCheckpointIO()],
        callbacks=run_callbacks(config, run_dir, "val/loss", "min"),
    )  # fmt: skip
    trainer.fit(module, data(32, 1), data(16, 2), ckpt_path=str(ckpt) if ckpt else None)
    trainer.save_checkpoint(str(run_dir / "checkpoints" / "last.ckpt"), weights_only=False)
    return trainer


def test_a_run_stopped_early_resumes_with_the_patience_it_is_given(tmp_path: Path):
    """Lightning restored the checkpoint's patience over task.early_stopping.patience: a run stopped early (patience
    1) and resumed with patience 4 to train on stopped again after one epoch. Resumed, it keeps the validations
    without improvement it had counted (1) and stops when they reach its own patience: 3 epochs later."""
    stopped = fit_until_stopped(tmp_path / "first", patience=1)
    assert stopped.current_epoch == 2  # the first validation sets the best, the second does not improve on it
    resumed = fit_until_stopped(tmp_path / "second", patience=4, ckpt=tmp_path / "first" / "checkpoints" / "last.ckpt")
    assert resumed.current_epoch - stopped.current_epoch == 3
    assert resumed.early_stopping_callback.patience == 4


def test_validating_after_every_step_picks_the_best_of_every_validation(tmp_path: Path):
    """trainer.val_check_interval=1 with check_val_every_n_epoch=1: Lightning's ModelCheckpoint took the whole number
    1 for 1.0 (a whole epoch) and weighed only each epoch's last validation, so best.ckpt and its score missed a
    better validation within the epoch. Here the rate is so high that the training overshoots after its first step."""
    config = compose("optim.name=sgd", "optim.lr=40", "optim.clip_grad_norm=0", "optim.schedule=constant")
    module = Classifier(copy.deepcopy(NETWORK), ["a", "b", "c"], config.optim, {}, monitor="val/loss")
    trainer = L.Trainer(
        max_epochs=1, max_steps=-1, val_check_interval=1, check_val_every_n_epoch=1, accelerator="cpu", devices=1,
        logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        plugins=[SafetensorsCheckpointIO()], callbacks=run_callbacks(config, tmp_path, "val/loss", "min"),
    )  # fmt: skip
    trainer.fit(module, data(48, 1), data(16, 2))
    losses = [h["val/loss"] for h in module.history]
    assert len(losses) == 3 and min(losses) < losses[-1]  # the best validation is not the epoch's last
    assert round(float(trainer.checkpoint_callback.best_model_score), 5) == min(losses)
