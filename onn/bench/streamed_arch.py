"""`task=bench_streamed_arch`: a DiT and an LSTM stack streamed under a budget several times smaller than their
blocks, against the plan (recipe=bench_streamed_arch; docs/streaming.md, "Models other than language models").

For each architecture (task.archs):

  arch/<a>/blocks_mb          the blocks' float32 weights (what streams)
  arch/<a>/budget_mb          the step's budget: blocks_mb / task.budget_ratio (the process's own memory aside)
  arch/<a>/ratio              blocks_mb / budget_mb
  arch/<a>/planned_mb         the plan's step memory (network_streaming, disk store, the chunk it picks)
  arch/<a>/measured_mb        per optimizer step: peak anonymous RSS above the process's baseline (taken after
                              the imports and torch's threads, before the model is built, as the plan's context is)
  arch/<a>/error              per step: measured / planned - 1
  arch/<a>/max_error          the largest |error| (the first step holds no AdamW moments yet: they appear at its
                              optimizer step, after its activations are freed; the plan counts them)
  arch/<a>/peak_mb            the peak over the steps, what the process needs
  arch/<a>/peak_error         peak_mb / planned_mb - 1: the plan's error on it
  arch/<a>/fits               the plan fits the budget
  arch/<a>/step_s             each step's seconds
  arch/<a>/grad_max_abs_diff  one step's gradients of what trains, streamed against resident

Each measurement runs in a fresh interpreter that imports only what the step needs: what a host process
imported before changes its RSS, and that belongs to the process, not to the step.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from onn.config import as_dict, typed
from onn.config.model import DenoiserConfig
from onn.config.strategy import StrategyConfig
from onn.config.task import BenchStreamedArchTask
from onn.errors import UserError
from onn.streaming.engine import Objective
from onn.training.classifier import ClassifierObjective

MB = 2**20
ARCHS = ("dit", "lstm")
SIZES = {  # each architecture's sizes (task.*): a stack, a batch or an image of none ends in torch's traceback
    "dit": ("image_size", "dit_layers", "dit_heads", "dit_batch"),
    "lstm": ("lstm_layers", "lstm_hidden", "lstm_mels", "lstm_frames", "lstm_batch"),
}
PATCH = 4  # the DiT's patch side (build)
ROOT = Path(__file__).resolve().parents[2]  # the folder holding the onn package


def build(arch: str, t: BenchStreamedArchTask, strategy: StrategyConfig) -> tuple[torch.nn.Module, tuple, Objective]:
    """The model ready to stream (what trains has requires_grad), one sample for the meta-device plan, and its
    objective. The DiT as recipe=dit_streamed builds it (LoRA on every block's linears, output layers trained);
    the LSTM stack (onn/models/zoo/recurrent.py AudioRNN) with its recurrent weight matrices frozen and streamed,
    its biases and the head trained (an LSTM has no linear layer for LoRA; the prefix before the blocks runs
    without grad when streamed, so its projection stays frozen)."""
    if arch == "dit":
        from onn.modalities.diffusion.module import NoisePrediction, build_denoiser
        from onn.modalities.diffusion.tasks import adapted

        kwargs = {"num_layers": t.dit_layers, "num_attention_heads": t.dit_heads, "attention_head_dim": 64}
        model_cfg = DenoiserConfig(
            name="dit", architecture="dit", kwargs={**kwargs, "patch_size": PATCH, "norm_num_groups": 32}, ema_decay=0.0
        )
        config = SimpleNamespace(model=model_cfg, strategy=strategy)
        model = adapted(build_denoiser(model_cfg, 1, [t.image_size, t.image_size]), config)
        sample = (torch.empty(1, 1, t.image_size, t.image_size), torch.zeros(1, dtype=torch.long))
        return model, sample, NoisePrediction()
    if arch == "lstm":
        from onn.models.zoo.recurrent import AudioRNN

        model = AudioRNN(1, 10, t.lstm_mels, hidden=t.lstm_hidden, layers=t.lstm_layers, dropout=0.0)
        for name, p in model.named_parameters():
            p.requires_grad_(name.startswith("classifier") or (name.startswith("layers.") and ".bias_" in name))
        return model, (torch.empty(1, 1, t.lstm_mels, t.lstm_frames),), ClassifierObjective(F.cross_entropy)
    raise ValueError(f"unknown architecture {arch!r}")  # check_settings names the choices first


def check_settings(config) -> None:
    """task.archs names architectures this bench builds, task.steps measures at least one step and the budget is
    a share of the blocks: one sentence otherwise, before anything runs."""
    t: BenchStreamedArchTask = config.task
    unknown = [a for a in t.archs if a not in ARCHS]
    if unknown or not t.archs:
        raise UserError(f"task.archs={list(t.archs)}: choose among {', '.join(ARCHS)}.")
    if t.steps < 1:
        raise UserError(f"task.steps={t.steps!r}: give a whole number of steps to measure, 1 or more.")
    if t.budget_ratio <= 0:
        raise UserError(
            f"task.budget_ratio={t.budget_ratio!r}: give a number above 0, the blocks' size over the step's budget."
        )
    for arch in dict.fromkeys(t.archs):  # the sizes of the architectures it builds; the others are not read
        for key in SIZES[arch]:
            if getattr(t, key) < 1:
                raise UserError(
                    f"task.{key}={getattr(t, key)!r}: task.archs lists {arch}; give a whole number, 1 or more."
                )
    if "dit" in t.archs and t.image_size % PATCH:
        raise UserError(
            f"task.image_size={t.image_size}: the DiT cuts its images into {PATCH}x{PATCH} patches; give a multiple "
            f"of {PATCH}."
        )


def batches(arch: str, t: BenchStreamedArchTask) -> list[dict[str, torch.Tensor]]:
    """One macro-batch, seeded: noisy images with their timesteps and noise; spectrograms (one clip shorter: packed
    sequences of different lengths) with their labels."""
    g = torch.Generator().manual_seed(2)
    if arch == "dit":
        shape = (t.dit_batch, 1, t.image_size, t.image_size)
        return [
            {
                "sample": torch.randn(shape, generator=g),
                "timestep": torch.randint(0, 1000, (t.dit_batch,), generator=g),
                "noise": torch.randn(shape, generator=g),
            }
        ]
    x = torch.randn(t.lstm_batch, 1, t.lstm_mels, t.lstm_frames, generator=g)
    x[0, :, :, t.lstm_frames // 2 :] = x.min()  # silence after half the clip: a shorter sequence
    return [{"x": x, "y": torch.randint(0, 10, (t.lstm_batch,), generator=g)}]


def planned(arch: str, t: BenchStreamedArchTask, strategy: StrategyConfig) -> dict[str, Any]:
    """The plan's streaming setting and step memory for `arch` under a budget task.budget_ratio times smaller than
    its blocks, with a disk store (network_streaming, as make_network_streaming_plan runs it)."""
    from onn.hardware.profile import Profile
    from onn.planning.spec import network_spec
    from onn.planning.streaming import FixedStreaming, network_streaming, peak

    with torch.device("meta"):
        model, sample, _ = build(arch, t, strategy)
    spec = network_spec(model, sample, arch, pretrained=False)
    blocks_mb = sum(spec.block_params) * 4 / MB
    budget_mb = blocks_mb / t.budget_ratio
    hw = Profile(name="budget", accelerator="cpu", source="preset", host_memory_available_mb=budget_mb)
    batch = t.dit_batch if arch == "dit" else t.lstm_batch
    plan, memory = network_streaming(spec, hw, batch, budget_mb * MB, FixedStreaming(store="disk"), 8)
    return {
        "blocks": spec.n_blocks,
        "blocks_mb": round(blocks_mb, 1),
        "budget_mb": round(budget_mb, 1),
        "ratio": round(blocks_mb / budget_mb, 2),
        "chunk_size": plan.chunk_size,
        "planned_mb": round(peak(memory) / MB, 3),
        "fits": plan.refused is None,
        "plan_parts_mb": {k: round(v / MB, 1) for k, v in memory.items()},
    }


def step_memory(spec: dict[str, Any]) -> dict[str, list[float]]:
    """In a fresh interpreter: the peak anonymous RSS of each of task.steps optimizer steps (the engine's forward
    and backward, AdamW's step, zero_grad) above the baseline taken before the model is built ("mb"), and each
    step's seconds ("s")."""
    import gc

    from onn.hardware.memory import PeakMemory, anon_rss_mb, hold_mmap_threshold
    from onn.models.layers import discover
    from onn.streaming.engine import StreamingEngine
    from onn.streaming.store import LayerStore

    t = typed(BenchStreamedArchTask, spec["task"], "bench_streamed_arch's step process: task")
    strategy = typed(StrategyConfig, spec["strategy"], "bench_streamed_arch's step process: strategy")
    with torch.device("meta"):  # the imports a build makes (diffusers, peft) belong to the process's baseline
        build(spec["arch"], t, strategy)
    torch.ones(64, 64) @ torch.ones(64, 64)  # and so do torch's threads
    torch.manual_seed(0)
    gc.collect()
    base = anon_rss_mb()
    hold_mmap_threshold()  # before the weights are built, as a streamed denoiser's training run does
    model, _, objective = build(spec["arch"], t, strategy)
    store = LayerStore("disk", "float32", folder=Path(spec["store"]))
    engine = StreamingEngine(model, discover(model), store, int(spec["chunk_size"]), objective=objective)
    engine.offload()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    data = batches(spec["arch"], t)
    measured: dict[str, list[float]] = {"mb": [], "s": []}
    for _ in range(t.steps):
        start = time.perf_counter()
        with PeakMemory("cpu", interval_s=0.002) as peak:
            engine.train_step(data)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        measured["s"].append(round(time.perf_counter() - start, 3))
        measured["mb"].append(round(peak.peak_mb - base, 3))
    engine.close()
    return measured


def gradient_difference(arch: str, t: BenchStreamedArchTask, strategy: StrategyConfig, chunk: int) -> float:
    """One step's largest absolute difference between the streamed and the resident model's gradients."""
    from onn.models.layers import discover
    from onn.streaming.engine import StreamingEngine
    from onn.streaming.store import LayerStore

    torch.manual_seed(0)
    resident, _, objective = build(arch, t, strategy)
    for name, p in resident.named_parameters():  # random adapters, so every one has a gradient
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    streamed = copy.deepcopy(resident)
    data = batches(arch, t)
    total = sum(objective.weight(b) for b in data)
    for b in data:
        (objective.loss(resident(**objective.inputs(b)), b) * objective.weight(b) / total).backward()
    with tempfile.TemporaryDirectory() as folder:
        engine = StreamingEngine(
            streamed, discover(streamed), LayerStore("disk", "float32", folder=Path(folder)), chunk, objective=objective
        )
        engine.offload()
        engine.train_step(data)
        engine.close()
    want = {n: p.grad for n, p in resident.named_parameters() if p.grad is not None}
    got = {n: p.grad for n, p in streamed.named_parameters() if p.grad is not None}
    if want.keys() != got.keys():
        raise RuntimeError(f"{arch}: the streamed step trained {len(got)} tensors, the resident {len(want)}")
    return max(float((want[n] - got[n]).abs().max()) for n in want)


def run(job) -> dict[str, Any]:
    config = job.config
    t: BenchStreamedArchTask = config.task
    out: dict[str, Any] = {}
    for arch in t.archs:
        plan = planned(arch, t, config.strategy)
        with tempfile.TemporaryDirectory(dir=Path(config.paths.cache)) as store:
            spec = {
                "arch": arch,
                "task": as_dict(t),
                "strategy": as_dict(config.strategy),
                "store": store,
                "chunk_size": plan["chunk_size"],
            }
            steps = _in_fresh_process(spec)
        measured = steps["mb"]
        errors = [round(m / plan["planned_mb"] - 1, 3) for m in measured]
        grad = gradient_difference(arch, t, config.strategy, plan["chunk_size"])
        figures = {
            **plan,
            "measured_mb": measured,
            "error": errors,
            "max_error": max(abs(e) for e in errors),
            "peak_mb": max(measured),
            "peak_error": round(max(measured) / plan["planned_mb"] - 1, 3),
            "step_s": steps["s"],
            "grad_max_abs_diff": grad,
        }
        out.update({f"arch/{arch}/{k}": v for k, v in figures.items()})
    _write_table(job.run_dir, t.archs, out)
    return out


def _in_fresh_process(spec: dict[str, Any]) -> dict[str, list[float]]:
    done = subprocess.run(
        [sys.executable, "-m", "onn.bench.streamed_arch"],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        check=False,
        # this checkout's onn first, whichever one the interpreter would find by itself
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.getenv("PYTHONPATH", "")])},
    )
    if done.returncode != 0:
        raise RuntimeError(f"the step-memory measurement failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _write_table(run_dir: Path, archs: list[str], out: dict[str, Any]) -> None:
    columns = "arch | blocks MB | budget MB | ratio | chunk | planned MB | measured MB per step | error per step"
    rows = [f"| {columns} | peak error | max abs gradient diff |", "|" + " --- |" * 10]
    for a in archs:
        f = {k.split("/")[-1]: v for k, v in out.items() if k.startswith(f"arch/{a}/")}
        rows.append(
            f"| {a} | {f['blocks_mb']} | {f['budget_mb']} | {f['ratio']} | {f['chunk_size']} | {f['planned_mb']} | "
            f"{', '.join(map(str, f['measured_mb']))} | {', '.join(f'{e:+.1%}' for e in f['error'])} | "
            f"{f['peak_error']:+.1%} | {f['grad_max_abs_diff']:.2e} |"
        )
    (run_dir / "bench_streamed_arch.md").write_text(
        "# Streamed architectures against the plan\n\n" + "\n".join(rows) + "\n"
    )
    print("\n".join(rows))


if __name__ == "__main__":  # the fresh process of _in_fresh_process
    print(json.dumps(step_memory(json.loads(sys.stdin.read()))))
