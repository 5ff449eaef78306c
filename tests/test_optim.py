"""The one optimizer and schedule builder, as every LightningModule uses it."""

from __future__ import annotations

import pytest
import torch
from conftest import compose
from transformers import LlamaConfig, LlamaForCausalLM

from onn.errors import UserError
from onn.modalities.text.module import CausalLM
from onn.training.classifier import Classifier
from onn.training.optim import check, make_optimizer, make_schedule


def language_model(optim: dict, max_steps: int = 10) -> CausalLM:
    config = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    return CausalLM(LlamaForCausalLM(config), optim, max_steps=max_steps, onn_config={}, micro_batch=2)


def classifier(optim: dict, monitor: str) -> Classifier:
    return Classifier(torch.nn.Linear(4, 3), ["a", "b", "c"], optim, {}, monitor=monitor)


class _Trainer:  # what configure_optimizers reads from Lightning's Trainer
    estimated_stepping_batches = 10


def test_sgd_momentum_and_nesterov_reach_every_module():
    optim = compose("optim.name=sgd", "optim.momentum=0.5", "optim.nesterov=true").optim
    lm = language_model(optim).configure_optimizers()["optimizer"]
    module = classifier(optim, "val/acc")
    module.trainer = _Trainer()
    cnn = module.configure_optimizers()["optimizer"]
    for optimizer in (lm, cnn):
        group = optimizer.param_groups[0]
        assert isinstance(optimizer, torch.optim.SGD) and group["momentum"] == 0.5 and group["nesterov"] is True


@pytest.mark.parametrize("monitor, mode", [("val/loss", "min"), ("val/acc", "max")])
def test_plateau_schedule_watches_task_monitor(monitor, mode):
    optim = compose("optim.schedule=plateau").optim
    module = classifier(optim, monitor)
    module.trainer = _Trainer()
    schedule = module.configure_optimizers()["lr_scheduler"]
    assert schedule["monitor"] == monitor and schedule["scheduler"].mode == mode


def test_warmup_longer_than_the_run_is_clamped_to_it():
    optim = compose("optim.schedule=linear", "optim.warmup_steps=100", "optim.lr=0.1").optim
    scheduler = language_model(optim, max_steps=10).configure_optimizers()["lr_scheduler"]["scheduler"]
    rates = []
    for _ in range(10):
        rates.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    # warming up over the whole run, towards the peak: step s at (s + 1) / 11 of it, none at 0 (make_schedule)
    assert rates == sorted(rates) and rates[0] > 0 and rates[-1] == pytest.approx(0.1 * 10 / 11)


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.lr=-1", "optim.lr=-1"),
        ("optim.warmup_steps=-5", "optim.warmup_steps=-5"),
        ("optim.schedule=wobbly", "optim.schedule='wobbly'"),
        ("optim.name=lion", "optim.name='lion'"),
        ("optim.step_size=0", "optim.step_size=0"),
    ],
)
def test_bad_optim_settings_are_one_sentence(override, message):
    with pytest.raises(UserError, match=message.replace("[", r"\[")):
        check(compose(override).optim)


def test_per_epoch_schedules_refuse_a_run_without_epochs():
    optim = compose("optim.schedule=step").optim
    optimizer = make_optimizer([torch.nn.Parameter(torch.zeros(1))], optim)
    with pytest.raises(UserError, match="without epochs"):
        make_schedule(optimizer, optim, 10, "val/loss", epochs=False)


@pytest.mark.parametrize("schedule", ["cosine", "plateau"])
def test_a_resumed_optimizer_steps_at_the_rate_its_schedule_had_reached(tmp_path, schedule):
    """DeepSpeed's optimizer state is not in ONN's checkpoint, and a scheduler's restored state sets no rate: a
    resumed run's optimizer stepped at the rate it was built with (0 under a warm-up; the first rate after a
    plateau's reductions) until restore_learning_rates set the one the saved schedule had reached."""
    from lightning.pytorch.utilities.types import LRSchedulerConfig

    from onn.training.checkpoints import load, save
    from onn.training.distributed import restore_learning_rates

    optim = compose("optim.warmup_steps=5", f"optim.schedule={schedule}", "optim.patience=0").optim

    def built():
        weights = [torch.nn.Parameter(torch.ones(3))]
        optimizer = make_optimizer(weights, optim)
        return optimizer, make_schedule(optimizer, optim, 20, "val/loss")["scheduler"]

    optimizer, scheduler = built()
    for _ in range(8):
        optimizer.step()
        if schedule == "plateau":
            scheduler.step(1.0)  # the loss never falls: each epoch cuts the rate
        else:
            scheduler.step()
    reached = scheduler.get_last_lr()
    save({"lr_schedulers": [scheduler.state_dict()]}, tmp_path / "last.ckpt")  # as ONN's CheckpointIO writes it
    states = load(tmp_path / "last.ckpt")["lr_schedulers"]
    optimizer, scheduler = built()
    scheduler.load_state_dict(states[0])  # what Lightning restores
    if schedule == "plateau":  # transformers' schedules set their step's rate as they load (follows_this_run)
        assert [g["lr"] for g in optimizer.param_groups] != reached
    restore_learning_rates([LRSchedulerConfig(scheduler)], states)
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx(reached) and reached[0] < optim.lr
