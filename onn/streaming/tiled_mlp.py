"""A streamed block's gated MLP, computed a slice of its intermediate features at a time.

A gated MLP, down(act(gate(x)) * up(x)), is where a decoder block's activations peak: its intermediate
features are 3.5x the hidden size (Phi-4: 17,920 against 5,120), and a backward holds the gate's and the up
projection's outputs, the activation and the product for every token, about 70% of what a Phi-4 block's
recompute keeps. Split along the intermediate features the MLP is a sum of independent slices,
down[:, j](act(gate[j](x)) * up[j](x)), and each slice runs under PyTorch's checkpoint: its features exist
only while that slice computes, and again, one slice at a time, while its gradient is taken. Every weight is
still cast once per use (an int8 store's codes a slice of rows or columns at a time, times their scales), so
the cost is one more pass of the MLP's matmuls in each backward.

The MLP is found by the LayerMap's `gated_mlps`. A LoRA adapter on its linears computes as peft's does: its
low-rank input A(dropout(x)) once per linear, outside the slices (rows x rank values), each slice adding its
rows of B; the down projection's adapter sums its slices' A(dropout(h_j)) and adds B of the sum once.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from onn.hardware.cast import cast_scaled
from onn.models.layers import GatedMLP, gated_mlp, linear_of
from onn.streaming.quantized import compute_dtype
from onn.streaming.schedule import CODES_MAX_ROWS, mlp_slices

Lows = dict[str, torch.Tensor]  # an adapter's low-rank input (A of its dropped-out input), by adapter name


def _weight(base: nn.Linear, rows: slice | None, cols: slice | None) -> torch.Tensor:
    """The weight's slice as it computes: an int8 store's codes (or codes the loader cast) times their row
    scales, cast into a new tensor; a plain weight as a view."""
    scale = getattr(base, "_onn_scale", None)
    w = base.weight[rows] if rows is not None else base.weight[:, cols]
    if scale is None:
        return w
    s = scale[rows] if rows is not None else scale
    return cast_scaled(w, s, torch.empty(w.shape, dtype=compute_dtype(base), device=w.device))


def _adapters(module: nn.Module) -> list[str]:
    """The vanilla LoRA adapters active on `module` (none on a plain linear)."""
    if not hasattr(module, "lora_A") or module.disable_adapters:
        return []
    return [name for name in module.active_adapters if name in module.lora_A]


def _low(module: nn.Module, x: torch.Tensor, cols: slice | None = None) -> Lows:
    """Each adapter's A(dropout(x)), over input features `cols` only when given. Autocast casts the input itself;
    without it, as peft does, the input is cast to the adapter's dtype."""
    out = {}
    for name in _adapters(module):
        a = module.lora_A[name].weight
        inputs = x if torch.is_autocast_enabled(x.device.type) else x.to(a.dtype)
        out[name] = F.linear(module.lora_dropout[name](inputs), a if cols is None else a[:, cols])
    return out


def _lora_out(module: nn.Module, lows: Lows, y: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
    """y plus each adapter's B(low) x scaling, for output `rows` only when given (B's bias with them)."""
    for name, low in lows.items():
        b = module.lora_B[name]
        bias = None if b.bias is None else (b.bias if rows is None else b.bias[rows])
        up = F.linear(low, b.weight if rows is None else b.weight[rows], bias)
        y = y + (up * module.scaling[name]).to(y.dtype)
    return y


def _rows(module: nn.Module, x: torch.Tensor, lows: Lows, rows: slice) -> torch.Tensor:
    """module(x) for its output features `rows`: the frozen weight's rows, the bias's, each adapter's B rows."""
    base = linear_of(module)
    y = F.linear(x, _weight(base, rows, None), None if base.bias is None else base.bias[rows])
    return _lora_out(module, lows, y, rows)


def _slice(mlp: GatedMLP, x: torch.Tensor, gate_low: Lows, up_low: Lows, a: int, b: int) -> tuple[torch.Tensor, Lows]:
    """One slice's part of the MLP's output (the down projection's frozen weight over input features a:b),
    and its part of each down adapter's low-rank input."""
    gate = _rows(mlp.gate, x, gate_low, slice(a, b))
    up = _rows(mlp.up, x, up_low, slice(mlp.up_row + a, mlp.up_row + b))
    h = mlp.act(gate) * up
    return F.linear(h, _weight(linear_of(mlp.down), None, slice(a, b))), _low(mlp.down, h, slice(a, b))


def _sliced_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A gated MLP's forward as a sum of slices (see the module's docstring). Looked up on `self` at each call, so
    a copy of the model computes with its own weights. A generated token's few rows hold little: without a
    gradient they go through the MLP's own forward."""
    grad, mlp = torch.is_grad_enabled(), gated_mlp(self)
    if mlp is None or (not grad and x.numel() // x.shape[-1] <= CODES_MAX_ROWS):
        return type(self).forward(self, x)
    parts = mlp_slices(mlp.intermediate, self._onn_mlp_tiles)
    gate_low = _low(mlp.gate, x)
    up_low = gate_low if mlp.up is mlp.gate else _low(mlp.up, x)
    out, down_low = None, {}
    for a, b in parts:
        args = (mlp, x, gate_low, up_low, a, b)
        y, low = checkpoint(_slice, *args, use_reentrant=False) if grad else _slice(*args)
        # summed in float32 at least, as one matmul would accumulate (a float64 model's in float64)
        out = y.to(torch.promote_types(y.dtype, torch.float32)) if out is None else out + y
        down_low = {k: down_low[k] + v if k in down_low else v for k, v in low.items()}
    down = linear_of(mlp.down)
    out = out.to(y.dtype) if down.bias is None else (out + down.bias).to(y.dtype)
    return _lora_out(mlp.down, down_low, out)


def tile_blocks(blocks: list[nn.Module], tiles: int) -> int:
    """Compute the gated MLPs of `blocks` in `tiles` slices from now on (whole again for 1); returns how many
    MLPs compute in more than one slice."""
    sliced = 0
    for module in (m for block in blocks for m in block.modules()):
        if getattr(module.__dict__.get("forward"), "__func__", None) is _sliced_forward:
            del module.forward  # the class's own forward again
        mlp = gated_mlp(module) if tiles > 1 else None
        if mlp is not None and len(mlp_slices(mlp.intermediate, tiles)) > 1:
            module._onn_mlp_tiles = tiles
            module.forward = types.MethodType(_sliced_forward, module)
            sliced += 1
    return sliced
