"""The streaming plans count the blocks a steady-state training step reads as the engine reads them (review
2026-12-07): the lowest trainable chunk stays resident but the forward starts at chunk 0, so it is read again
when it is not chunk 0; streamed edges give the last chunk back to the suffix; one chunk with resident edges reads
nothing. The real StreamingEngine runs on a disk store whose reads are counted, beside the plans' figures."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import pytest
from test_streaming import engine_for, lora_model, micro_batches

from onn.hardware.profile import Profile
from onn.planning.costs import MB
from onn.planning.spec import ModelSpec
from onn.planning.streaming import (
    FixedStreaming,
    StreamShape,
    block_bytes,
    cpu_stream_timing,
    network_streaming,
    step_loads,
)

N = 8  # blocks of test_streaming's llama
# The plans' model: 8 blocks of different sizes, so a plan charging the wrong blocks (not only too many) shows.
SPEC = ModelSpec(
    name="uneven",
    params=40_000,
    block_params=[1000 * (i + 1) for i in range(N)],
    prefix_params=3000,
    suffix_params=3100,
    lora_params_per_block=[100] * N,
    linear_params_per_block=[900] * N,
    hidden=32,
    intermediate=48,
    kv_dim=16,
    vocab=97,
    layer_map="llama",
    pretrained=False,
)
# a disk of 1 MB/s: the network plan's predicted_io_s (rounded to 1 ms) is then its read in MB, to 1 kB
HW = Profile(name="test", accelerator="cpu", cpu_cores=2, disk_read_mb_s=1.0, matmul_tflops=0.1)


def engine_reads(tmp_path: Path, model, chunk: int, edges: str) -> tuple[Counter, int]:
    """The blocks (with their counts) and edge files the engine reads from a disk store in its second step, the
    first having left what every step leaves. Loads are synchronous (no prefetch), so each read
    falls in the step that makes it; the store's own read is counted, not replaced."""
    engine = engine_for(model, chunk, kind="disk", prefetch=False, folder=tmp_path, stream_edges=edges == "stream")
    reads: list[int | str] = []
    read = engine.store.read

    def counted(index, into=None):
        reads.append(index)
        return read(index, into=into)

    engine.store.read = counted
    engine.train_step(micro_batches(m=2, seed=1))
    reads.clear()
    engine.train_step(micro_batches(m=2, seed=2))
    engine.close()
    return Counter(i for i in reads if isinstance(i, int)), reads.count("edges")


CASES = [  # chunk, trained blocks, edges: the engine's blocks read per step
    (2, [3, 6], "resident"),  # lowest chunk 1: read again after chunk 0 (12; the CPU plan counted 10)
    pytest.param(2, [0, 6], "stream", marks=pytest.mark.slow),  # chunk 0 kept, the last given back (14; counted 16)
    (8, [0, 6], "resident"),  # one chunk: nothing read (the network plan counted 16)
    pytest.param(4, [5, 6], "resident", marks=pytest.mark.slow),  # lowest chunk 1 is the last: 8 (counted 4)
    pytest.param(4, [0, 6], "stream", marks=pytest.mark.slow),  # chunk 1 forward, then both backward: 12
]


@pytest.mark.parametrize(("chunk", "layers", "edges"), CASES)
def test_plans_count_the_blocks_the_engine_reads(tmp_path, chunk, layers, edges):
    """step_loads gives the engine's loaded blocks; cpu_stream_timing charges exactly their bytes (and the edges'
    two reads when they stream); the network plan's predicted I/O is the time to read the same blocks."""
    read, edge_reads = engine_reads(tmp_path / "store", lora_model("llama", layers), chunk, edges)
    n_chunks, low = -(-N // chunk), min(layers) // chunk
    forward, backward = step_loads(n_chunks, low, edges)
    ranges = [range(c * chunk, min(N, (c + 1) * chunk)) for c in forward + backward]
    assert Counter(i for r in ranges for i in r) == read
    assert edge_reads == (2 if edges == "stream" else 0)

    files = block_bytes(SPEC, "float32")
    shape = StreamShape(SPEC, HW, "float32", 10, 2, 4, layers, 0, 0.0)
    timing = cpu_stream_timing(shape, "float32", "disk", edges, chunk, 0)
    assert timing["disk_bytes"] == pytest.approx(sum(files[i] * k for i, k in read.items()) + edge_reads * shape.edge)

    if edges == "resident":  # a network's edges stay resident
        trained = [100 if i in layers else 0 for i in range(N)]
        network = dataclasses.replace(SPEC, lora_params_per_block=trained)
        frozen = [p - t for p, t in zip(network.block_params, trained)]
        plan, _ = network_streaming(network, HW, 2, 1e12, FixedStreaming(store="disk", chunk_size=chunk), 8)
        read_mb = sum(frozen[i] * 4 * k for i, k in read.items()) / MB
        assert plan.predicted_io_s == pytest.approx(read_mb / HW.disk_read_mb_s, abs=1e-3)


def bloom_model(layers: list[int]):
    """test_streaming's tiny model as BLOOM, whose prefix computes with a weight besides its embedding table (the
    embedding norm): streamed edges take it to the device."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BloomConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(BloomConfig(vocab_size=97, hidden_size=32, n_layer=N, n_head=4))
    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["query_key_value", "dense"],
        layers_to_transform=layers,
        layers_pattern="h",
        init_lora_weights=False,
    )
    return get_peft_model(model, lora).float()


@pytest.mark.slow
def test_a_prefix_with_device_weights_reads_chunk_0_again(tmp_path):
    """BLOOM with streamed edges and chunk 0 trained: the engine gives chunk 0 back before the prefix takes its
    embedding norm to the device, so the forward reads chunk 0 again; the spec records that such a prefix does so
    (ModelSpec.prefix_device_stores), and step_loads and cpu_stream_timing then count it (the plans counted 14
    blocks, the engine read 16)."""
    from onn.models.layers import discover
    from onn.planning.spec import _prefix_device_stores

    model = bloom_model([0, 6])
    stores = _prefix_device_stores(discover(model))
    assert "float32" in stores
    read, edge_reads = engine_reads(tmp_path / "store", model, 2, "stream")
    forward, backward = step_loads(4, 0, "stream", prefix_on_device="float32" in stores)
    assert Counter(i for c in forward + backward for i in range(2 * c, 2 * c + 2)) == read
    assert sum(read.values()) == 16

    spec = dataclasses.replace(SPEC, prefix_device_stores=stores)
    shape = StreamShape(spec, HW, "float32", 10, 2, 4, [0, 6], 0, 0.0)
    timing = cpu_stream_timing(shape, "float32", "disk", "stream", 2, 0)
    files = block_bytes(spec, "float32")
    assert timing["disk_bytes"] == pytest.approx(sum(files[i] * k for i, k in read.items()) + edge_reads * shape.edge)


def test_an_embedding_only_prefix_puts_nothing_on_the_device():
    """LLaMA's prefix is its token table alone, looked up in host memory: only an nf4 store takes it to the device
    (its 32-wide rows straddle nf4's runs of 64), so chunk 0 stays kept otherwise (the cases above)."""
    from onn.models.layers import discover
    from onn.planning.spec import _prefix_device_stores

    assert _prefix_device_stores(discover(lora_model("llama", [0]))) == ["nf4"]
