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
               activations (CPU_HEAP_OVERHEAD)
  context      not allocated by the run but held: 1.5 GB for the CUDA context on GPUs; on CPUs
               the process's own resident memory (torch and Python), measured now

Gradients are allocated during backward while the saved activations are freed, layer by layer,
so with one micro-batch per step the peak holds the larger of the two, not both: peak = weights
+ optimizer + workspace + max(trainable, activations). When micro-batches accumulate, the first
one's gradients live through the next one's forward: the peak holds both.

sparse_lora is sized as ONN's layer-streaming engine: two chunks of blocks in flight (one
computing, one loading) plus the disk reader's buffer, prefix/suffix resident or streamed, the
kept chunk inputs of every micro-batch (on the device or the host), one chunk's activations
during recompute, LoRA state for the sparse layer set only.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field
from typing import Any

from onn.dtypes import BYTES_PER_VALUE as DTYPE_BYTES
from onn.errors import UserError
from onn.hardware.memory import anon_rss_mb
from onn.models.layers import resolve_indices
from onn.planning.spec import ModelSpec
from onn.planning.tuned import lookup

MB = 1024**2
CUDA_CONTEXT_MB = 1536
HEADROOM = 0.95  # use at most 95% of what is left after the context
# On CPUs the peak is resident memory, and glibc's heap holds on to the buffers autograd frees
# during backward while new ones of other sizes are taken: measured with task=bench (phi4_tiny,
# llama_small; full and LoRA; sequences of 64-96 tokens) as 0.5-1.0x the activations above the
# live tensors. Streaming frees per chunk and showed none of it.
CPU_HEAP_OVERHEAD = 0.7
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
        est.fits = est.peak_mb <= budget_mb(hw)
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
            f"WARNING: predicted {est.peak_mb:,.0f} MB exceeds the {budget_mb(hw):,.0f} MB budget; lower data.batch_size"
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
    if hw["accelerator"] == "cuda":
        return CUDA_CONTEXT_MB
    if hw.get("source") == "preset":
        return 600.0  # a preset machine cannot be measured: torch + Python's typical resident size
    return anon_rss_mb()


def budget_mb(hw: dict[str, Any]) -> float:
    """Memory the run may allocate on its compute device, after the context, with headroom;
    `hardware.budget_mb` caps it (the context included) to plan for less than the machine has."""
    if hw["accelerator"] == "cuda":
        total = hw.get("device_memory_free_mb") or hw["device_memory_mb"]
    else:  # CPU and unified memory: the host's available memory is the device
        total = hw.get("host_memory_available_mb") or hw.get("device_memory_mb") or hw["host_memory_mb"]
    if hw.get("budget_mb"):
        total = min(total, float(hw["budget_mb"]))
    return (total - context_mb(hw)) * HEADROOM


def estimate(strategy: str, spec: ModelSpec, hw: dict[str, Any], seq: int, micro_batch: int, precision: str,
             sparse_layers: list[int], batch_size: int, store_dtype: str | None = None,
             streaming: dict[str, Any] | None = None, checkpointing: bool = False) -> Estimate:  # fmt: skip
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
        return _estimate_streaming(
            spec,
            hw,
            seq,
            micro_batch,
            precision,
            sparse_layers,
            batch_size,
            per_token_layer,
            logits,
            ctx,
            store_dtype,
            streaming,
        )
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
    est.fits = est.peak_mb <= budget_mb(hw)
    return est


def store_dtypes(hw: dict[str, Any], precision: str) -> list[str]:
    """Frozen-weight storage for streaming, most precise first: the planner takes the first that fits.
    The quantized ones (bitsandbytes) come last: they cut the bytes moved, at some precision."""
    if hw["accelerator"] == "cuda":
        return ["bfloat16" if hw.get("bf16") else "float16", "int8", "nf4"]
    return ["float32" if precision == "32-true" else "bfloat16", "int8", "nf4"]


STREAMING_KEYS = ("chunk_size", "store", "store_dtype", "edges", "activations")
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
    if budget_mb(hw) <= 0:
        held = context_mb(hw)
        cause = (f"hardware.budget_mb={hw['budget_mb']:g} MB" if hw.get("budget_mb")
                 else f"this machine's available memory ({hw.get('host_memory_available_mb') or hw.get('device_memory_mb')} MB)")  # fmt: skip
        raise UserError(f"{cause} is below what the run holds before any model is built ({held:,.0f} MB: "
                        f"{'the CUDA context' if hw['accelerator'] == 'cuda' else 'Python, torch and the libraries'}); "
                        f"give a budget above {held / HEADROOM:,.0f} MB.")  # fmt: skip


def _estimate_streaming(spec, hw, seq, micro_batch, precision, sparse_layers, batch_size, per_token_layer, logits, ctx,
                        store_dtype, fixed=None) -> Estimate:  # fmt: skip
    """Layer streaming: the most comfortable settings that fit, then what is resident at the peak.

    Preference, in order: the most precise store dtype; the store in host memory over disk;
    prefix/suffix resident over streamed; kept activations on the device over the host; the largest
    chunk. Settings the config fixes (not `auto`) are taken as given."""
    fixed = {k: v for k, v in (fixed or {}).items() if k in STREAMING_KEYS and v not in (None, "auto")}
    on_gpu = hw["accelerator"] == "cuda"
    compute_bytes = 2 if precision != "32-true" else 4
    n = spec.n_blocks
    accumulate = max(1, -(-batch_size // micro_batch))
    lora = sum(spec.lora_params_per_block[i] for i in sparse_layers)
    lowest = min(sparse_layers) if sparse_layers else n
    budget = budget_mb(hw) * MB
    block = max(spec.block_params)
    edge = (spec.prefix_params + spec.suffix_params) * compute_bytes
    dtypes = [store_dtype] if store_dtype else store_dtypes(hw, precision)

    def options(key: str, default: list) -> list:
        return [int(fixed[key]) if key == "chunk_size" else fixed[key]] if key in fixed else default

    def memory(store_dtype, store, edges, activations, chunk) -> dict[str, float]:
        sbytes = DTYPE_BYTES[store_dtype]
        # On a CPU host memory is the device: a store held there counts in full.
        store_bytes = sum(spec.block_params) * sbytes if store == "cpu" and not on_gpu else 0
        # A chunk as it computes (de-quantized, compute dtype); a host store already in the compute
        # dtype on a CPU lends its tensors as they are, so a resident chunk costs nothing extra.
        zero_copy = store == "cpu" and not on_gpu and sbytes == compute_bytes
        unit = 0 if zero_copy else block * chunk * compute_bytes
        read_buffer = block * sbytes if store == "disk" else 0
        # Two chunks in flight (computing + prefetched); streamed edges load while no chunk is resident.
        weights = store_bytes + read_buffer + max(2 * unit, edge if edges == "stream" else 0)
        weights += edge if edges == "resident" else 0
        n_chunks = -(-n // chunk)
        # Kept per micro-batch: the input of every chunk from the lowest trainable one, the final
        # hidden state and the embeddings' output; with activations=host only the one in use.
        kept = (n_chunks - min(lowest // chunk, n_chunks) + 2) * accumulate if activations == "device" else 2
        tokens = micro_batch * seq
        acts = (kept * tokens * spec.hidden + per_token_layer * tokens * chunk) * compute_bytes + logits
        weights += lora * 4  # fp32 adapters
        trainable, optimizer = lora * 4, lora * 8
        workspace = 0.05 * (weights + max(trainable, acts) + optimizer)
        return {
            "weights": weights,
            "trainable": trainable,
            "optimizer": optimizer,
            "activations": acts,
            "workspace": workspace,
        }

    best = None
    for sd in options("store_dtype", dtypes):
        all_blocks = sum(spec.block_params) * DTYPE_BYTES[sd]
        # A CPU keeps the store in host memory only when every block fits there comfortably.
        stores = ["cpu"] if on_gpu or all_blocks <= 0.5 * budget else ["disk"]
        for store, edges, activations in itertools.product(options("store", stores), options("edges", ["resident", "stream"]),
                                                           options("activations", ["device", "host"] if on_gpu else ["device"])):  # fmt: skip
            for chunk in sorted(options("chunk_size", chunk_sizes(n)), reverse=True):
                m = memory(sd, store, edges, activations, chunk)
                if (
                    m["weights"] + m["optimizer"] + m["workspace"] + max(m["trainable"], m["activations"])
                    <= budget
                ):
                    best = (sd, store, edges, activations, chunk, m)
                    break
            if best:
                break
        if best:
            break
    if best is None:  # nothing fits: report the smallest configuration, marked as not fitting
        sd = options("store_dtype", dtypes)[-1]
        store = fixed.get("store", "cpu" if on_gpu else "disk")
        activations = fixed.get("activations", "host" if on_gpu else "device")
        chunk = min(options("chunk_size", [1]))
        best = (
            sd,
            store,
            fixed.get("edges", "stream"),
            activations,
            chunk,
            memory(sd, store, fixed.get("edges", "stream"), activations, chunk),
        )
    store_dtype, store, edges, activations, chunk, m = best
    streamed_bytes = sum(spec.block_params) * DTYPE_BYTES[store_dtype]
    reloaded = sum(spec.block_params[lowest:]) * DTYPE_BYTES[store_dtype]
    bandwidth = (hw.get("h2d_mb_s") if on_gpu else hw.get("disk_read_mb_s")) or 1000.0
    # Host memory is read at memory speed; only a disk store (or a GPU's host link) costs transfer time.
    io_s = 0.0 if store == "cpu" and not on_gpu else (streamed_bytes + reloaded) / MB / bandwidth
    streaming = {
        "chunk_size": chunk,
        "store": store,
        "store_dtype": store_dtype,
        "edges": edges,
        "activations": activations,
        "micro_batches_per_chunk": accumulate,
        "predicted_io_s": round(io_s, 3),
        "predicted_compute_s": round(
            compute_s(spec, hw, "sparse_lora", seq, batch_size, micro_batch, sparse_layers), 3
        ),
    }
    est = Estimate("sparse_lora", False, micro_batch, m["weights"] / MB, m["trainable"] / MB, m["optimizer"] / MB, m["activations"] / MB,
                   m["workspace"] / MB, ctx, note=f"streams {chunk} block(s) at a time, frozen weights stored as {store_dtype}",
                   streaming=streaming, accumulates=batch_size > micro_batch)  # fmt: skip
    est.fits = est.peak_mb <= budget_mb(hw)
    return est


# Framework time per block per micro-batch (Python, dispatch, kernel launches) for forward plus
# backward in full training, and what LoRA's adapter wrappers and streaming's forward-then-
# recompute multiply it by; and the share of the measured matmul rate a training step reaches.
# Calibrated with task=bench on a 2-core Xeon (phi4_tiny, llama_tiny, llama_small); assumptions
# elsewhere, which every task=bench checks (bench/step_time_error).
BLOCK_OVERHEAD_S = {"cpu": 5e-3, "cuda": 0.5e-3, "mps": 2e-3}
STRATEGY_OVERHEAD = {"full": 1.0, "lora": 1.8, "qlora": 2.0, "sparse_lora": 3.0}
MATMUL_EFFICIENCY = 0.7


def compute_s(spec: ModelSpec, hw: dict[str, Any], strategy: str, seq: int, batch_size: int, micro_batch: int,
              trainable_layers: list[int]) -> float:  # fmt: skip
    """Predicted compute time of one optimizer step: matmul FLOPs at the measured matmul rate, plus overhead.

    Forward: 2 FLOPs per weight per token, plus attention's 4 x seq x hidden per token and layer.
    Backward: full training computes input and weight gradients (2x forward); LoRA needs input
    gradients from the lowest trainable block up (1x those blocks' forward); streaming recomputes
    those blocks' forward as well."""
    rate = (hw.get("matmul_tflops") or 0.1) * 1e12 * MATMUL_EFFICIENCY
    tokens = batch_size * seq
    per_block = [2 * p + 4 * seq * spec.hidden for p in spec.block_params]
    head = 2 * spec.suffix_params
    lowest = min(trainable_layers) if trainable_layers else 0
    upper = sum(per_block[lowest:]) + head
    forward = sum(per_block) + head
    if strategy == "full":
        flops = 3 * forward
    elif strategy == "sparse_lora":
        flops = forward + 2 * upper
    else:
        flops = forward + upper
    micro_batches = -(-batch_size // max(micro_batch, 1))
    overhead = (
        BLOCK_OVERHEAD_S.get(hw["accelerator"], 1e-3)
        * STRATEGY_OVERHEAD.get(strategy, 1.0)
        * spec.n_blocks
        * micro_batches
    )
    return flops * tokens / rate + overhead


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
    precision = strategy_cfg["precision"]
    precision = choose_precision(hw) if precision in (None, "auto") else precision
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

    def best_estimate(name: str) -> Estimate:
        """Largest micro-batch that fits; for streaming, the most precise store dtype first."""
        sizes = [int(fixed_mb)] if fixed_mb not in (None, "auto") else micro_batch_sizes(batch_size)
        layers = sparse_layers if name == "sparse_lora" else list(range(n))
        last = None
        fixed = strategy_cfg.get("streaming") or {}
        dtypes = (
            [fixed["store_dtype"]]
            if fixed.get("store_dtype") not in (None, "auto")
            else store_dtypes(hw, precision)
        )
        for store in dtypes if name == "sparse_lora" else [None]:
            for mb in sizes:
                last = estimate(
                    name, spec, hw, seq, mb, precision, layers, batch_size, store, fixed, checkpointing
                )
                if last.fits:
                    return last
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
                f"{s}: {'fits' if e.fits else 'does not fit'} ({e.peak_mb:,.0f} MB{'; ' + e.note if e.note else ''})"
            )
            if s == chosen:
                break
    est = estimates[chosen]
    if chosen == "sparse_lora" and not est.fits:
        need = est.peak_mb + est.context_mb
        raise UserError(
            f"hardware {hw.get('name')}: a budget of {budget_mb(hw) + est.context_mb:,.0f} MB cannot hold one streamed block plus "
            f"activations for {spec.name} at data.max_length={seq}; the smallest budget that works is about {need / HEADROOM:,.0f} MB "
            "(or shorten data.max_length)."
        )
    if not est.fits:
        reasons.append(
            f"WARNING: predicted {est.peak_mb:,.0f} MB exceeds the {budget_mb(hw):,.0f} MB budget; expect out-of-memory"
        )
    micro_batch = est.micro_batch  # need not divide batch_size: the last micro-batch is smaller
    if chosen == "sparse_lora":
        s = est.streaming
        overlap = bool((strategy_cfg["streaming"] or {"prefetch": True})["prefetch"])
        step_s = (
            max(s["predicted_io_s"], s["predicted_compute_s"])
            if overlap
            else s["predicted_io_s"] + s["predicted_compute_s"]
        )
    else:
        trainable = list(range(n)) if chosen != "full" else [0]
        step_s = compute_s(
            spec, hw, chosen if chosen in CANDIDATES else "full", seq, batch_size, micro_batch, trainable
        )
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


def hardware_summary(hw: dict[str, Any]) -> dict[str, Any]:
    """The machine as a plan records it."""
    keys = ("name", "accelerator", "device_name", "device_memory_mb", "host_memory_mb", "matmul_tflops",
            "disk_read_mb_s", "h2d_mb_s", "source")  # fmt: skip
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
        lines.append(f"streaming: chunk_size {s['chunk_size']}, store {s['store']} as {s['store_dtype']}, edges {s['edges']}, "
                     f"kept activations on the {s['activations']}, "
                     f"predicted step {s['predicted_io_s']}s I/O vs {s['predicted_compute_s']}s compute (predictions)")  # fmt: skip
    lines += [f"  - {r}" for r in plan["reasons"]]
    lines.append(f"layer map: {plan['model']['layer_map']}")
    return "\n".join(lines)
