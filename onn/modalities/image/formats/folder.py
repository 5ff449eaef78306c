"""folder and archive: CLASS/IMAGE or SPLIT/CLASS/IMAGE trees, on disk or in a zip or tar read in place.

A file is an image when its extension says so (common.is_image_name) or, when the extension does not say
(common.needs_sniffing), its magic bytes do (common.image_kind); everything else (README.txt, labels.csv,
.DS_Store) is passed over quietly. Archive
members with an absolute or '..' path are not read: they are reported with the undecodable images.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from onn.data.files import ARCHIVE_ERRORS, archive_kind, is_hidden, iter_members, read_head, reported, walk_files
from onn.data.labelled import refuse_unread_classes, same_text, sort_classes, split_folders
from onn.errors import UserError
from onn.modalities.image.formats.common import (
    HELP,
    IMAGE_EXTS,
    LAYOUT,
    SNIFF_BYTES,
    SPLITS,
    Listing,
    MemFetch,
    PathFetch,
    Split,
    TarFetch,
    ZipFetch,
    image_kind,
    is_image_name,
    needs_sniffing,
)


def image_files(root: Path, unreadable: list[str] | None = None) -> Iterator[tuple[str, Path]]:
    """(relative name, path) of every image under a folder (see walk_files for links and hidden files). A folder
    that cannot be listed goes into `unreadable` ("name/: why"), to count with the refused files, when given."""
    for rel, path in walk_files(root, unreadable=unreadable):
        if is_image_name(rel):
            yield rel, path
            continue
        if not needs_sniffing(rel):
            continue
        try:
            head = read_head(path, SNIFF_BYTES)
        except OSError:
            continue
        if image_kind(head):
            yield rel, path


def list_tree(path: Path, key: str, allow_unlabelled: bool, stream: bool) -> Listing:
    """The splits of a folder or archive of class folders; stream: only random-access sources."""
    rejected: list[str] = []
    if path.is_dir():
        found = list(image_files(path, rejected))  # an unreadable folder below the classes counts as refused
        names = [n for n, _ in found]
        refuse_unread_classes(rejected, names, path, key)
        paths = [p for _, p in found]

        def make(idx: list[int]):
            return PathFetch([paths[i] for i in idx])

    else:
        kind = archive_kind(path)
        if kind is None:
            raise UserError(f"{key} {path} is not a folder or a .tar, .tar.gz or .zip archive; {HELP}.")
        try:
            names, make, rejected = _archive_images(path, kind, stream, key)
        except ARCHIVE_ERRORS as e:
            raise UserError(f"{key} {path} is not a readable archive: {e}") from e
    if not names:
        unread = f" (not read: {'; '.join(rejected[:3])})" if rejected else ""
        raise UserError(
            f"{key}: found no images ({', '.join(sorted(IMAGE_EXTS))}, ...) in {path}{unread}; expected {LAYOUT}."
        )
    layout, classes = _tree_layout(names, str(path), allow_unlabelled, key)
    index = {c: i for i, c in enumerate(classes)}
    splits = {}
    for split, entries in layout.items():
        entries.sort(key=lambda e: names[e[0]])
        idx = [i for i, _ in entries]
        labels = np.array([index[c] if c is not None else -1 for _, c in entries], np.int64)
        splits[split] = Split([names[i] for i in idx], labels, make(idx))
    # (a val/ or test/ class that train/ lacks is said when training starts: task=eval scores by the checkpoint's)
    return Listing(splits, classes, rejected)


def _archive_images(path: Path, kind: str, stream: bool, key: str):
    """Image member names of an archive, a maker of fetchers for a subset of them, and the members refused
    for their paths ("name: why")."""
    if kind == "targz" and stream:
        raise UserError(
            f"{key} {path} is a compressed tar, which has no random access: streaming (list_items) needs an "
            "uncompressed .tar, a .zip or a folder; unpack it or recompress it as .tar."
        )
    names: list[str] = []
    where: list[tuple[str, int | None, int]] = []  # (stored name, tar offset, size)
    blobs: list[bytes | None] = []  # a compressed tar's images, read in its one pass
    rejected: list[str] = []
    at: dict[str, int] = {}  # a name's place in names: a .tar.gz yields a name stored twice once per entry
    for m in iter_members(path, kind):
        if m.name is None:
            if reported(m, is_image_name):
                rejected.append(f"{m.raw}: {m.problem}")
            continue
        if is_hidden(m.name):
            continue
        data = None
        if not is_image_name(m.name):
            if not needs_sniffing(m.name):
                continue
            with m.open() as f:
                head = f.read(SNIFF_BYTES)
                if not image_kind(head):
                    continue
                if kind == "targz":
                    data = head + f.read()
        elif kind == "targz":
            with m.open() as f:
                data = f.read()
        if m.name in at:  # its later entry stands, as tar extracts it (see iter_members); counted once
            where[at[m.name]], blobs[at[m.name]] = (m.raw, m.offset, m.size), data
            continue
        at[m.name] = len(names)
        names.append(m.name)
        where.append((m.raw, m.offset, m.size))
        blobs.append(data)
    if kind == "zip":
        return names, lambda idx: ZipFetch(path, [where[i][0] for i in idx]), rejected
    if kind == "tar":
        return (
            names,
            lambda idx: TarFetch(path, [where[i][1] for i in idx], [where[i][2] for i in idx]),
            rejected,
        )
    return names, lambda idx: MemFetch([blobs[i] for i in idx]), rejected


def _tree_layout(names: list[str], where: str, allow_unlabelled: bool, key: str):
    """Split -> [(index, class or None)] and the sorted classes, from CLASS/IMAGE or SPLIT/CLASS/IMAGE."""
    parts = [n.split("/") for n in names]
    firsts = {p[0] for p in parts}
    # one wrapping top folder over class folders; one folder of images is a class (task.input of one class's folder
    # has its truth; infer gives none to a wrapper the model has no class of)
    if len(firsts) == 1 and parts[0][0].lower() not in SPLITS and min(len(p) for p in parts) >= 3:
        parts = [p[1:] for p in parts]
        where = f"{where}/{names[0].split('/')[0]}"
    # CLASS/IMAGE with a class named like a split (CIFAR-100's `train`) holding images; split folders beside classes
    split_tops = split_folders(parts, where, key, LAYOUT)
    groups: dict[str, list[int]] = {}
    depth = 1 if split_tops else 0
    for i, p in enumerate(parts):
        if depth == 0:
            groups.setdefault("all", []).append(i)
        elif len(p) >= 2:
            groups.setdefault(SPLITS[p[0].lower()], []).append(i)
    out: dict[str, list[tuple[int, str | None]]] = {}
    for split, idx in groups.items():
        # a class is one name however its folder spells its characters (macOS writes "é" decomposed: same_text)
        labelled = [(i, same_text(parts[i][depth])) for i in idx if len(parts[i]) >= depth + 2]
        if labelled:
            out[split] = labelled
        elif allow_unlabelled:
            out[split] = [(i, None) for i in idx]
        else:
            folder = f"{where}/{parts[idx[0]][0]}" if depth else where
            raise UserError(
                f"{key}: found no class folders in {folder}, only images; expected {LAYOUT} (for predictions on "
                "unlabelled images use task=infer task.input=PATH)."
            )
    kept = {i for entries in out.values() for i, _ in entries}
    loose = [names[i] for i in range(len(names)) if i not in kept]
    if loose:
        raise UserError(
            f"{key}: {len(loose)} image(s) in {where} sit in no class folder beside images that do, e.g. "
            f"{loose[0]}; move them into their class's folder or out of the source (expected {LAYOUT})."
        )
    # 2 before 10, as labelled files sort them: folders 0..11 trained as 0, 1, 10, 11, 2, ...
    classes = sort_classes({c for entries in out.values() for _, c in entries if c is not None})
    return out, classes
