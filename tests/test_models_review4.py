"""The model area's fourth review (onn/models): a hybrid's decoder layers of two kinds (Jamba's Mamba and attention
layers) are its LayerMap's blocks, a folder's corrupt tokenizer file is named rather than called no tokenizer, and a
tied model's bare .safetensors file read with an untied architecture says which key ties them."""

from __future__ import annotations

import pytest
import torch
from conftest import compose, tiny_llama
from safetensors.torch import save_model

from onn.errors import UserError
from onn.models.layers import discover
from onn.models.load import load
from onn.models.tokenizer import byte_tokenizer


def tiny_jamba():
    """A real three-layer Jamba (transformers' JambaForCausalLM): Mamba layers with an attention layer between."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.JambaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=2,
        expert_layer_period=2,
        expert_layer_offset=1,
        attn_layer_period=2,
        attn_layer_offset=1,
        mamba_d_state=4,
        mamba_dt_rank=4,
        use_mamba_kernels=False,
    )
    return tf.JambaForCausalLM(config).eval()


def test_a_hybrids_decoder_layers_of_two_kinds_are_its_blocks():
    model = tiny_jamba()
    kinds = {type(layer).__name__ for layer in model.model.layers}
    assert len(kinds) == 2  # (the premise: a Mamba layer and an attention layer)
    layer_map = discover(model)
    # found by type alone, the blocks were four leaf Linears inside layer 0's Mamba mixer
    assert layer_map.block_paths == ["model.layers.0", "model.layers.1", "model.layers.2"]
    assert [n for n, _ in layer_map.prefix] == ["model.embed_tokens"]
    assert [n for n, _ in layer_map.suffix] == ["model.final_layernorm", "lm_head"]
    # run as streaming runs it: prefix, each block after the one before, suffix: the model's own logits
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        expected = model(ids).logits
        hidden = model.model.embed_tokens(ids)
        positions = torch.arange(7).unsqueeze(0)
        for block in layer_map.blocks:
            hidden = block(hidden, position_ids=positions)
            hidden = hidden[0] if isinstance(hidden, tuple) else hidden
        logits = model.lm_head(model.model.final_layernorm(hidden))
    torch.testing.assert_close(logits, expected)


def saved_llama(folder) -> None:
    tiny_llama(vocab_size=320).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)


def folder_config(source, *overrides: str):
    return compose(
        "model=llama_tiny", f"model.source={source}", "model.architecture=null", "model.tokenizer=null", *overrides
    ).model


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_a_folders_truncated_tokenizer_file_is_named_not_called_no_tokenizer(tmp_path, name):
    saved_llama(tmp_path)
    text = (tmp_path / name).read_text()
    (tmp_path / name).write_text(text[: len(text) // 2])  # an interrupted copy
    with pytest.raises(UserError, match=rf"tokenizer file .*{name} is not readable JSON.*copy it again"):
        load(folder_config(tmp_path))
    # model.tokenizer replaces the folder's own: the broken file is never read, and the model loads
    model, tokenizer = load(folder_config(tmp_path, "model.tokenizer=byte"))
    assert tokenizer.pad_token == "<pad>" and model.get_input_embeddings().num_embeddings == 320


def test_a_folder_without_a_tokenizer_still_asks_for_model_tokenizer(tmp_path):
    tiny_llama(vocab_size=320).save_pretrained(tmp_path)
    with pytest.raises(UserError, match="has no tokenizer; set model.tokenizer"):
        load(folder_config(tmp_path))


def test_a_tied_models_file_read_with_an_untied_architecture_says_which_key_ties_them(tmp_path):
    tied, _ = load(compose("model=llama_tiny", "model.architecture.tie_word_embeddings=true").model)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    save_model(tied, str(tmp_path / "tied.safetensors"))  # the shared matrix once, under one of its names
    untied = compose("model=llama_tiny", f"model.source={tmp_path / 'tied.safetensors'}").model
    with pytest.raises(UserError, match=r"missing \['model.embed_tokens.weight'\].*tie_word_embeddings=true"):
        load(untied)
    model, tokenizer = load(
        compose(
            "model=llama_tiny",
            f"model.source={tmp_path / 'tied.safetensors'}",
            "model.architecture.tie_word_embeddings=true",
        ).model
    )
    assert model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(model.model.embed_tokens.weight, tied.model.embed_tokens.weight)
    ids = tokenizer("tied", return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, tied(ids).logits)


def test_all_linear_lora_adapts_both_kinds_of_a_hybrids_layers():
    """all-linear was expanded from block 0's linears: Jamba's block 0 is a Mamba layer, and its attention layers'
    projections got no adapters. Every block's linears are the targets now, and a few steps move both kinds."""
    import dataclasses

    from onn.training.lora import apply

    cfg = compose("strategy=lora").strategy
    cfg = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, target_modules="all-linear"))
    model = tiny_jamba().train()
    adapted = apply(model, "lora", cfg, discover(model), None)
    targeted = adapted.targeted_module_names
    assert any(n.endswith("layers.1.self_attn.q_proj") for n in targeted)  # the attention layer
    assert any(n.endswith("layers.0.mamba.in_proj") for n in targeted)  # the Mamba layer
    trained = {n: p.detach().clone() for n, p in adapted.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW([p for p in adapted.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 64, (2, 7))
    losses = []
    for _ in range(3):
        loss = adapted(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    moved = {n for n, p in adapted.named_parameters() if p.requires_grad and not torch.equal(p, trained[n])}
    assert any("self_attn.q_proj.lora_B" in n for n in moved) and any("mamba.in_proj.lora_B" in n for n in moved)
    assert losses[-1] < losses[0]


def test_a_hybrid_with_one_attention_layer_in_eight_is_all_blocks_not_its_first_mamba_stretch():
    """Jamba-v0.1's own layout (attention at layer 4 of every 8): a run of one kind (layers 0..3, Mamba) ranked above
    the mixed list, so the attention layer and the Mamba layers after it went to the suffix."""
    import transformers as tf

    config = tf.JambaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, num_experts=2, mamba_d_state=4, mamba_dt_rank=4, use_mamba_kernels=False,
    )  # fmt: skip
    assert (config.attn_layer_period, config.attn_layer_offset) == (8, 4)
    with torch.device("meta"):
        model = tf.JambaForCausalLM(config)
    layer_map = discover(model)
    assert layer_map.block_paths == [f"model.layers.{i}" for i in range(8)]
    assert [n for n, _ in layer_map.suffix] == ["model.final_layernorm", "lm_head"]


def test_a_stem_beside_a_run_of_blocks_in_one_list_is_no_hybrid():
    """[Stem, Block x 4] in one ModuleList: the blocks are the run, the stem goes before them; a hybrid's other kind
    sits among its layers. And nothing inside a hybrid's list is a run of its own blocks (its layers' own lists)."""
    from torch import nn

    class Stem(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Linear(4, 8)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

    class Other(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList([Block(), Block(), Block()])  # a run inside one layer

    stemmed = nn.Module()
    stemmed.layers = nn.ModuleList([Stem(), Block(), Block(), Block(), Block()])
    layer_map = discover(stemmed)
    assert layer_map.block_paths == [f"layers.{i}" for i in range(1, 5)]
    assert [n for n, _ in layer_map.prefix] == ["layers.0"]
    hybrid = nn.Module()
    hybrid.layers = nn.ModuleList([Block(), Other(), Block(), Block()])
    assert discover(hybrid).block_paths == [f"layers.{i}" for i in range(4)]
