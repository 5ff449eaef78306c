"""`task=bench_gpu` (recipe=bench_gpu): ONN's headline on a GPU, against what the host link and the GPU allow.

  train       Phi-4 at its real size (random init) under hardware.budget_mb, a 4 GB card with its CUDA context:
              the store built into pinned host memory, `task.steps` optimizer steps of data.batch_size samples
              (the first warms up and is not timed), the plan's predictions beside the measurements, then one
              more step, profiled (its kernels, its waits for the GPU) and not timed: the profiler slows it
  generate    greedy tokens for 1 and for task.gen_batch prompts from the same store
  accelerate  the same weights (the store's, de-quantized to bf16), prompts and token count through
              accelerate's device_map="auto" with max_memory at the same budget: what users reach for today
  overhead    the default job (`python run.py`'s model and data) against a plain PyTorch loop, and
              recipe=bench_vision's image runner against its plain loop (with the device ops and the waits
              for the GPU each side's step asks for, counted, and a bare LightningModule's own overhead: what
              Lightning's loop costs by itself), each in a run of its own, stopped where it would take the
              recipe past task.time_limit_s (8 minutes: issue 30's bound)

Figures go to metrics.json as gpu/* and to bench_gpu.md beside it. The step's limit is

    limit_s = max(bytes copied host-to-device per step / pinned bandwidth now,
                  matmul FLOPs per step / bf16 matmul rate now (the largest block weight at the step's rows))

for each timed step, their mean (the FLOPs at the samples and width the step's batch held, not data.max_length,
and the rate at the rows its micro-batches held), and limit_efficiency = limit_s / step_s. With several processes
every figure of the steps is one GPU's: its share of each batch (data.batch_size is the global batch), its
copies, its FLOPs against its own rate, its tokens and its time per sample.

io_s and compute_s are the GPU's own busy times in the profiled step (onn/bench/timeline.py): copying over the
host link, and everything else; overlap_s is both at once, and
copies_hidden the share of the copying done under compute (the engine's host clocks, io_wait_host_s and
compute_host_s, count a load's wait for the kernels queued before its copy as I/O). The seed's figure for
Phi-4 on a GTX 1650 (490 ms per sample at batch 128) stands beside ms_per_sample. alloc_retries counts the times
the allocator ran out of room under the budget's cap during the fit (every step, the untimed first and profiled
last included; each a wait for the GPU and a flush of its cache): a step that retries is slower than its copies
and matmuls say.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import itertools
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from onn.bench.timeline import gpu_timeline
from onn.config import ONNConfig
from onn.config.task import BenchGpuTask
from onn.errors import UserError
from onn.planning.costs import streaming_step_flops
from onn.planning.plan import STREAMING_LIGHTNING

log = logging.getLogger("onn")

MB = 1024**2
GB = 1e9  # bandwidths and bytes moved in decimal gigabytes, as NVIDIA quotes its links' (PCIe, NVLink) figures
SEED_MS_PER_SAMPLE = 490  # the seeds' Phi-4 on a 4 GB GTX 1650, batch 128
H2D_PROBE_MB = 512  # the largest copy the host link is timed with after the steps (PCIe's rate is level well below)
H2D_PROBE_SHARE = 4  # ... and at most this share of the device memory still free to the run
CHILD_TIMEOUT_S = 300  # a child run (the default job's or the image runner's overhead) takes 1-2 minutes on an H200
LEAST_CHILD_S = 60  # a child run starts a process, plans and times its rounds: with less time it is not started


def check_settings(config: ONNConfig) -> None:
    task: BenchGpuTask = config.task
    for key, least in (("steps", 2), ("gen_batch", 1), ("gen_tokens", 2), ("time_limit_s", 1)):
        if getattr(task, key) < least:
            raise UserError(f"task.{key}={getattr(task, key)!r}: give a whole number, {least} or more.")
    if config.strategy.name != "sparse_lora" or config.strategy.lightning not in STREAMING_LIGHTNING:
        raise UserError(
            f"task=bench_gpu measures layer streaming: use strategy=sparse_lora with strategy.lightning=streaming, "
            f"not strategy={config.strategy.name} with strategy.lightning={config.strategy.lightning}."
        )


SKIPPED = "skipped: past task.time_limit_s"


def run(job) -> dict[str, Any]:
    """The phases in turn, each after the last one's figures are written (bench_gpu.json, bench_gpu.md); one that
    would start past task.time_limit_s is skipped and its first figure says so, so the recipe ends itself."""
    task: BenchGpuTask = job.config.task
    started, deadline = time.perf_counter(), _deadline(task)
    out: dict[str, Any] = {
        "gpu/device": torch.cuda.get_device_name(),
        "gpu/params": job.spec.params,
        "gpu/seed_ms_per_sample": SEED_MS_PER_SAMPLE,
    }
    module, tokenizer, trained = _train(job)
    out.update(trained)
    _write(job, out)
    if time.time() >= deadline:
        out.update({"gpu/gen_bn_tokens_per_s": SKIPPED, "gpu/vs_accelerate": SKIPPED})
    else:
        prompts = _prompts(job, tokenizer)
        out.update(_generate(job, module, tokenizer, prompts))
        _write(job, out)
        if task.accelerate and time.time() >= deadline:
            out["gpu/vs_accelerate"] = SKIPPED
        elif task.accelerate:
            state = _plain_state(job, module)
            del module
            _free()
            out.update(_accelerate(job, state, tokenizer, prompts, out))
            _write(job, out)
    if task.overhead and time.time() >= deadline:
        out.update({**_missing(OVERHEAD_FIGURES, SKIPPED), **_missing(VISION_FIGURES, SKIPPED)})
    elif task.overhead:
        out.update(_overheads(job))
    out["gpu/wall_s"] = round(time.perf_counter() - started, 1)
    _write(job, out)
    return out


def _deadline(task: BenchGpuTask) -> float:
    """task.time_limit_s from this process's start (the imports and the store's build count), on time.time()'s clock."""
    import psutil

    return psutil.Process().create_time() + task.time_limit_s


def link_figures(copied_bytes: float, link_bytes_s: float, profile_mb_s: float | None) -> dict[str, float]:
    """The host link's figures in the units their names say: GB (1e9 bytes), not GiB; the profile's h2d_mb_s is in
    MB of 2**20 bytes (onn/hardware/profile.py), as the planner reads it."""
    return {
        "gpu/copied_gb_per_step": round(copied_bytes / GB, 3),
        "gpu/h2d_gb_s": round(link_bytes_s / GB, 2),
        "gpu/h2d_gb_s_profile": round(float(profile_mb_s or 0) * MB / GB, 2),
    }


def h2d_probe_mb(free_mb: float, budget_room_mb: float | None) -> int:
    """The size of the copy (pinned host memory, and as much on the device) the host link is timed with beside what
    the steps still hold: H2D_PROBE_MB, or a quarter of the room left where that is less, the device's free memory
    or, under hardware.budget_mb, the budget's room (512 MB on a 4 GB card after the steps, or a third of a 1.5 GB
    budget, failed with the allocator's out-of-memory error after every step had run). At least 1 MB."""
    room = free_mb if budget_room_mb is None else min(free_mb, budget_room_mb)
    return int(max(1, min(H2D_PROBE_MB, room / H2D_PROBE_SHARE)))


def _room_mb(job) -> tuple[float, float | None]:
    """The device memory free now (MB), and under hardware.budget_mb the room its cap leaves beside the tensors the
    run still holds (None without a budget)."""
    free, _ = torch.cuda.mem_get_info()
    if not job.config.hardware.budget_mb:
        return free / MB, None
    return free / MB, job.plan.budget_mb - job.plan.context_mb - torch.cuda.memory_allocated() / MB


def _train(job) -> tuple[Any, Any, dict[str, Any]]:
    """The store built, then task.steps steps and a profiled one; figures of the steps between the first and the
    profiled one (torch.profiler starts and traces every kernel inside its step, which it slows)."""
    from onn.hardware.cast import fused_scale
    from onn.hardware.profile import h2d_mb_s
    from onn.modalities.text.tasks import build, datamodule, trainer
    from onn.training.callbacks import StepClock

    config, plan, spec = job.config, job.plan, job.spec
    start = time.perf_counter()
    module, tokenizer = build(config, plan)  # the store is filled here, block by block
    build_s = time.perf_counter() - start
    dm = datamodule(config, tokenizer)
    clock, probe = StepClock(), _StepProbe(job.run_dir / "syncs_last_step.txt")
    steps = config.task.steps
    # no checkpoint callback: the Trainer writes no checkpoint (onn/training/trainer.py)
    run_trainer = dataclasses.replace(config.trainer, max_steps=steps + 1, limit_val_batches=0, num_sanity_val_steps=0)
    run_config = dataclasses.replace(config, trainer=run_trainer)
    fit = trainer(run_config, plan, job.run_dir, [clock, probe], loggers=False, steps_per_epoch=dm.steps_per_epoch)
    peak, reserved_peak, retries = _fit_measured(fit, module, dm)
    process = probe.process_peak_mb()
    context = float(job.hardware.cuda_context_mb or 0.0)
    timed = slice(1, steps)  # the first step loads kernels and the first chunks; the last is profiled
    step_s = statistics.mean(clock.step_s[timed])
    copied = statistics.mean(clock.copied_bytes[timed])
    link = h2d_mb_s(h2d_probe_mb(*_room_mb(job))) * MB
    micro = micro_batches_held(module.micro_batch, module.oom_backoffs, len(clock.step_s))
    rates = functools.cache(lambda rows: _matmul_rate(job, rows))
    figures = step_figures(spec, plan, clock, timed, fit.world_size, micro, link, rates)
    s = plan.streaming
    predicted_peak, predicted_context = plan.predicted_peak_memory_mb, plan.context_mb
    out = {
        **_settings(plan),
        "gpu/build_s": round(build_s, 1),
        "gpu/steps": len(clock.step_s),
        "gpu/timed_steps": len(clock.step_s[timed]),
        "gpu/batch_size": config.data.batch_size,
        "gpu/peak_allocated_mb": round(peak, 1),
        "gpu/process_gpu_mb": round(process, 1),
        "gpu/context_mb": round(context, 1),
        "gpu/budget_mb": plan.budget_mb,
        "gpu/predicted_peak_mb": predicted_peak,
        "gpu/predicted_process_mb": round(predicted_peak + predicted_context, 1),
        "gpu/allocated_error": round(peak / predicted_peak - 1, 4),
        "gpu/memory_error": round((peak + context) / (predicted_peak + predicted_context) - 1, 4),
        "gpu/step_s": round(step_s, 4),
        "gpu/predicted_step_s": plan.predicted_step_s,
        "gpu/step_time_error": round(step_s / plan.predicted_step_s - 1, 4),
        "gpu/step_s_all": [round(x, 4) for x in clock.step_s],
        # the GPU's own busy times in the profiled step: copies over the host link, kernels, both at once
        **{f"gpu/{k}": round(v, 4) for k, v in probe.timeline.items()},
        "gpu/predicted_io_s": s.predicted_io_s,
        "gpu/predicted_compute_s": s.predicted_compute_s,
        # the engine's host clocks, timed steps: its waits for loads (which wait for queued kernels too), the rest
        "gpu/io_wait_host_s": round(statistics.mean(clock.io_s[timed]), 4),
        "gpu/compute_host_s": round(statistics.mean(clock.compute_s[timed]), 4),
        **link_figures(copied, link, job.hardware.h2d_mb_s),
        **figures,
        "gpu/loss_first": round(module.train_losses[0], 4),
        "gpu/loss_last": round(module.train_losses[-1], 4),
        "gpu/loss_curve": [round(x, 4) for x in module.train_losses],
        "gpu/reserved_peak_mb": round(reserved_peak, 1),  # read before the rate probes allocated theirs
        "gpu/alloc_retries": retries,
        "gpu/syncs_last_step": probe.syncs,
        # the int8 casts as one kernel that scales as it casts (Triton), still in use after the steps
        "gpu/fused_cast": fused_scale(torch.device("cuda")),
    }
    return module, tokenizer, out


def step_figures(
    spec,
    plan,
    clock,
    timed: slice,
    world_size: int,
    micro_batches: list[int | None],
    link_bytes_s: float,
    rate_at: Callable[[int], float],
) -> dict[str, Any]:
    """The timed steps' speed against their limit, one GPU's: StepClock's rows are every process's samples (each
    process's share x world_size), while the copies, the matmul rate (`rate_at(rows)`, FLOP/s at a micro-batch's
    rows x width) and the tokens are this process's. Each step's limit is its own copies' or matmuls' time, the
    larger (a step bound by its copies and one by its matmuls do not share a bound), and their mean is set against
    the mean step: per sample and per token over the samples and tokens the steps held, not data.batch_size."""
    step_s = statistics.mean(clock.step_s[timed])
    rows = [n // world_size for n in clock.rows[timed]]
    widths = clock.widths[timed]
    link_s = [n / link_bytes_s for n in clock.copied_bytes[timed]]
    matmul_s = [
        _matmul_seconds(spec, plan, n, width, micro, rate_at)
        for n, width, micro in zip(rows, widths, micro_batches[timed], strict=True)
    ]
    flops = step_flops(spec, plan, rows, widths)
    limit = statistics.mean(max(copies, matmuls) for copies, matmuls in zip(link_s, matmul_s, strict=True))
    return {
        "gpu/processes": world_size,
        "gpu/samples_per_step": statistics.mean(rows),
        "gpu/flops_per_step": flops,
        "gpu/matmul_tflops": round(flops * len(rows) / sum(matmul_s) / 1e12, 1),
        "gpu/limit_s": round(limit, 4),
        "gpu/limit_efficiency": round(limit / step_s, 4),
        "gpu/limit_bound": "host link" if sum(link_s) >= sum(matmul_s) else "matmuls",
        "gpu/ms_per_sample": round(step_s / statistics.mean(rows) * 1000, 3),
        "gpu/tokens_per_s": round(statistics.mean(clock.tokens[timed]) / step_s, 1),
    }


def _matmul_seconds(
    spec, plan, rows: int, width: int, micro_batch: int | None, rate_at: Callable[[int], float]
) -> float:
    """A step's matmul time at the rate of each micro-batch it ran (`micro_batch` samples, the last one the rest):
    the rate of a few rows is well below that of many."""
    size = min(micro_batch or rows, rows)
    sizes = [size] * (rows // size) + ([rows % size] if rows % size else [])
    return sum(streaming_step_flops(spec, width, n, plan.sparse_layers) / rate_at(n * width) for n in sizes)


def micro_batches_held(last: int | None, backoffs: list[dict[str, int]], steps: int) -> list[int | None]:
    """The micro-batch each of `steps` steps ran at: the module's `last` one, or where an out-of-memory back-off
    halved it (TextModule.oom_backoffs: its step, from, to), the one before up to that step."""
    held = []
    for step in range(steps):
        before = [b["to"] for b in backoffs if b["step"] <= step]
        held.append(before[-1] if before else backoffs[0]["from"] if backoffs else last)
    return held


def step_flops(spec, plan, rows: list[int], widths: list[int]) -> float:
    """Matmul FLOPs of the measured steps (their mean), each at the samples and width its batch held: the data's
    samples after packing or truncation, padded to the batch's longest, not plan.sequence_length (data.max_length,
    only their cap): a limit counted there measured the GPU against work the steps never had."""
    per_step = (streaming_step_flops(spec, w, r, plan.sparse_layers) for r, w in zip(rows, widths, strict=True))
    return statistics.mean(per_step)


def _fit_measured(fit, module, dm) -> tuple[float, float, int]:
    """The fit, from fresh memory statistics: its peak allocated and reserved MB, and how often the allocator ran
    out of room under the budget's cap (then it waits for the GPU, frees its cache and tries again; the copy
    stream's blocks are not reused by the compute stream's allocations, nor the other way)."""
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    module.train()
    fit.fit(module, datamodule=dm)
    retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) - before
    return torch.cuda.max_memory_allocated() / MB, torch.cuda.max_memory_reserved() / MB, retries


def _settings(plan) -> dict[str, Any]:
    """The streaming settings the plan chose for the steps."""
    s = plan.streaming
    return {
        "gpu/store_dtype": s.store_dtype,
        "gpu/store_place": "pinned host memory" if s.store == "cpu" else "disk",
        "gpu/chunk_size": s.chunk_size,
        "gpu/micro_batch": plan.micro_batch,
        "gpu/suffix_rows": s.suffix_rows,
        "gpu/activations": s.activations,
        "gpu/edges": s.edges,
        "gpu/mlp_tiles": s.mlp_tiles,
    }


def _device_used_mb() -> float:
    """The GPU's used memory, every process's: a driver query cheap enough for every step (nvidia-smi, the
    per-process figure without pynvml, starts a process of some 0.3 s, which a step's loader overlaps)."""
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**20


class _StepProbe:
    """A callback: the GPU's used memory after every step (process_peak_mb makes it this process's, context
    included), and the host-device synchronisations of the last step (torch's sync debug mode), written to `path`
    by thread and by where they happen, with torch.profiler's table of that step's kernels beside it
    (profile_last_step.txt). `syncs` counts all but the loader threads' (their waits for their own copies hold
    nothing back). No step waits for the GPU here: the memory readings need no wait, and a wait would stop the
    host from queueing the next step."""

    def __new__(cls, path: Path):
        import lightning as L

        class Probe(L.Callback):
            def __init__(self):
                self.used_mb: list[float] = []
                self.syncs = 0
                self.timeline: dict[str, float] = {}  # the profiled step's GPU busy times (onn/bench/timeline.py)
                self._seen: list[str] = []
                self._show = None

            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
                if trainer.global_step == trainer.max_steps - 1:  # the last step: count its syncs
                    import warnings

                    # started before the warnings are caught: its own (a first profile's note) is no sync
                    self._profiler = torch.profiler.profile(
                        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                    )
                    self._profiler.__enter__()
                    self._show, self._filters = warnings.showwarning, warnings.filters[:]
                    warnings.showwarning = lambda message, category, filename, lineno, *a, **k: self._seen.append(
                        (threading.current_thread().name, f"{filename}:{lineno}: {str(message).splitlines()[0]}")
                    )
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")

            def process_peak_mb(self) -> float:
                """This process's GPU memory at the steps' highest: the most used memory a step ended with, less
                what other processes hold, taken once after the steps (process_gpu_mb's per-process figure against
                the used memory of the same moment; 0 where it falls back to the used memory itself)."""
                from onn.hardware.profile import process_gpu_mb

                used, own = _device_used_mb(), process_gpu_mb()
                return max(self.used_mb) - max(0.0, used - own)

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
                if self._show is not None:
                    import collections
                    import warnings

                    torch.cuda.set_sync_debug_mode("default")
                    warnings.showwarning, self._show = self._show, None
                    warnings.filters[:] = self._filters
                    torch.cuda.synchronize()
                    self._profiler.__exit__(None, None, None)
                    self.timeline = gpu_timeline(self._profiler.events())
                    table = self._profiler.key_averages().table(sort_by="cuda_time_total", row_limit=30)
                    path.with_name("profile_last_step.txt").write_text(table)
                    counts = collections.Counter(self._seen)
                    # the step's: the training thread's and autograd's (CastMatmul's backward runs on its threads)
                    self.syncs = sum(
                        n
                        for (thread, where), n in counts.items()
                        if "synchroniz" in where and not thread.startswith("onn-prefetch")
                    )
                    path.write_text(
                        "".join(f"{n} x [{thread}] {where}\n" for (thread, where), n in counts.most_common())
                    )
                self.used_mb.append(_device_used_mb())

        return Probe()


def _matmul_rate(job, rows: int) -> float:
    """The bf16 matmul rate now for the model's largest block weight at a micro-batch's `rows` (FLOP/s): its
    samples x the width its batch held."""
    from onn.hardware.profile import gpu_seconds
    from onn.models.layers import discover
    from onn.models.load import meta_model

    block = discover(meta_model(job.config.model)).blocks[0]
    out_features, in_features = max(
        (m.weight.shape for m in block.modules() if isinstance(m, torch.nn.Linear)), key=lambda s: s.numel()
    )
    dtype = getattr(torch, job.plan.streaming.compute_dtype)
    weight = torch.randn(out_features, in_features, device=job.device, dtype=dtype)
    x = torch.randn(rows, in_features, device=job.device, dtype=dtype)
    seconds = gpu_seconds(lambda: torch.nn.functional.linear(x, weight), trials=7, min_s=0.05)
    return 2 * rows * out_features * in_features / seconds


def _prompts(job, tokenizer) -> list[list[int]]:
    from onn.bench.giant import _prompts as held_out_prompts

    return held_out_prompts(job.config, tokenizer, job.config.task.gen_batch)


def _timed_generation(generate, prompts: list[list[int]], pad_id: int) -> dict[str, Any]:
    """`generate(ids, mask, on_token)` for 1 prompt and for all: the time of each new token after the first
    (whose step also reads the prompt), and tokens per second over the whole generation. Each token's time
    stamp waits for the GPU to finish it (accelerate's streamer reads each token to the host anyway)."""
    from onn.bench.giant import _left_padded

    out = {}
    for key, batch in (("b1", prompts[:1]), ("bn", prompts)):
        ids, mask = _left_padded(batch, pad_id)
        stamps = [time.perf_counter()]

        def stamp(*_, stamps=stamps) -> None:
            torch.cuda.synchronize()
            stamps.append(time.perf_counter())

        generate(ids, mask, stamp)
        steps = [b - a for a, b in itertools.pairwise(stamps)]
        out[key] = {
            "token_s": statistics.median(steps[1:]),
            "tokens_per_s": len(batch) * len(steps) / (stamps[-1] - stamps[0]),
            "first_s": steps[0],
        }
    return out


def _generate(job, module, tokenizer, prompts: list[list[int]]) -> dict[str, Any]:
    """ONN's streamed generation from the store the steps trained on."""
    from onn.modalities.text.tasks import streaming_settings
    from onn.streaming.strategy import build_engine

    config, plan, tokens = job.config, job.plan, job.config.task.gen_tokens
    settings = streaming_settings(config, plan, generate=True, sequences=len(prompts))
    module.model.to(job.device)  # Lightning's teardown left what is not streamed on the CPU
    engine = build_engine(module.model, settings, module.store, job.device, micro_batch=None)
    module.model.eval()
    torch.cuda.reset_peak_memory_stats()
    timed = _timed_generation(
        lambda ids, mask, on_token: engine.generate(ids, mask, tokens, on_token=on_token),
        prompts,
        tokenizer.pad_token_id,
    )
    engine.close()
    return {
        "gpu/gen_tokens": tokens,
        "gpu/gen_batch": len(prompts),
        "gpu/gen_b1_token_s": round(timed["b1"]["token_s"], 4),
        "gpu/gen_bn_token_s": round(timed["bn"]["token_s"], 4),
        "gpu/gen_b1_tokens_per_s": round(timed["b1"]["tokens_per_s"], 3),
        "gpu/gen_bn_tokens_per_s": round(timed["bn"]["tokens_per_s"], 3),
        "gpu/gen_bn_over_b1": round(timed["bn"]["token_s"] / timed["b1"]["token_s"], 3),
        "gpu/gen_peak_allocated_mb": round(torch.cuda.max_memory_allocated() / MB, 1),
    }


def _plain_state(job, module) -> dict[str, torch.Tensor]:
    """The model's frozen weights as a plain (un-adapted) model names them, de-quantized to the compute
    dtype on the CPU: the blocks from the store, the edges from the store or the model."""
    from onn.models.layers import discover
    from onn.streaming.store import stored_name

    store, dtype = module.store, getattr(torch, job.plan.streaming.compute_dtype)
    paths = discover(module.model).block_paths
    plain = "base_model.model."
    state = {}
    for i, path in enumerate(paths):
        for name, t in store.decode(store.read(i), torch.device("cpu"), dtype).items():
            state[f"{path}.{name}".replace(plain, "", 1)] = t
    if store.is_complete("edges"):
        for name, t in store.decode(store.read("edges"), torch.device("cpu"), dtype).items():
            state[name.replace(plain, "", 1)] = t
    for name, p in module.model.named_parameters():
        plain_name = stored_name(name).replace(plain, "", 1)
        if p.numel() and not p.requires_grad and plain_name not in state:
            state[plain_name] = p.data.to("cpu", dtype)
    module.store = None
    return state


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _accelerate(
    job, state: dict[str, torch.Tensor], tokenizer, prompts: list[list[int]], ours: dict[str, Any]
) -> dict[str, Any]:
    """accelerate's device_map="auto" at the same budget: the layers that fit on the GPU, the rest offloaded
    to host memory and copied in module by module as the forward reaches them."""
    from accelerate import dispatch_model, infer_auto_device_map, init_empty_weights

    from onn.models.load import architecture, auto_class

    config, plan, tokens = job.config, job.plan, job.config.task.gen_tokens
    gpu_mb = int(plan.budget_mb - plan.context_mb - 1024)
    if gpu_mb <= 0:  # accelerate would place nothing on the GPU, and fail on the inputs given there
        said = f"hardware.budget_mb={plan.budget_mb:g} leaves accelerate no GPU memory beside the context and 1 GB"
        return {"gpu/vs_accelerate": f"not measured: {said}"}
    dtype = getattr(torch, plan.streaming.compute_dtype)
    arch = architecture(config.model)
    with init_empty_weights(include_buffers=False):
        model = auto_class(arch).from_config(arch, dtype=dtype)
    missing = set(dict(model.named_parameters())) - set(state)
    if missing:
        raise RuntimeError(f"accelerate's copy lacks {sorted(missing)[:3]}")
    model.load_state_dict(state, strict=False, assign=True)
    del state
    # accelerate sizes the layers it places on the GPU by max_memory and leaves its own temporaries out (its
    # docs ask for headroom): the allocator's cap is lifted for it, max_memory keeps the budget less the
    # context and 1 GB for those, and its peak is reported beside
    torch.cuda.set_per_process_memory_fraction(1.0)
    host_mb = int(job.hardware.host_memory_available_mb * 0.9)
    device_map = infer_auto_device_map(
        model,
        max_memory={torch.cuda.current_device(): f"{gpu_mb}MiB", "cpu": f"{host_mb}MiB"},
        no_split_module_classes=model._no_split_modules,
        dtype=dtype,
    )
    model = dispatch_model(model, device_map=device_map).eval()
    on_gpu = sum(1 for where in device_map.values() if where == torch.cuda.current_device())

    class Stamps:  # a generation streamer: put() per new token (the first call is the prompt)
        def __init__(self, on_token):
            self.on_token, self.calls = on_token, 0

        def put(self, value):
            self.calls += 1
            if self.calls > 1:
                self.on_token()

        def end(self):
            pass

    def generate(ids, mask, on_token):
        with torch.no_grad():
            model.generate(
                input_ids=ids.to(torch.cuda.current_device()),
                attention_mask=mask.to(torch.cuda.current_device()),
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                streamer=Stamps(on_token),
            )

    torch.cuda.reset_peak_memory_stats()
    timed = _timed_generation(generate, prompts, tokenizer.pad_token_id)
    return {
        "gpu/accelerate_modules_on_gpu": on_gpu,
        "gpu/accelerate_modules": len(device_map),
        "gpu/accelerate_b1_tokens_per_s": round(timed["b1"]["tokens_per_s"], 3),
        "gpu/accelerate_bn_tokens_per_s": round(timed["bn"]["tokens_per_s"], 3),
        "gpu/accelerate_peak_allocated_mb": round(torch.cuda.max_memory_allocated() / MB, 1),
        "gpu/vs_accelerate": round(ours["gpu/gen_bn_tokens_per_s"] / timed["bn"]["tokens_per_s"], 2),
        "gpu/vs_accelerate_b1": round(ours["gpu/gen_b1_tokens_per_s"] / timed["b1"]["tokens_per_s"], 2),
    }


# bench_gpu's names for each child run's figures (ours: theirs)
OVERHEAD_FIGURES = {
    "gpu/default_job_ratio": "overhead/ratio",
    "gpu/default_job_steps_per_s": "overhead/onn_steps_per_s",
    "gpu/plain_loop_steps_per_s": "overhead/plain_steps_per_s",
}
VISION_FIGURES = {
    "gpu/vision_runner_overhead": "vision/runner_overhead",
    "gpu/vision_lightning_floor": "vision/lightning_floor",
    "gpu/vision_onn_samples_per_s": "vision/onn_samples_per_s",
    "gpu/vision_plain_samples_per_s": "vision/plain_samples_per_s",
}


def _overheads(job) -> dict[str, Any]:
    """The default job against a plain loop, and bench_vision's runner overhead, each a run of its own, within what
    is left of task.time_limit_s (from the process's start). Two children of CHILD_TIMEOUT_S each took the recipe
    past its 8 minutes."""
    task: BenchGpuTask = job.config.task
    source = Path(str(task.vision_source)).expanduser()
    children = [("overhead", ["task=bench_overhead", "tracking=none"], OVERHEAD_FIGURES)]
    if source.exists():
        children.append(("vision", ["recipe=bench_vision", f"data.source={source}"], VISION_FIGURES))
    out = _run_children(job, children, _deadline(task))
    if not source.exists():
        out["gpu/vision_runner_overhead"] = (
            f"not measured: task.vision_source {source} does not exist (scripts/gpu_check.sh: docs/gpu.md)"
        )
    else:
        out["gpu/vision_source"] = str(source)  # which images the image runner's figures were measured on
    return out


def child_limit_s(
    left: float, children: int, least_s: float = LEAST_CHILD_S, most_s: float = CHILD_TIMEOUT_S
) -> float | None:
    """The seconds a child may run of the `left` ones, `children` (it included) still to run: an even share, but
    at least `least_s` where that is left (of 100 s, one runs) and at most `most_s`; None (not started) where less
    than `least_s` is left."""
    limit_s = min(most_s, max(left / children, min(left, least_s)))
    return limit_s if limit_s >= least_s else None


def _run_children(
    job,
    children: list[tuple[str, list[str], dict[str, str]]],
    deadline: float,
    least_s: float = LEAST_CHILD_S,
    most_s: float = CHILD_TIMEOUT_S,
) -> dict[str, Any]:
    """Each child (name, overrides, its figures' names) in turn until `deadline` (time.time()'s clock), each for
    child_limit_s of what is left, so a child's unused time goes to the next: their figures, and for one not
    started, or stopped at its limit, or failed, a first figure that says so."""
    out = {}
    for i, (name, overrides, names) in enumerate(children):
        limit_s = child_limit_s(deadline - time.time(), len(children) - i, least_s, most_s)
        if limit_s is None:
            time_limit_s = job.config.task.time_limit_s
            out.update(_missing(names, f"less than {least_s:g} s of task.time_limit_s={time_limit_s} was left for it"))
            continue
        ran = _child(job, name, overrides, limit_s)
        out.update(_figures(ran, names) if ran["status"] == "ok" else _missing(names, ran["error"]))
        for count in ("device_ops_per_step", "host_waits_per_step") if name == "vision" else ():
            sides = ran.get(f"vision/{count}") or {}  # absent when the child failed or compiled its model
            out.update({f"gpu/vision_{count}_{side}": n for side, n in sides.items()})  # each a figure of bench_gpu.md
    return out


def _missing(names: dict[str, str], why: str) -> dict[str, Any]:
    """A child's figures where it measured nothing: the first says why, the others are None."""
    return {**dict.fromkeys(names), next(iter(names)): f"not measured: {why}"}


def _figures(ran: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """A child run's figures under bench_gpu's names (ours: theirs); None for each when the child did not finish."""
    if ran["status"] != "ok":
        log.warning("bench_gpu: a child run did not finish (%s): %s", ran["status"], ran["error"])
        return dict.fromkeys(names)
    return {ours: ran[theirs] for ours, theirs in names.items()}


def _child(job, name: str, overrides: list[str], limit_s: float = CHILD_TIMEOUT_S) -> dict[str, Any]:
    """A run.py of its own (its own process, config and GPU memory), its output in NAME.log, stopped with all it
    started after `limit_s`; its metrics.json."""
    folder = job.run_dir / name
    paths = job.config.paths
    root = Path(paths.root)
    command = [
        sys.executable,
        str(root / "run.py"),
        *overrides,
        f"hydra.run.dir={folder}",
        f"paths.outputs={paths.outputs}",
        f"paths.cache={paths.cache}",
    ]
    with (job.run_dir / f"{name}.log").open("w") as output:
        # a session of its own: a stop reaches every process it started (DataLoader and compile workers)
        proc = subprocess.Popen(
            command, cwd=root, env=os.environ.copy(), stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
        if not _waited(proc, limit_s):
            log.warning("bench_gpu: %s ran past its %.0f s and was stopped", name, limit_s)
            return {"status": "failed", "error": f"{name} ran past its {limit_s:.0f} s and was stopped; see {name}.log"}
    try:
        ran = json.loads((folder / "metrics.json").read_text())
    except (OSError, ValueError):
        return {
            "status": "failed",
            "error": f"{name} left no metrics.json (exit {proc.returncode}); see {name}.log",
        }
    if ran["status"] == "running":  # it ended without its last record: killed (the OOM killer, a signal)
        return {
            "status": "crashed",
            "error": f"{name} stopped without its last record (exit {proc.returncode}: killed?); see {name}.log",
        }
    return ran


def _waited(proc: subprocess.Popen, limit_s: float) -> bool:
    """Whether `proc` (a session leader) ended within `limit_s`. If not, or if this process is interrupted while
    waiting, its whole session is killed: subprocess's own timeout killed the leader alone, and what it had started
    ran on, orphaned."""
    try:
        proc.wait(timeout=limit_s)
        return True
    except subprocess.TimeoutExpired:
        return False
    finally:
        if proc.returncode is None:  # not yet reaped: its pid, and so its session's id, is still its own
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _write(job, out: dict[str, Any]) -> None:
    """bench_gpu.md: the figures so far (a bench stopped midway keeps what it measured)."""
    rows = [f"| {k.removeprefix('gpu/')} | {v} |" for k, v in out.items() if not isinstance(v, dict | list)]
    text = (
        f"# bench_gpu: {job.spec.name} on {out.get('gpu/device')}\n\n| figure | value |\n| --- | --- |\n"
        + "\n".join(rows)
        + "\n"
    )
    (job.run_dir / "bench_gpu.md").write_text(text)
    (job.run_dir / "bench_gpu.json").write_text(json.dumps(out, indent=1, default=str))
