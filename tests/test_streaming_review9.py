"""Review of the layer-streaming engine and its Lightning strategy: a streamed step through Lightning's own loop
updates every weight that trains as the resident step does."""

from __future__ import annotations

import copy
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from test_streaming import ARCH
from torch import nn

from onn.models.layers import discover
from onn.streaming.engine import StreamingEngine
from onn.streaming.store import LayerStore
from onn.streaming.strategy import EngineSettings, LayerStreamingStrategy
from onn.training.classifier import ClassifierObjective

TOLERANCE = 1e-5


class Stack(nn.Module):
    """A stem, blocks of linear -> ReLU, a head: the blocks' linears stream, the head (the suffix) trains in full."""

    def __init__(self, width: int = 16, depth: int = 4, classes: int = 5):
        super().__init__()
        self.stem = nn.Linear(8, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class AutomaticStep(L.LightningModule):
    """A training step as ONN's Classifier and DiffusionModule run a streamed one: Lightning's automatic
    optimization, the engine's forward (and the loss's backward to the blocks) in training_step, the blocks'
    backward in the strategy's `backward`."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model, self.store, self.engine = model, None, None

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.engine.forward_train(self.engine.split({"x": x, "y": y}))

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=1.0)


def lora_model() -> nn.Module:
    """A tiny Llama of 8 blocks with LoRA (random A and B, so every adapter has a gradient) on its last four."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", **ARCH["llama"])
    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        layers_to_transform=[4, 5, 6, 7],
        init_lora_weights=False,
    )
    return get_peft_model(AutoModelForCausalLM.from_config(config), lora)


def text_batches(labelled: bool, count: int = 2) -> list[dict[str, torch.Tensor]]:
    """Micro-batches of 2 rows of 10 tokens, the second half of each the answer (`labelled`) or cut away (all -100)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(count):
        ids = torch.randint(3, 97, (2, 10), generator=g)
        labels = ids.clone()
        labels[:, : 5 if labelled else 10] = -100
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
    return out


def settings(chunk_size: int = 2) -> EngineSettings:
    return EngineSettings(
        chunk_size=chunk_size,
        store="cpu",
        store_dtype="float32",
        edges="resident",
        activations="device",
        cache_blocks=0,
        eval_tokens=0,
    )


def test_lightnings_automatic_step_trains_the_head_after_the_streamed_blocks(tmp_path):
    """Lightning's automatic optimization zeroes the gradients after training_step and before the backward: the
    engine's training_step had backpropagated the loss through the head already, so a streamed classifier's head
    (and a DiT's output layers) never trained, only the blocks' weights did. Now one SGD step moves every weight
    that trains by the resident model's gradient."""
    torch.manual_seed(0)
    streamed = Stack()
    for name, p in streamed.named_parameters():
        p.requires_grad_(name.startswith("head") or name == "blocks.1.0.bias")
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 8, generator=g), torch.randint(0, 5, (6,), generator=g)
    resident = copy.deepcopy(streamed)
    F.cross_entropy(resident(x), y).backward()
    want = {n: (p - p.grad).detach() for n, p in resident.named_parameters() if p.requires_grad}
    objective = ClassifierObjective(F.cross_entropy)
    strategy = LayerStreamingStrategy(settings(), Path(tmp_path), micro_batch=4, objective=objective)  # 4 + 2 rows
    trainer = L.Trainer(
        accelerator="cpu",
        strategy=strategy,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=6)
    trainer.fit(AutomaticStep(streamed), loader)
    got = {n: p.detach() for n, p in streamed.named_parameters() if p.requires_grad}
    assert got.keys() == want.keys() == {"head.weight", "head.bias", "blocks.1.0.bias"}
    for name in want:
        assert float((got[name] - want[name]).abs().max()) <= TOLERANCE, name


def test_a_batch_without_target_tokens_leaves_the_adapters_as_the_resident_step_does():
    """A macro-batch whose every answer was cut away has nothing to learn from: the resident step runs no backward
    (CausalLM._forward_backward), so the adapters keep no gradient and AdamW leaves them, its moments and its step
    count as they are. The streamed step backpropagated zeros through every chunk instead, and AdamW then moved every
    adapter by its momentum and weight decay. Now the adapters keep no gradient and stay where the step before left
    them."""
    model = lora_model()
    engine = StreamingEngine(model, discover(model), LayerStore("cpu", "float32"), 3)
    engine.offload()
    adapters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(adapters, lr=1e-2, weight_decay=0.1)
    learning, empty = text_batches(labelled=True), text_batches(labelled=False)
    engine.train_step(learning)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    after_first = [p.detach().clone() for p in adapters]
    loss = engine.train_step(empty)
    engine.close()
    assert float(loss) == 0.0
    assert all(p.grad is None for p in adapters)
    optimizer.step()
    assert all(torch.equal(p, q) for p, q in zip(adapters, after_first))
