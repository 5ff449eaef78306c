"""The one table of weight dtypes: their names in configs, their bytes per value, their torch types.

Stored weights may be quantized: int8 is ONN's own (symmetric, one fp32 scale per 128 values of a
row, de-quantized by two plain torch ops, fast on any device) and nf4 is bitsandbytes' (4 bits, one
fp32 scale per 64 values). The byte counts include the scales, so the planner's sizes and the layer
store's files agree.
"""

from __future__ import annotations

# values per fp32 scale: int8 groups along a row (ONN), nf4 blocks (bitsandbytes)
QUANTIZED_BLOCK = {"int8": 128, "nf4": 64}
BYTES_PER_VALUE = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "int8": 1 + 4 / QUANTIZED_BLOCK["int8"],
    "nf4": 0.5 + 4 / QUANTIZED_BLOCK["nf4"],
}
FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def torch_dtype(name: str):
    """The torch dtype of a float dtype name (float32, bfloat16, float16)."""
    import torch

    if name not in FLOAT_DTYPES:
        raise ValueError(f"{name!r} is not one of {', '.join(FLOAT_DTYPES)}")
    return getattr(torch, name)
