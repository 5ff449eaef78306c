"""What the engine and the planner must agree on about a streamed step, without importing torch."""

from __future__ import annotations

import math

from onn.dtypes import BYTES_PER_VALUE

# Rows up to which torch's weight-only int8 matmul beats a cast of the weight and a 16-bit matmul: its cost
# grows with the rows (5120x17920 on a Xeon, 2 threads: 4 ms at 1 row, 13 at 8, 45 at 32, 179 at 128),
# the cast's does not (64 ms, matmul included, up to a few hundred rows).
CODES_MAX_ROWS = 32
# Values of an int8 weight a GPU casts to the compute dtype at once (onn/streaming/quantized.py): a 64 MB
# bf16 tile, the only decoded weight memory a streamed block needs beside its codes.
CAST_TILE_VALUES = 32 * 2**20


# A sliced gated MLP's slices start on multiples of this many intermediate features: aligned matmuls (on an
# H200, misaligned slices sent cuBLAS to kernels 5-7x slower; see quantized._tiles).
MLP_SLICE_ALIGN = 64


def mlp_slices(intermediate: int, tiles: int) -> list[tuple[int, int]]:
    """(start, end) of the slices a gated MLP of `intermediate` features computes in when asked for `tiles`:
    as many as that, each a multiple of MLP_SLICE_ALIGN features wide (so fewer for a narrow MLP)."""
    width = -(-intermediate // max(1, tiles))
    width = max(MLP_SLICE_ALIGN, -(-width // MLP_SLICE_ALIGN) * MLP_SLICE_ALIGN)
    return [(a, min(a + width, intermediate)) for a in range(0, intermediate, width)]


def smaller_store_dtypes(store_dtype: str) -> list[str]:
    """The store dtypes that take fewer bytes than `store_dtype` (none below nf4): advice for a disk too small
    (float16 is bfloat16's size, and named once)."""
    return [d for d in ("bfloat16", "int8", "nf4") if BYTES_PER_VALUE[d] < BYTES_PER_VALUE[store_dtype]]


def human_bytes(n: float) -> str:
    """A size as the store's and the plan's messages give it, with a figure that is not zero where the size is not
    (a disk's shortfall may be a few KB)."""
    if n >= 2**30:
        return f"{n / 2**30:,.1f} GB"
    if n >= 10 * 2**20:
        return f"{n / 2**20:,.0f} MB"
    return f"{n / 2**20:,.1f} MB" if n >= 2**20 else f"{math.ceil(n / 2**10):,} KB"


def cached_blocks(n: int, count: int, first_twice: int = 0) -> list[int]:
    """The `count` blocks of n that a disk store keeps in host memory: spread evenly, so the loader reads
    the others while the cores compute on the cached ones, and first among the blocks a training step
    reads twice (from `first_twice`, the lowest trainable chunk's first block, to the last)."""
    twice, once = list(range(first_twice, n)), list(range(first_twice))
    picked = _spread(twice, min(count, len(twice)))
    return sorted(picked + _spread(once, min(count - len(picked), len(once))))


def _spread(items: list[int], k: int) -> list[int]:
    return [items[(2 * j + 1) * len(items) // (2 * k)] for j in range(k)] if k > 0 else []


def computes_from_codes(store_dtype: str, device_type: str, compute_dtype: str, generating: bool) -> bool:
    """Whether the blocks compute from an int8 store's codes as stored rather than from a decoded copy: on a
    GPU always (a decoded block would take twice the device memory, and the cast of a tile costs one pass at
    the device's memory bandwidth); on a CPU while generating, where torch's weight-only int8 matmul pays."""
    if store_dtype != "int8":
        return False
    return device_type == "cuda" or generating and generates_from_codes(store_dtype, device_type, compute_dtype)


def generates_from_codes(store_dtype: str, device_type: str, compute_dtype: str) -> bool:
    """Whether generation computes from an int8 store's codes as stored (torch's weight-only int8 matmul
    has vectorised CPU kernels for 16-bit activations only): then it holds no decoded block."""
    return store_dtype == "int8" and device_type == "cpu" and compute_dtype in ("bfloat16", "float16")
