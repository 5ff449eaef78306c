"""Running a pipeline's pieces in onnxruntime: a session per piece (CUDA when this onnxruntime has it), the
request a `run` gets, and where it writes."""

from __future__ import annotations

import json
import os
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from onn.errors import UserError
from onn.hardware.disk import write_text_atomically


@dataclass
class Request:
    """What `python -m onn.export.omny run` was asked: the picture, a text prompt, points, where to write."""

    image: Path
    output: Path  # the PNG; the JSON goes beside it
    text: str | None = None
    points: list[tuple[float, float]] = field(default_factory=list)


class Pieces:
    """The pipeline's pieces as onnxruntime sessions, opened on first use."""

    def __init__(self, doc: dict[str, Any], folder: Path):
        self.files = {p["name"]: folder / p["file"] for p in doc["pieces"]}
        self.sessions: dict[str, Any] = {}
        self.tokenizer_file = folder / doc["tokenizer"] if doc.get("tokenizer") else None

    def tokenizer(self):
        """The pipeline's tokenizer.json (the `tokenizers` library reads it), or None when it has none."""
        from tokenizers import Tokenizer

        if self.tokenizer_file is None:
            return None
        try:
            return Tokenizer.from_file(str(self.tokenizer_file))
        except Exception as e:  # the tokenizers library raises a bare Exception for a file cut short or edited
            raise UserError(
                f"{self.tokenizer_file} cannot be read as a tokenizer ({' '.join(str(e).split())[:200]}); put back "
                "the file the export wrote or re-export the pipeline."
            ) from None

    def run(self, name: str, feeds: dict[str, Any], keep: Collection[str] = ()) -> dict[str, Any]:
        """The piece's outputs: those named in `keep` as onnxruntime OrtValues left where the session computed
        them (its GPU under CUDA), to be fed to a later run as they are; the rest as numpy. A feed is numpy or
        such an OrtValue. A decoder's keys and values go round once per token: read back to the host and fed
        again, every step copied them both ways."""
        import onnxruntime as ort

        session = self._session(name)
        binding = session.io_binding()
        for key, value in feeds.items():
            if isinstance(value, ort.OrtValue):
                binding.bind_ortvalue_input(key, value)
            else:
                binding.bind_cpu_input(key, np.require(value, requirements="C"))
        device, index = _device(session)
        names = [o.name for o in session.get_outputs()]
        for output in names:
            binding.bind_output(output, *((device, index) if output in keep else ("cpu", 0)))
        try:
            session.run_with_iobinding(binding)
        except Exception as e:  # onnxruntime's own error types: a feed of a shape the piece does not take, no memory
            raise self._failed(name, "run", e, feeds) from None
        values = binding.get_outputs()
        return {n: v if n in keep else v.numpy() for n, v in zip(names, values)}

    def _session(self, name: str):
        import onnxruntime as ort

        if name not in self.sessions:
            options = ort.SessionOptions()
            options.log_severity_level = 3
            # memory as the .omny budgets it: weights held once (a CPU pre-packs a second copy for its GEMMs
            # otherwise), each tensor freed after its last reader (onnxruntime's planned buffer reuse keeps a
            # block's buffers alive into the next; its CPU arena holds what was freed)
            options.add_session_config_entry("session.disable_prepacking", "1")
            options.enable_mem_reuse = False
            options.enable_cpu_mem_arena = False
            wanted = ("CUDAExecutionProvider", "CPUExecutionProvider")
            providers = [p for p in wanted if p in ort.get_available_providers()]
            try:
                self.sessions[name] = ort.InferenceSession(str(self.files[name]), options, providers=providers)
            except Exception as e:  # a piece file (or its weights beside it) cut short or damaged since export
                raise self._failed(name, "load", e) from None
        return self.sessions[name]

    def _failed(self, name: str, doing: str, error: Exception, feeds: dict[str, Any] | None = None) -> UserError:
        """onnxruntime's error as one sentence naming the piece's file, the shapes it was fed, and what to do."""
        shapes = {k: list(v.shape()) if callable(v.shape) else list(v.shape) for k, v in (feeds or {}).items()}
        fed = f" on inputs {shapes}" if shapes else ""
        message = " ".join(str(error).split())[:300]
        return UserError(
            f"pipeline piece {name} ({self.files[name]}): onnxruntime cannot {doing} it{fed} ({message}); if "
            "pipeline.json's settings were edited, restore them, else re-export the pipeline."
        )


def _device(session) -> tuple[str, int]:
    """Where the session computes: the CUDA device it was given (its device_id), or the CPU."""
    cuda = session.get_provider_options().get("CUDAExecutionProvider")
    return ("cuda", int(cuda["device_id"])) if cuda is not None else ("cpu", 0)


def check_output(request: Request, keep: list[Path]) -> None:
    """Before any piece runs: --output names a PNG whose folder exists, and neither it nor the JSON beside it is
    a file the run reads (`keep`: the picture, pipeline.json, the pieces, the tokenizer)."""
    png = request.output
    if png.suffix.lower() == ".json":
        raise UserError(f"--output {png} names the PNG to write (the JSON goes beside it); give a .png path.")
    if not png.parent.is_dir():
        raise UserError(f"--output {png}: the folder {png.parent} does not exist; create it or choose another path.")
    if not os.access(png.parent, os.W_OK):
        raise UserError(f"--output {png}: the folder {png.parent} cannot be written to; choose another --output.")
    kept = {p.resolve() for p in keep}
    for path in (png, png.with_suffix(".json")):
        if path.is_dir():
            raise UserError(f"--output {png}: {path} is a folder; name the PNG to write, e.g. {path / 'result.png'}.")
        if path.resolve() in kept:
            raise UserError(f"--output {png} would write {path} over a file this run reads; choose another --output.")


def finish(request: Request, picture, findings: dict[str, Any]) -> dict[str, Any]:
    """What a run found, with the picture drawn: the PNG at request.output, the findings as JSON beside it (each
    written whole or not at all)."""
    from onn.export.pipelines.images import save

    result = {"image": str(request.image), **findings, "png": str(save(picture, request.output))}
    path = request.output.with_suffix(".json")
    result["json"] = str(path)
    write_text_atomically(path, json.dumps(result, indent=2))
    return result


def check_points(points: list[tuple[float, float]], size: tuple[int, int]) -> None:
    width, height = size
    for x, y in points:
        if not (0 <= x < width and 0 <= y < height):
            raise UserError(
                f"--points {x:g},{y:g} lies outside the image ({width} x {height} pixels); give x in 0-{width - 1} "
                f"and y in 0-{height - 1}."
            )
