"""The one table of weight dtypes: their names in configs, their bytes per value, their torch types.

Stored weights may be quantized: int8 is ONN's own (symmetric, one fp32 scale per row: a weight's
output channel, so the streaming engine computes with the cast codes and scales the layer's output)
and nf4 is bitsandbytes' (4 bits, one fp32 scale per 64 values). The byte counts count int8 at one
byte a value (a row's scale is a rounding error of it) and nf4 with its scales, so the planner's
sizes and the layer store's files agree.
"""

from __future__ import annotations

# values per fp32 scale of nf4's blocks (bitsandbytes); int8 has one per row
QUANTIZED_BLOCK = {"int8": None, "nf4": 64}
BYTES_PER_VALUE = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "int8": 1,
    "nf4": 0.5 + 4 / QUANTIZED_BLOCK["nf4"],
}
FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def torch_dtype(name: str):
    """The torch dtype of a float dtype name (float32, bfloat16, float16)."""
    import torch

    if name not in FLOAT_DTYPES:
        raise ValueError(f"{name!r} is not one of {', '.join(FLOAT_DTYPES)}")
    return getattr(torch, name)
