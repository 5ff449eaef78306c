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


def engine_reads(tmp_path: Path, chunk: int, layers: list[int], edges: str) -> tuple[Counter, int]:
    """The blocks (with their counts) and edge files the engine reads from a disk store in its second step, the
    first having left what every step leaves. Loads are synchronous (no prefetch), so each read
    falls in the step that makes it; the store's own read is counted, not replaced."""
    engine = engine_for(
        lora_model("llama", layers), chunk, kind="disk", prefetch=False, folder=tmp_path, stream_edges=edges == "stream"
    )
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
    read, edge_reads = engine_reads(tmp_path / "store", chunk, layers, edges)
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
