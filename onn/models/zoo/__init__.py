"""ONN's own small models, one module each, by name (registry.py: model.source `zoo:NAME`)."""

from onn.models.zoo.registry import VIDEO, ZOO, build_zoo

__all__ = ["VIDEO", "ZOO", "build_zoo"]
