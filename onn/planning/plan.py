"""Choose strategy, micro-batch and precision for a model on a machine, and predict peak memory and step time.

Sizes come from the model built on the meta device and its LayerMap, never from constants keyed by model
name. Every candidate (full, lora, qlora, sparse_lora) gets a memory breakdown and a predicted step time
(onn/planning/costs.py); sparse_lora is sized as ONN's layer-streaming engine runs it, every streaming setting
that fits with its own predicted time (onn/planning/streaming.py). With strategy=auto, pretrained weights get
the first of lora -> qlora -> sparse_lora that fits; a model trained from random init gets full.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from onn.config import LoraConfig, ONNConfig, StrategyConfig, StreamingConfig, as_dict
from onn.config.data import DataConfig, SplitData, TextData
from onn.config.model import NetworkConfig
from onn.config.strategy import SPARSE_LAYERS
from onn.dtypes import BYTES_PER_VALUE as DTYPE_BYTES
from onn.errors import UserError
from onn.hardware.profile import Profile
from onn.models.layers import resolve_indices
from onn.planning.costs import (
    CPU_HEAP_OVERHEAD,
    HEADROOM,
    MB,
    TRUE_PRECISION_BYTES,
    Estimate,
    activation_bytes,
    budget_mb,
    choose_precision,
    compute_dtype_name,
    compute_s,
    context_mb,
    fits,
    layer_activation_elements,
    matmul_rate,
    network_compute_s,
    optimizer_bytes_per_weight,
    optimizer_states,
    threads_for,
    trained_weight_bytes,
)
from onn.planning.spec import ModelSpec, targeted_linears
from onn.planning.streaming import (
    CPU_TIE,
    GPU_TIE,
    PRECISE_FIRST,
    STREAMING_CHOICES,
    STREAMING_KEYS,
    FixedStreaming,
    StreamingPlan,
    StreamShape,
    estimate_streaming,
    network_streaming,
    peak,
    store_dtypes,
)
from onn.planning.tuned import lookup

CANDIDATES = ("full", "lora", "qlora", "sparse_lora")
NETWORK_CANDIDATES = ("full", "linear_probe")
AUTO_ORDER = ("lora", "qlora", "sparse_lora")  # the adapter strategies; pretrained weights: the first that fits wins
STREAMING_LIGHTNING = ("streaming", "auto")  # strategy.lightning values under which sparse_lora streams
EXTRAS = ("scale", "data_streamed", "tuned", "step_time_source")  # plan.yaml holds these only when set


@dataclass
class Plan:
    """What a run does on this machine and why: plan.yaml, as `as_dict` writes it."""

    strategy: str  # the chosen candidate: full, lora, qlora, sparse_lora, linear_probe
    requested: str  # strategy.name as asked (auto, or a candidate)
    reasons: list[str]  # why, one line each
    micro_batch: int
    accumulate: int  # micro-batches per optimizer step
    precision: str  # Lightning's precision
    weights_dtype: str  # the frozen weights' dtype
    sequence_length: int | None  # data.max_length (language models)
    predicted_peak_memory_mb: float  # allocated by the run, its context left out
    predicted_step_s: float
    context_mb: float  # the CUDA context, or the process's baseline on CPUs
    budget_mb: float
    sparse_layers: list[int] | None  # sparse_lora's trained blocks
    gradient_checkpointing: bool
    settings_source: str  # plan, or tune (a cached task=tune result)
    streaming: StreamingPlan | None  # sparse_lora's streaming setting
    threads: int | None  # torch's threads (CPU plans)
    hardware: dict[str, Any]  # the machine, as hardware_summary records it
    model: dict[str, Any]  # name, params, blocks, layer map, pretrained
    candidates: dict[str, dict[str, Any]]  # every candidate's memory, by name
    scale: dict[str, Any] | None = None  # several devices or nodes (scale.py)
    data_streamed: bool | None = None  # the data read as a stream rather than held
    tuned: dict[str, Any] | None = None  # where task=tune's settings came from
    step_time_source: str | None = None  # timed: the step time from the model's own blocks (calibrate.py)

    def as_dict(self) -> dict[str, Any]:
        """The plan as plan.yaml (and a benchmark's child process) reads it: plain values."""
        values = asdict(self)
        return {k: v for k, v in values.items() if k not in EXTRAS or v is not None}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Plan:
        """A plan read back from `as_dict`'s values."""
        streaming = values["streaming"]
        values = {**values, "streaming": StreamingPlan(**streaming) if streaming else None}
        return cls(**values)


def _network_estimates(
    spec: ModelSpec, hw: Profile, batch: int, half: bool, optimizer_bytes: int, ctx: float
) -> dict[str, Estimate]:
    """A classifier network's candidates (full training, a linear probe): their memory, and whether it fits."""
    estimates = {}
    for name in NETWORK_CANDIDATES:
        trainable = spec.params if name == "full" else spec.head_params
        # a probe's backbone runs once, without autograd, to cache features: one batch of activations
        activations = spec.sample_activation_bytes * batch * (0.5 if half else 1) if name == "full" else 0
        weights, grads, optim = spec.params * 4, trainable * 4, trainable * optimizer_bytes
        workspace = 0.05 * (weights + activations) + (CPU_HEAP_OVERHEAD * activations if hw.accelerator == "cpu" else 0)
        est = Estimate(
            name,
            False,
            batch,
            weights / MB,
            grads / MB,
            optim / MB,
            activations / MB,
            workspace / MB,
            ctx,
            note="plus the resident dataset, measured when it is read",
        )
        est.fits = fits(est, hw)
        estimates[name] = est
    return estimates


def check_layers_apply(strategy: StrategyConfig) -> None:
    """strategy.layers picks the blocks sparse_lora adapts; every other strategy trains every block, and read the
    key nowhere: strategy=lora strategy.layers=[0,-1] put adapters on all 40 blocks without a word."""
    if strategy.name != "sparse_lora" and strategy.layers not in (None, "all"):
        raise UserError(
            f"strategy.layers={strategy.layers!r} picks the blocks strategy=sparse_lora adapts, and strategy="
            f"{strategy.name} trains every block: use strategy=sparse_lora (strategy.lightning=ddp keeps the model "
            "resident), or leave strategy.layers at all."
        )


def check_probe_weights(cfg: ONNConfig) -> None:
    """A linear probe trains a head on a frozen network's features: without model.weights (or a checkpoint, or the
    user's own builder, which may load weights itself) the network is a random one, and the probe ran silently."""
    model = cfg.model
    if not isinstance(model, NetworkConfig) or model.weights or cfg.ckpt or ".py:" in str(model.source):
        return
    raise UserError(
        f"strategy=linear_probe freezes model {model.name} and trains a head on its features, and model.weights is "
        "null, so the frozen network would be random: give model.weights=PATH.safetensors, or use strategy=full."
    )


def check_network_micro_batch(strategy: StrategyConfig, batch: int) -> None:
    """A network other than a language model (a classifier, a dual encoder, a denoiser) trains each batch in one
    pass (streamed too): strategy.micro_batch, which nothing of it reads, was planned and run as the whole batch
    without a word."""
    given = strategy.micro_batch
    if given in (None, "auto") or given == batch:
        return
    raise UserError(
        f"strategy.micro_batch={given}: this network trains each batch of data.batch_size={batch} in one pass "
        "(micro-batches are a language model's); lower data.batch_size instead, and leave strategy.micro_batch at auto."
    )


def _network_precision(given: str | None, hw: Profile, spec: ModelSpec) -> tuple[str, list[str]]:
    """A network's precision, and the reason when the CPU decides it. oneDNN runs bf16 convolutions on AMX /
    AVX512-BF16 (v28 trained 2x faster), but its bf16 Conv3d backward corrupted the heap on such a CPU (PyTorch
    2.11, clips of 96 px and up: "free(): invalid next size"), so a 3-D network stays in float32 there."""
    bf16_cpu = hw.accelerator == "cpu" and bool(hw.bf16)
    if given not in (None, "auto"):
        if bf16_cpu and spec.conv3d and given.startswith("bf16"):
            return given, [
                f"WARNING: strategy.precision={given} on a CPU: oneDNN's bf16 Conv3d backward aborted with heap "
                "corruption on such CPUs (PyTorch 2.11, 96 px and up); strategy.precision=32-true avoids it"
            ]
        return given, []
    if bf16_cpu and spec.conv3d:
        return "32-true", [
            "precision 32-true: this CPU has bf16 matrix units, but the network has 3-D convolutions, whose bf16 "
            "backward in oneDNN aborted with heap corruption on such CPUs (PyTorch 2.11); "
            "strategy.precision=bf16-mixed asks for bf16 anyway"
        ]
    if bf16_cpu:
        return "bf16-mixed", ["precision bf16-mixed: this CPU has bf16 matrix units (AMX / AVX512-BF16)"]
    return choose_precision(hw), []


def strategy_source(cfg: ONNConfig, name: str) -> str:
    """The plan's reason for a strategy named in the config: with ckpt= it is the checkpoint's (from_checkpoint
    replaces the strategy config), which the plan said "was asked for" though the command line named none."""
    return f"strategy={name}, the checkpoint's" if cfg.ckpt else f"strategy={name} was asked for"


def make_network_plan(cfg: ONNConfig, hw: Profile, spec: ModelSpec) -> Plan:
    """The plan for a classifier network (images, audio, video, points): full training or a linear
    probe, the whole batch in one pass."""
    requested = cfg.strategy.name
    check_layers_apply(cfg.strategy)
    if requested not in ("auto", *NETWORK_CANDIDATES):
        raise UserError(
            f"strategy={requested}: classifiers train with strategy=full or strategy=linear_probe "
            "(the LoRA and streaming strategies are for language models)."
        )
    if requested == "linear_probe":
        check_probe_weights(cfg)
    batch = int(cfg.data.batch_size)
    check_network_micro_batch(cfg.strategy, batch)
    precision, reasons = _network_precision(cfg.strategy.precision, hw, spec)
    half = precision.startswith(("bf16", "16"))
    optimizer_bytes = 8 if cfg.optim.name == "adamw" else 4  # AdamW keeps two moments, SGD one
    ctx = context_mb(hw)
    estimates = _network_estimates(spec, hw, batch, half, optimizer_bytes, ctx)
    if requested == "auto":
        chosen = "full"
        reasons.insert(0, "a classifier: train every weight (strategy=linear_probe trains a head on frozen features)")
    else:
        chosen = requested
        reasons.insert(0, strategy_source(cfg, requested))
    est = estimates[chosen]
    if not est.fits:
        reasons.append(
            f"WARNING: predicted {est.peak_mb + est.context_mb:,.0f} MB exceeds the {budget_mb(hw):,.0f} MB budget; "
            "lower data.batch_size"
        )
    dtype, moved = compute_dtype_name(hw, precision), optimizer_bytes_per_weight(cfg.optim)
    step_s = network_compute_s(spec, hw, chosen, batch, dtype, moved)
    return Plan(
        strategy=chosen,
        requested=requested,
        reasons=reasons,
        micro_batch=batch,
        accumulate=1,
        precision=precision,
        weights_dtype="float32",
        sequence_length=None,
        predicted_peak_memory_mb=round(est.peak_mb, 1),
        predicted_step_s=round(step_s, 4),
        context_mb=round(ctx, 1),
        budget_mb=round(budget_mb(hw), 1),
        sparse_layers=None,
        gradient_checkpointing=False,
        settings_source="plan",
        streaming=None,
        threads=threads_for(hw)[0] if hw.accelerator == "cpu" else None,
        hardware=hardware_summary(hw),
        model={
            **model_summary(spec),
            "flops_per_sample": spec.sample_flops,
            "activation_bytes_per_sample": spec.sample_activation_bytes,
            "step_bytes_per_sample": spec.sample_step_bytes,
            "transform_bytes_per_sample": spec.sample_transform_bytes,
        },
        candidates=candidate_table(estimates),
    )


def _network_streaming_notes(given: StreamingConfig, streaming: StreamingPlan) -> list[str]:
    """What the plan says of the streaming settings a network's engine takes otherwise than a language model's:
    those that do not apply, and a store that keeps the blocks at less than their precision."""
    notes = []
    if given.mlp_tiles not in ("auto", 1):  # a language model's gated MLPs only (onn/streaming/tiled_mlp.py)
        notes.append(f"strategy.streaming.mlp_tiles={given.mlp_tiles} does not apply: a network's blocks compute whole")
    if given.edges == "stream":
        notes.append(
            "strategy.streaming.edges=stream does not apply: a network's layers outside its blocks stay in memory"
        )
    if given.eval_tokens != "auto":
        notes.append(
            f"strategy.streaming.eval_tokens={given.eval_tokens} does not apply: a network's validation streams "
            "one batch at a time"
        )
    if streaming.store_dtype != "float32":
        notes.append(
            f"the blocks' frozen weights are stored as {streaming.store_dtype} and computed in "
            f"{streaming.compute_dtype} from that; task=eval, infer and export of the checkpoint build them again at "
            "full precision"
        )
    return notes


def _network_streaming_precision(given: str | None, hw: Profile, spec: ModelSpec) -> tuple[str, list[str]]:
    """A streamed network's precision, chosen as a resident network's is (_network_precision), and a reason line
    saying which and why: it was 32-true whatever strategy.precision said or the machine ran fast. A CPU's default
    stays 32-true, bf16 units or not: streamed blocks are matrix products (a DiT's, an LSTM's), which CPU bf16 autocast
    ran slower than float32 (choose_precision), and each block's float32 store would be cast on every load."""
    if given in (None, "auto") and hw.accelerator == "cpu":
        return "32-true", [
            "precision 32-true: a CPU's default for streamed blocks, matrix products that bf16 autocast ran slower "
            "than float32 on CPUs; strategy.precision=bf16-mixed asks for bf16"
        ]
    precision, reasons = _network_precision(given, hw, spec)
    if reasons:
        return precision, reasons
    if given not in (None, "auto"):
        why = f"strategy.precision={given} was asked for"
    elif hw.accelerator == "cuda":
        why = "the GPU " + ("runs bf16 fast" if hw.bf16 else "has no fast bf16, so float16 with a loss scale")
    else:
        why = f"the {hw.accelerator}'s default (strategy.precision=bf16-mixed asks for bf16)"
    return precision, [f"precision {precision}: {why}; the store keeps the frozen weights in float32 unless fixed"]


def make_network_streaming_plan(cfg: ONNConfig, hw: Profile, spec: ModelSpec) -> Plan:
    """A network's blocks streamed (strategy=sparse_lora on a denoiser or a recurrent stack): its frozen block
    weights in a layer store, what trains resident, the whole batch one micro-batch (network_streaming)."""
    if spec.n_blocks < 1:
        raise UserError(f"strategy=sparse_lora streams a model's blocks, and {spec.name} has none to stream.")
    check_blocks(cfg.strategy.streaming, spec.n_blocks)  # a chunk past the blocks: planned, then the engine refused it
    batch = int(cfg.data.batch_size)
    check_network_micro_batch(cfg.strategy, batch)
    ctx = context_mb(hw)
    optimizer_bytes = 8 if cfg.optim.name == "adamw" else 4
    budget = (budget_mb(hw) - ctx) * MB
    precision, precision_reasons = _network_streaming_precision(cfg.strategy.precision, hw, spec)
    fixed = fixed_streaming(cfg.strategy.streaming)
    streaming, m = network_streaming(spec, hw, batch, budget, fixed, optimizer_bytes, precision)
    est = Estimate(
        "sparse_lora",
        False,
        batch,
        m["weights"] / MB,
        m["trainable"] / MB,
        m["optimizer"] / MB,
        m["activations"] / MB,
        m["workspace"] / MB,
        ctx,
        streaming=streaming,
        note=f"streams {streaming.chunk_size} block(s) at a time from a {streaming.store} store",
    )
    est.fits = fits(est, hw)
    store_mb = m["store"] / MB
    reasons = [
        strategy_source(cfg, "sparse_lora"),
        f"{spec.n_blocks} blocks ({spec.layer_map}), {store_mb:,.1f} MB of frozen block weights in a "
        f"{streaming.store} store of {streaming.store_dtype}"
        + (f" ({streaming.cache_blocks} blocks cached in memory)" if streaming.cache_blocks else "")
        + f", {streaming.chunk_size} block(s) at a time: predicted {peak(m) / MB:,.1f} MB "
        f"for the step in a budget of {budget / MB:,.1f} MB (the process's {ctx:,.0f} MB aside)",
    ]
    reasons += precision_reasons
    reasons += _network_streaming_notes(cfg.strategy.streaming, streaming)
    if streaming.refused:
        raise UserError(
            f"hardware {hw.name}: a budget of {budget_mb(hw):,.0f} MB cannot hold one streamed block of {spec.name} "
            f"with its activations (predicted {peak(m) / MB + ctx:,.0f} MB): raise hardware.budget_mb or lower "
            "data.batch_size."
        )
    return Plan(
        strategy="sparse_lora",
        requested="sparse_lora",
        reasons=reasons,
        micro_batch=batch,
        accumulate=1,
        precision=precision,
        weights_dtype="float32",
        sequence_length=None,
        predicted_peak_memory_mb=round(est.peak_mb, 1),
        predicted_step_s=streaming.predicted_step_s,
        context_mb=round(ctx, 1),
        budget_mb=round(budget_mb(hw), 1),
        sparse_layers=[i for i, t in enumerate(spec.lora_params_per_block) if t],
        gradient_checkpointing=False,
        settings_source="plan",
        streaming=streaming,
        threads=streaming.threads,
        hardware=hardware_summary(hw),
        model={**model_summary(spec), "flops_per_sample": spec.sample_flops},
        candidates=candidate_table({"sparse_lora": est}),
    )


def model_summary(spec: ModelSpec) -> dict[str, Any]:
    """plan.yaml's `model`: what was planned for."""
    return {
        "name": spec.name,
        "params": spec.params,
        "blocks": spec.n_blocks,
        "layer_map": spec.layer_map,
        "pretrained": spec.pretrained,
    }


def candidate_table(estimates: dict[str, Estimate]) -> dict[str, dict[str, Any]]:
    """Every candidate's memory as plan.yaml lists it, MB to one decimal (a candidate that streams: its setting)."""
    table = {}
    for name, e in estimates.items():
        row = {k: round(v, 1) if isinstance(v, float) else v for k, v in asdict(e).items()}
        table[name] = {**row, "streaming": row["streaming"] or {}, "peak_mb": round(e.peak_mb, 1)}
    return table


def frozen_weight_bytes(hw: Profile, precision: str) -> int:
    """Bytes of a frozen weight: a "-true" precision's dtype (Lightning converts the module to it); under a mixed
    precision half precision on an accelerator, on a CPU only under bf16, whose matmuls it computes in."""
    if precision in TRUE_PRECISION_BYTES:
        return TRUE_PRECISION_BYTES[precision]
    if hw.accelerator == "cpu":
        return 2 if precision.startswith("bf16") else 4
    return 2 if precision.endswith("mixed") or precision.startswith(("bf16", "16")) else 4


def weights_and_states(
    strategy: str,
    spec: ModelSpec,
    mixed: bool,
    frozen_bytes: int,
    adapted: list[int],
    weight_bytes: int = 4,
    states: int = 2,
) -> tuple[float, ...]:
    """Bytes of a full or (Q)LoRA candidate's weights, trainable weights' gradients and optimizer state, and the extra
    half-precision copy of the weights that mixed-precision full training keeps. `adapted`: the blocks with
    adapters; `weight_bytes`: a trained weight's (trained_weight_bytes: a "-true" precision's dtype, else float32),
    its gradient's and each optimizer state's; `states`: the optimizer's state values per weight (optimizer_states)."""
    if strategy == "full":
        p = spec.params
        return p * weight_bytes, p * weight_bytes, p * states * weight_bytes, p * 2 if mixed else 0
    lora_all = sum(spec.lora_params_per_block[i] for i in adapted)
    if strategy == "qlora":
        # the blocks' linear layers in NF4; the rest (embeddings, norms, head) as the frozen weights are
        linear = sum(spec.linear_params_per_block)
        weights = linear * DTYPE_BYTES["nf4"] + (spec.params - linear) * frozen_bytes
    else:
        weights = spec.params * frozen_bytes
    return weights + lora_all * weight_bytes, lora_all * weight_bytes, lora_all * states * weight_bytes, 0


def estimate(
    strategy: str,
    spec: ModelSpec,
    hw: Profile,
    seq: int,
    micro_batch: int,
    precision: str,
    sparse_layers: list[int],
    batch_size: int,
    store_dtype: str | None = None,
    fixed: FixedStreaming | None = None,
    prefetch: bool = True,
    checkpointing: bool = False,
    present: dict[str, int] | None = None,
    where: str = "paths.cache",
    streamed: bool = True,
    states: int = 2,
    dropped: list[int] | None = None,
) -> Estimate:
    """Predicted memory of one candidate at one micro-batch. With gradient checkpointing, autograd
    keeps only each block's input, and one block's activations exist at a time, during its recompute.
    `fixed`: the streaming settings the config fixes (fixed_streaming); `prefetch`: strategy.streaming.prefetch;
    `streamed`: False for sparse_lora placed by another Lightning strategy, which trains it resident; `states`: the
    optimizer's state values per trained weight (optimizer_states); `dropped`: per block, the input features whose
    LoRA dropout copy autograd keeps (lora_dropped), each value at the activations' bytes and its one-byte mask."""
    mixed = precision.endswith("mixed")
    act_bytes = activation_bytes(precision)
    frozen_bytes = frozen_weight_bytes(hw, precision)
    per_token_layer = layer_activation_elements(spec)
    # autograd keeps what the blocks from the lowest adapted one up need for their input gradients
    with_grad = spec.n_blocks - (min(sparse_layers, default=0) if strategy == "sparse_lora" else 0)
    kept_layers = spec.hidden * with_grad + per_token_layer if checkpointing else per_token_layer * with_grad
    adapted = sparse_layers if strategy == "sparse_lora" else list(range(spec.n_blocks))
    in_blocks = [dropped[i] for i in adapted] if dropped and strategy != "full" else [0]
    dropout = max(in_blocks) if checkpointing else sum(in_blocks)  # checkpointed: one block's at a time
    tokens = micro_batch * seq
    logits = tokens * spec.vocab * 4 * 3
    ctx = context_mb(hw)
    if why := cannot_run(strategy, hw):
        return Estimate(strategy, False, micro_batch, 0, 0, 0, 0, 0, ctx, note=why)
    if strategy in ("full", "lora", "qlora") or not streamed:
        weights, trainable, optimizer, extra = weights_and_states(
            strategy, spec, mixed, frozen_bytes, adapted, trained_weight_bytes(precision), states
        )
        activations = (kept_layers * act_bytes + dropout * (act_bytes + 1)) * tokens + logits
    elif strategy == "sparse_lora":
        shape = StreamShape(
            spec,
            hw,
            compute_dtype_name(hw, precision),
            seq,
            micro_batch,
            batch_size,
            sparse_layers,
            per_token_layer,
            logits,
            prefetch=prefetch,
            budget=(budget_mb(hw) - ctx) * MB,
            fixed=fixed or FixedStreaming(),
            present=present or {},
            where=where,
            precision=precision,
            states=states,
            dropped=max(in_blocks),
        )
        return estimate_streaming(shape, [store_dtype] if store_dtype else store_dtypes(hw, precision), ctx)
    else:
        raise ValueError(strategy)
    return _resident_estimate(
        strategy, hw, micro_batch, batch_size, ctx, (weights, trainable, optimizer, activations), extra
    )


def _resident_estimate(
    strategy: str,
    hw: Profile,
    micro_batch: int,
    batch_size: int,
    ctx: float,
    parts: tuple[float, float, float, float],
    extra: float,
) -> Estimate:
    """A resident candidate's estimate from its bytes (weights, trainable, optimizer, activations) and the extra
    workspace its strategy needs: a twentieth of what it holds, and on a CPU the heap's share of the activations."""
    weights, trainable, optimizer, activations = parts
    workspace = 0.05 * (weights + max(trainable, activations) + optimizer) + extra
    if hw.accelerator == "cpu":
        workspace += CPU_HEAP_OVERHEAD * activations
    megabytes = (v / MB for v in (weights, trainable, optimizer, activations, workspace))
    est = Estimate(strategy, False, micro_batch, *megabytes, ctx, "", accumulates=batch_size > micro_batch)
    est.fits = fits(est, hw)
    return est


def cannot_run(strategy: str, hw: Profile) -> str | None:
    """Why a candidate cannot run on this machine whatever its memory, or None."""
    if strategy == "qlora" and hw.accelerator == "mps":
        return "bitsandbytes' 4-bit layers run on CUDA GPUs and CPUs, not on Apple's MPS"
    return None


PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true")  # Lightning's own names


def check_settings(cfg: ONNConfig, hw: Profile) -> None:
    """What a plan cannot be made from, in one sentence before any is made: strategy.streaming values, and
    a memory budget below what the process already holds (planned, it would be a negative budget)."""
    streaming = cfg.strategy.streaming
    if streaming is not None:
        check_streaming(streaming)
    if cfg.strategy.lora is not None:
        check_lora(cfg.strategy.lora)
    check_workers(cfg.data)
    check_precision(cfg.strategy.precision, hw)
    check_trainer_precision(cfg)
    held = context_mb(hw)
    if budget_mb(hw) <= held:
        given = cfg.hardware.budget_mb
        cause = (
            f"hardware.budget_mb={given:g} MB"
            if given is not None
            else f"this machine's available memory ({hw.host_memory_available_mb or hw.device_memory_mb} MB)"
        )
        raise UserError(
            f"{cause} is below what the run holds before any model is built ({held:,.0f} MB: "
            f"{'the CUDA context' if hw.accelerator == 'cuda' else 'Python, torch and the libraries'}); "
            f"give a budget above {held:,.0f} MB."
        )


def check_lora(lora: LoraConfig) -> None:
    """strategy.lora's rank and scale: r=0 made adapters of no parameters, which the plan then took for blocks that
    hold no linear layer, and a negative alpha flipped the adapters' sign without a word."""
    if isinstance(lora.r, bool) or not isinstance(lora.r, int) or lora.r < 1:
        raise UserError(
            f"strategy.lora.r={lora.r}: give the adapters' rank, a whole number 1 or more (8 or 16 is usual)."
        )
    if not lora.alpha > 0:
        raise UserError(
            f"strategy.lora.alpha={lora.alpha}: give a number above 0 (the adapters' output is scaled by alpha / r)."
        )
    if not 0 <= lora.dropout < 1:
        raise UserError(
            f"strategy.lora.dropout={lora.dropout}: give the share of the adapters' inputs dropped in training, "
            "from 0 (none) to below 1 (0.05 or 0.1 is usual)."
        )


def check_workers(data: DataConfig) -> None:
    """data.num_workers of the data that has it (text and labelled samples): torch's DataLoader refused a negative
    one with a traceback once the data was loaded, after a plan had said ok."""
    if not isinstance(data, TextData | SplitData):
        return
    workers = data.num_workers
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise UserError(
            f"data.num_workers={workers}: give a whole number of loader workers, 0 (load in the main process) or more."
        )


def check_precision(precision: str | None, hw: Profile) -> None:
    """strategy.precision: one Lightning runs, and one this machine has (Lightning would fail at the run, or run
    another than the plan records)."""
    if precision not in (None, "auto", *PRECISIONS):
        raise UserError(f"strategy.precision={precision!r}: give auto, or one of {', '.join(PRECISIONS)}.")
    if precision in (None, "auto"):
        return
    if precision.startswith("bf16") and hw.accelerator == "cuda" and hw.bf16 is False:
        raise UserError(
            f"strategy.precision={precision}: {hw.device_name or 'this GPU'} has no bf16; "
            "give 16-mixed, 32-true or auto."
        )
    if precision.startswith("16") and hw.accelerator == "cpu":
        raise UserError(
            f"strategy.precision={precision}: float16 autocast is for GPUs; on a CPU give bf16-mixed, 32-true or auto."
        )


SHORT_PRECISIONS = {"16": "16-mixed", "bf16": "bf16-mixed", "32": "32-true", "64": "64-true"}  # Lightning's aliases


def check_trainer_precision(cfg: ONNConfig) -> None:
    """trainer.precision, given, must be strategy.precision's: the plan sizes memory and picks the compute dtype from
    strategy.precision, and the Trainer ran in trainer.precision while the plan and plan.yaml said another."""
    given = cfg.trainer.precision
    if given in (None, "auto"):
        return
    named = SHORT_PRECISIONS.get(str(given), str(given))
    if named == cfg.strategy.precision:
        return
    use = (
        f"strategy.precision={named}" if named in PRECISIONS else f"strategy.precision (one of {', '.join(PRECISIONS)})"
    )
    raise UserError(
        f"trainer.precision={given} differs from strategy.precision={cfg.strategy.precision}, which the plan sizes "
        f"memory and the compute dtype for: give {use} and leave trainer.precision at auto."
    )


def check_streaming(streaming: StreamingConfig) -> None:
    """strategy.streaming's values: a chunk size of whole blocks, MLP slices, tokens per evaluation pass, and each
    choice one of its kind."""
    for key, what in (("chunk_size", "blocks"), ("mlp_tiles", "slices"), ("eval_tokens", "tokens per streamed pass")):
        value = getattr(streaming, key)
        if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise UserError(f"strategy.streaming.{key}={value!r}: give a whole number of {what}, 1 or more, or auto.")
    for key, choices in STREAMING_CHOICES.items():
        value = getattr(streaming, key)
        if value not in ("auto", None, *choices):
            raise UserError(f"strategy.streaming.{key}={value!r} is not one of auto, {', '.join(choices)}.")
    cached = streaming.cache_blocks
    if cached != "auto" and (isinstance(cached, bool) or not isinstance(cached, int) or cached < 0):
        raise UserError(
            f"strategy.streaming.cache_blocks={cached!r}: give a whole number of blocks, 0 or more, or auto."
        )


def check_blocks(streaming: StreamingConfig | None, blocks: int) -> None:
    """strategy.streaming's block counts against the model's blocks (the engine would refuse a chunk only at
    the run, after task=plan had planned it)."""
    if streaming is None:
        return
    for key in ("chunk_size", "cache_blocks"):
        value = getattr(streaming, key)
        if value != "auto" and value > blocks:
            raise UserError(
                f"strategy.streaming.{key}={value}: this model has {blocks} blocks; give {blocks} or fewer, or auto."
            )


def fixed_streaming(streaming: StreamingConfig | None) -> FixedStreaming:
    """The streaming settings the config fixes (those not `auto`): the planner takes them as given."""
    if streaming is None:
        return FixedStreaming()
    values = as_dict(streaming)
    return FixedStreaming(**{k: None if values[k] == "auto" else values[k] for k in STREAMING_KEYS})


def _store_present_bytes(cfg: ONNConfig, store_dtype: str) -> int:
    """Bytes of complete blocks already in this model's disk store of `store_dtype` (a build resumes there)."""
    folder = _store_folder(cfg) / store_dtype
    if not folder.is_dir():
        return 0
    return sum(f.stat().st_size for f in folder.glob("*.safetensors") if f.with_suffix(".done").is_file())


def micro_batch_sizes(batch_size: int) -> list[int]:
    sizes, c = [], 1
    while c <= batch_size:
        sizes.append(c)
        c *= 2
    return sorted(sizes, reverse=True)


def targeted_spec(spec: ModelSpec, lora: LoraConfig | None, model: str) -> ModelSpec:
    """The spec with its adapters (lora_params_per_block) at strategy.lora.r on the linear layers
    strategy.lora.target_modules picks: [q_proj] was sized as all-linear."""
    targeted = targeted_linears(spec, lora.target_modules) if lora is not None and spec.kind == "lm" else None
    if targeted is None:
        return spec
    if not any(targeted) and any(spec.linears_per_block or []):
        raise UserError(
            f"strategy.lora.target_modules={lora.target_modules!r} matches no linear layer in the blocks of model "
            f"{model}: give names of its linear layers (e.g. q_proj, v_proj), or all-linear."
        )
    return replace(spec, lora_params_per_block=[lora.r * sum(i + o for _, i, o in block) for block in targeted])


def lora_dropped(spec: ModelSpec, lora: LoraConfig | None) -> list[int]:
    """Per block, the input features of the adapted linears whose input LoRA dropout keeps for the backward (the
    dropped copy beside the linear's own; peft skips dropout at 0): 56% more activations at dropout 0.1, unplanned."""
    targeted = targeted_linears(spec, lora.target_modules) if lora is not None and spec.kind == "lm" else None
    if targeted is None or not lora.dropout:
        return [0] * spec.n_blocks
    return [sum(i for _, i, _ in block) for block in targeted]


@dataclass
class PlanRequest:
    """What a language model's plan is asked for, read once from the config."""

    cfg: ONNConfig
    hw: Profile
    spec: ModelSpec
    requested: str
    seq: int
    batch_size: int
    sparse_layers: list[int]
    fixed_micro_batch: int | None
    checkpointing: bool
    fixed: FixedStreaming  # the streaming settings the config fixes
    prefetch: bool
    present: dict[str, int]
    precisions: dict[str, str]
    # sparse_lora streams under ONN's own strategy (or auto); another Lightning strategy named (ddp, fsdp) trains
    # it resident, which the plan then sizes
    streams: bool
    states: int  # the optimizer's state values per trained weight (optimizer_states)
    dropped: list[int]  # per block, the input features of the linears whose LoRA dropout keeps its input (lora_dropped)

    @classmethod
    def read(cls, cfg: ONNConfig, hw: Profile, spec: ModelSpec) -> PlanRequest:
        strategy_cfg = cfg.strategy
        spec = targeted_spec(spec, strategy_cfg.lora, cfg.model.name)
        seq, batch_size, n = int(cfg.data.max_length), int(cfg.data.batch_size), spec.n_blocks
        # the sparse_lora candidate of another strategy: first and last four blocks, as many as exist
        default = [i for i in SPARSE_LAYERS if -n <= i < n]
        check_layers_apply(strategy_cfg)
        layers = strategy_cfg.layers if strategy_cfg.name == "sparse_lora" else default
        if strategy_cfg.name in AUTO_ORDER and spec.lora_params_per_block and not any(spec.lora_params_per_block):
            raise UserError(  # before strategy.layers is read: a recurrent stack has fewer blocks than the default
                f"strategy={strategy_cfg.name}: the blocks of model {cfg.model.name} hold no linear layer for LoRA "
                "adapters (a stack of LSTM or GRU layers): train it with strategy=full."
            )
        sparse_layers = resolve_indices(layers, n)
        fixed_mb = strategy_cfg.micro_batch
        if fixed_mb not in (None, "auto") and (not isinstance(fixed_mb, int) or fixed_mb < 1):
            raise UserError(f"strategy.micro_batch={fixed_mb}: give a whole number of samples, 1 or more, or auto.")
        floor = strategy_cfg.min_micro_batch
        if isinstance(floor, bool) or not isinstance(floor, int) or floor < 1:
            raise UserError(
                f"strategy.min_micro_batch={floor}: give the smallest micro-batch an out-of-memory retry may halve "
                "to, a whole number of samples, 1 or more."
            )
        if batch_size < 1:
            raise UserError(f"data.batch_size={batch_size}: give a whole number of samples, 1 or more.")
        if fixed_mb not in (None, "auto") and fixed_mb > batch_size:
            raise UserError(
                f"strategy.micro_batch={fixed_mb} is more than data.batch_size={batch_size}: a micro-batch is part of "
                "a batch; give the batch size or less, or auto."
            )
        check_blocks(strategy_cfg.streaming, n)
        if strategy_cfg.gradient_checkpointing not in (True, False, "auto"):
            raise UserError(
                f"strategy.gradient_checkpointing={strategy_cfg.gradient_checkpointing!r}: give true, false or auto."
            )
        present = {sd: _store_present_bytes(cfg, sd) for sd in PRECISE_FIRST} if hw.disk_free_mb is not None else {}
        streams = strategy_cfg.lightning in STREAMING_LIGHTNING
        precisions = {
            name: _precision(strategy_cfg.precision, name, spec, hw, seq, batch_size, sparse_layers, streams)
            for name in CANDIDATES
        }
        streaming = strategy_cfg.streaming
        return cls(
            cfg,
            hw,
            spec,
            strategy_cfg.name,
            seq,
            batch_size,
            sparse_layers,
            None if fixed_mb in (None, "auto") else int(fixed_mb),
            strategy_cfg.gradient_checkpointing is True,  # auto: off unless task=tune found it faster
            fixed_streaming(streaming),
            streaming.prefetch if streaming is not None else True,
            present,
            precisions,
            streams,
            optimizer_states(cfg.optim),
            lora_dropped(spec, strategy_cfg.lora),
        )


def make_plan(cfg: ONNConfig, hw: Profile, spec: ModelSpec, use_tuned: bool = True) -> Plan:
    """The plan: chosen strategy with reasons, micro-batch, precision, and every candidate's memory."""
    check_settings(cfg, hw)
    if spec.kind == "network" and cfg.strategy.name == "sparse_lora":
        return make_network_streaming_plan(cfg, hw, spec)
    if spec.kind == "network":
        return make_network_plan(cfg, hw, spec)
    request = PlanRequest.read(cfg, hw, spec)
    if why := cannot_run(request.requested, hw):  # asked for by name: no plan of it, and no table row of zeros
        raise UserError(f"strategy={request.requested} cannot run on hardware {hw.name}: {why}; use strategy=lora.")
    estimates = {name: _best_estimate(request, name) for name in CANDIDATES}
    chosen, reasons = _choose(request, estimates)
    _refuse_unfit(request, chosen, estimates[chosen])
    plan = _record(request, chosen, estimates, reasons + _notes(request, chosen, estimates[chosen]))
    return _with_tuned(plan, cfg, hw, spec) if use_tuned else plan


def candidate_estimate(cfg: ONNConfig, hw: Profile, spec: ModelSpec, name: str) -> Estimate:
    """A language model's candidate `name` as make_plan sizes it on one device (scale.py reads sparse_lora's)."""
    return _best_estimate(PlanRequest.read(cfg, hw, spec), name)


def _best_estimate(r: PlanRequest, name: str) -> Estimate:
    """Largest micro-batch that fits (streaming then picks its own fastest settings). Streamed on a GPU, the
    fastest micro-batch that fits, and between two equally fast (GPU_TIE) the one holding less memory: a step
    bound by the host link is no faster for larger micro-batches, only larger."""
    sizes = [r.fixed_micro_batch] if r.fixed_micro_batch else micro_batch_sizes(r.batch_size)
    layers = r.sparse_layers if name == "sparse_lora" else list(range(r.spec.n_blocks))
    store = r.fixed.store_dtype
    streamed = name == "sparse_lora" and r.streams
    streamed_on_gpu = streamed and r.hw.accelerator == "cuda"
    fitting, last = [], None
    for mb in sizes:
        last = estimate(
            name,
            r.spec,
            r.hw,
            r.seq,
            mb,
            r.precisions[name],
            layers,
            r.batch_size,
            store,
            r.fixed,
            r.prefetch,
            r.checkpointing,
            present=r.present,
            where=str(_store_folder(r.cfg)),
            streamed=streamed,
            states=r.states,
            dropped=r.dropped,
        )
        if last.fits and not streamed_on_gpu:
            return last
        if last.fits:
            fitting.append(last)
    if fitting:
        fastest = min(e.streaming.predicted_step_s for e in fitting)
        near = [e for e in fitting if e.streaming.predicted_step_s <= fastest * (1 + GPU_TIE)]
        return min(near, key=lambda e: e.peak_mb)
    return last


def _choose(r: PlanRequest, estimates: dict[str, Estimate]) -> tuple[str, list[str]]:
    """The strategy and why: as asked; full for random init; for pretrained weights the first that fits."""
    if r.requested != "auto":
        reasons = [strategy_source(r.cfg, r.requested)]
        if r.requested not in estimates:  # ddp / fsdp / deepspeed: full training placed by Lightning
            reasons.append(f"sized as full training; Lightning strategy '{r.cfg.strategy.lightning}' places it")
        elif r.requested == "sparse_lora" and not r.streams:
            reasons.append(_resident_reason(r))
        return (r.requested if r.requested in estimates else "full"), reasons
    if not r.spec.pretrained:
        return "full", ["random init: train every weight (LoRA on random weights would adapt noise)"]
    if r.spec.kind == "lm" and not any(r.spec.lora_params_per_block):
        return "full", ["no linear layer inside the blocks for LoRA to adapt (a recurrent stack): train every weight"]
    # streamed, sparse_lora fits any budget above one block; resident (another Lightning strategy), the smallest
    fallback = "sparse_lora" if r.streams else min(AUTO_ORDER, key=lambda s: estimates[s].peak_mb)
    chosen = next((s for s in AUTO_ORDER if estimates[s].fits), fallback)
    reasons = []
    for s in AUTO_ORDER[: AUTO_ORDER.index(chosen) + 1] if estimates[chosen].fits else AUTO_ORDER:
        e = estimates[s]
        reasons.append(
            f"{s}: {'fits' if e.fits else 'does not fit'} ({e.peak_mb + e.context_mb:,.0f} MB"
            f"{'; ' + e.note if e.note else ''})"
        )
    if not r.streams:
        reasons.append(_resident_reason(r))
    return chosen, reasons


def _resident_reason(r: PlanRequest) -> str:
    return (
        f"sized resident: Lightning strategy '{r.cfg.strategy.lightning}' places the model whole (layer streaming, "
        "which fits a model far larger than the budget, is a Lightning strategy of its own: "
        "strategy.lightning=streaming)"
    )


def _refuse_unfit(r: PlanRequest, chosen: str, est: Estimate) -> None:
    """A streamed plan that cannot fit is one sentence: the disk that cannot hold its store, or the
    smallest budget that would work (`est` is then the setting that holds least: streaming.smallest)."""
    if est.streaming is None:
        return
    if est.streaming.refused:
        raise UserError(est.streaming.refused)
    if not est.fits:
        need = est.peak_mb + est.context_mb
        # rounded up: a budget of the figure named must fit
        smallest = math.ceil(need if r.cfg.hardware.budget_mb else need / HEADROOM)
        raise UserError(
            f"hardware {r.hw.name}: a budget of {budget_mb(r.hw):,.0f} MB cannot hold one streamed block plus "
            f"activations for {r.spec.name} at data.max_length={r.seq}; "
            f"the smallest budget that works is about {smallest:,} MB (or shorten data.max_length)."
        )


def _notes(r: PlanRequest, chosen: str, est: Estimate) -> list[str]:
    """What else the plan says: a prediction over the budget, bf16 on a CPU, busy cores, the streaming setting."""
    hw, notes = r.hw, []
    threads, share = threads_for(hw)
    precision = r.precisions.get(chosen, r.precisions["full"])
    if not est.fits:
        notes.append(
            f"WARNING: predicted {est.peak_mb + est.context_mb:,.0f} MB exceeds the {budget_mb(hw):,.0f} MB "
            "budget; expect out-of-memory"
        )
    if precision != choose_precision(hw) and r.cfg.strategy.precision in (None, "auto"):
        rows = est.micro_batch * r.seq
        notes.append(
            f"precision {precision}: this CPU's bf16 matmuls make the step faster "
            f"({matmul_rate(hw, 'bfloat16', rows, threads) / 1e9:,.0f} "
            f"GFLOP/s at {rows} rows, measured, against float32's "
            f"{matmul_rate(hw, 'float32', rows, threads) / 1e9:,.0f}): "
            "frozen weights in bf16, adapters in fp32"
        )
    if hw.accelerator == "cpu" and (hw.cpu_busy_cores or 0) >= 0.25:
        notes.append(
            f"cores busy: other processes use {hw.cpu_busy_cores:.1f} of {hw.cpu_cores} cores; torch runs "
            f"{threads} thread(s){'' if share >= 1 else f', each getting about {share:.0%} of a core'}, "
            "and the step time counts that"
        )
    elif hw.thread_limit and threads < (hw.cpu_cores or 1):
        notes.append(f"torch runs {threads} thread(s): OMP_NUM_THREADS={hw.thread_limit}")
    if est.streaming is not None:
        notes.append(streaming_reason(est.streaming))
    return notes


def _record(r: PlanRequest, chosen: str, estimates: dict[str, Estimate], reasons: list[str]) -> Plan:
    """The plan as plan.yaml holds it."""
    spec, hw, est = r.spec, r.hw, estimates[chosen]
    precision = r.precisions.get(chosen, r.precisions["full"])
    micro_batch = est.micro_batch  # need not divide batch_size: the last micro-batch is smaller
    if est.streaming is not None:
        step_s = est.streaming.predicted_step_s
    else:
        trainable = {"full": [0], "sparse_lora": r.sparse_layers}.get(chosen, list(range(spec.n_blocks)))
        step_s = compute_s(
            spec,
            hw,
            "lora" if chosen == "sparse_lora" else chosen if chosen in CANDIDATES else "full",
            r.seq,
            r.batch_size,
            micro_batch,
            trainable,
            dtype=compute_dtype_name(hw, precision),
        )
    return Plan(
        strategy=chosen,
        requested=r.requested,
        reasons=reasons,
        micro_batch=micro_batch,
        accumulate=-(-r.batch_size // micro_batch),
        precision=precision,
        weights_dtype=_weights_dtype(chosen, precision, hw),
        sequence_length=r.seq,
        predicted_peak_memory_mb=round(est.peak_mb, 1),
        predicted_step_s=round(step_s, 4),
        context_mb=round(est.context_mb, 1),
        budget_mb=round(budget_mb(hw), 1),
        sparse_layers=r.sparse_layers if chosen == "sparse_lora" else None,
        gradient_checkpointing=r.checkpointing,
        settings_source="plan",
        streaming=est.streaming,
        threads=threads_for(hw)[0] if hw.accelerator == "cpu" else None,
        hardware=hardware_summary(hw),
        model=model_summary(spec),
        candidates=candidate_table(estimates),
    )


def _precision(
    asked: str,
    name: str,
    spec: ModelSpec,
    hw: Profile,
    seq: int,
    batch_size: int,
    sparse_layers: list[int],
    streams: bool,
) -> str:
    """The precision a candidate runs in: as asked, or by the machine. A CPU whose profile measured
    bf16 matmuls streams in bf16-mixed when matmuls are most of the step and bf16 makes it at least
    1.5x faster: the
    store then holds bf16 (half the bytes of fp32) and the matmuls run on the CPU's bf16 units, the
    adapters in fp32. Resident strategies keep fp32, whose memory the planner's model was measured on."""
    if asked not in (None, "auto"):
        return asked
    measured = all("bfloat16" in table for table in (hw.matmul_gflops or {"": {}}).values())
    if hw.accelerator != "cpu" or name != "sparse_lora" or not streams or not measured:
        return choose_precision(hw)
    matmul32, other32 = compute_s(spec, hw, name, seq, batch_size, batch_size, sparse_layers, "float32", parts=True)
    matmul16, other16 = compute_s(spec, hw, name, seq, batch_size, batch_size, sparse_layers, "bfloat16", parts=True)
    # only where the matmuls are most of the step: a small model's step is framework time, which autocast adds to
    dominated = matmul32 >= 0.7 * (matmul32 + other32)
    return "bf16-mixed" if dominated and matmul16 + other16 < 0.67 * (matmul32 + other32) else "32-true"


def streaming_reason(s: StreamingPlan) -> str:
    """Why these streaming settings: their predicted step against the next fastest, and why a faster store,
    where there is one, was passed over (nf4 costs precision; a store within the tie is less precise). Once the
    model's own blocks are timed (calibrate.py), the others are put on the same basis (on_timed_basis): the timed
    step set beside the FLOP model's called a store twice as fast "within the tie"."""
    place = "in host memory" if s.store == "cpu" else f"on disk, {s.cache_blocks} block(s) cached in host memory"
    line = (
        f"streaming: {s.store_dtype} store {place}, chunk {s.chunk_size}, edges {s.edges}: predicted "
        f"{s.predicted_step_s:.2f} s/step (I/O {s.predicted_io_s:.2f} s for {_moved(s)}, "
        f"compute {s.predicted_compute_s:.2f} s in {s.compute_dtype}"
        + (f", decode {s.predicted_decode_s:.2f} s" if s.predicted_decode_s else "")
        + ")"
    )
    timed = s.modelled_compute_s is not None and s.predicted_compute_s != s.modelled_compute_s
    ratio = s.predicted_compute_s / s.modelled_compute_s if timed and s.modelled_compute_s else 1.0
    others = sorted(
        (
            {**a, "predicted_step_s": on_timed_basis(a, ratio)}
            for a in s.alternatives
            if (a["store_dtype"], a["store"]) != (s.store_dtype, s.store)
        ),
        key=lambda a: a["predicted_step_s"],
    )
    faster = [a for a in others if a["predicted_step_s"] < s.predicted_step_s]
    if not faster:
        line += ", the fastest that fits"
        if others:
            a = others[0]
            line += f"; next: the {a['store_dtype']} store {_place(a['store'])} at {a['predicted_step_s']:.2f} s/step"
        return line
    a = faster[0]
    if a["store_dtype"] == "nf4":
        return line + (
            f"; the nf4 store {_place(a['store'])} would take {a['predicted_step_s']:.2f} s/step, but nf4 "
            "costs precision and is chosen only when nothing else fits (strategy.streaming.store_dtype=nf4 asks for it)"
        )
    if timed and a["predicted_step_s"] * (1 + CPU_TIE) < s.predicted_step_s:
        return line + (
            f"; the {a['store_dtype']} store {_place(a['store'])} would take {a['predicted_step_s']:.2f} s/step at the "
            "rate the blocks were timed at: the settings were chosen on the FLOP model's step times, before the "
            f"timing (strategy.streaming.store_dtype={a['store_dtype']} strategy.streaming.store={a['store']} asks "
            "for that store)"
        )
    return line + (
        f"; the {a['store_dtype']} store {_place(a['store'])} would take {a['predicted_step_s']:.2f} s/step, within "
        "the tie of the fastest, where the more precise store, then the one holding least memory, is chosen"
    )


def on_timed_basis(alternative: dict[str, Any], ratio: float) -> float:
    """An alternative's predicted step with its compute scaled by `ratio` (the timed blocks' compute over the FLOP
    model's) and its reads and decoding as predicted, as calibrate.py puts the chosen setting's step."""
    if ratio == 1.0 or alternative.get("predicted_compute_s") is None:
        return alternative["predicted_step_s"]
    a = alternative
    return max(a["predicted_io_s"], a["predicted_compute_s"] * ratio + a["predicted_decode_s"])


def _moved(s: StreamingPlan) -> str:
    """What a streamed step moves: GB read from the disk, and on a GPU GB copied over the host link."""
    read, copied = f"{s.predicted_disk_read_gb:,.1f} GB read", s.predicted_h2d_gb
    if not copied:
        return read
    copy = f"{copied:,.1f} GB copied to the GPU"
    return f"{read} and {copy}" if s.predicted_disk_read_gb else copy


def _place(store: str) -> str:
    return "in host memory" if store == "cpu" else "on disk"


def _store_folder(cfg: ONNConfig) -> Path:
    from onn.models.load import model_fingerprint

    return Path(cfg.paths.cache) / "stores" / model_fingerprint(cfg.model)


def hardware_summary(hw: Profile) -> dict[str, Any]:
    """The machine as a plan records it."""
    keys = ("name", "accelerator", "device_name", "device_memory_mb", "host_memory_mb", "cpu_cores", "cpu_busy_cores",
            "matmul_tflops", "disk_read_mb_s", "disk_free_mb", "memory_gb_s", "h2d_mb_s", "source")  # fmt: skip
    return {k: getattr(hw, k) for k in keys}


def _with_tuned(plan: Plan, cfg: ONNConfig, hw: Profile, spec: ModelSpec) -> Plan:
    """The plan again with the `auto` settings that task=tune measured on this machine, when it has."""
    tuned = lookup(cfg, hw, plan.strategy, plan.sequence_length)
    if tuned is None:
        return plan
    config = copy.deepcopy(cfg)
    strategy = config.strategy
    taken = {}
    for key, value in tuned["settings"].items():
        if key in STREAMING_KEYS and strategy.streaming is None:
            strategy.streaming = StreamingConfig()  # a strategy that names no streaming streams with every `auto`
        holder = strategy.streaming if key in STREAMING_KEYS else strategy
        if hasattr(holder, key) and getattr(holder, key) in (None, "auto"):  # what the config fixes stays
            setattr(holder, key, value)
            taken[key] = value
    if not taken:
        return plan
    try:
        tuned_plan = make_plan(config, hw, spec, use_tuned=False)
    except UserError as e:  # a value an older version wrote (a store dtype since renamed): the file's, not the user's
        plan.reasons.append(
            f"task=tune's settings {taken} ({tuned['path']}) are refused ({e}): using the planner's own"
        )
        return plan
    if tuned_plan.strategy != plan.strategy or not tuned_plan.candidates[plan.strategy]["fits"]:
        plan.reasons.append(f"task=tune's settings {taken} ({tuned['path']}) no longer fit: using the planner's own")
        return plan
    tuned_plan.requested = plan.requested
    tuned_plan.settings_source = "tune"
    keys = ("path", "tuned_at", "samples_per_s", "plan_samples_per_s", "speedup_over_plan", "measured_where")
    tuned_plan.tuned = {k: tuned.get(k) for k in keys}
    tuned_plan.reasons = [
        f"settings {taken} from task=tune ({tuned['path']}, {tuned.get('tuned_at')}): "
        f"measured {tuned.get('samples_per_s')} samples/s on {tuned.get('measured_where')} against "
        + (
            f"{tuned['plan_samples_per_s']} for the planner's guess"
            if tuned.get("plan_samples_per_s") is not None
            else "the planner's guess, which did not fit"
        ),
        *tuned_plan.reasons,  # the reasons of the settings used: the planner's own guess's said another chunk size
    ]
    return tuned_plan


def attach_scale(plan: Plan, scale: dict[str, Any] | None) -> None:
    """plan.scale set to the multi-device table (scale.scale_plan), and a WARNING among the reasons where several
    processes run and the table finds no setup that fits each one's share: the table was only printed, and plan.yaml
    said the single-device plan, sized with the whole budget, fits."""
    plan.scale = scale
    if scale is None or scale["devices"] < 2 or scale["chosen"] is not None:
        return
    # a node's processes share a host device's memory; a GPU is each process's own
    sharing = 1 if plan.hardware["accelerator"] == "cuda" else scale["devices_per_node"]
    need = min(o["per_device_mb"] for o in scale["options"].values())
    plan.reasons.append(
        f"WARNING: trainer.devices={scale['devices_per_node']} on {scale['nodes']} node(s) gives each process "
        f"{plan.budget_mb / sharing:,.0f} MB of the {plan.budget_mb:,.0f} MB budget and "
        f"{scale['per_device_batch']} of the {scale['global_batch']} samples per batch, and no multi-device setup fits "
        f"that share (the smallest needs {need:,.0f} MB per process): expect out-of-memory; lower data.batch_size, "
        "use fewer devices or raise hardware.budget_mb"
    )


def _weights_dtype(strategy: str, precision: str, hw: Profile) -> str:
    """The dtype the run loads the weights in: a "-true" precision's, which Lightning converts the whole module to
    (full training too), but 64-true's float32, which Lightning casts up (torch_dtype loads no float64); under a mixed
    precision float32 for full training's master weights, else the frozen weights' half precision."""
    if precision in ("32-true", "64-true") or (strategy == "full" and precision.endswith("mixed")):
        return "float32"
    return "bfloat16" if precision.startswith("bf16") else "float16"


def render(plan: Plan) -> str:
    """The plan as a table for the terminal."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"ONN plan: {plan.model['name']} on {plan.hardware['name']} ({plan.hardware['device_name']})")
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
    for name, c in plan.candidates.items():
        mark = "*" if name == plan.strategy else ""
        table.add_row(
            f"{mark}{name}",
            "yes" if c["fits"] else "no",
            str(c["micro_batch"]),
            *(
                f"{c[k]:,.0f}"
                for k in ("weights_mb", "trainable_mb", "optimizer_mb", "activations_mb", "workspace_mb", "peak_mb")
            ),
        )
    console = Console(width=120, record=True, force_terminal=False)
    with console.capture() as capture:
        console.print(table)
    lines = [capture.get().rstrip()]
    lines.append(
        f"strategy: {plan.strategy}  micro-batch: {plan.micro_batch} x {plan.accumulate} accumulated  precision: "
        f"{plan.precision}"
    )
    peak, ctx = plan.predicted_peak_memory_mb, plan.context_mb
    ctx_name = "CUDA context" if plan.hardware["accelerator"] == "cuda" else "process baseline"
    lines.append(
        f"predicted peak memory: {peak:,.0f} MB allocated (+{ctx:,.0f} MB {ctx_name} = {peak + ctx:,.0f} MB); "
        f"budget {plan.budget_mb:,.0f} MB"
    )
    where = (
        f"at data.max_length={plan.sequence_length}" if plan.sequence_length else f"for a batch of {plan.micro_batch}"
    )
    lines.append(f"predicted step time: {plan.predicted_step_s:.3f} s {where} (a prediction; the run measures it)")
    if plan.streaming:
        s = plan.streaming
        # each figure by what it measures: the GB after "cached in RAM" read as RAM, though it was the disk store's
        place = f"in host memory ({s.store_gb:,.1f} GB)"
        if s.store == "disk":
            cached = f" ({s.cache_blocks * s.block_mb / 1024:,.1f} GB)" if s.cache_blocks else ""
            place = f"on disk ({s.store_gb:,.1f} GB), {s.cache_blocks} of {plan.model['blocks']} blocks cached in RAM"
            place += cached
        lines.append(
            f"streaming: chunk_size {s.chunk_size}, store {s.store_dtype} {place}, "
            f"edges {s.edges}, compute in {s.compute_dtype}; per step {_moved(s)} "
            f"({s.predicted_io_s}s I/O) vs {s.predicted_compute_s}s compute (predictions)"
        )
    if plan.threads:
        lines.append(f"threads: {plan.threads} of {plan.hardware['cpu_cores']} cores")
    lines += [f"  - {r}" for r in plan.reasons]
    lines.append(f"layer map: {plan.model['layer_map']}")
    if plan.scale:  # onn/planning/scale.py
        lines.append(render_scale(plan.scale))
    return "\n".join(lines)


def render_scale(scale: dict[str, Any]) -> str:
    """The multi-device setups side by side (predictions), the chosen one marked."""
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"{scale['fine_tune']} over {scale['devices_per_node']} device(s) x {scale['nodes']} node(s): "
        f"global batch {scale['global_batch']} ({scale['per_device_batch']} per device)"
    )
    for col in (
        "setup",
        "fits",
        "micro-batch",
        "MB per device",
        "host MB per node",
        "compute s",
        "all-reduce s",
        "offload s",
        "step s",
    ):
        table.add_column(col, justify="left" if col in ("setup", "fits") else "right", no_wrap=col == "setup")
    for name, o in scale["options"].items():
        fits = "refused" if o["refused"] else ("yes" if o["fits"] else "no")
        table.add_row(
            f"{'*' if name == scale['chosen'] else ''}{o['label']}",
            fits,
            str(o["micro_batch"]),
            f"{o['per_device_mb']:,.0f}",
            f"{o['host_per_node_mb']:,.0f}",
            f"{o['compute_s']:.3g}",
            f"{o['collective_s']:.3g}",
            f"{o['offload_s']:.3g}",
            f"{o['predicted_step_s']:.3g}",
        )
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
