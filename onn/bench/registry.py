"""The benchmark tasks app runs, by name (TASKS): speed and memory, with the planner's predictions.

task=bench             onn/bench/suite.py      a short training protocol against the plan (language models)
task=tune              onn/bench/tune.py       timed trials of the settings the planner guesses; cached
task=bench_streaming   onn/bench/streaming.py  layer streaming: chunk reuse, I/O against compute
task=bench_streamed_arch  onn/bench/streamed_arch.py  a DiT and an LSTM stack streamed under a budget, against
                                               the plan
task=bench_vision      onn/bench/vision.py     the image runner against a plain loop and a standard pipeline
task=bench_media       onn/bench/media.py      audio/video decoding throughput; the cached store against per-file
                                               loading
task=bench_shard_plan  onn/export/shards.py    the .omny shard planner on a synthetic model
task=bench_giant       onn/bench/giant.py      a model larger than RAM: store build, training, generation
task=bench_serve       onn/bench/serve.py      task=serve under load: batching speedup, latencies, errors
task=bench_overhead    onn/bench/overhead.py   the language-model runner's step against a plain PyTorch loop
task=bench_omny        onn/bench/omny.py       SAM2, Grounded SAM2 and TrOCR as .omny pipelines at their real sizes
task=bench_chaos       onn/bench/chaos.py      runs killed with SIGKILL at random moments, resumed, compared bitwise
task=bench_gpu         onn/bench/gpu.py        the headline on a GPU: Phi-4 under a 4 GB budget, generation,
                                               accelerate, the runner's overhead
"""

from __future__ import annotations

import math
from typing import Any

from onn.bench import suite
from onn.config import ONNConfig
from onn.errors import UserError
from onn.modalities.base import Job
from onn.tasks.registry import Task

TEXT = frozenset({"text"})


def _bench(job: Job) -> dict[str, Any]:
    return suite.run(job)


def _tune(job: Job) -> dict[str, Any]:
    from onn.bench import tune

    return tune.run(job)


def _check_tune(config: ONNConfig) -> None:
    from onn.bench import tune

    tune.check_settings(config)


def _bench_streaming(job: Job) -> dict[str, Any]:
    from onn.bench import streaming

    return streaming.run(job)


def _check_streaming(config: ONNConfig) -> None:
    from onn.bench import streaming

    streaming.check_settings(config)


def _bench_streamed_arch(job: Job) -> dict[str, Any]:
    from onn.bench import streamed_arch

    return streamed_arch.run(job)


def _check_streamed_arch(config: ONNConfig) -> None:
    from onn.bench import streamed_arch

    streamed_arch.check_settings(config)


def _bench_giant(job: Job) -> dict[str, Any]:
    from onn.bench import giant

    return giant.run(job)


def _check_giant(config: ONNConfig) -> None:
    from onn.bench import giant

    giant.check_settings(config)


def _bench_vision(job: Job) -> dict[str, Any]:
    from onn.bench import vision

    return vision.run(job)


def _bench_media(job: Job) -> dict[str, Any]:
    from onn.bench import media

    return media.run(job)


def _bench_serve(job: Job) -> dict[str, Any]:
    from onn.bench import serve

    return serve.run(job)


def _check_serve(config: ONNConfig) -> None:
    from onn.bench import serve

    serve.check_settings(config)


def _bench_overhead(job: Job) -> dict[str, Any]:
    from onn.bench import overhead

    return overhead.run(job)


def _check_overhead(config: ONNConfig) -> None:
    from onn.bench import overhead

    overhead.check_settings(config)


def _bench_gpu(job: Job) -> dict[str, Any]:
    from onn.bench import gpu

    return gpu.run(job)


def _check_gpu(config: ONNConfig) -> None:
    from onn.bench import gpu

    gpu.check_settings(config)


def _bench_omny(job: Job) -> dict[str, Any]:
    from onn.bench import omny

    return omny.run(job)


def _check_omny(config: ONNConfig) -> None:
    from onn.bench import omny

    omny.check_settings(config)


def _bench_chaos(job: Job) -> dict[str, Any]:
    from onn.bench import chaos

    return chaos.run(job)


def _bench_shard_plan(job: Job) -> dict[str, Any]:
    from onn.export.shards import bench

    return bench(job.config)


def _check_shard_plan(config: ONNConfig) -> None:
    """task.* of the shard planner's synthetic model and fleet, in this task's terms: the planner names its own keys
    (export.nodes), and a size it cannot use ends in its traceback (a negative block, a node of 0 MB)."""
    t = config.task
    if t.blocks < 3:
        raise UserError(
            f"task.blocks={t.blocks}: the synthetic model is an embedding, blocks and a head; give 3 or more."
        )
    for key in ("block_mb", "embed_mb", "head_mb", "activation_mb", "head_activation_mb"):
        if not 0 <= getattr(t, key) < math.inf:
            raise UserError(f"task.{key}={getattr(t, key)}: give a size in MB, 0 or more.")
    if not 0 <= t.jitter < 1:
        raise UserError(
            f"task.jitter={t.jitter}: each block's size varies by up to this share of task.block_mb; give 0 or more, "
            "under 1."
        )
    if not t.nodes_mb or not all(0 < mb < math.inf for mb in t.nodes_mb):
        raise UserError(f"task.nodes_mb={list(t.nodes_mb)}: list each node's memory in MB, each above 0.")
    if len(t.nodes_mb) > t.blocks:
        raise UserError(
            f"task.nodes_mb lists {len(t.nodes_mb)} nodes and task.blocks={t.blocks}: every node holds at least one "
            f"block; list at most {t.blocks} nodes, or give more blocks."
        )
    if not 0 < t.fleet_slack < math.inf:
        raise UserError(
            f"task.fleet_slack={t.fleet_slack}: the fleet holds this many times what the model needs; give a number "
            "above 0."
        )


TASKS: dict[str, Task] = {
    "bench": Task(_bench, check=lambda config: suite.check_settings(config.task), modalities=TEXT),
    "tune": Task(_tune, check=_check_tune, modalities=TEXT),
    "bench_streaming": Task(_bench_streaming, check=_check_streaming, modalities=TEXT),
    "bench_vision": Task(_bench_vision, modalities=frozenset({"image"})),
    "bench_media": Task(_bench_media, modalities=frozenset({"audio", "video"})),
    "bench_streamed_arch": Task(_bench_streamed_arch, check=_check_streamed_arch, model=False),
    "bench_giant": Task(_bench_giant, check=_check_giant, modalities=TEXT),
    "bench_serve": Task(_bench_serve, check=_check_serve, modalities=TEXT),
    "bench_shard_plan": Task(_bench_shard_plan, check=_check_shard_plan, model=False, heavy=False),
    "bench_omny": Task(_bench_omny, check=_check_omny, modalities=TEXT),
    "bench_chaos": Task(_bench_chaos, model=False, heavy=False),
    "bench_overhead": Task(_bench_overhead, check=_check_overhead, modalities=TEXT),
    "bench_gpu": Task(_bench_gpu, check=_check_gpu, modalities=TEXT, gpu=True),
}
