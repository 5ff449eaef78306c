"""The types of ONN's config keys, as Hydra structured configs: a wrong type fails at compose time,
with Hydra's own message naming the key (`trainer.max_steps=abc`: "Value 'abc' of type 'str' could
not be converted to Integer").

The values live in the YAML files under conf/; these dataclasses only say what each key is. Groups
whose keys differ by option (model, data, task) are checked by the modality and the task that read
them, before anything heavy starts. `register()` runs in run.py before Hydra composes; it imports
nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING


@dataclass
class OptimConfig:
    name: str = MISSING  # adamw | sgd
    lr: float = MISSING
    weight_decay: float = MISSING
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # adamw
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
    check_val_every_n_epoch: int | None = None
    log_every_n_steps: int = MISSING
    precision: Any = "auto"  # auto (the plan's) | 32-true | bf16-mixed | 16-mixed
    accelerator: str = "auto"
    devices: Any = "auto"
    num_nodes: int = 1
    num_sanity_val_steps: int = 0
    enable_progress_bar: bool = True
    enable_model_summary: bool = False
    deterministic: bool = False
    limit_train_batches: Any = None
    limit_val_batches: Any = None
    limit_test_batches: Any = None
    gradient_clip_val: float | None = None


@dataclass
class StreamingConfig:
    chunk_size: Any = "auto"  # auto | blocks loaded at a time
    store: str = "auto"  # auto | disk | cpu
    store_dtype: str = "auto"  # auto | float32 | bfloat16 | float16 | int8 | nf4
    edges: str = "auto"  # auto | resident | stream
    activations: str = "auto"  # auto | device | host
    cache_blocks: Any = "auto"  # auto | blocks of a disk store held in host memory after their first read
    eval_tokens: Any = "auto"  # auto | tokens per streamed pass of a validation / evaluation
    prefetch: bool = True


@dataclass
class StrategyConfig:
    name: str = MISSING
    trainable: str = MISSING  # full | lora | head
    layers: Any = "all"  # all, or block indices (negative count from the end)
    lora: dict[str, Any] | None = None
    quantize: str | None = None
    micro_batch: Any = "auto"  # auto | samples per forward pass
    min_micro_batch: int = 1
    precision: str = "auto"
    gradient_checkpointing: Any = "auto"  # auto | true | false
    lightning: str = "auto"  # the Lightning strategy that places the model
    timeout_s: float = MISSING  # multi-process runs: how long a process waits for its peers
    streaming: StreamingConfig | None = None


@dataclass
class HardwareConfig:
    name: str = MISSING
    measure: bool = MISSING
    refresh: bool = False
    cache: str | None = None  # the folder of measured profiles (null: ${paths.cache}/hardware)
    budget_mb: float | None = None
    disk_probe_mb: int = 1024
    accelerator: str | None = None
    device_name: str | None = None
    device_count: int | None = None
    count: int | None = None  # devices per node to plan and run for (null: 1)
    interconnect_gb_s: float | None = None  # link between a node's devices (NVLink, PCIe), GB/s
    network_gb_s: float | None = None  # link between nodes (InfiniBand, Ethernet), GB/s
    device_memory_mb: float | None = None
    device_memory_free_mb: float | None = None
    host_memory_mb: float | None = None
    host_memory_available_mb: float | None = None
    cpu_cores: int | None = None
    matmul_tflops: float | None = None
    disk_read_mb_s: float | None = None
    h2d_mb_s: float | None = None
    bf16: bool | None = None
    matmul_gflops: dict[str, Any] | None = None
    block_call_s: dict[str, float] | None = None
    memory_gb_s: float | None = None
    decode_gvalues_s: dict[str, float] | None = None
    cuda_context_mb: float | None = None  # the CUDA context's own memory (measured; a preset may give it)
    cuda_workspace_mb: float | None = None  # cuBLAS's workspaces, allocated once per process (measured)


@dataclass
class ONNConfig:
    """The root: typed blocks, and the groups whose keys depend on the option chosen."""

    seed: int = 0
    ckpt: str | None = None
    prompt: str | None = None
    sweep_objective: str | None = None
    optim: OptimConfig = MISSING
    checkpoint: CheckpointConfig = MISSING
    trainer: TrainerConfig = MISSING
    strategy: StrategyConfig = MISSING
    hardware: HardwareConfig = MISSING
    paths: Any = MISSING
    model: Any = MISSING
    data: Any = MISSING
    task: Any = MISSING
    tracking: Any = MISSING
    export: Any = MISSING
    tune: Any = None
    serve: Any = None


def register() -> None:
    """Give Hydra the schema conf/config.yaml extends (its defaults list names `onn_schema`), and ONN's
    `hydra/launcher=submitit_local` (see register_local_launcher)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="onn_schema", node=ONNConfig)
    register_local_launcher()


def register_local_launcher() -> None:
    """`hydra/launcher=submitit_local` with a cap on the jobs running at once (hydra_plugins/onn_launcher).

    The plugin registers its own `submitit_local` when Hydra scans its plugins, and a YAML file of that name
    would be merged into the plugin's schema, which has no `array_parallelism`. So the scan runs here, once
    (Hydra would run it a moment later anyway), and this entry replaces the plugin's."""
    from hydra.core.config_store import ConfigStore
    from hydra.core.plugins import Plugins

    Plugins.instance()
    try:
        from hydra_plugins.hydra_submitit_launcher.config import LocalQueueConf
    except ImportError:  # hydra-submitit-launcher not installed: sweeps run one job after another
        return

    @dataclass
    class ThrottledLocalConf(LocalQueueConf):
        _target_: str = "hydra_plugins.onn_launcher.ThrottledLocalLauncher"
        array_parallelism: int = 2  # jobs running at once, in groups (the next group starts when one ends)
        timeout_min: int = 1440  # a job still running after this is killed (submitit's default is 60)
        # One folder for every job's logs and results (named by job id), not a folder per job (`%j`): submitit's
        # local controller opens its log in the job's folder before the submitting process has made it, and on
        # a busy machine it loses that race (FileNotFoundError, the job never runs).
        submitit_folder: str = "${hydra.sweep.dir}/.submitit"

    ConfigStore.instance().store(
        group="hydra/launcher", name="submitit_local", node=ThrottledLocalConf, provider="onn"
    )
