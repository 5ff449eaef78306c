"""The training layer's eleventh review: a run of one step at the configured rate, the earlier best train/loss kept
by a run resumed into a new folder, and under DDP the ranks' mean train/loss and a schedule counted before the data
is set up."""

from __future__ import annotations

import copy
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import compose
from test_distributed_review import two_ranks

from onn.training.callbacks import run_callbacks
from onn.training.checkpoint_io import SafetensorsCheckpointIO
from onn.training.checkpoints import load, run_best
from onn.training.classifier import Classifier

torch.manual_seed(0)
NETWORK = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def data(samples: int, seed: int, random_labels: bool = False) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 6, generator=g)
    y = torch.randint(0, 3, (samples,), generator=g) if random_labels else x[:, :3].argmax(1)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


def fit(run_dir: Path, config, epochs: int, train, ckpt: Path | None = None) -> tuple[L.Trainer, Classifier]:
    """A classifier fitted through ONN's epoch callbacks with best.ckpt by train/loss, logged at every step."""
    module = Classifier(copy.deepcopy(NETWORK), ["a", "b", "c"], config.optim, {}, monitor="train/loss")
    trainer = L.Trainer(
        max_epochs=epochs, max_steps=-1, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, log_every_n_steps=1, plugins=[SafetensorsCheckpointIO()],
        callbacks=run_callbacks(config, run_dir, "train/loss", "min"),
    )  # fmt: skip
    trainer.fit(module, train, data(16, 9), ckpt_path=str(ckpt) if ckpt else None)
    trainer.save_checkpoint(str(run_dir / "checkpoints" / "last.ckpt"), weights_only=False)
    return trainer, module


def test_a_run_of_one_step_trains_at_the_configured_rate(tmp_path: Path):
    """optim.warmup_steps (20 by default) clamped to a run of one step (trainer.max_steps=1, a smoke test) was a
    warm-up of one step, whose first step transformers' schedule trains at rate 0: the step changed no weight."""
    config = compose("optim.schedule=cosine", "optim.warmup_steps=20", "optim.clip_grad_norm=0")
    module = Classifier(copy.deepcopy(NETWORK), ["a", "b", "c"], config.optim, {})
    before = [p.detach().clone() for p in module.parameters()]
    trainer = L.Trainer(
        max_steps=1, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_checkpointing=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(module, data(32, 1))
    assert trainer.global_step == 1
    assert all(not torch.equal(a, b.detach()) for a, b in zip(before, module.parameters()))


def test_a_run_resumed_into_a_new_folder_keeps_the_earlier_best_train_loss(tmp_path: Path):
    """task.monitor=train/loss: the validation history holds no train/loss, so a run resumed into a new folder never
    compared with the earlier run's best.ckpt and took its own best, here a worse one (it trains on random labels)."""
    config = compose("optim.schedule=constant", "optim.warmup_steps=0", "optim.lr=0.03", "optim.clip_grad_norm=0")
    first, _ = fit(tmp_path / "first", config, 6, data(64, 1))
    earlier = float(first.checkpoint_callback.best_model_score)
    ckpt = tmp_path / "first" / "checkpoints" / "last.ckpt"
    second, module = fit(tmp_path / "second", config, 8, data(64, 2, random_labels=True), ckpt=ckpt)
    own = float(second.checkpoint_callback.best_model_score)
    assert own > earlier  # this run's best is worse than the earlier run's
    path, score = run_best(second.checkpoint_callback, ckpt, tmp_path / "second", "train/loss", "min")
    assert path == str(tmp_path / "second" / "checkpoints" / "best.ckpt")
    assert score == pytest.approx(earlier, abs=1e-5)
    kept = load(path)["state_dict"]
    original = load(tmp_path / "first" / "checkpoints" / "best.ckpt")["state_dict"]
    assert all(torch.equal(kept[k], original[k]) for k in original)


_DDP_LOSSES_RANK = """
import json, sys
import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset
sys.path.insert(0, "tests")
from conftest import compose
from onn.training.checkpoints import load
from onn.training.checkpoint_io import SafetensorsCheckpointIO
from onn.training.classifier import Classifier
from onn.training.trainer import data_parallel, optimizer_steps


class OwnLosses(L.Callback):
    monitor = "train/loss"  # a reader of train/loss: each step logs it (logs_now)

    def __init__(self):
        self.own, self.logged = [], []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.own.append(float(outputs["loss"]))  # this rank's own share's loss
        self.logged.append(float(trainer.callback_metrics["train/loss"]))


folder = sys.argv[2]
config = compose("strategy=ddp", "trainer.devices=2", "optim.clip_grad_norm=0", "optim.warmup_steps=0")
torch.manual_seed(0)
network = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
g = torch.Generator().manual_seed(1)
x = torch.randn(16, 6, generator=g)
losses = OwnLosses()
trainer = L.Trainer(
    accelerator="cpu", devices=2, strategy=data_parallel("ddp", config, "cpu"), max_epochs=2, max_steps=-1,
    callbacks=[losses], logger=False, enable_checkpointing=False, enable_progress_bar=False,
    enable_model_summary=False, log_every_n_steps=1, limit_val_batches=0, plugins=[SafetensorsCheckpointIO()],
)
module = Classifier(network, ["a", "b", "c"], config.optim, {}, monitor="train/loss")
trainer.fit(module, DataLoader(TensorDataset(x, torch.randint(0, 3, (16,), generator=g)), batch_size=4))
trainer.save_checkpoint(folder + "/last.ckpt", weights_only=False)
print(json.dumps({
    "own": losses.own, "logged": losses.logged, "kept": [float(v) for v in module.train_losses],
    "rows": module.train_rows, "saved": load(folder + "/last.ckpt")["onn"]["train_losses"],
    "schedule": optimizer_steps(trainer, 2, per_process=True), "lightning": trainer.estimated_stepping_batches,
}))
"""


@pytest.mark.slow  # two fresh interpreters import torch and Lightning and fit under DDP: ~25 s
def test_under_ddp_the_losses_are_the_ranks_mean_and_the_schedule_is_counted_per_rank(tmp_path: Path):
    """Each rank trains on its own share, so its loss is its share's: the logged train/loss (what a checkpoint or early
    stopping on train/loss compares), the checkpoint's losses and train/loss_initial/final were rank 0's alone. And
    with several processes the schedule's length came from Lightning's estimated_stepping_batches, which sets the
    data up before a resumed run's loop state is restored (a run killed mid-epoch started the epoch over):
    optimizer_steps counts one rank's share (2 batches of 4 of 16 samples on 2 ranks, 2 epochs) as Lightning does."""
    outs = two_ranks(_DDP_LOSSES_RANK, str(tmp_path))
    mean = [(a + b) / 2 for a, b in zip(outs[0]["own"], outs[1]["own"], strict=True)]
    assert len(mean) == 4 and outs[0]["own"] != outs[1]["own"]
    for out in outs:
        assert out["kept"] == pytest.approx(mean, abs=1e-6)
        assert out["logged"] == pytest.approx(mean, abs=1e-6)
        assert out["saved"] == pytest.approx(mean, abs=1e-6)
        assert out["rows"] == [8, 8, 8, 8]
        assert out["schedule"] == out["lightning"] == 4
