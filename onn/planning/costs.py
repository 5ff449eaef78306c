"""What a step costs: the memory a candidate holds, the budget it must fit, and the time the hardware
profile's measured rates predict.

Memory, per candidate (full, lora, qlora, sparse_lora), from sizes read off the model on the meta device:

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
  context      not allocated by the run but held: the CUDA context on GPUs (measured by the profile);
               on CPUs the process's own resident memory (torch and Python), measured now

Gradients are allocated during backward while the saved activations are freed, layer by layer,
so with one micro-batch per step the peak holds the larger of the two, not both: peak = weights
+ optimizer + workspace + max(trainable, activations). When micro-batches accumulate, the first
one's gradients live through the next one's forward: the peak holds both. A candidate fits when its
peak plus the context stays within the budget: the memory available (with 5% headroom) or
hardware.budget_mb as given.

Time (`compute_s`) comes from what the hardware profile measured on this machine, never from
constants: matmul FLOPs at the measured rate for their dtype and row count, on the threads the
plan runs (torch's threads are sized to the cores other processes leave free, and a core shared
with them counts at its share), plus the measured framework time per block call, plus the
optimizer's and activations' memory traffic at the measured memory bandwidth. A preset machine,
which cannot be measured, has its matmul_tflops figure only.
"""

from __future__ import annotations

import importlib
import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from onn.config.run import OptimConfig
from onn.hardware.memory import anon_rss_mb
from onn.hardware.profile import Profile
from onn.planning.spec import ModelSpec, OpBytes

if TYPE_CHECKING:
    from onn.planning.streaming import StreamingPlan  # streaming.py imports this module

MB = 1024**2


# A preset GPU's CUDA context when the preset gives none (a measured profile has its own): CUDA 12-13 with
# lazy kernel loading, cuBLAS and the kernels a training step loads.
CUDA_CONTEXT_MB = 512


HEADROOM = 0.95  # use at most 95% of what is left after the context


# What a training run (and task=bench, task=tune) has imported before it plans: task=plan, which imported less,
# measured a baseline 52 MB below train's (peft and bitsandbytes), and called budgets fitting that train refused.
# Imported before the baseline is read, whatever the task, so that every task plans from the same one.
RUN_LIBRARIES = ("lightning", "peft", "transformers")


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


# The bytes of the dtype a Lightning "-true" precision converts the whole module to (Strategy.setup calls the precision
# plugin's convert_module): weights, their gradients, the optimizer's states and the activations are all of it.
TRUE_PRECISION_BYTES = {"32-true": 4, "bf16-true": 2, "16-true": 2, "64-true": 8}


@dataclass
class Estimate:
    """One candidate's predicted memory at one micro-batch (MB), and whether it fits the budget."""

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
    streaming: StreamingPlan | None = None  # the sparse_lora candidate's streaming setting
    accumulates: bool = False  # several micro-batches per step: their gradients outlive each backward

    @property
    def peak_mb(self) -> float:
        """Predicted peak the run allocates itself (what torch.cuda.max_memory_allocated reports)."""
        return step_peak(
            self.weights_mb,
            self.trainable_mb,
            self.optimizer_mb,
            self.activations_mb,
            self.workspace_mb,
            self.accumulates,
        )


def step_peak(
    weights: float, trainable: float, optimizer: float, activations: float, workspace: float, accumulates: bool
) -> float:
    """A step's peak from its parts (any unit), the one formula every fit is judged by: one micro-batch per step holds
    the larger of its gradients and its saved activations; micro-batches that accumulate hold both (the first one's
    gradients live through the next one's forward). A streamed setting sized by another formula than the estimate
    judged it by was refused at budgets above ones that fitted."""
    held = trainable + activations if accumulates else max(trainable, activations)
    return weights + optimizer + workspace + held


def trained_weight_bytes(precision: str) -> int:
    """Bytes of a trained weight, and of its gradient and each optimizer state (torch keeps them in the weight's
    dtype): a "-true" precision's dtype, which Lightning converts the module to; float32 under a mixed precision,
    whose autocast keeps float32 master weights."""
    return TRUE_PRECISION_BYTES.get(precision, 4)


def activation_bytes(precision: str) -> float:
    """Bytes autograd keeps per counted activation element (layer_activation_elements) under Lightning's `precision`:
    a "-true" precision's dtype; under autocast half-precision values beside the norms' float32 ones, which counted
    at 2 bytes the plan was 39% low."""
    if precision.endswith("mixed"):
        return 2 * MIXED_ACTIVATION_FACTOR
    return trained_weight_bytes(precision)


def choose_precision(hw: Profile) -> str:
    if hw.accelerator == "cuda":
        return "bf16-mixed" if hw.bf16 else "16-mixed"
    if hw.accelerator == "mps":
        return "16-mixed"
    # CPU autocast to bf16 measured 2x slower than fp32 here (Xeon with AVX512-BF16): casts cost
    # more than they save. Ask for it with strategy.precision=bf16-mixed.
    return "32-true"


def context_mb(hw: Profile) -> float:
    """What the process holds before any model is built: the CUDA context (measured by the profile; a
    preset's own figure, or CUDA_CONTEXT_MB), or on CPUs the process's resident memory now, with the libraries
    every training run has imported by then (RUN_LIBRARIES)."""
    if hw.accelerator == "cuda":
        return float(hw.cuda_context_mb or CUDA_CONTEXT_MB)
    if hw.source == "preset":
        return 600.0  # a preset machine cannot be measured: torch + Python's typical resident size
    for name in RUN_LIBRARIES:
        importlib.import_module(name)
    return anon_rss_mb()


def budget_mb(hw: Profile) -> float:
    """Memory the run may hold on its compute device, its context (CUDA context, or the process's own
    baseline) included: what is available with 5% headroom, or `hardware.budget_mb` as given."""
    if hw.accelerator == "cuda":
        total = hw.device_memory_free_mb or hw.device_memory_mb
    else:  # CPU and unified memory: the host's available memory is the device
        total = hw.host_memory_available_mb or hw.device_memory_mb or hw.host_memory_mb
    total *= HEADROOM
    if hw.budget_mb is not None:  # 0 too: a budget of nothing, refused as below the context, not "no budget"
        total = min(total, float(hw.budget_mb))
    return total


def fits(est: Estimate, hw: Profile) -> bool:
    """The prediction, context included, within the budget."""
    return est.peak_mb + est.context_mb <= budget_mb(hw)


def compute_dtype_name(hw: Profile, precision: str) -> str:
    if precision == "32-true":
        return "float32"
    return "bfloat16" if precision.startswith("bf16") else "float16"


def threads_for(hw: Profile) -> tuple[int, float]:
    """(threads, share): torch's thread count for the cores other processes leave free (at least one,
    at most OMP_NUM_THREADS when set), and the share of a core each thread gets: measured by the
    profile right now (`cpu_share`: busy threads of ours, timed), since the scheduler's split (fair per
    thread, or per session with autogroup) cannot be read off a count of the others' threads."""
    cores = int(hw.cpu_cores or 1)
    busy = float(hw.cpu_busy_cores or 0.0)
    threads = max(1, min(cores, math.floor(cores - busy + 0.5)))
    if hw.thread_limit:
        threads = min(threads, int(hw.thread_limit))
    share = float(hw.cpu_share or 1.0)  # 1 unless the cores are busy or a CPU quota (--cpus=1.5) throttles them
    return threads, share


def matmul_rate(hw: Profile, dtype: str, rows: float, threads: int, size: float = 4096.0) -> float:
    """FLOP/s of a matmul with `rows` rows by a weight of about size x size, in `dtype`, on `threads`
    threads: the profile's measured tables (log-interpolated in rows and in weight size, linearly in
    threads), or a preset's matmul_tflops."""
    tables = hw.matmul_gflops or {}
    if not tables or not all(dtype in t for t in tables.values()):
        return float(hw.matmul_tflops or 0.1) * 1e12

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
    """Forward matmul FLOPs per token: each block's (2 per weight a token multiplies through: a mixture of experts'
    routed experts only; plus attention's 4 x seq x the query heads' width), and the head's."""
    weights = spec.token_weights_per_block or spec.linear_params_per_block or spec.block_params
    per_block = [2 * p + 4 * seq * (spec.attention_dim or spec.hidden) for p in weights]
    return per_block, 2 * (spec.head_weights or spec.vocab * spec.hidden) if spec.vocab else 2 * spec.suffix_params


def kv_cache_elements(spec: ModelSpec, prompt: int, new: int = 0) -> int:
    """Elements one sequence of a `prompt` and `new` generated tokens holds in the KV cache, summed over the blocks:
    each block's width per token (kv_cache_per_block: a latent attention's compressed latent, not every head's keys
    and values) over the tokens it keeps (a sliding window's at most). A decoder-only model caches the prompt and the
    new tokens; an encoder-decoder's (kv_cross_per_block) prompt is its encoder's input, which each decoder block's
    cross-attention caches, and its decoder's self-attention caches the new tokens."""
    widths = spec.kv_cache_per_block or [2 * spec.kv_dim] * spec.n_blocks
    windows = spec.kv_window_per_block or [0] * len(widths)
    cross = spec.kv_cross_per_block or []
    length = new if cross else prompt + new
    own = sum(
        width * (min(window, length) if window else length) for width, window in zip(widths, windows, strict=True)
    )
    return own + sum(cross) * prompt


def layer_activation_elements(spec: ModelSpec) -> int:
    """Elements autograd keeps per token and block (the module docstring's 10h + 4kv + 4i), with the four of the ten
    that are query-wide (q before and after rotary, the attention output and its projection's input) at the query
    heads' width: Qwen3's and Gemma's exceed hidden."""
    query = spec.attention_dim or spec.hidden
    return 6 * spec.hidden + 4 * query + 4 * spec.kv_dim + 4 * spec.intermediate


def streaming_step_flops(spec: ModelSpec, seq: int, batch_size: int, trainable_layers: list[int]) -> float:
    """Matmul FLOPs of one streamed sparse-LoRA step: the forward of every block, the recompute and the
    input gradients from the lowest trainable block up, and the head's forward and input gradient."""
    per_block, head = token_flops(spec, seq)
    lowest = min(trainable_layers) if trainable_layers else len(per_block)
    return (sum(per_block) + 2 * sum(per_block[lowest:]) + 2 * head) * batch_size * seq


def compute_s(
    spec: ModelSpec,
    hw: Profile,
    strategy: str,
    seq: int,
    batch_size: int,
    micro_batch: int,
    trainable_layers: list[int],
    dtype: str = "float32",
    forward_group: int = 1,
    parts: bool = False,
):
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

    calls = hw.block_call_s or {}
    half = dtype != "float32"
    act_bytes = layer_activation_elements(spec) * tokens * (2 if half else 4)
    if strategy == "full":
        time_s = matmul(3 * forward + 3 * head * tokens, rows)
        framework = calls.get("full", 0.0) * n * micro_batches
        trainable, with_grad = spec.params, n
    elif strategy == "sparse_lora":
        time_s = matmul(forward, forward_group * rows) + matmul(2 * upper + 2 * head * tokens, rows)
        lora_call = calls.get("lora_bf16" if half else "lora", 0.0)
        forward_call = calls.get("forward_bf16" if half else "forward", 0.0)
        framework = forward_call * n * -(-micro_batches // forward_group) + lora_call * (n - lowest) * micro_batches
        trainable, with_grad = sum(spec.lora_params_per_block[i] for i in trainable_layers), n - lowest
    else:
        time_s = matmul(forward + upper + 2 * head * tokens, rows)
        framework = calls.get("lora_bf16" if half else "lora", 0.0) * n * micro_batches
        trainable, with_grad = sum(spec.lora_params_per_block[i] for i in trainable_layers), n - lowest
    framework += calls.get("step", 0.0) * micro_batches
    bandwidth = float(hw.memory_gb_s or 0) * 1e9
    traffic = (28 * trainable + 2 * act_bytes * with_grad) / bandwidth if bandwidth else 0.0
    if parts:
        return time_s, (framework + traffic) / share
    return time_s + (framework + traffic) / share


def norm_rate(hw: Profile, threads: int) -> float:
    """Bytes per second, as OpBytes counts them, of a network's norms, activations and pooling on `threads` threads:
    the profile's measured rates (linear in threads between those measured), or 0 where it has none (a preset, a
    GPU, an older profile): the copy bandwidth then stands in."""
    rates = {int(t): float(r) for t, r in (hw.norm_gb_s or {}).items()}
    if not rates:
        return 0.0
    lo = max((t for t in rates if t <= threads), default=min(rates))
    hi = min((t for t in rates if t >= threads), default=max(rates))
    rate = rates[lo] if lo == hi else rates[lo] + (threads - lo) / (hi - lo) * (rates[hi] - rates[lo])
    return max(rate, rates.get(1, 0.0)) * 1e9  # more threads never run slower than one (a busy moment's table)


def optimizer_bytes_per_weight(optim: OptimConfig) -> int:
    """Bytes the configured optimizer's step reads and writes per trained weight: torch.optim's own step, as
    onn.training.optim.make_optimizer builds it, counted on a meta weight (its second step: the first makes the
    state). Not AdamW's 28 of a fused kernel: the unfused step reads and writes each tensor once per operation
    (AdamW 84 bytes a weight, SGD with Nesterov momentum and weight decay 56)."""
    weight, step = _stepped_on_meta(optim)
    counter = OpBytes()
    with counter.mode:
        step.step()
    return round(counter.total / weight.numel())


def optimizer_states(optim: OptimConfig) -> int:
    """State values the configured optimizer keeps per trained weight, each in the weight's dtype: AdamW's two moments,
    SGD's momentum buffer (none without momentum). Counted on torch's own optimizer after its first step: the
    planner held AdamW's 8 bytes a weight for an SGD run too."""
    weight, step = _stepped_on_meta(optim)
    sizes = [t.numel() for state in step.state.values() for t in state.values() if hasattr(t, "numel")]
    return sum(n for n in sizes if n == weight.numel()) // weight.numel()  # the step count is a scalar


def _stepped_on_meta(optim: OptimConfig):
    """(weight, optimizer): torch.optim's step as make_optimizer builds it, on a meta weight, after its first step
    (which makes the state)."""
    import torch

    weight = torch.nn.Parameter(torch.empty(1 << 20, device="meta"))  # the step count's own bytes round away
    weight.grad = torch.empty_like(weight)
    # the settings' shape, not their values (which every task but train, tune and plan leaves unchecked): what runs
    # depends only on whether there is momentum, Nesterov's and weight decay
    decay = 0.1 if optim.weight_decay else 0.0
    if optim.name == "adamw":
        step = torch.optim.AdamW([weight], lr=1e-3, weight_decay=decay)
    else:
        momentum = 0.9 if optim.momentum else 0.0
        step = torch.optim.SGD(
            [weight], lr=0.1, momentum=momentum, weight_decay=decay, nesterov=optim.nesterov and bool(momentum)
        )
    step.step()
    return weight, step


def network_compute_s(
    spec: ModelSpec, hw: Profile, strategy: str, batch: int, dtype: str, optimizer_bytes: int
) -> float:
    """Predicted time of a classifier network's step (the whole batch, one pass), from the profile as compute_s reads
    it: the forward FLOPs (the spec's count), three times over for full training (input and weight gradients; a
    linear probe trains its head only, on features cached once), at the measured matmul rate for the compute dtype on
    the plan's threads, times the share of the cores they get; plus the memory traffic at the measured bandwidth of
    the step's memory-bound ops (norms, activations, pooling and their backward: the spec's count, op by op; where it
    has none, the saved activations written in the forward and read in the backward), the counted ones at the rate the
    profile measured such ops run at (norm_rate), the rest and the optimizer's (`optimizer_bytes` per trained weight:
    optimizer_bytes_per_weight) at the measured copy bandwidth; and the measured framework time per block
    call and step. The rate is the table's at a row per sample, through a weight of the blocks' mean size: a
    convolution's product has a row per sample and output position, but its few channels keep it well below a large
    product's rate (v28's bf16 step ran at a third of the 1,024-row rate)."""
    threads, share = threads_for(hw) if hw.accelerator == "cpu" else (1, 1.0)
    full = strategy == "full"
    trained = spec.params if full else spec.head_params
    flops = (3 * spec.sample_flops if full else 6 * spec.head_params) * batch
    layers = max(1, spec.n_blocks)
    size = math.sqrt(max(sum(spec.block_params) / layers, 1.0))
    matmul = flops / matmul_rate(hw, dtype, batch, threads, size)
    # as the spec counts them, in float32: under bf16 autocast v28 saved 77% as many bytes (its norms stay float32)
    per_sample = (spec.sample_step_bytes or 2 * spec.sample_activation_bytes) + spec.sample_transform_bytes
    activations = per_sample * batch if full else 0.0  # (a probe's features are transformed and cached once)
    bandwidth = float(hw.memory_gb_s or 0) * 1e9
    activation_rate = (norm_rate(hw, threads) if spec.sample_step_bytes else 0.0) or bandwidth
    traffic = optimizer_bytes * trained / bandwidth if bandwidth else 0.0
    traffic += activations / activation_rate if activation_rate else 0.0
    calls = hw.block_call_s or {}
    framework = calls.get("full", 0.0) * layers + calls.get("step", 0.0) if full else calls.get("step", 0.0)
    return (matmul + traffic + framework) / share
