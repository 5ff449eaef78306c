"""Layer streaming's plan: every combination of settings that fits the budget (and the disk), each with a
predicted step time; the fastest wins, the more precise store between two within 3% of each other (on a GPU
within GPU_TIE, then the one holding least device memory).

Settings: the store's dtype; its place (host memory, or disk with as many blocks cached in host memory as the
budget leaves room for); prefix/suffix resident or streamed; kept activations on the device or the host
(GPUs); the chunk size. Settings the config fixes (not `auto`) are taken as given.

A streamed step is sized as ONN's engine runs it. On a CPU: two slots of reused memory for the chunks in
flight (one computing, one loading: the disk read buffer, and the compute-dtype copy when the store's dtype
is not the compute dtype), the blocks of a disk store cached in host memory, prefix/suffix resident or
streamed, the kept chunk inputs of every micro-batch, one chunk's activations during recompute, LoRA state
for the sparse layer set only; its time is the longer of the disk's reads and the cores' compute plus the
loaders' decoding. On a GPU: see gpu_stream_memory and gpu_stream_timing.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from onn.dtypes import BYTES_PER_VALUE as DTYPE_BYTES
from onn.hardware.profile import Profile
from onn.planning.costs import (
    MB,
    MIXED_ACTIVATION_FACTOR,
    STREAM_HEAP_OVERHEAD,
    Estimate,
    activation_bytes,
    compute_s,
    kv_cache_elements,
    layer_activation_elements,
    matmul_rate,
    step_peak,
    threads_for,
    token_flops,
)
from onn.planning.spec import ModelSpec
from onn.streaming.schedule import (
    CAST_TILE_VALUES,
    cached_blocks,
    generates_from_codes,
    human_bytes,
    mlp_slices,
    smaller_store_dtypes,
)

# On a GPU, streamed settings predicted within this share of the fastest step count as equally fast, and
# the one holding the least device memory wins: the prediction's own error is about this large, and a step
# bound by the host link gains nothing from memory it leaves unused (which other work, or a larger
# batch, can have).
GPU_TIE = 0.10
CPU_TIE = 0.03  # on a CPU, settings within this share of the fastest: the more precise store wins
PRECISE_FIRST = ("float32", "bfloat16", "float16", "int8", "nf4")  # the tie-break between equally fast stores
STREAMING_KEYS = (
    "chunk_size",
    "store",
    "store_dtype",
    "edges",
    "activations",
    "cache_blocks",
    "eval_tokens",
    "mlp_tiles",
)
STREAMING_CHOICES = {
    "store": ("disk", "cpu"),
    "store_dtype": tuple(DTYPE_BYTES),
    "edges": ("resident", "stream"),
    "activations": ("device", "host"),
}
DISK_RESERVE = 2 * 1024**3  # what a store's build leaves free on the disk for others
# A GPU's streamed block may compute its gated MLP a slice of about this many intermediate features at a time
# (onn/streaming/tiled_mlp.py): Phi-4's 17,920 in five slices, or nine.
MLP_TILE_FEATURES = (4096, 2048)
# The hidden states per token a block's backward holds, past its sliced MLP, beyond the activations it keeps: the
# recomputed norms' float32 input, output and gradient, and the gradient of the block's input (fitted to tracked
# figures, gpu_stream_memory).
BACKWARD_TAIL_STATES = 7


@dataclass
class FixedStreaming:
    """The streaming settings the config fixes (not `auto`): the planner takes them as given; None: its choice."""

    chunk_size: int | None = None
    store: str | None = None
    store_dtype: str | None = None
    edges: str | None = None
    activations: str | None = None
    cache_blocks: int | None = None
    eval_tokens: int | None = None
    mlp_tiles: int | None = None


@dataclass
class StreamingPlan:
    """The chosen streaming setting with what the engine and the plan's reader need: plan.yaml's `streaming`."""

    chunk_size: int  # blocks loaded and computed together
    store: str  # cpu (host memory) or disk
    store_dtype: str  # the frozen weights' dtype in the store
    edges: str  # prefix/suffix resident or stream
    activations: str  # kept chunk inputs on the device or the host (GPUs)
    cache_blocks: int  # blocks of a disk store cached in host memory
    eval_tokens: int  # tokens validation holds hidden states for at once
    mlp_tiles: int  # slices a block's gated MLP computes in (1: whole)
    generate_batch: int  # sequences generated together
    generate_cache_blocks: int  # cached blocks while generating
    generate_sequence_mb: float  # memory each of generate_batch sequences is given
    generate_spare_mb: float  # left below one more cached block while generating
    block_mb: float  # one cached block
    suffix_rows: int  # rows whose loss (logits) runs at once
    compute_dtype: str  # the dtype the blocks compute in
    micro_batches_per_chunk: int
    threads: int  # torch's threads (CPUs)
    predicted_io_s: float
    predicted_compute_s: float
    predicted_decode_s: float
    predicted_disk_read_gb: float  # read from the disk per step
    predicted_h2d_gb: float  # copied to the GPU per step
    store_gb: float
    predicted_step_s: float
    refused: str | None = None  # why no disk store fits, in a sentence
    alternatives: list[dict[str, Any]] = field(default_factory=list)  # the fastest of every other store
    # the FLOP model's compute, which the alternatives were predicted on: kept when the model's own blocks, timed,
    # replace predicted_compute_s (onn/modalities/text/calibrate.py), to put the alternatives on the timed basis
    modelled_compute_s: float | None = None


@dataclass
class StreamShape:
    """What a streamed step's size depends on besides its settings: the model, machine, compute dtype and
    batch, the memory it may allocate, and what the config fixes and the disk already holds."""

    spec: ModelSpec
    hw: Profile
    cdtype: str
    seq: int
    micro_batch: int
    batch_size: int
    sparse_layers: list[int]
    per_token_layer: int
    logits: float  # bytes of one micro-batch's logits, their log-softmax and gradient
    prefetch: bool = True
    budget: float = 0.0  # bytes the step may allocate, its context left out
    fixed: FixedStreaming = field(default_factory=FixedStreaming)  # streaming settings the config fixes
    present: dict[str, int] = field(default_factory=dict)  # bytes of complete blocks on the disk, per store dtype
    where: str = "paths.cache"  # the store's folder, for a message
    precision: str = "32-true"  # Lightning's precision, which sizes the activations (costs.activation_bytes)
    states: int = 2  # the optimizer's state values per adapter weight (costs.optimizer_states): AdamW's two moments
    dropped: int = 0  # a trained block's input features whose LoRA dropout copy its recompute keeps (plan.lora_dropped)

    @property
    def on_gpu(self) -> bool:
        return self.hw.accelerator == "cuda"

    @property
    def n(self) -> int:
        return self.spec.n_blocks

    @property
    def lowest(self) -> int:
        return min(self.sparse_layers) if self.sparse_layers else self.spec.n_blocks

    @property
    def micro_batches(self) -> int:
        return max(1, -(-self.batch_size // self.micro_batch))

    @property
    def accumulates(self) -> bool:
        """Several micro-batches per step: their gradients outlive each backward (the estimate's `accumulates`)."""
        return self.batch_size > self.micro_batch

    @property
    def compute_bytes(self) -> int:
        return DTYPE_BYTES[self.cdtype]

    @property
    def lora(self) -> int:
        """LoRA parameters of the sparse layer set."""
        return sum(self.spec.lora_params_per_block[i] for i in self.sparse_layers)

    @property
    def edge(self) -> float:
        """The weights outside the blocks (embeddings, final norm, head) in the compute dtype, bytes."""
        return (self.spec.prefix_params + self.spec.suffix_params) * self.compute_bytes

    @property
    def host_room(self) -> float:
        """Host memory a GPU's store may take: 80% of what is available."""
        return (self.hw.host_memory_available_mb or self.hw.host_memory_mb or 0) * MB * 0.8

    def options(self, key: str, default: list) -> list:
        """A setting's candidates: the config's value when it fixes one, else `default`."""
        value = getattr(self.fixed, key)
        return default if value is None else [value]


@dataclass
class Setting:
    """One streaming setting that fits, with its predicted time and memory."""

    timing: dict[str, float]
    store_dtype: str
    store: str
    edges: str
    activations: str
    chunk: int
    cache: int
    memory: dict[str, float]


def peak(m: dict[str, float], accumulates: bool = False) -> float:
    """A setting's peak, as the estimate judges it (costs.step_peak)."""
    return step_peak(m["weights"], m["trainable"], m["optimizer"], m["activations"], m["workspace"], accumulates)


def resident(m: dict[str, float]) -> float:
    """What a setting holds besides a step's gradients and activations: weights, optimizer state, workspace."""
    return m["weights"] + m["optimizer"] + m["workspace"]


def cpu_stream_memory(
    s: StreamShape, sd: str, store: str, edges: str, activations: str, chunk: int, cache: int, decoded: bool = True
) -> dict[str, float]:
    """Host memory of a streamed step on a CPU (host memory is the device): a store held there counts in full,
    and so do cached blocks; two slots of reused memory (the disk read buffer, and the compute copy unless the
    CPU computes from the read buffer itself: a store in the compute dtype, or int8 codes generating)."""
    spec, n, cb = s.spec, s.n, s.compute_bytes
    files = block_bytes(spec, sd)
    zero_copy = sd == s.cdtype or not decoded
    held = sum(files) if store == "cpu" else cache * max(files)
    raw = max(files) if store == "disk" and cache < n else 0
    slots = 2 * chunk * (raw + (0 if zero_copy else max(spec.block_params) * cb))
    weights = held + slots + s.edge
    n_chunks = -(-n // chunk)
    # Kept per micro-batch: the input of every chunk from the lowest trainable one and the final hidden state
    # (the recompute takes the blocks' other arguments from the prefix, not its output).
    kept = (n_chunks - lowest_chunk(s.lowest, n, chunk) + 1) * s.micro_batches if activations == "device" else 1
    tokens = s.micro_batch * s.seq
    # the hidden states passed between chunks in the compute dtype; a chunk's saved activations as the precision keeps
    # them (under autocast with the norms' float32 values)
    act = activation_bytes(s.precision)
    block = (s.per_token_layer * act + s.dropped * (act + 1)) * tokens * chunk  # dropout: its copy and one-byte mask
    acts = kept * tokens * spec.hidden * cb + block + s.logits
    weights += s.lora * 4  # fp32 adapters
    trainable, optimizer = s.lora * 4, s.lora * 4 * s.states
    workspace = 0.05 * (weights - held + max(trainable, acts) + optimizer)
    if sd == s.cdtype and decoded:  # a zero-copy stream: glibc's heap keeps what it frees
        workspace += STREAM_HEAP_OVERHEAD * acts
    return {
        "weights": weights,
        "trainable": trainable,
        "optimizer": optimizer,
        "activations": acts,
        "workspace": workspace,
        "cached_block": max(files),
        "suffix_rows": s.micro_batch,
    }


def lowest_chunk(lowest: int, n: int, chunk: int) -> int:
    """The chunk holding block `lowest`, the lowest trainable one, as StreamingEngine.lowest_chunk counts it: the
    number of chunks when no block trains (`lowest` == n), even where `chunk` does not divide n."""
    return lowest // chunk if lowest < n else -(-n // chunk)


def step_loads(n_chunks: int, low: int, edges: str, prefix_on_device: bool = False) -> tuple[list[int], list[int]]:
    """The chunks a streamed training step loads in its steady state, forward and backward, as the engine runs
    it (StreamingEngine.forward_train, backward_chunks): the plans count these, so that what they charge is
    what the engine reads. `low`: the lowest chunk holding a trainable layer (n_chunks when none does).

    The previous step leaves its backward's last chunk, `low`, resident (the last chunk when nothing trains in
    the blocks, unless streamed edges' suffix gave it back); the prefix keeps it where its embeddings are looked
    up in host memory, but gives it back where streamed edges take other prefix weights to the device
    (`prefix_on_device`: ModelSpec.prefix_device_stores); the forward begins at chunk 0, so a kept chunk is
    reused only when it is chunk 0. The backward walks from the last chunk down to `low`, reusing the last one
    unless streamed edges' suffix gave it back."""
    last = n_chunks - 1
    kept = low if low < n_chunks else (last if edges == "resident" else None)
    if edges == "stream" and prefix_on_device:
        kept = None
    forward = [c for c in range(n_chunks) if not (c == 0 and kept == 0)]
    backward = list(range(last if edges == "stream" else last - 1, low - 1, -1))
    return forward, backward


def cpu_stream_timing(
    s: StreamShape, sd: str, store: str, edges: str, chunk: int, cache: int, tiles: int = 1
) -> dict[str, float]:
    """A streamed step's time on a CPU: the disk's reads (at its measured bandwidth) overlap the compute, and
    the loaders' decoding takes CPU time from the compute's cores. A gated MLP in slices (a fixed `tiles`; the
    plan keeps it whole on a CPU) computes its forward once more in each backward."""
    spec, hw, n = s.spec, s.hw, s.n
    files = block_bytes(spec, sd)
    chunks = [list(range(a, min(a + chunk, n))) for a in range(0, n, chunk)]
    low = lowest_chunk(s.lowest, n, chunk)
    forward, backward = step_loads(len(chunks), low, edges, sd in spec.prefix_device_stores)
    loads = [i for c in forward + backward for i in chunks[c]]
    cached = set(cached_blocks(n, cache, low * chunk if low < len(chunks) else n))
    disk = sum(files[i] for i in loads if store == "disk" and i not in cached)
    if edges == "stream" and store == "disk":
        disk += 2 * s.edge * DTYPE_BYTES[sd] / s.compute_bytes
    io = disk / MB / float(hw.disk_read_mb_s or 1000.0)
    decode = 0.0
    if sd != s.cdtype:
        rate = (hw.decode_gvalues_s or {}).get(f"{sd}->{s.cdtype}") or 1.0
        decode = sum(spec.block_params[i] for i in loads) / (rate * 1e9) / threads_for(hw)[1]
    compute = compute_s(
        spec,
        hw,
        "sparse_lora",
        s.seq,
        s.batch_size,
        s.micro_batch,
        s.sparse_layers,
        dtype=s.cdtype,
        forward_group=chunk,
    )
    if sliced_count(s, tiles) > 1:  # the MLP's matmuls once more, for each block the backward recomputes
        threads, share = threads_for(hw)
        flops = 6 * spec.hidden * spec.intermediate * s.batch_size * s.seq * (n - s.lowest)
        compute += flops / (matmul_rate(hw, s.cdtype, s.micro_batch * s.seq, threads) * share)
    cpu = compute + decode
    step = max(io, cpu) if s.prefetch else io + cpu
    return {
        "step": step,
        "io": io,
        "compute": compute,
        "decode": decode,
        "disk_bytes": disk,
        "h2d_bytes": 0.0,
    }


def stream_memory(
    s: StreamShape,
    sd: str,
    store: str,
    edges: str,
    activations: str,
    chunk: int,
    cache: int,
    decoded: bool = True,
    tiles: int = 1,
) -> dict[str, float]:
    if s.on_gpu:
        return gpu_stream_memory(s, sd, edges, activations, chunk, tiles)
    # a CPU's host memory holds a step's activations: sliced or not, the MLP's count in full
    return {**cpu_stream_memory(s, sd, store, edges, activations, chunk, cache, decoded), "mlp_tiles": tiles}


def stream_timing(
    s: StreamShape,
    setting_memory: dict[str, float],
    sd: str,
    store: str,
    edges: str,
    activations: str,
    chunk: int,
    cache: int,
) -> dict[str, float]:
    if s.on_gpu:
        rows, tiles = int(setting_memory["suffix_rows"]), int(setting_memory["mlp_tiles"])
        return gpu_stream_timing(s, sd, store, edges, activations, chunk, cache, rows, tiles)
    return cpu_stream_timing(s, sd, store, edges, chunk, cache, int(setting_memory["mlp_tiles"]))


def _cache(s: StreamShape, sd: str, store: str, m: dict[str, float]) -> int:
    """Blocks of a disk store held in host memory: on a CPU as many as the budget leaves room for; on a GPU
    as many as the host holds beside the run (pinned, read once); a fixed cache_blocks as given."""
    if store != "disk" or s.fixed.cache_blocks is not None:
        return int(s.fixed.cache_blocks or 0) if store == "disk" else 0
    if s.on_gpu:
        return int(min(s.n, s.host_room // max(block_bytes(s.spec, sd))))
    return int(min(s.n, max(0.0, s.budget - peak(m, s.accumulates)) // m["cached_block"]))


def candidates(s: StreamShape, dtypes: list[str]) -> tuple[list[Setting], list[tuple[str, int]]]:
    """Every setting that fits the budget, and (store dtype, bytes missing) for each disk store the disk
    refused. On a GPU the store sits in pinned host memory when the host has room for it, else on the disk."""
    found, refused = [], []
    disk_free = s.hw.disk_free_mb
    for sd in s.options("store_dtype", dtypes):
        missing = sum(block_bytes(s.spec, sd)) - s.present.get(sd, 0)
        disk_ok = disk_free is None or missing + DISK_RESERVE <= disk_free * MB
        for store, edges, act, tiles in layouts(s, sd):
            if store == "disk" and not disk_ok:
                refused.append((sd, missing))
                continue
            for chunk in sorted(s.options("chunk_size", chunk_sizes(s.n)), reverse=True):
                cache = _cache(s, sd, store, stream_memory(s, sd, store, edges, act, chunk, 0, tiles=tiles))
                m = stream_memory(s, sd, store, edges, act, chunk, cache, tiles=tiles)
                if peak(m, s.accumulates) <= s.budget:
                    found.append(
                        Setting(
                            stream_timing(s, m, sd, store, edges, act, chunk, cache),
                            sd,
                            store,
                            edges,
                            act,
                            chunk,
                            cache,
                            m,
                        )
                    )
    return found, refused


def layouts(s: StreamShape, sd: str) -> Iterator[tuple[str, str, str, int]]:
    """Every (store, edges, activations, MLP slices) a store of `sd` may take, as the config leaves them open. On a
    GPU the store sits in pinned host memory when the host has room for it, else on the disk."""
    in_host = sum(block_bytes(s.spec, sd)) <= s.host_room
    stores = (["cpu"] if in_host else ["disk"]) if s.on_gpu else ["cpu", "disk"]
    return itertools.product(
        s.options("store", stores),
        s.options("edges", ["resident", "stream"]),
        s.options("activations", ["device", "host"] if s.on_gpu else ["device"]),
        [sliced_count(s, t) for t in s.options("mlp_tiles", mlp_tile_counts(s))],
    )


def mlp_tile_counts(s: StreamShape) -> list[int]:
    """The slices a block's gated MLP may compute in: on a GPU whole, or each of MLP_TILE_FEATURES features at a
    time where it has more than the first (its activations, a decoder block's largest, then shrink by as much
    for one more pass of its matmuls in the backward); on a CPU whole (host memory holds a step's activations)."""
    if not (s.on_gpu and s.spec.gated_mlp and s.spec.intermediate > MLP_TILE_FEATURES[0]):
        return [1]
    return [1, *dict.fromkeys(-(-s.spec.intermediate // features) for features in MLP_TILE_FEATURES)]


def sliced_count(s: StreamShape, tiles: int) -> int:
    """The slices a block's MLP computes in when `tiles` are asked for, as the engine cuts them (1: the blocks
    have no gated MLP, or it is too narrow to cut)."""
    return len(mlp_slices(s.spec.intermediate, tiles)) if s.spec.gated_mlp else 1


def choose(s: StreamShape, found: list[Setting]) -> Setting | None:
    """The fastest setting (nf4, which costs precision, only when nothing else fits); between settings equally
    fast, the more precise store, and on a GPU then the one holding least of its memory."""
    usable = [f for f in found if f.store_dtype != "nf4"] or found
    if not usable:
        return None
    fastest = min(f.timing["step"] for f in usable)
    near = [f for f in usable if f.timing["step"] <= fastest * (1 + (GPU_TIE if s.on_gpu else CPU_TIE))]
    return min(
        near,
        key=lambda f: (
            PRECISE_FIRST.index(f.store_dtype),
            peak(f.memory, s.accumulates) if s.on_gpu else f.timing["step"],
        ),
    )


def smallest(s: StreamShape, dtypes: list[str]) -> Setting:
    """When nothing fits: the setting that holds the least, with no blocks cached, to report as not fitting. The
    smallest budget that works is named from it, so a budget of its peak fits it (one of the taken-for-smallest
    settings, with blocks cached to fill a budget, named a budget that was refused in turn, one MB short)."""
    sizes = [
        (stream_memory(s, sd, store, edges, act, chunk, 0, tiles=tiles), sd, store, edges, act, chunk)
        for sd in s.options("store_dtype", dtypes)
        for store, edges, act, tiles in layouts(s, sd)
        for chunk in s.options("chunk_size", chunk_sizes(s.n))
    ]
    m, sd, store, edges, act, chunk = min(sizes, key=lambda size: peak(size[0], s.accumulates))
    return Setting(stream_timing(s, m, sd, store, edges, act, chunk, 0), sd, store, edges, act, chunk, 0, m)


def disk_refusal(s: StreamShape, refused: list[tuple[str, int]]) -> str:
    """One sentence for a disk too small for any store the plan could take: what the smallest store needs, with the
    reserve and the shortfall (the rounded figures alone looked as if they fit), and a smaller store dtype only
    where there is one the plan did not try."""
    sd, missing = min(refused, key=lambda r: r[1])
    free, need = float(s.hw.disk_free_mb) * MB, missing + DISK_RESERVE
    smaller = [d for d in smaller_store_dtypes(sd) if d not in {r[0] for r in refused}]
    return (
        f"not enough disk for the layer store: {s.spec.name} as {sd} needs {human_bytes(missing)} more under "
        f"{s.where}, and {human_bytes(DISK_RESERVE)} must stay free for others: {human_bytes(need)} in all, but the "
        f"disk has {human_bytes(free)} free ({human_bytes(need - free)} short); set paths.cache (or ONN_CACHE) to a "
        "disk with room"
        + (f", or a smaller strategy.streaming.store_dtype ({', '.join(smaller)})." if smaller else ".")
    )


def generation(s: StreamShape, best: Setting) -> dict[str, Any]:
    """What validation and generation may hold beside the chosen setting. Validation holds every sample's
    hidden state (a block's input and output) for one pass. Generation (task=infer, exact match) reads the
    whole store once per token and computes little: one block at a time, and every byte the training's
    activations, adapters and larger chunks held goes to cached blocks instead, keeping room for
    `generate_batch` sequences (each a KV cache of its prompt and 64 new tokens, and a hidden state). From an
    int8 store's codes a CPU holds no decoded block, only one weight cast at a time for a prefill."""
    spec, m, cb = s.spec, best.memory, s.compute_bytes
    left = s.budget - resident(m)
    eval_tokens = s.fixed.eval_tokens
    if eval_tokens is None:
        eval_tokens = max(s.micro_batch * s.seq, min(1_000_000, left // (2 * spec.hidden * cb + 1)))
    new_tokens = 64
    length = s.seq + new_tokens
    per_sequence = (kv_cache_elements(spec, s.seq, new_tokens) + 2 * spec.hidden * length) * cb + spec.vocab * 4
    generate_batch = int(max(1, min(256, left // max(per_sequence, 1))))
    codes = not s.on_gpu and generates_from_codes(best.store_dtype, "cpu", s.cdtype)
    g = stream_memory(s, best.store_dtype, best.store, best.edges, best.activations, 1, 0, decoded=not codes)
    scratch = min(max(spec.block_params), 2 * spec.intermediate * spec.hidden) * cb if codes else 0
    room = s.budget - (g["weights"] - s.lora * 4) - 0.05 * g["weights"] - scratch - generate_batch * per_sequence
    on_host = best.store == "disk" and not s.on_gpu
    cache = int(min(s.n, max(0.0, room) // g["cached_block"])) if on_host else best.cache
    return {
        "eval_tokens": int(eval_tokens),
        "generate_batch": generate_batch,
        "generate_cache_blocks": cache,
        "generate_sequence_mb": round(per_sequence / MB, 3),  # what each of generate_batch sequences is given
        "generate_spare_mb": round(max(0.0, room - cache * g["cached_block"]) / MB, 3),  # below one more cached block
        "block_mb": round(g["cached_block"] / MB, 3),
    }


def estimate_streaming(s: StreamShape, dtypes: list[str], context_mb: float) -> Estimate:
    """The sparse_lora candidate: the chosen streaming setting's memory, with the settings and predictions
    the engine and the plan's reader need under `streaming`."""
    found, refused = candidates(s, dtypes)
    chosen = choose(s, found)
    refusal = disk_refusal(s, refused) if chosen is None and refused else None
    best = chosen or smallest(s, dtypes)
    t, m = best.timing, best.memory
    streaming = StreamingPlan(
        chunk_size=best.chunk,
        store=best.store,
        store_dtype=best.store_dtype,
        edges=best.edges,
        activations=best.activations,
        cache_blocks=best.cache,
        mlp_tiles=int(m["mlp_tiles"]),
        **generation(s, best),
        suffix_rows=int(m["suffix_rows"]),
        compute_dtype=s.cdtype,
        micro_batches_per_chunk=s.micro_batches,
        threads=threads_for(s.hw)[0],
        predicted_io_s=round(t["io"], 3),
        predicted_compute_s=round(t["compute"], 3),
        predicted_decode_s=round(t["decode"], 3),
        predicted_disk_read_gb=round(t["disk_bytes"] / 2**30, 2),
        predicted_h2d_gb=round(t["h2d_bytes"] / 2**30, 2),
        store_gb=round(sum(block_bytes(s.spec, best.store_dtype)) / 2**30, 2),
        predicted_step_s=round(t["step"], 3),
        refused=refusal,
        alternatives=alternatives(found, best),
        modelled_compute_s=round(t["compute"], 3),
    )
    est = Estimate(
        "sparse_lora",
        False,
        s.micro_batch,
        m["weights"] / MB,
        m["trainable"] / MB,
        m["optimizer"] / MB,
        m["activations"] / MB,
        m["workspace"] / MB,
        context_mb,
        streaming=streaming,
        note=f"streams {best.chunk} block(s) at a time, frozen weights stored as {best.store_dtype}"
        + (f", each gated MLP in {best.memory['mlp_tiles']} slices" if best.memory["mlp_tiles"] > 1 else ""),
        accumulates=s.accumulates,
    )
    est.fits = chosen is not None  # candidates judged it against the budget, by the estimate's own formula
    return est


def alternatives(found: list[Setting], best: Setting) -> list[dict[str, Any]]:
    """The fastest setting of every other store dtype and place, fastest first."""
    seen: dict[tuple, dict[str, Any]] = {}
    for f in sorted(found, key=lambda f: f.timing["step"]):
        key = (f.store_dtype, f.store)
        if f is not best and key != (best.store_dtype, best.store) and key not in seen:
            seen[key] = {
                "store_dtype": f.store_dtype,
                "store": f.store,
                "edges": f.edges,
                "chunk_size": f.chunk,
                "cache_blocks": f.cache,
                "predicted_step_s": round(f.timing["step"], 2),
                "predicted_io_s": round(f.timing["io"], 3),
                "predicted_compute_s": round(f.timing["compute"], 3),
                "predicted_decode_s": round(f.timing["decode"], 3),
            }
    return list(seen.values())


def store_dtypes(hw: Profile, precision: str) -> list[str]:
    """Frozen-weight storage for streaming, most precise first: the compute dtype itself (a CPU then
    computes straight from the read buffer), a 2-byte float under a float32 compute (half the bytes,
    lossless for weights that were bf16), ONN's int8. nf4 is for when nothing else fits."""
    if hw.accelerator == "cuda":
        return ["bfloat16" if hw.bf16 else "float16", "int8", "nf4"]
    if precision == "32-true":
        return ["float32", "bfloat16", "int8", "nf4"]
    return ["bfloat16", "int8", "nf4"]


def block_bytes(spec: ModelSpec, store_dtype: str) -> list[int]:
    """Each block's file size in a store of `store_dtype` (small tensors stay float32 when quantized)."""
    small = spec.block_params[0] - spec.linear_params_per_block[0] if spec.linear_params_per_block else 0
    per_value = DTYPE_BYTES[store_dtype]
    return [
        int((p - small) * per_value + small * (4 if store_dtype in ("int8", "nf4") else per_value))
        for p in spec.block_params
    ]


def chunk_sizes(n: int) -> list[int]:
    sizes, c = [], 1
    while c <= max(1, n // 2):
        sizes.append(c)
        c *= 2
    return sizes


def gpu_stream_memory(
    s: StreamShape, sd: str, edges: str, activations: str, chunk: int, tiles: int = 1
) -> dict[str, float]:
    """Device memory of a streamed step on a GPU, as its peak phase holds it: a chunk computing (two chunks
    of blocks on the device, the one computing and the one copying in; an int8 store's as codes with one
    cast tile), or the suffix (the head's weights, the logits of `suffix_rows` rows at a time: as many as
    keep the suffix within what a chunk holds). With edges streamed no chunk is resident while the suffix
    runs; the embeddings are looked up in host memory and never come to the device. With the gated MLP in
    `tiles` slices, its activations (4 x intermediate per token, and their gradient) are a slice's, beside
    that slice's weights cast to the compute dtype."""
    spec, cb = s.spec, DTYPE_BYTES[s.cdtype]
    files = block_bytes(spec, sd)
    codes = sd == "int8"
    per_block = max(files) if codes or sd == s.cdtype else max(files) + max(spec.block_params) * cb
    tile = CAST_TILE_VALUES * cb if codes else 0
    slots = 2 * chunk * per_block + tile
    head = max(spec.suffix_params, spec.vocab * spec.hidden) * (DTYPE_BYTES[sd] if codes else cb) + tile
    tokens = s.micro_batch * s.seq
    n_chunks = -(-spec.n_blocks // chunk)
    kept = (
        (n_chunks - lowest_chunk(s.lowest, spec.n_blocks, chunk) + 1) * s.micro_batches
        if activations == "device"
        else 0
    )
    kept_bytes = kept * tokens * spec.hidden * cb
    # a chunk's recompute with grad (or the no-grad forward of `chunk` fused micro-batches: as large). The MLP's
    # four activations per intermediate feature are kept in the compute dtype (no float32 copies: the norms'
    # are counted with the rest of the block), and its backward adds about one more, its gradient. A sliced MLP
    # holds one slice's at a time, beside that slice's weights cast; past the slices, the backward of the block's
    # attention and recomputed norms holds BACKWARD_TAIL_STATES hidden states per token beside the rest, which is
    # the block's peak once the slices are narrow. Tracked on a CPU (a Phi-4 block with LoRA on its linears, int8
    # codes, norms recomputed as on a GPU; 512 to 4,096 tokens in 5, 9, 18 and 36 slices): this counts each of the
    # 17 sliced figures within 4%; at 128 x 16 tokens 457 MB in five slices (counts 450), 415 in nine (counts 415).
    mlp = 4 * spec.intermediate
    width = max((b - a for a, b in mlp_slices(spec.intermediate, tiles)), default=0)  # the widest slice
    if tiles == 1:
        held_mlp = (mlp * chunk + spec.intermediate) * tokens * cb
    else:  # the slice's activations and its gate, up and down weights cast, or the tail's hidden states
        held_mlp = max(5 * width * tokens + 3 * width * spec.hidden, BACKWARD_TAIL_STATES * spec.hidden * tokens) * cb
    recompute = (s.per_token_layer - mlp) * chunk * MIXED_ACTIVATION_FACTOR * tokens * cb + held_mlp
    recompute += s.dropped * chunk * tokens * (activation_bytes(s.precision) + 1)  # LoRA dropout's copy and mask
    # the hidden states a step passes along, one per micro-batch each (StreamingEngine._forward, forward_train,
    # backward_chunks): a chunk's forward holds every micro-batch's input and output, its backward their gradients
    # and the input brought back from the host, the suffix the final states and, as its backward reaches them, their
    # gradients. Kept on the device, the chunk inputs count the final states and the backward's gradients (the +1).
    state = tokens * spec.hidden * cb
    if activations == "host":
        chunk_edges = suffix_edges = 2 * s.micro_batches * state
    else:
        chunk_edges, suffix_edges = 0, s.micro_batches * state
    row_logits = s.logits / s.micro_batch
    lora = sum(spec.lora_params_per_block[i] for i in s.sparse_layers)
    if edges == "resident":
        weights = slots + (spec.prefix_params + spec.suffix_params) * cb
        rows = s.micro_batch
        acts = kept_bytes + max(recompute + chunk_edges, suffix_edges + rows * row_logits)
    else:  # the suffix's rows at a time: as many as keep it within what a chunk's phase holds
        room = slots + recompute + chunk_edges - head - suffix_edges
        rows = int(max(1, min(s.micro_batch, max(room, 64 * MB) // row_logits)))
        chunk_phase = (slots, kept_bytes + recompute + chunk_edges)
        weights, acts = max(chunk_phase, (head, kept_bytes + suffix_edges + rows * row_logits), key=sum)
    weights += lora * 4
    optimizer = lora * 4 * s.states
    workspace = 0.05 * (weights + acts + optimizer) + float(s.hw.cuda_workspace_mb or 0) * MB
    return {
        "weights": weights,
        "trainable": lora * 4,
        "optimizer": optimizer,
        "activations": acts,
        "workspace": workspace,
        "cached_block": max(files),
        "suffix_rows": rows,
        "mlp_tiles": tiles,
    }


def gpu_stream_timing(
    s: StreamShape,
    sd: str,
    store: str,
    edges: str,
    activations: str,
    chunk: int,
    cache: int,
    suffix_rows: int,
    tiles: int = 1,
) -> dict[str, float]:
    """A streamed step's time on a GPU. The copy of the next chunk over the host link (from pinned host
    memory; a disk store's uncached blocks read first) overlaps the current chunk's compute, so each half of
    the step (the forward's chunks, the backward's) takes the longer of its copies and its compute; the
    suffix, the edges' copy and the optimizer come on top. Compute: matmul FLOPs at the profile's measured
    rate for the dtype and rows, an int8 store's casts at the measured cast rate (one per use of a block:
    the forward of each fused group, the recompute and the backward of each micro-batch), and the measured
    framework time per block call."""
    spec, hw, n = s.spec, s.hw, s.spec.n_blocks
    files = block_bytes(spec, sd)
    chunks = [list(range(a, min(a + chunk, n))) for a in range(0, n, chunk)]
    low = lowest_chunk(s.lowest, n, chunk)
    forward, backward = step_loads(len(chunks), low, edges, sd in spec.prefix_device_stores)
    h2d = float(hw.h2d_mb_s or 10000.0) * MB
    disk_rate = float(hw.disk_read_mb_s or 1000.0) * MB
    cached = set(cached_blocks(n, cache, low * chunk if low < len(chunks) else n))

    def copy_s(cs: list[int]) -> float:
        blocks = [i for c in cs for i in chunks[c]]
        read = sum(files[i] for i in blocks if store == "disk" and i not in cached)
        return sum(files[i] for i in blocks) / h2d + read / disk_rate

    tokens = s.batch_size * s.seq
    kept = tokens * spec.hidden * DTYPE_BYTES[s.cdtype] * len(backward) * chunk if activations == "host" else 0
    compute = gpu_stream_compute(s, sd, chunk, suffix_rows, tiles)
    io_f, io_b = copy_s(forward), copy_s(backward) + kept / h2d
    embedding = spec.vocab * spec.hidden
    edges_io = max(spec.suffix_params, embedding) * DTYPE_BYTES[sd] / h2d if edges == "stream" else 0.0
    if s.prefetch:
        step = max(io_f, compute["forward"]) + max(io_b, compute["backward"])
    else:
        step = io_f + io_b + compute["forward"] + compute["backward"]
    step += compute["suffix"] + edges_io
    disk = sum(files[i] for c in forward + backward for i in chunks[c] if store == "disk" and i not in cached)
    copied = sum(files[i] for c in forward + backward for i in chunks[c]) + kept + edges_io * h2d
    return {
        "step": step,
        "io": io_f + io_b + edges_io,
        "compute": sum(compute.values()),
        "decode": 0.0,
        "disk_bytes": disk,
        "h2d_bytes": copied,
    }


def gpu_stream_compute(s: StreamShape, sd: str, chunk: int, suffix_rows: int, tiles: int = 1) -> dict[str, float]:
    """A streamed step's GPU compute in its three parts (see gpu_stream_timing); the suffix runs
    `suffix_rows` rows of a micro-batch at a time. A gated MLP in slices (`tiles` > 1) computes its forward
    once more in each backward (its casts do not grow: the slice's recompute casts what the backward uses)."""
    spec, hw, n = s.spec, s.hw, s.spec.n_blocks
    per_block, head = token_flops(spec, s.seq)
    linear = spec.linear_params_per_block or spec.block_params
    size = math.sqrt(max(linear) / 4)
    tokens, rows, lowest = s.batch_size * s.seq, s.micro_batch * s.seq, s.lowest
    groups = -(-s.micro_batches // chunk)  # the forward fuses up to `chunk` micro-batches

    def matmul(flops: float, m: float) -> float:
        return flops / matmul_rate(hw, s.cdtype, m, 1, size)

    cast_rate = float((hw.decode_gvalues_s or {}).get(f"int8->{s.cdtype}") or 0) * 1e9
    cast = (lambda values: values / cast_rate) if sd == "int8" and cast_rate else (lambda values: 0.0)
    calls = hw.block_call_s or {}
    lora = sum(spec.lora_params_per_block[i] for i in s.sparse_layers)
    bandwidth = float(hw.memory_gb_s or 0) * 1e9
    # the kernels around the matmuls (norms, rotary embedding, attention, activations, residuals) at the
    # profile's measured time per activation value
    elementwise = hw.activation_ns or {}
    values = layer_activation_elements(spec) * tokens * 1e-9
    again = tiles > 1  # the MLP's forward once more in the backward
    mlp_flops, mlp_values = 6 * spec.hidden * spec.intermediate * again, 4 * spec.intermediate * tokens * 1e-9 * again
    # the GPU's kernels and the host's launching of them (the measured framework time per block call) overlap:
    # nothing in a chunk's compute waits for the GPU, so each part takes the longer of the two
    forward = max(
        matmul(sum(per_block) * tokens, min(s.micro_batches, chunk) * rows)
        + cast(sum(linear) * groups)
        + elementwise.get("forward", 0.0) * values * n,
        calls.get("forward", 0.0) * n * groups,
    )
    backward = max(
        matmul((2 * sum(per_block[lowest:]) + mlp_flops * (n - lowest)) * tokens, rows)
        + cast(2 * sum(linear[lowest:]) * s.micro_batches)
        + (elementwise.get("train", 0.0) * values + elementwise.get("forward", 0.0) * mlp_values) * (n - lowest),
        calls.get("lora", 0.0) * (n - lowest) * s.micro_batches,
    )
    head_values = max(spec.suffix_params, spec.vocab * spec.hidden)
    pieces = s.micro_batches * -(-s.micro_batch // suffix_rows)
    suffix = max(
        matmul(2 * head * tokens, suffix_rows * s.seq)
        + cast(2 * head_values * pieces)
        + (28 * lora / bandwidth if bandwidth else 0.0),
        calls.get("step", 0.0) * pieces,
    )
    return {"forward": forward, "backward": backward, "suffix": suffix}


def network_stream_memory(
    spec: ModelSpec,
    batch: int,
    chunk: int,
    store: str,
    optimizer_bytes: int,
    store_dtype: str = "float32",
    cache: int = 0,
    precision: str = "32-true",
) -> dict:
    """Memory of a streamed step of a network (a denoiser, a recurrent stack), its blocks' frozen weights in a store
    of `store_dtype` (small tensors counted at that dtype too), the whole batch one micro-batch: two slots of `chunk`
    blocks (the one computing and the one loading: each block's file, and its float32 copy when the store holds
    another dtype), a host-memory store in full on a CPU (a disk store's `cache` blocks), the weights outside the
    blocks and what trains (its weights, gradients and optimizer state: AdamW's moments exist from the first
    optimizer step on), the input of every chunk kept for the backward, one chunk's activations while it is
    recomputed and the activations outside the blocks, with their gradients. A recurrence's backward steps through
    time, holding one step's gradients beside its saved activations, not a second copy of them. The heap keeps no
    freed activations: the engine holds glibc's mmap threshold for a network (Objective.hold_mmap_threshold),
    measured by recipe=bench_streamed_arch. Under a half or mixed `precision` activations take 2 bytes a value (as
    estimate() sizes a language model's) and the blocks compute from a copy of their weights in that dtype."""
    n = spec.n_blocks
    compute = network_compute_dtype(precision)
    act_bytes = DTYPE_BYTES[compute]  # estimate()'s act_bytes: 2 under a bf16 or 16 precision, mixed or true
    trained = sum(spec.lora_params_per_block) + spec.edge_trainable_params
    frozen = [p - t for p, t in zip(spec.block_params, spec.lora_params_per_block)]
    files = [int(f * DTYPE_BYTES[store_dtype]) for f in frozen]
    held = sum(files) if store == "cpu" else min(n, cache) * max(files)
    decoded = DTYPE_BYTES[compute] * max(frozen) if store_dtype != compute else 0
    weights = held + 2 * chunk * (max(files) + decoded) + 4 * (spec.params - sum(frozen) - trained) + 4 * trained
    lowest = lowest_chunk(min((i for i, t in enumerate(spec.lora_params_per_block) if t), default=n), n, chunk)
    kept = (-(-n // chunk) - lowest + 2) * spec.boundary_bytes * batch
    blocks = spec.block_activation_bytes or [0]
    outside = max(0, spec.sample_activation_bytes - sum(blocks)) * batch
    # the backward holds each saved activation's gradient beside it: twice what the forward saves (a recurrence's
    # blocks once: their backward walks the steps, one step's gradients at a time)
    inside = chunk * max(blocks) * batch * (1 if spec.recurrent_blocks else 2)
    activations = (kept + inside + 2 * outside) * act_bytes // 4  # the spec counts float32 values
    optimizer = trained * optimizer_bytes
    cached = set(cached_blocks(n, cache, lowest * chunk)) if store == "disk" else set(range(n))
    return {
        "weights": weights,
        "trainable": 4 * trained,
        "optimizer": optimizer,
        "activations": activations,
        "workspace": 0.05 * (weights - held + activations + optimizer),
        "store": sum(files),
        "read": network_step_reads(files, chunk, lowest, cached),  # by a steady-state step
    }


def network_step_reads(files: list[int], chunk: int, low: int, cached: set[int]) -> int:
    """Bytes a network's streamed step reads from the disk in its steady state: the uncached blocks of the
    chunks it loads (step_loads; a network's edges stay resident)."""
    chunks = [list(range(a, min(a + chunk, len(files)))) for a in range(0, len(files), chunk)]
    forward, backward = step_loads(len(chunks), low, "resident")
    return sum(files[i] for c in forward + backward for i in chunks[c] if i not in cached)


def network_compute_dtype(precision: str) -> str:
    """The dtype a streamed network's blocks compute in under Lightning's `precision`: a bf16 or 16 precision's
    (the engine autocasts the backward's recompute to it, as Lightning's autocast runs the forward), else float32."""
    if precision.startswith("bf16"):
        return "bfloat16"
    return "float16" if precision.startswith("16") else "float32"


def network_streaming(
    spec: ModelSpec,
    hw: Profile,
    batch: int,
    budget: float,
    fixed: FixedStreaming,
    optimizer_bytes: int,
    precision: str = "32-true",
) -> tuple[StreamingPlan, dict]:
    """A network's streaming setting: the store in host memory when all of it fits the budget, else on the disk;
    the largest chunk that fits (fewest loads); the memory of it, its activations at `precision`. Settings the
    config fixes are taken as given (the edges and eval_tokens do not apply: make_network_streaming_plan says so);
    the store's dtype is float32 unless fixed, and a disk store caches no blocks unless `cache_blocks` is fixed."""
    stores = [fixed.store] if fixed.store else ["cpu", "disk"]
    chunks = [fixed.chunk_size] if fixed.chunk_size else sorted(chunk_sizes(spec.n_blocks), reverse=True)
    sd, cache = fixed.store_dtype or "float32", int(fixed.cache_blocks or 0)
    options = [
        (s, c, network_stream_memory(spec, batch, c, s, optimizer_bytes, sd, cache if s == "disk" else 0, precision))
        for s in stores
        for c in chunks
    ]
    fitting = [o for o in options if peak(o[2]) <= budget]
    store, chunk, m = fitting[0] if fitting else options[-1]
    reads = 0 if store == "cpu" else m["read"]
    io = reads / MB / float(hw.disk_read_mb_s or 1000.0)
    compute = 3 * spec.sample_flops * batch / (float(hw.matmul_tflops or 1.0) * 1e12)
    plan = StreamingPlan(
        chunk_size=int(chunk),
        store=store,
        store_dtype=sd,
        edges="resident",
        activations=fixed.activations or "device",
        cache_blocks=min(spec.n_blocks, cache) if store == "disk" else 0,
        eval_tokens=0,
        mlp_tiles=1,
        generate_batch=0,
        generate_cache_blocks=0,
        generate_sequence_mb=0.0,
        generate_spare_mb=0.0,
        block_mb=round(max(spec.block_params) * DTYPE_BYTES[sd] / MB, 3),  # one cached block
        suffix_rows=batch,
        compute_dtype=network_compute_dtype(precision),
        micro_batches_per_chunk=1,
        threads=threads_for(hw)[0],
        predicted_io_s=round(io, 3),
        predicted_compute_s=round(compute, 3),
        predicted_decode_s=0.0,
        predicted_disk_read_gb=round(reads / 2**30, 3),
        predicted_h2d_gb=0.0,
        store_gb=round(m["store"] / 2**30, 3),
        predicted_step_s=round(max(io, compute), 3),
        refused=None if fitting else "no chunk of one block or more fits the budget",
    )
    return plan, m
