"""The root of a run's config and the blocks every run has: optimizer, checkpoints, trainer, paths, tracking."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from onn.config.export import ExportConfig
from onn.config.hardware import HardwareConfig
from onn.config.model import ModelConfig
from onn.config.strategy import StrategyConfig
from onn.config.task import ServeConfig, TaskConfig, TuneConfig


@dataclass
class OptimConfig:
    name: str = MISSING  # adamw | sgd
    lr: float = MISSING
    weight_decay: float = MISSING
    betas: list[float] = MISSING  # adamw
    momentum: float = MISSING  # sgd
    nesterov: bool = MISSING  # sgd
    schedule: str = MISSING  # cosine | linear | constant | step | plateau | onecycle
    warmup_steps: int = MISSING
    step_size: int = MISSING
    gamma: float = MISSING
    patience: int = MISSING
    pct_start: float = MISSING
    clip_grad_norm: float = MISSING


@dataclass
class CheckpointConfig:
    every_n_steps: int = MISSING
    save_peft_adapter: bool = MISSING


@dataclass
class TrainerConfig:
    """lightning.Trainer's arguments that runs set; each passes to the Trainer as it is."""

    max_steps: int = MISSING
    max_epochs: int = MISSING
    val_check_interval: Any = MISSING  # steps (int) or a fraction of an epoch (float)
    check_val_every_n_epoch: int | None = MISSING
    log_every_n_steps: int = MISSING
    precision: Any = MISSING  # auto (the plan's) | 32-true | bf16-mixed | 16-mixed
    accelerator: str = MISSING
    devices: Any = MISSING
    num_nodes: int = 1
    num_sanity_val_steps: int = MISSING
    enable_progress_bar: bool = MISSING
    enable_model_summary: bool = False
    deterministic: bool = MISSING
    # a count of batches (int) or a fraction of them (float, 0 to 1); null: all. Any, as an int must stay an int
    # (OmegaConf's int | float fails Hydra's merge); onn.training.trainer.check refuses anything else in one sentence
    limit_train_batches: Any = None
    limit_val_batches: Any = None
    limit_test_batches: Any = None
    gradient_clip_val: float | None = None
    profiler: str | None = None  # one of Lightning's (simple | advanced | pytorch); null: none at all


@dataclass
class PathsConfig:
    root: str = MISSING  # the working directory the run started in
    outputs: str = MISSING  # run folders, sweeps and the cache below
    cache: str = MISSING  # hardware profiles, layer stores, tuner results


@dataclass
class TrackingConfig:
    loggers: list[Any] = field(default_factory=list)  # Lightning loggers, each a `_target_` Hydra instantiates


@dataclass
class PairSideConfig:
    """The run config one side of a dual encoder works with (onn/modalities/pairs/sides.py): its modality's
    data and model configs with data.sides.<name> and model.sides.<name> on top, the run's seed and paths.
    A pairs checkpoint saves it (as_dict) and rebuilds the side from it; Modality.pair_side reads it."""

    data: Any  # the side modality's data_schema (ImageData, MeshData, ...); CaptionData for text
    model: ModelConfig  # the side modality's model_schema (NetworkConfig)
    seed: int
    paths: PathsConfig


@dataclass
class ONNConfig:
    """The root. Each block is a config group (a folder under conf/); its type is the option's schema,
    which the option's YAML names in its defaults list (conf/data/image.yaml: `/schema/data/image`)."""

    seed: int = MISSING
    ckpt: str | None = MISSING
    prompt: str | None = MISSING
    sweep_objective: str | None = MISSING
    optim: OptimConfig = MISSING
    checkpoint: CheckpointConfig = MISSING
    trainer: TrainerConfig = MISSING
    strategy: StrategyConfig = MISSING
    hardware: HardwareConfig = MISSING
    paths: PathsConfig = MISSING
    model: ModelConfig = MISSING
    data: Any = MISSING  # a DataConfig: the option's schema (untyped only while data=auto finds its modality)
    task: TaskConfig = MISSING
    tracking: TrackingConfig = MISSING
    export: ExportConfig = MISSING
    tune: TuneConfig | None = None  # task=tune's search
    serve: ServeConfig | None = None  # task=serve's server


def named_devices(devices: Any) -> int | None:
    """The processes per node a value of trainer.devices (Lightning's `devices`) names: a count, a list of device
    indices or "0,1"; None for auto and -1 (whatever the node has)."""
    if isinstance(devices, list | tuple):
        return len(devices)
    if isinstance(devices, str) and "," in devices:
        return len([d for d in devices.split(",") if d.strip()])
    if isinstance(devices, str) and devices.strip().isdigit():
        devices = int(devices)
    return devices if isinstance(devices, int) and not isinstance(devices, bool) and devices > 0 else None
