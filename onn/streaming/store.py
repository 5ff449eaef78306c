"""The layer store: frozen block weights kept off the compute device, one block at a time.

`disk`: one safetensors file per block in a folder keyed by the model's fingerprint, each with a
`.done` marker that records the file's size; a block whose file or marker is missing or whose
size disagrees is rebuilt, never used. `cpu`: the same tensors held in host memory (pinned when
a GPU will read them). Weights may be stored in a smaller dtype than they compute in: bf16/fp16,
or int8 (blockwise, 256 per block) and nf4 (4-bit, 64 per block) through bitsandbytes, which
de-quantizes on the compute device after the copy, so only the small form crosses the bus.
Vectors and small tensors (norms, biases) stay float32 in the quantized stores.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from onn.dtypes import BYTES_PER_VALUE, QUANTIZED_BLOCK, torch_dtype
from onn.errors import UserError


class LayerStore:
    """Frozen weights of each block, by block index and parameter name (relative to the block)."""

    def __init__(
        self, kind: str, dtype: str, folder: Path | None = None, pin: bool = False, drop_cache: bool = False
    ):
        if kind not in ("disk", "cpu"):
            raise UserError(f"strategy.streaming.store must be disk or cpu, not {kind!r}.")
        if dtype not in BYTES_PER_VALUE:
            raise UserError(
                f"strategy.streaming.store_dtype {dtype!r} is not one of {', '.join(BYTES_PER_VALUE)}."
            )
        if dtype in QUANTIZED_BLOCK:
            _bitsandbytes()  # fail now, with a clear message, not in the prefetch thread
        self.kind, self.dtype, self.folder, self.pin = kind, dtype, folder, pin
        # drop_cache: evict each block file from the OS page cache after reading it, so every
        # load comes from the disk, as it does for a model larger than RAM (and RAM stays free).
        self.drop_cache = drop_cache
        self._memory: dict[int, dict[str, torch.Tensor]] = {}
        self.rebuilt: list[int] = []  # blocks written by the last `fill`

    def block_file(self, index: int | str) -> Path:
        return self.folder / f"{_stem(index)}.safetensors"

    def _marker(self, index: int | str) -> Path:
        return self.folder / f"{_stem(index)}.done"

    def is_complete(self, index: int | str, shapes: dict[str, list[int]] | None = None) -> bool:
        """A block is usable only with its marker, a file of the recorded size, a readable header,
        and (when given) the tensor names and shapes expected of it."""
        if self.kind == "cpu":
            return index in self._memory
        path, marker = self.block_file(index), self._marker(index)
        if not (path.is_file() and marker.is_file()):
            return False
        try:
            recorded = json.loads(marker.read_text())
            if recorded.get("bytes") != path.stat().st_size:
                return False
            if shapes is not None and (
                recorded.get("shapes") != shapes or recorded.get("dtype") != self.dtype
            ):
                return False
            with safe_open(str(path), framework="pt") as f:
                f.keys()
        except (OSError, ValueError, json.JSONDecodeError):
            return False
        return True

    def fill(self, blocks: dict[int | str, dict[str, torch.Tensor]]) -> None:
        """Store each block's frozen tensors (disk: only blocks without a complete file are written)."""
        shapes = {i: {n: list(t.shape) for n, t in tensors.items()} for i, tensors in blocks.items()}
        self.rebuilt = []
        for i in self.missing(shapes):
            self.write(i, blocks[i])

    def missing(self, shapes: dict[int | str, dict[str, list[int]]]) -> list[int | str]:
        """The blocks that must be written (all of them in memory; on disk those without a complete
        file of these shapes), after checking the disk has room for them."""
        if self.kind == "cpu":
            return list(shapes)
        self.folder.mkdir(parents=True, exist_ok=True)
        missing = [i for i in shapes if not self.is_complete(i, shapes[i])]
        needed = sum(
            math.prod(shape) * BYTES_PER_VALUE[self.dtype] for i in missing for shape in shapes[i].values()
        )
        free = shutil.disk_usage(self.folder).free
        if needed > free:
            raise UserError(
                f"the layer store at {self.folder} needs {needed / 2**20:,.0f} MB but the disk has {free / 2**20:,.0f} MB free; "
                "set paths.cache (or ONN_CACHE) to a disk with room, or strategy.streaming.store=cpu."
            )
        return missing

    def write(self, index: int | str, tensors: dict[str, torch.Tensor]) -> None:
        """Store one block (atomically on disk: the marker is written last)."""
        self.rebuilt.append(index)
        if self.kind == "cpu":
            stored = self.encode(tensors)
            self._memory[index] = {n: t.pin_memory() for n, t in stored.items()} if self.pin else stored
            return
        self._marker(index).unlink(missing_ok=True)
        path = self.block_file(index)
        tmp = path.with_suffix(".tmp")
        save_file(self.encode(tensors), str(tmp))
        os.replace(tmp, path)
        shapes = {n: list(t.shape) for n, t in tensors.items()}
        self._marker(index).write_text(
            json.dumps({"bytes": path.stat().st_size, "shapes": shapes, "dtype": self.dtype})
        )

    def encode(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A block's tensors as stored: cast, or quantized (`name` holds the codes, `name.absmax`
        the scales, `name.shape` the original shape)."""
        out = {}
        for name, t in tensors.items():
            t = t.detach().to("cpu")
            if self.dtype not in QUANTIZED_BLOCK:
                out[name] = t.to(torch_dtype(self.dtype)).contiguous()
            elif t.dim() < 2 or t.numel() < 4096:
                out[name] = t.float().contiguous()
            else:
                import bitsandbytes.functional as bnb

                t = t.float().contiguous()
                if self.dtype == "nf4":
                    codes, state = bnb.quantize_4bit(
                        t, blocksize=QUANTIZED_BLOCK["nf4"], quant_type="nf4", compress_statistics=False
                    )
                else:
                    codes, state = bnb.quantize_blockwise(t, blocksize=QUANTIZED_BLOCK["int8"])
                out[name], out[f"{name}.absmax"] = codes.contiguous(), state.absmax.float().contiguous()
                out[f"{name}.shape"] = torch.tensor(t.shape, dtype=torch.int64)
        return out

    def decode(self, stored: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
               non_blocking: bool = False) -> dict[str, torch.Tensor]:  # fmt: skip
        """Stored tensors -> compute tensors on `device`; quantized ones are de-quantized there."""
        out = {}
        for name, t in stored.items():
            if name.endswith((".absmax", ".shape")):
                continue
            t = t.to(device, non_blocking=non_blocking)
            if f"{name}.absmax" in stored:
                t = self._dequantize(
                    t, stored[f"{name}.absmax"].to(device, non_blocking=non_blocking), stored[f"{name}.shape"]
                )
            out[name] = t.to(dtype)
        return out

    def _dequantize(self, codes: torch.Tensor, absmax: torch.Tensor, shape: torch.Tensor) -> torch.Tensor:
        import bitsandbytes.functional as bnb

        if self.dtype == "nf4":
            state = bnb.QuantState(absmax=absmax, shape=torch.Size(shape.tolist()), dtype=torch.float32, blocksize=QUANTIZED_BLOCK["nf4"],
                                   quant_type="nf4", code=bnb.get_4bit_type("nf4", device=codes.device))  # fmt: skip
            return bnb.dequantize_4bit(codes, quant_state=state)
        code = bnb.create_dynamic_map(signed=True).to(codes.device)
        return bnb.dequantize_blockwise(codes, absmax=absmax, code=code, blocksize=QUANTIZED_BLOCK["int8"])

    def read(self, index: int | str) -> dict[str, torch.Tensor]:
        """The block's stored tensors, in host memory. `fill` verified (or rebuilt) every block, so
        this hot path does no checks of its own."""
        if self.kind == "cpu":
            return self._memory[index]
        path = self.block_file(index)
        with safe_open(str(path), framework="pt") as f:
            # clone: get_tensor can hand back memory-mapped data, and then the disk reads would
            # happen later, as page faults in compute, instead of here in the prefetch thread.
            tensors = {name: f.get_tensor(name).clone() for name in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
        if self.drop_cache:
            evict(path)
        return tensors


def stored_name(param_name: str) -> str:
    """A frozen weight's name in the store: without peft's `base_layer`, so a store written from
    the plain model (while loading) and one written from the LoRA model are the same."""
    return param_name.replace(".base_layer.", ".")


def _stem(index: int | str) -> str:
    return f"block_{index:05d}" if isinstance(index, int) else str(index)


def _bitsandbytes() -> None:
    try:
        import bitsandbytes.functional  # noqa: F401
    except ImportError as e:  # pragma: no cover - a dependency of ONN
        raise UserError(
            f"strategy.streaming.store_dtype int8/nf4 needs bitsandbytes, which failed to import ({e}); "
            "use store_dtype=bfloat16 or float16."
        ) from e


def evict(path: Path) -> None:
    """Drop a file's pages from the OS page cache (Linux); a no-op where that is not possible."""
    if not hasattr(os, "posix_fadvise"):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
