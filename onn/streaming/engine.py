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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from onn.errors import UserError
from onn.hardware.memory import return_large_frees_to_os
from onn.models.layers import LayerMap
from onn.streaming.store import LayerStore, stored_name


class _BlocksReached(Exception):
    def __init__(self, hidden: torch.Tensor, args: tuple, kwargs: dict):
        self.hidden, self.args, self.kwargs = hidden, args, kwargs


class _Capture(nn.Module):
    def forward(self, hidden, *args, **kwargs):
        raise _BlocksReached(hidden, args, kwargs)


class _Replay(nn.Module):
    """Stands in for a block: the first returns the streamed hidden state, the others pass it on."""

    def __init__(self, value: torch.Tensor | None, as_tuple: bool):
        super().__init__()
        self.value, self.as_tuple = value, as_tuple

    def forward(self, hidden, *args, **kwargs):
        out = self.value if self.value is not None else (hidden[0] if isinstance(hidden, tuple) else hidden)
        return (out,) if self.as_tuple else out


@dataclass
class BlockInputs:
    """What the model passes its blocks for one micro-batch: the hidden state and the rest."""

    hidden: torch.Tensor
    args: tuple
    kwargs: dict


@dataclass
class StepTimes:
    io_s: float = 0.0  # time the compute waited for weights (not hidden by prefetch)
    load_s: float = 0.0  # time spent loading weights, wherever it ran
    compute_s: float = 0.0
    loads: int = 0
    history: list[int] = field(default_factory=list)  # chunk indices in load order


class StreamingEngine:
    """Runs a LayerMap'd model with its blocks' frozen weights coming from a LayerStore."""

    def __init__(self, model: nn.Module, layer_map: LayerMap, store: LayerStore, chunk_size: int, device: torch.device | str = "cpu",
                 prefetch: bool = True, activations: str = "device", compute_dtype: torch.dtype | None = None,
                 micro_batch: int | None = None, forward_group: int | None = None, stream_edges: bool = False):  # fmt: skip
        n = len(layer_map)
        if not 1 <= chunk_size <= n:
            raise UserError(
                f"strategy.streaming.chunk_size must be between 1 and the model's {n} blocks (got {chunk_size})."
            )
        self.model, self.map, self.store = model, layer_map, store
        self.device = torch.device(device)
        self.prefetch, self.activations, self.micro_batch = prefetch, activations, micro_batch
        # A no-grad pass of g micro-batches through one block holds about what the recompute of one
        # micro-batch through a chunk holds, so fusing up to chunk_size of them costs no extra peak.
        self.forward_group = forward_group or chunk_size
        self.chunks = [list(range(s, min(s + chunk_size, n))) for s in range(0, n, chunk_size)]
        self.frozen = [
            [name for name, p in block.named_parameters() if not p.requires_grad]
            for block in layer_map.blocks
        ]
        self.compute_dtype = compute_dtype or next(
            p.dtype for p in layer_map.blocks[0].parameters() if not p.requires_grad
        )
        trainable = [
            i for i, block in enumerate(layer_map.blocks) if any(p.requires_grad for p in block.parameters())
        ]
        self.lowest_chunk = min(
            (c for c, ids in enumerate(self.chunks) if set(ids) & set(trainable)), default=len(self.chunks)
        )
        # stream_edges: the frozen weights outside the blocks (embeddings, final norm, head) live in
        # the store too and come to the device only for the prefix and the suffix, never beside a chunk.
        in_blocks = {id(p) for block in layer_map.blocks for p in block.parameters()}
        self.edges = (
            [n for n, p in model.named_parameters() if id(p) not in in_blocks and not p.requires_grad]
            if stream_edges
            else []
        )
        self.times = StepTimes()
        self._resident: int | None = None
        self._pending: dict[int, Future] = {}
        self._pool: ThreadPoolExecutor | None = None  # started on first use, again after close()
        self._copy_stream = torch.cuda.Stream() if self.device.type == "cuda" else None
        self._as_tuple = False
        self._pending_backward = None
        return_large_frees_to_os()

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
        if self.edges:
            params = dict(self.model.named_parameters())
            blocks["edges"] = {n: params[n].data for n in self.edges}
        self.store.fill(blocks)
        for i in range(len(self.map)):
            self._release_block(i)
        self._set_edges(None)

    def _set_edges(self, tensors: dict[str, torch.Tensor] | None) -> None:
        params = dict(self.model.named_parameters())
        for name in self.edges:
            params[name].data = (
                tensors[name] if tensors else torch.empty(0, dtype=self.compute_dtype, device=self.device)
            )

    @contextlib.contextmanager
    def _edges_loaded(self):
        """With stream_edges, load the prefix/suffix weights for the body (after giving the resident
        chunk back, so they never share the device with one); otherwise they are always there."""
        if not self.edges:
            yield
            return
        self.release()
        start = time.perf_counter()
        self._set_edges(self.store.decode(self.store.read("edges"), self.device, self.compute_dtype))
        self.times.load_s += time.perf_counter() - start
        self.times.io_s += time.perf_counter() - start
        try:
            yield
        finally:
            self._set_edges(None)

    def _release_block(self, i: int) -> None:
        params = dict(self.map.blocks[i].named_parameters())
        for name in self.frozen[i]:
            params[name].data = torch.empty(0, dtype=self.compute_dtype, device=self.device)

    def _read_chunk(self, c: int) -> dict[int, dict[str, torch.Tensor]]:
        """Read a chunk from the store onto the device (runs in the prefetch thread)."""
        start = time.perf_counter()
        out = {}
        for i in self.chunks[c]:
            tensors = self.store.read(i)
            if self._copy_stream is not None:
                with torch.cuda.stream(self._copy_stream):
                    out[i] = self.store.decode(tensors, self.device, self.compute_dtype, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._copy_stream)
                out[i]["__event__"] = event
            else:
                out[i] = self.store.decode(tensors, self.device, self.compute_dtype)
        self.times.load_s += time.perf_counter() - start
        return out

    def _schedule(self, c: int | None) -> None:
        if (
            c is None
            or not self.prefetch
            or c in self._pending
            or c == self._resident
            or not 0 <= c < len(self.chunks)
        ):
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="onn-prefetch")
        self._pending[c] = self._pool.submit(self._read_chunk, c)

    def _install(self, c: int, next_c: int | None = None) -> None:
        """Make chunk c resident (reusing it if it already is) and start loading next_c behind it."""
        if self._resident != c:
            if self._resident is not None:
                self.release()
            start = time.perf_counter()
            future = self._pending.pop(c, None)
            chunk = future.result() if future is not None else self._read_chunk(c)
            self.times.io_s += time.perf_counter() - start
            for i, tensors in chunk.items():
                event = tensors.pop("__event__", None)
                if event is not None:
                    torch.cuda.current_stream().wait_event(event)
                params = {stored_name(n): p for n, p in self.map.blocks[i].named_parameters()}
                for name, t in tensors.items():
                    params[name].data = t
            self._resident = c
            self.times.loads += 1
            self.times.history.append(c)
        self._schedule(next_c)

    def release(self) -> None:
        if self._resident is not None:
            for i in self.chunks[self._resident]:
                self._release_block(i)
            self._resident = None

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
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        inputs.setdefault("use_cache", False)  # a cache would grow again when a chunk is recomputed
        with self._swapped({0: _Capture()}):
            try:
                self.model(**inputs)
            except _BlocksReached as reached:
                return BlockInputs(reached.hidden, reached.args, reached.kwargs)
        raise RuntimeError("the model finished its forward without calling its first block")

    def suffix(self, hidden: torch.Tensor, batch: dict[str, Any], **extra):
        """Finish the model's forward from the last block's output (norm, head, loss)."""
        replay = {
            i: _Replay(hidden if i == len(self.map) - 1 else None, self._as_tuple)
            for i in range(len(self.map))
        }
        with self._swapped(replay):
            return self.model(**batch, **extra)

    def _run_chunk(self, c: int, hidden: torch.Tensor, inputs: BlockInputs) -> torch.Tensor:
        for i in self.chunks[c]:
            out = self.map.blocks[i](hidden, *inputs.args, **inputs.kwargs)
            self._as_tuple = isinstance(out, tuple)
            hidden = out[0] if self._as_tuple else out
        return hidden

    def _keep(self, t: torch.Tensor) -> torch.Tensor:
        return t.to("cpu", non_blocking=True) if self.activations == "host" and t.device.type != "cpu" else t

    def _groups(self, micro_batches: list[dict[str, Any]]) -> list[list[int]]:
        """Runs of consecutive micro-batches with identical shapes, at most `forward_group` long:
        the no-grad forward pushes each run through a block as one batch, so the block's weights
        are read from memory once per run instead of once per micro-batch."""
        groups: list[list[int]] = []
        for m, mb in enumerate(micro_batches):
            if (
                groups
                and len(groups[-1]) < self.forward_group
                and _shapes(mb) == _shapes(micro_batches[groups[-1][0]])
            ):
                groups[-1].append(m)
            else:
                groups.append([m])
        return groups

    def _forward(
        self, micro_batches: list[dict[str, Any]], keep_from: int | None
    ) -> tuple[list[BlockInputs] | None, list, list]:
        """Chunk-outer forward without grad, micro-batches fused into groups. Returns each micro-batch's
        block inputs (for the backward's recompute; None when nothing is kept), the kept chunk inputs
        per micro-batch, and the final hidden state per micro-batch."""
        groups = self._groups(micro_batches)
        with torch.no_grad():
            with self._edges_loaded():
                fused = [self.prefix(_concat([micro_batches[m] for m in g])) for g in groups]
                inputs = [self.prefix(mb) for mb in micro_batches] if keep_from is not None else None
            hidden = [x.hidden for x in fused]
            kept: list[list[torch.Tensor] | None] = [None] * len(self.chunks)
            for c in range(len(self.chunks)):
                self._install(c, c + 1 if c + 1 < len(self.chunks) else None)
                start = time.perf_counter()
                if keep_from is not None and c >= keep_from:
                    kept[c] = [
                        piece
                        for h, g in zip(hidden, groups)
                        for piece in self._keep(h).split(_sizes(micro_batches, g))
                    ]
                hidden = [self._run_chunk(c, h, x) for h, x in zip(hidden, fused)]
                self.times.compute_s += time.perf_counter() - start
        final = [piece for h, g in zip(hidden, groups) for piece in h.split(_sizes(micro_batches, g))]
        return inputs, kept, final

    # -- what callers use ----------------------------------------------------------------------
    def split(self, batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """A macro-batch as micro-batches of `micro_batch` samples, moved to the device."""
        size = self.micro_batch or next(iter(batch.values())).shape[0]
        pieces = {k: v.split(size) for k, v in batch.items()}
        return [
            {k: v[i].to(self.device) for k, v in pieces.items()}
            for i in range(len(next(iter(pieces.values()))))
        ]

    def train_step(self, micro_batches: list[dict[str, Any]]) -> torch.Tensor:
        """Forward and backward over M micro-batches; gradients of trainable parameters accumulate
        as they would for sum(loss_m / M).backward(). Returns the mean loss (detached)."""
        loss = self.forward_train(micro_batches)
        self.backward_chunks()
        return loss

    def forward_train(self, micro_batches: list[dict[str, Any]], loss_scale: float = 1.0) -> torch.Tensor:
        """The forward half of a step: chunk-outer forward keeping chunk inputs, then each micro-batch's
        loss backpropagated to its last hidden state (the engine's own tensors, so an optimizer's
        zero_grad in between changes nothing). `loss_scale` is fp16's loss scale."""
        last = len(self.chunks) - 1
        inputs, kept, hidden = self._forward(micro_batches, keep_from=self.lowest_chunk)
        # The backward's first chunk to load: the last one is still resident unless edges stream.
        first_back = last if self.edges else last - 1
        if not self.edges:
            self._schedule(first_back if first_back >= self.lowest_chunk else None)
        grads, losses = [], []
        # Each micro-batch's mean loss weighs by its share of the macro-batch's target tokens, so the
        # gradient is the whole macro-batch's, whatever the micro-batch size.
        weights = token_weights(micro_batches)
        with self._edges_loaded():
            start = time.perf_counter()
            for h, mb, w in zip(hidden, micro_batches, weights):
                h = h.detach().requires_grad_(True)
                if w == 0:  # no target tokens: nothing to learn from, and its mean loss is 0/0
                    grads.append(torch.zeros_like(h))
                    continue
                loss = self.suffix(h, mb).loss
                (loss * (loss_scale * w)).backward()
                grads.append(h.grad)
                losses.append(loss.detach() * w)
            self.times.compute_s += time.perf_counter() - start
        if self.edges:
            self._schedule(first_back if first_back >= self.lowest_chunk else None)
        self._pending_backward = (inputs, kept, grads)
        return torch.stack(losses).sum() if losses else torch.zeros((), device=self.device)

    def backward_chunks(self) -> None:
        """The backward half: chunks in reverse down to the lowest trainable one, recomputing each."""
        inputs, kept, grads = self._pending_backward
        self._pending_backward = None
        last = len(self.chunks) - 1
        for c in range(last, self.lowest_chunk - 1, -1):
            self._install(c, c - 1 if c - 1 >= self.lowest_chunk else None)
            start = time.perf_counter()
            for m in range(len(grads)):
                x = (
                    kept[c][m]
                    .to(self.device, non_blocking=True)
                    .detach()
                    .requires_grad_(c > self.lowest_chunk)
                )
                with torch.enable_grad():
                    y = self._run_chunk(c, x, inputs[m])
                y.backward(grads[m])
                grads[m] = x.grad
            kept[c] = None
            self.times.compute_s += time.perf_counter() - start
        self.release()

    def loss(self, micro_batches: list[dict[str, Any]]) -> list[torch.Tensor]:
        """Streamed forward only: each micro-batch's loss (for validation)."""
        inputs, _, hidden = self._forward(micro_batches, keep_from=None)
        with torch.no_grad(), self._edges_loaded():
            losses = [self.suffix(h, mb).loss for h, mb in zip(hidden, micro_batches)]
        self.release()
        return losses

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int, eos_token_id: int | None = None,
                 temperature: float = 0.0, top_p: float = 1.0, on_token=None) -> torch.Tensor:  # fmt: skip
        """Batched generation with a KV cache: every chunk load serves every sequence, per token.
        Prompts are left-padded; returns the new tokens (batch x steps)."""
        from transformers import DynamicCache

        config = getattr(self.model, "config", None)
        cache = DynamicCache(config=config) if config is not None else DynamicCache()
        ids, mask = input_ids.to(self.device), attention_mask.to(self.device)
        done = torch.zeros(ids.shape[0], dtype=torch.bool, device=self.device)
        new_tokens = []
        step_ids = ids
        for _ in range(max_new_tokens):
            position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1] :]
            batch = {
                "input_ids": step_ids,
                "attention_mask": mask,
                "position_ids": position_ids,
                "past_key_values": cache,
                "use_cache": True,
            }
            with self._edges_loaded():
                block_inputs = self.prefix(batch)
            hidden = block_inputs.hidden
            n = len(self.chunks)
            for c in range(n):
                # after the last chunk the first is next (next token), unless the edges come between
                self._install(c, c + 1 if c + 1 < n else (None if self.edges else 0))
                hidden = self._run_chunk(c, hidden, block_inputs)
            with self._edges_loaded():
                out = self.suffix(
                    hidden,
                    {"input_ids": step_ids, "attention_mask": mask, "position_ids": position_ids},
                    logits_to_keep=1,
                    use_cache=False,
                )
            logits = out.logits[:, -1, :].float()
            token = _pick(logits, temperature, top_p)
            if eos_token_id is not None:
                token = torch.where(done, torch.full_like(token, eos_token_id), token)
                done |= token == eos_token_id
            new_tokens.append(token)
            if on_token is not None:
                on_token(token)
            step_ids = token[:, None]
            mask = torch.cat([mask, torch.ones_like(step_ids)], dim=1)
            if eos_token_id is not None and bool(done.all()):
                break
        self._drain()
        self.release()
        return torch.stack(new_tokens, dim=1)

    def reset(self) -> None:
        """Drop a failed step's state (loads in flight, the resident chunk, kept activations) so it can be retried."""
        self._drain(raise_errors=False)  # a load that ran out of memory alongside the step is dropped too
        self.release()
        self._pending_backward = None

    def _drain(self, raise_errors: bool = True) -> None:
        try:
            for future in self._pending.values():
                if raise_errors:
                    future.result()
                else:
                    future.exception()
        finally:
            self._pending.clear()

    def close(self) -> None:
        """Wait for loads in flight and stop the loader thread; the next load starts it again."""
        self._drain()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


def target_tokens(mb: dict[str, Any]) -> int:
    """Tokens a micro-batch's mean loss averages over: shifted labels that are not -100."""
    return int((mb["labels"][:, 1:] != -100).sum())


def token_weights(micro_batches: list[dict[str, Any]]) -> list[float]:
    """Each micro-batch's share of the target tokens of them all."""
    counts = [target_tokens(mb) for mb in micro_batches]
    total = sum(counts)
    return [c / total if total else 0.0 for c in counts]


def _shapes(mb: dict[str, Any]) -> dict[str, tuple]:
    return {k: tuple(v.shape) for k, v in mb.items() if torch.is_tensor(v)}


def _concat(micro_batches: list[dict[str, Any]]) -> dict[str, Any]:
    if len(micro_batches) == 1:
        return micro_batches[0]
    return {
        k: torch.cat([mb[k] for mb in micro_batches]) if torch.is_tensor(v) else v
        for k, v in micro_batches[0].items()
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
