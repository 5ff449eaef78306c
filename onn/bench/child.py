"""A run's config across a process boundary: the benches that measure in a fresh interpreter (suite, giant)
send it as plain JSON (`as_dict`) and the child rebuilds the typed config from it here."""

from __future__ import annotations

from typing import Any

from onn.config import ONNConfig, typed
from onn.config.registry import SCHEMAS

# the groups whose type is the option's schema, not the root's field type (ModelConfig, TaskConfig, ...)
_OPTION_GROUPS = ("model", "data", "task", "export")


def config_from_dict(values: dict[str, Any], task_schema: type, where: str) -> ONNConfig:
    """`values` (as_dict of an ONNConfig) as the ONNConfig again: model and data as the data's modality types
    them, the task as `task_schema` (the child knows which task sent it), export by its name."""
    from onn.modalities import get

    modality = get(values["data"]["modality"])
    schemas = {
        "model": modality.model_schema,
        "data": modality.data_schema,
        "task": task_schema,
        "export": SCHEMAS["export"][values["export"]["name"]],
    }
    root = {k: ({"name": v["name"]} if k in _OPTION_GROUPS else v) for k, v in values.items()}
    config = typed(ONNConfig, root, where)
    for group, schema in schemas.items():
        setattr(config, group, typed(schema, values[group], f"{where}: {group}"))
    return config
