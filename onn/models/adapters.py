"""What peft's LoRA leaves out of a model: training adapts the rest (training/lora.py), and the plan sizes the
adapters on the same layers (planning/spec.py), so both ask here."""

from __future__ import annotations

from torch import nn


def lora_refused(model: nn.Module, names: list[str]) -> dict[str, str]:
    """The last names among `names` (module paths) that peft will not adapt on this model, each with peft's reason:
    peft refuses LoRA on a Mamba mixer's out_proj and conv1d (model_type mamba, falcon_mamba, ...), after wrapping
    the layers before them. peft's own check, asked name by name, so that its list of model types and modules holds
    as it grows; a peft without the check refuses none."""
    try:
        from peft.tuners.tuners_utils import _check_lora_target_modules_mamba as check
    except ImportError:
        return {}
    from peft import LoraConfig

    probe, refused = LoraConfig(), {}
    for last in dict.fromkeys(name.rsplit(".", 1)[-1] for name in names):
        try:
            check(probe, model, last)
        except ValueError as e:
            refused[last] = str(e)
    return refused
