"""The one Lightning Trainer builder: every task that trains, validates or tests makes its Trainer here.

`trainer` config keys pass to lightning.Trainer one-to-one; `auto` values come from the plan
(precision, the device), loggers from the tracking group (`_target_` instantiation), and checkpoints
always go through the safetensors CheckpointIO.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from onn.errors import UserError

MULTI_DEVICE = ("ddp", "ddp_spawn", "fsdp", "deepspeed")


def check(trainer: dict[str, Any], *, trains: bool = True) -> None:
    """The trainer group's values, checked before anything is built: one sentence per mistake.
    `trains`: the task fits weights, so its step and epoch limits must end."""
    for key in ("max_steps", "max_epochs"):
        value = trainer[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < -1:
            raise UserError(f"trainer.{key}={value!r}: give a whole number, 1 or more, or -1 (no limit).")
    if trains and trainer["max_steps"] == -1 and trainer["max_epochs"] == -1:
        raise UserError(
            "trainer.max_steps and trainer.max_epochs are both -1, so training would never end: set one of them."
        )
    every = trainer["log_every_n_steps"]
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise UserError(f"trainer.log_every_n_steps={every!r}: give a whole number, 1 or more.")
    interval = trainer["val_check_interval"]
    if isinstance(interval, bool) or not isinstance(interval, int | float) or interval <= 0:
        raise UserError(
            f"trainer.val_check_interval={interval!r}: give a number of steps, or a fraction of an epoch above 0."
        )


def build_trainer(config: dict[str, Any], plan: dict[str, Any], run_dir: Path, callbacks: list, *, strategy: Any = None,
                  loggers: bool = True, steps_per_epoch: int | None = None):  # fmt: skip
    """A Trainer for this run. `strategy`: a Strategy object or Lightning name (default: the strategy
    config's `lightning`); `steps_per_epoch`: the training loader's length, when it has epochs."""
    import lightning as L
    from hydra.utils import instantiate
    from lightning.pytorch.callbacks import Checkpoint, LearningRateMonitor

    from onn.training.checkpoint_io import SafetensorsCheckpointIO

    share_console_with_hydra()
    kwargs = dict(config["trainer"])
    if kwargs.get("precision") in (None, "auto"):
        kwargs["precision"] = plan["precision"]
    interval = kwargs.get("val_check_interval")
    if isinstance(interval, int) and not isinstance(interval, bool):
        limits = [n for n in (kwargs.get("max_steps"), steps_per_epoch) if isinstance(n, int) and n > 0]
        kwargs["val_check_interval"] = min([interval, *limits])
    elif kwargs.get("check_val_every_n_epoch") is None:  # a fraction of an epoch: validate every epoch
        kwargs["check_val_every_n_epoch"] = 1
    strategy = strategy if strategy is not None else (config["strategy"].get("lightning") or "auto")
    if kwargs.get("accelerator") in (None, "auto"):
        kwargs["accelerator"] = "cuda" if plan["hardware"]["accelerator"] == "cuda" else "cpu"
    if kwargs.get("devices") in (None, "auto") and not (
        isinstance(strategy, str) and strategy.startswith(MULTI_DEVICE)
    ):
        kwargs["devices"] = 1
    from onn.training.callbacks import Progress

    callbacks = [*callbacks, Progress()]  # the run's record reads the last step reached (onn/tasks/record.py)
    made = (
        [instantiate(c, save_dir=str(run_dir)) for c in (config.get("tracking") or {}).get("loggers", [])]
        if loggers
        else []
    )
    if made:
        callbacks = [*callbacks, LearningRateMonitor("step")]
    # no_grad, not inference_mode, for evaluation: torchmetrics states reset inside a standalone
    # validate() would otherwise become inference tensors that fit's validation cannot update
    kwargs.setdefault("inference_mode", False)
    if kwargs.get("enable_checkpointing") is None:
        kwargs["enable_checkpointing"] = any(isinstance(c, Checkpoint) for c in callbacks)
    return L.Trainer(default_root_dir=str(run_dir), logger=made or False, callbacks=callbacks,
                     plugins=[SafetensorsCheckpointIO()], strategy=strategy, **kwargs)  # fmt: skip


def share_console_with_hydra() -> None:
    """Print Lightning's lines once, through Hydra's handlers.

    Importing `lightning` adds a console handler to its logger and leaves propagation on, so under
    Hydra (whose root logger has a console handler too) every line printed twice. When the root
    logger has handlers, Lightning's own console handlers go and its lines propagate to the root:
    printed once, in Hydra's format, and kept in the job's log file too."""
    if not logging.getLogger().handlers:
        return
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if type(handler) is logging.StreamHandler:
                logger.removeHandler(handler)
        logger.propagate = True
