"""What a .omny records about the PyTorch model it was traced from: its block runs (where the cut points go),
the KV-cache bytes per token of each decoder block, and its source (name, class, parameters)."""

from __future__ import annotations

import itertools
from typing import Any

from onn.errors import UserError


def omny_runs(model, blocks_path: str | None = None) -> list[list[str]] | None:
    """The LayerMap's blocks (and any other tower's), where the .omny cut points go; None when the
    model has no repeated blocks: then every cut the graph allows is kept. `blocks_path`: the model
    config's layer_map.blocks, so the cuts fall between the blocks that were trained and streamed."""
    from onn.models.layers import block_runs

    try:
        return block_runs(model, blocks_path)
    except UserError:
        if blocks_path is not None:
            raise  # a layer_map.blocks that names no blocks: its own sentence, not a graph cut anywhere
        return None


def kv_cache_bytes(model, blocks_path: str | None = None) -> dict[str, int]:
    """KV-cache bytes per token of each decoder block (the model config's layer_map.blocks where set): keys and
    values of every KV head."""
    config = getattr(model, "config", None)
    archs = getattr(config, "architectures", None) or [type(model).__name__]
    if config is None or not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        return {}
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    if not heads or not hidden:
        return {}
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    itemsize = next(model.parameters()).element_size()
    runs = omny_runs(model, blocks_path) or []
    return {path: 2 * kv_heads * head_dim * itemsize for path in (runs[0] if runs else [])}


def model_source(model, model_name: str | None) -> dict[str, Any]:
    """The .omny's `source`: the model's name, class and parameter count (shared parameters once)."""
    seen, params = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            params += p.numel()
    return {
        "name": str(model_name or type(model).__name__),
        "framework": "pytorch",
        "class": type(model).__name__,
        "parameters": params,
    }


def weight_bytes(model) -> int | None:
    """What the model's weights take as they are held (parameters and buffers, shared ones once): about what its
    export writes; None for a model that holds none (its weights in a layer store, or on the meta device)."""
    tensors = {id(t): t for t in itertools.chain(model.parameters(), model.buffers()) if not t.is_meta}
    return sum(t.numel() * t.element_size() for t in tensors.values()) or None
