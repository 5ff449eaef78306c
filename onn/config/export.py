"""export=...: what a run writes after it trains (or from ckpt=): safetensors, ONNX, or .omny."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING


@dataclass
class ExportConfig:
    name: str = MISSING  # none | safetensors | onnx | omny


@dataclass
class SafetensorsExport(ExportConfig):
    output: str | None = MISSING  # null: <run dir>/export
    max_shard_size: str = MISSING  # e.g. 2GB (Hugging Face's sharding)
    adapter: bool = MISSING  # LoRA runs also write the adapter alone


@dataclass
class ExportSample:
    """The dummy input the graph is traced with (its axes stay dynamic)."""

    batch_size: int = MISSING
    sequence_length: int = MISSING
    image_size: list[int] | None = MISSING


@dataclass
class OnnxExport(ExportConfig):
    output: str | None = MISSING
    opset: int = MISSING
    atol: float = MISSING  # onnxruntime's outputs must match torch's within this
    sample: ExportSample = MISSING


@dataclass
class OmnyExport(OnnxExport):
    max_shard_size_mb: float | None = MISSING
    min_vram_mb: float | None = MISSING
    headroom_mb: float | None = MISSING
    nodes: Any = MISSING  # device memory per node (MB) to plan shards for
    shard_counts: list[int] | None = MISSING
    max_configs: int = MISSING
    reference_sequence_length: int = MISSING
