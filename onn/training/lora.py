"""Make the planned set of weights trainable: everything (full), or LoRA adapters via peft on all
blocks (lora), on a 4-bit base (qlora), or on a sparse set of blocks (sparse_lora)."""

from __future__ import annotations

from typing import Any

from torch import nn

from onn.errors import UserError
from onn.models.layers import LayerMap


def apply(
    model: nn.Module,
    strategy: str,
    strategy_cfg: dict[str, Any],
    layer_map: LayerMap,
    sparse_layers: list[int] | None,
) -> nn.Module:
    """Return the model ready to train under `strategy` (the plan's choice)."""
    if strategy in ("full", "ddp", "fsdp", "deepspeed_zero2", "deepspeed_zero3_offload"):
        for p in model.parameters():
            p.requires_grad_(True)
        return model
    if strategy == "qlora":
        quantize_blocks_nf4(layer_map)
    from peft import LoraConfig, get_peft_model

    lora = dict(strategy_cfg.get("lora") or {})
    layers = sparse_layers if strategy == "sparse_lora" else None
    target = lora["target_modules"]
    if target == "all-linear":  # peft needs explicit names to combine with layers_to_transform
        target = sorted(
            {
                name.rsplit(".", 1)[-1]
                for name, m in layer_map.blocks[0].named_modules()
                if isinstance(m, nn.Linear)
            }
        )
    config = LoraConfig(
        r=int(lora["r"]),
        lora_alpha=int(lora["alpha"]),
        lora_dropout=float(lora["dropout"]),
        target_modules=list(target) if not isinstance(target, str) else target,
        layers_to_transform=layers,
        layers_pattern=layer_map.layers_pattern if layers is not None else None,
        task_type="CAUSAL_LM",
    )
    try:
        return get_peft_model(model, config)
    except ValueError as e:
        raise UserError(f"strategy.lora: peft could not place adapters on {type(model).__name__}: {e}") from e


def quantize_blocks_nf4(layer_map: LayerMap) -> None:
    """Replace every nn.Linear inside the blocks by a bitsandbytes NF4 Linear4bit (quantized on .cuda())."""
    import torch

    if not torch.cuda.is_available():
        raise UserError(
            "strategy=qlora needs a CUDA GPU (bitsandbytes 4-bit); on this machine use strategy=lora or sparse_lora."
        )
    import bitsandbytes as bnb

    compute_dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    for block in layer_map.blocks:
        for child in list(block.modules()):
            for attr, linear in list(child.named_children()):
                if type(linear) is nn.Linear:
                    q = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                          compute_dtype=compute_dtype, quant_type="nf4")  # fmt: skip
                    q.weight = bnb.nn.Params4bit(
                        linear.weight.data.to(compute_dtype), requires_grad=False, quant_type="nf4"
                    )
                    if linear.bias is not None:
                        q.bias = nn.Parameter(linear.bias.data, requires_grad=False)
                    setattr(child, attr, q.cuda())
