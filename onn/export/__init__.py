"""Export a model (write.py): safetensors, onnx or omny; the settings checked first (settings.py)."""

from __future__ import annotations

from onn.export.model_facts import kv_cache_bytes
from onn.export.settings import FORMATS, check_settings
from onn.export.write import export_for_run, export_model

__all__ = [
    "FORMATS",
    "check_settings",
    "export_model",
    "export_for_run",
    "enrich_onnx",
    "inspect_omny",
    "validate",
    "kv_cache_bytes",
]


def __getattr__(name: str):
    """enrich_onnx, inspect_omny and validate live in onn.export.omny; imported on first use, so
    `python -m onn.export.omny` does not import that module twice."""
    if name in ("enrich_onnx", "inspect_omny", "validate"):
        from onn.export import omny

        return getattr(omny, name)
    raise AttributeError(f"module 'onn.export' has no attribute {name!r}")
