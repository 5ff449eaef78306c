"""Where task=tune's results live, and how the planner reads them: a JSON file per setting, nothing more.

The tuner (onn/bench/tune.py) writes `cache_path(...)`; the planner only reads it, so planning never
imports the benchmark that produced it. The key holds what changes the speed of a setting: the
machine, the frozen weights, the strategy and its precision, layers, LoRA, quantisation, what trains and
Lightning strategy, the sequence length and the batch size, and the streaming settings the tuner does not vary
(the store's place, edges, activations, cached blocks, MLP slices, prefetch): a result measured with the store in
host memory says nothing of one on disk.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from onn.config import ONNConfig, as_dict
from onn.hardware.profile import Profile
from onn.models.load import model_fingerprint


def cache_path(config: ONNConfig, hw: Profile, strategy: str, seq: int) -> Path:
    machine = hw.fingerprint or f"preset:{hw.name}"
    chosen = config.strategy
    key = {
        "hardware": machine,
        "model": model_fingerprint(config.model),
        "strategy": strategy,
        "sequence_length": seq,
        "batch_size": int(config.data.batch_size),
        "precision": chosen.precision,
        "layers": chosen.layers,
        "lora": as_dict(chosen.lora),
        "lightning": chosen.lightning,
        "quantize": chosen.quantize,
        "trainable": chosen.trainable,
        "streaming": _fixed_streaming(chosen.streaming),
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(config.paths.cache) / "tune" / f"{digest}.json"


# what task=tune varies (its result's settings), and what a training step does not read
NOT_KEYED = ("chunk_size", "store_dtype", "eval_tokens")


def _fixed_streaming(streaming) -> dict[str, Any] | None:
    return None if streaming is None else {k: v for k, v in as_dict(streaming).items() if k not in NOT_KEYED}


def lookup(config: ONNConfig, hw: Profile, strategy: str, seq: int) -> dict[str, Any] | None:
    """The cached tuning result for this machine, model, strategy and sequence length, if any."""
    path = cache_path(config, hw, strategy, seq)
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return {**result, "path": str(path)}
