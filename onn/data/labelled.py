"""Labelled media files (sounds, clips, ...): which files a source holds, their classes and splits.

A source is a folder, a .zip/.tar/.tar.gz archive of one, or a single file. Labels come from:

  folder     one folder per class, CLASS/FILE, or SPLIT/CLASS/FILE with train/ val/ test/ split folders
  a regex    matched against each file's name (data.label_from: "^(\\d+)_" reads FSDD's 3_george_7.wav as 3);
             its first group, or the whole match when it has none, is the class
  manifest   a metadata.csv or metadata.jsonl beside the files (Hugging Face's audiofolder / videofolder
             convention): a `file_name` column and a label column (data.label_column), in the source's root or
             in each split folder

`auto` takes the manifest when there is one, else the folders. A file whose extension the modality does
not read is named in the listing's `unknown` (never passed over in silence); text sidecars (README.md,
notes.txt, the manifest itself) are not data and pass quietly. Archives are read in place, and member names
that are absolute or climb out with '..' are refused and named.
"""

from __future__ import annotations

import errno
import io
import logging
import os
import posixpath
import re
import threading
import unicodedata
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from onn.data.files import (
    ARCHIVE_ERRORS,
    archive_kind,
    csv_objects,
    existing_source,
    is_hidden,
    iter_members,
    jsonl_objects,
    reported,
    walk_files,
)
from onn.errors import UserError

log = logging.getLogger("onn")

SPLITS = {"train": "train", "test": "test", "val": "val", "valid": "val", "validation": "val"}
SIDECARS = frozenset(
    {".txt", ".md", ".csv", ".tsv", ".json", ".jsonl", ".yaml", ".yml", ".log", ".rst", ".html", ".pdf"}
)
MANIFESTS = ("metadata.csv", "metadata.jsonl")
FILE_COLUMNS = ("file_name", "filename", "file", "path")
FOLDER_LAYOUT = "CLASS/FILE, or train/CLASS/FILE and test/CLASS/FILE (val/ too)"
KEPT_OPEN = 8  # zip archives whose handles ZipSource keeps open


class PathSource:
    """A file on disk, opened by path (decoders read it directly)."""

    def __init__(self, path: Path):
        self.path = path

    def open(self) -> str:
        return str(self.path)


class BytesSource:
    """A file's bytes held in memory (a compressed tar has no random access: read in its one pass)."""

    def __init__(self, data: bytes):
        self.data = data

    def open(self) -> IO[bytes]:
        return io.BytesIO(self.data)


class ZipSource:
    """A zip member, read when needed, through a handle per archive and process (DataLoader workers open their own).

    A handle serves its archive while the file is unchanged: one replaced at the same path is opened again (the old
    handle read the old file's members). The last KEPT_OPEN archives keep theirs; an older one is let go and closes
    when no read still holds it, so a server decoding zip uploads does not keep every one of them open. A member the
    archive holds damaged (a bad CRC, a cut-off download, an encrypted one) is an OSError naming why, which readers
    skip, count and name as they do an unreadable file: zipfile's own error was a bare traceback."""

    _handles: dict[tuple[int, str], tuple[tuple[int, int, int], zipfile.ZipFile]] = {}
    _lock = threading.Lock()

    def __init__(self, archive: Path, member: str):
        self.archive, self.member = archive, member

    def open(self) -> IO[bytes]:
        try:
            return io.BytesIO(self._handle().read(self.member))
        except OSError:
            raise
        except ARCHIVE_ERRORS as e:
            raise OSError(errno.EIO, f"a damaged member of {self.archive.name}: {e}") from e

    def _handle(self) -> zipfile.ZipFile:
        st = os.stat(self.archive)
        key, version = (os.getpid(), str(self.archive)), (st.st_ino, st.st_size, st.st_mtime_ns)
        with self._lock:
            held = self._handles.get(key)
            if held is None or held[0] != version:
                held = (version, zipfile.ZipFile(self.archive))
                self._handles.pop(key, None)
                self._handles[key] = held
                while len(self._handles) > KEPT_OPEN:  # the oldest let go (closed once no read holds it)
                    del self._handles[next(iter(self._handles))]
            return held[1]


class TarSource:
    """A member of an uncompressed tar: its bytes sit at a fixed offset."""

    def __init__(self, archive: Path, offset: int, size: int):
        self.archive, self.offset, self.size = archive, offset, size

    def open(self) -> IO[bytes]:
        with open(self.archive, "rb") as f:
            f.seek(self.offset)
            return io.BytesIO(f.read(self.size))


@dataclass
class MediaFile:
    name: str  # relative posix name inside the source, e.g. "train/cat/1.wav"
    label: str | None  # class name; None when the source does not say (unlabelled inputs for inference)
    split: str  # train | val | test | all
    source: PathSource | BytesSource | ZipSource | TarSource


@dataclass
class Listing:
    """A whole source, listed: its files by split, the class names, and what was left out."""

    splits: dict[str, list[MediaFile]]
    classes: list[str]
    unknown: list[str] = field(default_factory=list)  # files whose extension the modality does not read
    refused: list[str] = field(default_factory=list)  # "name: why", counted with the undecodable files


def extension(name: str) -> str:
    return os.path.splitext(name)[1].lower()


def same_text(name: str) -> str:
    """A name in Unicode NFC: macOS writes "é" in file names as e + a combining accent (NFD), where a typed manifest
    or data.classes holds the one character; compared as written, the two never matched."""
    return unicodedata.normalize("NFC", name)


def sort_classes(names: Iterable[str]) -> list[str]:
    """Class names in label order: numerically when they are all whole numbers (2 before 10), else by name."""
    names = set(names)
    if names and all(re.fullmatch(r"\d+", n) for n in names):
        return sorted(names, key=int)
    return sorted(names)


def list_labelled(
    source: str | os.PathLike,
    suffixes: frozenset[str],
    *,
    label_from: str = "auto",
    label_column: str = "label",
    kind: str = "media",
    key: str = "data.source",
    allow_unlabelled: bool = False,
    known: Sequence[str] = (),
) -> Listing:
    """Every file of `source` whose extension is in `suffixes`, with its label and split (see the module doc).

    `kind` names the files in messages ("audio", "video"); allow_unlabelled: files without a label are
    kept with label None (inference) instead of being an error; `known`: class names already known (a
    checkpoint's, data.classes), which a lone top folder is read as rather than as an archive's wrapper."""
    path = existing_source(source, key, f"a folder of {kind} files, an archive of one, or one file")
    files, unknown, refused = _files(path, suffixes, key)
    if not files:
        unread = f" (left out: {', '.join((unknown + refused)[:3])})" if unknown or refused else ""
        raise UserError(f"{key} {path} holds no {kind} files ({', '.join(sorted(suffixes))}){unread}.")
    manifests = {name: src for name, src in files.items() if name.rsplit("/", 1)[-1].lower() in MANIFESTS}
    media = {name: src for name, src in files.items() if extension(name) in suffixes}
    for name in files:
        if name not in media and name not in manifests and extension(name) not in SIDECARS:
            unknown.append(name)
    if not media:
        raise UserError(
            f"{key} {path} holds no {kind} files ({', '.join(sorted(suffixes))}); found {', '.join(list(files)[:3])}."
        )
    mode = label_from or "auto"
    if mode == "auto":
        mode = "manifest" if manifests else "folder"
    if mode == "manifest" and not manifests:  # else told that a manifest it lacks names none of its files
        raise UserError(
            f"data.label_from=manifest but {key} {path} holds no {' or '.join(MANIFESTS)}; add one with file_name "
            "and label columns, or set data.label_from=auto."
        )
    if mode == "manifest":
        labelled = _manifest_labels(media, manifests, label_column, key, path, refused)
    elif mode == "folder":
        refuse_unread_classes(refused, list(media), path, key)
        labelled = _folder_labels(media, key, path, allow_unlabelled, known)
    else:
        labelled = _regex_labels(media, mode, key)
    for m in labelled:  # a class is one name however its folder or manifest spells its characters
        m.label = same_text(m.label) if m.label is not None else None
    if not allow_unlabelled:
        missing = [m.name for m in labelled if m.label is None]
        if missing:
            raise UserError(
                f"{key} {path}: {len(missing)} {kind} files have no label, e.g. {missing[0]} (labels come from "
                f"{'data.label_from=' + mode if mode not in ('folder', 'manifest') else mode + 's'}); "
                "fix the names or data.label_from, or move them out."
            )
    splits: dict[str, list[MediaFile]] = {}
    # ordered by the names as typed (NFC): a seeded hold-out takes the same files from a copy macOS wrote decomposed
    for m in sorted(labelled, key=lambda m: (same_text(m.name), m.name)):
        splits.setdefault(m.split, []).append(m)
    classes = sort_classes(m.label for m in labelled if m.label is not None)
    return Listing(splits, classes, sorted(unknown), refused)


def _files(path: Path, suffixes: frozenset[str], key: str):
    """{relative name: source} of every regular file (of an archive's members), and the refused members."""
    unknown: list[str] = []
    refused: list[str] = []
    if path.is_dir():
        return {name: PathSource(p) for name, p in walk_files(path, unreadable=refused)}, unknown, refused
    kind = archive_kind(path)
    if kind is None or extension(path.name) in suffixes:  # one file (a .wav is never an archive)
        return {path.name: PathSource(path)}, unknown, refused
    files: dict[str, PathSource | BytesSource | ZipSource | TarSource] = {}
    try:
        for member in iter_members(path, kind):
            if member.name is None:
                if reported(member, lambda raw: _listed(raw, suffixes)):
                    refused.append(f"{member.raw}: {member.problem}")
                continue
            if is_hidden(member.name):
                continue
            wanted = _listed(member.name, suffixes)
            if kind == "zip":
                files[member.name] = ZipSource(path, member.raw)
            elif kind == "tar":
                files[member.name] = TarSource(path, member.offset, member.size)
            else:
                with member.open() as f:  # a compressed tar streams: keep the bytes now
                    files[member.name] = BytesSource(f.read() if wanted else b"")
    except ARCHIVE_ERRORS as e:
        raise UserError(f"{key} {path} is not a readable archive: {e}") from e
    return files, unknown, refused


def _listed(name: str, suffixes: frozenset[str]) -> bool:
    """Whether a file is one a listing reads: a media file or a manifest."""
    return extension(name) in suffixes or name.rsplit("/", 1)[-1].lower() in MANIFESTS


def _strip_wrapper(names: list[str], known: Sequence[str] = ()) -> int:
    """How many leading folders every name shares that are neither split nor class folders (an archive's
    top folder): 1 when all names start with the same folder and sit at least two folders deeper. A top folder
    named as one of the `known` classes (a checkpoint's, data.classes) is kept: a folder of one class folder in
    the CLASS/SESSION/FILE layout, whose sessions were otherwise taken for its classes."""
    top = _lone_top(names)
    if top is None or same_text(top) in {same_text(str(c)) for c in known}:
        return 0
    log.info("the one top folder %s/ holding every file is read as a wrapper, the class folders inside it", top)
    return 1


def _lone_top(names: list[str]) -> str | None:
    """The one top folder every name shares, at least two folders above each file and not a split: a wrapper
    unless it is a known class (_strip_wrapper)."""
    parts = [n.split("/") for n in names]
    top = parts[0][0]
    if {p[0] for p in parts} == {top} and top.lower() not in SPLITS and min(len(p) for p in parts) >= 3:
        return top
    return None


def kept_class_folder(source: str | os.PathLike, suffixes: frozenset[str], known: Sequence[str]) -> str | None:
    """The lone top folder of `source` that a folder listing keeps as a class because it is one of `known`, else
    None: the one way known classes change a listing, so the decoded cache's key names it and only it (an eval of
    a checkpoint, which knows its classes, reads the cache its training wrote)."""
    path = Path(source)
    if not known or not path.exists():
        return None
    try:
        if path.is_dir():
            names = [n for n, _ in walk_files(path, unreadable=[])]
        elif archive_kind(path) is not None and extension(path.name) not in suffixes:
            names = [m.name for m in iter_members(path) if m.name is not None and not is_hidden(m.name)]
        else:
            return None
    except ARCHIVE_ERRORS:  # the read that follows names what is wrong with it
        return None
    names = [n for n in names if extension(n) in suffixes]
    top = _lone_top(names) if names else None
    return top if top is not None and same_text(top) in {same_text(str(c)) for c in known} else None


def refuse_unread_classes(unreadable: list[str], names: list[str], path: Path, key: str) -> None:
    """Refuse an unreadable folder where class folders sit (CLASS/, SPLIT/CLASS/, or WRAPPER/CLASS/ when all the
    names share one top folder): counted as one bad item it passed max_bad_fraction and the run trained without
    that label. `unreadable` holds walk_files' "name/: why" entries; a deeper folder counts as one item."""
    tops = {n.split("/", 1)[0] for n in names}
    wrapped = len(tops) == 1 and all(n.count("/") >= 2 for n in names)
    for entry in unreadable:
        rel, _, why = entry.partition("/: ")
        parts = rel.split("/")
        if rel == "." or not why.startswith("a folder that cannot be read"):
            continue
        if len(parts) == 1 or (len(parts) == 2 and (parts[0].lower() in SPLITS or (wrapped and tops == {parts[0]}))):
            raise UserError(
                f"{key}: the folder {path / rel} cannot be read ({why.partition('(')[2].rstrip(')')}) and holds "
                "a class or a split the run would go without; fix its permissions or move it out of the source."
            )


def _split(parts: list[str]) -> str:
    """The split a file's folders name (train/, test/, val/ first under the source or its archive's top
    folder), or "all"."""
    return SPLITS.get(parts[0].lower(), "all") if len(parts) > 1 else "all"


def split_folders(parts: list[list[str]], where: str, key: str, layout: str, nested_classes: bool = False) -> set[str]:
    """The split folders (lowercased train, val, test, ...) at the top of names split on "/", or none when there are
    none or they are classes: a split-named folder holding files directly beside class folders is a class
    (CIFAR-100's `train`). Split folders holding class folders beside other folders are refused: read as classes,
    test/ became a class of every class's test files, trained on. The rule image folders (folder.py) follow too.
    With `nested_classes` (audio and video: CLASS/SESSION/FILE) one split-named folder holding folders none of which
    is named as a top folder is a class (valid/ and invalid/ of sessions); two such (train/ and test/ beside
    background/), or test/yes/ beside yes/, are refused."""
    tops = {p[0].lower() for p in parts if len(p) >= 2}
    splits = {t for t in tops if t in SPLITS}
    if not splits or splits == tops:
        return splits
    inner = {p[1].lower() for p in parts if len(p) >= 3 and p[0].lower() in splits}
    holding = {p[0].lower() for p in parts if len(p) >= 3 and p[0].lower() in splits}
    if not inner or (nested_classes and len(holding) == 1 and not inner & (tops - splits)):
        return set()
    raise UserError(
        f"{key}: {where} mixes split folders ({', '.join(sorted(splits))}) with other folders "
        f"({', '.join(sorted(tops - splits))}); expected {layout}."
    )


def _folder_labels(
    media: dict, key: str, path: Path, allow_unlabelled: bool, known: Sequence[str] = ()
) -> list[MediaFile]:
    names = list(media)
    skip = _strip_wrapper(names, known)
    out = []
    where = f"{path}/{names[0].split('/')[0]}" if skip else str(path)
    use_splits = bool(split_folders([n.split("/")[skip:] for n in names], where, key, FOLDER_LAYOUT, True))
    for name in names:
        parts = name.split("/")[skip:]
        split = "all"
        if use_splits and len(parts) > 1:
            split, parts = SPLITS[parts[0].lower()], parts[1:]
        label = parts[0] if len(parts) >= 2 else None
        out.append(MediaFile(name, label, split, media[name]))
    if not allow_unlabelled and all(m.label is None for m in out):
        raise UserError(
            f"{key} {path} has its files in no class folders; put them in one folder per class (CLASS/FILE), "
            'name the class in the file names with data.label_from="REGEX", or add a metadata.csv manifest.'
        )
    return out


def _regex_labels(media: dict, pattern: str, key: str) -> list[MediaFile]:
    try:
        regex = re.compile(pattern)
    except re.error as e:
        raise UserError(f"data.label_from={pattern!r} is not a valid regular expression: {e}.") from e
    out, skip = [], _strip_wrapper(list(media))
    for name, src in media.items():
        parts = name.split("/")
        split = _split(parts[skip:])
        found = regex.search(parts[-1])
        # an empty match ("^([a-z]*)" on 3_george_7.wav) names no class: a class "" trained on every file
        label = ((found.group(1) if regex.groups else found.group(0)) or None) if found else None
        out.append(MediaFile(name, label, split, src))
    return out


def _manifest_rows(name: str, text: str, key: str) -> list[tuple[int, dict]]:
    if name.lower().endswith(".jsonl"):
        return jsonl_objects(text, f"{key}: {name}", "an object with file_name and a label")
    return csv_objects(text, f"{key}: {name}")


def _manifest_labels(
    media: dict, manifests: dict, column: str, key: str, path: Path, refused: list[str]
) -> list[MediaFile]:
    """Labels from metadata.csv / metadata.jsonl files: their file_name is relative to their own folder."""
    labels: dict[str, str | None] = {}
    for name, src in sorted(manifests.items()):
        opened = src.open()
        raw = Path(opened).read_bytes() if isinstance(opened, str) else opened.read()
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            raise UserError(f"{key}: {name} is not UTF-8 text: {e}.") from e
        folder = name.rsplit("/", 1)[0] + "/" if "/" in name else ""
        for n, row in _manifest_rows(name, text, key):
            file = next((row[c] for c in FILE_COLUMNS if row.get(c)), None)
            if file is None:
                raise UserError(
                    f"{key}: {name} line {n} has no file_name; the manifest needs file_name and {column} columns."
                )
            if column not in row:
                raise UserError(
                    f"{key}: {name} line {n} has no {column!r} column (it has {', '.join(row)}); set data.label_column."
                )
            target = same_text(_manifest_target(folder, str(file), f"{key}: {name} line {n}"))
            value = row[column]
            label = None if value in (None, "") else str(value)
            if labels.get(target, label) != label:  # a file labelled twice: which row is right is the user's call
                raise UserError(
                    f"{key}: {name} line {n} labels {target} {label!r}, which an earlier row labels "
                    f"{labels[target]!r}; keep one row for each file."
                )
            labels[target] = label
    out, skip = [], _strip_wrapper(list(media))
    for name, src in media.items():
        if same_text(name) in labels:
            out.append(MediaFile(name, labels[same_text(name)], _split(name.split("/")[skip:]), src))
    listed = {same_text(name) for name in media}
    refused += [f"{t}: named in the manifest but not in {path}" for t in labels if t not in listed]
    left = [n for n in media if same_text(n) not in labels]
    if left:
        log.warning(
            "%s %s: %d files are not in the manifest and are left out, e.g. %s",
            key,
            path,
            len(left),
            ", ".join(left[:3]),
        )
    if not out:
        raise UserError(f"{key} {path}: the manifest names none of the files beside it; check its file_name column.")
    return out


def _manifest_target(folder: str, file: str, where: str) -> str:
    """A manifest's file_name as a name in the source: relative to the manifest's folder, "./" and "a/../" resolved
    as paths (".hidden/x.wav" stays hidden). A name that leads out of the source is one sentence naming the line."""
    joined = posixpath.normpath(posixpath.join(folder, file.replace("\\", "/")))
    if file.startswith(("/", "\\")) or joined == ".." or joined.startswith("../"):
        raise UserError(
            f"{where} has file_name {file!r}, which leads out of data.source; name each file relative to the "
            "manifest's folder, inside data.source."
        )
    return joined


def report_left_out(listing: Listing, path: str, key: str, kind: str) -> None:
    """Name the files of unknown types (left out, not counted as bad) in one warning."""
    if listing.unknown:
        log.warning(
            "%s %s: %s not %s this modality reads, left out: %s",
            key,
            path,
            _count(len(listing.unknown), "file is", "files are"),
            kind,
            _names(listing.unknown),
        )


def check_bad(
    skipped: list[str],
    total: int,
    max_bad_fraction: float,
    path,
    key: str,
    items: str,
    problem: str = "could not be decoded",
) -> None:
    """Name the items that could not be used (`items`: "images", "audio files", ...) in one warning, or refuse
    when more than data.max_bad_fraction of them are: every reader of files skips, counts and names them so."""
    if not skipped:
        return
    if len(skipped) >= total or len(skipped) / total > max_bad_fraction:
        raise UserError(
            f"{key} {path}: {len(skipped)} of {total} {items} {problem} (first: {'; '.join(skipped[:3])}); fix or "
            f"remove them, or set data.max_bad_fraction (now {max_bad_fraction}) to accept more."
        )
    log.warning("Skipped %d of %d %s in %s that %s: %s", len(skipped), total, items, path, problem, _names(skipped))


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _names(items: list[str], shown: int = 10) -> str:
    return "; ".join(items[:shown]) + (f"; and {len(items) - shown} more" if len(items) > shown else "")


SNIFF_WALKED = 50  # names walked per sampled file at most: a sniff of a huge folder stops early


def sniff_files(path: Path, suffixes: frozenset[str], kind: str, one: str, limit: int = 200) -> str | None:
    """Why `path` holds `kind` files (e.g. "audio files (30 of 30 files sampled)", or `one` for a single file)
    when at least half of a sample of up to `limit` of its data files have one of `suffixes`; else None. A folder's
    sample is spread over its subfolders (see _spread_sample); a zip or tar archive is voted on by its first
    members' names. Sidecars and hidden files do not count; names only are read, never contents (for data=auto)."""
    if path.is_file():
        if extension(path.name) in suffixes:
            return one
        names, where = _member_names(path, limit), "an archive of "
        if names is None:
            return None
    elif path.is_dir():
        names, where = _spread_sample(path, limit), ""
    else:
        return None
    names = [name for name in names if extension(name) not in SIDECARS]
    found = sum(extension(n) in suffixes for n in names)
    if not found or found * 2 < len(names):
        return None
    return f"{where}{kind} files ({found} of {len(names)} files sampled)"


def _spread_sample(path: Path, limit: int) -> list[str]:
    """Up to `limit` data file names under `path`, taken in turn from each folder that holds files. The first
    `limit` in walk order let one side folder that sorts first (201 WAVs in _notes/ beside 600 PNGs in
    train/cat and train/dog) outvote the rest. The walk is lazy and stops after limit * SNIFF_WALKED names."""
    from itertools import chain, islice, zip_longest

    by_folder: dict[str, list[str]] = {}
    # a folder it cannot list is named by the listing that reads it: every sniffer saying so repeated one warning
    for name, _ in islice(walk_files(path, unreadable=[]), limit * SNIFF_WALKED):
        if extension(name) not in SIDECARS:
            kept = by_folder.setdefault(posixpath.dirname(name), [])
            if len(kept) < limit:
                kept.append(name)
    turns = chain.from_iterable(zip_longest(*by_folder.values()))
    return list(islice((name for name in turns if name is not None), limit))


SNIFFED_COMPRESSED = 16  # members of a compressed tar named for a sniffer: each is decompressed to reach the next


def _member_names(path: Path, limit: int) -> list[str] | None:
    """The names of the first `limit` members of a zip or tar (hidden ones left out), or None for a file that is
    neither or cannot be listed. A compressed tar is read front to back, so only its first few are taken."""
    from itertools import islice

    kind = archive_kind(path)
    if kind is None:
        return None
    count = limit if kind in ("zip", "tar") else min(limit, SNIFFED_COMPRESSED)
    try:
        members = list(islice(iter_members(path, kind), count))
    except ARCHIVE_ERRORS:
        return None
    return [m.name or m.raw for m in members if not is_hidden(m.name or m.raw)]
