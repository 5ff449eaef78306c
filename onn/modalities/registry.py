"""The modalities ONN knows, by name: each modality's package registers one here when imported.

register(VideoModality())       # in onn/modalities/video/__init__.py
get("video"), all_modalities()  # app and the tasks, by the data config's `modality` key
detect(path)                    # data=auto: the modality whose sniffer recognises what a path holds
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

from onn.data.files import existing_source, walk_files
from onn.errors import UserError
from onn.modalities.base import Modality

REGISTRY: dict[str, Modality] = {}


def register(modality: Modality) -> Modality:
    """Make a modality known by its name; its package's __init__ calls this."""
    if not modality.name:
        raise ValueError(f"{type(modality).__name__} has no name")
    REGISTRY[modality.name] = modality
    return modality


def all_modalities() -> list[Modality]:
    return list(REGISTRY.values())


def get(name: str) -> Modality:
    """The modality called `name`; a UserError naming the known ones otherwise."""
    if name not in REGISTRY:
        raise UserError(f"data.modality={name!r} is not one of {', '.join(sorted(REGISTRY))}.")
    return REGISTRY[name]


def detect(source: str | os.PathLike, model_schema: type | None = None) -> tuple[Modality, str]:
    """The modality whose sniffer recognises `source` (`data=auto`), and why. Only regular files and
    folders are read, a bounded number of bytes each; the more specific modalities ask first. Where several
    read it (a folder of meshes: mesh data, or graphs), the one whose models are of `model_schema` (the type of
    the model the command line names) wins."""
    text = str(source)
    if text.startswith("builtin:"):
        name = text.partition(":")[2]
        for modality in REGISTRY.values():
            if name in modality.builtins:
                return modality, f"ONN's built-in generator {text}"
        known = ", ".join(f"builtin:{b}" for m in REGISTRY.values() for b in m.builtins)
        raise UserError(f"data.source={text} is no built-in dataset; the built-ins are {known}.")
    path = Path(os.path.expanduser(text))
    existing_source(path, "data.source")  # a link loop, a device, a pipe: one sentence, nothing read
    first = None
    for modality in sorted(REGISTRY.values(), key=lambda m: -m.sniff_priority):
        if first is not None and modality.model_schema is not model_schema:
            continue  # only a modality of the named model's kind can still win
        reason = modality.sniff(path)
        if reason and (model_schema is None or modality.model_schema is model_schema):
            return modality, reason
        first = first or ((modality, reason) if reason else None)
    if first is not None:
        return first
    known = ", ".join(m.description for m in REGISTRY.values())
    raise UserError(
        f"data.source={text}: no modality recognises what it holds{_unread(path)} ({known}); choose the data config "
        "with data=NAME."
    )


def _unread(path: Path) -> str:
    """' (not read: FOLDER/: why)' for the folders of a source's first two levels that cannot be listed: the
    sniffers pass them over quietly, and a source whose root cannot be read looked merely unrecognised."""
    unreadable: list[str] = []
    if path.is_dir():
        for _ in itertools.islice(walk_files(path, max_depth=2, unreadable=unreadable), 10_000):
            pass
    named = [f"{path / rel}/: {why}" for rel, _, why in (e.partition("/: ") for e in unreadable[:3])]
    return f" (not read: {'; '.join(named)})" if named else ""
