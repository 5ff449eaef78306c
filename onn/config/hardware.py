"""hardware=...: measure this machine (auto) or plan for a preset one; the measured profile fills the rest."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING


@dataclass
class HardwareConfig:
    name: str = MISSING
    measure: bool = MISSING
    refresh: bool = False
    cache: str | None = None  # the folder of measured profiles (null: ${paths.cache}/hardware)
    budget_mb: float | None = MISSING
    disk_probe_mb: int = 1024
    accelerator: str | None = None
    device_name: str | None = None
    device_count: int | None = None
    count: int = 1  # devices per node to plan and run for (a preset: 1)
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
