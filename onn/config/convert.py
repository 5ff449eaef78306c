"""The two ways a config changes form: to a plain dict (config.yaml, checkpoints, digests) and back from one
(a checkpoint's saved config)."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from onn.errors import UserError

T = TypeVar("T")


def as_dict(config: Any) -> Any:
    """A config (or any part of one) as plain dicts and lists: what YAML, JSON and checkpoints hold."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return {f.name: as_dict(getattr(config, f.name)) for f in dataclasses.fields(config)}
    if isinstance(config, dict):
        return {k: as_dict(v) for k, v in config.items()}
    if isinstance(config, list | tuple):
        return [as_dict(v) for v in config]
    return config


def typed(schema: type[T], values: Any, where: str) -> T:
    """`values` (a dict, e.g. a checkpoint's saved config) as an instance of `schema`, checked as Hydra checks
    a composed config: an unknown key or a wrong type is one sentence naming `where`."""
    if isinstance(values, schema):
        return values
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), as_dict(values)))
    except OmegaConfBaseException as e:
        raise UserError(f"{where}: {str(e).splitlines()[0]}") from None
