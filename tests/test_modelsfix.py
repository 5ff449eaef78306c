"""The LayerMap's blocks where a model's own discovery went wrong (sparse_lora's adapters outside the blocks on BART,
T5's two stacks, timm's [stem, stages]), and model.source=random initialised as transformers initialises it."""

from __future__ import annotations

import copy

import pytest
import torch

from onn.config.model import LanguageModelConfig, LayerMapOverride
from onn.config.strategy import LoraConfig, StrategyConfig
from onn.errors import UserError
from onn.models.layers import discover
from onn.models.load import _random_model
from onn.streaming.engine import StreamingEngine
from onn.streaming.store import LayerStore
from onn.training.lora import apply


def tiny_bart():
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    config = BartConfig(
        vocab_size=128,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
    )
    return BartForConditionalGeneration(config).float().train()


def test_sparse_lora_on_bart_adapts_only_the_blocks_and_every_adapter_trains_streamed():
    """BART's blocks are its decoder's layers; sparse_lora on block 1 adapted the encoder's layer 1 too (peft read
    the pattern `layers` anywhere), in the prefix, where the streamed step gave those adapters no gradient."""
    model = tiny_bart()
    layer_map = discover(model)
    assert layer_map.blocks_path == "model.decoder.layers"
    strategy = StrategyConfig(
        name="sparse_lora", lora=LoraConfig(r=2, alpha=4, dropout=0.0, target_modules="all-linear")
    )
    resident = apply(model, "sparse_lora", strategy, layer_map, [1], task_type=None)
    adapted = resident.targeted_module_names
    assert adapted and all(name.startswith("model.decoder.layers.1.") for name in adapted), adapted
    for name, param in resident.named_parameters():
        if "lora_B" in name:  # (zeros at first: then lora_A would get no gradient either way)
            torch.nn.init.normal_(param, std=0.05)
    streamed = copy.deepcopy(resident)

    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "decoder_input_ids": ids[:, :8]}
    batches = [{**batch, "labels": ids[:, 1:9].clone()} for _ in range(2)]
    for b in batches:
        (resident(**b).loss / len(batches)).backward()
    engine = StreamingEngine(streamed, discover(streamed), LayerStore("cpu", "float32"), 1)
    engine.offload()
    engine.train_step(batches)
    engine.close()

    want = {n: p.grad for n, p in resident.named_parameters() if p.requires_grad}
    got = {n: p.grad for n, p in streamed.named_parameters() if p.grad is not None}
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


def test_t5s_blocks_are_its_decoders_layers_not_its_two_stacks():
    """T5's encoder and decoder (two T5Stacks, whole models) were its 2 blocks, whatever its depth, which the
    streaming engine could not call; its blocks are its decoder's layers, the encoder before them (as BART's)."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=3, num_heads=4)
    with torch.device("meta"):
        model = T5ForConditionalGeneration(config)
    layer_map = discover(model)
    assert (layer_map.blocks_path, len(layer_map)) == ("decoder.block", 3)
    assert type(layer_map.blocks[0]).__name__ == "T5Block"
    assert "encoder" in [name for name, _ in layer_map.prefix]
    assert [name for name, _ in layer_map.suffix][-1] == "lm_head"


def test_streaming_t5_is_refused_in_one_sentence():
    """T5's blocks take the position biases the first block computes; the engine replays every block with the first
    one's arguments, and a streamed step failed with "'weight' must be 2-D" (or an unpacking error)."""
    from transformers import T5Config, T5ForConditionalGeneration

    model = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=2))
    with pytest.raises(UserError, match=r"first block \(T5Block\) computes the position bias.*strategy=lora"):
        StreamingEngine(model, discover(model), LayerStore("cpu", "float32"), 1)


def test_mpt_whose_alibi_bias_every_block_shares_still_streams():
    """MPT computes its ALiBi bias once and hands the same tensor to every block, which the engine's replay of the
    first block's arguments gives too: streamed, its loss is the resident loss (the T5 check first refused it)."""
    from transformers import MptConfig, MptForCausalLM

    torch.manual_seed(0)
    model = MptForCausalLM(MptConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=3, max_seq_len=32))
    model.eval()
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    with torch.no_grad():
        want = model(**batch).loss
    streamed = copy.deepcopy(model).requires_grad_(False)  # frozen blocks, as the streamed strategies hold them
    engine = StreamingEngine(streamed, discover(streamed), LayerStore("cpu", "float32"), 1)
    engine.offload()
    total, tokens = engine.evaluate([batch])
    got = total / tokens
    engine.close()
    torch.testing.assert_close(torch.as_tensor(got).float(), want.float(), rtol=1e-5, atol=1e-6)


def test_timm_convnexts_blocks_are_its_stages_and_resnets_stay_its_layers():
    """timm's ConvNeXt is [stem, stages, ...]: the two Sequentials were its 2 blocks, the second with 99.98% of the
    weights; its blocks are the four stages. ResNet's layer1..4, which share the weights, stay its blocks."""
    import timm

    with torch.device("meta"):
        convnext = timm.create_model("convnext_tiny", pretrained=False, num_classes=3)
        resnet = timm.create_model("resnet18", pretrained=False, num_classes=3)
    layer_map = discover(convnext)
    assert (layer_map.blocks_path, layer_map.block_names) == ("stages", ["0", "1", "2", "3"])
    assert [name for name, _ in layer_map.prefix] == ["stem"]
    layer_map = discover(resnet)
    assert (layer_map.blocks_path, layer_map.block_names) == ("", ["layer1", "layer2", "layer3", "layer4"])


def random_model(architecture: dict):
    config = LanguageModelConfig(
        name=architecture["model_type"],
        source="random",
        tokenizer="byte",
        dtype="float32",
        trust_remote_code=False,
        layer_map=LayerMapOverride(blocks=None),
        architecture=architecture,
    )
    return _random_model(config, torch.float32)


def test_random_gpt2_draws_its_residual_projections_with_the_scaled_std():
    """GPT-2 scales the init of each block's c_proj by 1/sqrt(2 * n_layer) in its attention's and MLP's init; drawn
    parents first, each Conv1D's own init then overwrote it with the plain 0.02."""
    layers = 8
    model = random_model(dict(model_type="gpt2", vocab_size=256, n_embd=256, n_layer=layers, n_head=4, n_positions=64))
    scaled = 0.02 / (2 * layers) ** 0.5  # 0.005: a 256 x 256 draw's std is within 1% of it, far inside 10%
    for block in model.transformer.h:
        for proj in (block.attn.c_proj, block.mlp.c_proj):
            assert abs(float(proj.weight.std()) - scaled) < 0.1 * scaled
        assert abs(float(block.attn.c_attn.weight.std()) - 0.02) < 0.002  # the others keep the plain std


def test_random_mamba_draws_its_dt_bias_as_its_mixer_initialises_it():
    """Mamba's mixer sets dt_proj's bias to the inverse softplus of a step in [0.001, 0.1] (below -2); the Linear's
    own init, run after it, left zeros."""
    model = random_model(dict(model_type="mamba", vocab_size=64, hidden_size=32, state_size=4, num_hidden_layers=2))
    for layer in model.backbone.layers:
        assert bool((layer.mixer.dt_proj.bias < -2).all())
