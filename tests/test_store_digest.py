"""A layer store block whose bytes were damaged on the disk (same size, header intact) is never used: its marker
records a hash of the bytes written, checked on the block's first read. Before, such a block passed every check
(marker, size, format, header, shapes) and its damaged weights, NaN among them, reached the compute."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from onn.errors import UserError
from onn.streaming.seeded import draw, empty_network
from onn.streaming.store import LayerStore


def _blocks() -> dict[int, dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return {
        i: {"w": torch.randn(64, 64, generator=generator), "b": torch.randn(64, generator=generator)} for i in (0, 1)
    }


def _damage(path: Path) -> None:
    """Bit rot in the tensors' bytes: the file keeps its size and its header."""
    raw = bytearray(path.read_bytes())
    size = len(raw)
    raw[-301] ^= 0x40
    raw[-1001] ^= 0x40
    path.write_bytes(raw)
    assert path.stat().st_size == size


def test_fill_rebuilds_a_block_whose_bytes_were_damaged_and_reads_back_the_source(tmp_path, caplog):
    blocks = _blocks()
    LayerStore("disk", "float32", tmp_path / "store").fill(blocks)
    store = LayerStore("disk", "float32", tmp_path / "store")
    _damage(store.block_file(1))
    assert store.is_complete(1, {"w": [64, 64], "b": [64]})  # the damage is invisible to the cheap checks
    with caplog.at_level(logging.WARNING, logger="onn.streaming.store"):
        store.fill(blocks)
    assert store.rebuilt == [1]
    assert str(store.block_file(1)) in caplog.text
    for i in blocks:
        got = store.read(i)
        assert all(torch.equal(got[k], blocks[i][k]) for k in blocks[i])


def test_an_untouched_store_is_reused_whole(tmp_path):
    blocks = _blocks()
    LayerStore("disk", "float32", tmp_path / "store").fill(blocks)
    store = LayerStore("disk", "float32", tmp_path / "store")
    store.fill(blocks)
    assert store.rebuilt == []
    assert torch.equal(store.read(0)["w"], blocks[0]["w"])


def _frozen_network() -> nn.Module:
    network = empty_network(lambda: nn.Sequential(*[nn.Linear(32, 32) for _ in range(3)]), 5)
    return network.requires_grad_(False)


def test_a_damaged_block_of_a_store_built_block_by_block_is_refused_at_its_first_read(tmp_path):
    """A store written block by block (seeded draws here; the loader writes the same way) holds no source in
    memory to rebuild from: the run stops with one sentence naming the file, before the weights are used."""
    draw(_frozen_network(), 5, None, LayerStore("disk", "float32", tmp_path / "store"))
    store = LayerStore("disk", "float32", tmp_path / "store")
    draw(_frozen_network(), 5, None, store)
    assert store.rebuilt == []
    _damage(store.block_file(2))
    assert store.read(0)["weight"].isfinite().all()
    with pytest.raises(UserError, match=r"block_00002\.safetensors is damaged.*delete it"):
        store.read(2)
    store.block_file(2).unlink()  # as the message says: the next build writes it again, from its seed
    again = LayerStore("disk", "float32", tmp_path / "store")
    draw(_frozen_network(), 5, None, again)
    assert again.rebuilt == [2]
    in_memory = _frozen_network()
    draw(in_memory, 5)  # the same seed without a store: the values the block was written from
    assert torch.equal(again.read(2)["weight"], in_memory[2].weight)


def test_a_marker_written_before_file_digest_is_trusted_not_rebuilt(tmp_path):
    blocks = _blocks()
    LayerStore("disk", "float32", tmp_path / "store").fill(blocks)
    for marker in (tmp_path / "store").glob("*.done"):
        recorded = json.loads(marker.read_text())
        del recorded["file_digest"]
        marker.write_text(json.dumps(recorded))
    store = LayerStore("disk", "float32", tmp_path / "store")
    store.fill(blocks)
    assert store.rebuilt == []
    assert torch.equal(store.read(1)["b"], blocks[1]["b"])
