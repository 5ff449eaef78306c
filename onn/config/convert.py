"""The two ways a config changes form: to a plain dict (config.yaml, checkpoints, digests) and back from one
(a checkpoint's saved config)."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from onn.config.model import DenoiserConfig, NetworkConfig
from onn.config.strategy import StrategyConfig
from onn.errors import UserError

T = TypeVar("T")
# Keys a schema no longer has, which nothing read (strategy=qlora is NF4 by its name; a classifier's or a denoiser's
# weights are float32): a checkpoint written before holds them in its saved config, and still loads.
RETIRED: dict[type, tuple[str, ...]] = {
    StrategyConfig: ("trainable", "quantize"),
    NetworkConfig: ("dtype",),
    DenoiserConfig: ("dtype",),
}


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
    values = as_dict(values)
    if isinstance(values, dict):
        retired = {key for kind, keys in RETIRED.items() if issubclass(schema, kind) for key in keys}
        values = {k: v for k, v in values.items() if k not in retired}
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), values))
    except OmegaConfBaseException as e:
        raise UserError(f"{where}: {str(e).splitlines()[0]}") from None
