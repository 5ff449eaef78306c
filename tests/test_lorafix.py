"""strategy=lora's targets on a Mamba model, and its message for targets peft would not place: peft refuses LoRA on
a Mamba mixer's out_proj, which all-linear named, and its half-adapted model was what the message described."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import compose, tiny_llama

from onn.errors import UserError
from onn.models.layers import discover
from onn.training.lora import apply


def _tiny_mamba() -> torch.nn.Module:
    """A random-init two-layer Mamba (transformers' MambaForCausalLM, the slow path: no CUDA kernels)."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.MambaConfig(vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=2, use_mambapy=False)
    return tf.MambaForCausalLM(config)


def _lora(target: object):
    """strategy=lora's config, as run.py composes it, with `target` as strategy.lora.target_modules."""
    cfg = compose("strategy=lora").strategy
    return dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, target_modules=target))


def test_the_default_lora_adapts_a_mamba_models_mixer_linears_but_out_proj_and_trains():
    """all-linear named out_proj too, which peft refuses on Mamba models: the default strategy=lora failed on any."""
    model = _tiny_mamba()
    cfg = compose("strategy=lora").strategy
    assert cfg.lora.target_modules == "all-linear"
    adapted = apply(model, "lora", cfg, discover(model), None)
    assert {n.rsplit(".", 1)[-1] for n in adapted.targeted_module_names} == {"in_proj", "x_proj", "dt_proj"}
    assert len(adapted.targeted_module_names) == 6  # three in each of the two blocks
    trained = {n: p for n, p in adapted.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    start = {n: p.detach().clone() for n, p in trained.items()}
    ids = torch.randint(0, 64, (2, 8))
    adapted.train()
    optimizer = torch.optim.SGD(trained.values(), lr=0.1)
    adapted(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    assert any(not torch.equal(p, start[n]) for n, p in trained.items() if "lora_B" in n)


@pytest.mark.parametrize("target, refused", [(["in_proj", "out_proj"], "out_proj"), (["conv1d"], "conv1d")])
def test_a_list_naming_what_peft_refuses_on_mamba_says_so_and_suggests_the_others(target, refused):
    """peft's own sentence, not a misleading "not linear layers" count over its half-adapted model."""
    model = _tiny_mamba()
    with pytest.raises(UserError) as e:
        apply(model, "lora", _lora(target), discover(model), None)
    message = str(e.value)
    assert message.startswith(f"strategy.lora.target_modules={target!r} names {refused}, which peft will not adapt")
    assert "incompatible with Mamba-based models" in message and "not linear layers" not in message
    assert message.endswith("e.g. [dt_proj, in_proj, x_proj], or all-linear.") and "\n" not in message


def test_targets_peft_will_not_place_are_described_on_the_model_as_given():
    """peft wraps q_proj before it refuses the MLP: the message counted q_proj as "not linear" (3 modules, e.g.
    q_proj) and offered peft's own names (base_layer, default) and the head outside the blocks."""
    model = tiny_llama()
    with pytest.raises(UserError) as e:
        apply(model, "lora", _lora(["q_proj", "mlp"]), discover(model), None)
    message = str(e.value)
    assert "matches 2 modules of LlamaForCausalLM that are not linear layers (e.g. model.layers.0.mlp (LlamaMLP))" in (
        message
    )
    assert "e.g. [down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj], or all-linear." in message
    assert "base_layer" not in message and "default" not in message and "lm_head" not in message
