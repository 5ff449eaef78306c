"""The plans' lowest trainable chunk where no block trains and the chunk does not divide the blocks (review
2026-12-07): the engine counts every chunk (lowest_chunk 3 of 8 blocks in chunks of 3), the plans counted
8 // 3 = 2, and so cached the wrong blocks of a disk store."""

from __future__ import annotations

import pytest
from test_plan_reads import HW, SPEC, N
from test_streaming import lora_model

from onn.models.layers import discover
from onn.planning.streaming import StreamShape, block_bytes, cpu_stream_timing, lowest_chunk, step_loads
from onn.streaming.engine import StreamingEngine
from onn.streaming.store import LayerStore


def test_no_trained_block_puts_the_lowest_chunk_past_the_last(tmp_path):
    """A real engine over 8 frozen blocks in chunks of 3 with 2 cached blocks: the plan's lowest chunk is the
    engine's, and cpu_stream_timing charges the blocks the engine does not cache (it cached 6 and 7, the engine
    2 and 6)."""
    model = lora_model("llama", [0])
    for p in model.parameters():
        p.requires_grad_(False)
    store = LayerStore("disk", "float32", folder=tmp_path)
    engine = StreamingEngine(model, discover(model), store, 3, prefetch=False, cache_blocks=2)
    assert lowest_chunk(N, N, 3) == engine.lowest_chunk == 3

    forward, backward = step_loads(3, engine.lowest_chunk, "resident")
    loads = [i for c in forward + backward for i in engine.chunks[c]]
    files = block_bytes(SPEC, "float32")
    shape = StreamShape(SPEC, HW, "float32", 10, 2, 4, [], 0, 0.0)
    timing = cpu_stream_timing(shape, "float32", "disk", "resident", 3, 2)
    assert timing["disk_bytes"] == pytest.approx(sum(files[i] for i in loads if i not in engine.cache_blocks))
