"""Memory measured, not only estimated: each shard of a .omny's first plan (its fewest shards, what a fleet of
small GPUs runs) cut out with onnx's extractor and run alone by onnxruntime in a fresh process; its peak
resident memory above that process's baseline (after the runtime's own context), beside the .omny's estimate
(weights + the largest block's activations, without the GPU headroom)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from onn.errors import UserError
from onn.export.omny.format import sample_feeds

CHILD = r"""
import json, resource, sys
import numpy as np, onnxruntime as ort
feeds = dict(np.load(sys.argv[2], allow_pickle=False))
def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()
options = ort.SessionOptions()
options.log_severity_level = 3
# as the pipelines' runtime (runtime.py): weights held once, each tensor freed after its last reader
options.add_session_config_entry("session.disable_prepacking", "1")
options.enable_mem_reuse = False
options.enable_cpu_mem_arena = False
# the runtime's own context (kernels, thread pools, arena) is paid by a one-node model first: like the GPU
# headroom, it is not the shard's
from onnx import helper, TensorProto
x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
tiny = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x],
                         [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])]), ir_version=8,
                         opset_imports=[helper.make_opsetid("", 17)])
ort.InferenceSession(tiny.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(
    None, {"x": np.ones(1, np.float32)})
before = resident()
session = ort.InferenceSession(sys.argv[1], options, providers=["CPUExecutionProvider"])
try:  # the peak while it runs: the high-water mark restarts here (a file loaded holds a tensor twice for a moment)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
except OSError:
    pass
session.run(None, feeds)
# VmHWM, this process's own high-water mark (ru_maxrss would count the parent's size at fork, on Linux)
with open("/proc/self/status") as f:
    peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
print(json.dumps({"baseline": before, "peak": peak}))
"""


def shard_peaks(path: str | Path, seed: int = 0) -> list[dict[str, Any]]:
    """Per shard of the first plan: blocks, estimate_mb, measured_mb (peak RSS above the baseline), ratio."""
    import onnx
    from onnx.utils import Extractor

    from onn.export.omny.format import read_document
    from onn.export.onnx_export import run_onnx

    doc = read_document(path)  # a missing file, a folder or a file without a .omny document: one sentence
    if not doc["shard_plans"]["configurations"]:
        raise UserError(
            f"{path} has no shard plans (its shard_plans.configurations is empty), so it has no shard to measure; "
            "re-export it with task=export export=omny."
        )
    plan = doc["shard_plans"]["configurations"][0]
    model = onnx.load(str(path))
    headroom = doc["shard_plans"]["headroom_mb"]
    env, extractor, out = reference_feeds(doc, seed), Extractor(model), []
    with tempfile.TemporaryDirectory(prefix="onn-shards-") as tmp:
        for k, shard in enumerate(plan["detail"]):
            part = extractor.extract_model(shard["inputs"], shard["outputs"])
            file, inputs = Path(tmp) / f"shard{k}.onnx", Path(tmp) / f"shard{k}.npz"
            onnx.save_model(part, str(file))  # weights inside: loaded, not memory-mapped (a shard is under 2 GB)
            feeds = {n: env[n] for n in shard["inputs"]}
            np.savez(inputs, **feeds)
            measured = _run_alone(file, inputs)
            env.update(run_onnx(file, feeds))  # the next shard's inputs (saving moved its weights to the file)
            estimate = shard["total_mb"] - headroom
            out.append(
                {
                    "shard": k,
                    "blocks": shard["blocks"],
                    "weights_mb": round(shard["weight_bytes"] / 2**20, 2),
                    "estimate_mb": round(estimate, 2),
                    "measured_mb": round(measured, 2),
                    "measured_over_estimate": round(measured / estimate, 3) if estimate > 0 else None,
                }
            )
    return out


def reference_feeds(doc: dict[str, Any], seed: int = 0) -> dict[str, np.ndarray]:
    """An input at the shapes the .omny's estimates are made at (batch 1, sequence axes at the reference length),
    with values as the exporter's sample has them."""
    return sample_feeds(
        {
            **doc,
            "inputs": [
                {**s, "sample": {**s["sample"], "shape": doc["reference"]["input_shapes"][s["name"]]}}
                for s in doc["inputs"]
            ],
        },
        seed,
    )


def _run_alone(file: Path, inputs: Path) -> float:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**17)}  # glibc hands large freed blocks back at once
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(file), str(inputs)], capture_output=True, text=True, env=env
    )
    if proc.returncode != 0:
        raise UserError(f"onnxruntime could not run shard {file.name} alone: {proc.stderr.strip()[-300:]}")
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    return (figures["peak"] - figures["baseline"]) / 2**20
