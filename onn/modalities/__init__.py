"""The modalities ONN knows (registry.py): one package each in this folder, each registering itself."""

from __future__ import annotations

import importlib
import pkgutil

from onn.modalities.base import ClassifierModality, Job, Modality
from onn.modalities.registry import REGISTRY, all_modalities, detect, get, register

__all__ = ["REGISTRY", "ClassifierModality", "Job", "Modality", "all_modalities", "detect", "get", "register"]

# Adding a modality adds a folder: each package's __init__ registers its Modality (onn/modalities/base.py).
for _info in pkgutil.iter_modules(__path__):
    if _info.ispkg:
        importlib.import_module(f"{__name__}.{_info.name}")
