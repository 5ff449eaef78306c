"""Make the planned set of weights trainable: everything (full), or LoRA adapters via peft on all
blocks (lora), on a 4-bit base loaded through transformers' BitsAndBytesConfig (qlora), or on a sparse
set of blocks (sparse_lora)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from torch import nn

from onn.config.strategy import StrategyConfig
from onn.errors import UserError
from onn.models.adapters import lora_refused
from onn.models.layers import LayerMap

if TYPE_CHECKING:
    from peft import LoraConfig

log = logging.getLogger(__name__)


def apply(
    model: nn.Module,
    strategy: str,
    strategy_cfg: StrategyConfig,
    layer_map: LayerMap,
    sparse_layers: list[int] | None,
    task_type: str | None = "CAUSAL_LM",
) -> nn.Module:
    """Return the model ready to train under `strategy` (the plan's choice). `task_type`: peft's (None: a plain
    PeftModel, which calls the model with the arguments it is given: a denoiser)."""
    if strategy in ("full", "ddp", "fsdp", "deepspeed_zero2", "deepspeed_zero3_offload"):
        for p in model.parameters():
            p.requires_grad_(True)
        return model
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from peft.tuners.tuners_utils import BaseTunerLayer

    if any(isinstance(m, BaseTunerLayer) for m in model.modules()):  # peft warned, then initialised them afresh
        raise UserError(
            f"strategy={strategy}: the model ({type(model).__name__}) already carries peft adapters (model.source "
            "holds an adapter, which transformers loads onto its base), and LoRA would replace them with new ones: "
            "give model.source the base model, or the adapter merged into it (peft's merge_and_unload)."
        )
    if strategy == "qlora":  # a 4-bit base from onn.models.load.load_4bit: norms in fp32, inputs that carry grad
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)

    lora = strategy_cfg.lora
    if lora is None:
        raise UserError(
            f"strategy={strategy} trains LoRA adapters, but strategy.lora is null: give its r, alpha, "
            "dropout and target_modules (conf/strategy/lora.yaml)."
        )
    layers = sparse_layers if strategy == "sparse_lora" else None
    before = list(model.named_modules())  # peft edits the model in place before it raises: the model as given
    modules = [(name, m) for block in layer_map.blocks for name, m in block.named_modules() if name]
    refused = lora_refused(model, [name for name, _ in modules])  # a Mamba mixer's out_proj and conv1d
    kind, choices = type(model).__name__, ", ".join(_linear_names([n for n, m in modules if _adaptable(m)], refused))
    target = lora.target_modules
    if target == "all-linear":  # peft needs explicit names to combine with layers_to_transform
        # every block's linears: a hybrid's blocks are of two kinds (Jamba's Mamba and attention layers), and block
        # 0's names alone left the other kind without adapters
        linears = list(dict.fromkeys(n for n, m in modules if _adaptable(m) and n.rsplit(".", 1)[-1] not in refused))
        if not linears:
            raise UserError(
                f"strategy={strategy}: the blocks of {type(model).__name__} ({type(layer_map.blocks[0]).__name__}) "
                "hold no linear layer for LoRA adapters (a stack of LSTM or GRU layers): train it with strategy=full."
            )
        last = {name.rsplit(".", 1)[-1] for name in linears}
        # the last names, unless one also names a module that is not a linear (a DiT's `ff.net.0`, an activation,
        # beside `attn1.to_out.0`): then the linears' paths within the block
        others = {n.rsplit(".", 1)[-1] for n, m in modules if not _adaptable(m)}
        target = sorted(linears if last & others else last)
        _warn_fused_weights(model, layer_map, strategy)
    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(target) if not isinstance(target, str) else target,
        layers_to_transform=layers,
        layers_pattern=layer_map.layers_pattern if layers is not None else None,
        task_type=task_type,
    )
    try:
        adapted = get_peft_model(model, config)
    except ValueError as e:
        raise UserError(_placement_error(before, config, lora.target_modules, e, kind, choices, refused)) from e
    # a list the user wrote; all-linear's list is of every block's linears, which the layers sparse_lora trains (a
    # MoE's router in some blocks only) may lack, and a string is a regular expression (peft's own check: nothing
    # matched)
    if not isinstance(lora.target_modules, str):
        _check_every_name_matched(adapted.targeted_module_names, list(target), kind, choices, strategy)
    return adapted


def _warn_fused_weights(model: nn.Module, layer_map: LayerMap, strategy: str) -> None:
    """Say once that all-linear leaves a block's fused 3-D weights frozen: transformers 5 holds a MoE's experts
    (Mixtral's, Qwen-MoE's) as one module of [experts, out, in] tensors, not a linear per expert, and peft's
    all-linear passes over them without a word, so the experts, most of such a model's weights, never train."""
    from torch.nn.modules.conv import _ConvNd

    fused = {
        (type(m).__name__, name): None
        for block in layer_map.blocks
        for m in block.modules()
        if not isinstance(m, _ConvNd)
        for name, p in m.named_parameters(recurse=False)
        if p.dim() == 3
    }
    if fused:
        weights = ", ".join(f"{kind}.{name}" for kind, name in fused)
        log.warning(
            "strategy=%s, strategy.lora.target_modules=all-linear: the blocks of %s hold fused expert weights (%s), "
            "which are no linear layers, so they get no LoRA adapters and stay frozen; only its linear layers "
            "(such as attention's projections) train.",
            strategy,
            type(model).__name__,
            weights,
        )


def _check_every_name_matched(targeted: list[str], target: list[str], kind: str, choices: str, strategy: str) -> None:
    """Each name of a list of target modules adapted something: peft adapts what the others match and passes over
    a misspelt one without a word ([q_proj, v_prj] trained q_proj alone). `kind`, `choices`: the model's class and
    linear layers' names, for the message."""
    missing = [t for t in target if not any(n == t or n.endswith(f".{t}") for n in targeted)]
    if missing:
        where = " in the layers strategy.layers picks" if strategy == "sparse_lora" else ""
        raise UserError(
            f"strategy.lora.target_modules={target!r}: {', '.join(missing)} matches no linear layer of "
            f"{kind}{where}, so only the others would train: correct or remove it, e.g. [{choices}], or all-linear."
        )


def _placement_error(
    before: list[tuple[str, nn.Module]],
    config: LoraConfig,
    target: object,
    error: ValueError,
    kind: str,
    choices: str,
    refused: dict[str, str],
) -> str:
    """One sentence for adapters peft would not place: what strategy.lora.target_modules matched (peft's own
    matcher, with the layers it was given) and a few of the blocks' linear layers to name instead. peft's message
    lists the matched module itself (a whole MLP printed) or its supported types over several lines. `before`: the
    model's modules as given, since peft has wrapped some of them (q_proj in its own Linear) by the time it raises;
    `kind`, `choices`: the model's class and linear layers' names; `refused`: names peft will not adapt, its reason."""
    from peft.tuners.tuners_utils import check_target_module_exists

    matched = [(name, m) for name, m in before if name and check_target_module_exists(config, name)]
    others = [f"{name} ({type(m).__name__})" for name, m in matched if not _adaptable(m)]
    names = list(dict.fromkeys(last for last in (name.rsplit(".", 1)[-1] for name, _ in matched) if last in refused))
    if not config.target_modules:
        found = "is empty"
    elif not matched:
        found = f"matches no module of {kind}" + (
            " in the layers strategy.layers picks" if config.layers_to_transform else ""
        )
        found += " (a string is a regular expression over whole module names)" if isinstance(target, str) else ""
    elif names:  # peft's first sentence, without its "[PEFT:LORA] " tag
        reason = refused[names[0]].split("] ", 1)[-1].split(". ", 1)[0]
        found = f"names {', '.join(names)}, which peft will not adapt on {kind} (peft: {reason})"
    elif others:
        found = f"matches {len(others)} modules of {kind} that are not linear layers (e.g. {others[0]})"
    else:  # it matched what peft adapts: another problem, in peft's first line
        found = f"could not be adapted on {kind} ({str(error).splitlines()[0][:200]})"
    advice = f"give a list of the names of its linear layers, e.g. [{choices}], or all-linear"
    return f"strategy.lora.target_modules={target!r} {found}: {advice}."


def _linear_names(linears: list[str], refused: dict[str, str]) -> list[str]:
    """The last names of the blocks' linear layers that peft adapts, the first 8 (then "..."): names outside the
    blocks (lm_head) are rarely meant, and outside the layers sparse_lora trains."""
    names = sorted({name.rsplit(".", 1)[-1] for name in linears} - set(refused))
    return names[:8] + (["..."] if len(names) > 8 else [])


def _adaptable(module: nn.Module) -> bool:
    """A layer LoRA adapts here: a linear one (transformers' Conv1D is GPT-2's)."""
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, nn.Linear | Conv1D)
