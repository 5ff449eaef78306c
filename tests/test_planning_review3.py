"""The planner's step time for classifier networks: the memory traffic it counts, from the network and the optimizer
the run builds, at the profile's measured bandwidth."""

from __future__ import annotations

import dataclasses

import torch
from conftest import compose
from torch import nn

from onn.hardware.profile import resolve
from onn.modalities import get
from onn.planning.spec import network_spec


def _v28_plan(tmp_path, *overrides: str, memory_gb_s: float):
    """recipe=cifar10_v28's plan on a preset CPU whose memory bandwidth is `memory_gb_s` (0: not measured)."""
    cfg = compose(
        "recipe=cifar10_v28", "hardware=cpu_16gb", "data.source=unused", f"paths.cache={tmp_path}", *overrides,
        root=tmp_path,
    )  # fmt: skip
    hw = dataclasses.replace(resolve(cfg.hardware, tmp_path / "cache", tmp_path), memory_gb_s=memory_gb_s)
    return get("image").plan(cfg, hw)


def _traffic_s(tmp_path, *overrides: str) -> float:
    """The seconds the plan's step spends moving memory at 1 GB/s: the step at 1 GB/s less the step without a
    measured bandwidth (no traffic counted)."""
    slow, _ = _v28_plan(tmp_path, *overrides, memory_gb_s=1.0)
    none, _ = _v28_plan(tmp_path, *overrides, memory_gb_s=0.0)
    return slow.predicted_step_s - none.predicted_step_s


def test_the_optimizers_traffic_is_the_one_the_run_builds(tmp_path):
    """Every optimizer was counted at 28 bytes per weight (a fused AdamW's), whatever optim.name said: torch.optim's
    AdamW reads and writes 84 bytes a weight, plain SGD 12. A classifier trained with AdamW now plans a slower step
    than one trained with plain SGD by the difference over every weight."""
    adamw = _traffic_s(tmp_path, "optim.name=adamw", "optim.weight_decay=0.01")
    sgd = _traffic_s(tmp_path, "optim.name=sgd", "optim.momentum=0", "optim.nesterov=false", "optim.weight_decay=0")
    nesterov = _traffic_s(tmp_path)  # the recipe's SGD: Nesterov momentum and weight decay
    _, spec = _v28_plan(tmp_path, memory_gb_s=1.0)
    assert abs((adamw - sgd) - (84 - 12) * spec.params / 1e9) < 2e-4  # predicted_step_s is rounded to 1e-4
    assert abs((nesterov - sgd) - (56 - 12) * spec.params / 1e9) < 2e-4


def test_a_networks_step_counts_what_its_norms_and_activations_read_and_write(tmp_path):
    """The step's memory-bound work was the saved activations written once and read once; its BatchNorms,
    LeakyReLUs and poolings read and write every activation and its gradient several times over (v28's step moves
    1.8x that). The spec counts those ops' bytes on the meta device now, per sample, and the plan's step holds them."""
    plan, spec = _v28_plan(tmp_path, "optim.name=sgd", "optim.momentum=0", "optim.nesterov=false", memory_gb_s=1.0)
    assert spec.sample_step_bytes > 1.5 * 2 * spec.sample_activation_bytes
    assert plan.model["step_bytes_per_sample"] == spec.sample_step_bytes
    traffic = _traffic_s(tmp_path, "optim.name=sgd", "optim.momentum=0", "optim.nesterov=false", "optim.weight_decay=0")
    expected = ((spec.sample_step_bytes + spec.sample_transform_bytes) * plan.micro_batch + 12 * spec.params) / 1e9
    assert abs(traffic - expected) < 2e-4


def _norm_net(channels: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.LazyLinear(10),
    )  # fmt: skip


def test_the_step_bytes_are_per_sample_and_scale_with_the_activations_not_the_weights():
    """The count is a batch of 2 less a batch of 1: it doubles with the activations (an image of twice the pixels),
    and the weights' own tensors (a BatchNorm's gradients, a convolution's weight) do not count per sample."""

    def counted(side: int, channels: int) -> int:
        with torch.device("meta"):
            net, sample = _norm_net(channels), torch.empty(1, 3, side, side)
            net(sample)  # LazyLinear takes its size
        return network_spec(net, sample, "norm_net", pretrained=False).sample_step_bytes

    small, large = counted(16, 8), counted(32, 8)  # 32 x 32 is four times the pixels of 16 x 16
    assert small > 0 and abs(large / small - 4) < 0.05
    assert abs(counted(16, 16) / small - 2) < 0.05  # twice the channels, twice the activations


def test_a_dual_encoders_step_counts_both_towers_traffic(tmp_path):
    """The two-tower spec was tower a's with its sums replaced: tower b's norms and activations were left out."""
    from onn.modalities.pairs.tasks import sides_of

    cfg = compose(
        "data=pairs", "data.modalities=[image,audio]", "model=dual_encoder", "hardware=cpu_16gb", root=tmp_path
    )
    _, spec = get("pairs").plan(cfg, resolve(cfg.hardware, tmp_path / "cache", tmp_path))
    towers = []
    for name, side in sides_of(cfg).items():
        with torch.device("meta"):
            tower = side.encoder(cfg.model.feature_dim)
        towers.append(network_spec(tower.network, tower.prepare(side.sample(1), train=False).to("meta"), name, False))
    assert all(t.sample_step_bytes > 0 for t in towers)
    assert spec.sample_step_bytes == sum(t.sample_step_bytes for t in towers)


class TupleOut(nn.Module):
    """A network whose forward returns a tuple (a user's builder, torchvision's Inception in training)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten())
        self.head = nn.Linear(8 * 8 * 8, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.body(x)
        return self.head(features), features


def test_a_network_that_returns_a_tuple_counts_its_backward_and_a_recurrent_one_falls_back(tmp_path):
    """step_bytes ran no backward for an output that is not a tensor, yet kept the forward's count; a recurrent
    network's meta backward stepped through every frame in Python (task=plan of audio_lstm took seconds more)."""
    from onn.planning.spec import OpBytes, step_bytes

    with torch.device("meta"):
        model, sample = TupleOut(), torch.empty(1, 3, 8, 8)
    forward_only = []
    for batch in (1, 2):
        counter = OpBytes()
        with counter.mode, torch.no_grad():
            model.train()(torch.cat([sample] * batch))
        forward_only.append(counter.total)
    assert step_bytes(model, sample) > 1.5 * (forward_only[1] - forward_only[0])  # the backward's reads and writes

    cfg = compose("recipe=fsdd_lstm", "hardware=cpu_16gb", root=tmp_path)
    _, spec = get("audio").plan(cfg, resolve(cfg.hardware, tmp_path / "cache", tmp_path))
    assert spec.recurrent_blocks and spec.sample_step_bytes == 0  # the saved activations stand in
