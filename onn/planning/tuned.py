"""Where task=tune's results live, and how the planner reads them: a JSON file per setting, nothing more.

The tuner (onn/bench/tune.py) writes `cache_path(...)`; the planner only reads it, so planning never
imports the benchmark that produced it. The key holds what changes the speed of a setting: the
machine, the frozen weights, the strategy and its precision, layers, LoRA and Lightning strategy, the sequence
length and the batch size, and the streaming settings the tuner does not vary (the store's place, edges,
activations, cached blocks, MLP slices, prefetch): a result measured with the store in host memory says nothing of
one on disk.

The machine is the one the trials ran on: a measured profile's fingerprint, or, for a preset (a machine described,
not measured: its figures are the same on every machine), this machine's fingerprint beside the preset's figures.
A result tuned with hardware=gtx1650_4gb on one machine is that machine's speed under the preset's memory, so
another machine sharing paths.cache with the same preset does not take it, and its speeds are said to be this
machine's, not the preset's (`measured_where`).

The key is the planned strategy's, not the configured block's: strategy=auto planned as a full fine-tune runs what
strategy=full runs, though its block names LoRA settings (which a full fine-tune never reads), so both take one
result. Only what the planned strategy reads is keyed: LoRA for the adapter strategies, layers and streaming for
sparse_lora (a strategy naming no streaming streams with every setting `auto`). What trains and the quantisation
follow from the planned strategy itself (full trains every weight; qlora loads the base in NF4).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from onn.config import ONNConfig, StreamingConfig, as_dict
from onn.config.run import named_devices
from onn.config.strategy import SPARSE_LAYERS
from onn.hardware.profile import PROFILE_KEYS, Profile, machine_fingerprint
from onn.models.load import model_fingerprint

ADAPTERS = ("lora", "qlora", "sparse_lora")  # the planned strategies that train LoRA adapters
log = logging.getLogger("onn")
STREAMS = ("auto", "streaming")  # strategy.lightning values under which sparse_lora streams (as the plan reads them)


def cache_path(config: ONNConfig, hw: Profile, strategy: str, seq: int) -> Path:
    """The result file of the planned `strategy` at sequence length `seq` for this config and machine."""
    chosen = config.strategy
    sparse = strategy == "sparse_lora"
    streams = sparse and chosen.lightning in STREAMS
    key = {
        "hardware": _machine_key(hw),
        "model": model_fingerprint(config.model),
        "strategy": strategy,
        "sequence_length": seq,
        "batch_size": int(config.data.batch_size),
        "precision": chosen.precision,  # the plan resolves `auto` from these same inputs
        "layers": (chosen.layers if chosen.name == "sparse_lora" else list(SPARSE_LAYERS)) if sparse else None,
        "lora": as_dict(chosen.lora) if strategy in ADAPTERS else None,
        "lightning": "streaming" if streams else chosen.lightning,
        "streaming": _fixed_streaming(chosen.streaming or StreamingConfig()) if streams else None,
        "micro_batch": chosen.micro_batch,  # a fixed one is the plan's, whatever was tuned
        "optimizer": _optimizer_work(config),
        "processes": [_per_node(config), config.trainer.num_nodes],
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(config.paths.cache) / "tune" / f"{digest}.json"


def _per_node(config: ONNConfig) -> int | str:
    """The processes a node runs, as trainer.devices names them: auto, 1 and [0] are one process (outside a
    multi-device Lightning strategy, where auto is every GPU, as -1 is), so task=tune's auto serves devices=1."""
    devices = config.trainer.devices
    lightning = str(config.strategy.lightning)
    if devices in (None, "auto"):
        return "every" if lightning.startswith(("ddp", "fsdp", "deepspeed")) else 1
    return named_devices(devices) or "every"


def _optimizer_work(config: ONNConfig) -> dict[str, Any]:
    """What of optim shapes a step's time and memory (its state, its operations), not its learning rate: a result
    tuned under AdamW was reused, its samples/s quoted, for SGD without state."""
    optim = config.optim
    sgd = optim.name == "sgd"
    return {
        "name": optim.name,
        "momentum": bool(optim.momentum) if sgd else None,
        "nesterov": bool(optim.nesterov) if sgd else None,
        "decays": bool(optim.weight_decay),
        "clips": bool(optim.clip_grad_norm),
    }


def measured_on(hw: Profile) -> str:
    """The fingerprint of the machine a tuning result is measured on: a measured profile's own, else (a preset) this
    machine's, where task=tune's trials run whatever machine the preset describes."""
    return hw.fingerprint or machine_fingerprint()


def _machine_key(hw: Profile) -> str | dict[str, Any]:
    """A measured machine keys by its fingerprint alone (as results were always keyed); a preset by the machine the
    trials ran on and the preset's figures, which sized them (its name alone was the same on every machine)."""
    if hw.fingerprint:
        return hw.fingerprint
    return {"measured_on": measured_on(hw), "preset": {k: getattr(hw, k) for k in PROFILE_KEYS}}


def measured_where(hw: Profile) -> str:
    """Where a tuning result's speeds were measured, in words: a preset's plan must not present this machine's
    figures as its own."""
    if hw.fingerprint:
        return "this machine"
    return f"this machine ({measured_on(hw)}, not a {hw.name}: the preset only sized its trials)"


# what task=tune varies (its result's settings), and what a training step does not read
NOT_KEYED = ("chunk_size", "store_dtype", "eval_tokens")


def _fixed_streaming(streaming) -> dict[str, Any] | None:
    return None if streaming is None else {k: v for k, v in as_dict(streaming).items() if k not in NOT_KEYED}


def lookup(config: ONNConfig, hw: Profile, strategy: str, seq: int) -> dict[str, Any] | None:
    """The cached tuning result for this machine, model, strategy and sequence length, if any, with `measured_where`:
    where its speeds were measured, in words."""
    if not (Path(config.paths.cache) / "tune").is_dir():  # nothing tuned: no need to identify this machine
        return None
    path = cache_path(config, hw, strategy, seq)
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(result, dict) or not isinstance(result.get("settings"), dict):  # not a file task=tune wrote
        log.warning("%s holds no task=tune result (no settings): ignored; run task=tune again to replace it", path)
        return None
    return {**result, "path": str(path), "measured_where": measured_where(hw)}
