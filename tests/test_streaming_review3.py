"""Layer streaming with the weights outside the blocks streamed too (strategy.streaming.edges=stream): an embedding
whose forward does more than a lookup (Gemma's scales its rows; OPT's learned positions come from the attention
mask) computes what the resident model computes, from a float store on the CPU and from an int8 store with the
GPU's choice (blocks and head computing from the codes) forced on the CPU."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from conftest import execute_run
from torch import nn

from onn.models.layers import LayerMap, discover
from onn.streaming import engine as engine_module
from onn.streaming.engine import StreamingEngine
from onn.streaming.store import LayerStore, stored_name

SIZES = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=64)


def gemma():
    """A tiny Gemma: its embedding (GemmaTextScaledWordEmbedding) multiplies each row by sqrt(hidden_size)."""
    import transformers as tf

    config = tf.GemmaConfig(
        **SIZES, intermediate_size=128, num_key_value_heads=2, head_dim=16, pad_token_id=127, bos_token_id=1
    )
    return tf.GemmaForCausalLM(config)


def opt():
    """A tiny OPT: its learned position table (OPTLearnedPositionalEmbedding, 66 x 64: int8 in a quantized store) is
    looked up by positions it counts from the attention mask."""
    import transformers as tf

    config = tf.OPTConfig(**SIZES, ffn_dim=128, word_embed_proj_dim=64, dropout=0.0, pad_token_id=1, bos_token_id=2)
    return tf.OPTForCausalLM(config)


def layer_map(model: nn.Module) -> LayerMap:
    """The model's LayerMap, with OPT's final norm after the blocks, where its forward runs it (discovery orders
    modules as they were registered, and OPTDecoder registers its final norm before its layers)."""
    found = discover(model)
    late = [(name, m) for name, m in found.prefix if name.endswith("final_layer_norm")]
    return dataclasses.replace(found, prefix=[p for p in found.prefix if p not in late], suffix=late + found.suffix)


def with_lora(build) -> nn.Module:
    """The model with random LoRA adapters on its attention (so every adapter has a gradient), in train mode."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = build()
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return get_peft_model(model, lora).train()


def batches(count: int = 2, rows: int = 2, length: int = 10) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(count):
        ids = torch.randint(3, 120, (rows, length), generator=g)
        mask = torch.ones_like(ids)
        mask[0, :3] = 0  # left padding in one row
        labels = ids.masked_fill(mask == 0, -100)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def as_stored(resident: nn.Module, engine: StreamingEngine) -> None:
    """The resident model's frozen weights set to what the engine's store holds, de-quantized: what the streamed
    model computes with."""
    cpu = torch.device("cpu")
    decoded = engine.store.decode(engine.store.read("edges"), cpu, torch.float32)
    for i, path in enumerate(engine.map.block_paths):
        blocks = engine.store.decode(engine.store.read(i), cpu, torch.float32)
        decoded.update({f"{path}.{n}": t for n, t in blocks.items()})
    for name, param in resident.named_parameters():
        if stored_name(name) in decoded:
            param.data = decoded[stored_name(name)]


def lora_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters() if "lora_" in n}


@pytest.mark.parametrize("build", [gemma, opt], ids=["gemma-scaled-rows", "opt-positions"])
@pytest.mark.parametrize("store_dtype", ["float32", "int8"], ids=["float-store", "int8-codes-as-on-a-gpu"])
def test_embeddings_that_do_more_than_a_lookup_stream_with_the_resident_results(monkeypatch, build, store_dtype):
    """A step's loss and LoRA gradients, the validation loss and the greedy tokens of a model streamed with its
    edges are the resident model's (with the store's weights). Gemma's rows were looked up in the stored table
    without their sqrt(hidden_size) scale (every loss wrong, silently); OPT's position table was called as a
    lookup of token ids (a TypeError on position_ids). int8, with the GPU's choice forced: a table that is no
    linear's weight was installed as its codes, without their row scales (wrong losses and tokens on a GPU)."""
    if store_dtype == "int8":
        monkeypatch.setattr(engine_module, "computes_from_codes", lambda store_dtype, *_: store_dtype == "int8")
    streamed = with_lora(build)
    resident = copy.deepcopy(streamed)
    engine = StreamingEngine(streamed, layer_map(streamed), LayerStore("cpu", store_dtype), 2, stream_edges=True)
    engine.offload()
    as_stored(resident, engine)
    mbs = batches()
    losses = [resident(**mb).loss for mb in mbs]
    (sum(losses) / len(losses)).backward()
    loss = engine.train_step(mbs)
    torch.testing.assert_close(loss, torch.stack(losses).mean().detach(), rtol=1e-4, atol=1e-6)
    want, got = lora_grads(resident), lora_grads(streamed)
    assert want and want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-3, atol=1e-6, msg=name)
    resident.eval(), streamed.eval()
    with torch.no_grad():
        want_losses = [resident(**mb).loss for mb in mbs]
    torch.testing.assert_close(torch.stack(engine.loss(mbs)), torch.stack(want_losses), rtol=1e-4, atol=1e-6)
    ids, mask = mbs[0]["input_ids"], mbs[0]["attention_mask"]
    want_ids = resident.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0
    )[:, ids.shape[1] :]
    assert torch.equal(engine.generate(ids, mask, max_new_tokens=4), want_ids)


@pytest.mark.parametrize("width", [64, 96], ids=["rows-whole-blocks", "rows-straddle-blocks"])
def test_an_nf4_embedding_streams_with_the_resident_results(width):
    """An nf4 store packs two values a byte in blocks of 64 with one absmax each: the streamed embedding looked its
    rows up in the packed bytes as if they were a table (each token one byte, broadcast by the first norm: every
    loss silently wrong). Rows 64-aligned are de-quantized alone; rows that straddle blocks take the table whole."""
    from conftest import tiny_llama

    streamed = with_lora(lambda: tiny_llama(hidden_size=width, intermediate_size=128, num_hidden_layers=4))
    resident = copy.deepcopy(streamed)
    engine = StreamingEngine(streamed, layer_map(streamed), LayerStore("cpu", "nf4"), 2, stream_edges=True)
    engine.offload()
    assert "base_model.model.model.embed_tokens.weight.absmax" in engine.store.read("edges")  # nf4 in the store
    as_stored(resident, engine)
    mbs = batches()
    losses = [resident(**mb).loss for mb in mbs]
    (sum(losses) / len(losses)).backward()
    torch.testing.assert_close(engine.train_step(mbs), torch.stack(losses).mean().detach(), rtol=1e-4, atol=1e-6)
    want, got = lora_grads(resident), lora_grads(streamed)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-3, atol=1e-6, msg=name)
    resident.eval(), streamed.eval()
    ids, mask = mbs[0]["input_ids"], mbs[0]["attention_mask"]
    want_ids = resident.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0
    )[:, ids.shape[1] :]
    assert torch.equal(engine.generate(ids, mask, max_new_tokens=4), want_ids)


def test_a_streamed_checkpoint_names_the_store_dtype_its_adapters_trained_on(tmp_path):
    """strategy.streaming.store_dtype=auto was saved as given, so eval, infer and export of the checkpoint planned
    the store again and could rebuild the frozen base at another precision than the adapters trained on. The
    checkpoint names the dtype the run streamed, and metrics.json says it."""
    from onn.training.checkpoints import saved_config

    overrides = ("strategy=sparse_lora", "data=math", "data.max_length=32", "trainer.max_steps=1")
    metrics = execute_run(tmp_path, tmp_path / "cache", *overrides, "task.exact_match_samples=0")
    saved = saved_config(tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert saved["strategy"]["streaming"]["store_dtype"] == metrics["streaming/store_dtype"] != "auto"
