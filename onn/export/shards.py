"""Shard plans for .omny: split a model's ordered blocks into contiguous ranges that fit small GPUs.

Pure Python, no torch, so planning imports and runs fast. Two planners:

- `plan_shards`: for each allowed shard count, the contiguous partition whose largest shard (by weights) is
  smallest, with every shard's weights under `max_shard_size_mb` and weights + activations + headroom under
  `min_vram_mb`.
- `plan_nodes`: one contiguous range per listed node, sized in proportion to node memory (largest remainder);
  when blocks differ too much in size for that to fit, the exact contiguous assignment that minimises the
  largest memory utilisation.

Both are exact for the same reason: a range that fits still fits with a block removed from either end, so a
greedy sweep decides whether a bound can be met and a binary search over the bound finds the optimum.
"""

from __future__ import annotations

import math
import random
import time
from bisect import bisect_left, bisect_right
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from onn.config import ONNConfig
from onn.config.task import BenchShardPlanTask
from onn.errors import UserError

MB = 2**20
# The fleet this was designed for: 1.5 GB smallest GPU, shards of at most 1.2 GB of weights.
MAX_SHARD_SIZE_MB = 1200.0
MIN_VRAM_MB = 1500.0
HEADROOM_MB = 256.0


# What two blocks both count in their weight_bytes (a tied embedding: the prefix's table is the head's matrix):
# (a block, a later block reading the same weight, its bytes). A range holding both stores it once.
Shared = list[tuple[int, int, int]]


@dataclass(frozen=True)
class Block:
    """One entry of the document's ordered block list (prefix/embeddings, blocks, suffix/head)."""

    name: str
    weight_bytes: int
    activation_bytes: int  # peak activation bytes per sample at the reference shape while this block runs


class _Sizes:
    """Any range's weights (prefix sums, less what `shared` says two of its blocks both count) and peak activation
    (sparse table) in O(1), in bytes."""

    def __init__(self, blocks: list[Block], headroom_mb: float, batch_size: int, shared: Shared | None = None) -> None:
        self.n = len(blocks)
        self.pre = [0]
        for block in blocks:
            self.pre.append(self.pre[-1] + block.weight_bytes)
        self.common = _common_table(self.n, shared) if shared else None
        self.table = [[block.activation_bytes * batch_size for block in blocks]]
        span = 1
        while 2 * span <= self.n:
            row = self.table[-1]
            self.table.append([max(row[i], row[i + span]) for i in range(self.n - 2 * span + 1)])
            span *= 2
        self.headroom = headroom_mb * MB
        alone = [self.total(i, i + 1) for i in range(self.n)]
        self.by_size = sorted(range(self.n), key=lambda i: -alone[i])  # biggest block (alone) first
        self.alone = [alone[i] for i in self.by_size]

    def weight(self, start: int, end: int) -> int:
        """What the range stores: each weight once, however many of its blocks read it."""
        counted = self.pre[end] - self.pre[start]
        return counted - self.common[start][end] if self.common else counted

    def activation(self, start: int, end: int) -> int:
        level = (end - start).bit_length() - 1
        row = self.table[level]
        return max(row[start], row[end - (1 << level)])

    def total(self, start: int, end: int) -> float:
        return self.weight(start, end) + self.activation(start, end) + self.headroom

    def furthest(self, start: int, cap: float) -> int:
        """The largest end with [start, end) storing at most cap bytes (start when block start alone is over)."""
        if not self.common:
            return bisect_right(self.pre, self.pre[start] + cap, start + 1) - 1
        low, high = start, self.n  # weights only grow with the end: bisect on it
        while low < high:
            mid = (low + high + 1) // 2
            if self.weight(start, mid) <= cap:
                low = mid
            else:
                high = mid - 1
        return low

    def too_big(self, cap: float, bound: float) -> list[int]:
        """Blocks that alone exceed bound utilisation of a node with cap bytes, in block order."""
        count = bisect_left(self.alone, True, key=lambda total: total / cap <= bound)
        return sorted(self.by_size[:count])

    def reach(self, weight_cap: float, total_cap: float) -> list[int]:
        """For each start s, the furthest end e such that [s, e) fits both caps (e == s: block s alone does not).

        Ends only grow with the start (a fitting range minus its first block still fits), so one sweep does it.
        """
        n = self.n
        out = list(range(n))
        end = 0
        for start in range(n):
            end = max(end, start)
            while end < n and self.weight(start, end + 1) <= weight_cap and self.total(start, end + 1) <= total_cap:
                end += 1
            out[start] = end
        return out


def shard_memory(blocks: list[Block], start: int, end: int, headroom_mb: float, batch_size: int) -> dict:
    """Memory of the shard [start, end), unrounded: blocks run one after another, so activations peak, not add."""
    if not 0 <= start < end <= len(blocks):
        raise ValueError(f"shard [{start}, {end}) is not a non-empty range of the {len(blocks)} blocks")
    weight = sum(block.weight_bytes for block in blocks[start:end]) / MB
    activation = max(block.activation_bytes for block in blocks[start:end]) * batch_size / MB
    return {"weight_mb": weight, "activation_mb": activation, "total_mb": weight + activation + headroom_mb}


def plan_shards(
    blocks: list[Block],
    max_shard_size_mb: float = MAX_SHARD_SIZE_MB,
    min_vram_mb: float = MIN_VRAM_MB,
    headroom_mb: float = HEADROOM_MB,
    batch_size: int = 1,
    counts: list[int] | None = None,
    max_configs: int = 8,
    shared: Shared | None = None,
) -> list[dict]:
    """Balanced contiguous shard plans, one per allowed shard count (ascending), each fitting the smallest GPU.

    Without `counts`: every feasible count from the fewest shards that fit up to `max_configs` of them. `shared`:
    the weights blocks share, which a shard holding several of them stores once.
    """
    _check_common(blocks, headroom_mb, batch_size)
    if isinstance(max_configs, bool) or not isinstance(max_configs, int) or max_configs < 1:
        raise UserError(f"export.max_configs is {max_configs!r}; set it to a whole number of at least 1.")
    check_limits(max_shard_size_mb, min_vram_mb, headroom_mb)
    sizes = _Sizes(blocks, headroom_mb, batch_size, shared)
    weight_cap, total_cap = max_shard_size_mb * MB, min_vram_mb * MB
    for index in range(len(blocks)):
        _check_block(blocks, sizes, index, max_shard_size_mb, min_vram_mb, headroom_mb, batch_size)
    reach = sizes.reach(weight_cap, total_cap)
    n = len(blocks)
    # Fewest shards: extend each shard as far as it fits (optimal, since fitting ranges are closed under shrinking).
    k_min = _greedy_parts(sizes, reach, math.inf, n)
    # Any plan can be split further down to one block per shard, so exactly the counts k_min..n are feasible.
    if counts is None:
        wanted = list(range(k_min, min(n, k_min + max_configs - 1) + 1))
    else:
        wanted = sorted(set(counts))
        for k in wanted:
            if isinstance(k, bool) or not isinstance(k, int) or k < 1:
                raise UserError(
                    f"export.shard_counts has {k!r}, not a whole number of shards; use counts from {k_min} to {n}."
                )
            if k > n:
                raise UserError(
                    f"export.shard_counts has {k}, which is not feasible: the model has only {n} blocks and every "
                    f"shard needs at least one; use counts from {k_min} to {n}."
                )
            if k < k_min:
                raise UserError(
                    f"export.shard_counts has {k}, which is not feasible: under export.max_shard_size_mb="
                    f"{max_shard_size_mb:g} and export.min_vram_mb={min_vram_mb:g} (export.headroom_mb="
                    f"{headroom_mb:g}) the {n} blocks need at least {k_min} shards; "
                    f"use counts from {k_min} to {n} or raise those limits."
                )
    # Ascending counts: more shards never need a larger largest shard, so each optimum bounds the next search.
    plans, cap = [], sizes.weight(0, n)
    for k in wanted:
        ranges, cap = _balanced(sizes, reach, k, cap)
        plans.append(
            {
                "shards": k,
                "ranges": ranges,
                "weight_mb": [round(sizes.weight(s, e) / MB, 1) for s, e in ranges],
                "total_mb": [round(sizes.total(s, e) / MB, 1) for s, e in ranges],
            }
        )
    return plans


def plan_nodes(
    blocks: list[Block],
    nodes_mb: list[float],
    headroom_mb: float = HEADROOM_MB,
    batch_size: int = 1,
    shared: Shared | None = None,
) -> dict:
    """One contiguous range per node (in the given order), in proportion to node memory, every node within it.

    Proportional block counts come from the largest-remainder method; when blocks differ in size (big
    embeddings or heads) and that split overflows a node, the capacity-aware assignment with the smallest
    largest utilisation replaces it. "method" says which one produced the plan.
    """
    _check_common(blocks, headroom_mb, batch_size)
    if not nodes_mb:
        raise UserError("export.nodes is empty; list each node's memory in MB, e.g. [2048, 1536, 4096].")
    nodes = []
    for index, mem in enumerate(nodes_mb):
        if isinstance(mem, bool) or not isinstance(mem, int | float) or not mem > 0 or not math.isfinite(mem):
            raise UserError(f"export.nodes[{index}] is {mem!r}; each node's memory must be a positive number of MB.")
        nodes.append(mem)
    check_node_headroom(nodes, headroom_mb)
    n, m = len(blocks), len(nodes)
    if n < m:
        raise UserError(
            f"export.nodes lists {m} nodes but the model has only {n} blocks; list at most {n} nodes, "
            "since every node holds at least one block."
        )
    sizes = _Sizes(blocks, headroom_mb, batch_size, shared)
    counts = largest_remainder(n, nodes)
    ranges, start = [], 0
    for count in counts:
        ranges.append([start, start + count])
        start += count
    method = "largest_remainder"
    if any(sizes.total(s, e) > mem * MB for (s, e), mem in zip(ranges, nodes)):
        ranges = _capacity_plan(blocks, sizes, nodes, counts, headroom_mb)
        method = "capacity"
    totals = [sizes.total(s, e) for s, e in ranges]
    return {
        "nodes_mb": list(nodes),
        "ranges": ranges,
        "weight_mb": [round(sizes.weight(s, e) / MB, 1) for s, e in ranges],
        "total_mb": [round(total / MB, 1) for total in totals],
        "utilisation": [round(total / (mem * MB), 3) for total, mem in zip(totals, nodes)],
        "method": method,
    }


def check_limits(max_shard_size_mb: float, min_vram_mb: float, headroom_mb: float) -> None:
    """The shard limits, alone and together. plan_shards checks them as it plans, and check_settings with the same
    sentences before a model is loaded or trained. Infinity is refused: it is no limit, and not JSON."""
    for key, value in (("max_shard_size_mb", max_shard_size_mb), ("min_vram_mb", min_vram_mb)):
        if not (value > 0 and math.isfinite(value)):
            raise UserError(f"export.{key} is {value}; set it to a positive, finite number of MB.")
    _check_headroom(headroom_mb)
    if headroom_mb >= min_vram_mb:
        raise UserError(
            f"export.headroom_mb ({headroom_mb:g}) leaves no memory under export.min_vram_mb ({min_vram_mb:g}); "
            "lower export.headroom_mb or raise export.min_vram_mb."
        )


def check_node_headroom(nodes_mb: list[float], headroom_mb: float) -> None:
    """Every node holds at least one block, so a node with no memory above the headroom fits no plan: refused by
    plan_nodes and, before a model is loaded or trained, by check_settings, in the same sentence."""
    smallest = min(range(len(nodes_mb)), key=lambda i: (nodes_mb[i], i))
    if nodes_mb[smallest] <= headroom_mb:
        raise UserError(
            f"export.headroom_mb ({headroom_mb:g}) leaves no memory on export.nodes[{smallest}] "
            f"({nodes_mb[smallest]:g}); lower export.headroom_mb or give that node more memory."
        )


def largest_remainder(n: int, weights: list[float]) -> list[int]:
    """n items split in proportion to weights, exactly (Hamilton's method), then at least one each.

    Remainder ties go to the larger weight, then the earlier one; a node left empty takes one item from the
    node furthest above its quota.
    """
    exact = [Fraction(w) for w in weights]
    whole = sum(exact)
    quotas = [n * w / whole for w in exact]
    counts = [math.floor(q) for q in quotas]
    order = sorted(range(len(weights)), key=lambda i: (-(quotas[i] - counts[i]), -exact[i], i))
    for i in order[: n - sum(counts)]:
        counts[i] += 1
    for i in range(len(counts)):
        if counts[i] == 0:
            donor = max((j for j in range(len(counts)) if counts[j] > 1), key=lambda j: (counts[j] - quotas[j], -j))
            counts[donor] -= 1
            counts[i] = 1
    return counts


def bench(config: ONNConfig) -> dict:
    """Time the full planning of a synthetic model (task=bench_shard_plan); the sizes come from config.task."""
    task: BenchShardPlanTask = config.task
    n = task.blocks
    repeats = max(1, task.repeats)
    blocks = synthetic_blocks(
        n,
        seed=task.seed,
        block_mb=task.block_mb,
        jitter=task.jitter,
        embed_mb=task.embed_mb,
        head_mb=task.head_mb,
        activation_mb=task.activation_mb,
        head_activation_mb=task.head_activation_mb,
    )
    base = [float(x) for x in task.nodes_mb]
    # Scale the fleet to `fleet_slack` times what the model needs, so the plan is tight (as on a real small fleet).
    peak = max(block.activation_bytes for block in blocks) / MB
    need = sum(block.weight_bytes for block in blocks) / MB + len(base) * (HEADROOM_MB + peak)
    biggest = max(block.weight_bytes + block.activation_bytes for block in blocks) / MB + HEADROOM_MB
    # ... and at least so big that the smallest node holds any one block (every node holds at least one).
    scale = max(task.fleet_slack * need / sum(base), biggest / min(base))
    nodes = [round(mem * scale, 1) for mem in base]

    shard_times, plans = _timed(lambda: plan_shards(blocks), repeats)
    k_min = plans[0]["shards"]
    # Once: at thousands of blocks every count is thousands of plans.
    every_times, every = _timed(lambda: plan_shards(blocks, counts=list(range(k_min, n + 1))), 1)
    node_times, node_plan = _timed(lambda: plan_nodes(blocks, nodes), repeats)
    return {
        "export/plan_blocks": n,
        "export/plan_nodes": len(nodes),
        "export/plan_repeats": repeats,
        "export/shard_plan_s": min(shard_times),
        "export/shard_plan_first_s": shard_times[0],
        "export/shard_counts": [plan["shards"] for plan in plans],
        "export/shard_max_weight_mb": [max(plan["weight_mb"]) for plan in plans],
        "export/shard_plan_every_count_s": every_times[0],
        "export/shard_plan_every_count_configs": len(every),
        "export/node_plan_s": min(node_times),
        "export/node_plan_first_s": node_times[0],
        "export/node_plan_method": node_plan["method"],
        "export/nodes_mb": nodes,
        "export/node_max_utilisation": max(node_plan["utilisation"]),
    }


def synthetic_blocks(
    n: int,
    seed: int = 0,
    block_mb: float = 48,
    jitter: float = 0.1,
    embed_mb: float = 250,
    head_mb: float = 250,
    activation_mb: float = 16,
    head_activation_mb: float = 64,
) -> list[Block]:
    """A decoder-shaped model: a big embedding, n-2 similar blocks (seeded jitter), a big head with big logits."""
    if n < 3:
        raise UserError(f"task.blocks is {n}; the synthetic model needs at least 3 (embedding, a block, head).")
    rng = random.Random(seed)
    blocks = [Block("model.embed_tokens", int(embed_mb * MB), int(activation_mb * MB))]
    for i in range(n - 2):
        weight = block_mb * (1 + rng.uniform(-jitter, jitter))
        blocks.append(Block(f"model.layers.{i}", int(weight * MB), int(activation_mb * MB)))
    blocks.append(Block("lm_head", int(head_mb * MB), int(head_activation_mb * MB)))
    return blocks


def _timed(fn: Callable[[], Any], repeats: int) -> tuple[list[float], Any]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return times, out


def _check_common(blocks: list[Block], headroom_mb: float, batch_size: int) -> None:
    if not blocks:
        raise UserError("the model has no blocks to plan shards for; check the model's layer map.")
    for block in blocks:
        if block.weight_bytes < 0 or block.activation_bytes < 0:
            raise ValueError(f"block {block.name!r} has negative sizes")
    _check_headroom(headroom_mb)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise UserError(f"the export batch size is {batch_size!r}; it must be a whole number of at least 1.")


def _check_headroom(headroom_mb: float) -> None:
    """NaN and infinity pass `>= 0`; neither is a headroom a GPU can keep, and neither is JSON."""
    if not (headroom_mb >= 0 and math.isfinite(headroom_mb)):
        raise UserError(f"export.headroom_mb is {headroom_mb}; set it to a finite number of MB, 0 or more.")


def _check_block(
    blocks: list[Block],
    sizes: _Sizes,
    index: int,
    max_shard_size_mb: float,
    min_vram_mb: float,
    headroom_mb: float,
    batch_size: int,
) -> None:
    """Raise naming the block when it does not fit a shard even alone."""
    block = blocks[index]
    weight = _up(block.weight_bytes / MB)  # every figure rounded up, so they add up as printed
    if block.weight_bytes > max_shard_size_mb * MB:
        raise UserError(
            f"block {index} '{block.name}' has {_mb(weight)} MB of weights but export.max_shard_size_mb is "
            f"{max_shard_size_mb:.10g}: {_mb(weight - max_shard_size_mb)} MB too big; raise "
            f"export.max_shard_size_mb to at least {weight:g}."
        )
    if sizes.total(index, index + 1) / MB > min_vram_mb:
        activation = _up(sizes.activation(index, index + 1) / MB)
        total = weight + activation + headroom_mb  # what the figures printed add up to
        batch = " or the batch size" if batch_size > 1 else ""
        raise UserError(
            f"block {index} '{block.name}' needs {_mb(total)} MB (weights {_mb(weight)} + activations "
            f"{_mb(activation)} + headroom {_mb(headroom_mb)}) but export.min_vram_mb is {min_vram_mb:.10g}: "
            f"{_mb(total - min_vram_mb)} MB too big; raise export.min_vram_mb or lower export.headroom_mb{batch}."
        )


def _up(mb: float) -> float:
    """Rounded up (as the limit to raise to must be, so a tiny excess never reads as 0.0) to 0.1 MB, or to two
    significant digits below 1 MB (a test's tiny blocks)."""
    if mb <= 0:
        return 0.0
    step = min(0.1, 10 ** (math.floor(math.log10(mb)) - 1))
    return round(math.ceil(mb / step - 1e-9) * step, 10)


def _mb(value: float) -> str:
    """A figure of MB as printed: one decimal where that is exact (the rounded figures), else as many as it has."""
    value = round(value, 6)
    return f"{value:.1f}" if abs(value * 10 - round(value * 10)) < 1e-6 else f"{value:.10g}"


def _greedy_parts(sizes: _Sizes, reach: list[int], cap: float, limit: int) -> int:
    """Fewest shards with weights <= cap (and the fixed limits in reach); stops counting past limit."""
    n, start, parts = len(reach), 0, 0
    while start < n:
        end = min(reach[start], sizes.furthest(start, cap))
        if end <= start:
            return limit + 1
        parts += 1
        if parts > limit:
            return parts
        start = end
    return parts


def _balanced(sizes: _Sizes, reach: list[int], k: int, high: int) -> tuple[list[list[int]], int]:
    """The k-shard partition with the smallest largest weight (at most high), cuts near an even split; and it."""
    n = sizes.n
    heaviest = max(sizes.weight(i, i + 1) for i in range(n))
    low = max(heaviest, -(-sizes.weight(0, n) // k)) - 1  # no k shards can all be this light
    while high - low > 1:  # weights are whole bytes, so the optimum is a whole number
        mid = (low + high) // 2
        if _greedy_parts(sizes, reach, mid, k) <= k:
            high = mid
        else:
            low = mid
    cap = high
    far = [min(reach[s], sizes.furthest(s, cap)) for s in range(n)]
    need = [0] * (n + 1)  # fewest shards under cap for blocks e..n-1
    for e in range(n - 1, -1, -1):
        need[e] = 1 + need[far[e]]
    ranges, start = [], 0
    for left in range(k, 0, -1):
        # Any end in [first, last] keeps the rest coverable by exactly left - 1 shards under cap.
        last = min(far[start], n - (left - 1))
        first = start + 1
        while need[first] > left - 1:
            first += 1
        ideal = sizes.weight(start, n) / left
        end = min(range(first, last + 1), key=lambda e: (abs(sizes.weight(start, e) - ideal), e))
        ranges.append([start, end])
        start = end
    return ranges, cap


def _common_table(n: int, shared: Shared) -> list[list[int]]:
    """common[s][e]: the bytes blocks s..e-1 count more than once (each pair a < b of `shared` inside the range)."""
    later: dict[int, list[tuple[int, int]]] = {}
    for a, b, size in shared:
        later.setdefault(a, []).append((b, size))
    rows = [[0] * (n + 1)]
    for s in range(n - 1, -1, -1):  # the pairs starting at s, added to those starting later
        step = [0] * (n + 1)
        for b, size in later.get(s, []):
            step[b + 1] += size
        row, inside = list(rows[-1]), 0
        for e in range(n + 1):
            inside += step[e]
            row[e] += inside
        rows.append(row)
    return rows[::-1]


def _capacity_plan(
    blocks: list[Block], sizes: _Sizes, nodes: list[float], counts: list[int], headroom_mb: float
) -> list[list[int]]:
    """Contiguous ranges, one per node, minimising the largest total/memory; raise naming the node that cannot fit."""
    n, caps = sizes.n, [mem * MB for mem in nodes]
    largest = max(range(len(nodes)), key=lambda i: (nodes[i], -i))
    for index in range(n):
        total = sizes.total(index, index + 1)
        if total > caps[largest]:
            raise UserError(
                f"block {index} '{blocks[index].name}' needs {_mb(_up(total / MB))} MB (with export.headroom_mb="
                f"{headroom_mb:g}) but the largest node, node {largest}, has {nodes[largest]:.10g} MB: "
                f"{_mb(_up(total / MB) - nodes[largest])} MB too big; "
                "add memory to export.nodes or lower export.headroom_mb."
            )
    layers, failed = _frontiers(sizes, caps, 1.0)
    if failed is not None:
        _raise_node(blocks, sizes, nodes, layers, failed)
    # Bisect the largest utilisation, then step below the found plan's exact value until nothing fits there.
    low, high = 0.0, 1.0
    while high - low > 1e-9:
        mid = (low + high) / 2
        if _frontiers(sizes, caps, mid)[1] is None:
            high = mid
        else:
            low = mid
    layers = _frontiers(sizes, caps, high)[0]
    while True:
        ranges = _backtrack(sizes, caps, layers, high, counts)
        worst = max(sizes.total(s, e) / cap for (s, e), cap in zip(ranges, caps))
        high = math.nextafter(worst, 0.0)  # "<= the float just below" is "strictly below"
        layers, failed = _frontiers(sizes, caps, high)
        if failed is not None:  # no plan is strictly better than this one
            return ranges


def _fits(sizes: _Sizes, start: int, end: int, cap: float, bound: float) -> bool:
    return sizes.total(start, end) / cap <= bound


def _frontiers(sizes: _Sizes, caps: list[float], bound: float) -> tuple[list[list[tuple[int, int]]], int | None]:
    """Where each node may start when every node stays within bound utilisation, as sorted runs [a, b] of starts.

    Returns the runs per node (and one more entry, the possible ends of the last node) with None when the last
    node can end at block n, else the runs so far and the first node that cannot go on. Within a run of
    consecutive starts whose first block fits, a later start reaches at least as far, so node i's ends from
    starts c..d are exactly (c, furthest end from d]: one binary search per run, not one step per block.
    """
    n, m = sizes.n, len(caps)
    starts = [(0, 0)]
    layers = []
    for node, cap in enumerate(caps):
        layers.append(starts)
        limit = n - (m - 1 - node)  # leave one block for every later node
        big = sizes.too_big(cap, bound)  # blocks that alone exceed bound on this node, ascending
        ends: list[tuple[int, int]] = []
        for a, b in starts:
            start, b = a, min(b, limit - 1)
            while start <= b:
                j = bisect_right(big, start) - 1
                if j >= 0 and big[j] == start:  # this block alone is too big here: no range starts at it
                    start += 1
                    continue
                nxt_big = big[j + 1] if j + 1 < len(big) else n
                last = min(b, nxt_big - 1)  # the run of starts whose first block fits
                reach = _furthest(sizes, last, limit, cap, bound)
                if ends and start + 1 <= ends[-1][1] + 1:
                    ends[-1] = (ends[-1][0], max(ends[-1][1], reach))
                else:
                    ends.append((start + 1, reach))
                start = last + 1
        if not ends:
            return layers, node
        starts = ends
    if starts[-1][1] != n:
        return layers, m - 1
    layers.append(starts)
    return layers, None


def _furthest(sizes: _Sizes, start: int, limit: int, cap: float, bound: float) -> int:
    """The largest end <= limit with [start, end) within bound, given that block start alone is."""
    low, high = start + 1, limit
    while low < high:
        mid = (low + high + 1) // 2
        if _fits(sizes, start, mid, cap, bound):
            low = mid
        else:
            high = mid - 1
    return low


def _backtrack(
    sizes: _Sizes, caps: list[float], layers: list[list[tuple[int, int]]], bound: float, counts: list[int]
) -> list[list[int]]:
    """A plan within bound (layers from _frontiers), each cut as close as allowed to the proportional one."""
    cuts = [0]
    for count in counts:
        cuts.append(cuts[-1] + count)
    ranges, end = [], sizes.n
    for node in range(len(caps) - 1, -1, -1):
        # Starts s with [s, end) within bound form a suffix [first, end - 1]; intersect it with node's runs.
        low, high = 0, end - 1
        while low < high:
            mid = (low + high) // 2
            if _fits(sizes, mid, end, caps[node], bound):
                high = mid
            else:
                low = mid + 1
        options = [min(max(cuts[node], a, low), b, end - 1) for a, b in layers[node] if b >= low and a <= end - 1]
        start = min(options, key=lambda s: (abs(s - cuts[node]), s))
        ranges.append([start, end])
        end = start
    return ranges[::-1]


def _raise_node(blocks: list[Block], sizes: _Sizes, nodes: list[float], layers: list[list[bool]], node: int) -> None:
    """Explain why node cannot be given a range within its memory, naming the block or blocks that overflow."""
    n, m, mem = sizes.n, len(nodes), nodes[node]
    starts = [s for a, b in layers[node] for s in range(a, min(b, n - 1) + 1)]
    if node == m - 1:
        start = max(starts)  # the least the last node can be left with
        total = sizes.total(start, n) / MB
        what = f"block {start} '{blocks[start].name}', which needs"
        if start < n - 1:
            what = f"blocks {start}-{n - 1}, which need"
        raise UserError(
            f"node {node} ({mem:.10g} MB), the last in export.nodes, would have to hold {what} "
            f"{_mb(_up(total))} MB: {_mb(_up(total) - mem)} MB too big; add nodes or memory to export.nodes."
        )
    start = min(starts, key=lambda s: (sizes.total(s, s + 1), s))
    total = sizes.total(start, start + 1) / MB
    raise UserError(
        f"node {node} ({mem:.10g} MB) must hold at least one block but cannot hold even block {start} "
        f"'{blocks[start].name}', the smallest it could start at, which needs {_mb(_up(total))} MB: "
        f"{_mb(_up(total) - mem)} MB too big; give node {node} more memory or reorder export.nodes."
    )
