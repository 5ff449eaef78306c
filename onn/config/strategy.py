"""strategy=...: what trains (full, LoRA, a head), how the model is placed (Lightning's strategy, or ONN's
layer streaming) and the settings the planner fills in when they are `auto`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING


@dataclass
class LoraConfig:
    """peft.LoraConfig's settings (conf/strategy/lora.yaml)."""

    r: int = MISSING
    alpha: int = MISSING
    dropout: float = MISSING
    target_modules: Any = MISSING  # all-linear, or module names


@dataclass
class StreamingConfig:
    """strategy=sparse_lora's layer streaming (conf/strategy/sparse_lora.yaml). Every setting has a default, the
    same as that YAML's: a plan that streams for a strategy naming no streaming (strategy=auto choosing
    sparse_lora, then given task=tune's settings) takes `StreamingConfig()`, every setting `auto`."""

    chunk_size: Any = "auto"  # auto | blocks loaded at a time
    store: str = "auto"  # auto | disk | cpu
    store_dtype: str = "auto"  # auto | float32 | bfloat16 | float16 | int8 | nf4
    edges: str = "auto"  # auto | resident | stream
    activations: str = "auto"  # auto | device | host
    cache_blocks: Any = "auto"  # auto | blocks of a disk store held in host memory after their first read
    eval_tokens: Any = "auto"  # auto | tokens per streamed pass of a validation / evaluation
    mlp_tiles: Any = "auto"  # auto | slices a block's gated MLP computes in (1: whole)
    prefetch: bool = True  # load the next chunk while this one computes


# the blocks with adapters when another strategy (auto) plans sparse_lora: the first and last four, as
# conf/strategy/sparse_lora.yaml's default
SPARSE_LAYERS = (0, 1, 2, 3, -4, -3, -2, -1)


@dataclass
class StrategyConfig:
    """What trains and how is the strategy's name: full, lora, qlora (LoRA on an NF4 base), sparse_lora,
    linear_probe (a head on frozen features); the planner and the modalities read it, not a key per choice."""

    name: str = MISSING
    layers: Any = MISSING  # all, or block indices (negative count from the end)
    lora: LoraConfig | None = MISSING  # strategy=lora, qlora, sparse_lora (and auto, which may plan one of them)
    micro_batch: Any = MISSING  # auto | samples per forward pass
    min_micro_batch: int = MISSING
    precision: str = MISSING
    gradient_checkpointing: Any = MISSING  # auto | true | false
    lightning: str = MISSING  # the Lightning strategy that places the model
    timeout_s: float = MISSING  # multi-process runs: how long a process waits for its peers
    streaming: StreamingConfig | None = None  # set by strategy=sparse_lora
