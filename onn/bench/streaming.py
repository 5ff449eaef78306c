"""`task=bench_streaming`: the layer-streaming engine's figures, measured on this machine.

Every figure is a ratio inside one run, so a noisy shared machine moves numerator and
denominator together. The disk store drops each block from the OS page cache after reading it,
and accelerate's offload folder is dropped the same way before every forward, so both read from
the disk as they would for a model larger than RAM.

  stream/reuse_speedup_m64     samples/s at M=64 micro-batches per chunk load over M=1 (disk store)
  stream/overlap_efficiency    max(load time, compute time) / step time of the timed steps, prefetch on (disk, M=16)
  stream/resident_step_ratio   streamed step / resident peft step, M=16, store in host memory
  stream/vs_accelerate_speedup ONN samples/s over accelerate's disk_offload hooks, same model and batch (M=16)
  stream/peak_over_predicted   measured peak growth of a step (after a warm-up step) over the planner's
                               prediction at a budget; the larger of two steps
  stream/model_over_budget     the model's fp32 weights over that budget (at least 8)

The memory figures come from a fresh interpreter that imports only the engine and loads the model
block by block into the store, as a run with a disk store does.
"""

from __future__ import annotations

import copy
import gc
import logging
import os
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from onn.config import ONNConfig, as_dict
from onn.config.task import BenchStreamingTask
from onn.errors import UserError
from onn.planning.plan import Plan

if TYPE_CHECKING:
    from onn.planning.streaming import StreamingPlan

log = logging.getLogger("onn")


def micro_batches(count: int, micro_batch: int, seq: int, vocab: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(3, vocab, (micro_batch, seq), generator=g)
        labels = ids.clone()
        labels[:, : seq // 2] = -100
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
    return out


def _timed(fn, repeats: int) -> float:
    return statistics.median(_runs(fn, repeats))


def _runs(fn, repeats: int, after_warmup=None) -> list[float]:
    """Each of `repeats` timed calls' seconds, after one untimed warm-up call (allocator, thread pool,
    first-touch); `after_warmup` runs between them, e.g. to reset counters that must cover the timed calls only."""
    fn()
    if after_warmup is not None:
        after_warmup()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


@dataclass
class _Bench:
    """What every measurement of the bench shares: the LoRA model, its settings and where its store goes."""

    config: ONNConfig
    plan: Plan
    base: Any  # the sparse-LoRA model every engine copies
    store_dir: Path
    seq: int
    micro_batch: int
    repeats: int
    chunk: int

    @property
    def vocab(self) -> int:
        return self.base.config.vocab_size

    def engine(self, kind: str, chunk_size: int | None = None, stream_edges: bool = False):
        from onn.models.layers import discover
        from onn.streaming.engine import StreamingEngine
        from onn.streaming.store import LayerStore

        m = copy.deepcopy(self.base)
        store = LayerStore(kind, "float32", folder=self.store_dir)
        e = StreamingEngine(m, discover(m), store, chunk_size or self.chunk, stream_edges=stream_edges)
        e.offload()
        os.sync()  # written pages must be clean before they can be dropped from the page cache
        return e


OVERLAP_M = 16  # the micro-batches per chunk load at which load against compute (overlap, io_s, compute_s) is measured


def check_settings(config: ONNConfig) -> None:
    """task.* in one sentence before the model is loaded: a value the figures cannot use would end the bench in a
    traceback after minutes, or leave figures out without a word."""
    t: BenchStreamingTask = config.task
    for key in ("seq_len", "micro_batch", "chunk_size", "repeats"):
        if getattr(t, key) < 1:
            raise UserError(f"task.{key}={getattr(t, key)}: give a whole number, 1 or more.")
    if not t.weights_over_budget > 0:
        raise UserError(
            f"task.weights_over_budget={t.weights_over_budget}: the memory figure's budget is the model's weights "
            "over this; give a number above 0 (the recipe's 8)."
        )
    counts = list(t.reuse_m)
    if any(m < 1 for m in counts) or len(set(counts)) < 2 or OVERLAP_M not in counts:
        raise UserError(
            f"task.reuse_m={counts}: list micro-batches per chunk load, each 1 or more, at least two of them (the "
            f"reuse speedup is the most over the fewest) and {OVERLAP_M}, where stream/overlap_efficiency, io_s and "
            f"compute_s are measured; e.g. [1, 4, {OVERLAP_M}, 64]."
        )


def run(job) -> dict[str, Any]:
    from onn.models.layers import discover

    b = make_bench(job.config, job.plan)
    out: dict[str, Any] = {
        "stream/blocks": len(discover(b.base)),
        "stream/chunk_size": b.chunk,
        "stream/seq_len": b.seq,
        "stream/micro_batch": b.micro_batch,
    }
    out.update(_memory_within_budget(b))
    rows: list[tuple] = []
    for measure in (_reuse, _against_resident, _against_accelerate):
        figures, more = measure(b)
        out.update(figures)
        rows += more
        gc.collect()  # free each measurement's copies before the next one is made
    _write_table(job.run_dir, rows, out)
    return out


def make_bench(config: ONNConfig, plan: Plan) -> _Bench:
    """The sparse-LoRA model on the plan's trained blocks, and the bench's settings, for every measurement."""
    from onn.models.layers import discover
    from onn.models.load import load, model_fingerprint
    from onn.training.lora import apply

    bench: BenchStreamingTask = config.task
    model, _ = load(config.model, dtype=torch.float32)
    base = apply(model, "sparse_lora", config.strategy, discover(model), plan.sparse_layers)
    store_dir = Path(config.paths.cache) / "stores" / model_fingerprint(config.model) / "bench"
    return _Bench(config, plan, base, store_dir, bench.seq_len, bench.micro_batch, bench.repeats, bench.chunk_size)


def _memory_within_budget(b: _Bench) -> dict[str, Any]:
    """5: a budget the model's fp32 weights exceed many times; one step's growth of anonymous memory stays
    within it and near the planner's prediction. An empty store, so the fresh process really loads the model
    block by block."""
    weights_mb = sum(p.numel() for p in b.base.parameters()) * 4 / 2**20
    budget = weights_mb / b.config.task.weights_over_budget
    predicted, planned = _predicted_step_mb(b.config, b.plan.sparse_layers, budget, b.micro_batch, b.seq)
    shutil.rmtree(f"{b.store_dir}_blockwise", ignore_errors=True)
    measured = _step_memory_in_fresh_process(
        {
            "model": as_dict(b.config.model),
            "strategy": as_dict(b.config.strategy),
            "layers": b.plan.sparse_layers,
            "store": f"{b.store_dir}_blockwise",
            "chunk_size": planned.chunk_size,
            "stream_edges": planned.edges == "stream",
            "micro_batch": b.micro_batch,
            "seq_len": b.seq,
        }
    )
    return {
        "stream/model_mb": round(weights_mb, 1),
        "stream/budget_mb": round(budget, 1),
        "stream/budget_chunk_size": planned.chunk_size,
        "stream/budget_edges": planned.edges,
        "stream/model_over_budget": round(weights_mb / budget, 2),
        "stream/peak_step_mb": round(measured, 1),
        "stream/predicted_step_mb": round(predicted, 1),
        "stream/peak_over_predicted": round(measured / predicted, 3),
        "stream/within_budget": measured <= budget,
    }


def _reuse(b: _Bench) -> tuple[dict[str, Any], list[tuple]]:
    """1 + 2: load once, process many; and how much of the I/O the prefetch hides."""
    disk = b.engine("disk")
    speeds, out, rows = {}, {}, []
    for m_count in b.config.task.reuse_m:
        batch = micro_batches(m_count, b.micro_batch, b.seq, b.vocab)
        # load and compute seconds of the timed steps only (the warm-up's reset away), per step
        times = _runs(
            lambda batch=batch: (disk.train_step(batch), disk.model.zero_grad(set_to_none=True)),
            b.repeats,
            after_warmup=disk.times.__init__,
        )
        step = statistics.median(times)
        speeds[m_count] = m_count * b.micro_batch / step
        load_s, compute_s = disk.times.load_s / b.repeats, disk.times.compute_s / b.repeats
        rows.append((f"disk store, M={m_count}", step, speeds[m_count], load_s, compute_s))
        if m_count == 1:  # I/O-bound here: load time next to compute time says so
            out["stream/load_s_m1"], out["stream/compute_s_m1"] = round(load_s, 4), round(compute_s, 4)
        if m_count == OVERLAP_M:  # like over like: the timed steps' mean load and compute over their mean step
            out["stream/overlap_efficiency"] = round(max(load_s, compute_s) / statistics.fmean(times), 3)
            out["stream/io_s"], out["stream/compute_s"] = round(load_s, 4), round(compute_s, 4)
            out["stream/step_s_m16"] = round(step, 4)
    lo, hi = min(speeds), max(speeds)
    out[f"stream/reuse_speedup_m{hi}"] = round(speeds[hi] / speeds[lo], 2)
    out["stream/samples_per_s"] = {str(k): round(v, 3) for k, v in speeds.items()}
    disk.close()
    return out, rows


def _against_resident(b: _Bench) -> tuple[dict[str, Any], list[tuple]]:
    """3: against resident LoRA with gradient accumulation, when the model fits (store in host memory)."""
    batch = micro_batches(16, b.micro_batch, b.seq, b.vocab, seed=1)
    resident = copy.deepcopy(b.base)

    def resident_step():
        for piece in batch:
            (resident(**piece).loss / len(batch)).backward()
        resident.zero_grad(set_to_none=True)

    resident_s = _timed(resident_step, b.repeats)
    cpu = b.engine("cpu")
    cpu_s = _timed(lambda: (cpu.train_step(batch), cpu.model.zero_grad(set_to_none=True)), b.repeats)
    cpu.close()
    mb = b.micro_batch
    return {"stream/resident_step_ratio": round(cpu_s / resident_s, 3)}, [
        ("resident peft, M=16", resident_s, 16 * mb / resident_s, 0.0, resident_s),
        ("cpu store, M=16", cpu_s, 16 * mb / cpu_s, 0.0, cpu_s),
    ]


def _against_accelerate(b: _Bench) -> tuple[dict[str, Any], list[tuple]]:
    """4: what users pick today: accelerate's disk offload hooks move weights at every forward call."""
    from accelerate import disk_offload

    from onn.hardware.disk import evict

    batch = micro_batches(16, b.micro_batch, b.seq, b.vocab, seed=1)
    offloaded = copy.deepcopy(b.base)
    offload_dir = b.store_dir.parent / "bench_accelerate"
    shutil.rmtree(offload_dir, ignore_errors=True)  # accelerate reuses whatever it finds there
    disk_offload(offloaded, offload_dir=str(offload_dir), execution_device=torch.device("cpu"))
    os.sync()

    def accelerate_step():
        for piece in batch:
            for f in offload_dir.glob("*"):
                evict(f)
            (offloaded(**piece).loss / len(batch)).backward()
        offloaded.zero_grad(set_to_none=True)

    acc_s = _timed(accelerate_step, max(1, b.repeats // 2))
    disk = b.engine("disk")
    onn_s = _timed(lambda: (disk.train_step(batch), disk.model.zero_grad(set_to_none=True)), b.repeats)
    disk.close()
    mb = b.micro_batch
    return {"stream/vs_accelerate_speedup": round(acc_s / onn_s, 2)}, [
        ("accelerate disk_offload, M=16", acc_s, 16 * mb / acc_s, 0.0, 0.0),
        ("ONN disk store, M=16", onn_s, 16 * mb / onn_s, 0.0, 0.0),
    ]


def _write_table(run_dir: Path, rows: list[tuple], out: dict[str, Any]) -> None:
    table = ["| setting | step s | samples/s | load s | compute s |", "| --- | ---: | ---: | ---: | ---: |"]
    table += [f"| {name} | {s:.3f} | {sps:.2f} | {ld:.3f} | {cp:.3f} |" for name, s, sps, ld, cp in rows]
    figures = [f"| {k} | {v} |" for k, v in out.items() if not isinstance(v, dict)]
    (run_dir / "bench_streaming.md").write_text(
        "# Layer streaming benchmark\n\n"
        + "\n".join(table)
        + "\n\n| figure | value |\n| --- | --- |\n"
        + "\n".join(figures)
        + "\n"
    )
    print("\n".join(table))


def _step_memory_in_fresh_process(spec: dict[str, Any]) -> float:
    """Run `step_memory` in a new interpreter that imports only the engine: what a host process
    imported before changes its per-step RSS (importing torchmetrics added ~40 MB per step here),
    and that belongs to the process, not to the engine's step."""
    import json
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "onn.bench.streaming"],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the step-memory measurement failed:\n{done.stderr[-2000:]}")
    return float(json.loads(done.stdout.strip().splitlines()[-1])["peak_step_mb"])


def step_memory(spec: dict[str, Any]) -> float:
    """Growth of anonymous RSS over a streamed training step (the larger of two, after a warm-up
    step), with the store on disk and each block dropped from the page cache after reading. `spec` is
    JSON: its model and strategy are their configs' plain values."""
    from onn.config import typed
    from onn.config.model import LanguageModelConfig
    from onn.config.strategy import StrategyConfig
    from onn.hardware.memory import PeakMemory, anon_rss_mb
    from onn.models.layers import discover
    from onn.streaming.engine import StreamingEngine
    from onn.streaming.loader import load_into_store
    from onn.streaming.store import LayerStore
    from onn.training.lora import apply

    # Block by block into the store, as a run with a disk store loads: the model is never whole here.
    model_cfg = typed(LanguageModelConfig, spec["model"], "bench_streaming's step process: model")
    strategy = typed(StrategyConfig, spec["strategy"], "bench_streaming's step process: strategy")
    store = LayerStore("disk", "float32", folder=Path(spec["store"]))
    model, _ = load_into_store(model_cfg, torch.float32, None, store)
    model = apply(
        model, "sparse_lora", strategy, discover(model), spec["layers"]
    ).train()  # a training step: dropout on
    engine = StreamingEngine(
        model, discover(model), store, int(spec["chunk_size"]), stream_edges=bool(spec["stream_edges"])
    )
    engine.offload()
    os.sync()  # written pages must be clean before they can be dropped from the page cache
    batch = micro_batches(4, int(spec["micro_batch"]), int(spec["seq_len"]), model.config.vocab_size, seed=2)
    # One warm-up step first: the process's one-time costs (thread pools, allocator arenas, kernel
    # workspaces) belong to its baseline, which the planner counts as context, not to a step.
    engine.train_step(batch)
    measured = 0.0
    for _ in range(2):
        model.zero_grad(set_to_none=True)  # the adapters' gradients are part of the step
        _release_free_memory()
        before = anon_rss_mb()
        with PeakMemory("cpu", interval_s=0.002) as peak:
            engine.train_step(batch)
        measured = max(measured, peak.peak_mb - before)
    engine.close()
    return measured


def _predicted_step_mb(
    config: ONNConfig, layers: list[int], budget_mb: float, mb: int, seq: int
) -> tuple[float, StreamingPlan]:
    """The planner's streaming prediction for this model at this budget (allocations, no context), and the
    settings it chose to fit, for the benchmark's float32 disk store. `layers`: the plan's trained blocks, resolved
    (strategy.layers may say `all`)."""
    from onn.hardware.profile import Profile
    from onn.planning.plan import estimate
    from onn.planning.spec import model_spec
    from onn.planning.streaming import FixedStreaming

    spec = model_spec(config.model, config.strategy.lora.r)
    hw = Profile(
        name="budget",
        accelerator="cpu",
        source="preset",
        host_memory_available_mb=budget_mb + 600.0,
        budget_mb=budget_mb + 600.0,
    )
    est = estimate(
        "sparse_lora",
        spec,
        hw,
        seq,
        mb,
        "32-true",
        layers,
        batch_size=4 * mb,
        store_dtype="float32",
        fixed=FixedStreaming(store="disk"),
    )
    return est.peak_mb, est.streaming


def _release_free_memory() -> None:
    """Return freed heap pages to the OS (glibc), so a step's allocations show up as RSS growth."""
    import contextlib
    import ctypes

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


if __name__ == "__main__":  # the fresh process of _step_memory_in_fresh_process
    import json
    import sys

    print(json.dumps({"peak_step_mb": step_memory(json.loads(sys.stdin.read()))}))
