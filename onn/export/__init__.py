"""Export a model: `safetensors` (a Hugging Face folder, LoRA merged, and the adapter alone), `onnx`
(checked, compared with PyTorch in onnxruntime) or `omny` (ONNX with cut points, per-block memory
and shard plans; see FORMAT_SPEC.md).

    export_model(model, output, sample_input, settings)    # Python (settings: onn.config.export's schemas);
                                                            # also enrich_onnx, inspect_omny, validate
    python run.py task=export export=omny [ckpt=...]        # or after training: task=train export=...
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

from onn.config import ONNConfig
from onn.config.export import ExportConfig, ExportSample, OmnyExport, OnnxExport, SafetensorsExport
from onn.errors import UserError

__all__ = ["export_model", "export_for_run", "enrich_onnx", "inspect_omny", "validate", "kv_cache_bytes"]


def __getattr__(name: str):
    """enrich_onnx, inspect_omny and validate live in onn.export.omny; imported on first use, so
    `python -m onn.export.omny` does not import that module twice."""
    if name in ("enrich_onnx", "inspect_omny", "validate"):
        from onn.export import omny

        return getattr(omny, name)
    raise AttributeError(f"module 'onn.export' has no attribute {name!r}")


log = logging.getLogger("onn")
FORMATS = ("safetensors", "onnx", "omny")


def export_model(
    model,
    output: str | Path,
    sample_input: dict[str, Any] | None,
    settings: SafetensorsExport | OnnxExport | OmnyExport,
    *,
    model_name: str | None = None,
    tokenizer=None,
    engine=None,
) -> dict[str, Any]:
    """Write `model` to `output` in the format settings.name names (the export group's schema, e.g.
    `typed(OnnxExport, {...}, "export")`); return the export/* metrics.

    `sample_input` (named tensors) is what ONNX traces and checks against; `engine` is the
    streaming engine of a layer-streamed model, whose frozen blocks live in its layer store;
    `model_name` names the model in a .omny's source (default: its class)."""
    for noisy in ("onnx_ir", "onnxscript"):  # the exporter's passes log every rewrite at INFO
        logging.getLogger(noisy).setLevel(logging.WARNING)
    kind = settings.name
    if kind not in FORMATS:
        raise UserError(f"export={kind!r} is not one of {', '.join(FORMATS)}.")
    check_settings(settings)
    output = Path(output)
    if not output.parent.is_dir():
        raise UserError(
            f"export.output {output}: the folder {output.parent} does not exist; create it or choose another path."
        )
    if kind == "safetensors":
        from onn.export import hf

        metrics = hf.save_folder(
            model, tokenizer, output, engine=engine, max_shard_size=settings.max_shard_size
        )
        if settings.adapter and _has_adapter(model):
            metrics.update(hf.save_adapter(model, tokenizer, output.with_name(output.name + "-adapter")))
        return metrics
    if sample_input is None:
        raise UserError(
            f"export={kind} traces the model on a sample input; pass sample_input (named tensors)."
        )
    if engine is not None or _has_adapter(model):
        from onn.export.hf import merged_model

        model = merged_model(model, engine)  # ONNX holds the whole graph: one resident, merged model
    from onn.export.onnx_export import export_onnx

    opset, atol = settings.opset, settings.atol
    if kind == "onnx":
        return export_onnx(model, output, sample_input, opset=opset, atol=atol)
    import onnx

    from onn.export import omny

    with tempfile.TemporaryDirectory(dir=output.parent, prefix=".omny-") as tmp:
        traced = Path(tmp) / "model.onnx"
        metrics = export_onnx(model, traced, sample_input, opset=opset, atol=atol)
        graph = onnx.load(str(traced))
        runs, kv = _block_runs(model), kv_cache_bytes(model)
        doc = omny.describe(
            graph,
            sample_input,
            _omny_settings(settings, model),
            runs=runs,
            kv_cache_bytes=kv,
            source=_source(model, model_name),
        )
        omny.write(graph, doc, output)
    metrics["export/onnx"] = str(output)
    metrics.update(_omny_metrics(doc, output))
    return metrics


def export_for_run(config: ONNConfig, model, run_dir: Path, sample: dict[str, Any] | None = None, *,
                   tokenizer=None, engine=None) -> dict[str, Any]:  # fmt: skip
    """Write a run's model in the `export` group's format, to export.output or the run folder's export/.

    `sample` (named tensors) is what ONNX traces; language models, CLIP and image CNNs get one made
    for them when it is None (export.sample sets its batch size and sequence length)."""
    from onn.export.onnx_export import sample_inputs

    settings: SafetensorsExport | OnnxExport | OmnyExport = config.export
    kind = settings.name
    default = {"safetensors": "hf", "onnx": "model.onnx", "omny": "model.omny"}[kind]
    output = Path(settings.output or Path(run_dir) / "export" / default)
    if not settings.output:
        output.parent.mkdir(parents=True, exist_ok=True)
    if sample is None and kind != "safetensors":
        shape: ExportSample = settings.sample
        plain = model.get_base_model() if hasattr(model, "get_base_model") else model  # under peft's wrapper
        sample = sample_inputs(
            plain, shape.batch_size, shape.sequence_length, shape.image_size, seed=config.seed
        )
    metrics = export_model(
        model, output, sample, settings, model_name=config.model.name, tokenizer=tokenizer, engine=engine
    )
    log.info("export: %s", {k: v for k, v in metrics.items() if not isinstance(v, dict | list)})
    return metrics


def check_settings(export: ExportConfig) -> None:
    """The export group's values, checked before a model is loaded or trained: one sentence per mistake.
    (Its keys and their types are checked by Hydra when the config is composed.)"""
    kind = export.name
    if kind == "none":
        return
    if kind not in FORMATS:
        raise UserError(f"export={kind!r} is not one of {', '.join(FORMATS)}.")

    def number(key: str, minimum: float, strict: bool = True, whole: bool = False) -> None:
        value = getattr(export, key)
        kind_ok = isinstance(value, int) if whole else isinstance(value, int | float)
        if isinstance(value, bool) or not kind_ok or value < minimum or (strict and value == minimum):
            what = "a whole number" if whole else "a number"
            bound = f"above {minimum:g}" if strict else f"{minimum:g} or more"
            raise UserError(f"export.{key}={value!r}: give {what} {bound}.")

    if kind in ("onnx", "omny"):
        number("opset", 7, strict=False, whole=True)
        number("atol", 0, strict=False)
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
                for v in value
            )
        )
        if not ok:
            example = "[4, 8]" if whole else "[2048, 1536, 4096]"
            raise UserError(
                f"export.{key}={value!r}: give a list of positive {'whole ' if whole else ''}numbers, e.g. {example}, or null."
            )


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


def _block_runs(model) -> list[list[str]] | None:
    """The LayerMap's blocks (and any other tower's), where the .omny cut points go; None when the
    model has no repeated blocks: then every cut the graph allows is kept."""
    from onn.models.layers import block_runs

    try:
        return block_runs(model)
    except UserError:
        return None


def kv_cache_bytes(model) -> dict[str, int]:
    """KV-cache bytes per token of each decoder block: keys and values of every KV head."""
    config = getattr(model, "config", None)
    archs = getattr(config, "architectures", None) or [type(model).__name__]
    if config is None or not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        return {}
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    if not heads or not hidden:
        return {}
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    itemsize = next(model.parameters()).element_size()
    runs = _block_runs(model) or []
    return {path: 2 * kv_heads * head_dim * itemsize for path in (runs[0] if runs else [])}


def _source(model, model_name: str | None) -> dict[str, Any]:
    seen, params = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            params += p.numel()
    return {"name": str(model_name or type(model).__name__), "framework": "pytorch",
            "class": type(model).__name__, "parameters": params}  # fmt: skip
