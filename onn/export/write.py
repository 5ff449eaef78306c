"""Write a model in the export group's format: `safetensors` (hf.py: a Hugging Face folder, LoRA merged, and
the adapter alone), `onnx` (onnx_export.py: checked, compared with PyTorch in onnxruntime) or `omny` (omny.py:
ONNX with cut points, per-block memory and shard plans; see FORMAT_SPEC.md).

    export_model(model, output, sample_input, settings)    # Python (settings: onn.config.export's schemas);
                                                            # also omny.enrich_onnx, inspect_omny, validate
    export_for_run(config, model, run_dir)                  # a run's model, in the export group's format
    python run.py task=export export=omny [ckpt=...]        # or after training: task=train export=...
"""

from __future__ import annotations

import errno
import logging
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from safetensors import SafetensorError

from onn.config import ONNConfig
from onn.config.convert import typed
from onn.config.export import ExportSample, OmnyExport, OnnxExport, SafetensorsExport
from onn.config.model import LanguageModelConfig
from onn.errors import ExportFailed, UserError, disk_error, diverged, write_refused
from onn.export.folders import sweep_leftovers, temp_prefix
from onn.export.model_facts import kv_cache_bytes, model_source, omny_runs, weight_bytes
from onn.export.settings import FORMATS, check_settings
from onn.models.load import load

DEFAULT_LIMITS = (
    "max_shard_size_mb",
    "min_vram_mb",
    "headroom_mb",
    "nodes",
    "shard_counts",
    "max_configs",
    "reference_sequence_length",
)

log = logging.getLogger("onn")
# the disk's refusals of a write: full, read-only, permission denied, not permitted (an immutable folder: chattr +i)
REFUSED = (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM)


def export_model(
    model,
    output: str | Path,
    sample_input: dict[str, Any] | None,
    settings: SafetensorsExport | OnnxExport | OmnyExport,
    *,
    model_name: str | None = None,
    tokenizer=None,
    engine=None,
    blocks_path: str | None = None,
) -> dict[str, Any]:
    """Write `model` to `output` in the format settings.name names (the export group's schema, e.g.
    `typed(OnnxExport, {...}, "export")`); return the export/* metrics.

    `sample_input` (named tensors) is what ONNX traces and checks against; `engine` is the
    streaming engine of a layer-streamed model, whose frozen blocks live in its layer store;
    `model_name` names the model in a .omny's source (default: its class); `blocks_path`
    (model.layer_map.blocks) names its blocks, where a .omny's cut points go (None: discovered)."""
    kind = settings.name
    if kind not in FORMATS:
        raise UserError(f"export={kind!r} is not one of {', '.join(FORMATS)}.")
    check_settings(settings)
    output = Path(output).expanduser()  # a recipe's export.output: ~/exports/model.onnx
    if not output.parent.is_dir():
        raise UserError(
            f"export.output {output}: the folder {output.parent} does not exist; create it or choose another path."
        )
    if kind != "safetensors" and output.is_dir():  # refused before the trace, not by the rename after it
        raise UserError(
            f"export.output {output} is a folder; name the .{kind} file to write, e.g. {output / ('model.' + kind)}."
        )
    try:  # every format writes beside `output` and moves into place: a refused write leaves nothing half-written
        return _export(model, output, sample_input, settings, model_name, tokenizer, engine, blocks_path)
    except (OSError, SafetensorError) as e:
        refused = refused_write(e, output, weight_bytes(model) if engine is None else None)
        if refused is None:
            raise
        raise refused from None


def refused_write(error: BaseException, output: Path, needed_bytes: int | None = None) -> UserError | None:
    """One sentence for an export's write the disk refused (full, read-only, not permitted), naming `output` and for a
    full disk the space needed; None for any other error. safetensors' writer says the disk's refusal in its own
    SafetensorError ("I/O error: No space left on device (os error 28)"), read here as the OSError it was."""
    refused = disk_error(error)
    if refused is None or refused.errno not in REFUSED:
        return None
    return write_refused(refused, output, needed_bytes, "the export (export.output)")


def _export(
    model, output: Path, sample_input, settings, model_name, tokenizer, engine, blocks_path: str | None
) -> dict[str, Any]:
    """export_model's writing, once its settings and folder are checked."""
    kind = settings.name
    if kind == "safetensors":
        from onn.export import hf

        adapter = bool(settings.adapter and _has_adapter(model))
        return hf.save_export(
            model,
            tokenizer,
            output,
            engine=engine,
            max_shard_size=settings.max_shard_size,
            adapter=adapter,
            model_name=model_name,
            blocks_path=blocks_path,
        )
    if sample_input is None:
        raise UserError(f"export={kind} traces the model on a sample input; pass sample_input (named tensors).")
    if engine is not None or _has_adapter(model):
        from onn.export.hf import merged_model

        model = merged_model(model, engine, blocks_path)  # ONNX holds the whole graph: one resident, merged model
    from onn.export.onnx_export import export_onnx, traceable

    model, sample_input = traceable(model, sample_input)  # (export_onnx does it too; omny.describe reads the sample)

    opset, atol = settings.opset, settings.atol
    if kind == "onnx":
        return export_onnx(model, output, sample_input, opset=opset, atol=atol)
    import onnx

    from onn.export import omny

    sweep_leftovers(output)  # a killed export's traced graph, which may hold all the weights
    with tempfile.TemporaryDirectory(dir=output.parent, prefix=Path(temp_prefix(output)).name + "-") as tmp:
        traced = Path(tmp) / "model.onnx"
        metrics = export_onnx(model, traced, sample_input, opset=opset, atol=atol)
        graph = onnx.load(str(traced))
        runs, kv = omny_runs(model, blocks_path), kv_cache_bytes(model, blocks_path)
        doc = omny.describe(
            graph,
            sample_input,
            _omny_settings(settings, model),
            runs=runs,
            kv_cache_bytes=kv,
            source=model_source(model, model_name),
        )
        omny.write(graph, doc, output)
    del metrics["export/onnx"]  # the traced .onnx, deleted with tmp: the .omny holds its graph (export/omny)
    metrics.update(_omny_metrics(doc, output))
    return metrics


def export_after_training(metrics: dict[str, Any], run_dir: Path, export: Callable[[], dict[str, Any]]) -> None:
    """A trained run's export, its figures added to `metrics`. A failure keeps the training's figures
    (ExportFailed carries them to the run's record) and says how to export the checkpoint without training."""
    if diverged(metrics) is not None:  # NaN weights are no model to hand on; the run says so when it ends (app.run)
        return
    try:
        metrics.update(export())
    except UserError as e:
        raise ExportFailed(
            f"{e} (training finished and wrote {Path(run_dir) / 'checkpoints'}: once that is fixed, "
            f"task=export ckpt={run_dir} exports it without training again)",
            metrics,
        ) from None


def export_for_run(
    config: ONNConfig, model, run_dir: Path, sample: dict[str, Any] | None = None, *, tokenizer=None, engine=None
) -> dict[str, Any]:
    """Write a run's model in the `export` group's format, to export.output or the run folder's export/.

    `sample` (named tensors) is what ONNX traces; language models, CLIP and image CNNs get one made
    for them when it is None (export.sample sets its batch size and sequence length)."""
    from onn.export.onnx_export import sample_inputs

    settings: SafetensorsExport | OnnxExport | OmnyExport = config.export
    kind = settings.name
    default = {"safetensors": "hf", "onnx": "model.onnx", "omny": "model.omny"}[kind]
    # expanded here, as settings.py expands it before training: a recipe's export.output may start with ~
    output = Path(settings.output).expanduser() if settings.output else Path(run_dir) / "export" / default
    if not settings.output:
        output.parent.mkdir(parents=True, exist_ok=True)
    plain = model.get_base_model() if hasattr(model, "get_base_model") else model  # under peft's wrapper
    if kind != "safetensors" and (pipeline := _pipeline(config, plain)) is not None:
        folder = pipeline_folder(settings.output, output)
        try:
            return _export_pipeline(config, pipeline, plain, folder, tokenizer)
        except (OSError, SafetensorError) as e:  # a full disk, or a folder that does not permit the write
            refused = refused_write(e, folder)
            if refused is None:
                raise
            raise refused from None
    if sample is None and kind != "safetensors":
        shape: ExportSample = settings.sample
        sample = sample_inputs(plain, shape.batch_size, shape.sequence_length, shape.image_size, seed=config.seed)
    # a language model's layer_map.blocks names a path in the model exported; a classifier's or denoiser's export
    # wraps its network (StoredBatchClassifier), where that path names nothing: its blocks are discovered, as before
    blocks = config.model.layer_map.blocks if isinstance(config.model, LanguageModelConfig) else None
    metrics = export_model(
        model,
        output,
        sample,
        settings,
        model_name=config.model.name,
        tokenizer=tokenizer,
        engine=engine,
        blocks_path=blocks,
    )
    log.info("export: %s", {k: v for k, v in metrics.items() if not isinstance(v, dict | list)})
    return metrics


def pipeline_folder(given: str | None, output: Path) -> Path:
    """Where a pipeline goes: export.output=DIR/NAME.omny (or .onnx, or DIR/NAME) is the folder DIR/NAME/, so two
    pipelines given two names in one folder never share a pipeline.json; without export.output, the run's export/."""
    if not given:
        return output.parent
    return output.with_suffix("") if output.suffix in (".omny", ".onnx") else output


def _pipeline(config: ONNConfig, model):
    """The pipeline this model is exported as (SAM2, Grounding DINO, Grounded SAM2, TrOCR), or None."""
    from onn.export.pipelines import for_model  # onnx, onnxruntime: imported when an export asks

    segmenter = getattr(config.model, "segmenter", None)
    return for_model(model, 2 if segmenter else 1)


def _export_pipeline(config: ONNConfig, pipeline, model, folder: Path, tokenizer) -> dict[str, Any]:
    """The pipeline's pieces and pipeline.json in `folder` (Grounded SAM2's SAM2 built from model.segmenter)."""
    from onn.export.pipelines import export_pipeline  # onnx, onnxruntime: imported when a pipeline is exported

    models = [model]
    if pipeline.models == 2:
        segmenter = typed(LanguageModelConfig, config.model.segmenter, "model.segmenter")
        models.append(load(segmenter)[0])
    export: OnnxExport | OmnyExport = config.export
    limits = {k: getattr(export, k) for k in DEFAULT_LIMITS if getattr(export, k, None) is not None}
    side = _pipeline_side(pipeline, export.sample.image_size)
    return export_pipeline(pipeline, models, folder, export, limits, config.model.name, tokenizer, side=side)


def _pipeline_side(pipeline, size: list[int] | None) -> int | None:
    """export.sample.image_size as a pipeline takes it: a detector's square canvas, its side; refused where the
    model's config fixes the size (SAM2, TrOCR), not ignored, and refused when not square, not cut to one."""
    if size is None:
        return None
    if not pipeline.canvas:
        raise UserError(
            f"export.sample.image_size={list(size)}: a {pipeline.kind} pipeline's image size is fixed by the model's "
            "config (model.architecture); remove export.sample.image_size."
        )
    if size[0] != size[1]:
        raise UserError(
            f"export.sample.image_size={list(size)}: the {pipeline.kind} detector reads a square canvas; give "
            f"[N, N], e.g. [{max(size)}, {max(size)}]."
        )
    return size[0]


def _omny_settings(export: OmnyExport, model) -> dict[str, Any]:
    """export=omny's limits as omny.describe takes them (a plain dict: the format's API, also enrich_onnx's);
    a null limit is left out, so the format's default (omny.DEFAULTS) holds."""
    from onn.export.omny import DEFAULTS
    from onn.export.onnx_export import max_sequence_length

    limits = {k: getattr(export, k) for k in DEFAULTS if getattr(export, k) is not None}
    longest = max_sequence_length(model)  # learned position tables (GPT-2, CLIP) end there
    reference = export.reference_sequence_length
    limits["reference_sequence_length"] = min(reference, longest) if longest else reference
    return limits


def _omny_metrics(doc: dict[str, Any], output: Path) -> dict[str, Any]:
    return {
        "export/omny": str(output),
        "export/blocks": len(doc["blocks"]),
        "export/cut_points": len(doc["cut_points"]),
        "export/shard_counts": doc["shard_plans"]["allowed_counts"],
        "export/node_plan": doc["node_plan"]["ranges"] if doc["node_plan"] else None,
    }


def _has_adapter(model) -> bool:
    inner = getattr(model, "model", model)
    return bool(getattr(model, "peft_config", None) or getattr(inner, "peft_config", None))
