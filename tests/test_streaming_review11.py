"""Review of the layer-streaming engine and its Lightning strategy: an int8 store computing in float16 keeps the row
scales of small weights, a load ahead that fails for a chunk no pass reads does not crash the run's end, and a
streamed step calls Lightning's backward hooks as a resident one does."""

from __future__ import annotations

import copy
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from test_streaming_review9 import AutomaticStep, Stack, settings
from torch import nn

from onn.hardware import cast
from onn.models.layers import discover
from onn.streaming.engine import StreamingEngine
from onn.streaming.store import LayerStore, dequantize_int8, quantize_int8, scale_dtype
from onn.streaming.strategy import LayerStreamingStrategy
from onn.training.classifier import ClassifierObjective


class Tower(nn.Module):
    """Linear blocks and nothing around them: a streamed output is the last block's, feature by feature."""

    def __init__(self, width: int = 64, depth: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width)) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def small_rows_tower() -> tuple[Tower, Tower]:
    """A float16 tower whose last block has half its rows of weights under 1e-5 (int8 row scales near 5e-8, below
    float16's smallest normal number), and its float32 twin with every block weight de-quantized in float32."""
    torch.manual_seed(0)
    model = Tower()
    with torch.no_grad():
        for block in model.blocks:
            block[0].weight.mul_(0.5)
        model.blocks[1][0].weight[32:] *= 1e-4
    model = model.half().requires_grad_(False)
    reference = copy.deepcopy(model).float()
    for block in reference.blocks:
        codes, scale = quantize_int8(block[0].weight.data)
        block[0].weight.data = codes.float() * scale
    return model, reference


def relative_errors(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per output feature: the largest error over the rows, relative to the feature's largest value."""
    return (got.float() - want).abs().amax(0) / want.abs().amax(0)


def test_float16_from_an_int8_store_keeps_the_scales_of_small_rows(tmp_path):
    """In float16 the row scale of a row of weights under 1e-5 is a subnormal number: cast to float16 it was rounded
    to a multiple of 6e-8, so every weight of the row came back off by the same large fraction (and a row under 4e-6
    came back zero); the block's outputs were 4% off. The loader's de-quantized weights (training, validation) and
    the codes a CPU generates from (torch's int8 matmul for a few rows, the scratch cast for more) now compute what
    the float32 de-quantized weights give, within float16's rounding."""
    model, reference = small_rows_tower()
    engine = StreamingEngine(
        model, discover(model), LayerStore("cpu", "int8"), 1, objective=ClassifierObjective(F.cross_entropy)
    )
    engine.offload()
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference(x)
        (got,) = engine.outputs([{"x": x.half(), "y": torch.zeros(64, dtype=torch.long)}])
    assert float(relative_errors(got, want).max()) < 2e-3
    # generating on a CPU computes from the codes as stored (the engine's own switch, as decode_step makes it)
    engine._use_codes(True)
    engine._install(1)
    assert model.blocks[1][0].weight.dtype == torch.int8
    hidden = reference.blocks[0](x)
    with torch.no_grad():
        for rows in (4, 64):  # torch's int8 matmul, then the scratch cast
            got = model.blocks[1](hidden[:rows].half())
            assert float(relative_errors(got, reference.blocks[1](hidden[:rows])).max()) < 2e-3, rows
    engine.close()


def test_a_failed_load_ahead_for_a_chunk_no_pass_reads_does_not_fail_close(tmp_path):
    """The backward's last chunk starts loading the next step's first one. When the run ends there (the last step,
    an epoch's end) no pass reads it, and close() (the strategy's teardown) re-raised its failure: a finished run
    ended in a traceback. Now close() drops it; a pass that does need the chunk loads it again and meets the error."""
    torch.manual_seed(0)
    model = Tower(width=8, depth=3)
    for name, p in model.named_parameters():
        p.requires_grad_(name == "blocks.2.0.bias")  # the lowest trainable chunk is the last: the backward reuses it
    store = LayerStore("disk", "float32", folder=Path(tmp_path))
    engine = StreamingEngine(model, discover(model), store, 1, objective=ClassifierObjective(F.cross_entropy))
    engine.offload()
    batch = {"x": torch.randn(4, 8), "y": torch.arange(4)}
    engine.forward_train(engine.split(batch))
    store.block_file(0).unlink()  # the next step's first chunk can no longer be read
    engine.backward_chunks()  # ... and its load ahead starts, and fails
    assert model.blocks[2][0].bias.grad is not None
    engine.close()
    with pytest.raises(FileNotFoundError):  # the chunk a pass needs still fails as it did
        engine.forward_train(engine.split(batch))
    engine.close()


class HookedStep(AutomaticStep):
    """AutomaticStep recording, in its own on_after_backward, whether the streamed block's weight has its gradient."""

    def __init__(self, model: nn.Module):
        super().__init__(model)
        self.after_backward: list[bool] = []

    def on_after_backward(self) -> None:
        self.after_backward.append(self.model.blocks[1][0].bias.grad is not None)


class BackwardHooks(L.Callback):
    """What a callback hears around each backward: the loss before it, the streamed block's gradient after it."""

    def __init__(self):
        self.losses: list[float] = []
        self.gradients: list[bool] = []

    def on_before_backward(self, trainer, pl_module, loss: torch.Tensor) -> None:
        self.losses.append(float(loss))

    def on_after_backward(self, trainer, pl_module) -> None:
        self.gradients.append(pl_module.model.blocks[1][0].bias.grad is not None)


def test_a_streamed_step_calls_lightnings_backward_hooks(tmp_path):
    """Lightning's Strategy.backward calls on_before_backward and on_after_backward (every callback's and the
    module's) around the loss's backward; the streaming strategy's backward ran the chunks' backward alone, so a
    callback that reads the gradients there (a gradient-norm logger) never ran for a streamed step. Now each
    optimizer step calls both, the loss before and the streamed blocks' gradients in place after."""
    torch.manual_seed(0)
    model = Stack()
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("head") or name == "blocks.1.0.bias")
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(12, 8, generator=g), torch.randint(0, 5, (12,), generator=g)
    strategy = LayerStreamingStrategy(
        settings(), Path(tmp_path), micro_batch=4, objective=ClassifierObjective(F.cross_entropy)
    )
    hooks, module = BackwardHooks(), HookedStep(model)
    trainer = L.Trainer(
        accelerator="cpu",
        strategy=strategy,
        max_steps=2,
        logger=False,
        callbacks=[hooks],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=6)
    trainer.fit(module, loader)
    assert len(hooks.losses) == 2 and all(loss > 0 for loss in hooks.losses)
    assert hooks.gradients == module.after_backward == [True, True]


def test_the_fallback_cast_multiplies_float32_scales_before_rounding_to_float16():
    """The copy-and-multiply cast (CPUs, GPUs without Triton) cast float32 row scales to float16 first: a row of
    small weights, whose scales the int8 store keeps in float32 for float16 compute, came back coarse or zero."""
    codes = torch.tensor([[127, -64, 3, 100]] * 3, dtype=torch.int8)
    scale = torch.tensor([3e-8, 2e-6, 0.01])  # under float16's smallest subnormal, subnormal, normal
    out = cast.cast_scaled(codes, scale, torch.empty(3, 4, dtype=torch.float16))
    assert torch.allclose(out.float(), (codes.float() * scale[:, None]).half().float(), rtol=0, atol=0)
    assert out[0].abs().sum() > 0


def test_an_all_zero_row_keeps_float16_scales_and_a_row_of_small_weights_does_not():
    """An all-zero row (a padding row of a tied head) has the scale 1e-12 / 127, below float16's smallest normal:
    it put the whole weight on float32 scales, off torch's int8 matmul, though float16 holds its zeros exactly."""
    weight = torch.randn(4, 64) * 0.1
    weight[0] = 0
    codes, scale = quantize_int8(weight)
    assert scale_dtype(scale, torch.float16) == torch.float16
    weight[1] *= 1e-3  # weights near 1e-4: their scale, under 1e-6, is a float16 subnormal
    codes, scale = quantize_int8(weight)
    assert scale_dtype(scale, torch.float16) == torch.float32 and scale_dtype(scale, torch.bfloat16) == torch.bfloat16
    exact = (codes.float() * scale).half()
    assert torch.equal(dequantize_int8(codes, scale, torch.float16), exact)
