"""The planner's figures for classifier networks, fourth review: a graph network counted on one thread, the
step's norms and activations charged at the rate the profile measures such ops at, and the batches' transform."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import compose

from onn.hardware.profile import OpBytes, norm_gb_s, resolve
from onn.modalities import get
from onn.modalities.graph.tasks import PLAN_DEGREE, PLAN_NODES, OneGraph, plan_graph, planned_inputs
from onn.planning.spec import network_spec, one_sample_norms


def _plan_graph_network(model: str) -> tuple[OneGraph, torch.Tensor]:
    """The graph network task=plan sizes (built for real), on its plan graph, and its node features."""
    m, cfg = get("graph"), compose("data=graph", f"model={model}", "hardware=cpu_16gb")
    inputs = planned_inputs(m, cfg)
    torch.manual_seed(0)
    network = m.network(cfg.model, inputs)
    return OneGraph(network, plan_graph(PLAN_NODES, PLAN_DEGREE)), torch.zeros(PLAN_NODES, *inputs["input_shape"])


def _counted_for_real(model: torch.nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """(saved bytes, step bytes) as the planner counted them before: the network run for real on the CPU."""
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        if not isinstance(t, torch.nn.Parameter) and not isinstance(t._base, torch.nn.Parameter):
            saved += min(t.numel() * t.element_size(), t.untyped_storage().nbytes())  # an expanded view: its storage
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), one_sample_norms(model.train()):
        model(x)
    totals = []
    for batch in (1, 2):
        counter = OpBytes()
        with counter.mode, one_sample_norms(model.train()):
            model(torch.cat([x] * batch)).float().sum().backward()
        model.zero_grad(set_to_none=True)
        totals.append(counter.total)
    return saved, totals[1] - totals[0]


@pytest.mark.parametrize("model", ["gat", "gin"])
def test_a_graph_networks_plan_counts_its_bytes_on_one_thread(model):
    """A graph network is built for real (its forward runs on no meta device), and step_bytes ran its forward and
    backward on the plan's graph on every core: tiny ops whose threads waited on each other on a busy machine, 1.2-2.8
    s of a `model=gat` plan. The count runs on one thread now (0.1 s), the figures those of the run before, and the
    caller's thread count is left as it was."""
    network, x = _plan_graph_network(model)
    threads: list[int] = []
    network.network.blocks[0].register_forward_hook(lambda *_: threads.append(torch.get_num_threads()))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        spec = network_spec(network, x, model, pretrained=False, blocks_path="network.blocks")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert threads and set(threads) == {1}  # the saved bytes' forward and step_bytes' forwards alike
    network.network.blocks[0]._forward_hooks.clear()
    saved, step = _counted_for_real(network, x)
    assert spec.sample_step_bytes > 0
    assert (spec.sample_activation_bytes, spec.sample_step_bytes) == (saved, step)


def _v28_plan(tmp_path, norm: dict[str, float] | None, *overrides: str):
    """v28's plan (SGD, fp32, one thread) on the 16 GB CPU preset at 20 GB/s copy bandwidth, with `norm` as the
    profile's measured norm_gb_s."""
    cfg = compose(
        "model=v28_cnn", "data=cifar10", "data.source=unused", "hardware=cpu_16gb", "optim.name=sgd",
        "strategy.precision=32-true", f"paths.cache={tmp_path}", *overrides, root=tmp_path,
    )  # fmt: skip
    hw = resolve(cfg.hardware, tmp_path / "cache", tmp_path)
    hw = dataclasses.replace(hw, memory_gb_s=20.0, norm_gb_s=norm, cpu_cores=1)
    return get("image").plan(cfg, hw)


def test_the_steps_norms_and_activations_are_charged_at_the_rate_the_profile_measures(tmp_path):
    """Norms, activations and pooling ran 3-4x slower than their bytes at the copy bandwidth (v28 +32%, audio +103%,
    graphs +108% on one thread): the profile now times a BatchNorm, LeakyReLU and max pool forward and backward, in
    the bytes the planner counts, and the step charges the network's counted bytes at that rate; a profile without it
    (a preset) keeps the copy bandwidth."""
    rates = norm_gb_s(2)
    assert set(rates) == {"1", "2"} and all(r > 0 for r in rates.values())
    copy, _ = _v28_plan(tmp_path, None)
    fast, spec = _v28_plan(tmp_path, {"1": 20.0})  # the copy bandwidth's rate: the same step
    slow, _ = _v28_plan(tmp_path, {"1": 4.0})
    counted = (spec.sample_step_bytes + spec.sample_transform_bytes) * slow.micro_batch
    assert abs(fast.predicted_step_s - copy.predicted_step_s) < 2e-4
    assert abs((slow.predicted_step_s - fast.predicted_step_s) - counted * (1 / 4e9 - 1 / 20e9)) < 2e-4


def test_the_image_batches_augmentation_is_in_the_planned_step(tmp_path):
    """The device-side crop, flip and normalisation of every training batch were left out of the step: the spec
    counts their bytes as the network's (v28 on CIFAR: 139 kB a sample), and planning draws no random number."""
    state = torch.get_rng_state()
    plain, _ = _v28_plan(tmp_path, {"1": 1.0}, "data.augment=null")
    augmented, spec = _v28_plan(tmp_path, {"1": 1.0})
    assert torch.equal(state, torch.get_rng_state())
    m = get("image")
    cfg = compose("model=v28_cnn", "data=cifar10", "data.source=unused", "hardware=cpu_16gb")
    inputs = m.planned_inputs(cfg)
    augment = m.transform(cfg, {**inputs, **m.neutral_stats(inputs)})
    counts = []
    for batch in (4, 8):
        counter, images = OpBytes(), torch.zeros(batch, *inputs["input_shape"], dtype=torch.uint8)
        with counter.mode:
            augment(images, train=True)
        counts.append(counter.total)
    assert spec.sample_transform_bytes == (counts[1] - counts[0]) // 4 > 0
    assert augmented.model["transform_bytes_per_sample"] == spec.sample_transform_bytes
    extra = augmented.predicted_step_s - plain.predicted_step_s
    _, plain_spec = _v28_plan(tmp_path, {"1": 1.0}, "data.augment=null")
    moved = (spec.sample_transform_bytes - plain_spec.sample_transform_bytes) * augmented.micro_batch
    assert moved > 0 and abs(extra - moved / 1e9) < 2e-4


class _ScatterRows(torch.nn.Module):
    """A linear layer whose rows are summed into 8 groups by scatter_add, as torch_geometric's aggregation does: the
    index is one number a row broadcast over the features (an expanded view), and autograd saves it for backward."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        index = torch.arange(x.shape[0], device=x.device).remainder(8).view(-1, 1).expand(-1, x.shape[1])
        return x.new_zeros(8, x.shape[1]).scatter_add(0, index, self.linear(x))


def test_a_saved_expanded_view_counts_the_storage_it_holds():
    """The [rows, width] index autograd saves holds one int64 a row, not one a feature: counted at its numel, a
    graph network's plan charged 8 x width bytes an edge where 8 are held (2.6x a 20,000-node graph's measured
    activations)."""
    rows, width = 4096, 64
    spec = network_spec(_ScatterRows(width), torch.zeros(rows, width), "scatter", pretrained=False)
    linear_input, index = rows * width * 4, rows * 8  # what the linear layer and the scatter save
    assert spec.sample_activation_bytes == linear_input + index


class _SparseAdjacency(torch.nn.Module):
    """A graph convolution over a sparse adjacency (torch.sparse.mm): autograd saves the sparse matrix."""

    def __init__(self, nodes: int, width: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width)
        ring = torch.arange(nodes)
        index = torch.stack([ring, (ring + 1) % nodes])
        self.register_buffer("adjacency", torch.sparse_coo_tensor(index, torch.ones(nodes), (nodes, nodes)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sparse.mm(self.adjacency, self.linear(x))


def test_a_saved_sparse_tensor_is_counted_without_a_storage():
    """A sparse tensor has no storage to ask for its bytes: the plan of a network saving one ended in a traceback."""
    spec = network_spec(_SparseAdjacency(64, 16), torch.zeros(64, 16), "sparse", pretrained=False)
    assert spec.sample_activation_bytes >= 64 * 16 * 4  # at least the linear layer's input
