"""A streamed block's gated MLP, computed a slice of its intermediate features at a time.

A gated MLP, down(act(gate(x)) * up(x)), is where a decoder block's activations peak: its intermediate
features are 3.5x the hidden size (Phi-4: 17,920 against 5,120), and a backward holds the gate's and the up
projection's outputs, the activation and the product for every token, about 70% of what a Phi-4 block's
recompute keeps. Split along the intermediate features the MLP is a sum of independent slices,
down[:, j](act(gate[j](x)) * up[j](x)), and each slice runs under PyTorch's checkpoint: its features exist
only while that slice computes, and again, one slice at a time, while its gradient is taken. Every weight is
still cast once per use (an int8 store's codes a slice of rows or columns at a time, times their scales), so
the cost is one more pass of the MLP's matmuls in each backward.

The MLP is found by the LayerMap's `gated_mlps`, and a LoRA on its linears is computed slice by slice too.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from onn.hardware.cast import cast_scaled
from onn.models.layers import GatedMLP, gated_mlps, linear_of
from onn.streaming.schedule import CODES_MAX_ROWS

TILE_ALIGN = 64  # a slice starts on a multiple of 64 features: aligned matmuls (see quantized._tiles)


def slices(intermediate: int, tiles: int) -> list[tuple[int, int]]:
    """(start, end) of each of about `tiles` slices of the intermediate features, aligned to TILE_ALIGN."""
    width = -(-intermediate // max(1, tiles))
    width = max(TILE_ALIGN, -(-width // TILE_ALIGN) * TILE_ALIGN)
    return [(a, min(a + width, intermediate)) for a in range(0, intermediate, width)]


def _weight(base: nn.Linear, rows: slice | None, cols: slice | None) -> torch.Tensor:
    """The weight's slice as it computes: an int8 store's codes (or codes the loader cast) times their row
    scales, cast into a new tensor; a plain weight as a view."""
    scale = getattr(base, "_onn_scale", None)
    w = base.weight[rows] if rows is not None else base.weight[:, cols]
    if scale is None:
        return w
    s = scale[rows] if rows is not None else scale
    return cast_scaled(w, s, torch.empty(w.shape, dtype=s.dtype, device=w.device))


def _project(
    module: nn.Module, x: torch.Tensor, rows: slice | None = None, cols: slice | None = None, bias: bool = True
) -> torch.Tensor:
    """module(x) for its output `rows` only, or for its input `cols` only (x then holds just those features;
    `bias`: add the bias, which belongs to one slice of the inputs), its LoRA adapters included as peft adds them."""
    base = linear_of(module)
    y = F.linear(x, _weight(base, rows, cols), _part(base.bias, rows, bias))
    if not hasattr(module, "lora_A") or module.disable_adapters:
        return y
    for name in module.active_adapters:
        if name not in module.lora_A:
            continue
        lora_a, lora_b = module.lora_A[name].weight, module.lora_B[name]
        # autocast casts the adapters' input itself; without it peft casts it to the adapters' dtype
        inputs = x if torch.is_autocast_enabled(x.device.type) else x.to(lora_a.dtype)
        low = F.linear(module.lora_dropout[name](inputs), lora_a if cols is None else lora_a[:, cols])
        up = F.linear(low, lora_b.weight if rows is None else lora_b.weight[rows], _part(lora_b.bias, rows, bias))
        y = y + (up * module.scaling[name]).to(y.dtype)
    return y


def _part(bias: torch.Tensor | None, rows: slice | None, whole: bool) -> torch.Tensor | None:
    """A bias for output `rows`, or (no rows: a slice of the inputs) the whole bias when `whole`, else none."""
    if bias is None:
        return None
    return bias[rows] if rows is not None else (bias if whole else None)


def _slice(mlp: GatedMLP, x: torch.Tensor, a: int, b: int) -> torch.Tensor:
    gate = _project(mlp.gate, x, rows=slice(mlp.gate_row + a, mlp.gate_row + b))
    up = _project(mlp.up, x, rows=slice(mlp.up_row + a, mlp.up_row + b))
    return _project(mlp.down, mlp.act(gate) * up, cols=slice(a, b), bias=a == 0)


def tile(mlp: GatedMLP, tiles: int) -> None:
    """Compute `mlp` `tiles` slices at a time from now on (its forward replaced on the instance). A generated
    token's few rows hold little: without a gradient they go through the MLP whole, as before."""
    parts = slices(mlp.intermediate, tiles)
    # the MLP's own forward, kept from the first tiling (an engine built again on the same model tiles it again)
    whole = mlp.module.__dict__.setdefault("_onn_whole_forward", mlp.module.forward)

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        grad = torch.is_grad_enabled()
        if not grad and x.numel() // x.shape[-1] <= CODES_MAX_ROWS:
            return whole(x)
        out = None
        for a, b in parts:
            y = checkpoint(_slice, mlp, x, a, b, use_reentrant=False) if grad else _slice(mlp, x, a, b)
            out = y if out is None else out + y
        return out

    mlp.module.forward = types.MethodType(forward, mlp.module)


def tile_blocks(blocks: list[nn.Module], tiles: int) -> int:
    """Tile the gated MLPs of `blocks` (see `tile`); returns how many there were."""
    found = [mlp for block in blocks for mlp in gated_mlps(block)]
    for mlp in found:
        tile(mlp, tiles)
    return len(found)
