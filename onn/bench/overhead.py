"""`task=bench_overhead`: what ONN's language-model runner costs a step, against a plain PyTorch loop.

Both train the same model (the run's model, strategy and precision as planned) on the same batches from
the same data module, with the same optimizer, schedule (over `task.warmup` + `task.steps` steps) and gradient
clipping, for `task.warmup` steps and then `task.steps` timed ones:

  plain   nanoGPT's step with gradient accumulation: the batch cut into the plan's micro-batches as ONN's module
          cuts it (micro_batches.split, each weighted by its share of the batch's target tokens), model(**piece)
          and backward per piece, then the optimizer's step and zero_grad, in a loop, at the precision Lightning
          runs (-mixed autocasts, 16-mixed with a GradScaler; -true casts the weights); an out-of-memory error
          halves its micro-batch and retries the step, as ONN's module does
  onn     a run's path: the Lightning Trainer and the CausalLM module with a run's callbacks (step clock,
          resource monitor, checkpoint, progress)

`overhead/ratio` = ONN's steps per second / the plain loop's, the median of `task.repeats` rounds (each
times both sides, in alternating order: a slow spell of a shared machine hits both). The timed window runs from
the first timed step's start to the last one's end, the device synchronised at those two stamps only: a wait at
every step kept either side from queueing its next step while the GPU ran this one, and added each side's host
time to its steps one for one (ONN's Lightning loop showed 0.134 of overhead that way on an H200). Data loading
counts on both sides; the garbage one side leaves (a Trainer, its loaders) is collected before the next side
starts, not inside its window.
`overhead/max_loss_gap` is the largest difference between the two sides' losses, step by step, in the first
round: 0 (or a GPU's float noise) when both did the same work. `overhead/micro_batch` is the plan's micro-batch,
which both sides start from: a plain loop running the whole batch in one forward would count ONN's micro-batching
(strategy.micro_batch below data.batch_size) as runner overhead.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from typing import Any

import torch

from onn.bench.vision import epochs, median_ratio, plain_precision, stamp, synchronize, trainer_precision
from onn.config import ONNConfig
from onn.config.task import BenchOverheadTask
from onn.errors import UserError
from onn.hardware.memory import is_out_of_memory
from onn.training.micro_batches import OutOfMemoryFloor, split

log = logging.getLogger("onn")


def check_settings(config: ONNConfig) -> None:
    task: BenchOverheadTask = config.task
    for key, least in (("steps", 2), ("warmup", 1), ("repeats", 1)):
        if getattr(task, key) < least:
            raise UserError(f"task.{key}={getattr(task, key)!r}: give a whole number, {least} or more.")
    if config.strategy.lightning != "auto":
        raise UserError(
            f"task=bench_overhead times one process on one device: strategy={config.strategy.name} "
            "runs through Lightning's own strategy; use full, lora or auto."
        )


def run(job) -> dict[str, Any]:
    import lightning as L

    config, task = job.config, job.config.task
    check_settings(config)
    if job.plan.streaming is not None:  # its blocks live in a layer store, which a plain loop lacks
        raise UserError(
            "task=bench_overhead times a resident model against a plain loop, and this plan streams sparse_lora "
            "(the model does not fit otherwise); set strategy=full or strategy=lora, or a model that fits."
        )
    steps, warmup = task.steps, task.warmup
    rounds: dict[str, list[float]] = {"plain": [], "onn": []}
    losses: dict[str, list[float]] = {}  # each side's, first round
    for round_ in range(task.repeats):
        sides = [("plain", lambda: _plain(job, steps, warmup)), ("onn", lambda: _onn(job, steps, warmup))]
        for name, measure in sides if round_ % 2 == 0 else sides[::-1]:
            settle(job.device)
            L.seed_everything(config.seed, verbose=False)
            rate, side_losses = measure()
            rounds[name].append(rate)
            losses.setdefault(name, side_losses)
    metrics = {
        "overhead/ratio": round(median_ratio(rounds["onn"], rounds["plain"]), 4),
        "overhead/onn_steps_per_s": round(max(rounds["onn"]), 2),
        "overhead/plain_steps_per_s": round(max(rounds["plain"]), 2),
        "overhead/rounds": {k: [round(x, 2) for x in v] for k, v in rounds.items()},
        "overhead/timed_steps": steps,
        "overhead/micro_batch": job.plan.micro_batch,
        "overhead/max_loss_gap": max(abs(p - o) for p, o in zip(losses["plain"], losses["onn"])),
        "overhead/device": str(job.device),
    }
    print(
        f"runner overhead: ONN {metrics['overhead/onn_steps_per_s']:.1f} steps/s, plain loop "
        f"{metrics['overhead/plain_steps_per_s']:.1f} steps/s (best rounds); median round ONN/plain = "
        f"{metrics['overhead/ratio']:.3f}",
        flush=True,
    )
    return metrics


def settle(device: str | torch.device) -> None:
    """Free what the last side left before the next one starts, outside both timed windows: a Trainer, its module
    and loaders hold reference cycles that only the collector frees, which it did inside the next side's window (on
    its time and, with the allocator's cache, its GPU memory)."""
    gc.collect()
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _rate(stamps: list[float], warmup: int, steps: int) -> float:
    return steps / (stamps[warmup + steps] - stamps[warmup])


def _plain(job, steps: int, warmup: int) -> tuple[float, list[float]]:
    """nanoGPT's loop on the module the plan builds, at the Trainer's precision and in the module's micro-batches:
    steps per second after `warmup`, and each step's loss (read after the steps)."""
    from onn.modalities.text.datamodule import HOST_ROWS
    from onn.modalities.text.tasks import build, datamodule
    from onn.training.optim import make_optimizer, make_schedule

    config, plan = job.config, job.plan
    device = torch.device(job.device)
    module, tokenizer = build(config, plan)
    weights, half = plain_precision(trainer_precision(config, plan))
    model = module.model.to(device).train()
    if weights is not None:  # bf16-true, 16-true, 64-true: Lightning trains the converted weights
        model.to(weights)
    dm = datamodule(config, tokenizer)
    loader = dm.train_dataloader()
    optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad], config.optim)
    scheduler = make_schedule(optimizer, config.optim, warmup + steps, "val/loss", epochs=False)["scheduler"]
    clip = config.optim.clip_grad_norm
    scaler = torch.amp.GradScaler(device.type, enabled=half is torch.float16)  # as Lightning's 16-mixed scales
    micro = module.micro_batch
    stamps: list[float] = []
    losses: list[torch.Tensor] = []
    for batch in epochs(loader, warmup + steps + 1):  # as many epochs as the steps take, as the Trainer runs
        stamp(stamps, device, warmup, steps)
        if len(stamps) > warmup + steps:
            break
        rows = dm.on_before_batch_transfer(batch, 0).pop(HOST_ROWS, None)  # counted on the host, as ONN's are
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        while True:
            try:
                loss = _accumulate(model, split(batch, micro, rows), scaler, device, half)
                break
            except Exception as e:  # noqa: BLE001 - only out-of-memory is handled; the rest re-raises
                if not is_out_of_memory(e):
                    raise
                error = e.with_traceback(None)  # its frames hold the failed pass's memory, which the retry needs
            optimizer.zero_grad(set_to_none=True)
            micro = _halve(micro, module.min_micro_batch, error)
        if clip > 0:  # after the unscale, as Lightning clips
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        losses.append(loss)
    return _rate(stamps, warmup, steps), [float(x) for x in losses]


def _accumulate(
    model: torch.nn.Module,
    split_batch: tuple[list[dict[str, torch.Tensor]], list[int]],
    scaler: torch.amp.GradScaler,
    device: torch.device,
    half: torch.dtype | None,
) -> torch.Tensor:
    """Each micro-batch's forward and backward, its mean loss weighted by its share of the batch's target tokens as
    CausalLM weighs it on one process, so the gradients and the loss are the whole batch's; returns that loss."""
    pieces, counts = split_batch
    total = sum(counts)
    losses = []
    for piece, count in zip(pieces, counts):
        if count == 0:  # no target tokens: its mean loss is 0/0, and CausalLM skips it too
            continue
        with torch.autocast(device.type, dtype=half or torch.float32, enabled=half is not None):
            loss = model(**piece).loss
        scaler.scale(loss * (count / total)).backward()
        losses.append(loss.detach() * (count / total))
    return torch.stack(losses).sum() if losses else torch.zeros((), device=device)


def _halve(micro: int, floor: int, error: BaseException) -> int:
    """The plain loop's out-of-memory back-off, CausalLM's on one process: half the micro-batch, or give up below
    strategy.min_micro_batch."""
    if micro // 2 < floor:
        raise OutOfMemoryFloor(
            f"out of memory at micro-batch {micro} in the plain loop, the floor (strategy.min_micro_batch={floor}): "
            f"lower data.max_length or strategy.micro_batch. The error was: {str(error).splitlines()[0]}"
        ) from error
    log.warning("plain loop: out of memory at micro-batch %d, retrying the step with %d", micro, micro // 2)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return micro // 2


def _onn(job, steps: int, warmup: int) -> tuple[float, list[float]]:
    """A run's path: Trainer, CausalLM and a run's callbacks; steps per second after `warmup`, and each step's loss."""
    import lightning as L

    from onn.modalities.text.tasks import build, datamodule, trainer
    from onn.training.callbacks import ResourceMonitor, StepCheckpoint, StepClock

    config, plan = job.config, job.plan
    device = torch.device(job.device)
    stamps: list[float] = []

    class Stamps(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            stamp(stamps, device, warmup, steps)

        def on_train_end(self, trainer, pl_module) -> None:
            synchronize(device)
            stamps.append(time.perf_counter())

    run_trainer = dataclasses.replace(
        config.trainer, max_steps=warmup + steps, limit_val_batches=0, num_sanity_val_steps=0
    )
    run_config = dataclasses.replace(config, trainer=run_trainer)
    module, tokenizer = build(run_config, plan)  # its schedule spans the run's steps, as the plain loop's does
    dm = datamodule(config, tokenizer)
    folder = job.run_dir / "onn_side"
    # the stamps first: the end of training is stamped before the checkpoint is written
    callbacks = [
        Stamps(),
        StepCheckpoint(folder / "checkpoints", 10**9),
        StepClock(),
        ResourceMonitor(config.trainer.log_every_n_steps),
    ]
    fit = trainer(run_config, plan, folder, callbacks, steps_per_epoch=dm.steps_per_epoch)
    module.train()
    fit.fit(module, datamodule=dm)
    return _rate(stamps, warmup, steps), list(module.train_losses)
