"""The one optimizer and learning-rate schedule builder, for every LightningModule ONN trains.

`optim` is the config's optim group: name (adamw | sgd), lr, weight_decay, betas (adamw), momentum
and nesterov (sgd), schedule and its settings, warmup_steps, clip_grad_norm.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

from onn.config import OptimConfig
from onn.errors import UserError

OPTIMIZERS = ("adamw", "sgd")
SCHEDULES = ("cosine", "linear", "constant", "step", "plateau", "onecycle")
EPOCH_SCHEDULES = ("step", "plateau")  # stepped once per epoch


def check(optim: OptimConfig) -> None:
    """The optim group's values, checked before anything is built: one sentence per mistake."""
    if optim.name not in OPTIMIZERS:
        raise UserError(f"optim.name={optim.name!r} is not one of {', '.join(OPTIMIZERS)}.")
    if optim.schedule not in SCHEDULES:
        raise UserError(f"optim.schedule={optim.schedule!r} is not one of {', '.join(SCHEDULES)}.")
    for key, value in (
        ("lr", optim.lr),
        ("weight_decay", optim.weight_decay),
        ("clip_grad_norm", optim.clip_grad_norm),
    ):
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise UserError(f"optim.{key}={value!r}: give a number 0 or more.")
    betas = list(optim.betas)
    if len(betas) != 2 or not all(_number(b) and 0 <= b < 1 for b in betas):
        raise UserError(f"optim.betas={betas!r}: give two numbers from 0 up to (not including) 1, e.g. [0.9, 0.95].")
    if not (_number(optim.momentum) and optim.momentum >= 0):
        raise UserError(f"optim.momentum={optim.momentum!r}: give a number 0 or more.")
    if not (_number(optim.gamma) and 0 <= optim.gamma <= 1):
        raise UserError(f"optim.gamma={optim.gamma!r}: give a number from 0 to 1 (the factor lr is multiplied by).")
    if optim.schedule == "plateau" and optim.gamma == 1:  # torch's ReduceLROnPlateau: "Factor should be < 1.0."
        raise UserError(
            "optim.gamma=1 with optim.schedule=plateau would never lower the rate: give a factor below 1 (e.g. 0.1), "
            "or optim.schedule=constant."
        )
    if optim.name == "sgd" and optim.nesterov and optim.momentum == 0:  # torch's SGD refused it with a ValueError
        raise UserError(
            "optim.nesterov=true needs a momentum: give optim.momentum above 0 (e.g. 0.9), or nesterov=false."
        )
    if not (_number(optim.pct_start) and 0 < optim.pct_start < 1):
        raise UserError(f"optim.pct_start={optim.pct_start!r}: give a number above 0 and below 1.")
    for key, value in (
        ("warmup_steps", optim.warmup_steps),
        ("step_size", optim.step_size),
        ("patience", optim.patience),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < (1 if key == "step_size" else 0):
            raise UserError(
                f"optim.{key}={value!r}: give a whole number, {'1' if key == 'step_size' else '0'} or more."
            )


def _number(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)


def make_optimizer(params, optim: OptimConfig):
    """torch.optim's AdamW or SGD with every setting the config gives it."""
    import torch

    check(optim)
    params = list(params)
    if not params:  # torch's ValueError "optimizer got an empty parameter list", raised from inside Lightning's fit
        raise UserError(
            "the model has no trainable parameter (every weight is frozen), so there is nothing to train: choose a "
            "strategy that trains some (strategy=full, or lora/sparse_lora with adapters on the model's layers)."
        )
    lr, groups = float(optim.lr), decay_groups(params, float(optim.weight_decay))
    if optim.name == "adamw":
        optimizer = torch.optim.AdamW(groups, lr=lr, betas=tuple(optim.betas))
    else:
        optimizer = torch.optim.SGD(groups, lr=lr, momentum=float(optim.momentum), nesterov=bool(optim.nesterov))
    optimizer.register_load_state_dict_pre_hook(regrouped(params))
    return optimizer


def regrouped(params: list):
    """torch's load_state_dict pre-hook that gives a checkpoint saved with other parameter groups to this optimizer's:
    a run saved before weight decay left biases and norms (one group) resumed into two, and one saved with decay
    resumed with optim.weight_decay=0. torch matches the saved groups to the current ones by count and size, and
    refused the other grouping with a ValueError; each parameter's saved state (momenta, step) is the same tensor
    whichever group holds it, found by the parameters' order in each grouping (decay_groups)."""

    def hook(optimizer, state_dict: dict[str, Any]) -> dict[str, Any] | None:
        saved, groups = state_dict["param_groups"], optimizer.param_groups
        if len(saved) == len(groups) or len(saved) > 2 or sum(len(g["params"]) for g in saved) != len(params):
            return None  # torch's own matching (and, for another model, its own refusal)
        order = params if len(saved) == 1 else [p for group in decay_groups(params, 1.0) for p in group["params"]]
        ids = dict(zip(map(id, order), (i for group in saved for i in group["params"]), strict=True))
        settings = [{**saved[0], "params": [ids[id(p)] for p in g["params"]], "weight_decay": g["weight_decay"]}
                    for g in groups]  # fmt: skip
        return {**state_dict, "param_groups": settings}

    return hook


BUILT_SHAPE = "onn_built_shape"  # a parameter's shape as built, noted before a strategy shards it (ONNModule.setup)


def built_shape(param) -> tuple[int, ...]:
    """A parameter's shape as the model built it: FSDP over several processes leaves each a 1-D view of its shard,
    and DeepSpeed's ZeRO-3 an empty one (keeping the shape in ds_shape)."""
    for name in (BUILT_SHAPE, "ds_shape"):
        shape = getattr(param, name, None)
        if shape is not None:
            return tuple(shape)
    return tuple(param.shape)


def decay_groups(params: list, weight_decay: float) -> list[dict[str, Any]]:
    """The optimizer's parameter groups: weight decay on matrices and larger (linear, convolution and embedding
    weights), none on biases, norms' scales and shifts, or scalars (a CLIP logit_scale), whose decay pulls them
    to 0 rather than regularising: timm's rule (param_groups_weight_decay), which Hugging Face's Trainer keeps too
    (get_decay_parameter_names: no biases, no norms). Without decay, one group (as runs before this rule had)."""
    if not weight_decay:
        return [{"params": params, "weight_decay": 0.0}]
    decayed = [p for p in params if len(built_shape(p)) >= 2]
    kept = [p for p in params if len(built_shape(p)) < 2]
    groups = [{"params": decayed, "weight_decay": weight_decay}, {"params": kept, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def make_schedule(optimizer, optim: OptimConfig, total_steps: int, monitor: str, epochs: bool = True) -> dict[str, Any]:
    """Lightning's lr_scheduler config for optim.schedule over a run of `total_steps` optimizer steps.

    Warm-up (every schedule's but onecycle's, which warms up over pct_start) trains step s (from 0) at
    lr x (s + 1) / (warmup_steps + 1) and reaches the full rate at step warmup_steps: no step trains at rate 0
    (transformers' own warm-up trains its first at 0, a step that changes nothing). It is clamped to the run's
    length, so a run shorter than it warms up all along (a 1-step smoke run trains at lr / 2). After the warm-up,
    cosine and linear decay as transformers' do, to 0 after the last step (shifted, see one_step_on).
    `monitor` is the metric the plateau schedule watches (task.monitor); `epochs` is False for runs that stream
    without epochs, where the per-epoch schedules never step."""
    import torch

    check(optim)
    schedule, total = optim.schedule, max(int(total_steps), 1)
    warmup = min(int(optim.warmup_steps), total)
    if schedule in EPOCH_SCHEDULES and not epochs:
        raise UserError(
            f"optim.schedule={schedule} steps once per epoch, and this run streams its data without epochs; "
            "use cosine, linear, constant or onecycle."
        )
    if schedule in ("cosine", "linear", "constant"):
        from transformers import get_scheduler

        kind = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}[schedule]
        # one step longer, read one step on: its rate 0 at step 0 is never trained (one_step_on)
        scheduler = get_scheduler(kind, optimizer, num_warmup_steps=warmup + 1, num_training_steps=total + 1)
        return {"scheduler": follows_this_run(scheduler), "interval": "step"}
    if schedule == "onecycle":
        return {"scheduler": one_cycle(optimizer, float(optim.lr), total, float(optim.pct_start)), "interval": "step"}
    if schedule == "step":
        step = per_epoch(torch.optim.lr_scheduler.StepLR, warmup)
        return {
            "scheduler": step(optimizer, step_size=int(optim.step_size), gamma=float(optim.gamma)),
            "interval": "epoch",
        }
    plateau = per_epoch(torch.optim.lr_scheduler.ReduceLROnPlateau, warmup)
    scheduler = plateau(optimizer, mode=monitor_mode(monitor), factor=float(optim.gamma), patience=int(optim.patience))
    return {"scheduler": scheduler, "interval": "epoch", "monitor": monitor, "strict": False}


PER_GROUP = ("base_lrs", "_last_lr", "min_lrs")  # a schedule's state that holds one value per parameter group


def widened(state: dict[str, Any], groups: int) -> dict[str, Any]:
    """A schedule's saved state for an optimizer of `groups` parameter groups: one saved with a single group (before
    weight decay left biases and norms, see regrouped) has its one rate repeated for each group; torch zips the
    lists with the groups, and the second group's rate never moved again."""
    return {
        key: value * groups if key in PER_GROUP and isinstance(value, list) and len(value) == 1 else value
        for key, value in state.items()
    }


def per_epoch(schedule: type, warmup_steps: int) -> type:
    """torch's per-epoch `schedule` (StepLR, ReduceLROnPlateau), after a warm-up of `warmup_steps` optimizer steps.

    Lightning steps one schedule per interval and torch's SequentialLR takes neither a plateau nor two intervals, so
    the warm-up is torch's LinearLR stepped after each optimizer step (the optimizer's step hook). Both scale the
    rate the optimizer holds, so the epoch schedule's factor multiplies the warm-up's. Its state is saved inside
    the schedule's; `_last_lr` is the optimizer's rate, which a warm-up moves between the epoch's steps."""
    import torch

    class PerEpoch(schedule):
        def __init__(self, optimizer, **settings: Any):
            super().__init__(optimizer, **settings)
            self.warmup = None
            if warmup_steps:
                self.warmup = torch.optim.lr_scheduler.LinearLR(
                    optimizer, start_factor=1 / (warmup_steps + 1), total_iters=warmup_steps
                )
                optimizer.register_step_post_hook(lambda *_: self.warmup.step())

        def state_dict(self) -> dict[str, Any]:
            state = {key: value for key, value in super().state_dict().items() if key != "warmup"}
            state["_last_lr"] = [group["lr"] for group in self.optimizer.param_groups]
            return {**state, "warmup": self.warmup.state_dict()} if self.warmup else state

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            groups = len(self.optimizer.param_groups)
            super().load_state_dict(widened({k: v for k, v in state_dict.items() if k != "warmup"}, groups))
            if self.warmup and "warmup" in state_dict:
                self.warmup.load_state_dict(widened(state_dict["warmup"], groups))
            elif self.warmup:  # saved without a warm-up (before it was applied): the run goes on at its rate
                self.warmup.last_epoch = self.warmup.total_iters

    return PerEpoch


def follows_this_run(scheduler):
    """transformers' schedule (a LambdaLR over this run's length, read one step on: one_step_on) that, resumed, sets
    the rate of its step along this run's length. Its state holds no length, so a run resumed with a larger
    trainer.max_steps stretches the schedule, but Lightning restores the optimizer first, with the saved run's rate,
    and the first resumed step trained at it (a warm-up of 2 steps ended at the full rate where the longer run's was
    half way)."""
    import torch

    class FollowsThisRun(torch.optim.lr_scheduler.LambdaLR):
        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            super().load_state_dict(widened(state_dict, len(self.optimizer.param_groups)))
            self.last_epoch -= 1
            self.step()  # the same step again: its rate along this run's length into the optimizer

    return FollowsThisRun(scheduler.optimizer, [functools.partial(one_step_on, f) for f in scheduler.lr_lambdas])


def one_step_on(lr_lambda: Callable[[int], float], step: int) -> float:
    """transformers' rate factor of the step after `step`: over a warm-up of warmup + 1 steps and a run of total + 1,
    step s trains at (s + 1) / (warmup + 1) of the rate, as per_epoch's warm-up does, and the decay after it is
    transformers' over total steps unchanged ((s - warmup) / (total - warmup) of the way)."""
    return lr_lambda(step + 1)


def one_cycle(optimizer, lr: float, total: int, pct_start: float):
    """torch's OneCycleLR over this run's `total` steps, peaking at `lr` after `pct_start` of them.

    Two of its edges are taken off: its warm-up spans pct_start x total - 1 steps and it divides by that span, so a
    warm-up of exactly one step (4 steps at pct_start=0.25) was a ZeroDivisionError; that warm-up ends at the first
    step instead. And its state holds the length it was built for, so a run resumed with a larger trainer.max_steps
    or max_epochs stepped past it ("Tried to step 7 times"): a resumed one keeps this run's length, as the other
    schedules do (their length is not in their state), and sets the rate of its step along it (Lightning restores
    the optimizer's, the saved run's rate, first)."""
    import torch

    class OneCycle(torch.optim.lr_scheduler.OneCycleLR):
        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            length = {"total_steps": self.total_steps, "_schedule_phases": self._schedule_phases}
            super().load_state_dict(widened(state_dict, len(self.optimizer.param_groups)))
            self.__dict__.update(length)
            self.last_epoch -= 1
            self.step()  # the same step again, along this length: its rate and momentum into the optimizer

    if pct_start * total - 1 == 0:
        pct_start *= 1 - 1e-6
    return OneCycle(optimizer, max_lr=lr, total_steps=total, pct_start=pct_start)


def monitor_mode(monitor: str) -> str:
    """Whether a metric improves downwards (losses, errors) or upwards (accuracy, recall)."""
    return "min" if monitor.endswith(("loss", "error", "perplexity")) else "max"
