"""task=...: what a run does. Each task is its schema; conf/task/<name>.yaml names it and holds the values."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

# tasks that build a trained checkpoint's model resident: training-only settings (a Lightning strategy, the
# held-out fraction) do not apply to them
READS_CHECKPOINT = ("eval", "infer", "export", "serve")


@dataclass
class TaskConfig:
    name: str = MISSING


@dataclass
class EarlyStopping:
    """Stop when task.monitor has not improved by min_delta for `patience` validations (0: never stop early).
    A block, not null when off: a command line's `task.early_stopping={patience: 5}` merges into it."""

    patience: int = MISSING
    min_delta: float = MISSING


@dataclass
class TrainTask(TaskConfig):
    """task=train's keys. The tasks that take a recipe's model (plan, eval, infer, export, tune, serve and the
    benches that train) extend them, so a recipe's task keys hold whichever of them runs it."""

    validate_before: bool = MISSING  # validate once before the first step (the loss the run starts from)
    exact_match_samples: int = MISSING  # text: held-out problems answered after training
    monitor: str = MISSING  # classifiers: the metric that picks the best checkpoint
    label_smoothing: float = MISSING
    mixup: float = MISSING  # classifiers: mixup's Beta(alpha, alpha) (0: off)
    adapt_norm: bool = MISSING
    early_stopping: EarlyStopping = MISSING
    # text with a recurrent LM (model=char_lstm): backpropagate through chunks of this many tokens, the state carried
    # from one chunk to the next, detached (truncated BPTT); 0: through the whole sequence
    tbptt_steps: int = MISSING
    # diffusion (onn/modalities/diffusion): how task=infer and task=eval draw images
    seed: int = MISSING  # the sampling seed: diffusion's images and text task=infer's sampled completions
    sampler: str = MISSING  # ddim (few steps) | ddpm (every training timestep)
    sample_steps: int = MISSING  # denoising steps (ddim); ddpm takes the schedule's own
    samples: int = MISSING  # images drawn
    classifier: str | None = MISSING  # task=eval: an ONN image classifier's checkpoint that labels the samples
    confidence: float = (
        MISSING  # task=eval: a sample counts as recognised when the classifier's top probability is this
    )


@dataclass
class EvalTask(TrainTask):
    max_samples: int = MISSING
    max_new_tokens: Any = MISSING  # auto | tokens


@dataclass
class InferTask(TrainTask):
    input: str | None = MISSING
    output: str | None = MISSING
    template: bool = MISSING
    max_new_tokens: Any = MISSING  # auto | tokens (checked where it is read: text's new_tokens)
    temperature: float = MISSING
    top_p: float = MISSING
    gallery: str | None = MISSING
    top_k: int = MISSING


@dataclass
class BenchTask(TaskConfig):
    """task=bench: the equitable grid's protocol (onn/bench/suite.py)."""

    warmup_steps: int = MISSING
    steps: int = MISSING
    val_batches: int = MISSING
    quality: str = MISSING  # loss_fall | exact_match
    exact_match_samples: int = MISSING
    learned_p: float = MISSING
    score_weights: dict[str, float] = field(default_factory=dict)


@dataclass
class BenchGiantTask(TrainTask):
    steps: int = MISSING
    kill_after: int = MISSING
    rebuild: bool = MISSING
    kill_build_after: int = MISSING
    keep_store: bool = MISSING
    disk_probe_mb: int = MISSING
    gen_batch: int = MISSING
    gen_tokens: int = MISSING
    accelerate: bool = MISSING


@dataclass
class BenchGpuTask(TrainTask):
    steps: int = MISSING
    gen_batch: int = MISSING
    gen_tokens: int = MISSING
    accelerate: bool = MISSING
    overhead: bool = MISSING
    time_limit_s: int = MISSING
    vision_source: str | None = MISSING


@dataclass
class BenchOverheadTask(TaskConfig):
    steps: int = MISSING
    warmup: int = MISSING
    repeats: int = MISSING


@dataclass
class BenchVisionTask(TrainTask):
    """task=bench_vision and task=bench_media: a classifier's training steps, timed."""

    steps: int = MISSING
    warmup: int = MISSING
    repeats: int = MISSING
    standard_workers: int = MISSING


@dataclass
class BenchServeTask(TrainTask):
    requests: int = MISSING
    max_tokens: int = MISSING
    clients: int = MISSING
    requests_per_client: int = MISSING
    load_max_tokens: int = MISSING


@dataclass
class BenchOmnyTask(TaskConfig):
    """task=bench_omny: a model exported as a pipeline of .omny pieces, validated, measured, run on pictures."""

    image: str | None = MISSING  # a photograph; null: matplotlib's sample photograph (grace_hopper.jpg)
    page: str | None = MISSING  # a page of printed text for OCR; null: one rendered here
    text: str = MISSING  # the detector's prompt
    points: list[list[float]] = MISSING  # SAM2's prompts, as fractions of the image's width and height
    repeats: int = MISSING  # timed runs of the whole pipeline; the best is reported


@dataclass
class ChaosTrack:
    """One of bench_chaos's tracks: a short run with frequent checkpoints, killed and resumed."""

    overrides: list[str] = MISSING  # run.py's overrides (a sweep's too, with sweep: true)
    data: str | None = None  # a dataset bench_chaos writes first: images, audio, jsonl, pairs; null: none
    sweep: bool = False  # the overrides describe a --multirun sweep: it is killed mid-job and run again
    failpoints: list[str] = field(default_factory=list)  # named kill points its runs reach (onn/hardware/failpoints.py)
    own_cache: bool = False  # each run its own paths.cache: every run builds its layer store (the profile shared)


@dataclass
class ChaosServer:
    """bench_chaos's server part: task=serve under clients that vanish, time out or send malformed requests."""

    overrides: list[str] = MISSING  # run.py's overrides for the task=serve process (its model)
    requests: int = MISSING  # the load after which resident memory is read first
    more_requests: int = MISSING  # then this many more, and memory read again
    clients: int = MISSING  # concurrent clients
    drop_share: float = MISSING  # requests whose client vanishes mid-stream or times out
    malformed_share: float = MISSING  # requests whose body the API must refuse
    max_tokens: int = MISSING  # tokens per answered request (greedy: compared with the answer alone)


@dataclass
class BenchChaosTask(TaskConfig):
    """task=bench_chaos: runs killed with SIGKILL at seeded random moments, resumed, compared bitwise."""

    trials: int = MISSING  # kill -9 trials in all, shared among the tracks
    seed: int = MISSING  # the moments and the generated data
    after_first_checkpoint: float = MISSING  # the share of kills after the whole run's first checkpoint
    kill_from: float = MISSING  # a kill before it falls in [kill_from, 1] x its time
    kill_to: float = MISSING  # a kill after it falls in the first kill_to of the rest of the run
    failpoint_share: float = MISSING  # the share of a track's trials killed at one of its named points
    atol: float = MISSING  # where a track is not bitwise: the largest difference called close
    timeout_s: float = MISSING  # one run's limit
    tracks: dict[str, ChaosTrack] = MISSING
    server: ChaosServer | None = None  # null: no server part


@dataclass
class BenchShardPlanTask(TaskConfig):
    blocks: int = MISSING
    block_mb: float = MISSING
    jitter: float = MISSING
    embed_mb: float = MISSING
    head_mb: float = MISSING
    activation_mb: float = MISSING
    head_activation_mb: float = MISSING
    nodes_mb: list[float] = MISSING
    fleet_slack: float = MISSING
    repeats: int = MISSING
    seed: int = MISSING


@dataclass
class BenchStreamingTask(TaskConfig):
    seq_len: int = MISSING
    micro_batch: int = MISSING
    chunk_size: int = MISSING
    reuse_m: list[int] = MISSING
    repeats: int = MISSING
    weights_over_budget: float = MISSING


@dataclass
class BenchStreamedArchTask(TaskConfig):
    """task=bench_streamed_arch (conf/task/bench_streamed_arch.yaml): a DiT and an LSTM stack streamed."""

    archs: list[str] = MISSING
    steps: int = MISSING
    budget_ratio: float = MISSING
    image_size: int = MISSING
    dit_layers: int = MISSING
    dit_heads: int = MISSING
    dit_batch: int = MISSING
    lstm_layers: int = MISSING
    lstm_hidden: int = MISSING
    lstm_mels: int = MISSING
    lstm_frames: int = MISSING
    lstm_batch: int = MISSING


@dataclass
class TuneConfig:
    """task=tune's search (conf/task/tune.yaml)."""

    time_budget_s: float = MISSING
    warmup_steps: int = MISSING
    steps: int = MISSING
    confirm_rounds: int = MISSING


@dataclass
class ServeConfig:
    """task=serve's server (conf/task/serve.yaml)."""

    host: str = MISSING
    port: int = MISSING
    api_key: str | None = MISSING
    model_name: str | None = MISSING
    template: bool = MISSING
    slots: int = MISSING
    max_waiting: int = MISSING
    max_body_bytes: int = MISSING
    max_prompt_tokens: int = MISSING
    max_tokens: int = MISSING
    default_max_tokens: int = MISSING
    max_stop: int = MISSING
    max_upload_bytes: int = MISSING
    top_k: int = MISSING
