"""pipeline.json: how a pipeline's pieces connect, what the runtime needs to feed them, and where each piece is.

    {"format": "omny-pipeline", "format_version": "1.0", "kind": "sam2", "model": {...},
     "pieces": [{"name": "image_encoder", "file": "image_encoder.omny", "when": "once per image",
                 "inputs": [{"name", "dtype", "shape"}], "outputs": [...]}, ...],
     "connections": [{"from": "image_encoder.image_embeddings", "to": "prompt_decoder.image_embeddings",
                      "via": ""}],
     "settings": {...}, "tokenizer": "tokenizer.json" or null}

`read` holds the document to SCHEMA, to its kind's pieces, connections and settings (registry.py), and each piece's
inputs and outputs to its file's; `check` holds every connection to the pieces' signatures (FORMAT_SPEC.md,
"Pipelines").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from onn.errors import UserError
from onn.export.pipelines.registry import Pipeline, get
from onn.hardware.disk import write_text_atomically

FORMAT = "omny-pipeline"
VERSION = "1.0"
# A connection `via` a conversion joins tensors of different shapes: what each side's last axes must be.
VIA = {
    "boxes_to_prompts": ([4], [2, 2]),  # the detector's [cx, cy, w, h] boxes -> SAM2's two corner points
}
_TENSORS = {
    "type": "array",
    "items": {
        "type": "object",
        "required": ["name", "dtype", "shape"],
        "properties": {
            "name": {"type": "string"},
            "dtype": {"type": "string"},
            "shape": {"type": "array", "items": {"type": ["integer", "string", "null"]}},
        },
    },
}
_END = {"type": "string", "pattern": r"^[^.]+\..+$"}  # piece.tensor
# What the runtime reads of a pipeline.json (FORMAT_SPEC.md, "Pipelines"): a document without it is refused in
# one sentence naming the field, not by a KeyError halfway through a run.
SCHEMA = {
    "type": "object",
    "required": ["kind", "pieces", "connections", "settings"],
    "properties": {
        "kind": {"type": "string"},
        "pieces": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["name", "file", "inputs", "outputs"],
                "properties": {
                    "name": {"type": "string"},
                    "file": {"type": "string", "pattern": r"^[^/\\]+$"},  # a name beside pipeline.json
                    "inputs": _TENSORS,
                    "outputs": _TENSORS,
                },
            },
        },
        "connections": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["from", "to", "via"],
                "properties": {"from": _END, "to": _END, "via": {"enum": ["", *VIA]}},
            },
        },
        "settings": {"type": "object"},
        "tokenizer": {"type": ["string", "null"]},
    },
}


def write(folder: Path, doc: dict[str, Any]) -> Path:
    check(doc, str(folder / "pipeline.json"))
    path = folder / "pipeline.json"
    write_text_atomically(path, json.dumps(doc, indent=2))
    return path


def read(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        raise UserError(
            f"{path} is a folder, not a pipeline document; give the pipeline.json an export wrote, e.g. "
            f"{path / 'pipeline.json'}."
        )
    if not path.is_file():
        raise UserError(f"{path} does not exist; export a pipeline with task=export export=omny first.")
    try:
        doc = json.loads(path.read_text())
    except UnicodeDecodeError:
        raise UserError(
            f"{path} is a binary file, not a pipeline document; give the pipeline.json a pipeline export wrote."
        ) from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not a pipeline document (not JSON: {e}).") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise UserError(f'{path} is not a pipeline document (no "format": "{FORMAT}").')
    _check_schema(doc, path)
    pipeline = get(doc["kind"], str(path))
    check(doc, str(path))
    _check_kind(doc, pipeline, path)
    _check_files(doc, path)
    return doc


def _check_schema(doc: dict[str, Any], path: Path) -> None:
    import jsonschema

    try:
        jsonschema.validate(doc, SCHEMA)
    except jsonschema.ValidationError as e:
        at = "/".join(str(p) for p in e.absolute_path) or "<root>"
        raise UserError(
            f"{path}: the pipeline document is invalid at {at}: {e.message}; re-export the pipeline."
        ) from None


def _check_kind(doc: dict[str, Any], pipeline: Pipeline, path: Path) -> None:
    """The pieces, connections and settings its kind's run reads, all there: a piece or setting left out is named
    now, not after the pieces before it have run."""
    names = [p["name"] for p in doc["pieces"]]
    if pipeline.names and sorted(names) != sorted(pipeline.names):
        raise UserError(
            f"{path}: a {pipeline.kind} pipeline's pieces are {', '.join(pipeline.names)}, not {', '.join(names)}; "
            "re-export the pipeline."
        )
    declared = set(pipeline.connections)
    held = {(c["from"], c["to"], c["via"]) for c in doc["connections"]}
    for a, b, via in sorted(declared ^ held):
        link = f"{a} -> {b}{' via ' + via if via else ''}"
        what = f"lacks connection {link}" if (a, b, via) in declared else f"has connection {link}, which it has not"
        raise UserError(f"{path}: a {pipeline.kind} pipeline {what}; re-export the pipeline.")
    for key in pipeline.needs:
        value = doc["settings"]
        for part in key.split("."):
            if not isinstance(value, dict) or part not in value:
                raise UserError(f"{path}: settings.{key} is missing; re-export the pipeline.")
            value = value[part]


def _check_files(doc: dict[str, Any], path: Path) -> None:
    """Every piece's file (and the tokenizer's) is beside pipeline.json, and each piece's file takes and gives
    what pipeline.json lists: found now, not by onnxruntime after the pieces before it have run."""
    files = [(f"piece {p['name']}", p["file"]) for p in doc["pieces"]]
    files += [("the tokenizer", doc["tokenizer"])] if doc.get("tokenizer") else []
    for what, name in files:
        if not (path.parent / name).is_file():
            raise UserError(
                f"{path}: {what}'s file {path.parent / name} is missing; put it back beside {path.name} or "
                "re-export the pipeline."
            )
    for piece in doc["pieces"]:
        _check_signature(piece, path.parent / piece["file"], path)


def _check_signature(piece: dict[str, Any], file: Path, path: Path) -> None:
    """The piece's file's graph inputs and outputs (names in order, dtypes, fixed sizes) are its entry's: a piece
    copied from another export, or two pieces' files swapped, are refused here."""
    import onnx
    from google.protobuf.message import DecodeError

    from onn.export.graph import dtype_name

    try:
        graph = onnx.load(str(file), load_external_data=False).graph
    except (DecodeError, OSError, ValueError) as e:
        raise UserError(
            f"{path}: piece {piece['name']}'s file {file} is not an ONNX graph ({e}); re-export the pipeline."
        ) from None
    stored = {t.name for t in graph.initializer}
    for side, values in (("inputs", [v for v in graph.input if v.name not in stored]), ("outputs", graph.output)):
        held = [_tensor(v, dtype_name) for v in values]
        listed = piece[side]
        if [t["name"] for t in held] != [t["name"] for t in listed]:
            raise UserError(
                f"{path}: piece {piece['name']}'s file {file.name} has {side} {', '.join(t['name'] for t in held)}, "
                f"not the {', '.join(t['name'] for t in listed)} pipeline.json lists; re-export the pipeline."
            )
        for a, b in zip(held, listed):
            if not _fits(a, b, ""):
                raise UserError(
                    f"{path}: piece {piece['name']}'s file {file.name} has {side[:-1]} {a['name']} {a['dtype']} "
                    f"{a['shape']}, not the {b['dtype']} {b['shape']} pipeline.json lists (a file of another "
                    "export?); re-export the pipeline."
                )


def _tensor(value, dtype_name) -> dict[str, Any]:
    t = value.type.tensor_type
    shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim]
    return {"name": value.name, "dtype": dtype_name(t.elem_type), "shape": shape}


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
