"""The planner's sizes of language models beyond dense Llama and Phi-3, checked against the real model built from the
same transformers config (tiny sizes, random weights): multi-head latent attention (DeepSeek-V2/V3), sliding-window
KV caches (Mistral, Qwen2, Gemma-2), Falcon's new decoder architecture, mixture-of-experts routers and OPT's
word_embed_proj_dim."""

from __future__ import annotations

import pytest
import test_planning_review5 as review5
import torch
from test_planning_review5 import SMALL, forward_flops, real_model, saved_bytes_per_token_and_block, spec_of

from onn.planning.costs import kv_cache_elements, layer_activation_elements, token_flops

SEQ = review5.SEQ  # 64 tokens
WINDOW = 16  # a sliding window shorter than SEQ
LATENT = dict(q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
DEEPSEEK = dict(
    model_type="deepseek_v2",
    **SMALL | dict(num_key_value_heads=4),
    **LATENT,
    intermediate_size=128,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
)
ARCHITECTURES = {
    "deepseek_v2": DEEPSEEK,
    "deepseek_v3": dict(DEEPSEEK, model_type="deepseek_v3"),
    "mistral": dict(model_type="mistral", **SMALL, intermediate_size=128, sliding_window=WINDOW),
    "qwen2": dict(
        model_type="qwen2",
        **SMALL,
        intermediate_size=128,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=1,  # the first layer attends to every token, the second slides
    ),
    "gemma2": dict(model_type="gemma2", **SMALL, intermediate_size=128, head_dim=16, sliding_window=WINDOW),
    "falcon": dict(
        model_type="falcon",
        vocab_size=320,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        new_decoder_architecture=True,
        num_kv_heads=2,
        bias=False,
        alibi=False,
    ),
    "olmoe": dict(model_type="olmoe", **SMALL, intermediate_size=48, num_experts=8, num_experts_per_tok=2),
    "opt": dict(
        model_type="opt",
        vocab_size=320,
        hidden_size=64,
        ffn_dim=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        word_embed_proj_dim=32,  # OPT-350m's form: embeddings narrower than hidden, projected in and out
    ),
}


def architecture(name: str) -> dict:
    """The architecture, or a clean skip where the installed transformers does not have it."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    found = ARCHITECTURES[name]
    if found["model_type"] not in CONFIG_MAPPING:
        pytest.skip(f"transformers has no {found['model_type']}")
    return found


def real_kv_cache_elements(model) -> int:
    """Elements the model's own KV cache holds after the prefill of one sequence of SEQ tokens."""
    with torch.no_grad():
        cache = model.eval()(torch.randint(0, 256, (1, SEQ)), use_cache=True).past_key_values
    return sum(t.numel() for layer in cache.layers for t in (layer.keys, layer.values) if isinstance(t, torch.Tensor))


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3", "olmoe", "opt"])
def test_the_planned_forward_flops_are_exactly_the_models(name):
    """DeepSeek's attention runs its products at 24-wide query-key and 16-wide value heads, where the plan read the
    config's head_dim (its 8-wide rotary part): 0.895 of the model's FLOPs. A router's weight is no linear layer and
    went uncounted (OLMoE: 0.990). OPT's head reads word_embed_proj_dim, not hidden: 1.07."""
    found = architecture(name)
    spec, model = spec_of(found), real_model(found, counted=True)
    per_block, head = token_flops(spec, SEQ)
    assert (sum(per_block) + head) * SEQ == pytest.approx(forward_flops(model), rel=1e-3)


@pytest.mark.parametrize("name", ["mistral", "qwen2", "gemma2", "deepseek_v2", "falcon"])
def test_the_planned_kv_cache_is_what_the_model_caches(name):
    """A sliding layer caches its window, not the sequence (Mistral: 15 of 64 tokens); multi-head latent attention
    caches its latent and rotary key (40 a token), not every head's keys and values; Falcon's new decoder architecture
    caches its keys and values broadcast to every query head (2 x 64 a token, planned as its 2 KV heads' 2 x 32).
    transformers keeps window - 1 tokens between steps and the window while one is added: the plan holds the window."""
    found = architecture(name)
    spec, model = spec_of(found), real_model(found)
    planned, real = kv_cache_elements(spec, SEQ), real_kv_cache_elements(model)
    sliding = sum(
        w for w, window in zip(spec.kv_cache_per_block or [], spec.kv_window_per_block or [], strict=True) if window
    )
    assert real <= planned <= real + sliding


def test_latent_attention_activations_are_within_what_a_dense_llama_gets():
    """DeepSeek's activations per token and block, planned against what autograd keeps, no further off than for the
    Llama the formula was measured on. The plan sized its keys and values at the config's 8-wide head_dim and left
    out its query and key-value latents: 53% of what the model keeps, against the Llama's 83%. Counted at two lengths,
    so that the attention probabilities its sdpa keeps (seq x seq, not in the formula) drop out."""

    def linear_bytes_per_token(model) -> float:
        at = {}
        for length in (SEQ // 2, SEQ):
            review5.SEQ = length
            at[length] = saved_bytes_per_token_and_block(model)
        review5.SEQ = SEQ
        return 2 * at[SEQ // 2] - at[SEQ]  # per token: a + b x length at each length

    llama = dict(model_type="llama", **SMALL, intermediate_size=128)
    reference = layer_activation_elements(spec_of(llama)) * 4 / linear_bytes_per_token(real_model(llama))
    found = architecture("deepseek_v2")
    planned = layer_activation_elements(spec_of(found)) * 4
    assert planned / linear_bytes_per_token(real_model(found)) == pytest.approx(reference, rel=0.1)
