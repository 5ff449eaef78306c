"""The models ONN exports as pipelines of .omny pieces, by the transformers class they are built from.

    register(Pipeline("sam2", "Sam2Model", pieces=..., run=...))   # in each pipeline's module
    for_model(model) -> Pipeline | None                             # export_for_run asks before exporting one graph

A pipeline's `pieces(model, settings)` are the graphs the runtime runs (SAM2: an image encoder once per image,
a prompt decoder once per prompt); its `run(document, folder, request)` runs them end to end in onnxruntime.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from onn.errors import UserError


@dataclass
class Piece:
    """One graph of a pipeline: a module whose forward takes named tensors and returns a dict of them."""

    name: str  # the .omny file's stem: image_encoder, prompt_decoder, ...
    module: Any  # torch.nn.Module
    sample: dict[str, Any]  # named tensors it is traced and checked with
    axes: dict[str, dict[int, str]] = field(default_factory=dict)  # dynamic axes per input ({} : all fixed)
    bounds: dict[str, tuple[int, int]] = field(default_factory=dict)  # an axis's (min, max) where the model has one
    runs: list[list[str]] | None = None  # module paths of its repeated blocks, relative to `module`: the cut points
    kv_cache_bytes: dict[str, int] = field(default_factory=dict)  # decoder blocks: KV-cache bytes per token
    when: str = "once"  # how often the runtime runs it: once (per image), per prompt, per token, ...
    # onnxruntime's outputs -> a context in which the module takes the discrete choices onnxruntime took (which
    # proposals a detector's top-k kept), for a piece whose outputs hinge on near-tied scores
    follow: Callable[[dict[str, Any]], AbstractContextManager] | None = None


@dataclass
class Pipeline:
    kind: str  # sam2 | grounding_dino | grounded_sam2 | trocr
    model_class: str  # the transformers class: Sam2Model, ...
    pieces: Callable[..., list[Piece]]  # (model, settings) -> the pieces
    connections: list[tuple[str, str, str]]  # (piece.output, piece.input, via): what feeds what ("" via: as is)
    run: Callable[..., dict[str, Any]]  # (document, folder, request) -> what it found; writes the PNG
    settings: Callable[..., dict[str, Any]] = lambda *models: {}  # what the runtime needs: sizes, ids, means
    models: int = 1  # how many models build it: 2 for Grounded SAM2 (the detector, then SAM2)
    names: tuple[str, ...] = ()  # its pieces, as pipeline.json must list them (document.read checks)
    needs: tuple[str, ...] = ()  # the settings its run reads ("detector.image_size": a key of settings["detector"])
    takes: frozenset[str] = frozenset()  # what `run` reads besides the image: "text", "points"
    canvas: bool = False  # export.sample.image_size sets its (square) input side; else the model's config fixes it


PIPELINES: dict[str, Pipeline] = {}


def register(pipeline: Pipeline) -> Pipeline:
    PIPELINES[pipeline.kind] = pipeline
    return pipeline


def for_model(model, models: int = 1) -> Pipeline | None:
    """The pipeline a model is exported as, with `models` models in all (a detector with its segmenter: 2), or
    None: one graph."""
    name = type(model).__name__
    return next((p for p in PIPELINES.values() if p.model_class == name and p.models == models), None)


def get(kind: str, where: str) -> Pipeline:
    if kind not in PIPELINES:
        raise UserError(f"{where}: pipeline kind {kind!r} is not one of {', '.join(sorted(PIPELINES))}.")
    return PIPELINES[kind]
