"""The one Lightning Trainer builder: every task that trains, validates or tests makes its Trainer here.

`trainer` config keys pass to lightning.Trainer one-to-one; `auto` values come from the plan
(precision, the device), loggers from the tracking group (`_target_` instantiation), and checkpoints
always go through the safetensors CheckpointIO.
"""

from __future__ import annotations

import logging
import math
import os
import re
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from onn.config import ONNConfig, TrainerConfig, as_dict
from onn.config.run import named_devices
from onn.errors import UserError
from onn.hardware.cluster import launched, rank
from onn.planning.plan import Plan

if TYPE_CHECKING:  # the strategy module imports Lightning: the runs that stream import it when they build one
    from onn.streaming.engine import Objective
    from onn.streaming.store import LayerStore
    from onn.streaming.strategy import EngineSettings, LayerStreamingStrategy

log = logging.getLogger("onn")
MULTI_DEVICE = ("ddp", "fsdp", "deepspeed")
# Lightning's strategies that start their processes anew and return nothing to the one that started them: ONN's
# results (the trained module, its record) would be lost, and the task failed after training ("not attached")
SPAWNED = ("ddp_spawn", "ddp_fork", "ddp_notebook")
ONN_LIGHTNING = ("auto", "streaming")  # strategy.lightning values ONN decides itself
GPU_ONLY = ("fsdp", "deepspeed")  # Lightning refuses these on the CPU
PROFILERS = ("simple", "advanced", "pytorch")  # Lightning's names for its profilers
ACCELERATORS = ("auto", "cpu", "cuda", "gpu", "mps")  # Lightning's, less the TPU's and HPU's extra packages


def check(trainer: TrainerConfig, *, trains: bool = True, launches: bool = True, planned: str | None = None) -> None:
    """The trainer group's values, checked before anything is built: one sentence per mistake.
    `trains`: the task fits weights, so its step and epoch limits must end. `launches`: it starts this node's
    processes (task=plan only plans for nodes: no launcher needed). `planned`: the hardware preset's accelerator
    (None: this machine's, measured)."""
    for key, value in (("max_steps", trainer.max_steps), ("max_epochs", trainer.max_epochs)):
        if isinstance(value, bool) or not isinstance(value, int) or value < -1:
            raise UserError(f"trainer.{key}={value!r}: give a whole number, 1 or more, or -1 (no limit).")
    if trains and trainer.max_steps == -1 and trainer.max_epochs == -1:
        raise UserError(
            "trainer.max_steps and trainer.max_epochs are both -1, so training would never end: set one of them."
        )
    _check_counts(trainer, trains)
    every = trainer.log_every_n_steps
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise UserError(f"trainer.log_every_n_steps={every!r}: give a whole number, 1 or more.")
    if trainer.profiler not in (None, *PROFILERS):
        raise UserError(
            f"trainer.profiler={trainer.profiler!r}: give one of Lightning's profilers ({', '.join(PROFILERS)}), "
            "or null for none."
        )
    interval = trainer.val_check_interval
    number = not isinstance(interval, bool) and isinstance(interval, int | float)
    # a fraction above 1.0 was Lightning's MisconfigurationException once the data and model were built
    if not number or interval <= 0 or (isinstance(interval, float) and interval > 1):
        raise UserError(
            f"trainer.val_check_interval={interval!r}: give a number of steps, or a fraction of an epoch above 0 and "
            "at most 1.0."
        )
    if trainer.gradient_clip_val is not None:  # Lightning's clipping refuses manual optimization, and ONN's own clips
        raise UserError(
            f"trainer.gradient_clip_val={trainer.gradient_clip_val}: ONN clips the gradients' norm itself, under every "
            f"strategy: give optim.clip_grad_norm={trainer.gradient_clip_val} instead (0: no clipping) and leave "
            "trainer.gradient_clip_val at null."
        )
    _check_devices(trainer, launches, planned)


def _check_counts(trainer: TrainerConfig, trains: bool) -> None:
    """The batch limits and validation counts Lightning takes as they are: `limit_train_batches=abc` was its
    TypeError, `check_val_every_n_epoch=0` a ZeroDivisionError after the data and model were built, and a training
    run limited to no step (max_steps=0, max_epochs=0, limit_train_batches=0) ended `ok` having trained nothing."""
    for key in ("limit_train_batches", "limit_val_batches", "limit_test_batches"):
        value = getattr(trainer, key)
        count = isinstance(value, int) and not isinstance(value, bool) and value >= 0
        if value is not None and not count and not (isinstance(value, float) and 0 <= value <= 1):
            raise UserError(
                f"trainer.{key}={value!r}: give a number of batches (0 or more), a fraction of them from 0.0 to 1.0, "
                "or null (all)."
            )
    every = trainer.check_val_every_n_epoch
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise UserError(
            f"trainer.check_val_every_n_epoch={every!r}: give a whole number of epochs, 1 or more, or null."
        )
    sanity = trainer.num_sanity_val_steps
    if isinstance(sanity, bool) or not isinstance(sanity, int) or sanity < -1:
        raise UserError(f"trainer.num_sanity_val_steps={sanity!r}: give a whole number, 0 or more, or -1 (all).")
    if not trains:
        return
    for key in ("max_steps", "max_epochs", "limit_train_batches"):
        if getattr(trainer, key) == 0:  # 0 and 0.0: Lightning's fit ends before its first step
            raise UserError(
                f"trainer.{key}={getattr(trainer, key)}: a training run would take no step; give 1 or more"
                + (", or -1 (no limit)." if key != "limit_train_batches" else ", a fraction above 0, or null (all).")
            )


def _check_devices(trainer: TrainerConfig, launches: bool, planned: str | None) -> None:
    """Where the run goes (precision, accelerator, devices, nodes): what Lightning would refuse with a traceback."""
    from typing import get_args

    from lightning.fabric.plugins.precision.precision import _PRECISION_INPUT, _PRECISION_INPUT_STR

    accepted = {str(v) for kind in get_args(_PRECISION_INPUT) for v in get_args(kind)}  # 32, "bf16" and the rest
    named = [v for v in get_args(_PRECISION_INPUT_STR) if "transformer-engine" not in v]  # its own names
    if str(trainer.precision) not in ("None", "auto", *accepted):
        raise UserError(
            f"trainer.precision={trainer.precision!r}: give auto (the plan's), or one of Lightning's: "
            f"{', '.join(named)}."
        )
    if trainer.accelerator not in (None, *ACCELERATORS):
        raise UserError(f"trainer.accelerator={trainer.accelerator!r}: give one of {', '.join(ACCELERATORS)}.")
    nodes = trainer.num_nodes
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise UserError(f"trainer.num_nodes={nodes!r}: give a whole number, 1 or more.")
    devices = trainer.devices
    if not _devices_ok(devices):
        raise UserError(
            f"trainer.devices={devices!r}: give auto, a count (1 or more, -1: every GPU), or a list of device indices."
        )
    if not launches:  # task=plan plans for any machine: -1 is every GPU of the planned one
        return
    # under auto the run is on the preset's device (a GPU preset on a machine without one: _accelerator's sentence)
    on_planned = planned == "cpu" or (planned is None and not _has_gpu("gpu"))
    cpu = trainer.accelerator == "cpu" or (trainer.accelerator in (None, "auto") and on_planned)
    _check_cpu_devices(devices, "cpu" if cpu else str(trainer.accelerator))
    launcher = os.getenv("MASTER_ADDR") or os.getenv("NODE_RANK") or launched()
    if nodes > 1 and not launcher:  # the rendezvous would wait strategy.timeout_s for nodes nobody starts
        raise UserError(
            f"trainer.num_nodes={nodes} asks for {nodes} machines, and no launcher started this one: start each node "
            f"with torchrun (--nnodes={nodes} --rdzv-endpoint=HOST:PORT) or srun, or set MASTER_ADDR, MASTER_PORT "
            "and NODE_RANK on each (docs/distributed.md)."
        )
    _check_launched_world(trainer)


def _check_launched_world(trainer: TrainerConfig) -> None:
    """Under torchrun, trainer.devices x trainer.num_nodes must be the processes it started: Lightning refused
    another product in every process, each with its traceback. trainer.devices=auto on a GPU machine is Lightning's
    to count (its GPUs)."""
    world, local = os.getenv("WORLD_SIZE", ""), os.getenv("LOCAL_WORLD_SIZE", "")
    if not (launched() and world.isdigit() and local.isdigit() and int(local) > 0):
        return
    per_node = named_devices(trainer.devices)
    if per_node is None and trainer.accelerator != "cpu" and _has_gpu("cuda"):
        return
    asked = (per_node or 1) * trainer.num_nodes
    if asked != int(world):
        raise UserError(
            f"torchrun started {world} processes ({local} per node), and trainer.devices={trainer.devices} x "
            f"trainer.num_nodes={trainer.num_nodes} asks for {asked}: give trainer.devices={local} "
            f"trainer.num_nodes={int(world) // int(local)}."
        )


def _check_cpu_devices(devices: Any, accelerator: str) -> None:
    """trainer.devices=-1 (every GPU) on the CPU: Lightning's TypeError after the run was planned and built. Checked
    before planning from trainer.accelerator and the machine, and again where the accelerator is final (build_trainer):
    a CPU preset on a GPU machine runs on the CPU too."""
    if accelerator == "cpu" and devices in (-1, "-1"):
        raise UserError(
            "trainer.devices=-1 means every GPU, and this run is on the CPU: give a number of processes instead, "
            "e.g. trainer.devices=1."
        )


def _devices_ok(devices: Any) -> bool:
    """A value of Lightning's `devices`: auto, a count (-1: every device), a list of indices, or "0,1"."""
    if devices in (None, "auto", -1, "-1"):
        return True
    if isinstance(devices, str):
        return re.fullmatch(r"\d+|(\d+\s*,\s*)*\d+\s*,?", devices.strip()) is not None
    if isinstance(devices, list | tuple):
        return bool(devices) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in devices)
    return isinstance(devices, int) and not isinstance(devices, bool) and devices >= 1


def processes_per_node(trainer: TrainerConfig) -> int:
    """The processes trainer.devices asks for on each node (auto: one, on a CPU)."""
    return device_processes(trainer.devices)


def device_processes(devices: Any) -> int:
    """The processes a value of trainer.devices (Lightning's `devices`) starts on a node (auto: one, on a CPU)."""
    return named_devices(devices) or 1


def check_launch(config: ONNConfig, multirun: bool) -> None:
    """Lightning's DDP launcher starts the other processes by running the command line again, which in a
    Hydra multirun (-m) runs the whole sweep again in each of them: refused in one sentence."""
    if multirun and processes_per_node(config.trainer) > 1 and not launched():
        raise UserError(
            f"trainer.devices={config.trainer.devices} in a multirun (-m): Lightning starts the extra processes by "
            "running the command again, which would run the whole sweep again in each; run that job on its own, or "
            "give each job one device (a cluster launcher such as hydra/launcher=submitit_slurm gives each its "
            "own machine)."
        )


def explain_distributed_failure(error: BaseException, config: ONNConfig | None) -> str | None:
    """One sentence for a process group that could not form or lost a peer (None for any other error):
    torch raises these after strategy.timeout_s, naming neither what went wrong nor what to do."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    name = type(error).__name__
    # gloo: "Connection closed by peer", "Read error ...: Connection reset by peer", "Timed out waiting ... for recv"
    lost_peer = isinstance(error, RuntimeError) and "gloo" in text and ("by peer" in text or "Timed out" in text)
    if name not in ("DistNetworkError", "DistStoreError") and not lost_peer or not config:
        return None
    where = f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ.get('MASTER_PORT', '?')}"
    timeout = config.strategy.timeout_s
    if name == "DistNetworkError":
        return unreachable(where, timeout) + f" ({text})"
    if name == "DistStoreError":
        return (
            f"the other processes did not join the rendezvous at {where} within strategy.timeout_s={timeout}: "
            f"start every node with the same address and trainer.num_nodes. ({text})"
        )
    return (
        f"rank {rank()} lost a peer process (it stopped, or its link went silent for strategy.timeout_s={timeout}); "
        f"resume every node with ckpt=last. ({text})"
    )


def unreachable(where: str, timeout: float) -> str:
    return (
        f"rank {rank()} could not reach the rendezvous at {where} within strategy.timeout_s={timeout}: check that "
        "rank 0 is running there and that the address and port (MASTER_ADDR/MASTER_PORT, torchrun "
        "--rdzv-endpoint) are right and open."
    )


def wait_for_rendezvous(timeout: float) -> None:
    """A rank other than 0 waits here, at most `timeout` seconds, until the rendezvous port answers: torch's
    own store client retries past its timeout (about twice it), so an unreachable address is named in time."""
    host, port = os.getenv("MASTER_ADDR"), os.getenv("MASTER_PORT", "")
    if rank() == 0 or not host or not port.isdigit():
        return  # rank 0 opens the rendezvous; without an address torch reports what is missing
    deadline = time.monotonic() + float(timeout)
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=max(0.1, deadline - time.monotonic())):
                return
        except OSError:
            if time.monotonic() + 0.2 >= deadline:
                raise UserError(unreachable(f"{host}:{port}", timeout)) from None
            time.sleep(0.2)


def data_parallel(name: str, config: ONNConfig, accelerator: str):
    """Lightning's multi-process strategy `name` with the configured process-group timeout (Lightning's default
    is 30 minutes, so a dead peer would hang a run that long); None when `name` is not one."""
    if not name.startswith(MULTI_DEVICE):
        return None
    if accelerator == "cpu" and name.startswith(GPU_ONLY):
        raise UserError(
            f"strategy={config.strategy.name} (Lightning's {name}) runs on CUDA GPUs only: Lightning refuses "
            "the CPU; on a CPU use strategy=ddp (data parallel over processes, gloo) or a single-process strategy."
        )
    from datetime import timedelta

    from lightning.pytorch.strategies import StrategyRegistry

    if name not in StrategyRegistry:
        return None
    entry = StrategyRegistry[name]
    if launched():
        wait_for_rendezvous(config.strategy.timeout_s)
    timeout = timedelta(seconds=float(config.strategy.timeout_s))
    if name.startswith(GPU_ONLY):
        from onn.training.distributed import sharded_strategy

        return sharded_strategy(name, entry, config, world_size(config), timeout)
    from lightning.pytorch.strategies import DDPStrategy

    from onn.training.distributed import EvaluatedOnceDDP

    strategy = EvaluatedOnceDDP if entry["strategy"] is DDPStrategy else entry["strategy"]
    return strategy(**entry["init_params"], timeout=timeout)


def check_lightning(name: str) -> None:
    """strategy.lightning: one of Lightning's registered strategies that returns to the process that started it,
    or ONN's own (auto, streaming). Lightning refused an unknown name with a traceback, and a spawning strategy
    trained, then failed the task ("not attached to a Trainer")."""
    if name.startswith(SPAWNED):
        raise UserError(
            f"strategy.lightning={name} starts its processes anew and returns nothing to the one that started them, "
            "so ONN could not finish the run: use strategy=ddp (strategy.lightning=ddp)."
        )
    from lightning.pytorch.strategies import StrategyRegistry

    if name not in ONN_LIGHTNING and name not in StrategyRegistry:
        raise UserError(
            f"strategy.lightning={name!r} is not a Lightning strategy: give auto, streaming (layer streaming) or one "
            "of Lightning's registered names (ddp, fsdp, deepspeed_stage_2, ...), or choose strategy=ddp, fsdp, "
            "deepspeed_zero2 or deepspeed_zero3_offload."
        )


def world_size(config: ONNConfig) -> int:
    """The processes a multi-device run has: trainer.devices per node (auto: every GPU visible) x nodes."""
    if config.trainer.devices in (None, "auto", -1, "-1"):
        import torch

        per_node = max(1, torch.cuda.device_count())
    else:
        per_node = processes_per_node(config.trainer)
    return per_node * int(config.trainer.num_nodes)


def processes(config: ONNConfig) -> int:
    """The processes a run has, known before its Trainer exists: those its launcher started (torchrun's WORLD_SIZE),
    else trainer.devices x trainer.num_nodes, where devices=auto is what build_trainer gives Lightning: every GPU
    visible under a multi-device strategy (ddp, fsdp, deepspeed), else one."""
    world = os.getenv("WORLD_SIZE", "")
    if launched() and world.isdigit():
        return int(world)
    lightning = config.strategy.lightning
    spread = isinstance(lightning, str) and lightning.startswith(MULTI_DEVICE)
    if config.trainer.devices not in (None, "auto") or spread:
        return world_size(config)
    return int(config.trainer.num_nodes)


def warn_oversubscribed(kwargs: dict[str, Any]) -> None:
    """More CPU processes than cores: they run, but share the cores and each step waits for the slowest.
    `kwargs`: lightning.Trainer's arguments, as build_trainer gives them."""
    wanted = device_processes(kwargs["devices"])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if kwargs["accelerator"] == "cpu" and wanted > cores:
        log.warning(
            "trainer.devices=%d starts %d processes on this machine's %d CPU core(s): they share the cores, so each "
            "step is slower than with trainer.devices=%d; use at most %d",
            wanted,
            wanted,
            cores,
            cores,
            cores,
        )


REQUEUE_CHECKPOINTS = "hpc_ckpt_*.ckpt"  # what Lightning's SLURM auto-requeue saves into the run folder at its signal


def newest_checkpoint(folder: Path) -> Path | None:
    """The run folder's newest whole checkpoint: its last.ckpt (last.ckpt.old where a save killed between its two
    renames left only that), or one Lightning's SLURM auto-requeue saved at sbatch's --signal (after the last.ckpt
    before it); None when it holds none."""
    last = folder / "checkpoints" / "last.ckpt"
    if not (last / "meta.json").is_file():
        last = last.with_name("last.ckpt.old")  # an .old beside a whole last.ckpt is the older of the two
    found = [*folder.glob(REQUEUE_CHECKPOINTS), last]
    whole = [p for p in found if (p / "meta.json").is_file()]  # a checkpoint's JSON half, written with it
    return max(whole, key=lambda p: (p / "meta.json").stat().st_mtime, default=None)


def keep_newest_as_last(folder: Path) -> None:
    """The run folder's newest checkpoint as its checkpoints/last.ckpt, where the run's saves go and a resume looks,
    and no hpc_ckpt_N.ckpt left: under SLURM Lightning loads the highest-numbered one, unasked, at every later
    fit() or validate() without a checkpoint (its weights over the trained ones)."""
    import shutil

    newest, last = newest_checkpoint(folder), folder / "checkpoints" / "last.ckpt"
    if newest is not None and newest != last:
        old = last.with_name(last.name + ".old")
        last.parent.mkdir(parents=True, exist_ok=True)
        if newest == old:  # a save killed between its two renames: its previous checkpoint goes back in its place
            shutil.rmtree(last, ignore_errors=True)
        else:
            shutil.rmtree(old, ignore_errors=True)
            if last.exists():
                last.rename(old)
        newest.rename(last)
        shutil.rmtree(old, ignore_errors=True)
        log.info("%s, the run's newest checkpoint, is now %s", newest.name, last)
    for stale in folder.glob(REQUEUE_CHECKPOINTS):  # older than last.ckpt
        shutil.rmtree(stale, ignore_errors=True)


def build_trainer(
    config: ONNConfig,
    plan: Plan,
    run_dir: Path,
    callbacks: list,
    *,
    strategy: Any = None,
    loggers: bool = True,
    steps_per_epoch: int | None = None,
    distributed_sampler: bool = True,
):
    """A Trainer for this run. `strategy`: a Strategy object or Lightning name (default: the strategy
    config's `lightning`); `steps_per_epoch`: the training loader's length, when it has epochs;
    `distributed_sampler`: False when the data module gives each process its own share of every batch."""
    import lightning as L
    from lightning.fabric.plugins.environments import SLURMEnvironment
    from lightning.pytorch.callbacks import Checkpoint, LearningRateMonitor

    from onn.training.checkpoint_io import SafetensorsCheckpointIO
    from onn.training.profiler import NoProfiler

    share_console_with_hydra()
    trainer = config.trainer
    kwargs = as_dict(trainer)  # lightning.Trainer's arguments, the trainer group's keys one-to-one
    if trainer.precision in (None, "auto"):
        kwargs["precision"] = plan.precision
    kwargs.update(_validation_schedule(config, steps_per_epoch))
    strategy = strategy if strategy is not None else config.strategy.lightning
    kwargs["accelerator"] = _accelerator(trainer, plan)
    _check_cpu_devices(trainer.devices, kwargs["accelerator"])
    if trainer.devices in (None, "auto") and not (isinstance(strategy, str) and strategy.startswith(MULTI_DEVICE)):
        kwargs["devices"] = 1
    if isinstance(strategy, str):
        check_lightning(strategy)
    if strategy == "auto" and processes(config) > 1:
        strategy = "ddp"  # what Lightning picks for several processes, here with strategy.timeout_s (its own: 30 min)
    if isinstance(strategy, str):
        strategy = data_parallel(strategy, config, kwargs["accelerator"]) or strategy
    warn_oversubscribed(kwargs)
    from lightning.pytorch.callbacks import ProgressBar
    from lightning.pytorch.utilities.imports import _RICH_AVAILABLE

    from onn.training.callbacks import Progress, StepsProgressBar

    callbacks = [*callbacks, Progress()]  # the run's record reads the last step reached (onn/tasks/record.py)
    if SLURMEnvironment.detect():  # Lightning's auto-requeue checkpoint, once resumed from
        from onn.training.distributed import RequeueCheckpoint

        callbacks.append(RequeueCheckpoint())
    if trainer.enable_progress_bar and _RICH_AVAILABLE and not any(isinstance(c, ProgressBar) for c in callbacks):
        callbacks.append(StepsProgressBar())  # the bar Lightning would pick, its epoch total fixed
    made = make_loggers(config, run_dir) if loggers else []
    if made:
        callbacks = [*callbacks, LearningRateMonitor("step")]
    # no_grad, not inference_mode, for evaluation: torchmetrics states reset inside a standalone
    # validate() would otherwise become inference tensors that fit's validation cannot update
    kwargs["inference_mode"] = False
    kwargs["enable_checkpointing"] = any(isinstance(c, Checkpoint) for c in callbacks)
    kwargs["profiler"] = trainer.profiler or NoProfiler()
    return L.Trainer(
        default_root_dir=str(run_dir),
        logger=made or False,
        callbacks=callbacks,
        plugins=[SafetensorsCheckpointIO()],
        strategy=strategy,
        use_distributed_sampler=distributed_sampler,
        **kwargs,
    )


def _validation_schedule(config: ONNConfig, steps_per_epoch: int | None) -> dict[str, Any]:
    """Lightning's val_check_interval (and check_val_every_n_epoch) for trainer.val_check_interval: steps, capped
    by the run's length, or a fraction of an epoch, which a language model's data (a stream whose length Lightning
    cannot read, or resident: one endless stream) does not have: Lightning refused it once the model was built.
    A fraction whose batches outnumber the run's (max_steps ends it first) becomes the run's length, as a whole
    number is capped: the run never validated, and best.ckpt and its monitored score stayed empty."""
    trainer = config.trainer
    interval = trainer.val_check_interval
    if isinstance(interval, int) and not isinstance(interval, bool):
        batches = None if steps_per_epoch is None else limited_batches(steps_per_epoch, trainer.limit_train_batches)
        limits = [n for n in (trainer.max_steps, batches) if isinstance(n, int) and n > 0]
        return {"val_check_interval": min([interval, *limits])}
    if config.data.modality == "text":
        raise UserError(
            f"trainer.val_check_interval={interval}: a language model's training data is a stream with no epoch "
            "Lightning can take a fraction of; give a number of optimizer steps (a whole number)."
        )
    if steps_per_epoch is not None and trainer.max_steps > 0:
        # Lightning's own count of a fraction's batches (its val_check_batch); a batch is one optimizer step: a
        # module splits it into micro-batches itself, and Lightning's accumulate_grad_batches is never set
        batches = max(1, int(limited_batches(steps_per_epoch, trainer.limit_train_batches) * interval))
        if batches > trainer.max_steps:
            return {"val_check_interval": trainer.max_steps}
    if trainer.check_val_every_n_epoch is None:  # a fraction of an epoch: validate every epoch
        return {"check_val_every_n_epoch": 1}
    return {}


GPUS = {"cuda": "a CUDA GPU", "gpu": "a GPU", "mps": "an Apple GPU (MPS)"}  # accelerators a machine may lack


def _accelerator(trainer: TrainerConfig, plan: Plan) -> str:
    """Lightning's accelerator: trainer.accelerator, or (auto) the planned machine's. A GPU this machine lacks is one
    sentence: Lightning refused a CUDA one with a traceback, and an Apple preset (mps) trained on the CPU instead."""
    planned = plan.hardware["accelerator"]
    given = trainer.accelerator not in (None, "auto")
    accelerator = trainer.accelerator if given else (planned if planned in ("cuda", "mps") else "cpu")
    if accelerator not in GPUS or _has_gpu(accelerator):
        return accelerator
    if given:
        raise UserError(
            f"trainer.accelerator={accelerator} asks for {GPUS[accelerator]} and this machine has none: give cpu, "
            "or auto for the plan's device."
        )
    raise UserError(
        f"hardware={plan.hardware['name']} plans for {GPUS[accelerator]} and this machine has none: use that preset "
        "with task=plan, or hardware=auto to run here."
    )


def _has_gpu(accelerator: str) -> bool:
    import torch

    cuda = torch.cuda.is_available()
    mps = bool(getattr(torch.backends, "mps", None)) and torch.backends.mps.is_available()
    return {"cuda": cuda, "mps": mps}.get(accelerator, cuda or mps)  # Lightning's "gpu": whichever there is


def make_loggers(config: ONNConfig, run_dir: Path) -> list:
    """The tracking group's loggers, each writing into the run folder (`save_dir`) where it takes one: Aim's
    AimLogger takes none (its YAML names its `repo`), and was refused the keyword."""
    import inspect

    from hydra.utils import get_class, instantiate

    made = []
    for spec in config.tracking.loggers:
        target = spec.get("_target_")
        try:
            takes_dir = "save_dir" in inspect.signature(get_class(target)).parameters
        except ImportError as error:
            raise UserError(
                f"tracking: the logger {target} cannot be imported ({error}): install its package, or choose "
                "tracking=tensorboard, csv or none."
            ) from None
        made.append(instantiate(spec, save_dir=str(run_dir)) if takes_dir else instantiate(spec))
    return made


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


def limited_batches(batches: int, limit: int | float | None) -> int:
    """The training batches of an epoch of `batches` that Lightning runs under trainer.limit_train_batches (a count,
    or a fraction of them; None: all). A fraction that leaves none is one sentence: Lightning refused it in fit."""
    if limit is None or isinstance(limit, bool):
        return batches
    kept = min(batches, limit) if isinstance(limit, int) else int(batches * limit)
    if batches and not kept and limit > 0:
        raise UserError(
            f"trainer.limit_train_batches={limit} of the {batches} training batches an epoch has is less than one "
            f"batch: give at least {1 / batches:.3g}, or a number of batches."
        )
    return kept


def optimizer_steps(trainer, steps_per_epoch: int, per_process: bool = False) -> int | None:
    """What Trainer.estimated_stepping_batches gives, for a schedule, without setting up the training data:
    asked in configure_optimizers it sets the data up before a resumed run's loop state is restored, and
    Lightning then never gives a stateful loader its position back (a run killed mid-epoch would start that
    epoch over). `steps_per_epoch`: the training loader's batches, of which trainer.limit_train_batches keeps
    some (the schedule ended where the whole epochs would have: a cosine stopped at 3/4 of its rate);
    `per_process`: they are already one process's share (a classifier's process_batches). None with several
    processes and a count of the whole data's batches, whose share Lightning's own figure knows."""
    batches = limited_batches(steps_per_epoch, trainer.limit_train_batches)
    if trainer.world_size > 1 and not per_process:
        return None
    per_epoch = math.ceil(batches / max(1, trainer.accumulate_grad_batches))
    limits = [trainer.max_steps] if trainer.max_steps and trainer.max_steps > 0 else []
    if trainer.max_epochs is not None and trainer.max_epochs > 0:
        limits.append(per_epoch * trainer.max_epochs)
    return min(limits) if limits else None


def engine_settings(config: ONNConfig, plan: Plan) -> EngineSettings:
    """The layer-streaming engine's settings for a network's blocks, as the plan chose them."""
    from onn.streaming.strategy import EngineSettings

    s = plan.streaming
    return EngineSettings(
        chunk_size=s.chunk_size,
        store=s.store,
        store_dtype=s.store_dtype,
        edges=s.edges,
        activations=s.activations,
        cache_blocks=s.cache_blocks,
        eval_tokens=s.eval_tokens,
        prefetch=config.strategy.streaming.prefetch,
        # as text's engines take it: under a mixed precision a network's plan computes in its half dtype, and the
        # engine autocasts the blocks to it in the forward and in the backward's recompute (outside Lightning's)
        compute_dtype=streamed_compute_dtype(plan),
        blocks_path=config.model.layer_map.blocks,  # the blocks the network's store was drawn for
    )


def streamed_compute_dtype(plan: Plan) -> str | None:
    """The streamed blocks' compute dtype: the plan's under mixed precision, else None (the model's own)."""
    return plan.streaming.compute_dtype if plan.precision.endswith("-mixed") else None


def streaming_store(config: ONNConfig, plan: Plan, run_dir: Path, device: str) -> LayerStore | None:
    """This run's own layer store, which the network's frozen block weights are drawn into before the strategy
    streams them (None: the plan does not stream)."""
    if plan.strategy != "sparse_lora":
        return None
    from onn.streaming.strategy import layer_store

    return layer_store(engine_settings(config, plan), run_dir / "layer_store", device)


def streaming_strategy(
    config: ONNConfig, plan: Plan, run_dir: Path, device: str, objective: Objective
) -> LayerStreamingStrategy | None:
    """ONN's layer-streaming strategy when the plan streams a network's blocks (None: Lightning's default), with
    the modality's Objective; it streams from the store the module holds (`streaming_store`), or from one of its
    own, which it fills with the blocks' weights."""
    if plan.strategy != "sparse_lora":
        return None
    from onn.streaming.strategy import LayerStreamingStrategy

    return LayerStreamingStrategy(
        engine_settings(config, plan), run_dir / "layer_store", plan.micro_batch, device=device, objective=objective
    )
