"""The export group's values, checked before a model is loaded or trained (app runs this first)."""

from __future__ import annotations

import math
from pathlib import Path

from onn.config.export import ExportConfig, OmnyExport, SafetensorsExport
from onn.errors import UserError
from onn.export import shards
from onn.export.folders import MARKER, check_replaceable, held, is_export, replaceable

FORMATS = ("safetensors", "onnx", "omny")
SEVERAL_GRAPHS = ("pipeline", "dual_encoder")  # the exports an onnx or omny export.output may name as a folder


def check_settings(export: ExportConfig) -> None:
    """The export group's values, checked before a model is loaded or trained: one sentence per mistake.
    (Its keys and their types are checked by Hydra when the config is composed.)"""
    kind = export.name
    if kind == "none":
        return
    if kind not in FORMATS:
        raise UserError(f"export={kind!r} is not one of {', '.join(FORMATS)}.")
    if kind == "safetensors":
        _check_safetensors(export)
    elif export.output:
        _check_file_output(export.output, kind)

    def number(key: str, minimum: float, strict: bool = True, whole: bool = False) -> None:
        value = getattr(export, key)
        kind_ok = isinstance(value, int) if whole else isinstance(value, int | float)
        above = kind_ok and (value > minimum if strict else value >= minimum)  # False for NaN, which passes `<`
        finite = kind_ok and value < math.inf  # infinity is no limit, and not JSON
        if isinstance(value, bool) or not (above and finite):
            what = "a whole number" if whole else "a finite number" if above else "a number"
            bound = f"above {minimum:g}" if strict else f"{minimum:g} or more"
            raise UserError(f"export.{key}={value!r}: give {what} {bound}.")

    if kind in ("onnx", "omny"):
        _check_opset(export.opset)
        number("atol", 0, strict=False)
        _check_sample(export.sample)
    if kind != "omny":
        return
    for key, strict in (("max_shard_size_mb", True), ("min_vram_mb", True), ("headroom_mb", False)):
        if getattr(export, key) is not None:  # null: the format's own default (onn/export/shards.py)
            number(key, 0, strict=strict)
    number("max_configs", 1, strict=False, whole=True)
    number("reference_sequence_length", 1, strict=False, whole=True)
    for key, whole in (("nodes", False), ("shard_counts", True)):
        value = getattr(export, key)
        if value is None:
            continue
        ok = (
            isinstance(value, list | tuple)
            and value
            and all(
                not isinstance(v, bool)
                and (isinstance(v, int) if whole else isinstance(v, int | float))
                and v > 0
                and v < math.inf
                for v in value
            )
        )
        if not ok:
            example = "[4, 8]" if whole else "[2048, 1536, 4096]"
            raise UserError(
                f"export.{key}={value!r}: give a list of positive {'whole ' if whole else ''}numbers, e.g. "
                f"{example}, or null."
            )
    _check_limits_together(export)


def _check_limits_together(export: OmnyExport) -> None:
    """What plan_shards and plan_nodes refuse of the limits together (a headroom that leaves a GPU no memory),
    refused before training instead of when the export runs; a null limit is the format's default."""

    def given(value: float | None, default: float) -> float:
        return default if value is None else float(value)

    headroom = given(export.headroom_mb, shards.HEADROOM_MB)
    shards.check_limits(
        given(export.max_shard_size_mb, shards.MAX_SHARD_SIZE_MB),
        given(export.min_vram_mb, shards.MIN_VRAM_MB),
        headroom,
    )
    if export.nodes is not None:
        shards.check_node_headroom([float(v) for v in export.nodes], headroom)


def check_graph_output(export: ExportConfig, several_graphs: bool | None) -> None:
    """export.output of onnx or omny once the model to export is known (app: after ckpt=, before training). A model
    exported as one graph writes the file DIR/NAME.onnx, which a name without .onnx cannot be; one exported as several
    (a dual encoder's towers) writes the folder DIR/NAME/, which a file or a folder of the user's own there would
    refuse. Either was said only when the export ran, after training. `several_graphs` None: only the built model
    tells (a language model may be a pipeline)."""
    if export.name not in ("onnx", "omny") or not export.output or several_graphs is None:
        return
    path = Path(export.output).expanduser()
    if not several_graphs:
        if export.name == "onnx" and path.suffix != ".onnx":
            raise UserError(
                f"export.output {path}: this model exports as one ONNX graph, a .onnx file; name it so, e.g. "
                f"export.output={path.with_suffix('.onnx')}."
            )
        return
    folder = path.with_suffix("") if path.suffix in (".onnx", ".omny") else path
    if not replaceable(folder):
        what = "a file" if folder.is_file() else f"a folder that is not an earlier export (no {MARKER})"
        raise UserError(
            f"export.output {path}: this model exports as several graphs into the folder {folder}, where {what} is; "
            "choose another export.output, or move that away."
        )


def _check_safetensors(export: SafetensorsExport) -> None:
    """What export=safetensors refuses when it writes, refused before training instead: a shard size transformers
    cannot read, and an export.output (or the OUTPUT-adapter folder beside it, where a LoRA model's adapter goes)
    that is a folder of the user's own."""
    from onn.export.hf import adapter_folder, shard_bytes  # brings torch: onn.export's shard planner runs without it

    shard_bytes(export.max_shard_size)
    if not export.output:
        return
    output = Path(export.output).expanduser()
    check_replaceable(output)
    beside = adapter_folder(output)
    if export.adapter and not replaceable(beside):
        raise UserError(
            f"export.output {output}: a LoRA model's adapter goes beside it to {beside}, which exists and is not an "
            "earlier export; choose another export.output, remove that folder, or set export.adapter=false."
        )


def _check_file_output(output: str, kind: str) -> None:
    """export.output of onnx or omny names the file to write: in a folder that exists, not a folder itself (an
    earlier export's folder is taken: a pipeline or a dual encoder writes its pieces into DIR/NAME/), and for onnx
    a .onnx file (or DIR/NAME without a suffix: the folder of a model exported as several graphs)."""
    path = Path(output).expanduser()
    if not path.parent.is_dir():
        raise UserError(
            f"export.output {path}: the folder {path.parent} does not exist; create it or choose another path."
        )
    if path.is_dir() and not is_export(path):
        raise UserError(
            f"export.output {path} is a folder; name the .{kind} file to write, e.g. {path / ('model.' + kind)}."
        )
    other = held(path)[0] if path.is_dir() else None
    if other not in (None, *SEVERAL_GRAPHS):  # a Hugging Face folder, say: no pipeline or dual encoder replaces it
        raise UserError(
            f"export.output {path} holds a {other} export, which an {kind} export would replace; choose another "
            "export.output."
        )
    if kind == "onnx" and path.suffix not in ("", ".onnx") and not is_export(path):
        raise UserError(
            f"export.output {path}: an ONNX export is a .onnx file; name it so, e.g. {path.with_suffix('.onnx')}."
        )


def _check_opset(opset) -> None:
    """torch.onnx writes opset 18 and converts its graph to another; below 18 that conversion fails for most models
    (and torch writes 18 anyway), above what onnx and onnxruntime know the written file cannot be checked or run."""
    from onn.export.onnx_export import TORCH_OPSET, newest_opset

    newest = newest_opset()
    if isinstance(opset, bool) or not isinstance(opset, int) or not TORCH_OPSET <= opset <= newest:
        raise UserError(
            f"export.opset={opset!r}: give a whole number from {TORCH_OPSET} (what torch.onnx writes) to {newest} "
            "(the newest opset both the installed onnx and onnxruntime know)."
        )


def _check_sample(sample) -> None:
    """The traced sample's sizes: a dynamic export needs 2 or more on its batch and sequence axes (torch.export
    fixes an axis of size 0 or 1), and export.sample.image_size is [H, W] as the data group's image_size is."""
    for key in ("batch_size", "sequence_length"):
        value = getattr(sample, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 2:
            raise UserError(
                f"export.sample.{key}={value!r}: give a whole number, 2 or more (torch.export fixes an axis traced "
                "at size 1, and the exported graph would take no other size)."
            )
    _check_image_size(sample.image_size)


def _check_image_size(size) -> None:
    """export.sample.image_size is the traced picture's [H, W], as the data group's image_size is."""
    if size is None:
        return
    ok = isinstance(size, list | tuple) and len(size) == 2
    if not ok or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in size):
        raise UserError(
            f"export.sample.image_size={size!r}: give two positive whole numbers [H, W], e.g. [224, 224], or null."
        )
