"""Choose strategy, micro-batch and precision for a model on a machine, and predict peak memory.

Sizes come from the model built on the meta device and its LayerMap, never from constants
keyed by model name. Every candidate (full, lora, qlora, sparse_lora) gets a breakdown:

  weights      frozen or master weights resident on the device (and LoRA adapters, fp32)
  trainable    the trainable weights' gradients
  optimizer    AdamW's two moments, fp32
  activations  what autograd keeps for backward: per layer and token ~ (10h + 4kv + 4i) elements
               (both norms' inputs and outputs, q and k before and after rotary embedding, v,
               attention output and its projection's input, MLP gate/up/act/down inputs: counted
               with saved-tensor hooks on HF Llama and Phi-3 layers) plus the logits (3 fp32
               copies: logits, log-softmax, gradient)
  workspace    5% of the above for allocator fragmentation and matmul temporaries, plus the bf16
               copies autocast makes of fp32 weights; on CPUs also the heap's overhead on
               activations (CPU_HEAP_OVERHEAD; STREAM_HEAP_OVERHEAD for a zero-copy stream)
  context      not allocated by the run but held: 1.5 GB for the CUDA context on GPUs; on CPUs
               the process's own resident memory (torch and Python), measured now

Gradients are allocated during backward while the saved activations are freed, layer by layer,
so with one micro-batch per step the peak holds the larger of the two, not both: peak = weights
+ optimizer + workspace + max(trainable, activations). When micro-batches accumulate, the first
one's gradients live through the next one's forward: the peak holds both.

sparse_lora is sized as ONN's layer-streaming engine: two slots of reused memory for the chunks
in flight (one computing, one loading: the disk read buffer, and the compute-dtype copy when the
store's dtype is not the compute dtype), the blocks of a disk store cached in host memory, prefix/
suffix resident or streamed, the kept chunk inputs of every micro-batch (on the device or the host),
one chunk's activations during recompute, LoRA state for the sparse layer set only. Every setting
that fits (store dtype and place, cached blocks, chunk, edges) gets a predicted step time, and the
fastest wins: see `_estimate_streaming`.

A candidate fits when its peak plus the context stays within the budget: the memory available
(with 5% headroom) or hardware.budget_mb as given.

Time (`compute_s`) comes from what the hardware profile measured on this machine, never from
constants: matmul FLOPs at the measured rate for their dtype and row count, on the threads the
plan runs (torch's threads are sized to the cores other processes leave free, and a core shared
with them counts at its share), plus the measured framework time per block call, plus the
optimizer's and activations' memory traffic at the measured memory bandwidth. A preset machine,
which cannot be measured, has its matmul_tflops figure only.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from onn.dtypes import BYTES_PER_VALUE as DTYPE_BYTES
from onn.errors import UserError
from onn.hardware.memory import anon_rss_mb
from onn.models.layers import resolve_indices
from onn.planning.spec import ModelSpec
from onn.planning.tuned import lookup
from onn.streaming.schedule import CAST_TILE_VALUES, cached_blocks, generates_from_codes

MB = 1024**2
# A preset GPU's CUDA context when the preset gives none (a measured profile has its own): CUDA 12-13 with
# lazy kernel loading, cuBLAS and the kernels a training step loads.
CUDA_CONTEXT_MB = 512
HEADROOM = 0.95  # use at most 95% of what is left after the context
# On CPUs the peak is resident memory, and glibc's heap holds on to the buffers autograd frees
# during backward while new ones of other sizes are taken: measured with task=bench (phi4_tiny,
# llama_small; full and LoRA; sequences of 64-96 tokens) as 0.5-1.0x the activations above the
# live tensors. A stream that decodes weights sets glibc's mmap threshold (StreamingEngine) and showed
# none of it; a zero-copy stream (the store in the compute dtype) keeps glibc's own threshold, and
# there the step's peak rose above the stored weights by 1.7x (phi4_tiny, float32, chunk 16) to 4.1x
# (llama_small, bf16-mixed, chunk 4) the counted activations (task=bench on recipe=equitable_grid; with
# MALLOC_MMAP_THRESHOLD_=4096, which frees at once, 0.85x to 1.9x): the heap kept as much again as the
# live tensors, and the backward's gradients sat beside the chunk's saved activations.
CPU_HEAP_OVERHEAD = 0.7
STREAM_HEAP_OVERHEAD = 2.0
# Bytes a counted activation element takes under bf16/fp16 autocast, relative to the compute dtype's: the
# norms keep float32 inputs and outputs (Phi-3's and Llama's RMSNorm compute in float32). Measured with
# saved-tensor hooks on HF Phi-3 and Llama layers under bf16 autocast: 2.4-2.6 bytes per counted element.
MIXED_ACTIVATION_FACTOR = 1.25
# On a GPU, streamed settings predicted within this share of the fastest step count as equally fast, and
# the one holding the least device memory wins: the prediction's own error is about this large, and a step
# bound by the host link gains nothing from memory it leaves unused (which other work, or a larger
# batch, can have).
GPU_TIE = 0.10
CANDIDATES = ("full", "lora", "qlora", "sparse_lora")
NETWORK_CANDIDATES = ("full", "linear_probe")
AUTO_ORDER = ("lora", "qlora", "sparse_lora")  # pretrained weights: the first that fits wins


@dataclass
class Estimate:
    strategy: str
    fits: bool
    micro_batch: int
    weights_mb: float
    trainable_mb: float
    optimizer_mb: float
    activations_mb: float
    workspace_mb: float
    context_mb: float
    note: str = ""
    streaming: dict[str, Any] = field(default_factory=dict)
    accumulates: bool = False  # several micro-batches per step: their gradients outlive each backward

    @property
    def peak_mb(self) -> float:
        """Predicted peak the run allocates itself (what torch.cuda.max_memory_allocated reports)."""
        if self.accumulates:
            held = self.trainable_mb + self.activations_mb
        else:
            held = max(self.trainable_mb, self.activations_mb)
        return self.weights_mb + self.optimizer_mb + self.workspace_mb + held


def make_network_plan(cfg: dict[str, Any], hw: dict[str, Any], spec: ModelSpec) -> dict[str, Any]:
    """The plan for a classifier network (images, audio, video, points): full training or a linear
    probe, the whole batch in one pass."""
    strategy_cfg, data_cfg = cfg["strategy"], cfg["data"]
    requested = strategy_cfg["name"]
    if requested not in ("auto", *NETWORK_CANDIDATES):
        raise UserError(
            f"strategy={requested}: classifiers train with strategy=full or strategy=linear_probe "
            "(the LoRA and streaming strategies are for language models)."
        )
    batch = int(data_cfg["batch_size"])
    precision = strategy_cfg["precision"]
    reasons = []
    if precision in (None, "auto") and hw["accelerator"] == "cpu" and hw.get("bf16"):
        precision = "bf16-mixed"  # oneDNN runs bf16 convolutions on AMX / AVX512-BF16: v28 trained 2x faster
        reasons.append("precision bf16-mixed: this CPU has bf16 matrix units (AMX / AVX512-BF16)")
    precision = choose_precision(hw) if precision in (None, "auto") else precision
    half = precision.startswith(("bf16", "16"))
    optimizer_bytes = 8 if cfg["optim"]["name"] == "adamw" else 4  # AdamW keeps two moments, SGD one
    ctx = context_mb(hw)
    estimates = {}
    for name in NETWORK_CANDIDATES:
        trainable = spec.params if name == "full" else spec.head_params
        # a probe's backbone runs once, without autograd, to cache features: one batch of activations
        activations = spec.sample_activation_bytes * batch * (0.5 if half else 1) if name == "full" else 0
        weights, grads, optim = spec.params * 4, trainable * 4, trainable * optimizer_bytes
        workspace = 0.05 * (weights + activations) + (
            CPU_HEAP_OVERHEAD * activations if hw["accelerator"] == "cpu" else 0
        )
        est = Estimate(name, False, batch, weights / MB, grads / MB, optim / MB, activations / MB, workspace / MB, ctx,
                       note="plus the resident dataset, measured when it is read")  # fmt: skip
        est.fits = fits(est, hw)
        estimates[name] = est
    if requested == "auto":
        chosen = "full"
        reasons.insert(
            0, "a classifier: train every weight (strategy=linear_probe trains a head on frozen features)"
        )
    else:
        chosen = requested
        reasons.insert(0, f"strategy={requested} was asked for")
    est = estimates[chosen]
    if not est.fits:
        reasons.append(
            f"WARNING: predicted {est.peak_mb + est.context_mb:,.0f} MB exceeds the {budget_mb(hw):,.0f} MB budget; lower data.batch_size"
        )
    tflops = float(hw.get("matmul_tflops") or 1.0)
    step_flops = spec.sample_flops * batch * (3 if chosen == "full" else 0)
    return {
        "strategy": chosen, "requested": requested, "reasons": reasons, "micro_batch": batch, "accumulate": 1,
        "precision": precision, "weights_dtype": "float32", "sequence_length": None,
        "predicted_peak_memory_mb": round(est.peak_mb, 1), "predicted_step_s": round(step_flops / (tflops * 1e12), 4),
        "context_mb": round(ctx, 1), "budget_mb": round(budget_mb(hw), 1), "sparse_layers": None,
        "gradient_checkpointing": False, "settings_source": "plan", "streaming": None,
        "hardware": hardware_summary(hw),
        "model": {"name": spec.name, "params": spec.params, "blocks": spec.n_blocks, "layer_map": spec.layer_map,
                  "pretrained": spec.pretrained, "flops_per_sample": spec.sample_flops,
                  "activation_bytes_per_sample": spec.sample_activation_bytes},
        "candidates": {name: {**{k: round(v, 1) if isinstance(v, float) else v for k, v in asdict(e).items()},
                              "peak_mb": round(e.peak_mb, 1)} for name, e in estimates.items()},
    }  # fmt: skip


def choose_precision(hw: dict[str, Any]) -> str:
    if hw["accelerator"] == "cuda":
        return "bf16-mixed" if hw.get("bf16") else "16-mixed"
    if hw["accelerator"] == "mps":
        return "16-mixed"
    # CPU autocast to bf16 measured 2x slower than fp32 here (Xeon with AVX512-BF16): casts cost
    # more than they save. Ask for it with strategy.precision=bf16-mixed.
    return "32-true"


def context_mb(hw: dict[str, Any]) -> float:
    """What the process holds before any model is built: the CUDA context (measured by the profile; a
    preset's own figure, or CUDA_CONTEXT_MB), or on CPUs the process's resident memory now."""
    if hw["accelerator"] == "cuda":
        return float(hw.get("cuda_context_mb") or CUDA_CONTEXT_MB)
    if hw.get("source") == "preset":
        return 600.0  # a preset machine cannot be measured: torch + Python's typical resident size
    return anon_rss_mb()


def budget_mb(hw: dict[str, Any]) -> float:
    """Memory the run may hold on its compute device, its context (CUDA context, or the process's own
    baseline) included: what is available with 5% headroom, or `hardware.budget_mb` as given."""
    if hw["accelerator"] == "cuda":
        total = hw.get("device_memory_free_mb") or hw["device_memory_mb"]
    else:  # CPU and unified memory: the host's available memory is the device
        total = hw.get("host_memory_available_mb") or hw.get("device_memory_mb") or hw["host_memory_mb"]
    total *= HEADROOM
    if hw.get("budget_mb"):
        total = min(total, float(hw["budget_mb"]))
    return total


def fits(est: Estimate, hw: dict[str, Any]) -> bool:
    """The prediction, context included, within the budget."""
    return est.peak_mb + est.context_mb <= budget_mb(hw)


def estimate(strategy: str, spec: ModelSpec, hw: dict[str, Any], seq: int, micro_batch: int, precision: str,
             sparse_layers: list[int], batch_size: int, store_dtype: str | None = None,
             streaming: dict[str, Any] | None = None, checkpointing: bool = False,
             present: dict[str, int] | None = None, where: str = "paths.cache") -> Estimate:  # fmt: skip
    """Predicted memory of one candidate at one micro-batch. With gradient checkpointing, autograd
    keeps only each block's input, and one block's activations exist at a time, during its recompute."""
    mixed = precision.endswith("mixed")
    half = 2 if (mixed or precision.startswith(("bf16", "16"))) else 4
    act_bytes = half
    frozen_bytes = half if hw["accelerator"] != "cpu" else (2 if precision.startswith("bf16") else 4)
    per_token_layer = 10 * spec.hidden + 4 * spec.kv_dim + 4 * spec.intermediate
    kept_layers = (
        spec.hidden * spec.n_blocks + per_token_layer if checkpointing else per_token_layer * spec.n_blocks
    )
    tokens = micro_batch * seq
    logits = tokens * spec.vocab * 4 * 3
    lora_all = sum(spec.lora_params_per_block)
    ctx = context_mb(hw)
    note = ""

    if strategy == "full":
        weights = spec.params * 4
        trainable = spec.params * 4
        optimizer = spec.params * 8
        activations = kept_layers * tokens * act_bytes + logits
        extra = spec.params * 2 if mixed else 0
    elif strategy in ("lora", "qlora"):
        if strategy == "qlora":
            if hw["accelerator"] == "mps":
                return Estimate(strategy, False, micro_batch, 0, 0, 0, 0, 0, ctx,
                                note="bitsandbytes' 4-bit layers run on CUDA GPUs and CPUs, not on Apple's MPS")  # fmt: skip
            # the blocks' linear layers in NF4; the rest (embeddings, norms, head) as the frozen weights are
            linear = sum(spec.linear_params_per_block)
            weights = linear * DTYPE_BYTES["nf4"] + (spec.params - linear) * frozen_bytes
        else:
            weights = spec.params * frozen_bytes
        weights += lora_all * 4  # fp32 adapters
        trainable = lora_all * 4
        optimizer = lora_all * 8
        activations = kept_layers * tokens * act_bytes + logits
        extra = 0
    elif strategy == "sparse_lora":
        return _estimate_streaming(spec, hw, seq, micro_batch, precision, sparse_layers, batch_size, per_token_layer, logits,
                                   ctx, store_dtype, streaming, present=present, where=where,
                                   prefetch=bool((streaming or {}).get("prefetch", True)))  # fmt: skip
    else:
        raise ValueError(strategy)
    workspace = 0.05 * (weights + max(trainable, activations) + optimizer) + extra
    if hw["accelerator"] == "cpu":
        workspace += CPU_HEAP_OVERHEAD * activations
    est = Estimate(
        strategy,
        False,
        micro_batch,
        weights / MB,
        trainable / MB,
        optimizer / MB,
        activations / MB,
        workspace / MB,
        ctx,
        note,
        accumulates=batch_size > micro_batch,
    )
    est.fits = fits(est, hw)
    return est


PRECISE_FIRST = ("float32", "bfloat16", "float16", "int8", "nf4")  # the tie-break between equally fast stores
STREAMING_KEYS = ("chunk_size", "store", "store_dtype", "edges", "activations", "cache_blocks", "eval_tokens")


def store_dtypes(hw: dict[str, Any], precision: str) -> list[str]:
    """Frozen-weight storage for streaming, most precise first: the compute dtype itself (a CPU then
    computes straight from the read buffer), a 2-byte float under a float32 compute (half the bytes,
    lossless for weights that were bf16), ONN's int8. nf4 is for when nothing else fits."""
    if hw["accelerator"] == "cuda":
        return ["bfloat16" if hw.get("bf16") else "float16", "int8", "nf4"]
    if precision == "32-true":
        return ["float32", "bfloat16", "int8", "nf4"]
    return ["bfloat16", "int8", "nf4"]


STREAMING_CHOICES = {"store": ("disk", "cpu"), "store_dtype": tuple(DTYPE_BYTES), "edges": ("resident", "stream"),
                     "activations": ("device", "host")}  # fmt: skip


def check_settings(cfg: dict[str, Any], hw: dict[str, Any]) -> None:
    """What a plan cannot be made from, in one sentence before any is made: strategy.streaming values, and
    a memory budget below what the process already holds (planned, it would be a negative budget)."""
    streaming = cfg["strategy"].get("streaming") or {}
    chunk = streaming.get("chunk_size", "auto")
    if chunk != "auto" and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise UserError(
            f"strategy.streaming.chunk_size={chunk!r}: give a whole number of blocks, 1 or more, or auto."
        )
    for key, choices in STREAMING_CHOICES.items():
        if streaming.get(key, "auto") not in ("auto", None, *choices):
            raise UserError(
                f"strategy.streaming.{key}={streaming[key]!r} is not one of auto, {', '.join(choices)}."
            )
    held = context_mb(hw)
    if budget_mb(hw) <= held:
        cause = (f"hardware.budget_mb={hw['budget_mb']:g} MB" if hw.get("budget_mb")
                 else f"this machine's available memory ({hw.get('host_memory_available_mb') or hw.get('device_memory_mb')} MB)")  # fmt: skip
        raise UserError(f"{cause} is below what the run holds before any model is built ({held:,.0f} MB: "
                        f"{'the CUDA context' if hw['accelerator'] == 'cuda' else 'Python, torch and the libraries'}); "
                        f"give a budget above {held:,.0f} MB.")  # fmt: skip


def compute_dtype_name(hw: dict[str, Any], precision: str) -> str:
    if precision == "32-true":
        return "float32"
    return "bfloat16" if precision.startswith("bf16") else "float16"


def threads_for(hw: dict[str, Any]) -> tuple[int, float]:
    """(threads, share): torch's thread count for the cores other processes leave free (at least one,
    at most OMP_NUM_THREADS when set), and the share of a core each thread gets: measured by the
    profile right now (`cpu_share`: busy threads of ours, timed), since the scheduler's split (fair per
    thread, or per session with autogroup) cannot be read off a count of the others' threads."""
    cores = int(hw.get("cpu_cores") or 1)
    busy = float(hw.get("cpu_busy_cores") or 0.0)
    threads = max(1, min(cores, math.floor(cores - busy + 0.5)))
    if hw.get("thread_limit"):
        threads = min(threads, int(hw["thread_limit"]))
    share = float(hw.get("cpu_share") or 1.0) if busy >= 0.25 else 1.0
    return threads, share


def matmul_rate(hw: dict[str, Any], dtype: str, rows: float, threads: int, size: float = 4096.0) -> float:
    """FLOP/s of a matmul with `rows` rows by a weight of about size x size, in `dtype`, on `threads`
    threads: the profile's measured tables (log-interpolated in rows and in weight size, linearly in
    threads), or a preset's matmul_tflops."""
    tables = hw.get("matmul_gflops") or {}
    if not tables or not all(dtype in t for t in tables.values()):
        return float(hw.get("matmul_tflops") or 0.1) * 1e12

    def log_interp(x: float, points: list[tuple[float, float]]) -> float:
        points = sorted(points)
        if x <= points[0][0]:
            return points[0][1]
        for (x0, v0), (x1, v1) in itertools.pairwise(points):
            if x <= x1:
                return v0 + (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0)) * (v1 - v0)
        return points[-1][1]

    def at(table: dict[str, dict[str, float]]) -> float:
        measured = sorted(int(t) for t in table)
        lo = max((t for t in measured if t <= threads), default=measured[0])
        hi = min((t for t in measured if t >= threads), default=measured[-1])
        a = log_interp(rows, [(int(r), float(v)) for r, v in table[str(lo)].items()])
        b = log_interp(rows, [(int(r), float(v)) for r, v in table[str(hi)].items()])
        return a if lo == hi else a + (threads - lo) / (hi - lo) * (b - a)

    def at_least_one_thread(table: dict[str, dict[str, float]]) -> float:
        # more threads never compute slower than one: a table measured on busy cores can say otherwise
        return max(
            at(table),
            log_interp(rows, [(int(r), float(v)) for r, v in table["1"].items()]) if "1" in table else 0.0,
        )

    return log_interp(size, [(float(s), at_least_one_thread(t[dtype])) for s, t in tables.items()]) * 1e9


def token_flops(spec: ModelSpec, seq: int) -> tuple[list[int], int]:
    """Forward matmul FLOPs per token: each block's (2 per weight, plus attention's 4 x seq x hidden),
    and the head's."""
    linear = spec.linear_params_per_block or spec.block_params
    per_block = [2 * p + 4 * seq * spec.hidden for p in linear]
    return per_block, 2 * spec.vocab * spec.hidden if spec.vocab else 2 * spec.suffix_params


def streaming_step_flops(spec: ModelSpec, seq: int, batch_size: int, trainable_layers: list[int]) -> float:
    """Matmul FLOPs of one streamed sparse-LoRA step: the forward of every block, the recompute and the
    input gradients from the lowest trainable block up, and the head's forward and input gradient."""
    per_block, head = token_flops(spec, seq)
    lowest = min(trainable_layers) if trainable_layers else len(per_block)
    return (sum(per_block) + 2 * sum(per_block[lowest:]) + 2 * head) * batch_size * seq


def compute_s(spec: ModelSpec, hw: dict[str, Any], strategy: str, seq: int, batch_size: int, micro_batch: int,
              trainable_layers: list[int], dtype: str = "float32", forward_group: int = 1, parts: bool = False):  # fmt: skip
    """Predicted compute time of one optimizer step on this machine, from what its profile measured.

    Matmuls: forward 2 FLOPs per weight per token plus attention's 4 x seq x hidden per token and
    block; full training adds input and weight gradients (2x forward); LoRA needs input gradients
    from the lowest trainable block up (1x those blocks' forward); streaming recomputes those blocks'
    forward as well, and runs its no-grad forward `forward_group` micro-batches at a time. Each at the
    measured rate for its dtype and row count on the plan's threads, times the share of the cores they
    get. Framework time: the measured time per block call, per micro-batch (`block_call_s`), and what a
    step costs besides. Memory traffic: the optimizer's (28 bytes per trainable weight: read p, g and
    two moments, write three) and the activations' (written in the forward, read in the backward) at
    the measured memory bandwidth. `parts`: (matmul time, the rest) instead of their sum."""
    threads, share = threads_for(hw)
    n = spec.n_blocks
    micro_batches = -(-batch_size // max(micro_batch, 1))
    rows, tokens = micro_batch * seq, batch_size * seq
    per_block, head = token_flops(spec, seq)
    lowest = min(trainable_layers) if trainable_layers else 0
    forward, upper = sum(per_block) * tokens, sum(per_block[lowest:]) * tokens
    linear = spec.linear_params_per_block or spec.block_params
    size = math.sqrt(max(linear) / 4)  # a block holds about four weights of its size

    def matmul(flops: float, m: float) -> float:
        return flops / (matmul_rate(hw, dtype, m, threads, size) * share)

    calls = hw.get("block_call_s") or {}
    half = dtype != "float32"
    act_bytes = (10 * spec.hidden + 4 * spec.kv_dim + 4 * spec.intermediate) * tokens * (2 if half else 4)
    if strategy == "full":
        time_s = matmul(3 * forward + 3 * head * tokens, rows)
        framework = calls.get("full", 0.0) * n * micro_batches
        trainable, with_grad = spec.params, n
    elif strategy == "sparse_lora":
        time_s = matmul(forward, forward_group * rows) + matmul(2 * upper + 2 * head * tokens, rows)
        lora_call = calls.get("lora_bf16" if half else "lora", 0.0)
        forward_call = calls.get("forward_bf16" if half else "forward", 0.0)
        framework = (
            forward_call * n * -(-micro_batches // forward_group) + lora_call * (n - lowest) * micro_batches
        )
        trainable, with_grad = sum(spec.lora_params_per_block[i] for i in trainable_layers), n - lowest
    else:
        time_s = matmul(forward + upper + 2 * head * tokens, rows)
        framework = calls.get("lora_bf16" if half else "lora", 0.0) * n * micro_batches
        trainable, with_grad = sum(spec.lora_params_per_block), n
    framework += calls.get("step", 0.0) * micro_batches
    bandwidth = float(hw.get("memory_gb_s") or 0) * 1e9
    traffic = (28 * trainable + 2 * act_bytes * with_grad) / bandwidth if bandwidth else 0.0
    if parts:
        return time_s, (framework + traffic) / share
    return time_s + (framework + traffic) / share


def _block_bytes(spec: ModelSpec, store_dtype: str) -> list[int]:
    """Each block's file size in a store of `store_dtype` (small tensors stay float32 when quantized)."""
    small = spec.block_params[0] - spec.linear_params_per_block[0] if spec.linear_params_per_block else 0
    per_value = DTYPE_BYTES[store_dtype]
    return [
        int((p - small) * per_value + small * (4 if store_dtype in ("int8", "nf4") else per_value))
        for p in spec.block_params
    ]


def _store_present_bytes(cfg: dict[str, Any], store_dtype: str) -> int:
    """Bytes of complete blocks already in this model's disk store of `store_dtype` (a build resumes there)."""
    folder = _store_folder(cfg) / store_dtype
    if not folder.is_dir():
        return 0
    return sum(f.stat().st_size for f in folder.glob("*.safetensors") if f.with_suffix(".done").is_file())


def _alternatives(found: list, best) -> list[dict[str, Any]]:
    """The fastest setting of every other store dtype and place, fastest first."""
    seen: dict[tuple, dict[str, Any]] = {}
    for f in sorted(found, key=lambda f: f[0]["step"]):
        key = (f[1], f[2])
        if f is not best and key != (best[1], best[2]) and key not in seen:
            seen[key] = {"store_dtype": f[1], "store": f[2], "edges": f[3], "chunk_size": f[5], "cache_blocks": f[6],
                         "predicted_step_s": round(f[0]["step"], 2)}  # fmt: skip
    return list(seen.values())


def _estimate_streaming(spec, hw, seq, micro_batch, precision, sparse_layers, batch_size, per_token_layer, logits, ctx,
                        store_dtype, fixed=None, present=None, prefetch=True, where="paths.cache") -> Estimate:  # fmt: skip
    """Layer streaming: every combination of settings that fits the budget (and the disk), each with a
    predicted step time; the fastest wins, the more precise store between two within 3% of each other.

    Settings: the store's dtype; its place (host memory, or disk with as many blocks cached in host
    memory as the budget leaves room for); prefix/suffix resident or streamed; kept activations on
    the device or the host (GPUs); the chunk size. Settings the config fixes (not `auto`) are taken
    as given. `present`: bytes already written per store dtype (a disk store only needs the rest)."""
    fixed = {k: v for k, v in (fixed or {}).items() if k in STREAMING_KEYS and v not in (None, "auto")}
    on_gpu = hw["accelerator"] == "cuda"
    cdtype = compute_dtype_name(hw, precision)
    compute_bytes = DTYPE_BYTES[cdtype]
    n = spec.n_blocks
    accumulate = max(1, -(-batch_size // micro_batch))
    lora = sum(spec.lora_params_per_block[i] for i in sparse_layers)
    lowest = min(sparse_layers) if sparse_layers else n
    budget = budget_mb(hw) * MB - ctx * MB
    block = max(spec.block_params)
    edge = (spec.prefix_params + spec.suffix_params) * compute_bytes
    dtypes = [store_dtype] if store_dtype else store_dtypes(hw, precision)
    disk_free = hw.get("disk_free_mb")
    threads, share = threads_for(hw)
    host_room = (hw.get("host_memory_available_mb") or hw.get("host_memory_mb") or 0) * MB * 0.8

    def options(key: str, default: list) -> list:
        return (
            [int(fixed[key]) if key in ("chunk_size", "cache_blocks") else fixed[key]]
            if key in fixed
            else default
        )

    shape = StreamShape(spec, hw, cdtype, seq, micro_batch, batch_size, sparse_layers, per_token_layer, logits,
                        prefetch)  # fmt: skip

    def memory(sd, store, edges, activations, chunk, cache, decoded=True) -> dict[str, float]:
        if on_gpu:
            return gpu_stream_memory(shape, sd, edges, activations, chunk)
        files = _block_bytes(spec, sd)
        zero_copy = not on_gpu and sd == cdtype or not decoded
        # On a CPU host memory is the device: a store held there counts in full, and so do cached blocks.
        held = (sum(files) if store == "cpu" else cache * max(files)) if not on_gpu else 0
        # Two slots of reused memory: the read buffer (disk, host memory) and the compute copy (unless
        # a CPU computes from the read buffer itself). On a GPU the read buffers are pinned host memory.
        raw = max(files) if store == "disk" and cache < n and not on_gpu else 0
        slots = 2 * chunk * (raw + (0 if zero_copy else block * compute_bytes))
        weights = held + slots + (edge if edges == "resident" or not on_gpu else 0)
        if edges == "stream" and on_gpu:
            weights = max(weights, edge)  # streamed edges load while no chunk is resident
        n_chunks = -(-n // chunk)
        # Kept per micro-batch: the input of every chunk from the lowest trainable one, the final
        # hidden state and the embeddings' output; with activations=host only the one in use.
        kept = (n_chunks - min(lowest // chunk, n_chunks) + 2) * accumulate if activations == "device" else 2
        tokens = micro_batch * seq
        acts = (kept * tokens * spec.hidden + per_token_layer * tokens * chunk) * compute_bytes + logits
        weights += lora * 4  # fp32 adapters
        trainable, optimizer = lora * 4, lora * 8
        workspace = 0.05 * (weights - held + max(trainable, acts) + optimizer)
        if not on_gpu and sd == cdtype and decoded:  # a zero-copy stream: glibc's heap keeps what it frees
            workspace += STREAM_HEAP_OVERHEAD * acts
        return {"weights": weights, "trainable": trainable, "optimizer": optimizer, "activations": acts,
                "workspace": workspace, "cached_block": max(files)}  # fmt: skip

    def peak(m: dict[str, float]) -> float:
        return m["weights"] + m["optimizer"] + m["workspace"] + max(m["trainable"], m["activations"])

    def host_cache(sd: str, store: str) -> int:
        """A GPU's disk store: the blocks host memory holds beside the run, pinned, read once."""
        if store != "disk" or "cache_blocks" in fixed:
            return int(fixed.get("cache_blocks", 0))
        return int(min(n, host_room // max(_block_bytes(spec, sd))))

    def timing(sd, store, edges, chunk, cache, activations="device") -> dict[str, float]:
        if on_gpu:
            rows = gpu_stream_memory(shape, sd, edges, activations, chunk)["suffix_rows"]
            return gpu_stream_timing(shape, sd, store, edges, activations, chunk, cache, rows)
        files = _block_bytes(spec, sd)
        chunks = [list(range(s, min(s + chunk, n))) for s in range(0, n, chunk)]
        low = min(lowest // chunk, len(chunks))
        # Loads per step, steady state: the forward's chunks (less the lowest trainable one, still
        # resident from the previous backward) and the backward's (less the last, still resident).
        forward = [c for c in range(len(chunks)) if edges == "stream" or c != low]
        backward = list(range(low, len(chunks) if edges == "stream" else len(chunks) - 1))
        loads = (
            [i for c in forward + backward for i in chunks[c]]
            if low < len(chunks)
            else [i for c in forward for i in chunks[c]]
        )
        cached = set(cached_blocks(n, cache, low * chunk if low < len(chunks) else n))
        disk = sum(files[i] for i in loads if store == "disk" and i not in cached)
        if edges == "stream":
            disk += 2 * edge * DTYPE_BYTES[sd] / compute_bytes if store == "disk" else 0
        io = disk / MB / float(hw.get("disk_read_mb_s") or 1000.0)
        if on_gpu:  # every load crosses the host link as stored
            io += sum(files[i] for i in loads) / MB / float(hw.get("h2d_mb_s") or 10000.0)
        decode = 0.0
        if not on_gpu and sd != cdtype:
            rate = (hw.get("decode_gvalues_s") or {}).get(f"{sd}->{cdtype}") or 1.0
            decode = sum(spec.block_params[i] for i in loads) / (rate * 1e9) / share
        compute = compute_s(spec, hw, "sparse_lora", seq, batch_size, micro_batch, sparse_layers, dtype=cdtype,
                            forward_group=chunk)  # fmt: skip
        # The loader's decoding takes CPU time from the compute's cores; its reads (DMA) do not.
        cpu = compute + decode
        step = max(io, cpu) if prefetch else io + cpu
        return {"step": step, "io": io, "compute": compute, "decode": decode, "disk_bytes": disk}

    found, refused = [], []
    for sd in options("store_dtype", dtypes):
        files = _block_bytes(spec, sd)
        missing = sum(files) - (present or {}).get(sd, 0)
        disk_ok = disk_free is None or missing + 2 * 1024**3 <= disk_free * MB
        # On a GPU the store sits in pinned host memory when the host has room for it, else on the disk with
        # as many blocks as fit cached in host memory; a fixed `store` is taken as given.
        stores = (["cpu"] if sum(files) <= host_room else ["disk"]) if on_gpu else ["cpu", "disk"]
        for store, edges, activations in itertools.product(options("store", stores), options("edges", ["resident", "stream"]),
                                                           options("activations", ["device", "host"] if on_gpu else ["device"])):  # fmt: skip
            if store == "disk" and not disk_ok:
                refused.append((sd, missing))
                continue
            for chunk in sorted(options("chunk_size", chunk_sizes(n)), reverse=True):
                m = memory(sd, store, edges, activations, chunk, 0)
                if store == "disk" and not on_gpu:
                    room = max(0.0, budget - peak(m)) // m["cached_block"]
                    cache = int(min(n, room)) if "cache_blocks" not in fixed else int(fixed["cache_blocks"])
                    m = memory(sd, store, edges, activations, chunk, cache)
                else:
                    cache = host_cache(sd, store) if on_gpu else 0
                if peak(m) > budget:
                    continue
                found.append(
                    (
                        timing(sd, store, edges, chunk, cache, activations),
                        sd,
                        store,
                        edges,
                        activations,
                        chunk,
                        cache,
                        m,
                    )
                )
    usable = [f for f in found if f[1] != "nf4"] or found  # nf4 costs precision: only when nothing else fits
    best = None
    if usable:
        fastest = min(f[0]["step"] for f in usable)
        near = [f for f in usable if f[0]["step"] <= fastest * (1 + (GPU_TIE if on_gpu else 0.03))]
        # between settings equally fast, the more precise store; on a GPU then the one that holds least of
        # its memory (a step bound by the host link gains nothing from more of it)
        best = min(near, key=lambda f: (PRECISE_FIRST.index(f[1]), peak(f[7]) if on_gpu else f[0]["step"]))
    refusal = None
    if best is None and refused:
        sd, missing = min(refused, key=lambda r: r[1])
        refusal = (
            f"not enough disk for the layer store: {spec.name} as {sd} needs {missing / 2**30:,.1f} GB more under "
            f"{where} and 2 GB must stay free, but the disk has {disk_free / 1024:,.1f} GB free; "
            "set paths.cache (or ONN_CACHE) to a disk with room, or a smaller strategy.streaming.store_dtype."
        )
    if best is None:  # nothing fits: report the smallest configuration, marked as not fitting
        sd = options("store_dtype", dtypes)[-1]
        store = fixed.get("store", "cpu" if on_gpu else "disk")
        edges = fixed.get("edges", "stream")
        activations = fixed.get("activations", "host" if on_gpu else "device")
        chunk = min(options("chunk_size", [1]))
        m = memory(sd, store, edges, activations, chunk, 0)
        best = (timing(sd, store, edges, chunk, 0), sd, store, edges, activations, chunk, 0, m)
    t, store_dtype, store, edges, activations, chunk, cache, m = best
    eval_tokens = fixed.get("eval_tokens")
    if eval_tokens is None:
        # validation holds every sample's hidden state (its input and output of a block) for one pass
        left = budget - peak(m) + max(m["trainable"], m["activations"])
        eval_tokens = int(
            max(micro_batch * seq, min(1_000_000, left // (2 * spec.hidden * compute_bytes + 1)))
        )
    # generation holds each sequence's KV cache (prompt and 64 new tokens) and its hidden state
    per_sequence = (n * 2 * spec.kv_dim + 2 * spec.hidden) * compute_bytes * (seq + 64) + spec.vocab * 4
    left = budget - peak(m) + max(m["trainable"], m["activations"])
    generate_batch = int(max(1, min(256, left // per_sequence)))
    # Generation (task=infer, exact match) reads the whole store once per token and computes little: one
    # block at a time, and every byte the training's activations, adapters and larger chunks held goes
    # to cached blocks instead, keeping room for `generate_batch` sequences.
    # From an int8 store's codes it holds no decoded block, only one weight cast at a time for a prefill.
    codes = not on_gpu and generates_from_codes(store_dtype, "cpu", cdtype)
    g = memory(store_dtype, store, edges, activations, 1, 0, decoded=not codes)
    scratch = min(block, 2 * spec.intermediate * spec.hidden) * compute_bytes if codes else 0
    room = budget - (g["weights"] - lora * 4) - 0.05 * g["weights"] - scratch - generate_batch * per_sequence
    generate_cache = (
        int(min(n, max(0.0, room) // g["cached_block"])) if store == "disk" and not on_gpu else cache
    )
    streaming = {
        "chunk_size": chunk,
        "store": store,
        "store_dtype": store_dtype,
        "edges": edges,
        "activations": activations,
        "cache_blocks": cache,
        "eval_tokens": int(eval_tokens),
        "generate_batch": generate_batch,
        "suffix_rows": int(m.get("suffix_rows") or micro_batch),  # rows whose loss (logits) runs at once
        "generate_cache_blocks": generate_cache,
        "generate_sequence_mb": round(per_sequence / MB, 3),  # what each of generate_batch sequences is given
        # what is left of generation's room below one more cached block
        "generate_spare_mb": round(max(0.0, room - generate_cache * g["cached_block"]) / MB, 3),
        "block_mb": round(g["cached_block"] / MB, 3),
        "compute_dtype": cdtype,
        "micro_batches_per_chunk": accumulate,
        "threads": threads,
        "predicted_io_s": round(t["io"], 3),
        "predicted_compute_s": round(t["compute"], 3),
        "predicted_decode_s": round(t["decode"], 3),
        "predicted_disk_read_gb": round(t["disk_bytes"] / 2**30, 2),
        "predicted_h2d_gb": round(t.get("h2d_bytes", 0) / 2**30, 2),  # copied to the GPU per step
        "store_gb": round(sum(_block_bytes(spec, store_dtype)) / 2**30, 2),
        "predicted_step_s": round(t["step"], 3),
        "refused": refusal,
        "alternatives": _alternatives(found, best),
    }  # fmt: skip
    est = Estimate("sparse_lora", False, micro_batch, m["weights"] / MB, m["trainable"] / MB, m["optimizer"] / MB, m["activations"] / MB,
                   m["workspace"] / MB, ctx, note=f"streams {chunk} block(s) at a time, frozen weights stored as {store_dtype}",
                   streaming=streaming, accumulates=batch_size > micro_batch)  # fmt: skip
    est.fits = fits(est, hw)
    return est


@dataclass
class StreamShape:
    """What a streamed step's size depends on besides its settings: the model, machine, compute dtype and
    batch (the planner's GPU model of a streamed step reads it)."""

    spec: ModelSpec
    hw: dict[str, Any]
    cdtype: str
    seq: int
    micro_batch: int
    batch_size: int
    sparse_layers: list[int]
    per_token_layer: int
    logits: float  # bytes of one micro-batch's logits, their log-softmax and gradient
    prefetch: bool = True

    @property
    def lowest(self) -> int:
        return min(self.sparse_layers) if self.sparse_layers else self.spec.n_blocks

    @property
    def micro_batches(self) -> int:
        return max(1, -(-self.batch_size // self.micro_batch))


def gpu_stream_memory(s: StreamShape, sd: str, edges: str, activations: str, chunk: int) -> dict[str, float]:
    """Device memory of a streamed step on a GPU, as its peak phase holds it: a chunk computing (two chunks
    of blocks on the device, the one computing and the one copying in; an int8 store's as codes with one
    cast tile), or the suffix (the head's weights, the logits of `suffix_rows` rows at a time: as many as
    keep the suffix within what a chunk holds). With edges streamed no chunk is resident while the suffix
    runs; the embeddings are looked up in host memory and never come to the device."""
    spec, cb = s.spec, DTYPE_BYTES[s.cdtype]
    files = _block_bytes(spec, sd)
    codes = sd == "int8"
    per_block = max(files) if codes or sd == s.cdtype else max(files) + max(spec.block_params) * cb
    tile = CAST_TILE_VALUES * cb if codes else 0
    slots = 2 * chunk * per_block + tile
    head = max(spec.suffix_params, spec.vocab * spec.hidden) * (DTYPE_BYTES[sd] if codes else cb) + tile
    tokens = s.micro_batch * s.seq
    n_chunks = -(-spec.n_blocks // chunk)
    kept = (
        (n_chunks - min(s.lowest // chunk, n_chunks) + 2) * s.micro_batches if activations == "device" else 0
    )
    kept_bytes = kept * tokens * spec.hidden * cb
    # a chunk's recompute with grad (or the no-grad forward of `chunk` fused micro-batches: as large), and
    # beside it in the backward the gradients of the widest layer's output and input (the MLP's)
    recompute = (s.per_token_layer * chunk * MIXED_ACTIVATION_FACTOR + 4 * spec.intermediate) * tokens * cb
    row_logits = s.logits / s.micro_batch
    lora = sum(spec.lora_params_per_block[i] for i in s.sparse_layers)
    if edges == "resident":
        weights = slots + (spec.prefix_params + spec.suffix_params) * cb
        rows = s.micro_batch
        acts = kept_bytes + max(recompute, rows * row_logits)
    else:
        rows = int(max(1, min(s.micro_batch, max(slots + recompute - head, 64 * MB) // row_logits)))
        weights, acts = max((slots, kept_bytes + recompute), (head, kept_bytes + rows * row_logits), key=sum)
    weights += lora * 4
    workspace = 0.05 * (weights + acts + lora * 8) + float(s.hw.get("cuda_workspace_mb") or 0) * MB
    return {"weights": weights, "trainable": lora * 4, "optimizer": lora * 8, "activations": acts,
            "workspace": workspace, "cached_block": max(files), "suffix_rows": rows}  # fmt: skip


def gpu_stream_timing(s: StreamShape, sd: str, store: str, edges: str, activations: str, chunk: int,
                      cache: int, suffix_rows: int) -> dict[str, float]:  # fmt: skip
    """A streamed step's time on a GPU. The copy of the next chunk over the host link (from pinned host
    memory; a disk store's uncached blocks read first) overlaps the current chunk's compute, so each half of
    the step (the forward's chunks, the backward's) takes the longer of its copies and its compute; the
    suffix, the edges' copy and the optimizer come on top. Compute: matmul FLOPs at the profile's measured
    rate for the dtype and rows, an int8 store's casts at the measured cast rate (one per use of a block:
    the forward of each fused group, the recompute and the backward of each micro-batch), and the measured
    framework time per block call."""
    spec, hw, n = s.spec, s.hw, s.spec.n_blocks
    files = _block_bytes(spec, sd)
    chunks = [list(range(a, min(a + chunk, n))) for a in range(0, n, chunk)]
    low = min(s.lowest // chunk, len(chunks))
    # the lowest trainable chunk stays resident from the last backward; the suffix gives the last one back
    # when the edges stream (the embeddings' lookup needs no device memory, so the prefix keeps it)
    forward = [c for c in range(len(chunks)) if not (c == low == 0)]
    backward = (
        list(range(low, len(chunks) if edges == "stream" else len(chunks) - 1)) if low < len(chunks) else []
    )
    h2d = float(hw.get("h2d_mb_s") or 10000.0) * MB
    disk_rate = float(hw.get("disk_read_mb_s") or 1000.0) * MB
    cached = set(cached_blocks(n, cache, low * chunk if low < len(chunks) else n))

    def copy_s(cs: list[int]) -> float:
        blocks = [i for c in cs for i in chunks[c]]
        read = sum(files[i] for i in blocks if store == "disk" and i not in cached)
        return sum(files[i] for i in blocks) / h2d + read / disk_rate

    tokens = s.batch_size * s.seq
    kept = (
        tokens * spec.hidden * DTYPE_BYTES[s.cdtype] * len(backward) * chunk if activations == "host" else 0
    )
    compute = gpu_stream_compute(s, sd, chunk, suffix_rows)
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
    return {"step": step, "io": io_f + io_b + edges_io, "compute": sum(compute.values()), "decode": 0.0,
            "disk_bytes": disk, "h2d_bytes": copied}  # fmt: skip


def gpu_stream_compute(s: StreamShape, sd: str, chunk: int, suffix_rows: int) -> dict[str, float]:
    """A streamed step's GPU compute in its three parts (see gpu_stream_timing); the suffix runs
    `suffix_rows` rows of a micro-batch at a time."""
    spec, hw, n = s.spec, s.hw, s.spec.n_blocks
    per_block, head = token_flops(spec, s.seq)
    linear = spec.linear_params_per_block or spec.block_params
    size = math.sqrt(max(linear) / 4)
    tokens, rows, lowest = s.batch_size * s.seq, s.micro_batch * s.seq, s.lowest
    groups = -(-s.micro_batches // chunk)  # the forward fuses up to `chunk` micro-batches

    def matmul(flops: float, m: float) -> float:
        return flops / matmul_rate(hw, s.cdtype, m, 1, size)

    cast_rate = float((hw.get("decode_gvalues_s") or {}).get(f"int8->{s.cdtype}") or 0) * 1e9
    cast = (lambda values: values / cast_rate) if sd == "int8" and cast_rate else (lambda values: 0.0)
    calls = hw.get("block_call_s") or {}
    lora = sum(spec.lora_params_per_block[i] for i in s.sparse_layers)
    bandwidth = float(hw.get("memory_gb_s") or 0) * 1e9
    # the GPU's kernels and the host's launching of them (the measured framework time per block call) overlap:
    # nothing in a chunk's compute waits for the GPU, so each part takes the longer of the two
    forward = max(matmul(sum(per_block) * tokens, min(s.micro_batches, chunk) * rows) + cast(sum(linear) * groups),
                  calls.get("forward", 0.0) * n * groups)  # fmt: skip
    backward = max(matmul(2 * sum(per_block[lowest:]) * tokens, rows) + cast(2 * sum(linear[lowest:]) * s.micro_batches),
                   calls.get("lora", 0.0) * (n - lowest) * s.micro_batches)  # fmt: skip
    head_values = max(spec.suffix_params, spec.vocab * spec.hidden)
    pieces = s.micro_batches * -(-s.micro_batch // suffix_rows)
    suffix = max(matmul(2 * head * tokens, suffix_rows * s.seq) + cast(2 * head_values * pieces)
                 + (28 * lora / bandwidth if bandwidth else 0.0), calls.get("step", 0.0) * pieces)  # fmt: skip
    return {"forward": forward, "backward": backward, "suffix": suffix}


def chunk_sizes(n: int) -> list[int]:
    sizes, c = [], 1
    while c <= max(1, n // 2):
        sizes.append(c)
        c *= 2
    return sizes


def micro_batch_sizes(batch_size: int) -> list[int]:
    sizes, c = [], 1
    while c <= batch_size:
        sizes.append(c)
        c *= 2
    return sorted(sizes, reverse=True)


def make_plan(
    cfg: dict[str, Any], hw: dict[str, Any], spec: ModelSpec, use_tuned: bool = True
) -> dict[str, Any]:
    """The plan: chosen strategy with reasons, micro-batch, precision, and every candidate's memory."""
    check_settings(cfg, hw)
    if spec.kind == "network":
        return make_network_plan(cfg, hw, spec)
    strategy_cfg, data_cfg = cfg["strategy"], cfg["data"]
    requested = strategy_cfg["name"]
    seq = int(data_cfg["max_length"])
    batch_size = int(data_cfg["batch_size"])
    layers = strategy_cfg.get("layers")
    n = spec.n_blocks
    # the sparse_lora candidate of another strategy: first and last four blocks, as many as exist
    default = [i for i in (0, 1, 2, 3, -4, -3, -2, -1) if -n <= i < n]
    sparse_layers = resolve_indices(layers if strategy_cfg["name"] == "sparse_lora" else default, n)
    fixed_mb = strategy_cfg["micro_batch"]
    if fixed_mb not in (None, "auto") and (not isinstance(fixed_mb, int) or fixed_mb < 1):
        raise UserError(
            f"strategy.micro_batch={fixed_mb}: give a whole number of samples, 1 or more, or auto."
        )
    if batch_size < 1:
        raise UserError(f"data.batch_size={batch_size}: give a whole number of samples, 1 or more.")
    # auto: off unless task=tune found it faster
    checkpointing = strategy_cfg.get("gradient_checkpointing") is True
    threads, share = threads_for(hw)
    fixed = strategy_cfg.get("streaming") or {}
    folder = _store_folder(cfg)
    present = (
        {sd: _store_present_bytes(cfg, sd) for sd in PRECISE_FIRST}
        if hw.get("disk_free_mb") is not None
        else {}
    )
    precisions = {
        name: _precision(strategy_cfg["precision"], name, spec, hw, seq, batch_size, sparse_layers)
        for name in CANDIDATES
    }

    def best_estimate(name: str) -> Estimate:
        """Largest micro-batch that fits (streaming then picks its own fastest settings). Streamed on a GPU,
        the fastest micro-batch that fits, and between two equally fast (GPU_TIE) the one holding less memory:
        a step bound by the host link is no faster for larger micro-batches, only larger."""
        sizes = [int(fixed_mb)] if fixed_mb not in (None, "auto") else micro_batch_sizes(batch_size)
        layers = sparse_layers if name == "sparse_lora" else list(range(n))
        store = fixed["store_dtype"] if fixed.get("store_dtype") not in (None, "auto") else None
        fitting, last = [], None
        for mb in sizes:
            last = estimate(name, spec, hw, seq, mb, precisions[name], layers, batch_size, store, fixed, checkpointing,
                            present=present, where=str(folder))  # fmt: skip
            if last.fits and not (name == "sparse_lora" and hw["accelerator"] == "cuda"):
                return last
            if last.fits:
                fitting.append(last)
        if fitting:
            fastest = min(e.streaming["predicted_step_s"] for e in fitting)
            near = [e for e in fitting if e.streaming["predicted_step_s"] <= fastest * (1 + GPU_TIE)]
            return min(near, key=lambda e: e.peak_mb)
        return last

    estimates = {name: best_estimate(name) for name in CANDIDATES}
    reasons = []
    if requested != "auto":
        chosen = requested if requested in estimates else "full"
        reasons.append(f"strategy={requested} was asked for")
        if requested not in estimates:  # ddp / fsdp / deepspeed: full training placed by Lightning
            reasons.append(
                f"sized as full training; Lightning strategy '{strategy_cfg.get('lightning')}' places it"
            )
    elif not spec.pretrained:
        chosen = "full"
        reasons.append("random init: train every weight (LoRA on random weights would adapt noise)")
    else:
        chosen = next((s for s in AUTO_ORDER if estimates[s].fits), "sparse_lora")
        for s in AUTO_ORDER:
            e = estimates[s]
            reasons.append(
                f"{s}: {'fits' if e.fits else 'does not fit'} ({e.peak_mb + e.context_mb:,.0f} MB{'; ' + e.note if e.note else ''})"
            )
            if s == chosen:
                break
    est = estimates[chosen]
    precision = precisions.get(chosen, precisions["full"])
    if chosen == "sparse_lora" and est.streaming.get("refused"):
        raise UserError(est.streaming["refused"])
    if chosen == "sparse_lora" and not est.fits:
        need = est.peak_mb + est.context_mb
        smallest = need if hw.get("budget_mb") else need / HEADROOM
        raise UserError(
            f"hardware {hw.get('name')}: a budget of {budget_mb(hw):,.0f} MB cannot hold one streamed block plus activations "
            f"for {spec.name} at data.max_length={seq}; the smallest budget that works is about {smallest:,.0f} MB "
            "(or shorten data.max_length)."
        )
    if not est.fits:
        reasons.append(
            f"WARNING: predicted {est.peak_mb + est.context_mb:,.0f} MB exceeds the {budget_mb(hw):,.0f} MB budget; expect out-of-memory"
        )
    if precision != choose_precision(hw) and strategy_cfg["precision"] in (None, "auto"):
        rows = est.micro_batch * seq
        reasons.append(
            f"precision {precision}: this CPU's bf16 matmuls make the step faster ({matmul_rate(hw, 'bfloat16', rows, threads) / 1e9:,.0f} "
            f"GFLOP/s at {rows} rows, measured, against float32's {matmul_rate(hw, 'float32', rows, threads) / 1e9:,.0f}): "
            "frozen weights in bf16, adapters in fp32"
        )
    if hw["accelerator"] == "cpu" and (hw.get("cpu_busy_cores") or 0) >= 0.25:
        reasons.append(
            f"cores busy: other processes use {hw['cpu_busy_cores']:.1f} of {hw.get('cpu_cores')} cores; torch runs "
            f"{threads} thread(s){'' if share >= 1 else f', each getting about {share:.0%} of a core'}, and the step time counts that"
        )
    elif hw.get("thread_limit") and threads < (hw.get("cpu_cores") or 1):
        reasons.append(f"torch runs {threads} thread(s): OMP_NUM_THREADS={hw['thread_limit']}")
    micro_batch = est.micro_batch  # need not divide batch_size: the last micro-batch is smaller
    if chosen == "sparse_lora":
        s = est.streaming
        step_s = s["predicted_step_s"]
        reasons.append(_streaming_reason(s))
    else:
        trainable = list(range(n)) if chosen != "full" else [0]
        step_s = compute_s(spec, hw, chosen if chosen in CANDIDATES else "full", seq, batch_size, micro_batch, trainable,
                           dtype=compute_dtype_name(hw, precision))  # fmt: skip
    plan = {
        "strategy": chosen,
        "requested": requested,
        "reasons": reasons,
        "micro_batch": micro_batch,
        "accumulate": -(-batch_size // micro_batch),
        "precision": precision,
        "weights_dtype": _weights_dtype(chosen, precision, hw),
        "sequence_length": seq,
        "predicted_peak_memory_mb": round(est.peak_mb, 1),
        "predicted_step_s": round(step_s, 4),
        "context_mb": round(est.context_mb, 1),
        "budget_mb": round(budget_mb(hw), 1),
        "sparse_layers": sparse_layers if chosen == "sparse_lora" else None,
        "gradient_checkpointing": checkpointing,
        "settings_source": "plan",
        "streaming": est.streaming or None,
        "threads": threads if hw["accelerator"] == "cpu" else None,
        "hardware": hardware_summary(hw),
        "model": {
            "name": spec.name,
            "params": spec.params,
            "blocks": n,
            "layer_map": spec.layer_map,
            "pretrained": spec.pretrained,
        },
        "candidates": {
            name: {
                **{k: round(v, 1) if isinstance(v, float) else v for k, v in asdict(e).items()},
                "peak_mb": round(e.peak_mb, 1),
            }
            for name, e in estimates.items()
        },  # fmt: skip
    }
    return _with_tuned(plan, cfg, hw, spec) if use_tuned else plan


def _precision(asked: str, name: str, spec: ModelSpec, hw: dict[str, Any], seq: int, batch_size: int,
               sparse_layers: list[int]) -> str:  # fmt: skip
    """The precision a candidate runs in: as asked, or by the machine. A CPU whose profile measured
    bf16 matmuls streams in bf16-mixed when matmuls are most of the step and bf16 makes it at least
    1.5x faster: the
    store then holds bf16 (half the bytes of fp32) and the matmuls run on the CPU's bf16 units, the
    adapters in fp32. Resident strategies keep fp32, whose memory the planner's model was measured on."""
    if asked not in (None, "auto"):
        return asked
    measured = all("bfloat16" in table for table in (hw.get("matmul_gflops") or {"": {}}).values())
    if hw["accelerator"] != "cpu" or name != "sparse_lora" or not measured:
        return choose_precision(hw)
    matmul32, other32 = compute_s(
        spec, hw, name, seq, batch_size, batch_size, sparse_layers, "float32", parts=True
    )
    matmul16, other16 = compute_s(
        spec, hw, name, seq, batch_size, batch_size, sparse_layers, "bfloat16", parts=True
    )
    # only where the matmuls are most of the step: a small model's step is framework time, which autocast adds to
    dominated = matmul32 >= 0.7 * (matmul32 + other32)
    return "bf16-mixed" if dominated and matmul16 + other16 < 0.67 * (matmul32 + other32) else "32-true"


def _streaming_reason(s: dict[str, Any]) -> str:
    """Why these streaming settings: their predicted step against the next fastest."""
    place = (
        "in host memory"
        if s["store"] == "cpu"
        else f"on disk, {s['cache_blocks']} block(s) cached in host memory"
    )
    line = (f"streaming: {s['store_dtype']} store {place}, chunk {s['chunk_size']}, edges {s['edges']}: predicted "
            f"{s['predicted_step_s']:.2f} s/step (I/O {s['predicted_io_s']:.2f} s for {_moved(s)}, "
            f"compute {s['predicted_compute_s']:.2f} s in {s['compute_dtype']}"
            + (f", decode {s['predicted_decode_s']:.2f} s" if s["predicted_decode_s"] else "") + "), the fastest that fits")  # fmt: skip
    others = [
        a for a in s["alternatives"] if (a["store_dtype"], a["store"]) != (s["store_dtype"], s["store"])
    ]
    if others:
        a = others[0]
        line += f"; next: {a['store_dtype']} {a['store']} store at {a['predicted_step_s']:.2f} s/step"
    return line


def _moved(s: dict[str, Any]) -> str:
    """What a streamed step moves: GB read from the disk, and on a GPU GB copied over the host link."""
    read = f"{s['predicted_disk_read_gb']:,.1f} GB read"
    copied = s.get("predicted_h2d_gb") or 0
    return f"{read} and {copied:,.1f} GB copied to the GPU" if copied else read


def _store_folder(cfg: dict[str, Any]):
    from pathlib import Path

    from onn.models.load import model_fingerprint

    return Path(cfg["paths"]["cache"]) / "stores" / model_fingerprint(cfg["model"])


def hardware_summary(hw: dict[str, Any]) -> dict[str, Any]:
    """The machine as a plan records it."""
    keys = ("name", "accelerator", "device_name", "device_memory_mb", "host_memory_mb", "cpu_cores", "cpu_busy_cores",
            "matmul_tflops", "disk_read_mb_s", "disk_free_mb", "memory_gb_s", "h2d_mb_s", "source")  # fmt: skip
    return {k: hw.get(k) for k in keys}


def _with_tuned(
    plan: dict[str, Any], cfg: dict[str, Any], hw: dict[str, Any], spec: ModelSpec
) -> dict[str, Any]:
    """The plan again with the `auto` settings that task=tune measured on this machine, when it has."""
    tuned = lookup(cfg, hw, plan["strategy"], plan["sequence_length"])
    if tuned is None:
        return plan
    strategy = dict(cfg["strategy"])
    streaming = dict(strategy.get("streaming") or {})
    taken = {}
    for key, value in tuned["settings"].items():
        holder = streaming if key in STREAMING_KEYS else strategy
        if holder.get(key, "auto") in (None, "auto"):
            holder[key] = taken[key] = value
    if not taken:
        return plan
    tuned_plan = make_plan(
        {**cfg, "strategy": {**strategy, "streaming": streaming}}, hw, spec, use_tuned=False
    )
    if tuned_plan["strategy"] != plan["strategy"] or not tuned_plan["candidates"][plan["strategy"]]["fits"]:
        plan["reasons"].append(
            f"task=tune's settings {taken} ({tuned['path']}) no longer fit: using the planner's own"
        )
        return plan
    tuned_plan["requested"] = plan["requested"]
    tuned_plan["settings_source"] = "tune"
    tuned_plan["tuned"] = {
        k: tuned.get(k)
        for k in ("path", "tuned_at", "samples_per_s", "plan_samples_per_s", "speedup_over_plan")
    }
    tuned_plan["reasons"] = [
        f"settings {taken} from task=tune ({tuned['path']}, {tuned.get('tuned_at')}): measured {tuned.get('samples_per_s')} "
        f"samples/s against {tuned.get('plan_samples_per_s')} for the planner's guess",
        *[r for r in plan["reasons"]],
    ]
    return tuned_plan


def _weights_dtype(strategy: str, precision: str, hw: dict[str, Any]) -> str:
    if strategy == "full" or precision == "32-true":
        return "float32"
    if precision.startswith("bf16"):
        return "bfloat16"
    return "float16"


def render(plan: dict[str, Any]) -> str:
    """The plan as a table for the terminal."""
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"ONN plan: {plan['model']['name']} on {plan['hardware']['name']} ({plan['hardware']['device_name']})"
    )
    for col in (
        "candidate",
        "fits",
        "micro-batch",
        "weights",
        "trainable",
        "optimizer",
        "activations",
        "workspace",
        "peak (MB)",
    ):
        table.add_column(col, justify="right" if col not in ("candidate", "fits") else "left")
    for name, c in plan["candidates"].items():
        mark = "*" if name == plan["strategy"] else ""
        table.add_row(f"{mark}{name}", "yes" if c["fits"] else "no", str(c["micro_batch"]),
                      *(f"{c[k]:,.0f}" for k in ("weights_mb", "trainable_mb", "optimizer_mb", "activations_mb", "workspace_mb", "peak_mb")))  # fmt: skip
    console = Console(width=120, record=True, force_terminal=False)
    with console.capture() as capture:
        console.print(table)
    lines = [capture.get().rstrip()]
    lines.append(
        f"strategy: {plan['strategy']}  micro-batch: {plan['micro_batch']} x {plan['accumulate']} accumulated  precision: {plan['precision']}"
    )
    peak, ctx = plan["predicted_peak_memory_mb"], plan["context_mb"]
    ctx_name = "CUDA context" if plan["hardware"]["accelerator"] == "cuda" else "process baseline"
    lines.append(
        f"predicted peak memory: {peak:,.0f} MB allocated (+{ctx:,.0f} MB {ctx_name} = {peak + ctx:,.0f} MB); budget {plan['budget_mb']:,.0f} MB"
    )
    where = (
        f"at data.max_length={plan['sequence_length']}"
        if plan["sequence_length"]
        else f"for a batch of {plan['micro_batch']}"
    )
    lines.append(
        f"predicted step time: {plan['predicted_step_s']:.3f} s {where} (a prediction; the run measures it)"
    )
    if plan.get("streaming"):
        s = plan["streaming"]
        place = (
            "host memory"
            if s["store"] == "cpu"
            else f"disk, {s['cache_blocks']} of {plan['model']['blocks']} blocks cached in RAM"
        )
        lines.append(f"streaming: chunk_size {s['chunk_size']}, store {s['store_dtype']} in {place} ({s['store_gb']:,.1f} GB), "
                     f"edges {s['edges']}, compute in {s['compute_dtype']}; per step {_moved(s)} "
                     f"({s['predicted_io_s']}s I/O) vs {s['predicted_compute_s']}s compute (predictions)")  # fmt: skip
    if plan.get("threads"):
        lines.append(f"threads: {plan['threads']} of {plan['hardware'].get('cpu_cores')} cores")
    lines += [f"  - {r}" for r in plan["reasons"]]
    lines.append(f"layer map: {plan['model']['layer_map']}")
    if plan.get("scale"):  # onn/planning/scale.py
        lines.append(render_scale(plan["scale"]))
    return "\n".join(lines)


def render_scale(scale: dict[str, Any]) -> str:
    """The multi-device setups side by side (predictions), the chosen one marked."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"full fine-tune over {scale['devices_per_node']} device(s) x {scale['nodes']} node(s): "
                        f"global batch {scale['global_batch']} ({scale['per_device_batch']} per device)")  # fmt: skip
    for col in ("setup", "fits", "micro-batch", "MB per device", "host MB per node", "compute s", "all-reduce s",
                "offload s", "step s"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("setup", "fits") else "right", no_wrap=col == "setup")
    for name, o in scale["options"].items():
        fits = "refused" if o["refused"] else ("yes" if o["fits"] else "no")
        table.add_row(f"{'*' if name == scale['chosen'] else ''}{o['label']}", fits, str(o["micro_batch"]),
                      f"{o['per_device_mb']:,.0f}", f"{o['host_per_node_mb']:,.0f}", f"{o['compute_s']:.3g}",
                      f"{o['collective_s']:.3g}", f"{o['offload_s']:.3g}", f"{o['predicted_step_s']:.3g}")  # fmt: skip
    console = Console(width=120, record=True, force_terminal=False)
    with console.capture() as capture:
        console.print(table)
    lines = [capture.get().rstrip(), f"  - {scale['reason']}"]
    if scale["links"]["missing"]:
        lines.append(f"  - all-reduce time not predicted: set {' and '.join(scale['links']['missing'])}")
    refused = next((o["refused"] for o in scale["options"].values() if o["refused"]), None)
    if refused:
        lines.append(f"  - {refused}: on this machine use strategy=ddp")
    return "\n".join(lines)
