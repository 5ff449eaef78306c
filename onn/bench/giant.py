"""`task=bench_giant` (recipe=bench_giant): a model larger than RAM, fine-tuned and generating on this
machine from a layer store on disk, measured against what the disk and the cores allow.

Every phase runs in a process of its own, forked from a warm interpreter that imported torch once
(onn/bench/child.py), whose anonymous RSS the parent samples (so a phase killed on purpose still has its
peak), in this order:

  disk       the disk's cold sequential read bandwidth now (a fresh file of task.disk_probe_mb, O_DIRECT, at
             most a quarter of the memory available), and the matmul rate now, for the model's own widest
             weight at the step's rows
  build      the store written block by block from scratch (task.rebuild), killed with SIGKILL after
             task.kill_build_after blocks and started again: the second build writes only what is missing
  train      a validation of the held-out set (data.builtin.val_size samples, one streamed pass), then
             steps on one fixed batch (data.builtin.train_size = data.batch_size); the process is killed
             with SIGKILL after task.kill_after steps (their checkpoint written) and training resumes
             from last.ckpt in a new process up to task.steps; after each step (outside its time) the
             matmul rate again, on the resident chunk's widest weight at the step's rows
  generate   greedy tokens for 1 prompt and for task.gen_batch prompts, from the same store
  accelerate the same model, prompts and token count through accelerate's disk_offload, reading the same
             safetensors files (no copy): what users reach for today

Figures (metrics.json, and bench_giant.md beside it):
  giant/limit_s            max(bytes read per step / disk bandwidth, matmul FLOPs per step / matmul rate),
                           the rate measured after each step (giant/matmul_gflops_steps, their mean): a
                           shared host's rate moves from minute to minute (giant/matmul_gflops: at the start)
  giant/limit_efficiency   limit_s / step_s: how close a step comes to what the disk and the cores allow
  giant/read_efficiency    the rate a step's reads ran at (bytes / time in reads) over the disk's bandwidth
  giant/memory_error, giant/step_time_error   measured / predicted - 1
and the rest named in the issue (see `run`).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from onn.bench import child
from onn.config import ONNConfig, as_dict
from onn.config.task import BenchGiantTask
from onn.errors import UserError
from onn.hardware.disk import write_text_atomically
from onn.hardware.profile import disk_read_mb_s
from onn.planning.plan import STREAMING_LIGHTNING, Plan
from onn.training.callbacks import batch_rows

MB = 1024**2


def check_settings(config: ONNConfig) -> None:
    """The task's values and the model's settings, before anything is measured or written."""
    task: BenchGiantTask = config.task
    for key in ("steps", "kill_after", "gen_batch", "gen_tokens", "disk_probe_mb", "kill_build_after"):
        if getattr(task, key) < 1:
            raise UserError(f"task.{key}={getattr(task, key)!r}: give a whole number, 1 or more.")
    if task.kill_after >= task.steps:
        raise UserError(
            f"task.kill_after={task.kill_after} must be below task.steps={task.steps}: the run resumes after it."
        )
    if task.gen_tokens < 2:
        raise UserError("task.gen_tokens must be 2 or more: the first token's step also reads the prompt.")
    if config.strategy.name != "sparse_lora" or config.strategy.lightning not in STREAMING_LIGHTNING:
        raise UserError(
            f"task=bench_giant measures layer streaming: use strategy=sparse_lora with strategy.lightning=streaming, "
            f"not strategy={config.strategy.name} with strategy.lightning={config.strategy.lightning}."
        )


def run(job) -> dict[str, Any]:
    config, plan, hw, spec, run_dir = job.config, job.plan, job.hardware, job.spec, job.run_dir
    check_settings(config)
    streaming = plan.streaming
    if streaming.store != "disk":
        raise UserError(
            f"the plan keeps {spec.name}'s store in host memory (it fits): bench_giant measures a store on disk; "
            "set strategy.streaming.store=disk."
        )
    from onn.modalities.text.tasks import store_root

    task: BenchGiantTask = config.task
    store_dir = store_root(config) / streaming.store_dtype
    out: dict[str, Any] = {
        "giant/params": spec.params,
        "giant/store_dtype": streaming.store_dtype,
        "giant/load_avg_start": [round(x, 2) for x in os.getloadavg()],
        "giant/cpu_busy_cores_at_plan": hw.cpu_busy_cores,
    }
    started = time.perf_counter()
    # the disk and the cores, now
    out["giant/disk_read_mb_s"] = disk_now(config)
    out["giant/disk_read_mb_s_profile"] = hw.disk_read_mb_s
    rate = _child("matmul", _request(job), run_dir)["result"]
    out["giant/matmul_gflops"] = rate["gflops"]
    out["giant/matmul_shape"] = [rate["rows"], *rate["shape"]]
    out.update(_build_phase(job, store_dir))
    out.update(
        _train_phase(
            job, max(out["giant/disk_read_mb_s"], out["giant/disk_read_mb_s_store"]), out["giant/matmul_gflops"]
        )
    )
    out.update(_generation_phase(job))
    if not task.keep_store:
        shutil.rmtree(store_dir, ignore_errors=True)
    out["giant/bench_s"] = round(time.perf_counter() - started, 1)
    out["giant/load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    _write_table(run_dir, out, plan)
    return out


def disk_now(config: ONNConfig) -> float:
    """The disk's cold read bandwidth now (MB/s), as hardware=auto measures it: a fresh file of task.disk_probe_mb
    under paths.cache, read whole into memory, so at most a quarter of the memory available (the 2 GB default, on a
    machine with less memory than the model, met the OOM killer), and one sentence where it cannot be written."""
    return disk_read_mb_s(Path(config.paths.cache), config.task.disk_probe_mb, measurer="task=bench_giant")


def _build_phase(job, store_dir: Path) -> dict[str, Any]:
    """The store built from scratch (task.rebuild), killed with SIGKILL after task.kill_build_after blocks and
    built again; then the disk again, on the store's own files: a plain sequential pass (no compute) over the
    blocks a step streams (the larger of the two disk figures is the bandwidth the step is held to)."""
    task: BenchGiantTask = job.config.task
    run_dir = job.run_dir
    if task.rebuild:
        shutil.rmtree(store_dir, ignore_errors=True)
    request = _request(job)
    killed = _child("build", request, run_dir, kill_when=lambda: _done_blocks(store_dir) >= task.kill_build_after)
    first_blocks = _done_blocks(store_dir)
    build = _child("build", request, run_dir)
    passed = _child("read_store", {**request, "limit_gb": task.disk_probe_mb * 4 / 1024}, run_dir)["result"]
    return {
        "giant/build_s": round(killed["wall_s"] + build["wall_s"], 1),
        "giant/build_peak_rss_mb": round(max(killed["peak_rss_mb"], build["peak_rss_mb"]), 1),
        "giant/build_killed_after_blocks": first_blocks,
        "giant/build_resumed_blocks": build["result"]["written"],
        "giant/store_gb": round(sum(f.stat().st_size for f in store_dir.glob("*.safetensors")) / 2**30, 2),
        "giant/disk_read_mb_s_store": round(passed["mb_s"], 1),
    }


def _train_phase(job, disk_mb_s: float, start_gflops: float) -> dict[str, Any]:
    """A validation, then the steps: the first process killed with SIGKILL after task.kill_after steps, the
    second resuming from last.ckpt; the steps measured against what the disk and the cores allow."""
    task: BenchGiantTask = job.config.task
    run_dir = job.run_dir
    request, train_dir = _request(job), run_dir / "train"
    first = _child(
        "train",
        {**request, "run_dir": str(train_dir), "validate": True, "max_steps": task.steps, "ckpt": None},
        run_dir,
        kill_when=lambda: _steps_done(train_dir) >= task.kill_after,
    )
    killed_at = _steps_done(train_dir)
    ckpt = train_dir / "checkpoints" / "last.ckpt"
    if not ckpt.exists():
        raise RuntimeError(f"the first training process left no checkpoint at {ckpt}; see {run_dir}/train.log")
    second = _child(
        "train",
        {**request, "run_dir": str(train_dir), "validate": False, "max_steps": task.steps, "ckpt": str(ckpt)},
        run_dir,
    )
    rows = _progress(train_dir)
    steps = [s for s in rows if "step_s" in s]  # a training step's row (step 0 holds the validation)
    out, read_bytes, step_s = _step_figures(job, steps, disk_mb_s, start_gflops)
    predicted_peak = job.plan.predicted_peak_memory_mb + second["result"]["baseline_mb"]
    peak = max(first["peak_rss_mb"], second["peak_rss_mb"])
    val = next(s for s in rows if "val_s" in s)
    losses = [s["loss"] for s in steps]
    out.update(
        {
            "giant/steps": len(steps),
            "giant/killed_after_step": killed_at,
            "giant/train_killed": first["killed"],
            "giant/resumed_at_step": second["result"]["resumed_at_step"],
            "giant/peak_rss_mb": round(peak, 1),
            "giant/baseline_mb": round(second["result"]["baseline_mb"], 1),
            "giant/predicted_peak_mb": round(predicted_peak, 1),
            "giant/memory_error": round(peak / predicted_peak - 1, 3),
            "giant/loss_first": round(losses[0], 4),
            "giant/loss_last": round(losses[-1], 4),
            "giant/loss_curve": [round(x, 4) for x in losses],
            "giant/val_samples": val["val_samples"],
            "giant/val_s": round(val["val_s"], 1),
            "giant/val_read_gb": round(val["val_read_bytes"] / 2**30, 2),
            "giant/val_loss": round(val["val_loss"], 4),
            "giant/val_read_over_step_read": round(val["val_read_bytes"] / read_bytes, 3) if read_bytes else None,
            "giant/val_over_step": round(val["val_s"] / step_s, 2),
        }
    )
    return out


def _step_figures(
    job, steps: list[dict[str, Any]], disk_mb_s: float, start_gflops: float
) -> tuple[dict[str, Any], float, float]:
    """The timed steps (a process's first step fills its block cache, so after the first process's it is
    not timed) against limit_s = max(bytes read / disk bandwidth, matmul FLOPs / the cores' rate around
    the steps, measured after each; the rate at the start when none was). The FLOPs are those of the samples and
    width each step's batch held (padded to its longest), not data.max_length's, which only caps them: counted
    there, a step of short samples was held to work it never had. Also the bytes a step read and its time,
    unrounded."""
    from onn.planning.costs import streaming_step_flops

    plan, spec = job.plan, job.spec
    timed = [s for s in steps if not (s["first_in_process"] and s["step"] > 1)]
    step_s = statistics.mean(s["step_s"] for s in timed)
    read_bytes = statistics.mean(s["read_bytes"] for s in timed)
    read_s = statistics.mean(s["read_s"] for s in timed)
    flops = statistics.mean(streaming_step_flops(spec, s["width"], s["rows"], plan.sparse_layers) for s in timed)
    disk_bw = disk_mb_s * MB
    rates = [s["matmul_gflops"] for s in timed if s["matmul_gflops"]]
    gflops = statistics.mean(rates) if rates else start_gflops
    limit_s = max(read_bytes / disk_bw, flops / (gflops * 1e9))
    return (
        {
            "giant/matmul_gflops_steps": round(gflops, 1) if rates else None,
            "giant/step_s": round(step_s, 4),
            "giant/io_s": round(statistics.mean(s["io_s"] for s in timed), 4),
            "giant/compute_s": round(statistics.mean(s["compute_s"] for s in timed), 4),
            "giant/step_read_gb": round(read_bytes / 2**30, 2),
            "giant/read_mb_s": round(read_bytes / MB / read_s, 1) if read_s else None,
            "giant/read_efficiency": round(read_bytes / read_s / disk_bw, 3) if read_s else None,
            "giant/step_gflop": round(flops / 1e9, 1),
            "giant/limit_s": round(limit_s, 4),
            "giant/limit_bound": "disk" if read_bytes / disk_bw >= flops / (gflops * 1e9) else "compute",
            "giant/limit_efficiency": round(limit_s / step_s, 3),
            "giant/predicted_step_s": plan.predicted_step_s,
            "giant/step_time_error": round(step_s / plan.predicted_step_s - 1, 3),
        },
        read_bytes,
        step_s,
    )


def _generation_phase(job) -> dict[str, Any]:
    """ONN's generation for 1 and for task.gen_batch prompts, then accelerate's on the same files."""
    task: BenchGiantTask = job.config.task
    run_dir = job.run_dir
    request = {**_request(job), "batch": task.gen_batch, "tokens": task.gen_tokens}
    gen = _child("generate", request, run_dir)
    g = gen["result"]
    out = {
        **generation_figures(g, task.gen_batch),
        "giant/gen_peak_rss_mb": round(gen["peak_rss_mb"], 1),
        "giant/gen_chunk_size": g["chunk_size"],
        "giant/gen_cache_blocks": g["cache_blocks"],
    }
    if task.accelerate:
        acc = _child("accelerate", {**request, "prompts": g["prompts"]}, run_dir)
        a = acc["result"]
        out.update(
            {
                "giant/accelerate_tokens_per_s": round(a["tokens_per_s"], 4),
                "giant/accelerate_s_per_token": round(a["token_s"], 2),
                "giant/vs_accelerate": round(g["bn"]["tokens_per_s"] / a["tokens_per_s"], 2),
                "giant/vs_accelerate_per_token": round(a["token_s"] / g["bn"]["token_s"], 2),
                "giant/accelerate_same_tokens": a["tokens"] == g["bn"]["tokens"],
                "giant/accelerate_peak_rss_mb": round(acc["peak_rss_mb"], 1),
            }
        )
    return out


def generation_figures(generated: dict[str, Any], gen_batch: int) -> dict[str, Any]:
    """The generate phase's times for 1 prompt and for `gen_batch` (task.gen_batch), each key named by the batch it
    measured: the ratio was named b8 whatever the batch was."""
    b1, bn = generated["b1"], generated["bn"]
    return {
        "giant/gen_s_per_token_b1": round(b1["token_s"], 4),
        f"giant/gen_s_per_token_b{gen_batch}": round(bn["token_s"], 4),
        f"giant/gen_b{gen_batch}_over_b1": round(bn["token_s"] / b1["token_s"], 3),
        "giant/gen_tokens_per_s": round(bn["tokens_per_s"], 4),
    }


def _request(job) -> dict[str, Any]:
    """What every phase's process is sent: the config as plain values (rebuilt typed in `_main`), the plan."""
    return {"config": as_dict(job.config), "plan": job.plan.as_dict()}


def _done_blocks(folder: Path) -> int:
    return len(list(folder.glob("block_*.done"))) if folder.is_dir() else 0


def _progress(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "progress.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by_step: dict[int, dict[str, Any]] = {}
    for row in rows:  # a step the kill interrupted may be run again after the resume: the last one counts
        by_step[row["step"]] = {**by_step.get(row["step"], {}), **row}
    return [by_step[k] for k in sorted(by_step)]


def _steps_done(run_dir: Path) -> int:
    """Steps the run's last.ckpt holds (written atomically after each step)."""
    from onn.training.checkpoints import read_meta

    try:
        return int(read_meta(run_dir / "checkpoints" / "last.ckpt")["global_step"])
    except (OSError, ValueError):
        return 0


def _child(phase: str, request: dict[str, Any], run_dir: Path, kill_when=None) -> dict[str, Any]:
    """Run one phase in a process of its own (`child.start`), sampling its anonymous RSS; with `kill_when`,
    SIGKILL it as soon as that returns True. Returns {result, peak_rss_mb, wall_s, killed}."""
    run_dir.mkdir(parents=True, exist_ok=True)
    result = run_dir / f"{phase}.json"
    result.unlink(missing_ok=True)
    start = time.perf_counter()
    peak, killed = 0.0, False
    proc = child.start(
        "onn.bench.giant", [phase, str(result)], run_dir / f"{phase}.log", json.dumps(request, default=str)
    )
    try:
        while proc.is_alive():
            peak = max(peak, _rss_anon_mb(proc.pid))
            if kill_when is not None and not killed and kill_when():
                proc.kill()  # SIGKILL
                killed = True
            time.sleep(0.1)
    finally:  # the bench stopped (SIGTERM, an error): its phase stops with it
        if proc.is_alive():
            proc.kill()
        proc.join()
    wall = time.perf_counter() - start
    if killed:
        return {"result": None, "peak_rss_mb": peak, "wall_s": wall, "killed": True}
    if proc.exitcode != 0 or not result.is_file():
        tail = (run_dir / f"{phase}.log").read_text()[-3000:]
        raise RuntimeError(
            f"bench_giant phase '{phase}' failed (exit {proc.exitcode}); {run_dir / (phase + '.log')}:\n{tail}"
        )
    body = json.loads(result.read_text())
    if "error" in body:  # the phase's UserError, said in its own words
        raise UserError(body["error"])
    return {
        "result": body,
        "peak_rss_mb": max(peak, body["peak_rss_mb"]),
        "wall_s": wall,
        "killed": False,
    }


def _rss_anon_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


# -- the phases, each in its own process --------------------------------------------------------------
def _matmul(request: dict[str, Any]) -> dict[str, Any]:
    """The matmul rate now for the model's largest block weight at the step's rows, in the plan's compute
    dtype on the plan's threads: the best of short trials, as the profile measures."""
    import torch

    from onn.hardware.profile import _best_rate, use_threads
    from onn.models.layers import discover
    from onn.models.load import meta_model

    plan, config = request["plan"], request["config"]
    use_threads(plan.threads)
    block = discover(meta_model(config.model)).blocks[0]
    out_features, in_features = max(
        (m.weight.shape for m in block.modules() if isinstance(m, torch.nn.Linear)), key=lambda s: s.numel()
    )
    dtype = getattr(torch, plan.streaming.compute_dtype)
    rows = plan.micro_batch * plan.sequence_length
    weight = torch.randn(out_features, in_features).to(dtype)
    x = torch.randn(rows, in_features).to(dtype)
    rate = _best_rate(
        2 * rows * out_features * in_features,
        lambda: torch.nn.functional.linear(x, weight),
        trials=7,
        min_s=0.2,
    )
    return {"gflops": round(rate / 1e9, 1), "rows": rows, "shape": [out_features, in_features]}


def _read_store(request: dict[str, Any]) -> dict[str, Any]:
    """Read the store's uncached blocks (up to limit_gb) one after the other into one buffer, O_DIRECT,
    nothing else running: the disk's sequential bandwidth on the files the steps stream."""
    from onn.hardware.disk import buffer
    from onn.modalities.text.tasks import store_root, streaming_settings
    from onn.streaming.schedule import cached_blocks
    from onn.streaming.strategy import layer_store

    config, plan = request["config"], request["plan"]
    settings = streaming_settings(config, plan)
    store = layer_store(settings, store_root(config))
    blocks = sorted(int(p.stem.split("_")[1]) for p in store.folder.glob("block_*.done"))
    cached = set(cached_blocks(len(blocks), int(settings.cache_blocks)))
    blocks = [i for i in blocks if i not in cached] or blocks
    into = buffer(max(store.file_bytes(i) for i in blocks))
    read_s, total = store.read_s, 0
    for i in blocks:
        store.read(i, into=into)
        total += store.file_bytes(i)
        if total >= float(request["limit_gb"]) * 2**30:
            break
    # the store's own read clock: a block's first read in a process also hashes its bytes, which is not the disk's
    return {"mb_s": total / MB / (store.read_s - read_s), "gb": total / 2**30, "direct": store.direct}


def _build(request: dict[str, Any]) -> dict[str, Any]:
    from onn.modalities.text.tasks import store_root, streaming_settings, weights_dtype
    from onn.streaming.loader import load_into_store
    from onn.streaming.strategy import layer_store

    config, plan = request["config"], request["plan"]
    settings = streaming_settings(config, plan)
    store = layer_store(settings, store_root(config))
    start = time.perf_counter()
    load_into_store(config.model, weights_dtype(config, plan), config.paths.cache, store)
    return {"written": len(store.rebuilt), "build_s": time.perf_counter() - start}


def _progress_callback(path: Path, micro_batch: int):
    """A Lightning callback writing one JSON line per optimizer step to `path`, after the step's
    checkpoint: time, weight wait, compute, bytes read, loss, the samples and width its batch held, and the
    matmul rate right after it (at a micro-batch's rows: up to `micro_batch` samples x the width); the first step
    of a process is marked (it fills the block cache, so its reads are not a steady step's)."""
    import lightning as L

    class Progress(L.Callback):
        def __init__(self):
            self.t0, self.before, self.steps = 0.0, None, 0

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            t = module.engine.times
            self.before = (t.io_s, t.compute_s, t.read_bytes, t.read_s)
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            t = module.engine.times
            row = {
                "step": trainer.global_step,
                "step_s": time.perf_counter() - self.t0,
                "io_s": t.io_s - self.before[0],
                "compute_s": t.compute_s - self.before[1],
                "read_bytes": t.read_bytes - self.before[2],
                "read_s": t.read_s - self.before[3],
                "loss": module.train_losses[-1],
                "rows": batch_rows(batch),
                "width": int(batch["input_ids"].shape[1]),
                "first_in_process": self.steps == 0,
            }
            self.steps += 1
            row["matmul_gflops"] = _matmul_after_step(module.engine, min(micro_batch, row["rows"]) * row["width"])
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")

    return Progress()


def _matmul_after_step(engine, rows: int) -> float | None:
    """The cores' matmul rate right after a step (outside its time), on the largest weight of the chunk
    still resident (the step's own weight, shape and dtype) at the step's rows, best of three short
    trials. A shared host's rate moves from minute to minute (1,043 and 634 GFLOP/s for the same matmul
    ten minutes apart here), so each step is held to the rate the cores gave around it."""
    import torch

    from onn.hardware.profile import _best_rate

    weights = engine.resident_weights()
    if not weights:
        return None
    weight = max(weights, key=lambda w: w.numel())
    x = torch.randn(rows, weight.shape[1]).to(weight.dtype)
    rate = _best_rate(2 * rows * weight.numel(), lambda: torch.nn.functional.linear(x, weight), trials=3, min_s=0.2)
    return round(rate / 1e9, 1)


def _train(request: dict[str, Any]) -> dict[str, Any]:
    import gc

    from onn.hardware.memory import anon_rss_mb
    from onn.hardware.profile import use_threads
    from onn.modalities.text.tasks import build, datamodule, trainer
    from onn.training.callbacks import StepCheckpoint

    config, plan = request["config"], request["plan"]
    run_dir = Path(request["run_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    use_threads(plan.threads)
    steps = int(request["max_steps"])
    config.trainer = dataclasses.replace(
        config.trainer,
        max_steps=steps,
        enable_progress_bar=False,
        enable_model_summary=False,
        val_check_interval=steps,
    )
    gc.collect()
    baseline = anon_rss_mb()
    progress = _progress_callback(run_dir / "progress.jsonl", plan.micro_batch)
    fit = trainer(config, plan, run_dir, [StepCheckpoint(run_dir / "checkpoints", 1), progress], loggers=False)
    module, tokenizer = build(config, plan)
    dm = datamodule(config, tokenizer)
    if request["validate"]:  # the first pass fills the block cache: it reads the whole store once
        start = time.perf_counter()
        fit.validate(module, datamodule=dm, verbose=False)
        row = {
            "step": 0,
            "val_s": time.perf_counter() - start,
            "val_read_bytes": module.engine.times.read_bytes,
            "val_samples": len(dm.val_set),
            "val_loss": module.val_losses[-1],
        }
        with open(run_dir / "progress.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
    fit.limit_val_batches = 0  # the validation above is the one measured
    module.train()
    fit.fit(module, datamodule=dm, ckpt_path=request["ckpt"])
    return {
        "baseline_mb": baseline,
        "global_step": fit.global_step,
        "resumed_at_step": fit.global_step - progress.steps,
    }


def _prompts(config: ONNConfig, tokenizer, count: int) -> list[list[int]]:
    """The held-out questions as token ids laid out as training lays them (example_prompt_ids: a plain-text model's
    BOS included, which its tokenizer may not add), cut from the left to data.max_length as training cuts them. The
    held-out set is the resident datamodule's (answered_splits: records with an empty answer left out, the split
    cut from answered records), and its layout the training data's: a held-out file of questions for a plain-text
    model is still prompted as plain text."""
    from onn.modalities.text.datamodule import answered_splits, example_prompt_ids
    from onn.modalities.text.prompts import Prompter

    data = config.data
    prompter = Prompter(data, tokenizer)  # the prompt format training uses
    _, (val, _) = answered_splits(prompter, data, config.seed)
    special, bos = prompter.add_special_tokens, prompter.starts_with_bos
    return [example_prompt_ids(tokenizer, p, special, bos)[-data.max_length :] for p, _ in val[:count]]


def _left_padded(prompts: list[list[int]], pad_id: int):
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def _generate(request: dict[str, Any]) -> dict[str, Any]:
    from onn.hardware.profile import use_threads
    from onn.modalities.text.tasks import build, streaming_settings
    from onn.streaming.strategy import build_engine

    config, plan = request["config"], request["plan"]
    use_threads(plan.threads)
    module, tokenizer = build(config, plan)
    settings = streaming_settings(config, plan, generate=True, sequences=int(request["batch"]))
    engine = build_engine(module.model, settings, module.store, "cpu", micro_batch=None)
    module.model.eval()
    prompts = _prompts(config, tokenizer, int(request["batch"]))
    out = {"prompts": prompts, "chunk_size": settings.chunk_size, "cache_blocks": settings.cache_blocks}
    for key, batch in (("b1", prompts[:1]), ("bn", prompts)):
        ids, mask = _left_padded(batch, tokenizer.pad_token_id)
        stamps = [time.perf_counter()]
        new = engine.generate(
            ids, mask, int(request["tokens"]), on_token=lambda t, stamps=stamps: stamps.append(time.perf_counter())
        )
        steps = [b - a for a, b in itertools.pairwise(stamps)]
        total = stamps[-1] - stamps[0]
        out[key] = {
            "first_s": steps[0],
            "token_s": statistics.median(steps[1:]),
            "total_s": total,
            "tokens_per_s": len(batch) * len(steps) / total,
            "tokens": new.tolist(),
        }
    engine.close()
    return out


def _offload_index(model: Any, layer_map: Any, folder: Path, blocks: Path) -> dict[str, dict[str, str]]:
    """accelerate's offload index: for every weight, the block file and name it has there, or the edges file."""
    index = {}
    for name, _ in model.named_parameters():
        block = next((i for i, p in enumerate(layer_map.block_paths) if name.startswith(p + ".")), None)
        if block is None:
            index[name] = {"safetensors_file": str(folder / "edges.safetensors"), "weight_name": name}
        else:
            index[name] = {
                "safetensors_file": str(blocks / f"block_{block:05d}.safetensors"),
                "weight_name": name[len(layer_map.block_paths[block]) + 1 :],
            }
    return index


def _accelerate(request: dict[str, Any]) -> dict[str, Any]:
    """accelerate's disk_offload over the layer store's own files: an index naming, for every weight,
    the block file and name it has there (and the prefix/suffix weights written once beside)."""
    import torch
    from accelerate import disk_offload, init_empty_weights
    from safetensors.torch import save_file

    from onn.hardware.disk import evict
    from onn.hardware.profile import use_threads
    from onn.modalities.text.tasks import build, store_root, weights_dtype
    from onn.models.layers import discover
    from onn.models.load import architecture, auto_class

    config, plan = request["config"], request["plan"]
    use_threads(plan.threads)
    dtype = weights_dtype(config, plan)
    module, tokenizer = build(config, plan)  # the prefix/suffix weights, as the run made them
    edges = {
        n: p.data.contiguous()
        for n, p in module.model.named_parameters()
        if p.numel() and not p.requires_grad and "lora_" not in n
    }
    folder = Path(config.paths.cache) / "bench_accelerate"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    base_names = {n.replace("base_model.model.", "", 1): t for n, t in edges.items()}
    save_file(base_names, str(folder / "edges.safetensors"))
    del module, edges, base_names
    with init_empty_weights(include_buffers=False):
        model = auto_class(architecture(config.model)).from_config(architecture(config.model), dtype=dtype)
    layer_map = discover(model)
    store_dtype = plan.streaming.store_dtype
    store = store_root(config) / store_dtype
    blocks = store
    if store_dtype not in ("bfloat16", "float16", "float32"):
        # accelerate reads float tensors only: the store's blocks, de-quantized to the weights dtype (the
        # numbers ONN computes with), written once beside; this needs the disk room of a bf16 store
        blocks = _float_copy(config, plan, folder, dtype)
    (folder / "index.json").write_text(json.dumps(_offload_index(model, layer_map, folder, blocks)))
    disk_offload(model, offload_dir=str(folder), execution_device=torch.device("cpu"))
    files = [*blocks.glob("*.safetensors"), folder / "edges.safetensors"]

    # every forward reads from the disk, as it must for a model larger than RAM (and the page cache
    # is left to the machine's other users)
    def from_disk(module, args) -> None:
        for f in files:
            evict(f)

    model.register_forward_pre_hook(from_disk)
    ids, mask = _left_padded(request["prompts"], tokenizer.pad_token_id)
    inputs = {"input_ids": ids, "attention_mask": mask}
    stamps = []
    model.register_forward_hook(lambda m, a, o: stamps.append(time.perf_counter()))
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=int(request["tokens"]),
            min_new_tokens=int(request["tokens"]),
            do_sample=False,
            eos_token_id=None,
            pad_token_id=tokenizer.pad_token_id,
        )
    total = time.perf_counter() - start
    new = out[:, inputs["input_ids"].shape[1] :]
    steps = [b - a for a, b in itertools.pairwise([start, *stamps])]
    shutil.rmtree(folder, ignore_errors=True)
    return {
        "tokens_per_s": new.numel() / total,
        "token_s": statistics.median(steps[1:]) if len(steps) > 1 else total,
        "total_s": total,
        "tokens": new.tolist(),
    }


def _float_copy(config: ONNConfig, plan: Plan, folder: Path, dtype) -> Path:
    """The store's blocks de-quantized into `folder`/blocks as plain safetensors files, one at a time."""
    import torch

    from onn.modalities.text.tasks import store_root, streaming_settings
    from onn.streaming.store import DISK_RESERVE_BYTES, human_bytes, write_safetensors
    from onn.streaming.strategy import layer_store

    store = layer_store(streaming_settings(config, plan), store_root(config))
    blocks = sorted(int(p.stem.split("_")[1]) for p in store.folder.glob("block_*.done"))
    out = folder / "blocks"
    out.mkdir(parents=True, exist_ok=True)
    for i in blocks:
        tensors = store.decode(store.read(i), torch.device("cpu"), dtype)
        need = sum(t.numel() * t.element_size() for t in tensors.values()) * (len(blocks) - i)
        if shutil.disk_usage(out).free < need + DISK_RESERVE_BYTES:
            raise UserError(
                f"accelerate's copy of the model needs {human_bytes(need)} more under {out}: free some disk, "
                "or task.accelerate=false."
            )
        write_safetensors(out / f"block_{i:05d}.safetensors", tensors)  # synced and out of the page cache
    return out


PHASES = {
    "matmul": _matmul,
    "read_store": _read_store,
    "build": _build,
    "train": _train,
    "generate": _generate,
    "accelerate": _accelerate,
}


def _write_table(run_dir: Path, out: dict[str, Any], plan: Plan) -> None:
    rows = [
        f"| {k.removeprefix('giant/')} | {v} |"
        for k, v in out.items()
        if not isinstance(v, dict | list) or k.endswith("load_avg_start")
    ]
    s = plan.streaming
    text = (
        f"# Giant: {plan.model['name']} ({out['giant/params'] / 1e9:.1f}B parameters) on this machine\n\n"
        f"Store: {s.store_dtype} on disk ({out.get('giant/store_gb')} GB), "
        f"{s.cache_blocks} blocks cached in RAM, chunk "
        f"{s.chunk_size}, compute in {s.compute_dtype} on {plan.threads} thread(s). "
        f"limit_s = max(bytes read per step / disk bandwidth, matmul FLOPs per step / matmul rate).\n\n"
        "| figure | value |\n| --- | --- |\n" + "\n".join(rows) + "\n"
    )
    (run_dir / "bench_giant.md").write_text(text)
    print(text, flush=True)


def _main() -> None:
    """Child side of `_child`: the phase's request on stdin, its result to argv[2]."""
    import logging

    phase, result = sys.argv[1], Path(sys.argv[2])
    if sys.platform == "linux":  # die with the bench, even when it is killed with SIGKILL
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    request = json.loads(sys.stdin.read())
    from onn.hardware.memory import PeakMemory
    from onn.planning.plan import Plan

    try:
        request["plan"] = Plan.from_dict(request["plan"])
        request["config"] = child.config_from_dict(request["config"], BenchGiantTask, f"bench_giant's {phase} process")
        with PeakMemory("cpu", interval_s=0.05) as peak:
            body = PHASES[phase](request)
        body["peak_rss_mb"] = peak.peak_mb
    except UserError as e:
        body = {"error": str(e)}
    write_text_atomically(result, json.dumps(body))


if __name__ == "__main__":
    _main()
