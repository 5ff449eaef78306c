"""Seeded weight and graph draws leave torch's global generator as the run's seed= set it, and draw the same values
as the per-block torch.manual_seed they replace (layer stores and checkpoints already written hold those)."""

from __future__ import annotations

import torch
from torch import nn

from onn.models.load import block_seed, edge_seed

SEED = 5


class _Stack(nn.Module):
    """Edges around a run of repeated blocks: an input layer, three blocks, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
        self.head = nn.Linear(8, 2)


class _Undrawable(nn.Module):
    """A weight no module draws again (no reset_parameters): empty_network builds the whole network from the seed."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.rand(4))


def _drawn(seed: int) -> nn.Module:
    from onn.streaming.seeded import draw, empty_network

    network = empty_network(_Stack, seed)
    draw(network, seed, "blocks")
    return network


def test_drawing_a_network_leaves_the_global_generator_as_it_was():
    """The global stream after a draw is the one before it, not whatever the last block's seed left: dropout and
    shuffles then follow seed=, not the number of blocks."""
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    _drawn(SEED)
    assert torch.equal(torch.random.get_rng_state(), before)


def test_drawn_weights_are_those_of_the_per_block_seeds():
    """Each block from block_seed and each edge from edge_seed of its name, through torch's reset_parameters:
    the values stores and checkpoints written before hold."""
    network = _drawn(SEED)
    for name, module in [(f"blocks.{i}", b) for i, b in enumerate(network.blocks)] + [
        ("embed", network.embed),
        ("head", network.head),
    ]:
        expected = nn.Linear(module.in_features, module.out_features)
        index = int(name.split(".")[1]) if name.startswith("blocks.") else None
        torch.manual_seed(block_seed(SEED, index) if index is not None else edge_seed(SEED, name))
        expected.reset_parameters()
        assert torch.equal(module.weight, expected.weight), name
        assert torch.equal(module.bias, expected.bias), name
    assert not torch.equal(network.blocks[0].weight, network.blocks[1].weight)  # each block its own seed


def test_a_network_built_whole_is_the_seeds_and_leaves_the_global_generator():
    """The fallback for a weight torch cannot draw again: the whole build seeded, the global stream untouched."""
    from onn.streaming.seeded import empty_network

    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    whole = empty_network(_Undrawable, 3)
    assert torch.equal(torch.random.get_rng_state(), before)
    torch.manual_seed(3)
    expected = _Undrawable()
    assert all(torch.equal(a, b) for a, b in zip(whole.parameters(), expected.parameters(), strict=True))


def test_communities_leave_the_global_generator_and_keep_their_edges():
    """builtin:communities' stochastic block model is drawn from its seed (the same edges as before) without
    reseeding the run's global generator."""
    from torch_geometric.utils import stochastic_blockmodel_graph

    from onn.config.data import GraphBuiltin
    from onn.modalities.graph.builtin import BETWEEN, INSIDE, communities

    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    graph = communities(GraphBuiltin(nodes=40, communities=2, features=3), seed=7)
    assert torch.equal(torch.random.get_rng_state(), before)
    torch.manual_seed(7)
    probs = torch.full((2, 2), BETWEEN).fill_diagonal_(INSIDE)
    assert torch.equal(graph.edge_index, stochastic_blockmodel_graph([20, 20], probs, directed=False))
