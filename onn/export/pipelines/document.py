"""pipeline.json: how a pipeline's pieces connect, what the runtime needs to feed them, and where each piece is.

    {"format": "omny-pipeline", "format_version": "1.0", "kind": "sam2", "model": {...},
     "pieces": [{"name": "image_encoder", "file": "image_encoder.omny", "when": "once per image",
                 "inputs": [{"name", "dtype", "shape"}], "outputs": [...]}, ...],
     "connections": [{"from": "image_encoder.image_embeddings", "to": "prompt_decoder.image_embeddings",
                      "via": ""}],
     "settings": {...}, "tokenizer": "tokenizer.json" or null}

`check` holds every connection to the pieces' own signatures (FORMAT_SPEC.md, "Pipelines").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from onn.errors import UserError
from onn.hardware.disk import write_text_atomically

FORMAT = "omny-pipeline"
VERSION = "1.0"
# A connection `via` a conversion joins tensors of different shapes: what each side's last axes must be.
VIA = {
    "boxes_to_prompts": ([4], [2, 2]),  # the detector's [cx, cy, w, h] boxes -> SAM2's two corner points
}


def write(folder: Path, doc: dict[str, Any]) -> Path:
    check(doc, str(folder / "pipeline.json"))
    path = folder / "pipeline.json"
    write_text_atomically(path, json.dumps(doc, indent=2))
    return path


def read(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path} does not exist; export a pipeline with task=export export=omny first.")
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not a pipeline document (not JSON: {e}).") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise UserError(f'{path} is not a pipeline document (no "format": "{FORMAT}").')
    check(doc, str(path))
    _check_files(doc, path)
    return doc


def _check_files(doc: dict[str, Any], path: Path) -> None:
    """Every piece's file (and the tokenizer's) is beside pipeline.json: found missing now, not by onnxruntime
    after the pieces before it have run."""
    files = [(f"piece {p['name']}", p["file"]) for p in doc["pieces"]]
    files += [("the tokenizer", doc["tokenizer"])] if doc.get("tokenizer") else []
    for what, name in files:
        if not (path.parent / name).is_file():
            raise UserError(
                f"{path}: {what}'s file {path.parent / name} is missing; put it back beside {path.name} or "
                "re-export the pipeline."
            )


def check(doc: dict[str, Any], where: str) -> None:
    """Every connection names a piece's output and a piece's input whose dtypes agree and whose fixed sizes fit."""
    pieces = {p["name"]: p for p in doc["pieces"]}
    for c in doc["connections"]:
        (src, out), (dst, inp) = c["from"].split(".", 1), c["to"].split(".", 1)
        for piece, kind, tensor in ((src, "outputs", out), (dst, "inputs", inp)):
            if piece not in pieces:
                raise UserError(f"{where}: connection {c['from']} -> {c['to']} names no piece {piece!r}.")
            if tensor not in {t["name"] for t in pieces[piece][kind]}:
                raise UserError(f"{where}: piece {piece} has no {kind[:-1]} {tensor!r} ({c['from']} -> {c['to']}).")
        a = next(t for t in pieces[src]["outputs"] if t["name"] == out)
        b = next(t for t in pieces[dst]["inputs"] if t["name"] == inp)
        if not _fits(a, b, c["via"]):
            raise UserError(
                f"{where}: {src}'s output {out} ({a['dtype']} {a['shape']}) does not fit {dst}'s input {inp} "
                f"({b['dtype']} {b['shape']}){' via ' + c['via'] if c['via'] else ''}; re-export the pipeline."
            )


def _fits(a: dict, b: dict, via: str) -> bool:
    if a["dtype"] != b["dtype"]:
        return False
    if via:
        tail_a, tail_b = VIA[via]
        return _same(a["shape"][-len(tail_a) :], tail_a) and _same(b["shape"][-len(tail_b) :], tail_b)
    return len(a["shape"]) == len(b["shape"]) and _same(a["shape"], b["shape"])


def _same(x: list, y: list) -> bool:
    """Fixed sizes equal; a named (dynamic) or unknown axis fits any size."""
    return len(x) == len(y) and all(not (isinstance(p, int) and isinstance(q, int)) or p == q for p, q in zip(x, y))
