"""`task=bench_overhead`: what ONN's language-model runner costs a step, against a plain PyTorch loop.

Both train the same model (the run's model, strategy and precision as planned) on the same batches from
the same data module, with the same optimizer, schedule and gradient clipping, for `task.warmup` steps and
then `task.steps` timed ones:

  plain   model(**batch).loss.backward(), the optimizer's step and zero_grad, in a loop: nanoGPT's step
  onn     a run's path: the Lightning Trainer and the CausalLM module with a run's callbacks (step clock,
          resource monitor, checkpoint, progress)

`overhead/ratio` = ONN's steps per second / the plain loop's, the median of `task.repeats` rounds (each
times both sides, in alternating order: a slow spell of a shared machine hits both). Steps are timed from
one step's start to the next (the device synchronised at each stamp), so data loading counts on both sides.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any

import torch

from onn.bench.vision import epochs
from onn.config import ONNConfig
from onn.config.task import BenchOverheadTask
from onn.errors import UserError


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
    for round_ in range(task.repeats):
        sides = [("plain", lambda: _plain(job, steps, warmup)), ("onn", lambda: _onn(job, steps, warmup))]
        for name, measure in sides if round_ % 2 == 0 else sides[::-1]:
            L.seed_everything(config.seed, verbose=False)
            rounds[name].append(measure())
    ratios = sorted(o / p for o, p in zip(rounds["onn"], rounds["plain"]))
    metrics = {
        "overhead/ratio": round(ratios[len(ratios) // 2], 4),
        "overhead/onn_steps_per_s": round(max(rounds["onn"]), 2),
        "overhead/plain_steps_per_s": round(max(rounds["plain"]), 2),
        "overhead/rounds": {k: [round(x, 2) for x in v] for k, v in rounds.items()},
        "overhead/timed_steps": steps,
        "overhead/device": str(job.device),
    }
    print(
        f"runner overhead: ONN {metrics['overhead/onn_steps_per_s']:.1f} steps/s, plain loop "
        f"{metrics['overhead/plain_steps_per_s']:.1f} steps/s (best rounds); median round ONN/plain = "
        f"{metrics['overhead/ratio']:.3f}",
        flush=True,
    )
    return metrics


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rate(stamps: list[float], warmup: int, steps: int) -> float:
    return steps / (stamps[warmup + steps] - stamps[warmup])


def _plain(job, steps: int, warmup: int) -> float:
    """nanoGPT's loop on the module the plan builds: steps per second after `warmup`."""
    from onn.modalities.text.tasks import build, datamodule
    from onn.training.optim import make_optimizer, make_schedule

    config, plan = job.config, job.plan
    device = torch.device(job.device)
    module, tokenizer = build(config, plan)
    model = module.model.to(device).train()
    loader = datamodule(config, tokenizer).train_dataloader()
    optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad], config.optim)
    scheduler = make_schedule(optimizer, config.optim, warmup + steps, "val/loss", epochs=False)["scheduler"]
    clip = config.optim.clip_grad_norm
    half = {"bf16": torch.bfloat16, "16": torch.float16}.get(plan.precision.split("-")[0])
    stamps: list[float] = []
    for batch in epochs(loader, warmup + steps + 1):  # as many epochs as the steps take, as the Trainer runs
        _sync(device)
        stamps.append(time.perf_counter())
        if len(stamps) > warmup + steps:
            break
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        autocast = torch.autocast(device.type, dtype=half) if half else contextlib.nullcontext()
        with autocast:
            loss = model(**batch).loss
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
    return _rate(stamps, warmup, steps)


def _onn(job, steps: int, warmup: int) -> float:
    """A run's path: Trainer, CausalLM and a run's callbacks; steps per second after `warmup`."""
    import lightning as L

    from onn.modalities.text.tasks import build, datamodule, trainer
    from onn.training.callbacks import ResourceMonitor, StepCheckpoint, StepClock

    config, plan = job.config, job.plan
    device = torch.device(job.device)
    stamps: list[float] = []

    class Stamps(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            _sync(device)
            stamps.append(time.perf_counter())

        def on_train_end(self, trainer, pl_module) -> None:
            _sync(device)
            stamps.append(time.perf_counter())

    module, tokenizer = build(config, plan)
    dm = datamodule(config, tokenizer)
    folder = job.run_dir / "onn_side"
    # the stamps first: the end of training is stamped before the checkpoint is written
    callbacks = [
        Stamps(),
        StepCheckpoint(folder / "checkpoints", 10**9),
        StepClock(),
        ResourceMonitor(config.trainer.log_every_n_steps),
    ]
    run_trainer = dataclasses.replace(
        config.trainer, max_steps=warmup + steps, limit_val_batches=0, num_sanity_val_steps=0
    )
    run_config = dataclasses.replace(config, trainer=run_trainer)
    fit = trainer(run_config, plan, folder, callbacks, steps_per_epoch=dm.steps_per_epoch)
    module.train()
    fit.fit(module, datamodule=dm)
    return _rate(stamps, warmup, steps)
