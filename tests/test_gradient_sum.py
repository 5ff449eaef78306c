"""The streamed DDP strategy's gradient all-reduce (onn/streaming/strategy.py sum_gradients), in one gloo process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import HostReads

from onn.streaming.strategy import sum_gradients


@pytest.fixture
def one_rank(tmp_path: Path):
    """A process group of one rank, as a run on one machine and one device of a DDP launch has."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_gradients_every_rank_used_are_summed_without_reading_anything_back(one_rank):
    """All weights used here: the sum needs no value on the host (the old mask was read back at every step)."""
    weights = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2, 2))]
    for i, w in enumerate(weights):
        w.grad = torch.full_like(w, float(i + 1))
    with HostReads() as reads:
        sum_gradients(weights)
    assert reads.seen == []
    assert torch.equal(weights[0].grad, torch.ones(3)) and torch.equal(weights[1].grad, torch.full((2, 2), 2.0))


def test_a_weight_no_rank_used_keeps_no_gradient(one_rank):
    """A weight without a gradient on every rank stays without one (AdamW then skips it, as in one process); the
    used ones keep theirs."""
    used, unused = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    used.grad = torch.arange(4.0)
    sum_gradients([unused, used])
    assert unused.grad is None
    assert torch.equal(used.grad, torch.arange(4.0))
