"""`task=bench_omny` (recipe=bench_omny): a model exported as a pipeline of .omny pieces, at its real size; or a
model exported as one .omny (a decoder LM: llama_small), whose memory check is the point: attention's
[heads, seq, seq] tensors, and what onnxruntime holds beside them, make a decoder block's peak at long sequences.

  export    every piece traced, compared with PyTorch in onnxruntime and written with its cut points: seconds,
            file size, cut points, the largest shard of the first plan (the fewest shards that fit a 1.5 GB GPU);
            the whole export's seconds and how many processes exported the pieces side by side
  validate  every plan's shards run one after another against the whole piece: the largest max abs diff
  memory    each shard of the first plan run alone in a fresh onnxruntime process: peak resident memory above
            the runtime's own context, beside the .omny's estimate (weights + the largest block's activations)
  pipeline  the whole pipeline on a photograph (SAM2, Grounded SAM2) or a page of printed text (OCR), timed
            task.repeats times (the best is reported), its PNG and JSON beside metrics.json (not for one graph)

Figures go to metrics.json as omny/* and to bench_omny.md.
"""

from __future__ import annotations

import gc
import logging
import time
from pathlib import Path
from typing import Any

from onn.config import ONNConfig
from onn.config.task import BenchOmnyTask
from onn.errors import UserError
from onn.export.omny.format import validate
from onn.export.onnx_export import weights_files
from onn.export.pipelines import Request, document, images, run_pipeline
from onn.export.pipelines.export import largest_shards_mb
from onn.export.pipelines.measure import shard_peaks
from onn.export.write import export_for_run
from onn.models.load import load

log = logging.getLogger("onn")


def check_settings(config: ONNConfig) -> None:
    """task.* and export in one sentence before the export's minutes: a pipeline run no times would have no figure."""
    task: BenchOmnyTask = config.task
    if task.repeats < 1:
        raise UserError(f"task.repeats={task.repeats!r}: give a whole number, 1 or more.")
    if config.export.name != "omny":
        raise UserError(
            f"task=bench_omny measures .omny pipelines; set export=omny (it is export={config.export.name})."
        )


def run(job) -> dict[str, Any]:
    config, task = job.config, job.config.task
    check_settings(config)
    model, tokenizer = load(config.model, cache_dir=config.paths.cache)
    exported = export_for_run(config, model, job.run_dir, tokenizer=tokenizer)
    del model
    gc.collect()
    if "export/pipeline" not in exported:
        return _one_graph(Path(exported["export/omny"]), config.model.name, exported, job.run_dir)
    path = Path(exported["export/pipeline"])
    doc = document.read(path)
    metrics: dict[str, Any] = {
        "omny/kind": doc["kind"],
        "omny/pipeline": str(path),
        "omny/export_s": exported["export/seconds"],
        "omny/export_processes": exported["export/processes"],
    }
    for piece in doc["pieces"]:
        metrics.update(_piece(path.parent / piece["file"], piece["name"], exported["export/pieces"][piece["name"]]))
    metrics.update(_pictures(path, doc["kind"], task, job.run_dir))
    (job.run_dir / "bench_omny.md").write_text(_table(doc, metrics))
    return metrics


def _one_graph(file: Path, name: str, exported: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """A model exported as one .omny (a decoder LM): exported, validated and its shards' memory measured, as a
    pipeline's piece is; no pictures to run."""
    from onn.export.omny.format import read_document

    figures = {
        "seconds": exported["export/seconds"],
        "bytes": exported_bytes(file),
        "cut_points": exported["export/cut_points"],
        "shard_counts": exported["export/shard_counts"],
        **largest_shards_mb(read_document(file)),
        "max_abs_diff": exported["export/max_abs_diff"],
    }
    metrics = {"omny/kind": "model", "omny/file": str(file), "omny/export_s": exported["export/seconds"]}
    metrics.update(_piece(file, name, figures))
    doc = {"kind": name, "pieces": [{"name": name}]}
    (run_dir / "bench_omny.md").write_text(_table(doc, metrics))
    return metrics


def exported_bytes(file: Path) -> int:
    """The .omny's size: the graph and the weights files it names, not every file whose name starts as its does (an
    export stopped before its graph was renamed into place leaves its weights beside it, NAME.omny.<hex>.data, and
    a folder may hold NAME.omny.bak)."""
    return file.stat().st_size + sum(f.stat().st_size for f in weights_files(file))


def _piece(file: Path, name: str, exported: dict[str, Any]) -> dict[str, Any]:
    checked = validate(file, echo=log.info)
    peaks = shard_peaks(file)
    key = f"omny/{name}"
    return {
        f"{key}/export_s": exported["seconds"],
        f"{key}/file_mb": round(exported["bytes"] / 2**20, 1),
        f"{key}/cut_points": exported["cut_points"],
        f"{key}/shard_counts": exported["shard_counts"],
        f"{key}/largest_shard_mb": exported["largest_shard_mb"],
        f"{key}/export_max_abs_diff": exported["max_abs_diff"],
        f"{key}/shards_max_abs_diff": checked.max_abs_diff,
        f"{key}/valid": checked.ok,
        f"{key}/shard_estimate_mb": [p["estimate_mb"] for p in peaks],
        f"{key}/shard_measured_mb": [p["measured_mb"] for p in peaks],
        f"{key}/measured_over_estimate": [p["measured_over_estimate"] for p in peaks],
        f"{key}/largest_shard_mb_any_plan": exported["largest_shard_mb_any_plan"],
    }


def _pictures(path: Path, kind: str, task: BenchOmnyTask, run_dir: Path) -> dict[str, Any]:
    """The pipeline on its picture, task.repeats times: seconds per picture (the best) and what it found."""
    from PIL import Image

    picture = Path(task.page) if kind == "trocr" and task.page else Path(task.image) if task.image else None
    if picture is None:
        picture = run_dir / ("page.png" if kind == "trocr" else "photo.jpg")
        (rendered_page() if kind == "trocr" else Image.open(sample_photo())).save(picture)
    # the points are fractions of the picture as the pipeline reads it: upright, as its EXIF orientation says (a
    # phone's photograph is stored sideways, its width and height swapped)
    width, height = images.load_rgb(picture).size
    points = [(x * width, y * height) for x, y in task.points] if kind == "sam2" else []
    text = task.text if kind in ("grounding_dino", "grounded_sam2") else None
    times, result = [], {}
    for _ in range(task.repeats):
        started = time.perf_counter()
        result = run_pipeline(path, Request(picture, run_dir / f"{kind}.png", text, points))
        times.append(time.perf_counter() - started)
    return {
        "omny/picture": str(picture),
        "omny/seconds_per_picture": round(min(times), 3),
        "omny/png": result["png"],
        "omny/json": result["json"],
    }


def sample_photo() -> Path:
    """A real photograph that ships with matplotlib (Grace Hopper), so the benchmark needs no download."""
    from matplotlib import cbook

    return Path(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False))


def rendered_page():
    """A page of printed text: three lines in PIL's own font, black on white."""
    from PIL import Image, ImageDraw, ImageFont

    page = Image.new("RGB", (1000, 480), "white")
    draw = ImageDraw.Draw(page)
    font = ImageFont.load_default(size=40)
    for k, line in enumerate(
        (
            "ONN exports models as .omny files.",
            "Each shard fits a small GPU.",
            "This page was rendered for the benchmark.",
        )
    ):
        draw.text((50, 60 + 140 * k), line, fill="black", font=font)
    return page


def _table(doc: dict[str, Any], m: dict[str, Any]) -> str:
    rows = [
        "| piece | export s | file MB | cut points | largest shard MB | shard MB estimated / measured | "
        "max abs diff (export, shards) | valid |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for piece in doc["pieces"]:
        k = f"omny/{piece['name']}"
        pairs = ", ".join(f"{e:g} / {v:g}" for e, v in zip(m[f"{k}/shard_estimate_mb"], m[f"{k}/shard_measured_mb"]))
        rows.append(
            f"| {piece['name']} | {m[f'{k}/export_s']} | {m[f'{k}/file_mb']} | {m[f'{k}/cut_points']} | "
            f"{m[f'{k}/largest_shard_mb']} | {pairs} | {m[f'{k}/export_max_abs_diff']:.2g}, "
            f"{m[f'{k}/shards_max_abs_diff']:.2g} | {m[f'{k}/valid']} |"
        )
    if "omny/picture" in m:  # a pipeline, run on its picture
        rows.append(
            f"\n{doc['kind']}: exported in {m['omny/export_s']} s (processes side by side: "
            f"{m['omny/export_processes']}); {m['omny/seconds_per_picture']} s per picture in onnxruntime "
            f"({m['omny/picture']})."
        )
    return "\n".join(rows) + "\n"
