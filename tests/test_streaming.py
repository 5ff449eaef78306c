"""The layer-streaming engine computes what the resident model computes: same loss, same LoRA
gradients, same weights after several steps, same greedy tokens."""

import copy
import math
import weakref

import pytest
import torch
import torch.nn.functional as F
from conftest import compose
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from onn.models.layers import discover
from onn.streaming.engine import StreamingEngine, target_tokens, token_weights
from onn.streaming.recompute_norms import recompute_norms
from onn.streaming.store import LayerStore, stored_name
from onn.streaming.tiled_mlp import tile_blocks

ARCH = {
    "llama": dict(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "phi3": dict(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
}
LAYER_SETS = {"first4+last4": [0, 1, 2, 3, -4, -3, -2, -1], "last4": [-4, -3, -2, -1], "all": None}


def lora_model(model_type: str, layers, dropout: float = 0.0, **sizes):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**ARCH[model_type], **sizes}))
    idx = None if layers is None else sorted({i % 8 for i in layers})
    targets = (
        ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
        if model_type == "phi3"
        else ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=targets,
        layers_to_transform=idx,
        layers_pattern="layers" if idx else None,
        lora_dropout=dropout,
        init_lora_weights=False,
    )  # random A and B, so every adapter gets a gradient
    return get_peft_model(model, config).float()


def micro_batches(m=3, b=2, t=10, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(m):
        ids = torch.randint(3, 97, (b, t), generator=g)
        mask = torch.ones_like(ids)
        mask[0, :3] = 0  # left padding in one row
        labels = ids.clone()
        labels[:, : t // 2] = -100  # loss on the second half only, like an answer
        labels[mask == 0] = -100
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def engine_for(model, chunk_size, kind="cpu", prefetch=True, folder=None, stream_edges=False, dtype="float32"):
    store = LayerStore(kind, dtype, folder=folder)
    engine = StreamingEngine(model, discover(model), store, chunk_size, prefetch=prefetch, stream_edges=stream_edges)
    engine.offload()
    return engine


def lora_grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("model_type", ["llama", "phi3"])
@pytest.mark.parametrize("chunk_size", [1, 2, 3])
@pytest.mark.parametrize("layer_set", list(LAYER_SETS))
def test_one_step_matches_resident_gradient_accumulation(model_type, chunk_size, layer_set):
    resident = lora_model(model_type, LAYER_SETS[layer_set])
    streamed = copy.deepcopy(resident)
    mbs = micro_batches()
    losses = []
    for mb in mbs:
        loss = resident(**mb).loss
        (loss / len(mbs)).backward()
        losses.append(loss.detach())
    engine = engine_for(streamed, chunk_size)
    loss = engine.train_step(mbs)
    torch.testing.assert_close(loss, torch.stack(losses).mean(), rtol=1e-4, atol=1e-6)
    want, got = lora_grads(resident), lora_grads(streamed)
    assert want.keys() == got.keys() and want
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
    if layer_set == "last4" and chunk_size == 2:
        assert engine.lowest_chunk == 2  # blocks 0-3 run forward only
        assert engine.times.history == [
            0,
            1,
            2,
            3,
            2,
        ]  # forward 0..3, backward reuses 3 then reloads 2 and stops


def test_a_step_weighs_its_micro_batches_and_loss_pieces_by_the_hosts_counts_without_reading_them(monkeypatch):
    """The text module counts each row's target tokens on the host before the batch goes to the device; the
    streamed step weighs its micro-batches and its loss's pieces (a row at a time here) by those counts and never
    counts them on the device (each count read back is a wait for the GPU): the same loss and gradients as the
    resident model's, with the device's counting taken away. Micro-batches hold different numbers of targets."""
    import onn.streaming.engine as streaming

    resident = lora_model("llama", LAYER_SETS["first4+last4"])
    streamed = copy.deepcopy(resident)
    mbs = micro_batches()
    mbs[1]["labels"][1, 5:8] = -100  # fewer targets in one row of one micro-batch
    total = sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in mbs)
    for mb in mbs:
        loss = resident(**mb).loss
        (loss * int((mb["labels"][:, 1:] != -100).sum()) / total).backward()
    rows = [(mb["labels"][:, 1:] != -100).sum(1).tolist() for mb in mbs]
    engine = engine_for(streamed, 2)
    engine.suffix_rows = 1
    monkeypatch.setattr(streaming, "target_tokens", lambda mb: pytest.fail("a count was read from the device"))
    engine.forward_train(mbs, total_tokens=total, row_weights=rows)
    engine.backward_chunks()
    want, got = lora_grads(resident), lora_grads(streamed)
    assert want.keys() == got.keys() and want
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


class LiveBytes(TorchDispatchMode):
    """The bytes of the tensors created under it that are still alive, and their peak: what a device's
    allocator would hold for them, measured on any device."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak = {}, 0, 0

    def _freed(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.live:
                storage, key = t.untyped_storage(), t.untyped_storage().data_ptr()
                self.live[key] = storage.nbytes()
                weakref.finalize(storage, self._freed, key)
                self.now += storage.nbytes()
                self.peak = max(self.peak, self.now)
        return out


def test_a_streamed_forward_lets_the_prefixs_output_go_once_the_first_chunk_has_read_it():
    """A streamed step's no-grad forward holds, per micro-batch, a chunk's input and its output: two hidden states,
    as the GPU plan counts with the chunk inputs on the host. The prefix's outputs were held to the forward's end,
    a third state per micro-batch on the device."""
    model = lora_model("llama", LAYER_SETS["last4"], hidden_size=256, intermediate_size=64)
    engine = StreamingEngine(model, discover(model), LayerStore("cpu", "float32"), 2, forward_group=1)
    engine.offload()
    g = torch.Generator().manual_seed(0)

    def forward_peak(m: int) -> int:
        ids = [torch.randint(3, 97, (4, 16), generator=g) for _ in range(m)]
        batches = [{"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x} for x in ids]
        with LiveBytes() as held:
            engine._forward(batches, keep_from=None)
        return held.peak

    state = 4 * 16 * 256 * 4  # a micro-batch's hidden state in float32
    grown = forward_peak(4) - forward_peak(2)
    assert 4 * state <= grown < 5 * state  # two micro-batches more, two states each (six before)


def test_a_decode_step_lets_the_prefixs_output_go_once_the_first_chunk_has_read_it():
    """Generation holds a chunk's input and output, as training's forward does: the prefix's output (for the
    prompts' prefill, a hidden state of every prompt token) was held through every chunk of the step."""
    engine = engine_for(lora_model("llama", LAYER_SETS["last4"]), 2)
    prefix, run_chunk, outputs, alive = engine.prefix, engine._run_chunk, [], []

    def watched_prefix(batch):
        inputs = prefix(batch)
        outputs.append(weakref.ref(inputs.hidden))
        return inputs

    def watched_chunk(c, hidden, inputs, random_state=None):
        alive.append(outputs[-1]() is not None)
        return run_chunk(c, hidden, inputs, random_state)

    engine.prefix, engine._run_chunk = watched_prefix, watched_chunk
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
    engine.generate(ids, torch.ones_like(ids), max_new_tokens=2)
    chunks = len(engine.chunks)
    assert chunks >= 2 and len(outputs) == 2  # the prefill and one token
    assert alive == ([True] + [False] * (chunks - 1)) * 2


@pytest.mark.parametrize("model_type", ["llama", "phi3"])
def test_a_sliced_gated_mlp_trains_as_the_whole_one_in_a_fraction_of_the_memory(model_type):
    """strategy.streaming.mlp_tiles: each block's gated MLP (Llama's gate and up projections, Phi-3's fused
    one) computed a slice of its intermediate features at a time, LoRA on all three of its linears: the
    streamed step's loss and LoRA gradients are the resident model's, also under bf16 autocast, a block's
    recompute and backward holds less than half of what the whole MLP held, and a copy of a sliced model
    computes with its own weights."""
    bias = {"mlp_bias": True} if model_type == "llama" else {}  # the down projection's bias added once
    resident = lora_model(model_type, LAYER_SETS["first4+last4"], hidden_size=32, intermediate_size=1024, **bias)
    for name, param in resident.named_parameters():
        if name.endswith("proj.base_layer.bias"):
            param.data.normal_()  # transformers starts biases at zero
    sliced, whole = copy.deepcopy(resident), copy.deepcopy(resident)
    mbs = micro_batches(m=2, b=4, t=16)
    losses = [resident(**mb).loss for mb in mbs]
    (sum(losses) / len(mbs)).backward()
    engine = StreamingEngine(sliced, discover(sliced), LayerStore("cpu", "float32"), 2, mlp_tiles=4)
    engine.offload()
    assert engine.tiled_mlps == 8
    loss = engine.train_step(mbs)
    torch.testing.assert_close(loss, torch.stack(losses).mean().detach(), rtol=1e-4, atol=1e-6)
    want, got = lora_grads(resident), lora_grads(sliced)
    assert any("down_proj" in n for n in want) and any("up_proj" in n for n in want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)

    def block_peak(model) -> int:
        block, x = discover(model).blocks[-1], torch.randn(8, 64, 32, requires_grad=True)
        position = torch.arange(64)[None]
        rotary = model.base_model.model.model.rotary_emb(x, position)
        with LiveBytes() as held:
            block(x, position_embeddings=rotary, position_ids=position)[0].sum().backward()
        return held.peak

    tile_blocks(discover(resident).blocks, 4)  # what the engine did to `sliced`, whose weights are in its store
    assert block_peak(resident) < 0.5 * block_peak(whole)
    copied = copy.deepcopy(resident)
    mlp = discover(copied).blocks[-1].mlp
    mlp.down_proj.base_layer.weight.data.zero_()
    mlp.down_proj.lora_B["default"].weight.data.zero_()
    if model_type == "llama":
        mlp.down_proj.base_layer.bias.data.zero_()
    x = torch.randn(64, 32, requires_grad=True)
    assert not mlp(x).any() and discover(resident).blocks[-1].mlp(x).any()
    tile_blocks(discover(copied).blocks, 1)
    assert "forward" not in mlp.__dict__  # the class's forward again: whole

    # bf16 autocast, as a GPU computes: a bf16 store, float32 adapters; sliced against whole
    grads = []
    for tiles in (1, 4):
        model = copy.deepcopy(whole)
        engine = StreamingEngine(
            model, discover(model), LayerStore("cpu", "bfloat16"), 2, compute_dtype=torch.bfloat16, mlp_tiles=tiles
        )
        engine.offload()
        engine.train_step(mbs)
        grads.append(lora_grads(model))
    # each against the float32 gradients: bf16's rounding puts the whole MLP's at cosines of 0.986 and more
    cosines = [[F.cosine_similarity(g[n].flatten(), want[n].flatten(), dim=0).item() for n in want] for g in grads]
    assert min(cosines[1]) > 0.97 and sum(cosines[1]) / len(want) > sum(cosines[0]) / len(want) - 0.002


@pytest.mark.parametrize("model_type", ["llama", "phi3"])
def test_recomputed_norms_keep_no_float32_copies_and_change_no_gradient(model_type):
    """On a GPU the engine recomputes its blocks' norms in the backward (onn/streaming/recompute_norms.py). Under
    bf16 autocast, bf16 weights beside float32 adapters as a GPU computes: a block's output and its input's and
    adapters' gradients are what they were, and its recompute and backward holds less by at least one float32
    copy of its input (RMSNorm keeps one per norm); no gradient, or the norms kept again: the class's forward."""
    model = lora_model(model_type, LAYER_SETS["first4+last4"], hidden_size=64, intermediate_size=128)
    for param in model.parameters():
        if not param.requires_grad:
            param.data = param.data.bfloat16()
    blocks = discover(model).blocks
    g = torch.Generator().manual_seed(3)
    x0, dy = torch.randn(8, 32, 64, generator=g).bfloat16(), torch.randn(8, 32, 64, generator=g).bfloat16()
    position = torch.arange(32)[None]

    def block_step(block) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], int]:
        model.zero_grad()
        x = x0.clone().requires_grad_(True)
        rotary = model.base_model.model.model.rotary_emb(x, position)
        with LiveBytes() as held, torch.autocast("cpu", dtype=torch.bfloat16):
            y = block(x, position_embeddings=rotary, position_ids=position)
            y = y[0] if isinstance(y, tuple) else y
            y.backward(dy)
        return (
            y.detach(),
            x.grad,
            {n: p.grad.clone() for n, p in block.named_parameters() if p.requires_grad},
            held.peak,
        )

    y_kept, dx_kept, grads_kept, peak_kept = block_step(blocks[-1])
    assert recompute_norms(blocks) == 2 * len(blocks)
    y, dx, grads, peak = block_step(blocks[-1])
    torch.testing.assert_close(y, y_kept, rtol=0, atol=0)
    torch.testing.assert_close(dx, dx_kept, rtol=0, atol=0)
    assert grads_kept and all(torch.equal(grads[n], grads_kept[n]) for n in grads_kept)
    assert peak <= peak_kept - x0.numel() * 4, (peak, peak_kept)
    norm = blocks[-1].input_layernorm
    copied = copy.deepcopy(norm)  # a copy computes with its own weight
    copied.weight.data.zero_()
    with torch.no_grad():
        assert not copied(x0).any() and norm(x0).any()
    assert recompute_norms(blocks, on=False) == 0 and "forward" not in norm.__dict__
    # a batch norm's training forward updates its running statistics: recomputed, it would update them twice
    assert recompute_norms([torch.nn.Sequential(torch.nn.BatchNorm1d(4), torch.nn.LayerNorm(4))]) == 1


def test_with_dropout_the_recompute_draws_the_forwards_masks():
    """LoRA dropout (and any dropout in the blocks): each chunk recomputed in the backward draws the masks its
    forward drew. With one chunk of all blocks and one micro-batch the streamed step draws as the resident
    model does, and its gradients are the resident model's; with chunks of 3 and 3 micro-batches every
    recompute's output is its forward's, and the step leaves the random state where its forward did."""
    resident = lora_model("llama", LAYER_SETS["first4+last4"], dropout=0.3)
    streamed = copy.deepcopy(resident)
    mb = micro_batches(m=1, b=4, t=12)
    torch.manual_seed(5)
    resident(**mb[0]).loss.backward()
    engine = engine_for(streamed, 8)
    assert engine.dropout
    torch.manual_seed(5)
    engine.train_step(mb)
    want, got = lora_grads(resident), lora_grads(streamed)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)

    model = copy.deepcopy(resident)
    engine = engine_for(model, 3)
    outputs: dict[str, list[torch.Tensor]] = {"forward": [], "recompute": []}
    run_chunk = engine._run_chunk

    def recorded(c, hidden, inputs, random_state=None):
        out = run_chunk(c, hidden, inputs, random_state)
        outputs["recompute" if torch.is_grad_enabled() else "forward"].append((c, out.detach().clone()))
        return out

    engine._run_chunk = recorded
    mbs = micro_batches(m=3, b=2, t=10)
    torch.manual_seed(7)
    engine.train_step(mbs)
    after_step = torch.get_rng_state()
    forward = {(c, i % 3): out for i, (c, out) in enumerate(outputs["forward"])}
    recompute = {(c, i % 3): out for i, (c, out) in enumerate(sorted(outputs["recompute"], key=lambda x: -x[0]))}
    assert len(forward) == len(recompute) == 9
    for key, out in recompute.items():
        torch.testing.assert_close(out, forward[key], rtol=0, atol=0, msg=str(key))
    torch.manual_seed(7)
    engine._forward(mbs, keep_from=0)  # the forward alone draws what the whole step drew
    assert torch.equal(torch.get_rng_state(), after_step)


def test_adapters_match_after_several_steps():
    resident = lora_model("llama", LAYER_SETS["first4+last4"])
    streamed = copy.deepcopy(resident)
    engine = engine_for(streamed, 3)
    opt_r = torch.optim.AdamW([p for p in resident.parameters() if p.requires_grad], lr=1e-2)
    opt_s = torch.optim.AdamW([p for p in streamed.parameters() if p.requires_grad], lr=1e-2)
    for step in range(4):
        mbs = micro_batches(seed=step)
        for mb in mbs:
            (resident(**mb).loss / len(mbs)).backward()
        engine.train_step(mbs)
        opt_r.step(), opt_s.step(), opt_r.zero_grad(), opt_s.zero_grad()
    for (name, a), (_, b) in zip(resident.named_parameters(), streamed.named_parameters()):
        if a.requires_grad:
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6, msg=name)


def test_store_disk_and_prefetch_give_identical_numbers(tmp_path):
    base = lora_model("phi3", LAYER_SETS["first4+last4"])
    results = []
    for kind, prefetch in [("cpu", True), ("cpu", False), ("disk", True), ("disk", False)]:
        model = copy.deepcopy(base)
        engine = engine_for(model, 2, kind=kind, prefetch=prefetch, folder=tmp_path / f"{kind}{prefetch}")
        loss = engine.train_step(micro_batches())
        results.append((loss, lora_grads(model)))
        engine.close()
    for loss, grads in results[1:]:
        assert torch.equal(loss, results[0][0])
        assert all(torch.equal(grads[n], results[0][1][n]) for n in grads)


def test_prefetch_survives_close_as_lightning_tears_down_after_validate(tmp_path):
    engine = engine_for(lora_model("llama", LAYER_SETS["all"]), 2, kind="disk", folder=tmp_path)
    engine.train_step(micro_batches())
    assert engine._pool is not None
    engine.close()  # what LayerStreamingStrategy.teardown does after trainer.validate
    assert engine._pool is None
    engine.train_step(micro_batches())
    assert engine._pool is not None  # the next step loads ahead again
    engine.close()


def test_loads_that_fail_give_their_read_buffers_back(tmp_path):
    """A load that runs out of memory beside the step (on a GPU, the copy's allocation) fails the step, which the
    back-off retries after engine.reset(): every failed load's read buffer comes back, so a third failure in a row
    cannot leave the retry without one to read into (it failed with an IndexError)."""
    from onn.streaming.engine import SLOTS

    engine = engine_for(lora_model("llama", LAYER_SETS["all"]), 2, kind="disk", folder=tmp_path)
    load, failures = engine._load_chunk, [SLOTS + 1]

    def out_of_memory_first(*args, **kwargs):
        if failures[0] > 0:
            failures[0] -= 1
            raise torch.OutOfMemoryError("out of memory (injected)")
        return load(*args, **kwargs)

    engine._load_chunk = out_of_memory_first
    for _ in range(SLOTS + 1):
        with pytest.raises(torch.OutOfMemoryError):
            engine.train_step(micro_batches())
        engine.reset()
    loss = engine.train_step(micro_batches())
    engine.close()
    reference = engine_for(lora_model("llama", LAYER_SETS["all"]), 2, kind="disk", folder=tmp_path / "again")
    assert torch.equal(loss, reference.train_step(micro_batches()))
    reference.close()


def test_a_load_that_fails_lets_what_it_loaded_go_with_its_error(tmp_path):
    """A load ahead that runs out of memory partway (on a GPU: a chunk's first blocks already on the device) fails
    the step; once the step's error is let go, what the load held is freed by reference counts alone, the garbage
    collector off (the future holding the error was kept by the frame its traceback holds: a cycle that kept the
    blocks through the back-off's retry)."""
    import gc

    engine = engine_for(lora_model("llama", LAYER_SETS["all"]), 2, kind="disk", folder=tmp_path)
    load, held = engine._load_chunk, []

    def out_of_memory_partway(c, *args, **kwargs):
        if c == 1 and not held:
            copied = torch.empty(4096)  # the blocks copied before the allocation that failed
            held.append(weakref.ref(copied))
            raise torch.OutOfMemoryError("out of memory (injected)")
        return load(c, *args, **kwargs)

    engine._load_chunk = out_of_memory_partway
    gc.disable()
    try:
        with pytest.raises(torch.OutOfMemoryError):
            engine.train_step(micro_batches())
        engine.reset()
        engine.close()  # the loader threads joined: none still holds its finished work item (and the error)
        assert held and held[0]() is None
    finally:
        gc.enable()
    assert torch.isfinite(engine.train_step(micro_batches()))
    engine.close()


@pytest.mark.parametrize("chunk_size,prefixes", [(1, 4), (2, 2 + 4)], ids=["unfused", "fused-in-pairs"])
def test_a_step_runs_the_prefix_once_per_micro_batch_and_holds_no_hidden_state_for_the_recompute(chunk_size, prefixes):
    """The backward's recompute starts each chunk from its kept input and takes only the rest of the blocks'
    arguments from the prefix: a micro-batch the forward ran alone gives its own (one prefix run, not two: on a GPU
    each is an embedding lookup that reads the ids back and a mask the model reads), and none of them holds a hidden
    state until the step's end (a micro-batch's activations on the device that nothing reads). Micro-batches fused
    in the forward run the prefix again, each alone. The step equals the resident model's either way."""
    resident = lora_model("llama", LAYER_SETS["first4+last4"])
    streamed = copy.deepcopy(resident)
    mbs = micro_batches(4)
    for mb in mbs:
        (resident(**mb).loss / len(mbs)).backward()
    engine = engine_for(streamed, chunk_size)
    engine.forward_group = chunk_size
    runs, prefix = [], engine.prefix
    engine.prefix = lambda batch: runs.append(batch) or prefix(batch)
    engine.forward_train(mbs)
    assert len(runs) == prefixes and all(x.hidden is None for x in engine._pending_backward[0])
    engine.backward_chunks()
    engine.close()
    for name, grad in lora_grads(streamed).items():
        torch.testing.assert_close(grad, dict(resident.named_parameters())[name].grad, rtol=1e-4, atol=1e-6)


def test_fp16_loss_scaling_through_lightning():
    """Lightning's fp16 plugin unscales before every optimizer step: the streamed loss must start its scaler."""
    import lightning as L
    from lightning.pytorch.plugins.precision import MixedPrecision

    from onn.modalities.text.module import CausalLM
    from onn.streaming.strategy import EngineSettings, LayerStreamingStrategy

    model = lora_model("llama", LAYER_SETS["all"])
    optim = compose("optim.lr=1e-3", "optim.schedule=constant", "optim.warmup_steps=0").optim
    module = CausalLM(model, optim, max_steps=2, onn_config={}, micro_batch=2)
    settings = EngineSettings(
        chunk_size=2,
        store="cpu",
        store_dtype="float32",
        edges="resident",
        activations="device",
        prefetch=True,
        cache_blocks=0,
        eval_tokens=10_000,
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    trainer = L.Trainer(
        max_steps=2,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        strategy=LayerStreamingStrategy(settings, "/nonexistent", 2),
        enable_model_summary=False,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
    )
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(micro_batches(m=2, b=4), batch_size=None))
    assert trainer.global_step == 2 and all(math.isfinite(x) for x in module.train_losses)
    assert scaler._scale is not None


def test_a_streamed_validation_keeps_its_batches_on_the_host():
    """The engine evaluates the held-out set at the epoch's end, moving each group itself: its batches stay where
    the loader made them (a copy to the device and back would wait for a GPU at every batch), training's go."""
    import lightning as L

    from onn.modalities.text.datamodule import TextDataModule
    from onn.modalities.text.module import CausalLM
    from onn.models.tokenizer import byte_tokenizer
    from onn.streaming.strategy import EngineSettings, LayerStreamingStrategy

    module = CausalLM(
        lora_model("llama", LAYER_SETS["last4"]),
        compose("optim.lr=1e-3", "optim.schedule=constant", "optim.warmup_steps=0").optim,
        max_steps=2,
        onn_config={},
        micro_batch=2,
    )
    settings = EngineSettings(
        chunk_size=2, store="cpu", store_dtype="float32", edges="resident", activations="device",
        prefetch=False, cache_blocks=0, eval_tokens=10_000,
    )  # fmt: skip
    trainer = L.Trainer(
        max_steps=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        strategy=LayerStreamingStrategy(settings, "/nonexistent", 2),
    )  # fmt: skip
    batches = torch.utils.data.DataLoader(micro_batches(m=2, b=4), batch_size=None)
    trainer.fit(module, train_dataloaders=batches, val_dataloaders=batches)
    assert len(module.val_losses) == 1 and math.isfinite(module.val_losses[0])

    # a device the host cannot read: what the text data's hook keeps on the host while validating, and moves else
    dm = TextDataModule(compose("data=math").data, byte_tokenizer(), 4)
    dm.trainer, batch = trainer, micro_batches(m=1, b=2)[0]
    trainer.validating = True
    kept = dm.transfer_batch_to_device(batch, torch.device("meta"), 0)
    assert all(kept[k] is batch[k] for k in batch)
    trainer.training = True
    assert all(t.is_meta for t in dm.transfer_batch_to_device(batch, torch.device("meta"), 0).values())


def test_validation_loss_matches_resident():
    resident = lora_model("llama", LAYER_SETS["last4"])
    streamed = copy.deepcopy(resident)
    mbs = micro_batches()
    with torch.no_grad():
        want = [resident(**mb).loss for mb in mbs]
    got = engine_for(streamed, 3).loss(mbs)
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-5, atol=1e-6)


def test_mixed_precision_streams_bf16_weights_into_a_float32_model():
    """bf16-mixed on a float32 model: the engine computes from a bf16 store (no decode to float32) under
    autocast, also outside Lightning's (validation's epoch end), as the resident model does under autocast."""
    resident = lora_model("llama", LAYER_SETS["last4"])
    streamed = copy.deepcopy(resident)
    mbs = micro_batches()
    engine = StreamingEngine(
        streamed, discover(streamed), LayerStore("cpu", "bfloat16"), 3, compute_dtype=torch.bfloat16
    )
    engine.offload()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = torch.stack([resident(**mb).loss for mb in mbs])
        (want.sum() / len(mbs)).backward()
    got = torch.stack(engine.loss(mbs))  # no autocast around it
    torch.testing.assert_close(got.float(), want.detach().float(), rtol=2e-2, atol=2e-2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        engine.train_step(mbs)
    for (name, a), b in zip(lora_grads(resident).items(), lora_grads(streamed).values()):
        assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.99, name


def test_float32_adapters_beside_bf16_weights_compute_in_bf16_under_mixed_precision():
    """bf16 weights (a bf16-mixed GPU run's Phi-4) with float32 adapters: the engine autocasts its blocks, as
    Lightning's autocast runs a resident model, in the forward and in the backward's recompute. Its autocast
    used to be off there (the weights were in the compute dtype already), which switched Lightning's off: the
    adapters ran in float32, peft copying each adapted layer's input to float32 first. peft's cast is left to
    autocast while the blocks run, and is back on after, for whatever runs the model otherwise."""
    model = lora_model("llama", LAYER_SETS["first4+last4"])
    for p in model.parameters():
        p.data = p.data if p.requires_grad else p.data.bfloat16()
    engine = StreamingEngine(model, discover(model), LayerStore("cpu", "bfloat16"), 2, compute_dtype=torch.bfloat16)
    engine.offload()
    seen = []
    adapters = [m for name, m in model.named_modules() if name.endswith("lora_A.default")]
    for module in adapters:
        module.register_forward_hook(lambda m, args, out: seen.append((torch.is_grad_enabled(), args[0].dtype)))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as Lightning's bf16-mixed runs training_step
        engine.train_step(micro_batches())
    assert {dtype for grad, dtype in seen if not grad} == {torch.bfloat16}  # the forward
    assert {dtype for grad, dtype in seen if grad} == {torch.bfloat16}  # the backward's recompute
    grads = lora_grads(model)
    assert len(grads) == 8 * 7 * 2 and all(g.abs().sum() > 0 for g in grads.values())
    tuners = [m for m in model.modules() if hasattr(m, "cast_input_dtype_enabled")]
    assert len(tuners) == 8 * 7 and all(m.cast_input_dtype_enabled for m in tuners)


@pytest.mark.parametrize("model_type", ["llama", "phi3"])
def test_greedy_generation_matches_resident_generate(model_type):
    resident = lora_model(model_type, LAYER_SETS["all"]).eval()
    streamed = copy.deepcopy(resident)
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    want = resident.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=8,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
        min_new_tokens=8,
    )[:, ids.shape[1] :]
    engine = engine_for(streamed, 3)
    got = engine.generate(ids, mask, max_new_tokens=8)
    assert torch.equal(got, want)
    assert engine.times.loads == 8 * len(engine.chunks)  # each chunk loaded once per token, for the whole batch


def test_streamed_edges_match_resident_and_never_sit_beside_a_chunk():
    """With stream_edges the embeddings, final norm and head come from the store too."""
    resident = lora_model("llama", LAYER_SETS["first4+last4"])
    streamed = copy.deepcopy(resident)
    mbs = micro_batches()
    losses = [resident(**mb).loss for mb in mbs]
    (sum(losses) / len(mbs)).backward()
    engine = engine_for(streamed, 3, stream_edges=True)
    head = streamed.get_output_embeddings().weight
    sizes = []
    original = engine._run_chunk
    engine._run_chunk = lambda *a: (sizes.append(head.numel()), original(*a))[1]
    loss = engine.train_step(mbs)
    torch.testing.assert_close(loss, torch.stack(losses).mean().detach(), rtol=1e-4, atol=1e-6)
    want, got = lora_grads(resident), lora_grads(streamed)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
    assert set(sizes) == {0} and head.numel() == 0  # the head was never resident with a chunk
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    mask = (ids != 0).long()
    want_ids = resident.eval().generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=5,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
        min_new_tokens=5,
    )[:, 6:]
    assert torch.equal(engine.generate(ids, mask, max_new_tokens=5), want_ids)


def test_a_forward_only_pass_loads_no_chunk_beside_the_streamed_head(tmp_path):
    """With stream_edges the head has the device to itself in validation and in a classifier's forward, as in
    training: the next pass's first chunks are loaded ahead after the suffix, not during it (on a GPU a chunk, the
    head and the logits at once, which the plan's memory does not count)."""
    resident = lora_model("llama", LAYER_SETS["all"])
    engine = engine_for(copy.deepcopy(resident), 2, kind="disk", folder=tmp_path, stream_edges=True)
    beside, suffix = [], engine.suffix
    engine.suffix = lambda *a: (beside.append((engine._resident, len(engine._pending))), suffix(*a))[1]
    mbs = micro_batches()
    total, _ = engine.evaluate(mbs)
    assert 0 in engine._pending  # the next pass's first chunk, loaded ahead once the suffix is done
    engine.outputs(mbs)
    assert 0 in engine._pending
    engine.close()
    assert len(beside) > len(mbs) and set(beside) == {(None, 0)}
    with torch.no_grad():
        want = sum(float(resident(**mb).loss) * target_tokens(mb) for mb in mbs)
    assert math.isclose(total, want, rel_tol=1e-4)


def test_micro_batches_of_different_lengths_match_resident():
    """The forward fuses runs of same-shaped micro-batches; mixed lengths must not change a number."""
    resident = lora_model("phi3", LAYER_SETS["all"])
    streamed = copy.deepcopy(resident)
    mbs = micro_batches(m=2, t=10) + micro_batches(m=1, t=7, seed=3) + micro_batches(m=2, t=10, seed=4)
    weights = token_weights(mbs)
    assert len(set(weights)) == 2  # the short micro-batch has fewer target tokens: it weighs less
    for mb, w in zip(mbs, weights):
        (resident(**mb).loss * w).backward()
    engine = engine_for(streamed, 4)
    assert [len(g) for g in engine._groups(mbs)] == [2, 1, 2]
    engine.train_step(mbs)
    want, got = lora_grads(resident), lora_grads(streamed)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("dtype,max_error,min_shrink", [("int8", 0.02, 3.5), ("nf4", 0.12, 6.0)])
def test_quantized_store_trains_the_dequantized_model(tmp_path, dtype, max_error, min_shrink):
    """int8 / nf4 stores (bitsandbytes): small files, small error, and a streamed step that equals
    the resident model whose frozen weights are the de-quantized ones."""
    weight = torch.randn(96, 64)
    store = LayerStore("disk", dtype, folder=tmp_path / "unit")
    store.fill({0: {"w": weight, "norm": torch.ones(64)}})
    back = store.decode(store.read(0), torch.device("cpu"), torch.float32)
    assert ((back["w"] - weight).norm() / weight.norm()).item() < max_error
    assert torch.equal(back["norm"], torch.ones(64))  # vectors stay exact
    assert weight.numel() * 4 / store.block_file(0).stat().st_size > min_shrink * 0.8

    resident = lora_model("llama", LAYER_SETS["last4"])
    streamed = copy.deepcopy(resident)
    engine = engine_for(streamed, 2, kind="disk", folder=tmp_path / "model", dtype=dtype)
    for i, block in enumerate(discover(resident).blocks):  # give the resident model the stored weights
        params = {stored_name(n): p for n, p in block.named_parameters()}
        for name, t in store_decoded(engine, i).items():
            params[name].data = t
    mbs = micro_batches()
    for mb in mbs:
        (resident(**mb).loss / len(mbs)).backward()
    engine.train_step(mbs)
    want, got = lora_grads(resident), lora_grads(streamed)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


def test_an_lstm_stack_streams_from_an_int8_store_as_its_dequantized_self(tmp_path):
    """A network's fixed store_dtype is now honoured (the plan took float32 whatever was set). An LSTM's weight
    matrices are no linear's, so an int8 store de-quantizes them whole in the loader instead of leaving their row
    scales to a linear's output (a KeyError on the LSTM's weight): a step's loss and gradients, with a block cached,
    are the de-quantized network's."""
    from onn.models.zoo.recurrent import AudioRNN
    from onn.training.classifier import ClassifierObjective

    torch.manual_seed(0)
    resident = AudioRNN(1, 10, 8, hidden=64, layers=4, dropout=0.0)
    for name, p in resident.named_parameters():
        p.requires_grad_(name.startswith("classifier") or (name.startswith("layers") and "bias" in name))
    streamed = copy.deepcopy(resident)
    store = LayerStore("disk", "int8", folder=tmp_path)
    objective = ClassifierObjective(F.cross_entropy)
    engine = StreamingEngine(streamed, discover(streamed), store, 2, objective=objective, cache_blocks=1)
    engine.offload()
    assert any(n.endswith(".scale") for n in store.read(0))  # the LSTM's weights are stored as codes
    for i, block in enumerate(discover(resident).blocks):
        params = dict(block.named_parameters())
        for name, t in store_decoded(engine, i).items():
            params[name].data = t
    g = torch.Generator().manual_seed(2)
    batches = [{"x": torch.randn(4, 1, 8, 20, generator=g), "y": torch.randint(0, 10, (4,), generator=g)} for _ in "ab"]
    for batch in batches:
        (objective.loss(resident(**objective.inputs(batch)), batch) / len(batches)).backward()
    engine.train_step(batches)
    want, got = lora_grads(resident), lora_grads(streamed)
    assert any(".bias" in n for n in want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
    engine.close()


def store_decoded(engine, i):
    return engine.store.decode(engine.store.read(i), torch.device("cpu"), torch.float32)


def test_store_detects_and_rebuilds_damaged_blocks(tmp_path):
    blocks = {i: {"w": torch.full((4, 4), float(i))} for i in range(3)}
    store = LayerStore("disk", "float32", folder=tmp_path)
    store.fill(blocks)
    assert store.rebuilt == [0, 1, 2]
    store.fill(blocks)
    assert store.rebuilt == []  # complete blocks are reused
    path = store.block_file(1)
    path.write_bytes(path.read_bytes()[:-7])  # partial file
    (tmp_path / "block_00002.done").unlink()  # missing marker
    assert not store.is_complete(1) and not store.is_complete(2)
    store.fill(blocks)
    assert store.rebuilt == [1, 2] and torch.equal(store.read(1)["w"], blocks[1]["w"])
    other = {i: {"w": torch.zeros(2, 4)} for i in range(3)}  # another model's blocks in the same folder
    store.fill(other)
    assert store.rebuilt == [0, 1, 2] and store.read(0)["w"].shape == (2, 4)


def test_a_block_whose_header_is_damaged_is_rebuilt_not_used(tmp_path):
    """A header whose length or tensor table does not fit the file (a bad sector, a stray write: same size, marker
    intact) marks the block incomplete, so it is rebuilt; it never crashes the run or serves wrong bytes."""
    blocks = {i: {"w": torch.full((4, 4), float(i))} for i in range(4)}
    store = LayerStore("disk", "float32", folder=tmp_path)
    store.fill(blocks)

    def damage(index: int, offset: int, data: bytes) -> None:
        with open(store.block_file(index), "r+b") as f:
            f.seek(offset)
            f.write(data)

    damage(0, 0, b"\xff" * 8)  # a length no index fits (it raised OverflowError)
    damage(1, 0, (2**40).to_bytes(8, "little"))  # a length far past the file (a read that size: MemoryError)
    header = store.block_file(2).read_bytes()
    damage(2, header.index(b"[0,64]"), b"[0,96]")  # a tensor past the end of the file, the JSON still whole
    damage(3, 8, b"\x00" * 8)  # not JSON at all
    fresh = LayerStore("disk", "float32", folder=tmp_path)
    assert not any(fresh.is_complete(i, {"w": [4, 4]}) for i in range(4))
    fresh.fill(blocks)
    assert fresh.rebuilt == [0, 1, 2, 3]
    assert all(torch.equal(fresh.read(i)["w"], blocks[i]["w"]) for i in range(4))


GENERATE_FROM_CODES = """
import sys, torch
from pathlib import Path
from test_streaming import LAYER_SETS, lora_model
from onn.models.layers import discover
from onn.streaming.engine import StreamingEngine
from onn.streaming.store import LayerStore
torch.set_num_threads(1)
model = lora_model("llama", LAYER_SETS["last4"], hidden_size=64, intermediate_size=96).eval()
engine = StreamingEngine(model, discover(model), LayerStore("disk", "int8", folder=Path(sys.argv[1])), 2,
                         compute_dtype=torch.bfloat16)
engine.offload()
ids = torch.arange(3, 27).view(4, 6)
print(engine.generate(ids, torch.ones_like(ids), max_new_tokens=2).tolist())
"""


def _tensor_starts(path) -> dict[str, int]:
    """Each tensor's first byte in a safetensors file, read from its header as any reader would."""
    import json
    import struct

    data = path.read_bytes()
    length = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + length])
    return {n: 8 + length + t["data_offsets"][0] for n, t in header.items() if n != "__metadata__"}


@pytest.mark.slow  # 12-32 s in ci137's fast suite, which took 646 s
def test_generating_in_bf16_from_int8_codes_survives_a_header_of_any_length(tmp_path):
    """torch's weight-only int8 matmul (a few rows from an int8 store's codes, on a CPU) segfaults on codes that
    are not 16-byte aligned, and the codes are views of the block file read: this model's header length left its
    MLP's codes 8 bytes off, and generating for four prompts killed the process. Every tensor of a block file now
    starts 64-byte aligned, and any safetensors reader still opens it. In a subprocess: a crash fails the test."""
    import os
    import subprocess
    import sys

    from conftest import ROOT
    from safetensors.torch import load_file

    store = tmp_path / "store"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "tests")}
    proc = subprocess.run(
        [sys.executable, "-c", GENERATE_FROM_CODES, str(store)], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-2000:]}"
    assert len(eval(proc.stdout.strip().splitlines()[-1])) == 4
    files = sorted(store.glob("*.safetensors"))
    assert len(files) == 8
    for path in files:
        assert all(start % 64 == 0 for start in _tensor_starts(path).values()), path.name
        assert any(t.dtype == torch.int8 for t in load_file(path).values())


def test_a_block_of_the_earlier_unaligned_format_is_rebuilt_not_read(tmp_path):
    """Block files of the earlier format aligned a tensor only for its dtype: their markers name no format, so
    the blocks are rebuilt (an int8 matmul reading their codes in place could crash), and a file whose tensors
    are off the store's alignment, whatever its marker says, is rebuilt too."""
    import json
    import struct

    blocks = {i: {"w": torch.randn(3, 5), "b": torch.randn(7)} for i in range(3)}
    store = LayerStore("disk", "float32", folder=tmp_path)
    store.fill(blocks)
    marker = json.loads((tmp_path / "block_00000.done").read_text())
    del marker["format"]  # what the earlier format's marker held
    (tmp_path / "block_00000.done").write_text(json.dumps(marker))
    path = store.block_file(1)  # the earlier layout: the header padded to 8 bytes only, no padding between tensors
    header = {"w": {"dtype": "F32", "shape": [3, 5], "data_offsets": [0, 60]},
              "b": {"dtype": "F32", "shape": [7], "data_offsets": [60, 88]}}  # fmt: skip
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    data = blocks[1]["w"].numpy().tobytes() + blocks[1]["b"].numpy().tobytes()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    marker = json.loads((tmp_path / "block_00001.done").read_text())
    (tmp_path / "block_00001.done").write_text(json.dumps({**marker, "bytes": path.stat().st_size}))
    fresh = LayerStore("disk", "float32", folder=tmp_path)
    fresh.fill(blocks)
    assert fresh.rebuilt == [0, 1]
    for i in range(3):
        got = fresh.read(i)
        assert torch.equal(got["w"], blocks[i]["w"]) and torch.equal(got["b"], blocks[i]["b"])
        assert all(t.data_ptr() % 64 == 0 for t in got.values())


def test_a_file_where_the_store_folder_goes_is_one_sentence(tmp_path):
    """A file in place of a disk store's folder, or of a folder above it (a damaged cache), was a bare
    FileExistsError traceback from the build; it is one sentence naming the path, and nothing is written."""
    from onn.errors import UserError

    blocks = {0: {"w": torch.ones(4, 4)}}
    (tmp_path / "stores").mkdir()
    (tmp_path / "stores" / "float32").write_text("junk")
    with pytest.raises(UserError, match=r"layer store folder .*stores/float32 is a file: remove it, or set paths"):
        LayerStore("disk", "float32", folder=tmp_path / "stores" / "float32").fill(blocks)
    with pytest.raises(UserError, match=r"float32/int8 cannot be made: .*stores/float32 is a file; remove it"):
        LayerStore("disk", "int8", folder=tmp_path / "stores" / "float32" / "int8").fill(blocks)
    assert (tmp_path / "stores" / "float32").read_text() == "junk"


def _two_builds_at_once(build, folder, monkeypatch, caplog) -> dict:
    """`build(store)` in two threads on one disk store folder: the second starts while the first has a block in its
    temporary file, not yet renamed; the first goes on once the second waits for it (or, unheld, has finished).
    The errors each raised, by thread."""
    import logging
    import threading

    from onn.hardware import failpoints

    paused, go, errors = threading.Event(), threading.Event(), {}

    def pause(name: str) -> None:
        if name == "store_write" and threading.current_thread().name == "first" and not paused.is_set():
            paused.set()
            go.wait(60)

    class Waiting(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "waiting" in record.getMessage():
                go.set()

    def run() -> None:
        try:
            build(LayerStore("disk", "float32", folder=folder))
        except Exception as e:  # the assertion names it
            errors[threading.current_thread().name] = e
        finally:
            go.set()

    monkeypatch.setattr(failpoints, "reached", pause)
    caplog.set_level(logging.INFO, logger="onn.streaming.store")
    logger, handler = logging.getLogger("onn.streaming.store"), Waiting()
    logger.addHandler(handler)
    try:
        first = threading.Thread(target=run, name="first")
        first.start()
        assert paused.wait(60)
        second = threading.Thread(target=run, name="second")
        second.start()
        first.join(120)
        second.join(120)
    finally:
        logger.removeHandler(handler)
    return errors


@pytest.mark.parametrize("builder", ["loader", "seeded"])
def test_two_builds_of_one_store_at_once_both_finish_with_its_blocks_whole(tmp_path, monkeypatch, caplog, builder):
    """Two runs of one model (or the ranks of a streamed run) building its disk store together: the second waits
    for the first's lock, then finds every block whole. Unheld, the second deleted the first's temporary file
    mid-write and the first died with advice to move the store elsewhere."""
    from torch import nn

    from onn.streaming.loader import load_into_store
    from onn.streaming.seeded import draw, empty_network

    source = compose("model=llama_tiny").model

    def frozen_network() -> nn.Module:
        network = empty_network(lambda: nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)]), 5)
        return network.requires_grad_(False)

    build = {
        "loader": lambda store: load_into_store(source, torch.float32, None, store),
        "seeded": lambda store: draw(frozen_network(), 5, None, store),
    }[builder]
    errors = _two_builds_at_once(build, tmp_path / "store", monkeypatch, caplog)
    assert errors == {}
    again = LayerStore("disk", "float32", folder=tmp_path / "store")
    build(again)
    assert again.rebuilt == [] and not list((tmp_path / "store").glob("*.tmp"))


def test_a_random_model_has_the_same_weights_resident_and_streamed(tmp_path):
    """model.source=random draws each block from its own seed, in memory as into the layer store, so the resident
    strategies (full, lora) and streamed sparse_lora start from one model: a sweep over strategies compares them."""
    from onn.models.load import load
    from onn.streaming.loader import load_into_store

    for dtype, store_dtype in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
        source = compose("model=llama_tiny").model
        resident, _ = load(source, dtype=dtype)
        store = LayerStore("disk", store_dtype, folder=tmp_path / store_dtype)
        streamed, _ = load_into_store(source, dtype, None, store)
        layer_map = discover(resident)
        for i, block in enumerate(layer_map.blocks):
            stored = store.read(i)
            assert all(torch.equal(stored[stored_name(n)], p) for n, p in block.named_parameters())
        edges = {n: p for n, p in resident.named_parameters() if not n.startswith("model.layers.")}
        assert edges and all(torch.equal(streamed.get_parameter(n), p) for n, p in edges.items())


def test_bad_streaming_inputs(tmp_path, monkeypatch):
    from torch import nn

    from onn.errors import UserError
    from onn.models.layers import resolve_indices

    model = lora_model("llama", LAYER_SETS["last4"])
    for chunk in (0, 9):
        with pytest.raises(UserError, match="chunk_size must be between 1 and the model's 8 blocks"):
            StreamingEngine(model, discover(model), LayerStore("cpu", "float32"), chunk)
    with pytest.raises(UserError, match="block index 8 is out of range; this model has 8 blocks"):
        resolve_indices([0, 8], 8)
    with pytest.raises(UserError, match="no repeated blocks.*strategy=lora"):
        discover(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))
    import shutil
    from collections import namedtuple

    monkeypatch.setattr(shutil, "disk_usage", lambda path: namedtuple("u", "total used free")(10, 10, 1024))
    with pytest.raises(
        UserError,
        match=r"needs 4.0 MB more \(1 blocks as float32\) and 2.0 GB left free for others: 2.0 GB in all, but the disk "
        r"has 1 KB free \(2.0 GB short\); .* or a smaller strategy.streaming.store_dtype \(bfloat16, int8, nf4\)\.$",
    ):
        LayerStore("disk", "float32", folder=tmp_path).fill({0: {"w": torch.zeros(1024, 1024)}})
    with pytest.raises(UserError, match=r"as nf4\) .*set paths.cache \(or ONN_CACHE\) to a disk with room\.$"):
        LayerStore("disk", "nf4", folder=tmp_path).fill({0: {"w": torch.zeros(1024, 1024)}})  # no smaller dtype
    assert not list(tmp_path.glob("*.safetensors"))  # checked before anything was written


def test_plan_refuses_a_budget_below_one_block(tmp_path):

    from onn.errors import UserError
    from onn.hardware.profile import resolve
    from onn.planning.plan import make_plan
    from onn.planning.spec import model_spec

    cfg = compose(
        "model=phi4", "hardware=gtx1650_4gb", "hardware.budget_mb=1000", "strategy=sparse_lora", root=tmp_path
    )
    hw = resolve(cfg.hardware, tmp_path, tmp_path)
    with pytest.raises(
        UserError,
        match=r"cannot hold one streamed block .* the smallest budget that works is about [\d,]+ MB",
    ):
        make_plan(cfg, hw, model_spec(cfg.model, 8))


def test_a_model_loads_block_by_block_into_the_store(tmp_path, monkeypatch):
    """Larger-than-memory path: blocks go from the checkpoint files to the store one at a time, the
    model keeps empty placeholders, and streaming it computes what the fully loaded model computes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from onn.streaming.loader import load_into_store

    torch.manual_seed(0)
    arch = {**ARCH["llama"], "vocab_size": 259}  # llama_tiny's byte tokenizer gives ids up to 258
    full = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **arch))
    full.save_pretrained(tmp_path / "hf")
    store = LayerStore("disk", "float32", folder=tmp_path / "store")
    built, in_memory = [], []  # blocks holding real weights whenever one is written: one at a time
    from_config = AutoModelForCausalLM.from_config
    monkeypatch.setattr(
        AutoModelForCausalLM, "from_config", lambda *a, **k: built.append(from_config(*a, **k)) or built[-1]
    )
    write = store.write

    def counting_write(i, tensors):
        real = [any(not p.is_meta and p.numel() for p in b.parameters()) for b in discover(built[0]).blocks]
        in_memory.append(sum(real))
        write(i, tensors)

    monkeypatch.setattr(store, "write", counting_write)
    source = compose("model=llama_tiny", f"model.source={tmp_path / 'hf'}", "model.architecture=null").model
    model, _ = load_into_store(source, torch.float32, None, store)
    assert store.rebuilt == list(range(8)) and in_memory == [1] * 8
    assert all(p.numel() == 0 for p in discover(model).blocks[3].parameters())  # nothing of a block in memory
    engine = StreamingEngine(model, discover(model), store, 3)
    engine.offload()  # the blocks are in the store already: nothing is rewritten
    assert store.rebuilt == []
    mbs = micro_batches()
    with torch.no_grad():
        want = [full(**mb).loss for mb in mbs]
    torch.testing.assert_close(torch.stack(engine.loss(mbs)), torch.stack(want), rtol=1e-5, atol=1e-6)
    again = LayerStore("disk", "float32", folder=tmp_path / "store")
    load_into_store(source, torch.float32, None, again)
    assert again.rebuilt == []  # a complete store is reused without reading the checkpoint's blocks


def test_generating_from_codes_reads_past_cached_blocks(tmp_path):
    """From an int8 store's codes a cached block needs no slot: installing an uncached chunk starts the read
    of the next uncached one at once, passing over the cached ones between (when the cached blocks took the
    second slot, the disk waited for every uncached block's compute)."""
    model = lora_model("llama", LAYER_SETS["last4"], hidden_size=64, intermediate_size=128).eval()
    store = LayerStore("disk", "int8", folder=tmp_path / "store")
    engine = StreamingEngine(model, discover(model), store, 1, compute_dtype=torch.bfloat16, cache_blocks=2)
    engine.offload()
    ids = torch.tensor([[5, 6, 7, 8]])
    engine.generate(ids, torch.ones_like(ids), max_new_tokens=2)  # the cached blocks are now in memory
    n = len(engine.chunks)
    uncached = [c for c in range(n) if not all(i in engine.cache_blocks for i in engine.chunks[c])]
    first, following = next(
        (a, b) for a, b in zip(uncached, uncached[1:]) if b > a + 1
    )  # an uncached chunk, cached ones, then an uncached one
    engine._use_codes(True)
    engine._drain()
    engine.release()
    engine._install(first, range(first + 1, n))
    assert following in engine._pending
    assert not any(c in engine._pending for c in range(first + 1, following))
    engine.close()


def test_int8_codes_decode_tokens_as_the_dequantized_model_does(tmp_path, monkeypatch):
    """Generating from an int8 store in bf16, each frozen linear computes from the stored codes: a few rows
    through torch's weight-only int8 matmul, a long prefill through a cast of one weight at a time, and no
    decoded block is held. The logits are the de-quantized model's; a training step after it casts whole
    chunks again (its gradients need the weights)."""
    from onn.streaming.schedule import CODES_MAX_ROWS

    resident = lora_model("llama", LAYER_SETS["last4"], hidden_size=64, intermediate_size=128).eval()  # weights of
    streamed = copy.deepcopy(resident)  # 4,096 values and more are quantized; smaller ones stay float
    store = LayerStore("disk", "int8", folder=tmp_path / "store")
    engine = StreamingEngine(streamed, discover(streamed), store, 2, compute_dtype=torch.bfloat16)
    engine.offload()
    for i, block in enumerate(discover(resident).blocks):
        params = {stored_name(n): p for n, p in block.named_parameters()}
        for name, t in store_decoded(engine, i).items():
            params[name].data = t
    calls = []
    kernel = torch._weight_int8pack_mm
    monkeypatch.setattr(torch, "_weight_int8pack_mm", lambda *a: (calls.append(a[1].dtype), kernel(*a))[1])
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    mask = (ids != 0).long()
    got = engine.generate(ids, mask, max_new_tokens=3)
    assert calls and set(calls) == {torch.int8}
    tokens = CODES_MAX_ROWS // 2 + 4  # two prompts: more rows than the int8 matmul takes
    prompt = torch.cat([torch.randint(3, 90, (2, tokens - ids.shape[1] - 3)), ids], 1)
    full_ids = torch.cat([prompt, got], 1)
    full_mask = torch.cat([(prompt != 0).long(), torch.ones_like(got)], 1)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = resident(input_ids=full_ids, attention_mask=full_mask).logits.float()
    from transformers import DynamicCache

    cache = DynamicCache(config=streamed.config)
    positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
    before = len(calls)
    first = engine.decode_step(full_ids[:, :-1], full_mask[:, :-1], positions[:, :-1], cache)  # the prefill
    assert len(calls) == before and not any(slot.decoded for slot in engine._slots)
    assert (first - want[:, -2]).abs().max() < 0.08 * want[:, -2].abs().max()  # bf16 through 20 positions
    last = engine.decode_step(full_ids[:, -1:], full_mask, positions[:, -1:], cache)  # one token: the codes
    assert len(calls) > before
    assert (last - want[:, -1]).abs().max() < 0.05 * want[:, -1].abs().max()
    after = len(calls)
    loss = engine.train_step(micro_batches(m=1))  # training casts the codes again
    assert torch.isfinite(loss) and len(calls) == after


def test_the_fused_cast_compiles_one_graph_whatever_grad_mode_and_autocast_its_caller_runs_under(monkeypatch):
    """torch.compile guards its graphs on grad mode and autocast, and the fused int8 cast is called under each
    of their mixes (the profile, the no-grad forward, the recompute under checkpoint, generation): with the
    cast's layouts, that ran past its limit of 8 graphs, after which every cast fell back to two passes. Here
    the CUDA kernel's compile is stood in for by one that counts its graphs on the CPU."""
    import itertools

    from onn.hardware import cast

    graphs = []

    def count(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    torch._dynamo.reset()
    monkeypatch.setattr(cast, "_compiled", lambda device_type: torch.compile(cast._cast_scaled, backend=count))
    codes = torch.randint(-127, 128, (64, 32), dtype=torch.int8)
    scale = torch.rand(64).bfloat16()
    out = torch.empty(64, 32, dtype=torch.bfloat16)
    try:
        for grad, autocast in itertools.product((True, False), (True, False)):
            with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                assert torch.equal(
                    cast.cast_scaled(codes, scale, out), (codes.float() * scale.float()[:, None]).bfloat16()
                )
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 1


def test_the_fused_cast_falls_back_when_it_cannot_build_but_lets_out_of_memory_through(monkeypatch):
    """A kernel that fails to build (no C compiler, say) leaves the cast to PyTorch's copy, the same values; running
    out of device memory is the step's to back off from, and neither turns the fused kernel off nor is hidden."""
    from onn.hardware import cast

    codes = torch.randint(-127, 128, (64, 32), dtype=torch.int8)
    scale = torch.rand(64).bfloat16()
    expected = (codes.float() * scale.float()[:, None]).bfloat16()
    for error, passes in (
        (torch.OutOfMemoryError("out of memory (injected)"), True),
        (RuntimeError("Triton Error [CUDA]: out of memory"), True),  # a compiled kernel's launch on a full GPU
        (RuntimeError("no cc"), False),
    ):

        def kernel(*args, error=error):
            raise error

        def compiled(device_type, kernel=kernel):
            return kernel

        compiled.cache_clear = lambda: None  # what functools.cache gives the real one
        monkeypatch.setattr(cast, "_broken", set())
        monkeypatch.setattr(cast, "_compiled", compiled)
        out = torch.empty(64, 32, dtype=torch.bfloat16)
        if passes:
            with pytest.raises(type(error), match="out of memory"):
                cast.cast_scaled(codes, scale, out)
            assert not cast._broken
        else:
            assert torch.equal(cast.cast_scaled(codes, scale, out), expected) and cast._broken == {"cpu"}


@pytest.mark.parametrize(
    "fused,tied", [(False, False), (True, False), (False, True)], ids=["scaled-product", "scaled-cast", "tied-head"]
)
def test_every_pass_from_int8_codes_matches_the_dequantized_model(monkeypatch, fused, tied):
    """On a GPU the blocks and the streamed head compute from an int8 store's codes in every pass (CastMatmul
    casts a tile of rows at a time, in the forward and again in the backward) and the embedding is looked up
    in host memory: a step's loss and LoRA gradients, the validation loss and the greedy tokens are the
    de-quantized model's, and no decoded weight is ever installed. Run on the CPU with the GPU's choice forced
    and tiles smaller than a weight, so the tiling is exercised; `fused`: the row scales applied in the cast
    (as CUDA's fused kernel does, compiled as there, its graphs counted) rather than to the product, and each
    gated MLP computed in two slices of its intermediate features (strategy.streaming.mlp_tiles), as a GPU's
    plan chooses; `tied`:
    a head that shares the embedding's weight (SmolLM2's, GPT-2's), which computes from the codes as an untied one
    does (it took them as a float weight and failed, its weight named after the embedding)."""
    from onn.hardware import cast
    from onn.streaming import engine as engine_module
    from onn.streaming import quantized

    graphs = []
    if fused:  # CUDA's compile (dynamic shapes, one graph), its graphs counted rather than built for a GPU

        def count(graph, example_inputs):
            graphs.append(graph)
            return graph.forward

        torch._dynamo.reset()
        compiled = torch.compile(cast._cast_scaled, backend=count, dynamic=True, fullgraph=True)
        monkeypatch.setattr(cast, "_compiled", lambda device_type: compiled)
    monkeypatch.setattr(engine_module, "computes_from_codes", lambda store_dtype, *_: store_dtype == "int8")
    monkeypatch.setattr(quantized, "CAST_TILE_VALUES", 40 * 64)  # 64-row tiles: weights of 128 rows take two
    resident = lora_model(
        "llama", LAYER_SETS["first4+last4"], hidden_size=64, intermediate_size=128, tie_word_embeddings=tied
    )
    streamed = copy.deepcopy(resident)
    head = streamed.get_output_embeddings()
    assert (head.weight is streamed.get_input_embeddings().weight) == tied
    engine = StreamingEngine(
        streamed,
        discover(streamed),
        LayerStore("cpu", "int8"),
        2,
        stream_edges=True,
        suffix_rows=1,  # the loss one row at a time, as a large vocabulary needs
        mlp_tiles=2 if fused else 1,
    )
    assert engine.tiled_mlps == (8 if fused else 0)
    engine.offload()
    decoded = {
        **{
            f"{discover(resident).block_paths[i]}.{n}": t
            for i in range(len(engine.map))
            for n, t in store_decoded(engine, i).items()
        },
        **store_decoded(engine, "edges"),
    }
    for name, param in resident.named_parameters():
        if stored_name(name) in decoded:
            param.data = decoded[stored_name(name)]
    kinds = []
    original = engine._run_chunk
    engine._run_chunk = lambda c, *a: (
        kinds.append({p.dtype for p in engine.resident_weights() if p.numel() >= 4096}),
        original(c, *a),
    )[1]
    mbs = micro_batches()
    losses = [resident(**mb).loss for mb in mbs]
    (sum(losses) / len(mbs)).backward()
    loss = engine.train_step(mbs)
    torch.testing.assert_close(loss, torch.stack(losses).mean().detach(), rtol=1e-4, atol=1e-6)
    want, got = lora_grads(resident), lora_grads(streamed)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
    assert kinds and all(k == {torch.int8} for k in kinds)  # quantized weights stay codes on the device
    assert head.forward.__func__ is quantized.linear_forward  # the head computed from its codes, scaled
    total, tokens = engine.evaluate(mbs)
    with torch.no_grad():
        want_total = sum(float(resident(**mb).loss) * target_tokens(mb) for mb in mbs)
    assert math.isclose(total, want_total, rel_tol=1e-4)
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    mask = (ids != 0).long()
    want_ids = resident.eval().generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=5,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
        min_new_tokens=5,
    )[:, 6:]
    assert torch.equal(engine.generate(ids, mask, max_new_tokens=5), want_ids)
    # every pass's casts (the forward, the recompute, the tiled MLP's slices of each weight, evaluation,
    # generation) in a few graphs (3 here): past torch.compile's limit, every cast falls back to two passes
    assert len(graphs) < torch._dynamo.config.recompile_limit if fused else not graphs, len(graphs)
    torch._dynamo.reset()


def bench_plan(tmp_path, *overrides: str):
    """recipe=bench_streaming on llama_tiny, planned for the 16 GB CPU preset: its config and plan."""
    from onn.hardware.profile import resolve
    from onn.planning.plan import make_plan
    from onn.planning.spec import model_spec

    cfg = compose(
        "recipe=bench_streaming", "model=llama_tiny", "hardware=cpu_16gb", f"paths.cache={tmp_path}", *overrides
    )
    hw = resolve(cfg.hardware, tmp_path, tmp_path)
    return cfg, make_plan(cfg, hw, model_spec(cfg.model, cfg.strategy.lora.r), use_tuned=False)


def test_the_streaming_bench_predicts_a_step_with_every_block_trained(tmp_path):
    """strategy.layers=all: the budget figure's prediction plans the plan's resolved blocks (it iterated the string
    `all` and stopped on a TypeError); every block trained takes more than the recipe's last four."""
    from onn.bench.streaming import _predicted_step_mb

    predicted = {}
    for layers in ("all", "[-4,-3,-2,-1]"):
        cfg, plan = bench_plan(tmp_path, f"strategy.layers={layers}")
        predicted[layers], _ = _predicted_step_mb(cfg, plan.sparse_layers, 0.25, 1, 8)
    assert predicted["all"] > predicted["[-4,-3,-2,-1]"] > 0


def test_the_streaming_benchs_load_and_compute_are_the_timed_steps_own(tmp_path):
    """The reuse figures' load and compute seconds are those of the timed steps, not of the untimed warm-up's
    too (an engine's first step reads more than the next ones: nothing is resident yet; the overlap efficiency
    was 1.13 where the warm-up's compute counted against the timed steps' time). Counted in bytes, not seconds."""
    from onn.bench.streaming import _runs, make_bench, micro_batches

    b = make_bench(*bench_plan(tmp_path, "task.reuse_m=[1,16]", "task.repeats=1"))
    disk = b.engine("disk")
    batch = micro_batches(1, b.micro_batch, b.seq, b.vocab)

    reads: list[int] = []  # each call's own bytes from disk: the warm-up's, then the timed ones'

    def step():
        before = disk.times.read_bytes
        disk.train_step(batch)
        disk.model.zero_grad(set_to_none=True)
        reads.append(disk.times.read_bytes - before)

    _runs(step, 2, after_warmup=disk.times.__init__)
    disk.close()
    assert len(reads) == 3 and reads[0] > 0
    assert disk.times.read_bytes == reads[1] + reads[2]  # the counters hold the timed calls' reads, no warm-up's
