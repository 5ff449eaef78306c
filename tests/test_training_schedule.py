"""The learning-rate schedule's warm-up and length, as real runs step it: no step trains at rate 0, the full rate
comes after optim.warmup_steps steps, and a classifier run's schedule spans exactly the optimizer steps it takes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import compose
from test_streamed_resume import STREAMED
from test_vision_train import make_images, run

from onn.training.checkpoints import read_meta
from onn.training.optim import make_schedule

LR = 0.1


def stepped_rates(schedule: str, warmup: int, total: int, resume_at: int | None = None) -> list[float]:
    """The rate each of a `total`-step run's optimizer steps trained at (then the rate after its last step): a tiny
    regression's AdamW stepped by make_schedule's scheduler as Lightning steps it (a step interval's after each
    optimizer step; an epoch interval's never, the run being shorter than an epoch). With
    `resume_at`, the optimizer and schedule are saved after that many steps and loaded into fresh ones, as a
    resumed run's are."""
    optim = compose(f"optim.schedule={schedule}", f"optim.warmup_steps={warmup}", f"optim.lr={LR}").optim
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 3, generator=gen)
    y = x.sum(1, keepdim=True)

    def built() -> tuple[torch.nn.Linear, torch.optim.Optimizer, dict]:
        layer = torch.nn.Linear(3, 1)
        optimizer = torch.optim.AdamW(layer.parameters(), lr=LR)
        return layer, optimizer, make_schedule(optimizer, optim, total, "val/loss")

    layer, optimizer, scheduler = built()
    rates = []
    for step in range(total):
        if step == resume_at:
            saved = (layer.state_dict(), optimizer.state_dict(), scheduler["scheduler"].state_dict())
            layer, optimizer, scheduler = built()
            layer.load_state_dict(saved[0])
            optimizer.load_state_dict(saved[1])  # Lightning's order: the optimizer, then its schedule
            scheduler["scheduler"].load_state_dict(saved[2])
        rates.append(optimizer.param_groups[0]["lr"])
        before = layer.weight.detach().clone()
        torch.nn.functional.mse_loss(layer(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        if scheduler["interval"] == "step":  # a per-epoch schedule's warm-up steps with the optimizer
            scheduler["scheduler"].step()
        assert not torch.equal(layer.weight, before), f"step {step} changed no weight"
    return [*rates, optimizer.param_groups[0]["lr"]]


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_warm_up_starts_above_zero_and_reaches_the_full_rate_after_its_steps(schedule):
    """transformers' warm-up trained a run's first optimizer step at rate 0 (it changed nothing) and reached the full
    rate one step late; step s now trains at lr x (s + 1) / (warmup + 1), as the per-epoch schedules' warm-up does,
    and the decay after it is transformers' over the run, ending at 0 after the last step."""
    warmup, total = 3, 10
    rates = stepped_rates(schedule, warmup, total)
    assert rates[:warmup] == pytest.approx([LR * (s + 1) / (warmup + 1) for s in range(warmup)])
    assert rates[warmup] == pytest.approx(LR)
    decay = [(s - warmup) / (total - warmup) for s in range(warmup, total + 1)]  # progress through the decay
    expected = {
        "cosine": [LR * 0.5 * (1 + math.cos(math.pi * p)) for p in decay],
        "linear": [LR * (1 - p) for p in decay],
        "constant": [LR] * len(decay),
    }[schedule]
    assert rates[warmup:] == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant", "step"])
def test_a_run_shorter_than_its_warm_up_trains_every_step(schedule):
    """A 4-step smoke run with optim.warmup_steps=100: the warm-up, clamped to the run, trained its first step at 0;
    every step now trains, rising towards the rate (and a 1-step run trains at half of it, where it trained at 0
    before the clamp dropped one-step warm-ups)."""
    rates = stepped_rates(schedule, 100, 4)[:4]
    assert rates == pytest.approx([LR * (s + 1) / 5 for s in range(4)])
    assert stepped_rates(schedule, 100, 1)[0] == pytest.approx(LR / 2)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_a_run_resumed_mid_warm_up_goes_on_at_the_unbroken_runs_rates(schedule):
    """The schedule's state is its step count; a run resumed after 2 of 4 warm-up steps trains its third step at
    3/5 of the rate (transformers' own warm-up: 2/4) and every later one as the unbroken run does."""
    unbroken = stepped_rates(schedule, 4, 8)
    resumed = stepped_rates(schedule, 4, 8, resume_at=2)
    assert resumed[2] == pytest.approx(LR * 3 / 5)
    assert resumed == pytest.approx(unbroken)


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return make_images(tmp_path_factory.mktemp("images"), train=8, test=1)


@pytest.mark.slow  # one classifier run through the runner: 45-70 s on 2 shared cores
def test_a_streamed_classifier_runs_schedule_spans_its_optimizer_steps(images, tmp_path):
    """classification.train gives the schedule the run's length (optimizer_steps over one process's batches, cut by
    trainer.limit_train_batches and max_epochs), here of streamed data (a DataLoader; test_training_fixes covers the
    resident batches): a cosine of that length, warm-up included, is at rate 0 exactly after the run's last optimizer
    step (one step short or long, it would not be), and its step count is the trainer's."""
    metrics, run_dir = run(
        tmp_path,
        f"data.source={images}",
        *STREAMED,
        "data.num_workers=0",
        "data.batch_size=4",  # 18 training images: 4 steps an epoch (2 images left over), 3 kept
        "trainer.limit_train_batches=3",
        "trainer.max_epochs=3",
        "optim.schedule=cosine",
        "optim.warmup_steps=2",
        "export=none",
    )
    assert metrics["steps"] == 9 and metrics["epochs"] == 3 and metrics["resident"] is False
    state = read_meta(run_dir / "checkpoints" / "last.ckpt")["lr_schedulers"][0]
    assert state["last_epoch"] == metrics["steps"]
    assert state["_last_lr"] == pytest.approx([0.0] * len(state["_last_lr"]), abs=1e-12)
    assert state["base_lrs"][0] == pytest.approx(0.05)  # the run's optim.lr: the rate did fall from it
