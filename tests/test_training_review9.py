"""The training loop at its edges: a checkpoint saved with one parameter group resumed now that weight decay makes
two, the per-epoch schedules' warm-up, and train/loss_final weighted by each step's samples."""

from __future__ import annotations

import copy
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import compose

from onn.training import optim as onn_optim
from onn.training.callbacks import StepCheckpoint
from onn.training.checkpoint_io import SafetensorsCheckpointIO
from onn.training.checkpoints import load
from onn.training.classifier import Classifier

torch.manual_seed(0)
NETWORK = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def data(samples: int, batch_size: int) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(samples, 6, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :3].argmax(1)), batch_size=batch_size)


def classifier(*overrides: str) -> Classifier:
    optim = compose("optim.name=adamw", "optim.clip_grad_norm=0", *overrides).optim
    return Classifier(copy.deepcopy(NETWORK), ["a", "b", "c"], optim, {}, monitor="train/loss")


def trainer(max_steps: int, *callbacks: L.Callback, max_epochs: int = -1) -> L.Trainer:
    return L.Trainer(
        max_steps=max_steps, max_epochs=max_epochs, accelerator="cpu", devices=1, logger=False,
        callbacks=list(callbacks), enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=any(isinstance(c, L.pytorch.callbacks.Checkpoint) for c in callbacks),
        plugins=[SafetensorsCheckpointIO()],
    )  # fmt: skip


class Rates(L.Callback):
    """The learning rate of every parameter group as each optimizer step starts, and each parameter's optimizer
    state as training starts (after a resume has restored it)."""

    def __init__(self):
        self.rates: list[list[float]] = []
        self.state_at_start: dict[str, dict[str, torch.Tensor]] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        state = trainer.optimizers[0].state
        self.state_at_start = {n: {k: v.clone() for k, v in state[p].items()} for n, p in pl_module.named_parameters()}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.rates.append([group["lr"] for group in trainer.optimizers[0].param_groups])


def one_group(params: list, weight_decay: float) -> list[dict]:
    """The parameter groups ONN made before commit 372c8ca: every parameter in one group, decayed alike."""
    return [{"params": params, "weight_decay": weight_decay}]


def test_a_checkpoint_saved_with_one_parameter_group_resumes_into_two(tmp_path: Path, monkeypatch):
    """A run saved before weight decay left biases and norms had one parameter group; resumed now (two groups)
    Lightning stopped in torch's ValueError ("a different number of parameter groups"). Each parameter's saved
    momenta now reach it in whichever group holds it, and both groups follow the resumed schedule."""
    settings = ("optim.lr=0.05", "optim.weight_decay=0.1", "optim.schedule=cosine", "optim.warmup_steps=2")
    old = classifier(*settings)
    with monkeypatch.context() as patch:
        patch.setattr(onn_optim, "decay_groups", one_group)
        first = trainer(3)
        first.fit(old, train_dataloaders=data(48, 16))
    first.save_checkpoint(tmp_path / "old.ckpt")
    saved = load(tmp_path / "old.ckpt")["optimizer_states"][0]
    assert len(saved["param_groups"]) == 1  # a real checkpoint as those runs wrote it

    rates = Rates()
    resumed = classifier(*settings)
    trainer(6, rates).fit(resumed, train_dataloaders=data(48, 16), ckpt_path=tmp_path / "old.ckpt")
    names = [n for n, _ in resumed.named_parameters()]  # the saved group's order
    for index, name in zip(saved["param_groups"][0]["params"], names, strict=True):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(rates.state_at_start[name][key], saved["state"][index][key]), (name, key)
    groups = resumed.trainer.optimizers[0].param_groups
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert all(len(set(r)) == 1 for r in rates.rates)  # the two groups at one rate, step after step
    assert rates.rates[0][0] > rates.rates[-1][0] > 0  # the cosine falling along the resumed steps
    assert len(resumed.train_losses) == 6


@pytest.mark.parametrize("schedule", ["step", "plateau"])
def test_per_epoch_schedules_warm_up_over_optim_warmup_steps(schedule: str):
    """optim.schedule=step and plateau trained their first step at the full rate whatever optim.warmup_steps said
    (20 by default): the rate now rises linearly over the warm-up's optimizer steps, and the epoch schedule's
    factor multiplies it (StepLR halves it after each epoch here)."""
    rates = Rates()
    module = classifier("optim.lr=0.1", f"optim.schedule={schedule}", "optim.warmup_steps=3", "optim.step_size=1",
                        "optim.gamma=0.5", "optim.patience=5")  # fmt: skip
    trainer(8, rates).fit(module, train_dataloaders=data(16, 4))  # 4 steps an epoch
    got = [round(r[0], 6) for r in rates.rates]
    rising = [0.025, 0.05, 0.075, 0.1]
    assert got == (rising + [0.05] * 4 if schedule == "step" else rising + [0.1] * 4)


class StopAfter(L.Callback):
    """Ends fit after `steps` optimizer steps of a longer run, as a run killed after its step checkpoint."""

    def __init__(self, steps: int):
        self.steps = steps

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        trainer.should_stop = trainer.global_step >= self.steps


def test_a_warm_up_resumed_half_way_goes_on_from_where_it_stopped(tmp_path: Path):
    """The warm-up's progress is saved with the epoch schedule: a run stopped after 2 of its 3 warm-up steps resumes
    at the rates the unbroken run has."""
    settings = ("optim.lr=0.1", "optim.schedule=step", "optim.warmup_steps=3", "optim.step_size=1", "optim.gamma=0.5")
    unbroken = Rates()
    trainer(8, unbroken).fit(classifier(*settings), train_dataloaders=data(16, 4))
    first = trainer(8, StopAfter(2))
    first.fit(classifier(*settings), train_dataloaders=data(16, 4))
    first.save_checkpoint(tmp_path / "half.ckpt")
    resumed = Rates()
    trainer(8, resumed).fit(classifier(*settings), train_dataloaders=data(16, 4), ckpt_path=tmp_path / "half.ckpt")
    assert resumed.rates[0][0] == pytest.approx(0.075)  # the third of the 3 warm-up steps
    assert [r[0] for r in resumed.rates] == pytest.approx([r[0] for r in unbroken.rates[2:]])


def test_the_final_loss_weights_each_step_by_its_samples():
    """train/loss_final was the plain mean of the last steps' mean losses: 10 samples in batches of 4 make steps of
    4, 4 and 2, and the short last batch counted as much as a full one. With lr=0 the weights never move, so the
    mean loss per sample over the epoch is the network's loss over all 10 samples at once."""
    module = classifier("optim.lr=0", "optim.schedule=constant", "optim.warmup_steps=0")
    loader = data(10, 4)
    trainer(-1, max_epochs=1).fit(module, train_dataloaders=loader)
    x, y = loader.dataset.tensors
    with torch.no_grad():
        whole = float(torch.nn.functional.cross_entropy(module.model(x), y))
    assert module.train_rows == [4, 4, 2]
    assert module.final_loss() == pytest.approx(whole, rel=1e-5)


def test_a_step_checkpoint_holds_each_loss_beside_its_samples(tmp_path):
    """StepCheckpoint saves in its batch-end hook, which Lightning calls before the module's: the samples were
    recorded there, so a checkpoint at step 4 held 4 losses and 3 sample counts, and the resumed run weighted
    every later step by the step before it."""
    settings = ("optim.schedule=constant", "optim.warmup_steps=0")
    saved = classifier(*settings)
    trainer(4, StepCheckpoint(tmp_path, 4)).fit(saved, train_dataloaders=data(10, 4))  # step 4: mid-epoch
    onn = load(tmp_path / "last.ckpt")["onn"]
    assert onn["train_rows"] == [4, 4, 2, 4] and len(onn["train_losses"]) == 4
    resumed, seen = classifier(*settings), Batches()
    trainer(9, seen).fit(resumed, train_dataloaders=data(10, 4), ckpt_path=tmp_path / "last.ckpt")
    assert len(resumed.train_losses) == 9 and resumed.train_rows == [4, 4, 2, 4, *seen.sizes]


class Batches(L.Callback):
    """The samples of each batch trained."""

    def __init__(self):
        self.sizes: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.sizes.append(len(batch[0]))
