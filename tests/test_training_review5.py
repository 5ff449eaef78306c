"""The optimizer builder at its edges: settings torch refuses with a traceback, and a model with nothing to train."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from conftest import compose

from onn.errors import UserError
from onn.training.optim import check, make_optimizer, make_schedule


class Regression(L.LightningModule):
    """A one-layer regression trained with ONN's optimizer and schedule (the optim group) over 4 steps."""

    def __init__(self, optim):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.optim = optim

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        optimizer = make_optimizer([p for p in self.parameters() if p.requires_grad], self.optim)
        return {"optimizer": optimizer, "lr_scheduler": make_schedule(optimizer, self.optim, 4, "val/loss")}


def fit(module: Regression) -> None:
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=2)
    trainer = L.Trainer(
        max_steps=4, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=data)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("optim.name=sgd", "optim.momentum=0", "optim.nesterov=true"), "optim.nesterov=true needs a momentum"),
        (("optim.schedule=plateau", "optim.gamma=1"), "optim.gamma=1 with optim.schedule=plateau"),
    ],
    ids=["nesterov-without-momentum", "plateau-factor-1"],
)
def test_optimizer_settings_torch_refuses_are_one_sentence_before_the_run(overrides, message):
    """SGD refused Nesterov without momentum, and ReduceLROnPlateau a factor of 1, each with a ValueError from
    inside Lightning's fit once the data and model were built: optim's check (run before anything is built)
    passed both."""
    optim = compose(*overrides).optim
    with pytest.raises(UserError, match=message):
        check(optim)
    with pytest.raises(UserError, match=message):
        fit(Regression(optim))


def test_a_model_with_nothing_to_train_is_one_sentence():
    """Every weight frozen: torch's "optimizer got an empty parameter list" from inside Lightning's fit. A model
    with weights to train still trains."""
    optim = compose("optim.schedule=constant", "optim.warmup_steps=0").optim
    with pytest.raises(UserError, match="no trainable parameter"):
        fit(Regression(optim).requires_grad_(False))
    module = Regression(optim)
    before = module.layer.weight.detach().clone()
    fit(module)
    assert not torch.equal(module.layer.weight, before)


@pytest.mark.slow  # a two-job sweep in a run.py process: about 30 s on 2 cores
def test_a_sweeps_job_failing_before_its_first_step_reports_no_step_of_the_job_before(tmp_path):
    """A multirun's jobs run one after another in one process, and the last step a training loop reached was kept
    across them: a job refused before its first step recorded the previous job's last step in its metrics.json."""
    import json

    from conftest import run_cli

    sweep = tmp_path / "sweep"
    proc = run_cli(
        "-m",
        "model=llama_tiny",
        "data.builtin.train_size=64",
        "data.builtin.val_size=16",
        "tracking=none",
        "trainer.max_steps=3",
        "task.validate_before=false",
        "task.exact_match_samples=0",
        "optim.lr=0.001,-1",
        f"paths.outputs={tmp_path / 'outputs'}",
        f"hydra.sweep.dir={sweep}",
    )
    jobs = {json.loads(p.read_text())["status"]: json.loads(p.read_text()) for p in sweep.glob("*/metrics.json")}
    assert set(jobs) == {"ok", "failed"}, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert jobs["ok"]["steps"] == 3
    assert "optim.lr" in jobs["failed"]["error"] and jobs["failed"].get("steps") is None
