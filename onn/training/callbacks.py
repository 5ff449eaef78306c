"""Callbacks ONN adds to training runs: step checkpoints, progress, per-step timing and resource monitoring."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Checkpoint, EarlyStopping, ModelCheckpoint, RichProgressBar

from onn.config import ONNConfig
from onn.errors import UserError
from onn.hardware.memory import anon_rss_mb
from onn.training import progress


class StepCheckpoint(Checkpoint):
    """`last.ckpt` every `every_n_steps` optimizer steps and at the end of training.

    Lightning's ModelCheckpoint expects automatic optimization: with the manual accumulation ONN's
    language models use, it warns on every run (with a code sample) although it saves correctly. This
    does the one thing those runs need, through the Trainer's own save (loops, optimizer, CheckpointIO).

    A step that Lightning validates after is saved after that validation, and an epoch's last step at the
    epoch's end: Lightning resumes a checkpoint taken between a batch and its validation past the
    validation (the resumed run would never validate that step), and one taken between an epoch's last
    batch and its end as an unfinished epoch with no batch left (it would count that epoch twice)."""

    def __init__(self, dirpath: str | Path, every_n_steps: int):
        check_every_n_steps(every_n_steps)
        self.path = Path(dirpath) / "last.ckpt"
        self.every_n_steps = every_n_steps
        self.last_model_path = ""
        self._saved_at: int | None = None
        self._waits_for: str | None = None  # "validation" or "epoch": what a due step's save waits for

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step % self.every_n_steps:
            return
        if batch_idx + 1 == trainer.num_training_batches:
            self._waits_for = "epoch"
        elif validates_now(trainer):
            self._waits_for = "validation"
        else:
            self.save(trainer)

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._waits_for == "validation" and not trainer.sanity_checking:
            self.save(trainer)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self._waits_for is not None:  # also a step whose validation did not run (no held-out batch)
            self.save(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        self.save(trainer)

    def save(self, trainer) -> None:
        self._waits_for = None
        if self._saved_at == trainer.global_step:
            return
        trainer.save_checkpoint(str(self.path), weights_only=False)
        self.last_model_path, self._saved_at = str(self.path), trainer.global_step

    def saves_this_step(self) -> bool:
        """Whether this step's last.ckpt is still to come from this callback (after its validation, or at its
        epoch's end)."""
        return self._waits_for is not None


def check_every_n_steps(every_n_steps: int) -> None:
    """checkpoint.every_n_steps as StepCheckpoint takes it; also called by task=plan, so that a plan does not say ok
    for a setting its training run would refuse when it starts."""
    if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
        raise UserError(
            f"checkpoint.every_n_steps={every_n_steps!r}: give a whole number of optimizer steps, 1 or more "
            "(last.ckpt is written at the end of training too)."
        )


def validates_now(trainer) -> bool:
    """Whether Lightning validates after the training batch that just ended: asked as its training loop asks it
    (after the callbacks' on_train_batch_end, from the same loop state), so the two never disagree."""
    loop = trainer.fit_loop
    return loop._data_fetcher is not None and bool(loop.epoch_loop._should_check_val_fx(loop._data_fetcher))


class RandomState(L.Callback):
    """The random number generators' states (torch's on the CPU and every GPU, NumPy's, Python's) in each
    checkpoint and back on resume: augmentation and dropout then draw after a resume what the run would have
    drawn had it never stopped. Lightning keeps a callback's state_dict in the checkpoint."""

    def state_dict(self) -> dict[str, Any]:
        """The generators' states now; a restored state not yet set (a resumed run that had nothing left to train
        never started training) as it was restored, so that its final checkpoint keeps the stopped run's draws."""
        import random

        import numpy as np
        import torch

        if self._restored is not None:
            return self._restored
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        version, values, python_gauss = random.getstate()
        return {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos,
                      "has_gauss": has_gauss, "gauss": gauss},
            "python": {"version": version, "values": list(values), "gauss": python_gauss},
        }  # fmt: skip

    def __init__(self):
        self._restored: dict[str, Any] | None = None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._restored = state  # set when training starts: the setup after a restore may draw numbers too

    def on_train_start(self, trainer, pl_module) -> None:
        if self._restored is not None:
            self._set(self._restored)
            self._restored = None

    @staticmethod
    def _set(state: dict[str, Any]) -> None:
        import random

        import numpy as np
        import torch

        torch.set_rng_state(state["torch"])
        if state["cuda"] and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(state["cuda"])
        n = state["numpy"]
        keys = n["keys"].numpy().astype(np.uint32)
        np.random.set_state((n["kind"], keys, int(n["pos"]), int(n["has_gauss"]), float(n["gauss"])))
        p = state["python"]
        random.setstate((p["version"], tuple(p["values"]), p["gauss"]))


def epoch_checkpoints(run_dir: Path, monitor: str, mode: str, every_n_steps: int) -> list[L.Callback]:
    """What an epoch-based run checkpoints: best.ckpt by `monitor` (the first ModelCheckpoint, Lightning's
    trainer.checkpoint_callback), last.ckpt at each epoch's end and every `every_n_steps` steps within one (a
    run killed mid-epoch resumes from within it), and the random generators' states in each."""
    folder = str(Path(run_dir) / "checkpoints")
    best = BestCheckpoint(
        dirpath=folder,
        filename="best",
        monitor=monitor,
        mode=mode,
        save_top_k=1,
        auto_insert_metric_name=False,
        enable_version_counter=False,
    )
    # last.ckpt at each epoch's end: Lightning's save_last writes only when that same callback saved a checkpoint at
    # the step, which save_top_k=0 never does; with no monitor and one kept, it saves the latest every epoch
    last = LastCheckpoint(dirpath=folder, filename="last", monitor=None, save_top_k=1, enable_version_counter=False)
    return [best, last, StepCheckpoint(folder, every_n_steps), RandomState()]


class LastCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint of last.ckpt that leaves a step to the run's StepCheckpoint when that writes the
    same file at this step: both wrote it at every validation of a due step (StepCheckpoint runs after it), which
    doubled the checkpoint I/O, and StepCheckpoint's later save at an epoch's end replaced this one's anyway."""

    def _save_checkpoint(self, trainer, filepath: str) -> None:
        path = Path(filepath).resolve()  # Lightning's dirpath is the real path
        steps = [c for c in trainer.checkpoint_callbacks if isinstance(c, StepCheckpoint) and c.path.resolve() == path]
        if not any(c.saves_this_step() for c in steps):
            super()._save_checkpoint(trainer, filepath)

    @property
    def state_key(self) -> str:
        """Lightning's own key (it names the class): checkpoints saved by ModelCheckpoint resume into this one."""
        return super().state_key.replace(type(self).__qualname__, "ModelCheckpoint", 1)


class BestCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint that weighs every validation when trainer.val_check_interval=1 (after every step):
    Lightning saves at each epoch's end instead of after each validation when `val_check_interval == 1.0` (a whole
    epoch), which the whole number 1 equals too, so best.ckpt and its score missed every validation but an epoch's
    last one (with trainer.check_val_every_n_epoch=1)."""

    def _should_save_on_train_epoch_end(self, trainer) -> bool:
        interval = trainer.val_check_interval
        every_step = isinstance(interval, int) and interval == 1 and trainer.num_training_batches > 1
        batches = trainer.num_val_batches
        validates = (sum(batches) if isinstance(batches, list) else batches) > 0
        return super()._should_save_on_train_epoch_end(trainer) and not (every_step and validates)

    @property
    def state_key(self) -> str:
        """Lightning's own key (it names the class): checkpoints saved by ModelCheckpoint resume into this one."""
        return super().state_key.replace(type(self).__qualname__, "ModelCheckpoint", 1)


def run_callbacks(config: ONNConfig, run_dir: Path, monitor: str, mode: str) -> list[L.Callback]:
    """An epoch-based run's callbacks: its checkpoints (epoch_checkpoints), the step clock, the resource monitor,
    a stopped run's resume where it stopped (NextEpochAfterFit), and early stopping on `monitor` when
    task.early_stopping.patience is set."""
    checkpoints = epoch_checkpoints(run_dir, monitor, mode, config.checkpoint.every_n_steps)
    callbacks = [*checkpoints, StepClock(), ResourceMonitor(int(config.trainer.log_every_n_steps)), NextEpochAfterFit()]
    stop = config.task.early_stopping
    if stop.patience > 0:
        # checked after each validation only: at a training epoch's end that max_steps cut short, no validation had
        # logged `monitor` yet, and Lightning's own default check there ended the run in a RuntimeError
        patience, delta = int(stop.patience), float(stop.min_delta)
        callbacks.append(
            ThisRunsPatience(monitor, mode=mode, patience=patience, min_delta=delta, check_on_train_epoch_end=False)
        )
    return callbacks


class ThisRunsPatience(EarlyStopping):
    """Lightning's EarlyStopping with this run's task.early_stopping.patience after a resume too. Lightning restores
    the checkpoint's patience over the one it was given, so a run stopped early and resumed with a larger patience
    (to train on) stopped again at its first validation that did not improve. The count of validations without
    improvement and the best score are the checkpoint's, as a run never stopped has them."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        patience = self.patience
        super().load_state_dict(state_dict)
        self.patience = patience

    @property
    def state_key(self) -> str:
        """Lightning's own key (it names the class): checkpoints saved by EarlyStopping resume into this one."""
        return super().state_key.replace(type(self).__qualname__, "EarlyStopping", 1)


class NextEpochAfterFit(L.Callback):
    """A checkpoint written after fit ended resumes where the run that never stopped would be: at the next epoch's
    first batch when fit ended at an epoch's end, at the interrupted epoch's next batch when it ended within one.

    With trainer.max_steps set, Lightning restores every checkpoint as a restart inside the epoch it was saved in:
    the first epoch a larger trainer.max_epochs adds took the finished epoch's batch counters as its own and ended
    without training (Lightning resets them at an epoch's start only when it is not restarting). And when
    trainer.max_steps ended fit within an epoch, Lightning counted that epoch processed (and completed) all the
    same: a resumed run started the next epoch with the interrupted one's batch count, so it trained that epoch
    short, from the next epoch's order, and never trained the interrupted epoch's remaining batches."""

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        loop = checkpoint.get("loops", {}).get("fit_loop", {})
        epochs, batches = loop.get("epoch_progress"), loop.get("epoch_loop.batch_progress")
        if not epochs or not batches:
            return
        if batches.get("is_last_batch"):
            if len(set(epochs["current"].values())) == 1:  # its last epoch completed: fit had ended
                batches["current"] = dict.fromkeys(batches["current"], 0)
                batches["is_last_batch"] = False
        elif batches["current"]["ready"] and epochs["total"]["processed"] == epochs["total"]["started"]:
            # an epoch ended before its last batch (saved at that epoch's end or after fit): still unfinished, as a
            # checkpoint saved after one of its batches has it, so that Lightning restarts inside it
            if 0 <= trainer.max_steps <= checkpoint.get("global_step", 0):
                return  # nothing left to train: the run records the epochs the stopped run counted
            for counts in (epochs["total"], epochs["current"]):
                counts["processed"] = counts["completed"] = counts["started"] - 1


class Progress(L.Callback):
    """Tells onn/training/progress.py each optimizer step reached, for the run's record and heartbeat."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        progress.reached(trainer.global_step)

    def on_train_start(self, trainer, pl_module) -> None:
        progress.reached(trainer.global_step)  # a resumed run starts at its checkpoint's step


class StepsProgressBar(RichProgressBar):
    """Lightning's rich progress bar without a negative epoch total: when max_steps ends a run
    (trainer.max_epochs=-1, ONN's default) Lightning 2.6 shows "Epoch 0/-2" (Lightning-AI/pytorch-lightning#21925,
    fixed after 2.6.6; drop this class once requirements.lock has the fix)."""

    def _get_train_description(self, current_epoch: int) -> str:
        if self.trainer.max_epochs is not None and self.trainer.max_epochs >= 0:
            return super()._get_train_description(current_epoch)
        description = f"Epoch {current_epoch}"
        return f"{description:{len(self.validation_description)}}"  # as wide as the validation bar's: no flicker


def logs_now(module: L.LightningModule) -> bool:
    """Whether this training step logs its loss: the first step (the progress bar has a figure at once), and each
    step after which Lightning writes to the loggers (every trainer.log_every_n_steps-th: steps n-1, 2n-1, ...,
    so each row holds its own step's loss), when something reads it: a logger, the progress bar, or a callback or
    schedule that monitors train/loss. A step that logs reads its loss (one wait for the GPU) and logs it as a
    host tensor (record.log_train_loss): Lightning reads every progress-bar figure back after every step, logging
    or not, and a figure on the GPU (where it puts a logged number) would make the host wait for the GPU at every
    step, so it could never run ahead. With no reader no step waits (the run's record reads the losses after the
    steps, and a checkpoint as it is saved).

    A run that monitors train/loss (best.ckpt, early stopping, the plateau schedule) logs it at every step: those
    read Lightning's latest logged value whenever they run, and a value kept from the last logging step compared an
    old step's loss (a falling loss 'did not improve'). Only such runs pay the per-step read."""
    trainer, step = module.trainer, module.global_step
    monitors = [getattr(c, "monitor", None) for c in trainer.callbacks]
    monitors += [s.monitor for s in trainer.lr_scheduler_configs]
    if "train/loss" in monitors:
        return True
    if step and (step + 1) % max(1, trainer.log_every_n_steps):
        return False
    return bool(trainer.loggers) or trainer.progress_bar_callback is not None


class StepClock(L.Callback):
    """Wall time, tokens and (when streaming) weight-wait and compute time of every training step.

    A batch is one optimizer step (the module accumulates micro-batches itself), so batch start to
    batch end is the whole step: forward, backward and optimizer. On a GPU the step's span is timed on the
    GPU's own timeline (CUDA events at its start and end, read after the steps): a step that never waits
    for the GPU ends on the host before its work does on the device."""

    def __init__(self):
        self._step_s: list[float] = []
        self._events: list = []  # (start, end) CUDA events per step, on a GPU
        self._tokens: list = []  # per step, as the batch's device holds it: read once, after the steps
        self.widths: list[int] = []
        # the samples each step trained on, over every process (a last or only batch may be short)
        self.rows: list[int] = []
        self.io_s: list[float] = []
        self.compute_s: list[float] = []
        self.copied_bytes: list[int] = []  # streamed on a GPU: weights copied from host memory per step
        self._t0 = 0.0
        self._engine_t0 = (0.0, 0.0, 0)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        engine = getattr(pl_module, "engine", None)
        if engine is not None:
            self._engine_t0 = (engine.times.io_s, engine.times.compute_s, engine.times.copied_bytes)
        # this process's share of the step: the processes train equal shares (a sampler's, resident batches' own, or
        # the global batch's slices), so the step trained the world's
        self.rows.append(batch_rows(batch) * trainer.world_size)
        if isinstance(batch, dict):  # token batches; image batches are (images, labels)
            self._tokens.append(batch["attention_mask"].sum())
            self.widths.append(int(batch["input_ids"].shape[1]))
        if pl_module.device.type == "cuda":
            import torch

            self._events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
            self._events[-1][0].record()
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._step_s.append(time.perf_counter() - self._t0)
        if pl_module.device.type == "cuda":
            self._events[-1][1].record()
        engine = getattr(pl_module, "engine", None)
        if engine is not None:
            self.io_s.append(engine.times.io_s - self._engine_t0[0])
            self.compute_s.append(engine.times.compute_s - self._engine_t0[1])
            self.copied_bytes.append(engine.times.copied_bytes - self._engine_t0[2])

    @property
    def step_s(self) -> list[float]:
        """Each step's time: on a GPU from its start to its end as the GPU ran them, else on the host."""
        if not self._events:
            return self._step_s
        self._events[-1][1].synchronize()
        return [start.elapsed_time(end) / 1000 for start, end in self._events]

    @property
    def tokens(self) -> list[int]:
        """Non-padding tokens of every step (read from the device here, not during the steps)."""
        return [int(t) for t in self._tokens]

    def samples_per_s(self, skip: int = 0) -> float | None:
        """Training samples per second over the steps after the first `skip`: the rows those steps trained on in
        every process (not data.batch_size: a short last batch, or data smaller than a batch) over their batches'
        and optimizer steps' time, not validation, checkpoints or data loading."""
        timed = self.step_s[skip:]
        return sum(self.rows[skip:]) / sum(timed) if timed and sum(timed) > 0 else None


def batch_rows(batch: Any) -> int:
    """How many samples a training batch holds, read from its shapes (no wait for the device): a dict of tensors
    (tokens, pairs), a tuple or list whose first item is the inputs (images, labels), a PyG batch of graphs, or of
    a node-level split (one graph whose `nodes` are the split's: those nodes are its rows, not the one graph)."""
    if hasattr(batch, "num_graphs"):
        return int(batch.nodes.numel()) if "nodes" in batch else int(batch.num_graphs)
    if isinstance(batch, dict):
        return batch_rows(batch["input_ids"] if "input_ids" in batch else next(iter(batch.values())))
    if isinstance(batch, list | tuple):
        return batch_rows(batch[0])
    return int(batch.shape[0]) if hasattr(batch, "shape") else len(batch)


class ResourceMonitor(L.Callback):
    """Logs host memory, this process's memory and CPU use, and on GPUs device memory and utilisation.

    Lightning's DeviceStatsMonitor logs every allocator counter on every batch and refuses to run
    without a logger; this logs the handful of figures people read, every `log_every_n_steps`."""

    def __init__(self, every_n_steps: int = 10):
        self.every_n_steps = max(1, every_n_steps)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step % self.every_n_steps or not trainer.loggers:
            return
        import torch

        # host tensors: Lightning makes a logged number a tensor on the module's device, on a GPU a blocking copy
        # each, which waits for the step's backward and optimizer the host has just queued
        figures = {name: torch.tensor(float(value)) for name, value in self.read(pl_module.device).items()}
        pl_module.log_dict(figures, on_step=True, on_epoch=False)

    @staticmethod
    def read(device) -> dict[str, float]:
        import psutil

        host = psutil.virtual_memory()
        stats = {
            "resource/host_available_mb": host.available / 2**20,
            "resource/host_used_percent": float(host.percent),
            "resource/process_rss_mb": anon_rss_mb(),
            "resource/cpu_percent": psutil.cpu_percent(),  # since the previous call: this logging interval
        }
        if getattr(device, "type", "cpu") == "cuda":
            import torch

            stats["resource/device_allocated_mb"] = torch.cuda.memory_allocated(device) / 2**20
            stats["resource/device_reserved_mb"] = torch.cuda.memory_reserved(device) / 2**20
            stats["resource/device_peak_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
            with contextlib.suppress(Exception):  # needs NVML (pynvml); the memory figures stand without it
                stats["resource/gpu_util_percent"] = float(torch.cuda.utilization(device))
        return stats
