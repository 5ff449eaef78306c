"""The .omny command line: `python -m onn.export.omny COMMAND`.

python -m onn.export.omny inspect FILE                 # cut points, per-block memory, shard plans
python -m onn.export.omny validate FILE|PIPELINE.json  # split at every plan's cuts, run the shards, compare;
                                                       # a pipeline: its pieces connect, and each validates
python -m onn.export.omny enrich IN.onnx OUT.omny      # a .omny of an ONNX file made elsewhere
                          [--dim NAME=SIZE] [--reference-length TOKENS]
                          [--max-shard-size-mb MB] [--min-vram-mb MB] [--headroom-mb MB]
python -m onn.export.omny run PIPELINE.json IMAGE [--text "a cat."] [--points X,Y ...]
                                                       # a pipeline end to end in onnxruntime, drawn as a PNG
"""

from __future__ import annotations

import sys
from typing import Any

from onn.errors import UserError
from onn.export.omny.format import DEFAULTS, SAMPLE_DIM, enrich_onnx, inspect_omny, validate
from onn.export.pipelines import Request, run_pipeline, validate_pipeline

# enrich's shard limits: the export group's keys, which the planner's messages name, and the options that set them
LIMIT_OPTIONS = {
    "max_shard_size_mb": "--max-shard-size-mb",
    "min_vram_mb": "--min-vram-mb",
    "headroom_mb": "--headroom-mb",
}


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m onn.export.omny", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("inspect", help="print cut points, per-block memory and shard plans").add_argument("file")
    check = sub.add_parser("validate", help="split at every plan's cut points, run the shards, compare")
    check.add_argument("file", help="a .omny file, or a pipeline.json (its connections, then each piece)")
    check.add_argument("--atol", type=float, default=1e-4)
    enrich = sub.add_parser("enrich", help="make a .omny of an ONNX file made elsewhere (cut points from the graph)")
    enrich.add_argument("file", help="the .onnx file")
    enrich.add_argument("output", help="the .omny file to write")
    enrich.add_argument(
        "--sample",
        help="a .npz of the sample input (one array per graph input); default: made from the graph's declared shapes",
    )
    enrich.add_argument(
        "--dim",
        action="append",
        default=[],
        metavar="NAME=SIZE",
        help="the size of a named input dimension in the made sample (default: 1 for the first, "
        f"{SAMPLE_DIM} for others)",
    )
    enrich.add_argument(
        "--reference-length",
        type=int,
        metavar="TOKENS",
        help="the sequence length per-sample memory is given at (default: "
        f"{DEFAULTS['reference_sequence_length']}; at most the model's longest, e.g. 77 for CLIP's text encoder)",
    )
    for key, option in LIMIT_OPTIONS.items():
        enrich.add_argument(
            option, type=float, metavar="MB", help=f"export.{key} of the shard plans (default: {DEFAULTS[key]:g})"
        )
    run = sub.add_parser("run", help="run a pipeline end to end in onnxruntime and draw what it found")
    run.add_argument("file", help="the pipeline.json an export wrote")
    run.add_argument("image", help="the picture (a photograph, a page of text)")
    run.add_argument("--text", help="what to find (Grounding DINO, Grounded SAM2): phrases ending in '.'")
    run.add_argument("--points", nargs="*", default=[], metavar="X,Y", help="SAM2's prompts, in the image's pixels")
    run.add_argument("--output", help="the PNG to write, the JSON beside it (default: IMAGE.result.png beside IMAGE)")
    args = parser.parse_args(argv)
    try:
        if args.command == "run":
            return _run(args)
        if args.command == "inspect":
            if args.file.endswith(".json"):
                raise UserError(f"{args.file}: inspect reads a .omny piece; validate or run take pipeline.json.")
            print(inspect_omny(args.file).summary())
            return 0
        if args.command == "enrich":
            return _enrich(args)
        if args.file.endswith(".json"):
            return 0 if validate_pipeline(args.file, atol=args.atol) else 1
        return 0 if validate(args.file, atol=args.atol) else 1
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (KeyError, ValueError, TypeError) as e:  # a document that passes the schema yet makes no sense
        what = "pipeline document" if args.file.endswith(".json") else ".omny document"
        print(f"error: {args.file}: the {what} cannot be used ({type(e).__name__}: {e}).", file=sys.stderr)
        return 2


def _run(args) -> int:
    from pathlib import Path

    pipeline, image = Path(args.file), Path(args.image)
    if pipeline.suffix.lower() in (".omny", ".onnx"):  # read as JSON, it was refused with a raw UTF-8 decode error
        raise UserError(
            f"{pipeline} is a single model file: run takes the pipeline.json a pipeline export writes (SAM2, Grounded "
            "SAM2 or OCR with task=export export=omny: docs/export.md), and inspect or validate take a single .omny."
        )
    output = Path(args.output) if args.output else image.parent / f"{image.stem}.result.png"
    result = run_pipeline(pipeline, Request(image, output, args.text, [_point(p) for p in args.points]))
    print(f"wrote {result['png']} and {result['json']}")
    return 0


def _enrich(args) -> int:
    """enrich, its messages naming the options that set the shard limits (the planner names the export group's keys,
    which a command line has not)."""
    sample = _read_sample(args.sample) if args.sample else None
    try:
        written = enrich_onnx(args.file, args.output, sample, _settings(args), dims=_read_dims(args.dim))
    except UserError as e:
        message = str(e)
        for key, option in LIMIT_OPTIONS.items():
            message = message.replace(f"export.{key}", option)
        raise UserError(message) from None
    print(inspect_omny(written).summary())
    return 0


def _settings(args) -> dict[str, Any] | None:
    """enrich's settings from its options: the reference length and the shard limits given."""
    settings: dict[str, Any] = {key: getattr(args, key) for key in LIMIT_OPTIONS if getattr(args, key) is not None}
    if args.reference_length is not None:
        if args.reference_length < 1:
            raise UserError(f"--reference-length {args.reference_length}: give a whole number of tokens, 1 or more.")
        settings["reference_sequence_length"] = args.reference_length
    return settings or None


def _point(text: str) -> tuple[float, float]:
    try:
        x, y = (float(v) for v in text.split(","))
    except ValueError:
        raise UserError(
            f"--points {text}: write each point as X,Y in the image's pixels, e.g. --points 320,240."
        ) from None
    return x, y


def _read_dims(items: list[str]) -> dict[str, int]:
    dims = {}
    for item in items:
        name, _, size = item.partition("=")
        if not name or not size.isdigit() or int(size) < 1:
            raise UserError(
                f"--dim {item}: write NAME=SIZE with a whole number of 1 or more (e.g. --dim sequence=128)."
            )
        dims[name] = int(size)
    return dims


def _read_sample(path: str) -> dict[str, Any]:
    import numpy as np

    try:
        with np.load(path, allow_pickle=False) as arrays:  # never unpickles
            return {k: arrays[k] for k in arrays.files}
    except (OSError, ValueError) as e:
        raise UserError(f"--sample {path} is not a readable .npz of arrays: {e}.") from None
