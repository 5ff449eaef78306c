"""A pipeline end to end (`python -m onn.export.omny run`), and its validation: the pieces connect, and each
piece splits where its .omny says."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from onn.export.omny.format import validate
from onn.export.pipelines import document
from onn.export.pipelines.registry import get
from onn.export.pipelines.runtime import Pieces, Request


def run_pipeline(path: str | Path, request: Request) -> dict[str, Any]:
    doc = document.read(path)
    pipeline = get(doc["kind"], str(path))
    return pipeline.run(doc, Pieces(doc, Path(path).parent), request)


def validate_pipeline(path: str | Path, atol: float = 1e-4, echo=print) -> bool:
    """The connections hold (document.read raises, naming the two pieces, when they do not); then every piece."""
    doc = document.read(path)
    echo(f"{path}: {len(doc['connections'])} connections between {len(doc['pieces'])} pieces hold")
    return all([bool(validate(Path(path).parent / piece["file"], atol=atol, echo=echo)) for piece in doc["pieces"]])
