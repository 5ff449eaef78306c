"""Models whose weights sat where streaming and LoRA did not look: BART's embeddings (its encoder's and decoder's
embed_tokens share model.shared's table) with the edges streamed, Mixtral's fused experts under all-linear, and a
timm ViT's cls_token and pos_embed, registered on its root and in no prefix module."""

from __future__ import annotations

import copy
import logging

import torch
import torch.nn.functional as F
from test_modelsfix import tiny_bart

from onn.config.strategy import LoraConfig, StrategyConfig
from onn.models.layers import discover
from onn.streaming.engine import StreamingEngine
from onn.streaming.store import LayerStore
from onn.training.classifier import ClassifierObjective
from onn.training.lora import apply


def lora_strategy() -> StrategyConfig:
    return StrategyConfig(name="sparse_lora", lora=LoraConfig(r=2, alpha=4, dropout=0.0, target_modules="all-linear"))


def test_bart_streams_its_edges_with_the_resident_loss_and_gradients():
    """BART's encoder and decoder run their own embed_tokens, whose table is model.shared's: the engine matched the
    stored table by the module's path, so neither got a stand-in nor its table, and the prefix failed on an empty
    table ("Padding_idx must be within num_embeddings")."""
    model = tiny_bart()
    resident = apply(model, "sparse_lora", lora_strategy(), discover(model), [1], task_type=None)
    for name, param in resident.named_parameters():
        if "lora_B" in name:  # (zeros at first: lora_A would get no gradient either way)
            torch.nn.init.normal_(param, std=0.05)
    streamed = copy.deepcopy(resident)
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "decoder_input_ids": ids[:, :8]}
    batch["labels"] = ids[:, 1:9].clone()
    loss = resident(**batch).loss
    loss.backward()

    engine = StreamingEngine(streamed, discover(streamed), LayerStore("cpu", "float32"), 1, stream_edges=True)
    engine.offload()
    assert any(name.endswith("model.shared.weight") for name in engine.edges)  # the table is streamed
    total, tokens = engine.evaluate([batch])
    engine.train_step([batch])
    engine.close()

    torch.testing.assert_close(torch.as_tensor(total / tokens).float(), loss.detach(), rtol=1e-5, atol=1e-6)
    want = {n: p.grad for n, p in resident.named_parameters() if p.requires_grad}
    got = {n: p.grad for n, p in streamed.named_parameters() if p.grad is not None}
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


def test_all_linear_on_mixtrals_fused_experts_says_they_stay_frozen_and_the_rest_trains(caplog):
    """transformers 5 holds Mixtral's experts as one MixtralExperts module of 3-D weights, no linear per expert:
    peft's all-linear passed over them without a word. The run says so once; attention's adapters still train."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    model = MixtralForCausalLM(config)
    strategy = StrategyConfig(name="lora", lora=LoraConfig(r=2, alpha=4, dropout=0.0, target_modules="all-linear"))
    with caplog.at_level(logging.WARNING, logger="onn.training.lora"):
        adapted = apply(model, "lora", strategy, discover(model), None)
    warned = [r.getMessage() for r in caplog.records if r.name == "onn.training.lora"]
    assert len(warned) == 1, warned
    assert "strategy.lora.target_modules=all-linear" in warned[0] and "MixtralExperts.gate_up_proj" in warned[0]
    assert "stay frozen" in warned[0]
    trainable = [n for n, p in adapted.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert not any("experts" in n for n in trainable) and any("q_proj.lora_A" in n for n in trainable)

    for name, param in adapted.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.05)
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    optimizer = torch.optim.SGD([p for p in adapted.parameters() if p.requires_grad], lr=0.5)
    before = adapted(input_ids=ids, labels=ids).loss
    before.backward()
    optimizer.step()
    with torch.no_grad():
        after = adapted(input_ids=ids, labels=ids).loss
    assert after < before


def test_a_dense_models_all_linear_warns_of_no_fused_weights(caplog):
    """The warning is for fused 3-D weights only: Llama's MLP is three linears, all adapted."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM(config)
    strategy = StrategyConfig(name="lora", lora=LoraConfig(r=2, alpha=4, dropout=0.0, target_modules="all-linear"))
    with caplog.at_level(logging.WARNING, logger="onn.training.lora"):
        adapted = apply(model, "lora", strategy, discover(model), None)
    assert not [r for r in caplog.records if r.name == "onn.training.lora"]
    assert any("mlp.down_proj.lora_A" in n for n, _ in adapted.named_parameters())


def tiny_vit():
    import timm

    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        img_size=32,
        patch_size=8,
        embed_dim=32,
        depth=3,
        num_heads=2,
        num_classes=4,
    )
    with torch.no_grad():  # (timm starts pos_embed near zero: its absence would hardly show)
        torch.nn.init.normal_(model.cls_token)
        torch.nn.init.normal_(model.pos_embed)
    return model.eval()


def test_a_vits_root_parameters_count_with_its_prefix():
    """cls_token and pos_embed sit on a ViT's root, in no prefix module: the prefix's count left them out, so
    prefix, blocks and suffix held less than the model (the planner's resident weights too few)."""
    model = tiny_vit()
    layer_map = discover(model)
    total = layer_map.prefix_params() + sum(layer_map.block_params()) + layer_map.suffix_params()
    assert total == sum(p.numel() for p in model.parameters())
    modules = sum(p.numel() for _, m in layer_map.prefix for p in m.parameters())
    assert layer_map.prefix_params() == modules + model.cls_token.numel() + model.pos_embed.numel()
    assert [name for name, _ in layer_map.loose] == ["cls_token", "pos_embed"]


def test_a_vit_streams_its_root_parameters_with_its_edges():
    """Streamed with its edges, cls_token and pos_embed come from the store for the prefix and the suffix:
    the logits are the resident model's."""
    model = tiny_vit()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(x)
    streamed = copy.deepcopy(model).requires_grad_(False)
    engine = StreamingEngine(
        streamed,
        discover(streamed),
        LayerStore("cpu", "float32"),
        1,
        stream_edges=True,
        objective=ClassifierObjective(F.cross_entropy),
    )
    engine.offload()
    assert {"cls_token", "pos_embed"} <= set(engine.edges)
    assert streamed.pos_embed.numel() == 0  # in the store, not on the model, between the phases
    with torch.no_grad():
        got = engine.outputs([{"x": x, "y": torch.tensor([0, 3])}])[0]
    engine.close()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
