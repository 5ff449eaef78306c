"""The layer store: frozen block weights kept off the compute device, one block at a time.

`disk`: one safetensors file per block in a folder keyed by the model's fingerprint, each with a
`.done` marker that records the file's size, the store's format, a hash of the bytes written (`file_digest`) and,
for weights written from memory, their digest; a block whose file or marker is missing or whose size, format or
digest disagrees is rebuilt, never used. The bytes are checked against `file_digest` on a block's first read in a
process, from the buffer the read filled (no second read): a damaged block is rebuilt where its weights are in
memory (`fill`), else refused with advice to delete it. Markers written before `file_digest` are trusted. A block
file is written to a temporary name, synced, renamed, and only then marked, so a build killed at any moment leaves
whole blocks (reused) and at most one unmarked file (rebuilt). `cpu`: the same tensors held in host memory (pinned
when a GPU will read them).

Reads from disk are whole files, straight into a buffer the caller reuses, with O_DIRECT where the
file system allows it: the disk's DMA fills the buffer, the page cache is neither used nor filled
(a store larger than RAM would only evict other processes' pages), and the stored tensors are views
of the buffer. Where O_DIRECT is refused the file is read normally and dropped from the page cache.

Weights may be stored in a smaller dtype than they compute in: bf16/fp16, int8 (ONN's: symmetric,
one fp32 scale per row: `name` holds the codes, `name.scale` the scales) or nf4
(bitsandbytes: `name`, `name.absmax`, `name.shape`), de-quantized on the compute device after the
copy, so only the small form crosses the bus. Vectors and small tensors (norms, biases) stay float32
in the quantized stores.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import shutil
import struct
import time
from collections.abc import Container, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from onn.dtypes import BYTES_PER_VALUE, QUANTIZED_BLOCK, torch_dtype
from onn.errors import UserError, write_refused
from onn.hardware import failpoints
from onn.hardware.disk import aligned, buffer, evict, read_file
from onn.hardware.locks import held
from onn.hardware.memory import pinned_copy
from onn.streaming.schedule import human_bytes, smaller_store_dtypes

log = logging.getLogger(__name__)

# what a build must leave free on the disk: other processes share it
DISK_RESERVE_BYTES = 2 * 1024**3
ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I8": torch.int8,
             "U8": torch.uint8, "I64": torch.int64, "I32": torch.int32}  # fmt: skip
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit: a longer header length is damage
# every tensor of a block file starts at a multiple of this many bytes (a cache line): the read buffer is
# page-aligned, so the stored tensors, views of it, are too. torch's weight-only int8 matmul on a CPU
# (generating from an int8 store's codes) segfaults on codes that are not 16-byte aligned.
STORE_ALIGN = 64
PAD = "__pad__"  # the names of the bytes between tensors (safetensors allows no holes): never a weight
# a block file's layout, recorded in its marker: a block of another format (format 1 aligned its tensors
# only for their dtype) is rebuilt, not read
STORE_FORMAT = 2


@dataclass
class Layout:
    """Where each tensor of a block file lies, read from its safetensors header."""

    file_bytes: int
    tensors: dict[str, tuple[torch.dtype, list[int], int, int]]  # name -> dtype, shape, start, end (file offsets)


class LayerStore:
    """Frozen weights of each block, by block index and parameter name (relative to the block)."""

    def __init__(self, kind: str, dtype: str, folder: Path | None = None, pin: bool = False, direct: bool = True):
        if kind not in ("disk", "cpu"):
            raise UserError(f"strategy.streaming.store must be disk or cpu, not {kind!r}.")
        if dtype not in BYTES_PER_VALUE:
            raise UserError(f"strategy.streaming.store_dtype {dtype!r} is not one of {', '.join(BYTES_PER_VALUE)}.")
        if dtype == "nf4":
            _bitsandbytes()  # fail now, with a clear message, not in the prefetch thread
        self.kind, self.dtype, self.folder, self.pin = kind, dtype, folder, pin
        self.direct = direct and hasattr(os, "O_DIRECT")  # False: read through the page cache, then drop it
        self._memory: dict[int | str, dict[str, torch.Tensor]] = {}
        self._layouts: dict[int | str, Layout] = {}
        self.rebuilt: list[int | str] = []  # blocks written by the last `fill`
        self._file_digests: dict[int | str, str | None] = {}  # the markers' hashes of the bytes written
        self._verified: set[int | str] = set()  # blocks whose bytes this process wrote or checked
        self.bytes_read = 0  # from the disk, since the store was made
        self.read_s = 0.0
        self.progress = None  # a callable(index, bytes) told after every block written (the build's progress bar)

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
            if recorded["bytes"] != path.stat().st_size or recorded.get("format") != STORE_FORMAT:
                return False
            self._file_digests[index] = recorded.get("file_digest")
            if shapes is not None and (recorded["shapes"] != shapes or recorded["dtype"] != self.dtype):
                return False
            layout = read_layout(path)
            if shapes is not None and not self._holds(layout, shapes):
                return False
            self._layouts[index] = layout
        except (OSError, ValueError, KeyError, TypeError, OverflowError, struct.error):  # damaged: rebuilt
            return False
        return True

    def _holds(self, layout: Layout, shapes: dict[str, list[int]]) -> bool:
        """Whether a block file holds each weight in its shape (nf4 packs its codes: their shape is the file's
        `name.shape`). An int8 store written before codes kept their weight's shape holds a convolution's as rows."""
        if self.dtype == "nf4":
            return all(name in layout.tensors for name in shapes)
        return all(name in layout.tensors and layout.tensors[name][1] == shape for name, shape in shapes.items())

    @contextlib.contextmanager
    def building(self) -> Iterator[None]:
        """Hold a disk store's folder while checking and writing blocks: a second build (another run of the
        model, another rank) waits, then finds the first one's blocks whole, and never sees a half-written one."""
        if self.kind == "cpu":
            yield
            return
        self._make_folder()
        with contextlib.ExitStack() as lock:
            try:
                lock.enter_context(
                    held(
                        self.folder,
                        on_wait=lambda: log.info("%s: another process is building it; waiting", self.folder),
                    )
                )
            except OSError as e:  # a folder that refuses the lock file (read-only, not ours)
                raise self._unusable(e) from None
            yield

    def _make_folder(self) -> None:
        """The disk store's folder, made where missing; one sentence when a file (or the file system) is in the way."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise self._unusable(e) from None

    def _unusable(self, error: OSError) -> UserError:
        """One sentence naming the store folder the disk refused (a file in its place or above it, no permission)."""
        folder, elsewhere = self.folder, "set paths.cache (or ONN_CACHE) to another folder"
        blocking = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
        if blocking == folder:
            return UserError(f"the layer store folder {folder} is a file: remove it, or {elsewhere}.")
        if blocking is not None:
            return UserError(
                f"the layer store folder {folder} cannot be made: {blocking} is a file; remove it, or {elsewhere}."
            )
        return UserError(f"the layer store folder {folder} cannot be used: {error.strerror or error}; {elsewhere}.")

    def fill(self, blocks: dict[int | str, dict[str, torch.Tensor]]) -> None:
        """Store each block's frozen tensors (disk: only blocks without a complete file of these same values are
        written). The weights are in memory here, so a block file is reused only when its marker records their
        digest: the folder's key (model.source's stat, its architecture and dtype) does not see weights a Python
        builder draws from the run's seed or reads from another file, and another run's values were used silently.
        A reused file's bytes are checked here, one read each, because only here can a damaged one be rebuilt."""
        shapes = {i: {n: list(t.shape) for n, t in tensors.items()} for i, tensors in blocks.items()}
        digests = {i: digest(tensors) for i, tensors in blocks.items()} if self.kind == "disk" else {}
        self.rebuilt = []
        into = None  # one read buffer for every check
        with self.building():
            missing = self.missing(shapes)
            for i in blocks:
                if i in missing or self._recorded(i, "digest") != digests[i]:
                    self.write(i, blocks[i], digests.get(i))
                    continue
                if not self._unchecked(i):
                    continue
                into, intact = self._read_bytes(i, into)
                if not intact:
                    log.warning(
                        "%s: its bytes differ from those written (damaged on the disk); rebuilding it",
                        self.block_file(i),
                    )
                    self.write(i, blocks[i], digests[i])

    def _recorded(self, index: int | str, key: str) -> str | None:
        """A hash a block's marker records (`digest`: of the values written; `file_digest`: of the bytes written),
        None where it was written without one."""
        try:
            return json.loads(self._marker(index).read_text()).get(key)
        except (OSError, ValueError, AttributeError):
            return None

    def missing(self, shapes: dict[int | str, dict[str, list[int]]]) -> list[int | str]:
        """The blocks that must be written (all of them in memory; on disk those without a complete
        file of these shapes), after checking the disk has room for them and a reserve beside. On disk, called
        inside `building`: a temporary file found then is a dead build's."""
        if self.kind == "cpu":
            return list(shapes)
        self._make_folder()
        for stale in self.folder.glob("*.tmp"):  # a build killed while writing
            stale.unlink(missing_ok=True)
        missing = [i for i in shapes if not self.is_complete(i, shapes[i])]
        needed = sum(stored_bytes(shapes[i], self.dtype) for i in missing)
        reusable = sum(self.block_file(i).stat().st_size for i in missing if self.block_file(i).is_file())
        free = shutil.disk_usage(self.folder).free + reusable
        if needed + DISK_RESERVE_BYTES > free:
            smaller = smaller_store_dtypes(self.dtype)
            raise UserError(
                f"the layer store at {self.folder} needs {human_bytes(needed)} more ({len(missing)} blocks as "
                f"{self.dtype}) and {human_bytes(DISK_RESERVE_BYTES)} left free for others: "
                f"{human_bytes(needed + DISK_RESERVE_BYTES)} in all, but the disk has {human_bytes(free)} free "
                f"({human_bytes(needed + DISK_RESERVE_BYTES - free)} short); "
                "set paths.cache (or ONN_CACHE) to a disk with room"
                + (f", or a smaller strategy.streaming.store_dtype ({', '.join(smaller)})." if smaller else ".")
            )
        return missing

    def write(self, index: int | str, tensors: dict[str, torch.Tensor], values: str | None = None) -> None:
        """Store one block (atomically on disk: synced, renamed, and the marker written last); `values`: the
        tensors' `digest`, recorded in the marker when given. Weights holding NaN or inf are refused here, where they
        are in memory anyway: a server or a run would otherwise find them only when a request or a step reaches them."""
        bad = non_finite(tensors)
        if bad is not None:
            raise UserError(
                f"the model's frozen weight {bad} (block {index} of the layer store) holds NaN or inf: model.source is "
                "damaged, or was saved from a training that diverged, so every output would be NaN; use another copy "
                "of the model."
            )
        self.rebuilt.append(index)
        encoded = self.encode(tensors)
        if self.kind == "cpu":
            self._memory[index] = {n: pinned_copy(t) for n, t in encoded.items()} if self.pin else encoded
            return
        self._marker(index).unlink(missing_ok=True)
        path = self.block_file(index)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # this process's own, whoever else writes
        try:
            written = write_safetensors(tmp, encoded)
        except OSError as e:  # the disk filled after the check in `missing` (another writer)
            tmp.unlink(missing_ok=True)
            needed = sum(t.numel() * t.element_size() for t in encoded.values())
            raise write_refused(e, path, needed, "the layer store (paths.cache or ONN_CACHE)") from None
        failpoints.reached("store_write")
        os.replace(tmp, path)
        shapes = {n: list(t.shape) for n, t in tensors.items()}
        size = path.stat().st_size
        marker = {"bytes": size, "shapes": shapes, "dtype": self.dtype, "format": STORE_FORMAT, "file_digest": written}
        if values is not None:
            marker["digest"] = values
        self._marker(index).write_text(json.dumps(marker))
        self._file_digests[index] = written
        self._verified.add(index)
        self._layouts[index] = read_layout(path)
        if self.progress is not None:
            self.progress(index, size)

    def encode(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A block's tensors as stored: cast, or quantized (int8: `name` codes and `name.scale`;
        nf4: `name` codes, `name.absmax` scales and `name.shape` the original shape)."""
        out = {}
        for name, t in tensors.items():
            t = t.detach()  # cast or quantized where it lies (a block initialised on a GPU), stored on the host
            if self.dtype not in QUANTIZED_BLOCK:
                out[name] = t.to(torch_dtype(self.dtype)).to("cpu").contiguous()
            elif t.dim() < 2 or t.numel() < 4096:
                out[name] = t.float().to("cpu").contiguous()
            elif self.dtype == "int8":
                codes, scale = quantize_int8(t)
                out[name], out[f"{name}.scale"] = codes.to("cpu"), scale.to("cpu")
            else:
                t = t.to("cpu")
                import bitsandbytes.functional as bnb

                t = t.float().contiguous()
                codes, state = bnb.quantize_4bit(
                    t, blocksize=QUANTIZED_BLOCK["nf4"], quant_type="nf4", compress_statistics=False
                )
                out[name], out[f"{name}.absmax"] = codes.contiguous(), state.absmax.float().contiguous()
                out[f"{name}.shape"] = torch.tensor(t.shape, dtype=torch.int64)
        return out

    def decode(
        self,
        stored: dict[str, torch.Tensor],
        device: torch.device,
        dtype: torch.dtype,
        non_blocking: bool = False,
        out: dict[str, torch.Tensor] | None = None,
        scales: dict[str, torch.Tensor] | None = None,
        codes: bool = False,
        scaled: Container[str] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Stored tensors -> compute tensors on `device`; quantized ones are de-quantized there.

        On the CPU a stored tensor already in the compute dtype is returned as it is (a view of the
        read buffer: no copy), and `out` (tensors from an earlier decode of a block of the same shapes)
        is written into instead of allocating: the buffers are reused from chunk to chunk. With `scales`,
        int8 weights are only cast (one pass) and their per-row scales go into `scales` by name, for the
        caller to apply to the layer's output: (x Qᵀ) s = x (s Q)ᵀ, at a cost of one multiply per output;
        with `codes` too, int8 weights stay the stored codes (for an int8 matmul). `scaled`: the int8 weights that
        scale their layer's output (a block's linears; None: all); any other is de-quantized whole (an LSTM's)."""
        decoded = {}
        for name, t in stored.items():
            if name.endswith((".absmax", ".shape", ".scale")):
                continue
            target = out.get(name) if out is not None else None
            if device.type == "cpu" and t.dtype == dtype:
                decoded[name] = t
                continue
            t = t.to(device, non_blocking=non_blocking)
            if f"{name}.scale" in stored:  # its scales' dtype chosen on the host copy: no wait for the device
                kept = scale_dtype(stored[f"{name}.scale"], dtype)
                scale = stored[f"{name}.scale"].to(device, non_blocking=non_blocking).to(kept)
                if scales is not None and (scaled is None or name in scaled):
                    decoded[name] = t if codes else _into(target, t, dtype)
                    scales[name] = scale.view(-1)
                else:
                    decoded[name] = dequantize_int8(t, scale, dtype, target)
                continue
            if f"{name}.absmax" in stored:  # into the compute dtype at once: a float32 copy would be in flight too
                shape = stored[f"{name}.shape"].tolist()
                t = dequantize_nf4(t, stored[f"{name}.absmax"].to(device, non_blocking=non_blocking), shape, dtype)
            decoded[name] = _into(target, t, dtype)
        return decoded

    def file_bytes(self, index: int | str) -> int:
        """The size of a block's file (what one read moves), from its verified layout."""
        if index not in self._layouts:
            self._layouts[index] = read_layout(self.block_file(index))
        return self._layouts[index].file_bytes

    def read(self, index: int | str, into: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The block's stored tensors, in host memory. From disk the whole file is read into `into`
        (a uint8 buffer from `buffer`, reused by the caller; a new one when None) and the tensors are
        views of it. A block's first read in this process checks the bytes read against its marker's `file_digest`
        (a hash of the buffer, no second read): damaged weights are refused before they are used."""
        if self.kind == "cpu":
            return self._memory[index]
        into, intact = self._read_bytes(index, into)
        if not intact:
            raise UserError(
                f"the layer store block {self.block_file(index)} is damaged (its bytes differ from those written): "
                f"delete it, or the store folder {self.folder} (under paths.cache), and run again to rebuild it."
            )
        return views(into, self._layouts[index])

    def _read_bytes(self, index: int | str, into: torch.Tensor | None) -> tuple[torch.Tensor, bool]:
        """A block file read whole into `into` (a new buffer when None or too small), and whether its bytes are those
        written: checked once per process, against the marker's `file_digest` (a marker without one is trusted)."""
        size = self.file_bytes(index)
        if into is None or into.numel() < aligned(size):
            into = buffer(size, pin=self.pin)
        start = time.perf_counter()
        self.direct = read_file(self.block_file(index), into, size, self.direct)
        self.read_s += time.perf_counter() - start
        self.bytes_read += size
        if not self._unchecked(index):
            return into, True
        if hashlib.sha256(memoryview(into[:size].numpy())).hexdigest() != self._file_digests[index]:
            return into, False
        self._verified.add(index)
        return into, True

    def _unchecked(self, index: int | str) -> bool:
        """Whether a block's bytes are still to be checked in this process: neither written nor checked by it yet,
        and its marker records their hash (one written before `file_digest` is trusted, not rebuilt)."""
        if index in self._verified:
            return False
        if index not in self._file_digests:
            self._file_digests[index] = self._recorded(index, "file_digest")
        return self._file_digests[index] is not None

    def read_some(self, index: int, keep) -> dict[str, torch.Tensor]:
        """The stored tensors of block `index` whose names `keep(name)` accepts, and from a disk store only their
        bytes: a few small tensors wanted outside the blocks' passes (a DiT's timestep embedding)."""
        if self.kind == "cpu":
            return {n: t for n, t in self._memory[index].items() if keep(n)}
        self.file_bytes(index)  # the layout, read once
        out = {}
        with open(self.block_file(index), "rb") as f:
            for name, (dtype, shape, begin, end) in self._layouts[index].tensors.items():
                if keep(name):
                    f.seek(begin)
                    data = bytearray(f.read(end - begin))
                    out[name] = (
                        torch.frombuffer(data, dtype=dtype).view(shape) if data else torch.empty(shape, dtype=dtype)
                    )
        return out


def read_layout(path: Path) -> Layout:
    """A block file's tensor table, from its safetensors header (8-byte length, then JSON), padding left out. A
    header that does not fit the file (a damaged length, a tensor past the end or of the wrong size) or a tensor
    off `STORE_ALIGN` is a ValueError, before any large read: the store rebuilds the block."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 8 <= length <= min(size - 8, MAX_HEADER_BYTES):
            raise ValueError(f"{path}: a header of {length} bytes does not fit a {size}-byte file")
        header = json.loads(f.read(length))
    if not isinstance(header, dict):
        raise ValueError(f"{path}: its header is not a table of tensors")
    start = 8 + length
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__" or name.startswith(PAD):
            continue
        dtype, shape, (begin, end) = ST_DTYPES[info["dtype"]], [int(n) for n in info["shape"]], info["data_offsets"]
        if not 0 <= begin <= end <= size - start or end - begin != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"{path}: tensor {name!r} at bytes {begin}-{end} does not fit the file or its shape")
        if (start + begin) % STORE_ALIGN:
            raise ValueError(f"{path}: tensor {name!r} at byte {start + begin} is not {STORE_ALIGN}-byte aligned")
        tensors[name] = (dtype, shape, start + begin, start + end)
    return Layout(size, tensors)


def views(data: torch.Tensor, layout: Layout) -> dict[str, torch.Tensor]:
    """The tensors of a block file read into `data`, as views of it (no copy)."""
    return {
        name: data[begin:end].view(dtype).view(shape) for name, (dtype, shape, begin, end) in layout.tensors.items()
    }


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> str:
    """A safetensors file written tensor by tensor (no second copy of the block in memory), synced to
    the disk and dropped from the page cache; returns the sha256 of the bytes written, hashed as they are written
    (no read back), for the store to check a read against. The header is padded with spaces and each tensor followed by
    a uint8 padding tensor (`PAD`), so every tensor starts `STORE_ALIGN`-aligned in the file: safetensors
    allows no gaps, and any safetensors reader still opens the file."""
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header, offset, pads = {}, 0, {}
    for name in order:
        t = tensors[name]
        size = t.numel() * t.element_size()
        header[name] = {"dtype": ST_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
        if offset % STORE_ALIGN:
            pads[name] = f"{PAD}{len(pads)}"
            gap = -offset % STORE_ALIGN
            header[pads[name]] = {"dtype": "U8", "shape": [gap], "data_offsets": [offset, offset + gap]}
            offset += gap
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % STORE_ALIGN)
    written = hashlib.sha256()

    def put(data) -> None:
        written.update(data)
        f.write(data)

    with open(path, "wb") as f:
        put(struct.pack("<Q", len(text)) + text)
        for name in order:
            put(memoryview(tensors[name].contiguous().view(-1).view(torch.uint8).numpy()))
            if name in pads:
                put(bytes(header[pads[name]]["shape"][0]))
        f.flush()
        os.fsync(f.fileno())
    evict(path)
    return written.hexdigest()


def non_finite(tensors: dict[str, torch.Tensor]) -> str | None:
    """The name of the first floating-point tensor holding NaN or inf, or None: one max and one min each, read back
    in one copy (training's check_finite does the same for a module, a layer above this one)."""
    floats = [(name, t) for name, t in tensors.items() if t.is_floating_point() and t.numel()]
    if not floats:
        return None
    finite = torch.stack([(torch.isfinite(t.amax()) & torch.isfinite(t.amin())).cpu() for _, t in floats]).tolist()
    return next((name for (name, _), ok in zip(floats, finite) if not ok), None)


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """A block's values, as a short hash of each tensor's name, dtype, shape and bytes (one pass over memory)."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(f"{name}:{t.dtype}:{list(t.shape)};".encode())
        h.update(memoryview(t.view(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


def stored_bytes(shapes: dict[str, list[int]], dtype: str) -> int:
    """A block's file size in a store of `dtype` (header aside): small tensors stay float32 when quantized."""
    total = 0
    for shape in shapes.values():
        n = math.prod(shape)
        small = len(shape) < 2 or n < 4096
        total += n * (4 if small and dtype in QUANTIZED_BLOCK else BYTES_PER_VALUE[dtype])
    return int(total)


def quantize_int8(t: torch.Tensor, rows_at_once: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one fp32 scale per row (per output channel of a weight): codes shaped as the
    tensor, scales shaped [rows, 1, ...] (one 1 per further dimension, so they broadcast over a convolution's
    kernel too). Per-row scales let the engine compute with the cast codes and scale the layer's output
    instead, so decoding is one cast. Rows are quantized `rows_at_once` at a time, on the tensor's device, so
    the float32 temporaries stay small beside a large weight."""
    shape, rows = t.shape, t.reshape(t.shape[0], -1)
    codes = torch.empty(rows.shape, dtype=torch.int8, device=t.device)
    scale = torch.empty(rows.shape[0], 1, dtype=torch.float32, device=t.device)
    for a in range(0, rows.shape[0], rows_at_once):
        part = rows[a : a + rows_at_once].float()
        s = part.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127
        codes[a : a + rows_at_once] = (part / s).round_().clamp_(-127, 127)
        scale[a : a + rows_at_once] = s
    return codes.view(shape), scale.view(shape[0], *[1] * (len(shape) - 1))


def dequantize_nf4(codes: torch.Tensor, absmax: torch.Tensor, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """bitsandbytes' nf4 codes (two values a byte) and their blocks' absmax as a tensor of `shape` in `dtype`."""
    import bitsandbytes.functional as bnb

    state = bnb.QuantState(
        absmax=absmax,
        shape=torch.Size(shape),
        dtype=dtype,
        blocksize=QUANTIZED_BLOCK["nf4"],
        quant_type="nf4",
        code=bnb.get_4bit_type("nf4", device=codes.device),
    )
    return bnb.dequantize_4bit(codes, quant_state=state)


def dequantize_int8(
    codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """codes x scale in `dtype`, written into `out` when it fits: a cast and a multiply, each one pass. Scales in
    `dtype` multiply in it (the scale rounded, then the product: the speed of one native pass); float32 ones (those
    float16 cannot hold, scale_dtype) multiply a block of rows at a time, each product rounded once, with no
    float32 copy of the whole weight (cast to float16 first, a row of weights under 0.008 had its scale rounded
    coarsely, and under 4e-6 to zero)."""
    out = _into(out, codes, dtype)
    if scale.dtype == out.dtype:
        return out.mul_(scale)
    for a in range(0, out.shape[0], SCALE_ROWS_AT_ONCE):
        out[a : a + SCALE_ROWS_AT_ONCE].mul_(scale[a : a + SCALE_ROWS_AT_ONCE])
    return out


SCALE_ROWS_AT_ONCE = 256  # rows a float32 multiply into float16 takes at once: its float32 temporary stays small
FLOAT16_SMALLEST = 2.0**-24  # float16's smallest subnormal: a weight under half of it is zero in float16


def scale_dtype(scale: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """The dtype an int8 weight's row scales (`scale`, float32 in host memory) are kept in beside its codes for a
    compute in `dtype`: that dtype, except float16 where a scale is below its smallest normal number (a row of
    weights under 0.008): float16 would round it coarsely or to zero, so they stay float32 and scale in float32."""
    if dtype != torch.float16:
        return dtype
    # a row whose weights float16 shows as zero anyway (an all-zero row's scale is 1e-12 / 127) asks for nothing
    small = (scale < torch.finfo(torch.float16).tiny) & (scale * 127 >= FLOAT16_SMALLEST)
    return torch.float32 if bool(small.any()) else dtype


def _into(target: torch.Tensor | None, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` cast to `dtype`: into `target` when it has the right shape, dtype and device, else a new tensor."""
    if target is not None and target.shape == t.shape and target.dtype == dtype and target.device == t.device:
        return target.copy_(t)
    return t.to(dtype)


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
            f"strategy.streaming.store_dtype nf4 needs bitsandbytes, which failed to import ({e}); "
            "use store_dtype=int8 or bfloat16."
        ) from e


@contextlib.contextmanager
def build_progress(store, missing: list, shapes: dict):
    """A progress bar while the store is written: blocks, GB written and the time left."""
    if not missing or store.kind != "disk":
        yield
        return
    from tqdm import tqdm

    total = sum(stored_bytes(shapes[i], store.dtype) for i in missing)
    written = 0
    bar = tqdm(
        total=len(missing),
        unit="block",
        desc=f"layer store ({store.dtype}, {human_bytes(total)})",
        bar_format="{desc}: {n_fmt}/{total_fmt} blocks{postfix} [{elapsed}<{remaining}]",
        postfix="0.0 GB",
    )

    def advance(index, size: int) -> None:
        nonlocal written
        written += size
        bar.set_postfix_str(f"{written / 2**30:,.1f} of {total / 2**30:,.1f} GB", refresh=False)
        bar.update(1)

    store.progress = advance
    try:
        yield
    finally:
        store.progress = None
        bar.close()
