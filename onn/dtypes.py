"""The one table of weight dtypes: their names in configs, their bytes per value, their torch types.

Stored weights may be quantized by bitsandbytes: int8 (one fp32 scale per 256 values) and nf4
(4 bits, one fp32 scale per 64 values). The byte counts include the scales, so the planner's
sizes and the layer store's files agree.
"""

from __future__ import annotations

# bitsandbytes' blockwise formats and their block sizes (values per fp32 scale)
QUANTIZED_BLOCK = {"int8": 256, "nf4": 64}
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
