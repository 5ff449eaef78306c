"""The training loop's pieces at their edges: weight decay left off biases, norms and scalars (as Hugging Face's
Trainer and timm leave it), also once a strategy has sharded the weights, and a classifier's task.monitor that
names a figure it never logs."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import MODALITY_HARDWARE, compose, tiny_llama
from test_vision_train import make_images

from onn.errors import UserError
from onn.models.layers import discover
from onn.training.lora import apply
from onn.training.module import ONNModule
from onn.training.optim import make_optimizer


class NormedLinear(ONNModule):
    """A linear layer, a LayerNorm after it and a CLIP-style learned logit scale (a 0-D weight)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.logit_scale = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(x)) * self.logit_scale


def one_step(module: NormedLinear, optimizer: torch.optim.Optimizer) -> None:
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    optimizer.zero_grad()
    (module(x) - 1).square().mean().backward()
    optimizer.step()


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_weight_decay_leaves_biases_norms_and_scalars_as_training_without_it(name):
    """optim.weight_decay=0.5: one step decayed every trainable weight, the linear's bias, the LayerNorm's scale and
    shift and the logit scale too (pulled towards 0: a norm's scale of 1 shrank, the logit scale's temperature
    grew). Now the step leaves those as torch's optimizer without decay does, and decays the linear's weight."""
    optim = compose(f"optim.name={name}", "optim.lr=0.1", "optim.weight_decay=0.5").optim
    decayed, plain = NormedLinear(), NormedLinear()
    one_step(decayed, make_optimizer(decayed.parameters(), optim))
    if name == "adamw":
        reference = torch.optim.AdamW(plain.parameters(), lr=0.1, betas=tuple(optim.betas), weight_decay=0.0)
    else:
        reference = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=float(optim.momentum), weight_decay=0.0)
    one_step(plain, reference)
    for key in ("linear.bias", "norm.weight", "norm.bias", "logit_scale"):
        assert torch.equal(decayed.state_dict()[key], plain.state_dict()[key]), key
    assert not torch.allclose(decayed.linear.weight, plain.linear.weight)


def test_weight_decay_keeps_to_the_matrices_once_a_strategy_has_flattened_them():
    """FSDP over several GPUs makes each parameter a 1-D view of its shard before configure_optimizers, and
    DeepSpeed's ZeRO-3 an empty one: read from the tensors then, every weight would look like a bias. The shapes
    noted when Lightning sets the module up (ONNModule.setup) still tell the linear's weight from the rest."""
    optim = compose("optim.lr=0.1", "optim.weight_decay=0.5").optim
    module = NormedLinear()
    module.setup("fit")
    with torch.no_grad():
        for param in module.parameters():
            param.data = param.data.reshape(-1)  # what FSDP's sharded views look like (this rank holding all)
    optimizer = make_optimizer(module.parameters(), optim)
    decay = {id(p): group["weight_decay"] for group in optimizer.param_groups for p in group["params"]}
    assert decay[id(module.linear.weight)] == 0.5
    assert [decay[id(p)] for p in (module.linear.bias, module.norm.weight, module.logit_scale)] == [0.0] * 3


def test_weight_decay_trains_a_classifier_through_lightning():
    """The two groups train through Lightning's loop: the loss falls, and the LayerNorm's scale moves only by its
    gradient (a decayed one would also shrink by lr x decay each step)."""
    from onn.training.classifier import Classifier

    optim = compose("optim.lr=0.05", "optim.weight_decay=0.1", "optim.schedule=constant", "optim.warmup_steps=0").optim
    torch.manual_seed(0)
    network = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    module = Classifier(copy.deepcopy(network), ["a", "b", "c"], optim, {}, monitor="train/loss")
    g = torch.Generator().manual_seed(2)
    x = torch.randn(48, 6, generator=g)
    y = x[:, :3].argmax(1)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    trainer = L.Trainer(
        max_steps=6, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=data)
    losses = [float(v) for v in module.train_losses]
    assert losses[-1] < losses[0]
    groups = trainer.optimizers[0].param_groups
    norm_scale = module.model[1].weight
    assert [g["weight_decay"] for g in groups if any(p is norm_scale for p in g["params"])] == [0.0]


def image_run(tmp_path: Path, *overrides: str) -> dict:
    from onn.app import execute

    images = tmp_path / "images"
    make_images(images, train=16, test=4)
    cfg = compose(
        "model=v28_cnn", "data=image", MODALITY_HARDWARE, "tracking=none", "trainer.enable_progress_bar=false",
        f"paths.outputs={tmp_path / 'outputs'}", f"paths.cache={tmp_path / 'cache'}", f"data.source={images}",
        "data.batch_size=4", "data.val_split=0.25", "trainer.max_steps=-1", "trainer.max_epochs=1", *overrides,
    )  # fmt: skip
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    return execute(cfg, run_dir)


def test_a_classifier_monitor_it_never_logs_is_one_sentence_before_training(tmp_path):
    """task.monitor=val/accuracy (the figure is val/acc): the run trained its first epoch, then Lightning's
    checkpoint refused the key with a traceback."""
    with pytest.raises(UserError, match=r"^task.monitor='val/accuracy' is not a figure .* val/acc, val/acc_top5"):
        image_run(tmp_path, "task.monitor=val/accuracy")
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing trained, nothing written


def test_lora_on_a_model_that_already_carries_adapters_is_one_sentence():
    """A model.source holding a peft adapter comes with it loaded onto its base (transformers' load_adapter, as
    here add_adapter): peft warned "a second time", then initialised the adapters afresh over the loaded ones."""
    from peft import LoraConfig

    model = tiny_llama()
    model.add_adapter(LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    with pytest.raises(
        UserError, match=r"^strategy=lora: the model \(LlamaForCausalLM\) already carries peft adapters"
    ):
        apply(model, "lora", compose("strategy=lora").strategy, discover(model), None)


@pytest.mark.parametrize("strategy, layers", [("lora", None), ("sparse_lora", [1])])
def test_a_misspelt_name_among_lora_targets_is_one_sentence(strategy, layers):
    """strategy.lora.target_modules=[q_proj, v_prj]: peft adapted q_proj and passed over v_prj without a word, so
    the run trained half the adapters it was asked for."""

    model = tiny_llama()
    cfg = compose("strategy=lora").strategy
    cfg = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, target_modules=["q_proj", "v_prj"]))
    with pytest.raises(UserError, match=r"^strategy.lora.target_modules=\['q_proj', 'v_prj'\]: v_prj matches no"):
        apply(model, strategy, cfg, discover(model), layers)
    model = tiny_llama()  # the names right: every one adapted, in the layers given
    cfg = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, target_modules=["q_proj", "v_proj"]))
    adapted = apply(model, strategy, cfg, discover(model), layers)
    assert {n.rsplit(".", 1)[-1] for n in adapted.targeted_module_names} == {"q_proj", "v_proj"}


class RoutedBlock(torch.nn.Module):
    """Two projections, and in some blocks a router (a MoE's, in its sparse layers only)."""

    def __init__(self, routed: bool):
        super().__init__()
        self.q_proj, self.v_proj = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.router = torch.nn.Linear(8, 2) if routed else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.v_proj(self.q_proj(x))


class RoutedNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(4, 8)
        self.layers = torch.nn.ModuleList(RoutedBlock(i == 0) for i in range(4))
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return self.head(x)


def test_all_linear_adapts_the_linears_of_the_layers_it_trains_when_block_0_holds_more():
    """all-linear is expanded from block 0's linears; a router there but not in the layer trained was refused as a
    misspelt name the user never wrote."""
    cfg = compose("strategy=sparse_lora").strategy
    cfg = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, target_modules="all-linear"))
    model = RoutedNet()
    adapted = apply(model, "sparse_lora", cfg, discover(model), [2], task_type=None)
    assert {n.rsplit(".", 1)[-1] for n in adapted.targeted_module_names} == {"q_proj", "v_proj"}
