"""Layer streaming: run a model whose blocks do not fit on the device, a chunk of blocks at a time.

The schedule for one optimizer step over M micro-batches (FairScale OffloadModel / FlexGen):

  forward   chunk-outer, micro-batch-inner, no grad: each chunk is loaded once and every
            micro-batch passes through it; the input of every chunk that will be recomputed is
            kept (on the device, or on the host with activations=host)
  suffix    the loss of each micro-batch, backpropagated to the last hidden state
  backward  chunks in reverse: reload (the last chunk is still resident), recompute the forward
            with grad from the kept input, backpropagate every micro-batch, free; it stops at the
            lowest chunk that holds a trainable layer, so a frozen prefix runs forward only

The model's own forward code does everything around the blocks: to get the blocks' inputs, the
first block is swapped for a module that raises with its arguments (`prefix`); to finish, the
blocks are swapped for modules that hand back the streamed hidden state (`suffix`). So masks,
rotary embeddings, caches, the final norm, the head and the loss are exactly the model's.
"""

from __future__ import annotations

import contextlib
import time
import types
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from onn.errors import UserError
from onn.hardware.memory import hold_mmap_threshold, return_large_frees_to_os, trim_heap
from onn.hardware.profile import CoreWatch
from onn.models.layers import LayerMap
from onn.streaming.quantized import (
    EmptyEmbedding,
    Scratch,
    StoredEmbedding,
    linear_forward,
    looks_up_ids,
    scales_the_product,
)
from onn.streaming.recompute_norms import recompute_norms
from onn.streaming.schedule import cached_blocks, computes_from_codes
from onn.streaming.store import LayerStore, buffer, stored_name
from onn.streaming.tiled_mlp import tile_blocks


class _BlocksReached(Exception):
    def __init__(self, hidden: torch.Tensor, args: tuple, kwargs: dict):
        self.hidden, self.args, self.kwargs = hidden, args, kwargs


class _Capture(nn.Module):
    def forward(self, hidden, *args, **kwargs):
        raise _BlocksReached(hidden, args, kwargs)


class _Replay:
    """A block's forward while the suffix runs: the last hands back the streamed hidden state, the others pass on
    what they are given. Set on the block itself (not swapped for it), so the model can still reach into its
    blocks after them (a DiT's output layer conditions on block 0's timestep embedding)."""

    def __init__(self, value: torch.Tensor | None, as_tuple: bool):
        self.value, self.as_tuple = value, as_tuple

    def __call__(self, hidden, *args, **kwargs):
        out = self.value if self.value is not None else (hidden[0] if isinstance(hidden, tuple) else hidden)
        return (out,) if self.as_tuple else out


@dataclass
class BlockInputs:
    """What the model passes its blocks for one micro-batch: the hidden state (None where it is not needed) and the
    rest."""

    hidden: torch.Tensor | None
    args: tuple
    kwargs: dict


class Objective:
    """What the engine asks of a model's batches, the part that differs between kinds of model. This default is a
    causal LM's (the text modality): the model's keyword inputs are the batch without its labels, its own output
    carries the loss, and a micro-batch's mean loss averages over its target tokens. Another modality passes its
    own (a denoiser's inputs are the noisy images and their timesteps, its loss the error against the noise)."""

    # Hold glibc's mmap threshold at its start (128 KiB) while streaming, so activations of a block's weights' sizes
    # are unmapped when freed rather than kept by the heap. A network's objective (a DiT's, an LSTM stack's) does:
    # a 24-block DiT's streamed step then peaked at 102 MB instead of 330 (recipe=bench_streamed_arch), its step
    # time within the noise of two shared cores. A causal LM's activations stay in the heap: held low, llama_small's
    # streamed step ran 2.6x slower (docs/streaming.md).
    hold_mmap_threshold: bool = False

    def inputs(self, batch: dict[str, Any], targets: bool = False) -> dict[str, Any]:
        """The model's keyword arguments for `batch`; `targets`: for the suffix, which computes the loss."""
        if targets:
            return batch
        # a cache would grow again when a chunk is recomputed
        return {"use_cache": False, **{k: v for k, v in batch.items() if k != "labels"}}

    def loss(self, output: Any, batch: dict[str, Any]) -> torch.Tensor:
        """The mean loss of `batch` from the model's output."""
        return output.loss

    def weight(self, batch: dict[str, Any]) -> int:
        """What the mean loss of `batch` averages over (micro-batches weigh by it in a step's loss)."""
        return target_tokens(batch)


@dataclass
class StepTimes:
    io_s: float = 0.0  # time the compute waited for weights (not hidden by prefetch)
    load_s: float = 0.0  # time spent loading weights (reading and decoding), wherever it ran
    read_s: float = 0.0  # of which reading the disk
    read_bytes: int = 0  # bytes read from the disk
    copied_bytes: int = 0  # bytes copied from host memory to the GPU (weights)
    compute_s: float = 0.0
    loads: int = 0
    history: list[int] = field(default_factory=list)  # chunk indices in load order


class _Slot:
    """Reused memory for one chunk in flight: per block position, the buffer its file is read into and
    the tensors it decodes into (when the stored dtype is not the compute dtype)."""

    def __init__(self):
        self.raw: dict[int, torch.Tensor] = {}
        self.decoded: dict[int, dict[str, torch.Tensor]] = {}


SLOTS = 2  # chunks in flight: the one computing and the one loading behind it


class StreamingEngine:
    """Runs a LayerMap'd model with its blocks' frozen weights coming from a LayerStore.

    Weights move through two slots of reused memory: the loader thread reads the next chunk that
    needs the disk into the free slot while the compute thread works on the other (a store in the
    compute dtype on a CPU computes straight from the read buffer: no copy). `cache_blocks` blocks of a
    disk store stay in host memory after their first read and are never read again."""

    def __init__(
        self,
        model: nn.Module,
        layer_map: LayerMap,
        store: LayerStore,
        chunk_size: int,
        device: torch.device | str = "cpu",
        prefetch: bool = True,
        activations: str = "device",
        compute_dtype: torch.dtype | None = None,
        micro_batch: int | None = None,
        forward_group: int | None = None,
        stream_edges: bool = False,
        cache_blocks: int = 0,
        eval_tokens: int | None = None,
        suffix_rows: int | None = None,
        objective: Objective | None = None,
        mlp_tiles: int = 1,
    ):
        n = len(layer_map)
        if not 1 <= chunk_size <= n:
            raise UserError(
                f"strategy.streaming.chunk_size must be between 1 and the model's {n} blocks (got {chunk_size})."
            )
        check_router_loss(model)
        check_blocks_stand_alone(layer_map.blocks)
        self.model, self.map, self.store = model, layer_map, store
        self.objective = objective or Objective()
        device = torch.device(device)
        # `cuda` alone is the current GPU, named: the loader threads' set_device needs the index
        self.device = torch.device("cuda", torch.cuda.current_device()) if device == torch.device("cuda") else device
        self.prefetch, self.activations, self.micro_batch = prefetch, activations, micro_batch
        self.eval_tokens = eval_tokens  # tokens a validation pass may hold (None: the whole set)
        # rows of a micro-batch whose loss runs at once (None: all): the logits of a large vocabulary
        # (Phi-4's 100,352) would otherwise take more memory than a streamed chunk
        self.suffix_rows = suffix_rows
        # A no-grad pass of g micro-batches through one block holds about what the recompute of one
        # micro-batch through a chunk holds, so fusing up to chunk_size of them costs no extra peak.
        self.forward_group = forward_group or chunk_size
        self.chunks = [list(range(s, min(s + chunk_size, n))) for s in range(0, n, chunk_size)]
        self._find_frozen(compute_dtype)
        self._find_edges(stream_edges)
        # Blocks of a disk store held in host memory once read (as many as the plan's budget allows).
        first_twice = self.chunks[self.lowest_chunk][0] if self.lowest_chunk < len(self.chunks) else n
        self.cache_blocks = set(cached_blocks(n, int(cache_blocks), first_twice)) if store.kind == "disk" else set()
        self._prepare_linears()
        # a block's gated MLP a slice of its intermediate features at a time: its activations, the largest
        # of a decoder block's, then take a slice's memory (onn/streaming/tiled_mlp.py)
        self.tiled_mlps = tile_blocks(self.map.blocks, mlp_tiles)
        # on a GPU, whose memory a block's recompute shares with the chunks, its norms' float32 copies are computed
        # again in the backward rather than kept (onn/streaming/recompute_norms.py); host memory has room for them
        self.recomputed_norms = recompute_norms(self.map.blocks, on=self.device.type == "cuda")
        # Dropout in the blocks (LoRA's, a layer's, attention's): the backward recomputes each chunk, and must draw
        # the masks its forward drew, or the gradient is of no network at all. The training forward then records
        # the random state each chunk of each micro-batch starts from, and fuses no micro-batches (one draw for a
        # fused batch is not the draws of its parts); the recompute starts from the same state.
        self.dropout = any(_draws_masks(m) for block in self.map.blocks for m in block.modules())
        # BatchNorms before and in the blocks: where one normalises by the batch's statistics (in training, or
        # always without running statistics) each micro-batch is normalised by its own (no fused runs, whose
        # statistics would be the run's) and running statistics move once per micro-batch, as the resident model's
        # do; the suffix (which runs the model's forward, its prefix included, again) and a chunk's recompute
        # normalise by the batch's statistics and leave the running ones (_statistics_kept)
        outside = [module for _, module in self.map.prefix]
        self._batch_norms = [
            m
            for m in dict.fromkeys(m for module in [*outside, *self.map.blocks] for m in module.modules())
            if isinstance(m, nn.modules.batchnorm._BatchNorm)
        ]
        self._random_states: dict[tuple[int, int], tuple] = {}
        self._start_state()

    def _find_frozen(self, compute_dtype: torch.dtype | None) -> None:
        """The blocks' frozen weights, the dtype they compute in, and the lowest chunk with a trainable layer."""
        blocks = self.map.blocks
        self.frozen = [[name for name, p in block.named_parameters() if not p.requires_grad] for block in blocks]
        model_dtype = next(p.dtype for p in blocks[0].parameters() if not p.requires_grad)
        self.compute_dtype = compute_dtype or model_dtype
        trained = {p.dtype for block in blocks for p in block.parameters() if p.requires_grad}
        # Mixed precision (a compute dtype given) autocasts the blocks wherever one of their weights has another
        # dtype: frozen weights streamed in a lower dtype than the model's, or float32 adapters beside bf16
        # weights (Phi-4's on a GPU), as Lightning's autocast runs a resident model. _run_chunk's autocast with
        # enabled=False switched Lightning's off inside the blocks: such adapters then ran in float32, and with
        # peft's cast of their inputs a Phi-4 block's recompute and backward at 2,048 tokens held 1,007 MB of
        # activations; under autocast, peft's cast left to it: 664 MB (tracked on a CPU).
        mixed = compute_dtype is not None and bool(trained - {self.compute_dtype})
        self._autocast = self.compute_dtype != model_dtype or mixed
        # under autocast, which casts an adapter's input itself, peft's cast to float32 first is a copy for nothing:
        # off while a block runs (peft's own helper, which puts it back after)
        self._uncast = lambda block: contextlib.nullcontext()
        if self._autocast:
            from peft.helpers import disable_input_dtype_casting

            self._uncast = disable_input_dtype_casting
        trainable = {i for i, block in enumerate(blocks) if any(p.requires_grad for p in block.parameters())}
        self.lowest_chunk = min(
            (c for c, ids in enumerate(self.chunks) if set(ids) & trainable), default=len(self.chunks)
        )

    def _find_edges(self, stream_edges: bool) -> None:
        """stream_edges: the frozen weights outside the blocks (embeddings, final norm, head) live in the store
        too and come to the device only for the prefix or the suffix that uses them, never beside a chunk. A
        streamed embedding is looked up in host memory (StoredEmbedding): only the rows a batch names cross to
        the device."""
        model = self.model
        in_blocks = {id(p) for block in self.map.blocks for p in block.parameters()}
        self.edges = (
            [n for n, p in model.named_parameters() if id(p) not in in_blocks and not p.requires_grad]
            if stream_edges
            else []
        )
        self._edge_phases = _edge_phases(model, self.map, self.edges)
        # an embedding by its table's stored name, not its own path: BART's encoder and decoder each run their own
        # embed_tokens, whose table is model.shared's (stored under that name); matched by path, neither got a
        # stand-in nor its table, and the prefix failed on an empty table ("Padding_idx must be within ...")
        names = {id(p): n for n, p in model.named_parameters()}
        embeddings = {
            path: (names[id(module.weight)], module)
            for path, module in model.named_modules()
            if isinstance(module, nn.Embedding) and names.get(id(module.weight)) in self._edge_phases["prefix"]
        }
        # an embedding no stored table stands in for (OPT's positions, from the attention mask; nf4 rows that
        # straddle its blocks) takes its whole table in the prefix, and again in the suffix, which computes it
        # again; so does every module that shares that table
        whole = {name for name, m in embeddings.values() if not looks_up_ids(m, self.store.dtype)}
        self._embeddings = {path: (name, m) for path, (name, m) in embeddings.items() if name not in whole}
        self._looked_up = {name for name, _ in self._embeddings.values()}
        # so does every other weight the prefix computes with (BLOOM's embedding norm, OPT's input projection): the
        # suffix runs the model's forward from its start, and only a stored table's embedding has a stand-in there
        self._edge_phases["suffix"] |= self._edge_phases["prefix"] - self._looked_up
        # int8 weights the edges compute from as codes: their linears' (a head tied to a table decoded whole
        # is decoded whole too); any other (a table, a convolution) is de-quantized, or it computed from codes
        self._edge_codes = {
            names[id(m.weight)]
            for m in model.modules()
            if isinstance(m, nn.Linear) and names.get(id(m.weight)) in self.edges
        } - whole

    def _prepare_linears(self) -> None:
        """The frozen linears of the blocks (and the streamed head). With an int8 store each computes from the
        codes installed in it and scales its output by their row scales (linear_forward), so decoding is at
        most one cast (in float16, whose range the unscaled output can pass, the loader scales the weight).
        Decoded weights: freed buffers their size go back to the OS, smaller ones (activations) stay in the heap;
        a zero-copy stream decodes nothing, and a fixed threshold would only send a small model's activations
        (larger than its weights) through mmap: llama_small's step ran 35% slower."""
        self._linears = [
            {
                stored_name(f"{name}.weight"): m
                for name, m in block.named_modules()
                if isinstance(m, nn.Linear) and not m.weight.requires_grad
            }
            for block in self.map.blocks
        ]
        if not self._zero_copy:
            weights = [
                m.in_features * m.out_features * self.compute_dtype.itemsize
                for linears in self._linears
                for m in linears.values()
            ]
            return_large_frees_to_os(min(weights, default=0))
        elif self.objective.hold_mmap_threshold:
            hold_mmap_threshold()
        # by the weight itself: a head tied to the embedding holds a weight named after the embedding
        names = {id(p): n for n, p in self.model.named_parameters()}
        self._edge_linears = [
            (names[id(m.weight)], m)
            for m in self.model.modules()
            if isinstance(m, nn.Linear) and names.get(id(m.weight)) in self.edges
        ]
        if self.store.dtype == "int8":
            scratch = Scratch(self.compute_dtype)
            for module in [
                *(m for linears in self._linears for m in linears.values()),
                *(m for _, m in self._edge_linears),
            ]:
                module._onn_scale, module._onn_scratch = None, scratch
                module.forward = types.MethodType(linear_forward, module)

    def _start_state(self) -> None:
        """What the loads keep between calls. Generating, a CPU computes from an int8 store's codes as stored
        (one new token per sequence through torch's weight-only int8 matmul; a prefill casts one weight at a
        time); training and validation decode whole chunks in the loader thread, whose passes are many rows.
        On a GPU one chunk loads at a time: it copies over the one host link while the current chunk computes,
        and the device holds two chunks, as planned (a third would only share the link)."""
        self._codes_direct = False
        self.times = StepTimes()
        self._cached: dict[int, dict[str, torch.Tensor]] = {}
        self._slots = [_Slot() for _ in range(SLOTS)]
        self._free = list(range(SLOTS))
        self._in_flight = 1 if self.device.type == "cuda" else SLOTS
        self._resident: int | None = None
        self._resident_slot: int | None = None
        self._pending: dict[int, tuple[Future, int | None]] = {}
        self._pool: ThreadPoolExecutor | None = None  # started on first use, again after close()
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._released: torch.cuda.Event | None = None  # the GPU's point past the last chunk released (release)
        self._edge_buffer: torch.Tensor | None = None
        self.cores: CoreWatch | None = None  # set for CPU runs: torch's threads follow the free cores, chunk by chunk
        self._as_tuple = False
        self._pending_backward = None

    # -- weights -------------------------------------------------------------------------------
    def offload(self) -> None:
        """Move every block's frozen weights into the store and leave empty placeholders behind.
        Blocks that are placeholders already were written to the store while loading."""
        blocks = {}
        for i, block in enumerate(self.map.blocks):
            params = dict(block.named_parameters())
            if all(params[n].numel() == 0 for n in self.frozen[i]):
                if not self.store.is_complete(i):
                    raise RuntimeError(f"block {i} was loaded into the store, which no longer holds it")
                continue
            blocks[i] = {stored_name(n): params[n].data for n in self.frozen[i]}
        params = dict(self.model.named_parameters())
        if self.edges and not all(params[n].numel() == 0 for n in self.edges):
            blocks["edges"] = {n: params[n].data for n in self.edges}
        elif self.edges and not self.store.is_complete("edges"):  # placeholders: streamed by an engine before
            raise RuntimeError("the edges were streamed from the store, which no longer holds them")
        self.store.fill(blocks)
        for i in range(len(self.map)):
            self._release_block(i)
        self._set_edges(None)
        del blocks  # the last references to the weights now in the store
        if self.objective.hold_mmap_threshold:  # the model's build left freed weights in the heap: give them back
            trim_heap()

    def _set_edges(
        self, tensors: dict[str, torch.Tensor] | None, scales: dict[str, torch.Tensor] | None = None
    ) -> None:
        params = dict(self.model.named_parameters())
        for name in self.edges:
            params[name].data = (
                tensors[name]
                if tensors and name in tensors
                else torch.empty(0, dtype=self.compute_dtype, device=self.device)
            )
        for name, module in self._edge_linears:
            module._onn_scale = (scales or {}).get(name)

    @contextlib.contextmanager
    def _edges_loaded(self, phase: str):
        """With stream_edges, the weights outside the blocks that `phase` (prefix or suffix) uses; otherwise
        they are always there. The prefix's embeddings are looked up in host memory (StoredEmbedding); the
        suffix runs them as EmptyEmbedding (it recomputes them only for their shape). Weights that do go to
        the device go after the resident chunk is given back, so they never share the device with one."""
        if not self.edges:
            yield
            return
        start = time.perf_counter()
        if self.store.kind == "disk" and self._edge_buffer is None:
            self._edge_buffer = buffer(self.store.file_bytes("edges"), pin=self.store.pin)
        stored = self._read("edges", self._edge_buffer)
        wanted = self._edge_phases[phase] - (self._looked_up if phase == "prefix" else set())
        # every streamed embedding: the suffix computes one only for its shape, even where the head shares its
        # weight (which the head then takes as installed: codes, on a GPU)
        stand_ins = {
            path: StoredEmbedding(module, stored, name, self.device, self.compute_dtype)
            if phase == "prefix"
            else EmptyEmbedding(module, self.device, self.compute_dtype)
            for path, (name, module) in self._embeddings.items()
        }
        if wanted:
            self.release()
            # the same choice as the blocks' outside generation: on a GPU the head computes from codes too
            compute = str(self.compute_dtype).removeprefix("torch.")
            codes = computes_from_codes(self.store.dtype, self.device.type, compute, False)
            scales = {} if codes else None
            subset = {k: v for k, v in stored.items() if _base_name(k) in wanted}
            if self.device.type == "cuda":
                self.times.copied_bytes += sum(t.numel() * t.element_size() for t in subset.values())
            # queued behind the compute, without waiting for it (a blocking copy drained the GPU at every suffix
            # and generated token) where the host tensors stay as they are: a memory store's; a disk store's
            # edge buffer is read into again at the next phase
            queued = self.device.type == "cuda" and self.store.kind == "cpu"
            decoded = self.store.decode(
                subset, self.device, self.compute_dtype, queued, scales=scales, codes=codes, scaled=self._edge_codes
            )
            self._set_edges(decoded, scales)
        self.times.load_s += time.perf_counter() - start
        self.times.io_s += time.perf_counter() - start
        try:
            with _swapped_paths(self.model, stand_ins):
                yield
        finally:
            self._set_edges(None)

    def _release_block(self, i: int) -> None:
        params = dict(self.map.blocks[i].named_parameters())
        for name in self.frozen[i]:
            params[name].data = torch.empty(0, dtype=self.compute_dtype, device=self.device)
        for module in self._linears[i].values():
            module._onn_scale = None

    @property
    def _zero_copy(self) -> bool:
        """Stored tensors are the compute tensors: a CPU computing in the store's (float) dtype."""
        return self.device.type == "cpu" and self.store.dtype == str(self.compute_dtype).removeprefix("torch.")

    def _as_stored(self) -> bool:
        """A CPU computes from the stored tensors themselves (a zero-copy stream, or an int8 store's codes
        while generating): a block in host memory takes no slot and is ready at once. So the loader
        passes over the cached blocks and reads the next uncached one while they compute; when cached
        blocks took the slots too, the disk sat idle through every uncached block's compute (Phi-4's
        generation: 5.1 s per token at batch 8 for 3.7 s of reads). A GPU always needs its copy."""
        return self.device.type == "cpu" and (self._zero_copy or self._codes_direct)

    def _needs_slot(self, c: int) -> bool:
        """Whether loading chunk c takes a slot's memory: to read into, or to decode into."""
        if self.device.type == "cpu" and not self._as_stored():
            return True
        return self.store.kind == "disk" and any(i not in self.cache_blocks for i in self.chunks[c])

    def _ready(self, c: int) -> bool:
        """Chunk c can be installed without reading or decoding anything."""
        if not self._as_stored():
            return False
        return self.store.kind == "cpu" or all(i in self._cached for i in self.chunks[c])

    def _read(self, index: int | str, into: torch.Tensor | None) -> dict[str, torch.Tensor]:
        start = time.perf_counter()
        stored = self.store.read(index, into=into)
        self.times.read_bytes += self.store.file_bytes(index) if self.store.kind == "disk" else 0
        self.times.read_s += time.perf_counter() - start
        return stored

    def _stored(self, i: int, slot: _Slot | None, pos: int) -> dict[str, torch.Tensor]:
        """Block i's stored tensors: from host memory (a cpu store, or a cached block), else read from
        the disk into the slot's buffer for this position."""
        if self.store.kind == "cpu":
            return self.store.read(i)
        if i in self._cached:
            return self._cached[i]
        if i in self.cache_blocks:
            self._cached[i] = self._read(i, buffer(self.store.file_bytes(i), pin=self.store.pin))
            return self._cached[i]
        size = max(self.store.file_bytes(j) for j in range(len(self.map)))
        if pos not in slot.raw:
            slot.raw[pos] = buffer(size, pin=self.store.pin)
        return self._read(i, slot.raw[pos])

    def _load_chunk(
        self, c: int, slot_index: int | None, after: torch.cuda.Event | None = None
    ) -> dict[int, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]:
        """Read (and decode) chunk c's weights for the device: per block, its tensors and the row scales of
        its int8 weights. Runs in a loader thread. `after`: the GPU's point past the last chunk released, which
        the copies wait for (see release)."""
        start = time.perf_counter()
        slot = self._slots[slot_index] if slot_index is not None else None
        out = {}
        try:
            for pos, i in enumerate(self.chunks[c]):
                stored = self._stored(i, slot, pos)
                # a linear's int8 weight cast by the loader is scaled here in float16 (scales_the_product)
                scaled = self._codes_direct or scales_the_product(self.compute_dtype)
                scales = {} if self.store.dtype == "int8" and scaled else None
                linears = self._linears[i]  # their int8 weights scale the output; others (an LSTM's) decode whole
                if self._copy_stream is not None:
                    if after is not None:  # read from the host already; the device memory is the released chunk's
                        after.synchronize()
                        after = None
                    self.times.copied_bytes += sum(t.numel() * t.element_size() for t in stored.values())
                    with torch.cuda.stream(self._copy_stream):
                        tensors = self.store.decode(
                            stored,
                            self.device,
                            self.compute_dtype,
                            non_blocking=True,
                            scales=scales,
                            codes=self._codes_direct,
                            scaled=linears,
                        )
                elif self._codes_direct:  # views of the read buffer (or the cached block): nothing to keep
                    tensors = self.store.decode(
                        stored, self.device, self.compute_dtype, scales=scales, codes=True, scaled=linears
                    )
                else:
                    targets = slot.decoded.get(pos) if slot is not None else None
                    tensors = self.store.decode(
                        stored, self.device, self.compute_dtype, out=targets, scales=scales, scaled=linears
                    )
                    if slot is not None and not self._zero_copy:
                        slot.decoded[pos] = tensors
                out[i] = (tensors, scales or {})
        finally:
            # the slot's host buffers are read into again after this chunk (or a failed load) gives it back: its
            # copies, a failed decode's queued ones too, end first. One wait for the chunk: each block position has
            # a buffer of its own, so the next block's read from the disk runs while this one's copy is queued
            if self._copy_stream is not None:
                self._copy_stream.synchronize()
        self.times.load_s += time.perf_counter() - start
        return out

    def _take_slot(self) -> int:
        if not self._free:  # loads ahead of a pass that ended early hold every slot: let them finish
            self._drain()
        return self._free.pop(0)

    def _schedule(self, c: int) -> None:
        slot = self._take_slot() if self._needs_slot(c) else None
        if self._pool is None:
            # one loader per slot: one chunk's decode overlaps the next one's read
            # a new thread's current CUDA device is GPU 0: its page-locked buffers would put a context there
            on_device = {"initializer": torch.cuda.set_device, "initargs": (self.device,)} if self._copy_stream else {}
            self._pool = ThreadPoolExecutor(max_workers=SLOTS, thread_name_prefix="onn-prefetch", **on_device)
        self._pending[c] = (self._pool.submit(self._load_chunk, c, slot, self._released), slot)

    def _prefetch(self, upcoming) -> None:
        """Start loading the next chunks of `upcoming` (in the order they will be needed) that need the
        disk or a decode, as many as there are free slots; chunks ready in memory are passed over."""
        if not self.prefetch:
            return
        for c in upcoming:
            if len(self._pending) >= self._in_flight:
                return
            if c == self._resident or c in self._pending or self._ready(c):
                continue
            if self._needs_slot(c) and not self._free:
                return  # in order: never read a later chunk before an earlier one
            self._schedule(c)

    def _install(self, c: int, upcoming=()) -> None:
        """Make chunk c resident (reusing it if it already is) and start loading what comes after it."""
        if self.cores is not None:
            self.cores.look()
        if self._resident != c:
            self.release()
            start = time.perf_counter()
            entry = self._pending.pop(c, None)
            slot = entry[1] if entry is not None else self._take_slot() if self._needs_slot(c) else None
            try:
                chunk = entry[0].result() if entry is not None else self._load_chunk(c, slot, self._released)
            except Exception:  # out of memory beside the step: the back-off retries, and needs the buffer
                if slot is not None:
                    self._free.append(slot)
                # the failed load's future holds the error, whose traceback holds this frame: without the future
                # here, what the load had copied to the device goes when the back-off lets the error go, not at
                # the garbage collector's next full pass
                entry = None
                raise
            self.times.io_s += time.perf_counter() - start
            # the engine's GPU's stream, named: the current device may be another GPU (the main thread's cuda:0)
            computing = torch.cuda.current_stream(self.device) if self._copy_stream is not None else None
            for i, (tensors, scales) in chunk.items():
                params = {stored_name(n): p for n, p in self.map.blocks[i].named_parameters()}
                for name, t in tensors.items():
                    if self._copy_stream is not None:  # made on the copy stream, used on this one
                        t.record_stream(computing)
                    params[name].data = t
                for name, scale in scales.items():
                    if self._copy_stream is not None:  # made on the copy stream too: its memory must outlive the use
                        scale.record_stream(computing)
                    self._linears[i][name]._onn_scale = scale
            self._resident, self._resident_slot = c, slot
            self.times.loads += 1
            self.times.history.append(c)
        self._prefetch(upcoming)

    def _use_codes(self, generating: bool) -> None:
        """Switch between int8 codes used as stored and codes cast to the compute dtype (on a CPU, by
        whether the pass generates; on a GPU always codes): loads in flight and the resident chunk were made
        for the other kind, so they are dropped."""
        direct = computes_from_codes(
            self.store.dtype, self.device.type, str(self.compute_dtype).removeprefix("torch."), generating
        )
        if direct != self._codes_direct:
            self._drain()
            self.release()
            self._codes_direct = direct
            if direct:  # the decoded blocks' memory goes back
                for slot in self._slots:
                    slot.decoded.clear()

    def resident_weights(self) -> list[torch.Tensor]:
        """The frozen 2-D weights of the chunk on the device now, as the matmuls use them (empty if none)."""
        if self._resident is None:
            return []
        return [
            p
            for i in self.chunks[self._resident]
            for p in self.map.blocks[i].parameters()
            if not p.requires_grad and p.dim() == 2
        ]

    def release(self) -> None:
        """Give the resident chunk's weights (and its slot) back. On a GPU its memory is free for reuse only once
        the GPU has run the kernels queued on it (the allocator holds it until then: record_stream), so the
        loads started after this wait for that point before they allocate: else each load would take new memory
        while the GPU still computes with the released chunk, a third chunk the plan does not count, until the
        allocator met the budget's cap and stalled to free its cache."""
        if self._resident is not None:
            for i in self.chunks[self._resident]:
                self._release_block(i)
            if self._resident_slot is not None:
                self._free.append(self._resident_slot)
            self._resident, self._resident_slot = None, None
            if self._copy_stream is not None:
                self._released = torch.cuda.Event()
                self._released.record(torch.cuda.current_stream(self.device))  # the engine's GPU, not the current one

    # -- around the blocks ---------------------------------------------------------------------
    @contextlib.contextmanager
    def _swapped(self, replacements: dict[int, nn.Module]):
        container = self.map.blocks_path and self.model.get_submodule(self.map.blocks_path) or self.model
        names = self.map.block_names
        saved = {i: container._modules[names[i]] for i in replacements}
        try:
            for i, module in replacements.items():
                container._modules[names[i]] = module
            yield
        finally:
            for i, module in saved.items():
                container._modules[names[i]] = module

    def prefix(self, batch: dict[str, Any]) -> BlockInputs:
        """Run the model up to its first block; return what the first block would be called with."""
        with self._swapped({0: _Capture()}):
            try:
                self.model(**self.objective.inputs(batch))
            except _BlocksReached as reached:
                return BlockInputs(reached.hidden, reached.args, reached.kwargs)
        raise RuntimeError("the model finished its forward without calling its first block")

    def suffix(self, hidden: torch.Tensor, batch: dict[str, Any], **extra):
        """Finish the model's forward from the last block's output (norm, head, loss)."""
        last = len(self.map) - 1
        try:
            for i, block in enumerate(self.map.blocks):
                block.forward = _Replay(hidden if i == last else None, self._as_tuple)
            return self.model(**self.objective.inputs(batch, targets=True), **extra)
        finally:
            for block in self.map.blocks:
                del block.forward

    @contextlib.contextmanager
    def _suffix_phase(self):
        """Around the suffix's forward and backward: the streamed edges it uses, and any frozen block weights the
        model reads outside its blocks' calls (a DiT's output layer calls block 0's timestep embedding), which
        are read from the store when such a module is called without them and given back after."""
        borrowed: list[nn.Parameter] = []

        def hook(i: int, path: str):
            def load(module: nn.Module, args) -> None:
                own = {f"{path}.{n}" if path else n: p for n, p in module.named_parameters(recurse=False)}
                empty = {stored_name(n): p for n, p in own.items() if n in self.frozen[i] and p.numel() == 0}
                if not empty:
                    return
                wanted = self.store.read_some(i, lambda name: _base_name(name) in empty)
                for name, t in self.store.decode(wanted, self.device, self.compute_dtype).items():
                    empty[name].data = t
                    borrowed.append(empty[name])

            return load

        handles = [
            module.register_forward_pre_hook(hook(i, path))
            for i, block in enumerate(self.map.blocks)
            for path, module in block.named_modules()
            if any(not p.requires_grad for p in module.parameters(recurse=False))
        ]
        try:
            with self._edges_loaded("suffix"), self._statistics_kept():
                yield
        finally:
            for h in handles:
                h.remove()
            for p in borrowed:
                p.data = torch.empty(0, dtype=self.compute_dtype, device=self.device)

    @contextlib.contextmanager
    def _statistics_kept(self):
        """The BatchNorms before and in the blocks that train normalise by the batch's statistics and leave their
        running statistics as they are, for a pass that runs them again on a micro-batch the forward measured."""
        measuring = [m for m in self._batch_norms if m.training and m.track_running_stats]
        for m in measuring:
            m.track_running_stats = False
        try:
            yield
        finally:
            for m in measuring:
                m.track_running_stats = True

    def _run_chunk(self, c: int, hidden: torch.Tensor, inputs: BlockInputs, random_state=None) -> torch.Tensor:
        """Chunk c's blocks on `hidden`; drawing from `random_state` when given (the masks a run from it drew)."""
        # mixed precision (see _find_frozen): autocast to the compute dtype, also where Lightning's precision
        # plugin does not (validation's epoch end, generation). Otherwise no autocast of the engine's own: one with
        # enabled=False would switch off an enclosing one (Lightning's bf16-mixed) inside the blocks, which then
        # computed in float32 where the resident model's computed in bf16
        own = torch.autocast(self.device.type, dtype=self.compute_dtype) if self._autocast else contextlib.nullcontext()
        with self._replay(random_state), own:
            for i in self.chunks[c]:
                with self._uncast(self.map.blocks[i]):
                    out = self.map.blocks[i](hidden, *inputs.args, **inputs.kwargs)
                self._as_tuple = isinstance(out, tuple)
                hidden = out[0] if self._as_tuple else out
        return hidden

    def _random_state(self) -> tuple:
        """The random state dropout draws from next: the CPU generator's, and the device's on a GPU."""
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return torch.get_rng_state(), cuda

    @contextlib.contextmanager
    def _replay(self, state: tuple | None):
        """Draw from `state` inside, and from where the generators were after it (None: as they are)."""
        if state is None:
            yield
            return
        with torch.random.fork_rng(devices=[self.device] if state[1] is not None else []):
            torch.set_rng_state(state[0])
            if state[1] is not None:
                torch.cuda.set_rng_state(state[1], self.device)
            yield

    def _keep(self, t: torch.Tensor) -> torch.Tensor:
        """A chunk input kept for the backward: on the device, or (activations=host) in pinned host memory,
        copied in the compute stream's order so the GPU never waits for the host."""
        if self.activations != "host" or t.device.type == "cpu":
            return t
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)

    def _groups(self, micro_batches: list[dict[str, Any]]) -> list[list[int]]:
        """Runs of consecutive micro-batches with identical shapes, at most `forward_group` long:
        the no-grad forward pushes each run through a block as one batch, so the block's weights
        are read from memory once per run instead of once per micro-batch."""
        groups: list[list[int]] = []
        for m, mb in enumerate(micro_batches):
            if groups and len(groups[-1]) < self.forward_group and _shapes(mb) == _shapes(micro_batches[groups[-1][0]]):
                groups[-1].append(m)
            else:
                groups.append([m])
        return groups

    def _forward(
        self, micro_batches: list[dict[str, Any]], keep_from: int | None, then=(), fuse: bool = True
    ) -> tuple[list[BlockInputs] | None, list, list]:
        """Chunk-outer forward without grad, micro-batches fused into groups (`fuse`). Returns each
        micro-batch's block inputs (for the backward's recompute; None when nothing is kept), the kept
        chunk inputs per micro-batch, and the final hidden state per micro-batch. `then`: the chunks
        needed after this pass, in order, which the loader may start on during the last chunk. Training with
        dropout, each kept chunk's random state per micro-batch is recorded for its recompute (see __init__)."""
        record = keep_from is not None and self.dropout and self.model.training
        self._random_states = {}
        measuring = any(m.training or not m.track_running_stats for m in self._batch_norms)
        fuse = fuse and not record and not measuring
        groups = self._groups(micro_batches) if fuse else [[m] for m in range(len(micro_batches))]
        n = len(self.chunks)
        self._use_codes(False)
        with torch.no_grad():
            with self._edges_loaded("prefix"):
                fused = [self.prefix(_concat([micro_batches[m] for m in g])) for g in groups]
                inputs = self._recompute_inputs(micro_batches, groups, fused) if keep_from is not None else None
            hidden = [x.hidden for x in fused]
            fused = [BlockInputs(None, x.args, x.kwargs) for x in fused]  # each state let go as its chunk replaces it
            kept: list[list[torch.Tensor] | None] = [None] * n
            for c in range(n):
                self._install(c, [*range(c + 1, n), *then])
                start = time.perf_counter()
                if keep_from is not None and c >= keep_from:
                    kept[c] = [
                        piece for h, g in zip(hidden, groups) for piece in self._keep(h).split(_sizes(micro_batches, g))
                    ]
                outputs = []
                for m, (h, x) in enumerate(zip(hidden, fused)):
                    if record and c >= keep_from:  # the recompute draws from here again (backward_chunks)
                        self._random_states[(c, m)] = self._random_state()
                    outputs.append(self._run_chunk(c, h, x))
                hidden = outputs
                self.times.compute_s += time.perf_counter() - start
        final = [piece for h, g in zip(hidden, groups) for piece in h.split(_sizes(micro_batches, g))]
        return inputs, kept, final

    def _recompute_inputs(
        self, micro_batches: list[dict[str, Any]], groups: list[list[int]], fused: list[BlockInputs]
    ) -> list[BlockInputs]:
        """What each micro-batch's blocks are called with besides their hidden state, for the backward's recompute
        (which starts each chunk from its kept input): the forward's prefix runs where each group is one micro-batch
        (groups are runs of consecutive micro-batches, so they are then the micro-batches in order), else the prefix
        run again for each. No hidden state is held: kept until the step's end, it would be a micro-batch's
        activations on the device that nothing reads."""
        ran = fused if all(len(g) == 1 for g in groups) else map(self.prefix, micro_batches)
        return [BlockInputs(None, x.args, x.kwargs) for x in ran]

    # -- what callers use ----------------------------------------------------------------------
    def split(self, batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """A macro-batch as micro-batches of `micro_batch` samples, moved to the device."""
        size = self.micro_batch or next(iter(batch.values())).shape[0]
        pieces = {k: v.split(size) for k, v in batch.items()}
        return [{k: v[i].to(self.device) for k, v in pieces.items()} for i in range(len(next(iter(pieces.values()))))]

    def train_step(self, micro_batches: list[dict[str, Any]]) -> torch.Tensor:
        """Forward and backward over M micro-batches; gradients of trainable parameters accumulate
        as they would for sum(loss_m / M).backward(). Returns the mean loss (detached)."""
        loss = self.forward_train(micro_batches)
        self.backward_chunks()
        return loss

    def _backward_order(self) -> list[int]:
        """The chunks the backward loads, in order: the last one is still resident unless edges stream."""
        last = len(self.chunks) - 1
        return list(range(last if self.edges else last - 1, self.lowest_chunk - 1, -1))

    def forward_train(
        self,
        micro_batches: list[dict[str, Any]],
        loss_scale: float | torch.Tensor = 1.0,
        total_tokens: int | None = None,
        row_weights: list[list[int]] | None = None,
    ) -> torch.Tensor:
        """The forward half of a step: chunk-outer forward keeping chunk inputs, then each micro-batch's
        loss backpropagated to its last hidden state. What that backward gives the weights it passes (a classifier's
        head, a DiT's output layers) is held by the engine until `backward_chunks`, so an optimizer's zero_grad in
        between (Lightning's automatic optimization zeroes after the training step, before its backward) changes
        nothing. `loss_scale` is fp16's loss scale (on the device); `total_tokens` the
        target tokens of the whole global batch when several processes share it (default: these);
        `row_weights`: per micro-batch, what each row's loss averages over (target tokens) as the host counted
        them, so that no micro-batch's or suffix piece's weight is read from the device (a wait on a GPU)."""
        # the loader reads the backward's first chunks while the forward's last one computes
        inputs, kept, hidden = self._forward(
            micro_batches, keep_from=self.lowest_chunk, then=[] if self.edges else self._backward_order()
        )
        grads, losses = [], []
        # Each micro-batch's mean loss weighs by its share of the macro-batch's target tokens, so the
        # gradient is the whole macro-batch's, whatever the micro-batch size.
        counts = None if row_weights is None else [sum(rows) for rows in row_weights]
        weights = token_weights(micro_batches, total_tokens, self.objective.weight, counts)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        earlier = [p.grad for p in trainable]  # set aside: the suffix's gradients are taken alone
        for p in trainable:
            p.grad = None
        try:
            with self._suffix_phase():
                start = time.perf_counter()
                for m, (h, mb, w) in enumerate(zip(hidden, micro_batches, weights)):
                    h = h.detach().requires_grad_(True)
                    if w == 0:  # no target tokens: nothing to learn from (its mean loss is 0/0), and no backward
                        grads.append(None)
                        continue
                    step = self.suffix_rows or h.shape[0]
                    pieces = [{k: v[a : a + step] for k, v in mb.items()} for a in range(0, h.shape[0], step)]
                    rows = None if row_weights is None else row_weights[m]
                    counted = None if rows is None else [sum(rows[a : a + step]) for a in range(0, h.shape[0], step)]
                    share = token_weights(pieces, weigh=self.objective.weight, counts=counted)  # its part of the mean
                    for a, piece, part in zip(range(0, h.shape[0], step), pieces, share):
                        if part:
                            loss = self.objective.loss(self.suffix(h[a : a + step], piece), piece)
                            (loss * (loss_scale * w * part)).backward()
                            losses.append(loss.detach() * (w * part))
                    grads.append(h.grad)
                self.times.compute_s += time.perf_counter() - start
            suffix_grads = [(p, p.grad) for p in trainable if p.grad is not None]
        finally:
            for p, grad in zip(trainable, earlier):
                p.grad = grad
        if self.edges:
            self._prefetch(self._backward_order())
        self._pending_backward = (inputs, kept, grads, suffix_grads)
        return torch.stack(losses).sum() if losses else torch.zeros((), device=self.device)

    def backward_chunks(self) -> None:
        """The backward half: chunks in reverse down to the lowest trainable one, recomputing each.
        The lowest stays resident and the loader starts on the next forward's first chunks: the next
        step, a validation or a generation all begin at chunk 0, so the resident chunk is reused only
        when it is chunk 0."""
        inputs, kept, grads, suffix_grads = self._pending_backward
        self._pending_backward = None
        for p, grad in suffix_grads:  # what the suffix's backward gave, added as autograd would have
            p.grad = grad if p.grad is None else p.grad.add_(grad)
        learning = [m for m, grad in enumerate(grads) if grad is not None]  # micro-batches with target tokens
        last = len(self.chunks) - 1
        for c in range(last, self.lowest_chunk - 1, -1):
            upcoming = range(c - 1, self.lowest_chunk - 1, -1) if c > self.lowest_chunk else range(len(self.chunks))
            self._install(c, upcoming)
            start = time.perf_counter()
            for m in learning:
                x = kept[c][m].to(self.device, non_blocking=True).detach().requires_grad_(c > self.lowest_chunk)
                with torch.enable_grad(), self._statistics_kept():
                    y = self._run_chunk(c, x, inputs[m], self._random_states.pop((c, m), None))
                y.backward(grads[m])
                grads[m] = x.grad
            kept[c] = None
            self.times.compute_s += time.perf_counter() - start

    def outputs(self, micro_batches: list[dict[str, Any]]) -> list[Any]:
        """Streamed forward only: each micro-batch's output (a classifier's logits, which its metrics read)."""
        inputs, _, hidden = self._forward(micro_batches, keep_from=None, then=self._after_suffix())
        with torch.no_grad(), self._suffix_phase():
            out = [self.suffix(h, mb) for h, mb in zip(hidden, micro_batches)]
        self._prefetch(range(len(self.chunks)))
        return out

    def loss(self, micro_batches: list[dict[str, Any]]) -> list[torch.Tensor]:
        """Streamed forward only: each micro-batch's loss."""
        with torch.no_grad():
            return [self.objective.loss(out, mb) for out, mb in zip(self.outputs(micro_batches), micro_batches)]

    def evaluate(
        self,
        batches: list[dict[str, torch.Tensor]],
        pass_tokens: int | None = None,
        group_tokens: int | None = None,
        suffix_rows: int | None = None,
    ) -> tuple[float, int]:
        """Loss over a whole held-out set, chunk-outer: every chunk is loaded once per pass, and a pass
        holds as many samples as `pass_tokens` allows (all of them, for a validation set that fits).

        Samples are taken out of their batches, sorted by length and re-batched into groups of at most
        `group_tokens` tokens (one matmul each, per block); the loss runs `suffix_rows` rows at a time
        (the logits are the large tensor there). Returns (sum of loss x target tokens, target tokens):
        the token-weighted mean is the same as the resident model's over the same batches."""
        # a row without target tokens adds nothing to the resident loss's token-weighted mean; an all-padding one,
        # cut to no tokens, would be a group of width 0 that the blocks cannot reshape
        rows = [row for batch in batches for row in _rows(batch) if bool((row["labels"][1:] != -100).any())]
        rows.sort(key=lambda r: -r["input_ids"].shape[0])
        longest = rows[0]["input_ids"].shape[0] if rows else 1
        suffix_rows = suffix_rows or self.suffix_rows or self.micro_batch or 1
        # one matmul per block per group: what the training forward fuses, never less than a micro-batch
        group_tokens = group_tokens or self.forward_group * (self.micro_batch or suffix_rows) * longest
        # no budget: the whole set in one pass, measured as _packed measures a pass (rows x longest, padded)
        pass_tokens = max(pass_tokens or self.eval_tokens or len(rows) * longest, group_tokens)
        wide = torch.float32 if self.device.type == "mps" else torch.float64  # MPS has no float64
        total, count = torch.zeros((), dtype=wide, device=self.device), 0
        for rows_in_pass in _packed(rows, pass_tokens):
            groups = [_pad(g) for g in _packed(rows_in_pass, group_tokens)]
            # each piece's target tokens counted here, on the host: read from the device, each is a wait for the GPU
            tokens = [[target_tokens(piece) for piece in _pieces(g, suffix_rows)] for g in groups]
            groups = [{k: v.to(self.device) for k, v in g.items()} for g in groups]
            _, _, hidden = self._forward(groups, keep_from=None, then=self._after_suffix(), fuse=False)
            with torch.no_grad(), self._suffix_phase():
                start = time.perf_counter()
                for h, group, counts in zip(hidden, groups, tokens):
                    for s, piece, n in zip(range(0, h.shape[0], suffix_rows), _pieces(group, suffix_rows), counts):
                        if n:  # the sum stays on the device: one read for the whole held-out set
                            total += self.suffix(h[s : s + suffix_rows], piece).loss.to(wide) * n
                            count += n
                self.times.compute_s += time.perf_counter() - start
            self._prefetch(range(len(self.chunks)))
        return float(total), count

    def _after_suffix(self) -> range:
        """The chunks a forward-only pass may load ahead during its last chunk: the next pass's first ones, unless
        the edges stream (the suffix's head then takes the device on its own; they are loaded ahead after it)."""
        return range(0 if self.edges else len(self.chunks))

    @torch.no_grad()
    def decode_step(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache,
        last: bool = False,
    ) -> torch.Tensor:
        """One forward with a KV cache (the prompts' prefill, or one new token per sequence): every chunk is
        loaded once for all the rows. Returns the last position's logits (batch x vocab, float32). `last`: no
        step follows, so the loader does not start on the first chunk again (task=serve runs this step by
        step, adding and dropping rows between steps)."""
        batch = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "past_key_values": cache,
            "use_cache": True,
        }
        self._use_codes(True)
        with self._edges_loaded("prefix"):
            block_inputs = self.prefix(batch)
        hidden = block_inputs.hidden
        block_inputs = BlockInputs(None, block_inputs.args, block_inputs.kwargs)  # the state let go as chunk 0 reads it
        n = len(self.chunks)
        for c in range(n):
            # after the last chunk the first is next (next token), unless the edges come between
            after = [] if (self.edges or last) else range(c)
            self._install(c, [*range(c + 1, n), *after])
            start = time.perf_counter()
            hidden = self._run_chunk(c, hidden, block_inputs)
            self.times.compute_s += time.perf_counter() - start
        with self._suffix_phase():
            # only the last position's logits are needed; a contiguous [batch, 1, hidden] keeps the
            # head a plain matmul (a strided slice sends torch's linear through bmm, which copies
            # the head's weight once per sequence: 8 GB and a minute for Phi-4's at batch 8)
            out = self.suffix(
                hidden[:, -1:, :].contiguous(),
                {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids},
                logits_to_keep=1,
                use_cache=False,
            )
        return out.logits[:, -1, :].float()

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        max_new_tokens: int,
        eos_token_id: int | list[int] | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        on_token=None,
    ) -> torch.Tensor:
        """Batched generation with a KV cache: every chunk load serves every sequence, per token.
        Prompts are left-padded; returns the new tokens (batch x steps). A row ends at any of the end ids
        (`eos_token_id`, one or a list as transformers takes it) and repeats the first after it; generation stops
        when every row has ended."""
        from transformers import DynamicCache

        config = getattr(self.model, "config", None)
        cache = DynamicCache(config=config) if config is not None else DynamicCache()
        ids, mask = input_ids.to(self.device), attention_mask.to(self.device)
        done = torch.zeros(ids.shape[0], dtype=torch.bool, device=self.device)
        listed = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
        ends = torch.tensor(listed, dtype=torch.long, device=self.device)
        new_tokens = []
        step_ids = ids
        for step in range(max_new_tokens):
            position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1] :]
            logits = self.decode_step(step_ids, mask, position_ids, cache, last=step == max_new_tokens - 1)
            token = _pick(logits, temperature, top_p)
            if listed:
                token = torch.where(done, ends[0], token)
                done |= torch.isin(token, ends)
            new_tokens.append(token)
            if on_token is not None:
                on_token(token)
            step_ids = token[:, None]
            mask = torch.cat([mask, torch.ones_like(step_ids)], dim=1)
            if listed and bool(done.all()):
                break
        return torch.stack(new_tokens, dim=1)

    def reset(self) -> None:
        """Drop a failed step's state (loads in flight, the resident chunk, kept activations) so it can be retried."""
        self._drain()  # a load that ran out of memory alongside the step is dropped too
        self.release()
        self._pending_backward = None

    def _drain(self) -> None:
        """Wait for the loads in flight and drop them, their slots given back. A load that failed is dropped with
        its error: no pass reads its chunk now (a pass that needs it loads it again, and meets the error there),
        so a load ahead for a step that never came does not turn a finished run (close) into a crash."""
        try:
            for future, _ in self._pending.values():
                future.exception()
        finally:
            self._free += [slot for _, slot in self._pending.values() if slot is not None]
            self._pending.clear()

    def close(self) -> None:
        """Wait for loads in flight, give the resident chunk back and stop the loader thread; the next
        load starts it again."""
        self._drain()
        self.release()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


def check_blocks_stand_alone(blocks: Sequence[nn.Module]) -> None:
    """Refuse blocks that take state the first block computed (T5, mT5, LongT5, Switch Transformers: the first
    block alone has a relative attention bias, whose values its stack hands to the others), which streaming cannot
    hand along: the engine replays each block with the first block's arguments, and T5 failed mid-step with
    "'weight' must be 2-D" or an unpacking error. A bias the model computes once for all blocks (MPT's ALiBi) is
    among those arguments, and streams."""

    def computes_bias(block: nn.Module) -> bool:
        return any(getattr(m, "has_relative_attention_bias", False) is True for m in block.modules())

    if len(blocks) > 1 and computes_bias(blocks[0]) and not computes_bias(blocks[1]):
        raise UserError(
            f"this model's first block ({type(blocks[0]).__name__}) computes the position bias the other blocks take "
            "from it, which layer streaming cannot pass along: train it without streaming (strategy=lora or full)."
        )


def check_router_loss(model: nn.Module) -> None:
    """Refuse a mixture of experts set to add its router's load-balancing loss (output_router_logits: Mixtral,
    Qwen2-MoE): the suffix's forward runs the blocks as stubs, so no router logits are recorded, and transformers'
    load_balancing_loss_func failed mid-step with an IndexError on the empty tuple."""
    config = getattr(model, "config", None)
    configs = [config, config.get_text_config()] if hasattr(config, "get_text_config") else [config]
    if any(getattr(c, "output_router_logits", False) is True for c in configs):
        name = getattr(config, "model_type", None) or type(model).__name__
        raise UserError(
            f"model type {name} has output_router_logits=true, whose router auxiliary loss layer streaming does not "
            "compute: set model.architecture.output_router_logits=false (or false in the model folder's config.json), "
            "or train without layer streaming (strategy=lora)."
        )


def target_tokens(mb: dict[str, Any]) -> int:
    """Tokens a micro-batch's mean loss averages over: shifted labels that are not -100."""
    return int((mb["labels"][:, 1:] != -100).sum())


def token_weights(
    micro_batches: list[dict[str, Any]], total: int | None = None, weigh=None, counts: list[int] | None = None
) -> list[float]:
    """Each micro-batch's share of the target tokens of them all (or of `total`: a global batch's); `weigh`: what
    a micro-batch's mean loss averages over instead (Objective.weight); `counts`: those, counted on the host."""
    counts = counts if counts is not None else [(weigh or target_tokens)(mb) for mb in micro_batches]
    total = sum(counts) if total is None else total
    return [c / total if total else 0.0 for c in counts]


def _draws_masks(module: nn.Module) -> bool:
    """A module that draws dropout masks in training: a dropout layer of rate above 0, or an attention with a
    dropout rate (transformers' attentions drop inside the kernel they call)."""
    rate = module.p if isinstance(module, nn.Dropout) else getattr(module, "attention_dropout", 0.0)
    return isinstance(rate, int | float) and rate > 0


def _shapes(mb: dict[str, Any]) -> dict[str, tuple]:
    return {k: tuple(v.shape) for k, v in mb.items() if torch.is_tensor(v)}


def _concat(micro_batches: list[dict[str, Any]]) -> dict[str, Any]:
    if len(micro_batches) == 1:
        return micro_batches[0]
    return {
        k: torch.cat([mb[k] for mb in micro_batches]) if torch.is_tensor(v) else v for k, v in micro_batches[0].items()
    }


def _rows(batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """A batch's samples one by one, each cut to its attended length when it is right-padded."""
    out = []
    for r in range(batch["input_ids"].shape[0]):
        row = {k: v[r] for k, v in batch.items()}
        mask = row.get("attention_mask")
        if mask is not None:
            length = int(mask.sum())
            if bool(mask[:length].all()):  # right padding: the rest is padding
                row = {k: v[:length] for k, v in row.items()}
        out.append(row)
    return out


def _packed(rows: list[dict[str, torch.Tensor]], max_tokens: int) -> list[list[dict[str, torch.Tensor]]]:
    """Consecutive rows (longest first) in groups whose padded size, rows x longest, stays within max_tokens."""
    groups: list[list[dict[str, torch.Tensor]]] = []
    for row in rows:
        if groups and (len(groups[-1]) + 1) * groups[-1][0]["input_ids"].shape[0] <= max_tokens:
            groups[-1].append(row)
        else:
            groups.append([row])
    return groups


def _pieces(batch: dict[str, torch.Tensor], rows: int) -> list[dict[str, torch.Tensor]]:
    """A batch cut into pieces of `rows` rows (the last may have fewer)."""
    return [{k: v[s : s + rows] for k, v in batch.items()} for s in range(0, batch["input_ids"].shape[0], rows)]


def _pad(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Rows as one right-padded batch: padding is never attended to and never a target."""
    width = max(r["input_ids"].shape[0] for r in rows)
    fill = {"labels": -100, "attention_mask": 0}
    return {
        k: torch.stack([torch.nn.functional.pad(r[k], (0, width - r[k].shape[0]), value=fill.get(k, 0)) for r in rows])
        for k in rows[0]
    }


def _sizes(micro_batches: list[dict[str, Any]], group: list[int]) -> list[int]:
    return [len(next(iter(micro_batches[m].values()))) for m in group]


def _pick(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """The next token of each row: greedy at temperature 0, else sampled through transformers' own
    temperature and top-p warpers, the ones model.generate uses."""
    if not temperature:
        return logits.argmax(-1)
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

    warpers = LogitsProcessorList(
        [TemperatureLogitsWarper(temperature), *([TopPLogitsWarper(top_p)] if top_p < 1.0 else [])]
    )
    scores = warpers(None, logits)
    return torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator)[:, 0]


def _base_name(stored: str) -> str:
    """A stored tensor's weight name: int8's `.scale` and nf4's `.absmax`/`.shape` belong to their weight."""
    for suffix in (".scale", ".absmax", ".shape"):
        if stored.endswith(suffix):
            return stored.removesuffix(suffix)
    return stored


def _edge_phases(model: nn.Module, layer_map: LayerMap, edges: list[str]) -> dict[str, set[str]]:
    """Which streamed weights outside the blocks the prefix and the suffix use (a tied weight: both; one
    registered on no prefix or suffix module, to be safe: both)."""
    names = {id(p): n for n, p in model.named_parameters()}
    phases = {
        phase: {names[id(p)] for _, m in modules for p in m.parameters() if names.get(id(p)) in edges}
        for phase, modules in (("prefix", layer_map.prefix), ("suffix", layer_map.suffix))
    }
    unplaced = set(edges) - phases["prefix"] - phases["suffix"]
    return {phase: names_ | unplaced for phase, names_ in phases.items()}


@contextlib.contextmanager
def _swapped_paths(model: nn.Module, replacements: dict[str, nn.Module]):
    """Submodules replaced by dotted path for the body, put back after."""
    saved = {}
    try:
        for path, module in replacements.items():
            parent, _, child = path.rpartition(".")
            holder = model.get_submodule(parent) if parent else model
            saved[path] = (holder, child, holder._modules[child])
            holder._modules[child] = module
        yield
    finally:
        for holder, child, module in saved.values():
            holder._modules[child] = module
