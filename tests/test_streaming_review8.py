"""Review of the layer-streaming engine: an int8 store computing in float16 (whose range a weight's unscaled codes
can pass) and BatchNorms before or in the streamed blocks (whose statistics a fused run or a second pass changed)
give what the resident model gives."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from onn.models.layers import discover
from onn.streaming.engine import StreamingEngine
from onn.streaming.quantized import CastMatmul
from onn.streaming.store import LayerStore, quantize_int8, stored_name
from onn.training.classifier import ClassifierObjective

TOLERANCE = 1e-4


def test_int8_codes_times_a_large_input_stay_finite_in_float16():
    """x Qᵀ is x Wᵀ over each row's scale: for a row of weights around 0.02 that is x Wᵀ times about 2,500, past
    float16's 65,504 here, where x Wᵀ is about 50. CastMatmul scales the weight in float16 (forward and backward)."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(128, 64, generator=g) * 0.02
    codes, scale = quantize_int8(weight)
    x = (torch.randn(4, 64, generator=g) * 300).half().requires_grad_(True)
    dequantized = (codes.float() * scale).half()
    want = F.linear(x.float(), dequantized.float())
    assert want.abs().max() < 1000  # the product itself is well inside float16
    out = CastMatmul.apply(x, codes, scale.view(-1).half())
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), want, rtol=2e-3, atol=0.1)
    out.float().sum().backward()
    torch.testing.assert_close(x.grad.float(), dequantized.float().sum(0).expand(4, -1), rtol=2e-3, atol=1e-3)


def float16_llama(norm_weight: float):
    """A tiny Llama in float16 with LoRA on its last four blocks, its attention norms' weights raised so that the
    q/o projections' inputs are large (as LLMs' outlier features are): large enough that their int8 codes' product
    passes float16's range before its scale, while the model's own products stay well inside it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "llama",
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight.fill_(norm_weight)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], layers_to_transform=[2, 3])
    model = get_peft_model(model, lora)
    for name, p in model.named_parameters():  # random adapters, so every one has a gradient
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model.half()


def with_stored_weights(resident, engine) -> None:
    """The resident model's frozen block weights set to the store's, de-quantized whole in float16."""
    for i, block in enumerate(discover(resident).blocks):
        params = {stored_name(n): p for n, p in block.named_parameters()}
        decoded = engine.store.decode(engine.store.read(i), torch.device("cpu"), torch.float16)
        for name, t in decoded.items():
            params[name].data = t


def test_a_float16_model_trains_and_generates_from_an_int8_store_as_its_dequantized_self(tmp_path):
    """A float16 model (a GPU without bf16 runs 16-mixed) streamed from an int8 store: the loader cast the codes and
    the row scales multiplied each linear's output, an output that passed float16's range first (inf, then a NaN
    loss); generating from the codes cast a prompt's weights into the scratch buffer and did the same. Now a step's
    loss and gradients and the greedy tokens are the de-quantized model's."""
    resident = float16_llama(norm_weight=60.0)
    streamed = copy.deepcopy(resident)
    engine = StreamingEngine(streamed, discover(streamed), LayerStore("disk", "int8", folder=tmp_path), 2)
    engine.offload()
    assert any(n.endswith("q_proj.weight.scale") for n in engine.store.read(0))  # stored as int8 codes
    with_stored_weights(resident, engine)
    g = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(3, 97, (4, 12), generator=g)}
    batch["labels"] = batch["input_ids"].clone()
    want = resident(**batch).loss
    assert torch.isfinite(want)
    want.backward()
    loss = engine.train_step([batch])
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss.float(), want.float(), rtol=1e-2, atol=1e-2)
    grads = {n: p.grad for n, p in resident.named_parameters() if p.requires_grad}
    got = {n: p.grad for n, p in streamed.named_parameters() if p.requires_grad}
    assert grads.keys() == got.keys() and grads
    for name in grads:
        assert torch.isfinite(got[name]).all(), name
        torch.testing.assert_close(got[name].float(), grads[name].float(), rtol=0.05, atol=2e-3, msg=name)

    prompts = torch.randint(3, 97, (4, 10), generator=g)  # a prefill of 40 rows: past the int8 matmul's 32
    mask = torch.ones_like(prompts)
    want_tokens = resident.generate(
        input_ids=prompts, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0
    )[:, prompts.shape[1] :]
    tokens = engine.generate(prompts, mask, max_new_tokens=4)
    engine.close()
    assert torch.equal(tokens, want_tokens)


class NormedStack(nn.Module):
    """A stem with a BatchNorm, blocks of linear -> BatchNorm -> ReLU, a head: a network whose batch statistics
    matter before and in its streamed blocks."""

    def __init__(self, features: int = 8, width: int = 16, depth: int = 4, classes: int = 5):
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(features, width), nn.BatchNorm1d(width))
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU()) for _ in range(depth)
        )
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def running_statistics(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.clone() for n, b in model.named_buffers() if n.rsplit(".", 1)[-1].startswith(("running", "num"))}


def resident_and_streamed_step(resident: nn.Module, batches: list[dict], chunk_size: int, folder):
    """One step of `resident` (a forward per micro-batch, as gradient accumulation runs it) and of its copy streamed;
    returns the copy."""
    streamed = copy.deepcopy(resident)
    objective = ClassifierObjective(F.cross_entropy)
    total = sum(objective.weight(b) for b in batches)
    for batch in batches:
        (objective.loss(resident(**objective.inputs(batch)), batch) * objective.weight(batch) / total).backward()
    engine = StreamingEngine(
        streamed, discover(streamed), LayerStore("disk", "float32", folder=folder), chunk_size, objective=objective
    )
    engine.offload()
    engine.train_step(batches)
    engine.close()
    return streamed


def assert_same_step(resident: nn.Module, streamed: nn.Module) -> None:
    want = {n: p.grad for n, p in resident.named_parameters() if p.requires_grad}
    got = {n: p.grad for n, p in streamed.named_parameters() if p.requires_grad}
    assert want.keys() == got.keys() and want
    assert max(float((want[n] - got[n]).abs().max()) for n in want) <= TOLERANCE
    want, got = running_statistics(resident), running_statistics(streamed)
    assert want.keys() == got.keys() and want
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


def test_batch_norms_before_and_in_the_blocks_see_each_micro_batch_once(tmp_path):
    """Two micro-batches of one shape went through the stem and the blocks as one fused run, normalised by the
    run's statistics rather than each micro-batch's; the suffix ran the stem again and the backward each chunk
    again, moving the running statistics two or three times per micro-batch. Now the gradients and the running
    statistics are the resident model's."""
    torch.manual_seed(0)
    resident = NormedStack()
    for name, p in resident.named_parameters():  # the blocks' norms and the head train, the linears stream
        p.requires_grad_(name.startswith("head") or (name.startswith("blocks") and name.split(".")[2] == "1"))
    g = torch.Generator().manual_seed(2)
    batches = [
        {"x": torch.randn(6, 8, generator=g) * 3 + i, "y": torch.randint(0, 5, (6,), generator=g)} for i in (0, 1)
    ]
    streamed = resident_and_streamed_step(resident, batches, 2, tmp_path)
    assert_same_step(resident, streamed)


def test_an_lstm_stack_with_a_batch_normed_front_end_streams_with_the_resident_step(tmp_path):
    """recipe=fsdd_lstm's network: a convolutional front-end with BatchNorms and a BatchNorm over the projected
    frames before the streamed LSTM stack (strategy=sparse_lora)."""
    from onn.models.zoo.recurrent import AudioRNN

    torch.manual_seed(0)
    resident = AudioRNN(1, 10, 8, hidden=16, layers=4, dropout=0.0, batch_norm=True, conv_widths=[4])
    for name, p in resident.named_parameters():
        p.requires_grad_(name.startswith("classifier") or (name.startswith("layers") and "bias" in name))
    g = torch.Generator().manual_seed(2)
    batches = [
        {"x": torch.randn(4, 1, 8, 20, generator=g) + i, "y": torch.randint(0, 10, (4,), generator=g)} for i in (0, 1)
    ]
    streamed = resident_and_streamed_step(resident, batches, 2, tmp_path)
    assert_same_step(resident, streamed)


@pytest.mark.parametrize("chunk_size", [1, 3])
def test_a_stack_whose_chunks_do_not_divide_its_blocks_keeps_its_statistics(tmp_path, chunk_size):
    """Five blocks in chunks of 3 (the last chunk of 2) or 1, micro-batches of unequal size (an epoch's last)."""
    torch.manual_seed(0)
    resident = NormedStack(depth=5)
    for name, p in resident.named_parameters():
        p.requires_grad_(name.startswith("head") or (name.startswith("blocks") and name.split(".")[2] == "1"))
    g = torch.Generator().manual_seed(3)
    batches = [{"x": torch.randn(n, 8, generator=g), "y": torch.randint(0, 5, (n,), generator=g)} for n in (6, 6, 3)]
    streamed = resident_and_streamed_step(resident, batches, chunk_size, tmp_path)
    assert_same_step(resident, streamed)


def test_batch_norms_without_running_statistics_normalise_each_micro_batch_by_its_own(tmp_path):
    """A BatchNorm built with track_running_stats=False normalises by the batch's statistics in training and in
    evaluation alike; it was left out of the check, so two micro-batches of one shape still ran fused and each was
    normalised by both's statistics (a gradient 0.2 off the resident step's)."""
    torch.manual_seed(0)
    resident = NormedStack()
    for m in resident.modules():
        if isinstance(m, nn.BatchNorm1d):
            m.track_running_stats, m.running_mean, m.running_var, m.num_batches_tracked = False, None, None, None
    for name, p in resident.named_parameters():
        p.requires_grad_(name.startswith("head") or (name.startswith("blocks") and name.split(".")[2] == "1"))
    g = torch.Generator().manual_seed(2)
    batches = [
        {"x": torch.randn(6, 8, generator=g) * 3 + i, "y": torch.randint(0, 5, (6,), generator=g)} for i in (0, 1)
    ]
    streamed = resident_and_streamed_step(resident, batches, 2, tmp_path)
    want = {n: p.grad for n, p in resident.named_parameters() if p.requires_grad}
    got = {n: p.grad for n, p in streamed.named_parameters() if p.requires_grad}
    assert want.keys() == got.keys() and want
    assert max(float((want[n] - got[n]).abs().max()) for n in want) <= TOLERANCE
