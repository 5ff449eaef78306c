"""The plan for several devices and nodes: a fine-tune under DDP, DeepSpeed ZeRO-2, FSDP and DeepSpeed ZeRO-3
with CPU offload, over the devices each of trainer.num_nodes nodes runs (trainer.devices, or hardware.count for a node
this run does not start: `devices_per_node`). The fine-tune is the one asked for: LoRA, QLoRA or sparse LoRA (which
trains resident under these strategies) when strategy names one, else full.

Per device, with W the weights' bytes (frozen ones as the single-device plan holds them, trainable ones fp32), T
the trainable weights, and the states of Adam (the ZeRO paper's accounting, with Lightning's mixed precision
keeping fp32 weights and gradients, and DeepSpeed keeping half-precision ones beside its fp32 master copy):

    DDP              every device holds everything        W + 12T (+2T of a full fine-tune's autocast copies)
    ZeRO-2           weights whole, the rest sharded       frozen W + 2T + 14T/N   (fp32: frozen W + 4T + 12T/N)
    FSDP (= ZeRO-3)  everything sharded                    (W + 12T)/N + two blocks gathered at a time
    ZeRO-3+offload   weights and optimizer in host memory  two blocks gathered at a time; host W + 12T per node's share

(a full fine-tune: T = P weights, W = 4P: 16P, 2P + 14P/N, 16P/N), plus the activations of one micro-batch,
as the single-device plan counts them (on a CPU with the heap's share, CPU_HEAP_OVERHEAD). CPU processes are not
devices of their own: the n processes of a node share its memory and cores, so each gets 1/n of the budget and
computes at 1/n of the profile's rate. The step's predicted time is the per-device compute
(each device takes global batch / N samples) plus the trainable weights' gradients' collectives, not
overlapped: a ring all-reduce moves 2 (n-1)/n of the gradient bytes over each link; inside a node at
hardware.interconnect_gb_s, between nodes at hardware.network_gb_s (hierarchical: devices reduce inside their
node first). ZeRO-2 moves the same bytes
(reduce-scatter + all-gather); FSDP and ZeRO-3 gather the weights again for the backward (1.5x). Offload adds
the trainable weights' and gradients' trips over PCIe (h2d_mb_s) and the optimizer step on the CPU.

The recommendation: the fastest setup that fits; on a tie the first of DDP, ZeRO-2, FSDP, ZeRO-3+offload
(less to configure and to go wrong). Every figure is a prediction.
"""

from __future__ import annotations

from typing import Any

from onn.config import HardwareConfig, ONNConfig
from onn.config.run import named_devices
from onn.errors import UserError
from onn.hardware.profile import Profile
from onn.models.layers import resolve_indices
from onn.planning.costs import (
    CPU_HEAP_OVERHEAD,
    HEADROOM,
    MB,
    budget_mb,
    choose_precision,
    compute_dtype_name,
    compute_s,
)
from onn.planning.plan import (
    STREAMING_LIGHTNING,
    candidate_estimate,
    estimate,
    frozen_weight_bytes,
    micro_batch_sizes,
    weights_and_states,
)
from onn.planning.spec import ModelSpec

SETUPS = ("ddp", "deepspeed_zero2", "fsdp", "deepspeed_zero3_offload")  # also the tie-break order
LABELS = {
    "ddp": "DDP",
    "deepspeed_zero2": "ZeRO-2",
    "fsdp": "FSDP",
    "deepspeed_zero3_offload": "ZeRO-3+offload",
}
# DeepSpeed's CPU Adam updates about a billion weights a second per process on a server CPU (its
# ZeRO-Offload paper's order of magnitude); an assumption, said so in the plan.
CPU_ADAM_WEIGHTS_S = 1.0e9
GATHERED_BLOCKS = 2  # FSDP and ZeRO-3 gather the next block while this one computes
# the adapter fine-tunes the table sizes as strategy names them; any other strategy (full, auto, ddp, fsdp,
# deepspeed_*) is sized as a full fine-tune, what several devices are for
FINE_TUNES = {"full": "full fine-tune", "lora": "LoRA fine-tune", "qlora": "QLoRA fine-tune",
              "sparse_lora": "sparse-LoRA fine-tune"}  # fmt: skip


def scale_plan(cfg: ONNConfig, hw: Profile, spec: ModelSpec) -> dict[str, Any] | None:
    """Per-device memory and step time of each multi-device setup, and the one to use. None for a run on
    one device with a single-device strategy (task=plan always shows it, for one device too)."""
    count = devices_per_node(cfg)
    nodes = int(cfg.trainer.num_nodes)
    devices = count * nodes
    lightning = str(cfg.strategy.lightning)
    asked = devices > 1 or lightning.startswith(("ddp", "fsdp", "deepspeed")) or cfg.task.name == "plan"
    if spec.kind != "lm" or not asked:
        return None
    batch = int(cfg.data.batch_size)
    if batch % devices:  # as the run refuses it (each process takes an equal slice of every global batch)
        raise UserError(
            f"data.batch_size={batch} does not split evenly over {devices} processes: give a multiple of {devices}."
        )
    per_device = batch // devices
    # the precision the run trains in (strategy.precision): the machine's default alone sized a 32-true run on a GPU
    # as mixed, its gradients and all-reduce at half the bytes it moves
    given = cfg.strategy.precision
    precision = given if given not in (None, "auto") else choose_precision(hw)
    method = cfg.strategy.name if cfg.strategy.name in FINE_TUNES else "full"
    adapted = (
        resolve_indices(cfg.strategy.layers, spec.n_blocks) if method == "sparse_lora" else list(range(spec.n_blocks))
    )
    setup = _Setup(spec, hw, int(cfg.data.max_length), per_device, precision, devices, nodes, method, adapted)
    comm = collective_s(setup.grad_bytes, count, nodes, cfg.hardware)
    options = {name: setup.option(name, comm["all_reduce_s"]) for name in SETUPS}
    fitting = [n for n in SETUPS if options[n]["fits"]]
    chosen = min(fitting, key=lambda n: (options[n]["predicted_step_s"], SETUPS.index(n))) if fitting else None
    return {
        "devices": devices,
        "devices_per_node": count,
        "nodes": nodes,
        "method": method,
        "fine_tune": FINE_TUNES[method],
        "trainable_params": int(setup.trained),
        "global_batch": per_device * devices,
        "per_device_batch": per_device,
        "precision": precision,
        "links": comm,
        "options": options,
        "chosen": chosen,
        "reason": streamed_alone(cfg, hw, spec, options, chosen, devices)
        or reason(spec, hw, options, chosen, count, nodes, method),
    }


def devices_per_node(cfg: ONNConfig) -> int:
    """The processes per node the table sizes: those trainer.devices starts when it names them, else hardware.count
    (a node this run does not start: task=plan). The plan sized one number while Lightning started another, so
    a hardware.count that disagrees with trainer.devices, or that a run's trainer.devices=auto would not start,
    is refused."""
    count = cfg.hardware.count
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise UserError(f"hardware.count={count!r}: give a whole number of devices per node, 1 or more.")
    devices = cfg.trainer.devices
    given = named_devices(devices)
    if given is not None and count not in (1, given):
        raise UserError(
            f"hardware.count={count} and trainer.devices={devices} disagree on the processes per node: "
            f"trainer.devices is what runs and what the plan sizes; give hardware.count={given}, or leave it at 1."
        )
    if given is None and count > 1 and cfg.task.name != "plan":
        raise UserError(
            f"hardware.count={count} sizes the plan for {count} processes per node, which trainer.devices={devices} "
            f"does not start: give trainer.devices={count} as well, or task=plan to plan without running."
        )
    return given or count


def streamed_alone(
    cfg: ONNConfig, hw: Profile, spec: ModelSpec, options: dict[str, Any], chosen: str | None, devices: int
) -> str | None:
    """On one device no setup above fits a sparse-LoRA fine-tune held resident, but the single-device plan streams
    its blocks and may fit: the table's "no setup fits: add devices" then contradicted the plan it follows."""
    if chosen is not None or devices > 1 or cfg.strategy.name != "sparse_lora":
        return None
    if str(cfg.strategy.lightning) not in STREAMING_LIGHTNING:
        return None  # under ddp/fsdp sparse LoRA trains resident: the table is that run
    if not candidate_estimate(cfg, hw, spec, "sparse_lora").fits:
        return None
    size = model_size(spec)
    need = min(o["per_device_mb"] for o in options.values())
    return (
        f"{size} sparse-LoRA fine-tune: streamed, it fits 1 x {hw.device_name or hw.name or 'device'} (the plan "
        f"above); held resident under DDP, ZeRO or FSDP it would need at least {need:,.0f} MB per device."
    )


class _Setup:
    """A fine-tune (`method`, adapters on the `adapted` blocks) over `devices` devices: what each setup holds
    per device and per node's host, and its step."""

    def __init__(
        self,
        spec: ModelSpec,
        hw: Profile,
        seq: int,
        per_device: int,
        precision: str,
        devices: int,
        nodes: int,
        method: str,
        adapted: list[int],
    ):
        self.spec, self.hw, self.seq, self.per_device, self.precision = spec, hw, seq, per_device, precision
        self.devices, self.method, self.adapted = devices, method, adapted
        # a node's processes on a host device share its memory and cores; GPUs are one device each
        self.sharing = 1 if hw.accelerator == "cuda" else devices // nodes
        mixed = precision.endswith("mixed")
        # the weights as one device holds them (frozen ones in the plan's dtype, trainable ones fp32), the
        # trainable ones' gradients and Adam moments, and mixed precision's half copy of what trains
        weights, grads, moments, extra = weights_and_states(
            method, spec, mixed, frozen_weight_bytes(hw, precision), adapted
        )
        self.trained = grads / 4
        self.grad_bytes = self.trained * gradient_bytes(precision)  # what the all-reduce moves
        frozen, states = weights - grads, grads + moments
        gathered = (
            GATHERED_BLOCKS
            * max(spec.block_params + [spec.prefix_params, spec.suffix_params])
            * gradient_bytes(precision)
        )
        t = self.trained
        self.state = {
            "ddp": weights + states + extra,
            "deepspeed_zero2": frozen + ((2 * t + 14 * t / devices) if mixed else (4 * t + 12 * t / devices)),
            "fsdp": (weights + states) / devices + gathered,
            "deepspeed_zero3_offload": gathered,
        }
        self.host_per_node = {name: 0.0 for name in SETUPS}
        self.host_per_node["deepspeed_zero3_offload"] = (weights + states) / nodes
        # offloaded, the weights cross PCIe for the forward and again for the backward, the gradients once
        self.offload_bytes = 2 * (frozen + t * (2 if mixed else 4)) + self.grad_bytes

    def option(self, name: str, all_reduce_s: float) -> dict[str, Any]:
        """The largest micro-batch whose state and activations fit a device, and the step's parts."""
        spec, hw = self.spec, self.hw
        refused = hw.accelerator != "cuda" and name != "ddp"
        budget = budget_mb(hw) / self.sharing
        heap = CPU_HEAP_OVERHEAD if hw.accelerator == "cpu" else 0.0  # as the single-device plan's workspace
        for mb in micro_batch_sizes(self.per_device):
            act = estimate(
                self.method, spec, hw, self.seq, mb, self.precision, self.adapted, self.per_device, streamed=False
            )
            # + 5% workspace and a CPU's heap, as the single-device plan
            device_mb = (self.state[name] / MB + act.activations_mb) * 1.05 + heap * act.activations_mb
            if device_mb + act.context_mb <= budget:
                break
        ctx = act.context_mb
        host_budget = float(hw.host_memory_mb or 0) * HEADROOM
        fits = (not refused) and device_mb + ctx <= budget and self.host_per_node[name] / MB <= host_budget
        resident = "full" if self.method == "full" else "lora"  # sparse LoRA trains resident here: LoRA's step
        dtype = compute_dtype_name(hw, self.precision)
        step = self.sharing * compute_s(spec, hw, resident, self.seq, self.per_device, mb, self.adapted, dtype=dtype)
        collective = all_reduce_s * (1.5 if name in ("fsdp", "deepspeed_zero3_offload") else 1.0)
        offload = 0.0
        if name == "deepspeed_zero3_offload":
            pcie = float(hw.h2d_mb_s or 0) * MB
            offload = self.offload_bytes / self.devices / pcie if pcie else 0.0
            offload += self.trained / self.devices / CPU_ADAM_WEIGHTS_S
        return {
            "label": LABELS[name],
            "fits": fits,
            "refused": "Lightning runs FSDP and DeepSpeed on CUDA GPUs only" if refused else None,
            "micro_batch": mb,
            "per_device_mb": round(device_mb + ctx, 1),
            "host_per_node_mb": round(self.host_per_node[name] / MB, 1),
            "compute_s": round(step, 6),
            "collective_s": round(collective, 6),
            "offload_s": round(offload, 6),
            "predicted_step_s": round(step + collective + offload, 6),
        }


def gradient_bytes(precision: str) -> int:
    """Bytes a trained weight's gradient takes in the all-reduce: 2 under mixed precision (as planned so far) and
    in 16/bf16-true, 4 in 32-true, 8 in 64-true."""
    return {"64": 8, "32": 4}.get(precision.split("-")[0], 2)


def collective_s(grad_bytes: float, count: int, nodes: int, hw_cfg: HardwareConfig) -> dict[str, Any]:
    """A ring all-reduce of `grad_bytes`: inside each node, then between nodes (hierarchical)."""
    inside, between = hw_cfg.interconnect_gb_s, hw_cfg.network_gb_s
    seconds, missing = 0.0, []
    if count > 1:
        if inside:
            seconds += 2 * (count - 1) / count * grad_bytes / (float(inside) * 1e9)
        else:
            missing.append("hardware.interconnect_gb_s")
    if nodes > 1:
        if between:
            seconds += 2 * (nodes - 1) / nodes * grad_bytes / (float(between) * 1e9)
        else:
            missing.append("hardware.network_gb_s")
    return {"interconnect_gb_s": inside, "network_gb_s": between, "all_reduce_s": round(seconds, 6), "missing": missing}


def model_size(spec: ModelSpec) -> str:
    """The model's size as the recommendation says it: 14.7B, 135.0M."""
    return f"{spec.params / 1e9:.1f}B" if spec.params >= 1e8 else f"{spec.params / 1e6:.1f}M"


def reason(
    spec: ModelSpec, hw: Profile, options: dict[str, Any], chosen: str | None, count: int, nodes: int, method: str
) -> str:
    """The recommendation in one sentence, e.g. "14.7B full fine-tune: FSDP over 8 x A100-80GB, 1 node"."""
    size = model_size(spec)
    device = hw.device_name or hw.name or "device"
    where = f"{count} x {device}, {nodes} node{'s' if nodes > 1 else ''}"
    if chosen is None:
        need = min(o["per_device_mb"] for o in options.values())
        refused = next((o["refused"] for o in options.values() if o["refused"]), None)
        return (
            f"{size} {FINE_TUNES[method]}: no setup fits {where} (the smallest needs {need:,.0f} MB per device"
            f"{'; ' + refused if refused else ''}): add devices or nodes"
            + (", or use LoRA." if method == "full" else ".")
        )
    c = options[chosen]
    total = budget_mb(hw) / 1024
    of = (
        f"of {total:,.0f} GB"
        if hw.accelerator == "cuda" or count == 1
        else f"of {total / count:,.0f} GB, the host's {total:,.0f} GB over {count} processes"
    )
    rejected = [
        f"{o['label']} {'is refused' if o['refused'] else 'needs'}"
        + ("" if o["refused"] else f" {o['per_device_mb'] / 1024:,.0f} GB")
        for n, o in options.items()
        if not o["fits"] and SETUPS.index(n) < SETUPS.index(chosen)
    ]
    why = f"; {', '.join(rejected)} per device" if rejected else ""
    return (
        f"{size} {FINE_TUNES[method]}: {c['label']} over {where} ({c['per_device_mb'] / 1024:,.1f} GB per device "
        f"{of}, predicted {c['predicted_step_s']:.3g} s per step{why})."
    )
