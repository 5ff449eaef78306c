"""A pipeline end to end (`python -m onn.export.omny run`), and its validation: the pieces connect, and each
piece splits where its .omny says."""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Any

from onn.errors import UserError
from onn.export.omny.format import validate
from onn.export.pipelines import document
from onn.export.pipelines.registry import Pipeline, get
from onn.export.pipelines.runtime import Pieces, Request, check_output


def run_pipeline(path: str | Path, request: Request) -> dict[str, Any]:
    path = Path(path)
    doc = document.read(path)
    pipeline = get(doc["kind"], str(path))
    _check_prompts(pipeline, request)
    files = [p["file"] for p in doc["pieces"]]
    pieces = [path.parent / f for f in files]
    # each piece's weights files, by the names exports give them (NAME.data, NAME.<12 hex>.data): reading each
    # graph for them would parse every piece, up to 1.5 GiB of inline weights, before onnxruntime loads it again
    weights = [w for piece in pieces for w in piece.parent.glob(f"{glob.escape(piece.name)}*.data")]
    read = [path, request.image, *pieces, *weights]
    check_output(request, read + ([path.parent / doc["tokenizer"]] if doc.get("tokenizer") else []))
    return pipeline.run(doc, Pieces(doc, path.parent), request)


def _check_prompts(pipeline: Pipeline, request: Request) -> None:
    """--text and --points only where the pipeline reads them: one given to another is refused, not ignored."""
    for flag, given in (("text", request.text is not None), ("points", bool(request.points))):
        if given and flag not in pipeline.takes:
            takes = " and ".join(f"--{t}" for t in sorted(pipeline.takes)) or "only the image"
            raise UserError(f"--{flag}: a {pipeline.kind} pipeline takes {takes}, not --{flag}.")


def validate_pipeline(path: str | Path, atol: float = 1e-4, echo=print) -> bool:
    """The connections hold (document.read raises, naming the two pieces, when they do not); then every piece."""
    doc = document.read(path)
    echo(f"{path}: {len(doc['connections'])} connections between {len(doc['pieces'])} pieces hold")
    return all([_validate_piece(Path(path).parent / piece["file"], atol, echo) for piece in doc["pieces"]])


def _validate_piece(file: Path, atol: float, echo) -> bool:
    """A .omny piece split at its cut points (format.validate); a plain ONNX piece (export=onnx writes no .omny
    document: no cut points or plans to check) held to onnx.checker, its inputs and outputs already held to
    pipeline.json's by document.read."""
    import onnx

    from onn.export.omny.format import METADATA_KEY
    from onn.export.onnx_export import check_onnx

    if any(p.key == METADATA_KEY for p in onnx.load(str(file), load_external_data=False).metadata_props):
        return bool(validate(file, atol=atol, echo=echo))
    check_onnx(file, load_external_data=False)
    echo(
        f"{file}: plain ONNX (export=onnx: no cut points or shard plans to validate); onnx.checker passes and its "
        "inputs and outputs are pipeline.json's: valid"
    )
    return True
