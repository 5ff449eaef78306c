"""Layer streaming, as users reach it: a `-true` precision through the runner, convolutions in an int8 store, and
what a store kept on disk from an earlier run is trusted with."""

from __future__ import annotations

import copy
import json
import math

import torch
import torch.nn.functional as F
from conftest import execute_run, tiny_llama
from torch import nn

from onn.models.layers import discover
from onn.streaming.engine import StreamingEngine
from onn.streaming.store import LayerStore, write_safetensors
from onn.training.classifier import ClassifierObjective

TINY_RUN = (
    "strategy=sparse_lora",
    "data=math",
    "data.max_length=32",
    "trainer.max_steps=1",
    "task.exact_match_samples=0",
    "task.validate_before=false",
)


def test_a_bf16_true_run_streams_its_blocks_in_bf16(tmp_path):
    """Lightning casts the model to bf16 in the strategy's setup; the engine took its compute dtype from the float32
    model before that, decoded the frozen blocks in float32 beside the bf16 head, and the first step died in a
    matmul of mixed dtypes."""
    metrics = execute_run(tmp_path, tmp_path / "cache", *TINY_RUN, "strategy.precision=bf16-true")
    assert metrics["steps"] == 1
    assert math.isfinite(metrics["train/loss_initial"])


def test_a_64_true_run_loads_its_weights_in_float32_and_streams_them_in_float64(tmp_path):
    """64-true: the plan loaded a model.dtype=auto model in float16 (rounded, large values inf) before Lightning cast it
    up to float64, and the engine then decoded the frozen blocks in the model's old dtype."""
    import yaml

    metrics = execute_run(tmp_path, tmp_path / "cache", *TINY_RUN, "strategy.precision=64-true")
    plan = yaml.safe_load((tmp_path / "run" / "plan.yaml").read_text())
    assert plan["weights_dtype"] == "float32" and metrics["steps"] == 1
    assert math.isfinite(metrics["train/loss_initial"])


class ConvBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.conv = nn.Conv1d(width, width, 5, padding=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.conv(x))


class ConvStack(nn.Module):
    """A stack of 1-D convolution blocks (a weight of 3 dimensions and more than 4,096 values each) and a head."""

    def __init__(self, width: int = 32, blocks: int = 4, classes: int = 5):
        super().__init__()
        self.layers = nn.ModuleList(ConvBlock(width) for _ in range(blocks))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return self.head(x.mean(-1))


def test_a_convolution_streams_from_an_int8_store_as_its_dequantized_self(tmp_path):
    """int8 codes were stored as rows (out, in x kernel): the convolution got a 2-D weight back and refused it."""
    torch.manual_seed(0)
    resident = ConvStack()
    for name, p in resident.named_parameters():
        p.requires_grad_(name.startswith("head") or name.endswith("conv.bias"))
    streamed = copy.deepcopy(resident)
    store = LayerStore("disk", "int8", folder=tmp_path)
    objective = ClassifierObjective(F.cross_entropy)
    engine = StreamingEngine(streamed, discover(streamed), store, 2, objective=objective)
    engine.offload()
    for i, block in enumerate(discover(resident).blocks):  # the resident network holds the de-quantized weights
        block.conv.weight.data = store.decode(store.read(i), torch.device("cpu"), torch.float32)["conv.weight"]
    assert resident.layers[0].conv.weight.shape == (32, 32, 5)
    g = torch.Generator().manual_seed(1)
    batches = [{"x": torch.randn(3, 32, 12, generator=g), "y": torch.randint(0, 5, (3,), generator=g)} for _ in "ab"]
    for batch in batches:
        (objective.loss(resident(**objective.inputs(batch)), batch) / len(batches)).backward()
    engine.train_step(batches)
    engine.close()
    for (name, want), got in zip(resident.named_parameters(), streamed.parameters()):
        if want.requires_grad:
            torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_an_int8_block_holding_a_convolution_as_rows_is_rebuilt_not_used(tmp_path):
    """A store an earlier ONN wrote holds a convolution's codes as rows, its marker the weight's own shape: read as
    it is, every later run failed in the convolution. Its file no longer matches the weight's shape: rebuilt."""
    weight = torch.randn(32, 32, 5)
    store = LayerStore("disk", "int8", folder=tmp_path)
    store.fill({0: {"conv.weight": weight}})
    encoded = store.encode({"conv.weight": weight})
    as_rows = {"conv.weight": encoded["conv.weight"].reshape(32, -1), "conv.weight.scale": torch.ones(32, 1)}
    write_safetensors(store.block_file(0), as_rows)
    marker = tmp_path / "block_00000.done"
    recorded = json.loads(marker.read_text())
    marker.write_text(json.dumps({**recorded, "bytes": store.block_file(0).stat().st_size}))
    store = LayerStore("disk", "int8", folder=tmp_path)
    store.fill({0: {"conv.weight": weight}})
    assert store.rebuilt == [0]
    decoded = store.decode(store.read(0), torch.device("cpu"), torch.float32)["conv.weight"]
    torch.testing.assert_close(decoded, weight, atol=weight.abs().max().item() / 127, rtol=0)


def test_a_disk_store_of_other_values_under_the_same_key_is_rewritten_not_used(tmp_path):
    """The store's folder is keyed by model.source's stat, architecture and dtype: a Python builder's weights drawn
    from the run's seed (or read from a file beside it) change under the same key. A model in memory offloaded into
    a folder holding another model's blocks of the same shapes streamed the other model's weights."""
    batch = {"input_ids": torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))}
    batch["labels"] = batch["input_ids"].clone()
    losses = {}
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = tiny_llama(num_hidden_layers=4)
        torch.manual_seed(seed)
        model.apply(model._init_weights)  # tiny_llama seeds itself: each seed's own weights
        model.requires_grad_(False)
        with torch.no_grad():
            resident = model(**batch).loss
        store = LayerStore("disk", "float32", folder=tmp_path)
        engine = StreamingEngine(model, discover(model), store, 2)
        engine.offload()
        (streamed,) = engine.loss([batch])
        engine.close()
        torch.testing.assert_close(streamed, resident, rtol=1e-5, atol=1e-6)
        assert store.rebuilt == [0, 1, 2, 3]  # the second model's blocks are written over the first's
        losses[seed] = resident
    assert not torch.allclose(losses[0], losses[1])  # two models, not one
    again = tiny_llama(num_hidden_layers=4)
    torch.manual_seed(1)
    again.apply(again._init_weights)
    again.requires_grad_(False)
    store = LayerStore("disk", "float32", folder=tmp_path)
    StreamingEngine(again, discover(again), store, 2).offload()
    assert store.rebuilt == []  # the same values: the files are reused
