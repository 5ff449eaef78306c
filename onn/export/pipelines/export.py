"""Export a pipeline: each piece traced, checked against PyTorch in onnxruntime and written as a .omny (or
.onnx) with its cut points, then pipeline.json (document.py) and the tokenizer beside them.

The pieces are independent graphs, and tracing one is single-threaded Python (torch.export spends most of a
piece's minutes in its tracer): on a machine with idle cores they are exported side by side, one forked process
per free core."""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import TYPE_CHECKING, Any

from onn.config.export import OmnyExport, OnnxExport
from onn.errors import UserError
from onn.export.folders import check_replaceable, write_atomically
from onn.export.graph import fold_constants
from onn.export.onnx_export import call_model, weights_files
from onn.export.pipelines import document
from onn.export.pipelines.registry import Piece, Pipeline
from onn.hardware.profile import available_memory_mb, cpu_busy_cores, usable_cores

if TYPE_CHECKING:
    import torch

log = logging.getLogger("onn")


def export_pipeline(
    pipeline: Pipeline,
    models: list,
    folder: Path,
    settings: OnnxExport | OmnyExport,
    limits: dict[str, Any],
    model_name: str,
    tokenizer=None,
    side: int | None = None,
) -> dict[str, Any]:
    """Write every piece of `pipeline` (built from `models`: the model, and SAM2 for Grounded SAM2) and the
    pipeline document into `folder`; return the export/* metrics, per piece under export/pieces. `side`: the
    detector's square image size (export.sample.image_size). The pieces are written into a sibling folder that
    replaces `folder` whole once every piece is done: a failed export leaves an earlier one as it was."""
    started = time.perf_counter()
    _check_replaceable(folder, pipeline.kind, model_name)
    models = [_traceable(m) for m in models]
    pieces = pipeline.pieces(*models, side=side)
    processes = export_processes(pieces)

    def write(staged: Path) -> dict[str, Any]:
        jobs = [(piece, staged, settings, limits, _source(piece, model_name)) for piece in pieces]
        entries, per_piece = [], {}
        for piece, (path, figures, signature) in zip(pieces, _export_all(jobs, processes)):
            entries.append({"name": piece.name, "file": path.name, "when": piece.when, **signature})
            per_piece[piece.name] = {**figures, "file": str(folder / path.name)}  # where it will be
        doc = {
            "format": document.FORMAT,
            "format_version": document.VERSION,
            "kind": pipeline.kind,
            "model": {"name": model_name, "classes": [type(m).__name__ for m in models]},
            "pieces": entries,
            "connections": [{"from": a, "to": b, "via": via} for a, b, via in pipeline.connections],
            "settings": pipeline.settings(*models, side=side),
            "tokenizer": _save_tokenizer(tokenizer, staged),
        }
        document.write(staged, doc)
        return per_piece

    per_piece = write_atomically(folder, "pipeline", write, model_name)
    return {
        "export/pipeline": str(folder / "pipeline.json"),
        "export/pieces": per_piece,
        "export/seconds": round(time.perf_counter() - started, 3),
        "export/cut_points": sum(f.get("cut_points", 0) for f in per_piece.values()),
        "export/processes": processes,
    }


def _check_replaceable(folder: Path, kind: str, model_name: str) -> None:
    """Before anything is traced: a folder of the user's own, another export (a Hugging Face folder, as its
    onn_export.json says) or another pipeline (another kind or model) is not replaced."""
    check_replaceable(folder, "pipeline", model_name)
    path = folder / "pipeline.json"
    if not path.is_file():
        return  # missing or empty, or not an export at all (write_atomically refuses that one)
    try:
        earlier = json.loads(path.read_text())
        held = (earlier["kind"], earlier["model"]["name"])
    except (OSError, ValueError, KeyError, TypeError):
        held = None
    if held != (kind, model_name):
        what = f"a {held[0]} pipeline of {held[1]}" if held else "a pipeline.json this export did not write"
        raise UserError(
            f"export.output: {folder} already holds {what}, not this {kind} pipeline of {model_name}; "
            "choose another export.output or remove that folder."
        )


def _traceable(model: torch.nn.Module) -> torch.nn.Module:
    """The model on the CPU in float32, moved in place (a copy would double what the export holds): the pieces'
    samples and the runtime's feeds are float32 numpy, and onnxruntime's CPU provider, which checks each piece,
    has no bf16 convolution or matmul. A model loaded in bf16 or fp16 (model.dtype), or left on a GPU, was traced
    as it was and failed in onnxruntime's checker."""
    import torch

    held = [*model.parameters(), *model.buffers()]
    if all(t.device.type == "cpu" and (not t.is_floating_point() or t.dtype == torch.float32) for t in held):
        return model
    return model.to("cpu", torch.float32)


# What one more process exporting a piece beside the others must find free. Measured (ru_maxrss above the
# process before it, 2 cores): TrOCR-base's decoder piece, whose module holds 1,274 MB of weights, took 5,662 MB
# (4.4x: the ONNX program saving them, the written graph loaded to be folded and described, onnxruntime's
# session comparing it with PyTorch, the tracer); the tiny pieces took 124-132 MB, the tracer's own.
WEIGHT_COPIES_WHILE_EXPORTING = 5
TRACER_MB = 256


def export_processes(pieces: list[Piece]) -> int:
    """How many pieces to export side by side: one per core other processes leave free now, at most one per
    piece, as many as the free memory holds (read once, here: two exports started together may both count
    it). 1 (this process) where forking cannot be trusted (can_fork)."""
    if len(pieces) < 2 or not can_fork():
        return 1
    free_cores = int(usable_cores() - cpu_busy_cores(0.3) + 0.5)
    largest = max(_weight_bytes(p.module) for p in pieces)
    per_process = WEIGHT_COPIES_WHILE_EXPORTING * largest + TRACER_MB * 2**20
    fits = int(available_memory_mb() * 2**20 // per_process)
    return max(1, min(len(pieces), free_cores, fits))


def can_fork() -> bool:
    """Linux, and CUDA not initialised: a forked child cannot use CUDA, nor fork safely elsewhere."""
    import torch

    return sys.platform == "linux" and not torch.cuda.is_initialized()


def _weight_bytes(module: torch.nn.Module) -> int:
    unique = {id(t): t for t in (*module.parameters(), *module.buffers())}.values()
    return sum(t.numel() * t.element_size() for t in unique)


def _export_all(jobs: list[tuple], processes: int) -> list[tuple]:
    """export_piece(*job) for each job, in order: here one after another, or in `processes` forked processes
    that inherit the jobs (only the figures coming back are pickled), each taking the next piece as it
    finishes one. The pieces of a process that ended without a result (killed: the kernel's out-of-memory
    killer picks the largest process) are exported here afterwards, one after another."""
    if processes == 1 or not can_fork():
        return [export_piece(*job) for job in jobs]
    context = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(processes, mp_context=context, initializer=_in_a_fork, initargs=(jobs,)) as pool:
        futures = [pool.submit(_export_nth, i) for i in range(len(jobs))]
        wait(futures)
    errors = [f.exception() for f in futures]
    failed = next((e for e in errors if e is not None and not isinstance(e, BrokenProcessPool)), None)
    if failed is not None:
        raise failed  # the first piece's own error (a UserError: one sentence)
    lost = [i for i, e in enumerate(errors) if e is not None]
    if lost:
        names = ", ".join(jobs[i][0].name for i in lost)
        log.warning("the processes exporting %s ended without a result (killed?): exporting them here", names)
        for i in lost:  # what the killed process left half-written
            for partial in jobs[i][1].glob(f".{jobs[i][0].name}-*"):
                shutil.rmtree(partial, ignore_errors=True)
    return [export_piece(*jobs[i]) if i in lost else futures[i].result() for i in range(len(jobs))]


_JOBS: list[tuple] = []  # in a forked process: the jobs it inherited


def _in_a_fork(jobs: list[tuple]) -> None:
    """A forked process's start: its jobs, and torch on one thread. GNU OpenMP's thread pool does not survive a
    fork (a child's second thread waits forever), and tracing is single-threaded Python anyway."""
    import torch

    _JOBS[:] = jobs
    torch.set_num_threads(1)


def _export_nth(index: int) -> tuple:
    return export_piece(*_JOBS[index])


def export_piece(
    piece: Piece, folder: Path, settings: OnnxExport | OmnyExport, limits: dict[str, Any], source: dict[str, Any]
) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """One piece as `folder/NAME.omny` (or .onnx): traced, compared with PyTorch, its cut points described."""
    import onnx

    from onn.export import omny
    from onn.export.onnx_export import export_onnx

    started = time.perf_counter()
    suffix = ".omny" if settings.name == "omny" else ".onnx"
    output = folder / f"{piece.name}{suffix}"
    with tempfile.TemporaryDirectory(dir=folder, prefix=f".{piece.name}-") as tmp:
        traced = Path(tmp) / f"{piece.name}.onnx"
        with _checks_off():
            checked = export_onnx(
                piece.module,
                traced,
                piece.sample,
                opset=settings.opset,
                atol=settings.atol,
                axes=piece.axes,
                bounds=piece.bounds,
                follow=piece.follow,
            )
        source = {**source, "parameters": _read_parameters(piece.module, piece.sample)}
        # what computes from weights alone (a tied head's transpose, SAM2's interpolated position table) is folded
        # into weights, as onnxruntime does when it loads the graph: held once, not counted as activations
        graph, _ = fold_constants(onnx.load(str(traced)))
        if "sequence" in piece.bounds:  # per-sample figures at a length the piece takes
            longest = piece.bounds["sequence"][1]
            limits = {**limits, "reference_sequence_length": min(limits.get("reference_sequence_length", 128), longest)}
        doc = omny.describe(
            graph,
            piece.sample,
            limits,
            runs=piece.runs,
            kv_cache_bytes=piece.kv_cache_bytes,
            source=source,
            sequence_axes={"sequence"} & set(piece.bounds),
        )
        if suffix == ".omny":
            omny.write(graph, doc, output)
        else:
            for f in Path(tmp).iterdir():
                os.replace(f, folder / f.name)
    figures = {
        "file": str(output),
        "seconds": round(time.perf_counter() - started, 3),
        "bytes": output.stat().st_size + sum(f.stat().st_size for f in weights_files(output)),
        "cut_points": len(doc["cut_points"]),
        "blocks": len(doc["blocks"]),
        **largest_shards_mb(doc),
        "shard_counts": doc["shard_plans"]["allowed_counts"],
        "max_abs_diff": checked["export/max_abs_diff"],
    }
    signature = {"inputs": _plain(doc["inputs"]), "outputs": _plain(doc["outputs"])}
    return output, figures, signature


def largest_shards_mb(doc: dict[str, Any]) -> dict[str, float | None]:
    """A .omny's largest shard by the weights it stores (what max_shard_size_mb limits), in MB: in its first plan
    (the fewest shards) and in any plan; None where it has no plan. The one definition the export's figures and
    task=bench_omny's report."""
    plans = doc["shard_plans"]["configurations"]
    largest = [max(s["weight_bytes"] for s in p["detail"]) / 2**20 for p in plans]
    return {
        "largest_shard_mb": round(largest[0], 3) if largest else None,
        "largest_shard_mb_any_plan": round(max(largest), 3) if largest else None,
    }


def _plain(signatures: list[dict]) -> list[dict]:
    return [{"name": s["name"], "dtype": s["dtype"], "shape": s["shape"]} for s in signatures]


def _source(piece: Piece, model_name: str) -> dict[str, Any]:
    """The piece's .omny `source`; export_piece counts its parameters once it is traced (_read_parameters)."""
    return {"name": f"{model_name}/{piece.name}", "framework": "pytorch", "class": type(piece.module).__name__}


def _read_parameters(module: torch.nn.Module, sample: dict[str, Any]) -> int:
    """The parameters the piece's forward reads on its sample (shared ones once): a piece wraps the whole model
    (TrOCR's encoder and decoder both hold it) but reads only its own part. Every op that reads a parameter (a
    linear, an embedding, a transpose of a tied head) is a torch function call taking it, which a mode sees; the
    traced graph cannot say, as torch.onnx folds transposed weights into initializers of its own names."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_leaves

    held = {id(p): p for p in module.parameters()}
    read: dict[int, torch.nn.Parameter] = {}

    class Reads(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            read.update((id(t), held[id(t)]) for t in tree_leaves((args, kwargs)) if id(t) in held)
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), _checks_off(), Reads():
        call_model(module, sample)  # as export_onnx calls it
    return sum(p.numel() for p in read.values())


def _save_tokenizer(tokenizer, folder: Path) -> str | None:
    """The tokenizer as tokenizer.json (the `tokenizers` library reads it without transformers), or None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    backend.save(str(folder / "tokenizer.json"))
    return "tokenizer.json"


@contextlib.contextmanager
def _checks_off():
    """transformers' torch_compilable_check asserts shapes with tensors, which the ONNX exporter cannot translate
    (aten._is_all_true); its own switch turns them off while tracing."""
    before = os.environ.get("TRANSFORMERS_DISABLE_TORCH_CHECK")
    os.environ["TRANSFORMERS_DISABLE_TORCH_CHECK"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TRANSFORMERS_DISABLE_TORCH_CHECK", None)
        else:
            os.environ["TRANSFORMERS_DISABLE_TORCH_CHECK"] = before
