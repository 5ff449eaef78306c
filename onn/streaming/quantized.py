"""Computing with a layer store's weights as they are stored, where decoding a whole block would not fit.

An int8 store keeps each weight as codes Q and one scale per output row s, so x Wᵀ = (x Qᵀ) s. On a GPU the
codes cross the host link and stay codes on the device: a frozen linear casts them to the compute dtype a
tile of rows at a time, multiplies, and drops the tile (`CastMatmul`, whose backward casts again instead of
keeping the cast weight). So a streamed block takes its stored size on the device (Phi-4's: 341 MB as codes,
681 MB decoded) plus one tile, and the cast is one pass over the codes at the device's memory bandwidth.

On a CPU a few rows (a generated token) go through torch's weight-only int8 matmul, which reads each weight
byte once, and more rows through a cast into one reused scratch buffer (no autograd there: generation).

Streamed embeddings are looked up where they are stored (`StoredEmbedding`): a batch needs a few rows of a
vocabulary-sized table, so only those rows cross to the device.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from onn.dtypes import QUANTIZED_BLOCK
from onn.hardware.cast import cast_scaled, fused_scale
from onn.streaming.schedule import CAST_TILE_VALUES, CODES_MAX_ROWS
from onn.streaming.store import dequantize_nf4

_TILES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def release_tiles() -> None:
    """Drop the cast buffers (one per device and dtype, kept from run to run): a run in this process that
    follows plans its own from the memory it finds free."""
    _TILES.clear()


def _tiles(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, scaled: bool):
    """(start, tile) for each run of output rows of `codes`, cast to `dtype` (times their row scales when
    `scaled`) into one buffer per device and dtype, reused for every cast: the device's stream orders each
    tile's use before the next cast into it, and no allocation comes and goes per tile. A run is a multiple
    of 64 rows, so every slice of the output starts 16-byte aligned (on an H200, misaligned slices sent
    cuBLAS to a kernel 5-7x slower)."""
    step = max(64, CAST_TILE_VALUES // codes.shape[1] // 64 * 64)
    key = (codes.device, dtype)
    buffer = _TILES.get(key)
    if buffer is None or buffer.numel() < min(step, codes.shape[0]) * codes.shape[1]:
        size = max(CAST_TILE_VALUES, min(step, codes.shape[0]) * codes.shape[1])
        buffer = _TILES[key] = torch.empty(size, dtype=dtype, device=codes.device)
    for a in range(0, codes.shape[0], step):
        part = codes[a : a + step]
        tile = buffer[: part.numel()].view(part.shape)
        yield a, cast_scaled(part, scale[a : a + step], tile) if scaled else tile.copy_(part)


def scales_the_product(dtype: torch.dtype) -> bool:
    """Whether an int8 weight's row scales may multiply its layer's output rather than its codes. x Qᵀ is x Wᵀ over
    each row's scale (127 over the row's largest value: thousands for a row of small weights), so in float16, whose
    range ends at 65,504, it overflows where x Wᵀ does not (an output of 30 from a row whose largest weight is 0.05
    is 76,200 before its scale): a float16 weight is scaled before its product. bfloat16 has float32's range."""
    return dtype != torch.float16


class CastMatmul(torch.autograd.Function):
    """x (Q s)ᵀ for int8 codes Q [out, in] and row scales s [out], differentiable in x only: the codes are
    cast to x's compute dtype a tile of output rows at a time, in the forward and again in the backward.
    Where the device fuses the scale into the cast (onn/hardware/cast.py) each tile is Q s; elsewhere the
    tile is Q and the product is scaled (fewer values than the weight when the rows are few), except in float16
    (scales_the_product)."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """`dtype`: the compute dtype (default: the scales'; float16's scales may be float32, store.scale_dtype)."""
        dtype = dtype or scale.dtype
        ctx.save_for_backward(codes, scale)
        ctx.x_dtype, ctx.dtype = x.dtype, dtype
        ctx.scaled = fused_scale(codes.device) or not scales_the_product(dtype)
        rows = x.reshape(-1, x.shape[-1]).to(dtype)
        # each tile's product is a plain contiguous matmul (what F.linear runs), copied into its columns
        # after: cuBLAS picks its slow kernels for products written into strided slices
        out = None
        for a, tile in _tiles(codes, scale, dtype, ctx.scaled):
            part = torch.mm(rows, tile.t())
            if tile.shape[0] == codes.shape[0]:  # the whole weight in one tile
                out = part
                break
            if out is None:
                out = rows.new_empty(rows.shape[0], codes.shape[0])
            out[:, a : a + tile.shape[0]] = part
        out = out if ctx.scaled else out.mul_(scale)
        return out.view(*x.shape[:-1], codes.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        codes, scale = ctx.saved_tensors
        g = grad.reshape(-1, codes.shape[0]).to(ctx.dtype)
        g = (g if ctx.scaled else g * scale).contiguous()
        gx = g.new_zeros(g.shape[0], codes.shape[1])
        for a, tile in _tiles(codes, scale, ctx.dtype, ctx.scaled):
            piece = g if tile.shape[0] == codes.shape[0] else g[:, a : a + tile.shape[0]].contiguous()
            gx.addmm_(piece, tile)
        return gx.view(*grad.shape[:-1], codes.shape[1]).to(ctx.x_dtype), None, None, None


class Scratch:
    """What an engine's int8 linears share: one buffer, reused, for the cast of one int8 weight at a time (a CPU
    prompt's prefill from the codes), and the dtype they compute in (None: their scales')."""

    def __init__(self, dtype: torch.dtype | None = None):
        self.buffer: torch.Tensor | None = None
        self.dtype = dtype

    def cast(self, codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        b = self.buffer
        if b is None or b.numel() < codes.numel() or b.dtype != dtype or b.device != codes.device:
            b = self.buffer = torch.empty(codes.numel(), dtype=dtype, device=codes.device)
        return b[: codes.numel()].view(codes.shape).copy_(codes)


def compute_dtype(module: nn.Linear) -> torch.dtype:
    """The dtype an int8 linear of an engine computes in: float16's row scales may be kept in float32
    (store.scale_dtype), so the scales' own dtype is only the default."""
    return module._onn_scratch.dtype or module._onn_scale.dtype


def linear_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A frozen linear of an int8 store: x Qᵀ times the row scales s is x Wᵀ. The weight installed is either
    the codes cast to the compute dtype by the loader (a plain matmul, scaled after) or the stored int8
    codes: on a GPU (or wherever a gradient is needed) through CastMatmul; on a CPU a few rows through torch's
    weight-only int8 matmul (which scales itself), more rows through a cast into the scratch buffer (scaled there in
    float16: scales_the_product). The bias, if any, is added after."""
    scale = module._onn_scale
    if scale is None:  # weights installed whole (de-quantized, or no store yet)
        return F.linear(x, module.weight, module.bias)
    weight, dtype = module.weight, compute_dtype(module)
    if weight.dtype == torch.int8 and (weight.device.type != "cpu" or torch.is_grad_enabled()):
        out = CastMatmul.apply(x, weight, scale, dtype)
        return out if module.bias is None else out + module.bias.to(out.dtype)
    if weight.dtype == torch.int8:
        rows = x.reshape(-1, x.shape[-1]).to(dtype)
        # torch's int8 matmul takes scales in the rows' dtype only: float32 ones (float16's smallest) go by the cast
        if rows.shape[0] <= CODES_MAX_ROWS and scale.dtype == dtype:
            out = torch._weight_int8pack_mm(rows.contiguous(), weight, scale).view(*x.shape[:-1], -1)
            return out if module.bias is None else out + module.bias.to(out.dtype)
        x, weight = rows.view(*x.shape[:-1], -1), module._onn_scratch.cast(weight, dtype)
        if not scales_the_product(dtype):  # the scratch is this call's own: scaled in place
            bias = None if module.bias is None else module.bias.to(x.dtype)
            return F.linear(x, weight.mul_(scale[:, None]), bias)
    out = F.linear(x, weight) * scale
    return out if module.bias is None else out + module.bias.to(out.dtype)


def looks_up_ids(module: nn.Embedding, store_dtype: str) -> bool:
    """Whether a stored table can stand in for the embedding (StoredEmbedding): its forward takes the ids alone,
    nn.Embedding's or a subclass's (Gemma's, which scales the rows), not OPT's positions (from the attention mask);
    and each of its rows is stored on its own: nf4 quantizes runs of 64 values, which a row of another width
    straddles."""
    if store_dtype == "nf4" and module.embedding_dim % QUANTIZED_BLOCK["nf4"]:
        return False
    forward = type(module).forward
    if forward is nn.Embedding.forward:
        return True
    arguments = list(inspect.signature(forward).parameters.values())[1:]
    return len(arguments) == 1 and arguments[0].name in ("input", "input_ids")


class StoredEmbedding(nn.Module):
    """Stands in for a streamed nn.Embedding while the prefix runs: the rows the ids name are gathered from
    the stored table in host memory (int8 codes and their row scales, or a float table) and only they cross
    to the device, in the compute dtype. The lookup is the de-quantized table's, value for value. A subclass's
    own forward (Gemma's scales the rows by the square root of the width) runs on a table of just those rows."""

    def __init__(
        self, module: nn.Embedding, stored: dict[str, torch.Tensor], name: str, device: torch.device, dtype: torch.dtype
    ):
        super().__init__()
        self.table, self.scale, self.absmax = stored[name], stored.get(f"{name}.scale"), stored.get(f"{name}.absmax")
        self.device, self.dtype, self.width = device, dtype, module.embedding_dim
        if self.absmax is not None:  # nf4: a row is a run of packed bytes (two values each) and of 64-value blocks
            self.table = self.table.view(module.num_embeddings, -1)
            self.absmax = self.absmax.view(module.num_embeddings, -1)
        self.padding_idx = module.padding_idx
        # held outside the module tree: the stand-in replaces the module, and must not list it as its own
        self._own_forward = None if type(module).forward is nn.Embedding.forward else (module,)

    def _rows(self, host: torch.Tensor) -> torch.Tensor:
        if self.absmax is not None:
            ids = host.reshape(-1)
            codes = self.table[ids].to(self.device, non_blocking=True).view(-1, 1)
            absmax = self.absmax[ids].to(self.device, non_blocking=True).view(-1)
            return dequantize_nf4(codes, absmax, [ids.numel(), self.width], self.dtype).view(*host.shape, self.width)
        rows = F.embedding(host, self.table).to(self.device, non_blocking=True).to(self.dtype)
        if self.scale is not None:  # in float32, rounded once (float16 holds no scale of a row under 0.008 well)
            rows.mul_(F.embedding(host, self.scale).to(self.device, non_blocking=True))
        return rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        host = ids.to("cpu")
        if self._own_forward is None:
            return self._rows(host)
        unique, where = host.unique(return_inverse=True)
        (module,) = self._own_forward
        # only a gradient reads the padding row, and the ids are renumbered: a padding id past them is refused
        padding, module.padding_idx = module.padding_idx, None
        try:
            return functional_call(module, {"weight": self._rows(unique)}, (where.to(self.device, non_blocking=True),))
        finally:
            module.padding_idx = padding


class EmptyEmbedding(nn.Module):
    """Stands in for a streamed nn.Embedding while the suffix runs: the model's forward computes its output
    again, but the streamed hidden state replaces what follows, so only the shape counts."""

    def __init__(self, module: nn.Embedding, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.width, self.device, self.dtype = module.embedding_dim, device, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*ids.shape, self.width, device=self.device, dtype=self.dtype)
