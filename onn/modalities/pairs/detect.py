"""Finding pairs in what a user hands over, by the two conventions users already follow.

Shared stems (webdataset's convention): files whose names match up to the last dot are one sample,
`0001.jpg` + `0001.txt`, `clip7.wav` + `clip7.obj`, in a folder tree or inside tar shards (a shard's
members pair only with members of the same shard). Which modality a file holds is asked of the
registered modalities' sniffers, once per suffix, with one example file (sides.modality_of).

Metadata (Hugging Face's imagefolder/audiofolder convention): a `metadata.jsonl` or `metadata.csv`
whose rows name a file in `file_name` (relative to the metadata's folder) and give its partner in
another column: a caption (data.text_column, or the first text column), or a second file in a
`*_file_name` column.

The two modalities are those that most samples have both of (or data.modalities). Files of either
that have no partner are orphans: training goes on with the complete pairs, and the orphans are
counted and a few named. Files of neither are left out and counted too.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from dataclasses import dataclass, field
from itertools import combinations, zip_longest
from pathlib import Path
from typing import Any, BinaryIO

from onn.data.files import (
    ARCHIVE_ERRORS,
    UnsafeMemberNameError,
    archive_kind,
    clean_member_name,
    csv_objects,
    existing_source,
    iter_members,
    jsonl_objects,
    read_file,
    read_head,
    walk_files,
)
from onn.errors import UserError
from onn.modalities.pairs.sides import TEXT, TEXT_SUFFIXES, modality_of, modality_of_bytes

log = logging.getLogger("onn")

METADATA = ("metadata.jsonl", "metadata.csv")
SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")
SNIFF_FILES = 20_000  # data=auto looks at this many files at most
SNIFF_BYTES = 1 << 16  # and at most this much of a metadata file
EXAMPLE_BYTES = 64 << 20  # of the first shard member of a suffix, read to learn the suffix's modality
CAPTION_BYTES = 64 << 10  # a shard's text member held in its entry at most; a longer one is keyed by its sha256
NAMED = 5  # orphans named in a summary
# a class, not a caption (Hugging Face's audiofolder/imagefolder classification manifests): a folder of files with
# these beside file_name is classification data, which data=auto took for file-text pairs
LABEL_COLUMNS = ("label", "labels")
CAPTION_COLUMNS = ("text", "caption", "description", "transcription", "sentence")  # preferred, in this order
LAYOUT = (
    "pairs of files that share a name up to the extension (0001.jpg + 0001.txt), in folders or .tar shards, "
    "or a metadata.jsonl/metadata.csv with file_name and a caption column"
)


@dataclass
class Entry:
    """One item of a pair: a file, a member of a tar shard, or a metadata column's text."""

    name: str  # as messages show it: the path under the source (shard members: shard.tar/member)
    path: Path | None = None
    shard: Path | None = None
    member: str | None = None  # the member's name as stored in the shard
    text: str | None = None
    data: bytes | None = None  # a shard's caption member's bytes, read as the shard is listed (see _shard_items)
    digest: str | None = None  # a shard's text member too long to hold: the sha256 of its bytes, read as listed


@dataclass
class Listing:
    """The complete pairs found in a source, and what was left over."""

    how: str  # "shared file stems" or "metadata.jsonl (file_name + text)"
    modalities: tuple[str, str]
    keys: list[str] = field(default_factory=list)  # one per complete pair
    entries: dict[str, list[Entry]] = field(default_factory=dict)  # per modality, in the order of keys
    orphans: dict[str, list[str]] = field(default_factory=dict)  # per modality: items without a partner
    left_out: list[str] = field(default_factory=list)  # files of neither modality, and duplicates
    notes: list[str] = field(default_factory=list)  # a damaged shard, ...
    partial: bool = False  # only the first SNIFF_FILES files were looked at

    @property
    def complete(self) -> int:
        return len(self.keys)

    @property
    def orphan_count(self) -> int:
        return sum(len(names) for names in self.orphans.values())

    def summary(self) -> str:
        a, b = self.modalities
        text = f"{self.complete}{'+' if self.partial else ''} complete {a}-{b} pairs by {self.how}"
        orphans = [
            n for names in zip_longest(*self.orphans.values()) for n in names if n is not None
        ]  # each side in turn
        if orphans:
            counts = ", ".join(f"{len(self.orphans[m])} {m}" for m in self.modalities if self.orphans.get(m))
            text += f"; {len(orphans)} items have no partner ({counts}; e.g. {', '.join(orphans[:NAMED])})"
        if self.left_out:
            text += f"; {len(self.left_out)} other files left out (e.g. {', '.join(self.left_out[:3])})"
        return text + "".join(f"; {note}" for note in self.notes)


def find_pairs(
    source: str | Path,
    modalities: Any = "auto",
    text_column: str = "auto",
    limit: int | None = None,
    key: str = "data.source",
) -> Listing:
    """The pairs in a folder, a tar shard or a metadata file. `limit`: look at that many files at most
    (data=auto's quick look). A source with no pair at all is one UserError naming what it holds."""
    path = existing_source(Path(str(source)).expanduser(), key, LAYOUT)
    wanted = wanted_modalities(modalities)
    if path.is_file() and path.name.lower() in METADATA:
        return _from_metadata([path], path.parent, wanted, text_column, limit, key)
    if path.is_file():
        if not _is_shard(path):
            raise UserError(f"{key} {path} is not a folder, a .tar shard or a metadata.jsonl/.csv; expected {LAYOUT}.")
        return _by_stem([(path.name, path)], wanted, limit)
    metadata, files = [], []
    # a quick look (limit) stays silent on a folder it cannot list: the listing that reads the source names it
    for rel, full in walk_files(path, unreadable=[] if limit is not None else None):
        if full.name.lower() in METADATA:
            metadata.append(full)
        else:
            files.append((rel, full))
        if limit is not None and len(files) >= limit:
            break
    if metadata:
        return _from_metadata(metadata, path, wanted, text_column, limit, key, files)
    return _by_stem(files, wanted, limit)


def wanted_modalities(modalities: Any) -> tuple[str, str] | None:
    if modalities in (None, "auto"):
        return None
    names = list(modalities) if isinstance(modalities, list | tuple) else [modalities]
    if len(names) != 2 or len(set(names)) != 2 or not all(isinstance(n, str) for n in names):
        raise UserError(f"data.modalities={modalities!r}: give two different modalities, e.g. [image, text], or auto.")
    return names[0], names[1]


def _is_shard(path: Path) -> bool:
    return path.name.lower().endswith(SHARD_SUFFIXES) and archive_kind(path) in ("tar", "targz")


def _suffix(name: str) -> str:
    base = name.rsplit("/", 1)[-1]
    return "." + base.rsplit(".", 1)[1].lower() if "." in base.strip(".") else ""


# ---------------------------------------------------------------------------------------------------------
# Shared stems


def _by_stem(files: list[tuple[str, Path]], wanted: tuple[str, str] | None, limit: int | None) -> Listing:
    items: list[tuple[str, str, Entry]] = []  # (key, suffix, entry)
    examples: dict[str, Path | bytes] = {}
    notes: list[str] = []
    for rel, full in files:
        if _is_shard(full):
            _shard_items(rel, full, items, examples, notes, limit)
            continue
        suffix = _suffix(rel)
        if suffix:
            items.append((rel[: -len(suffix)], suffix, Entry(rel, path=full)))
            examples.setdefault(suffix, full)
    kinds = {s: (modality_of(s, e) if isinstance(e, Path) else modality_of_bytes(s, e)) for s, e in examples.items()}
    groups: dict[str, dict[str, list[Entry]]] = {}
    left_out = []
    for key, suffix, entry in items:
        if kinds[suffix] is None:
            left_out.append(entry.name)
        else:
            groups.setdefault(key, {}).setdefault(kinds[suffix], []).append(entry)
    pair = wanted or _most_paired(groups)
    listing = Listing(
        "shared file stems", pair, left_out=left_out, notes=notes, partial=limit is not None and len(files) >= limit
    )
    _collect(listing, groups)
    return listing


def _shard_items(rel: str, shard: Path, items: list, examples: dict, notes: list[str], limit: int | None) -> None:
    """The members of a tar shard as (key, suffix, entry); a damaged shard keeps the members before the damage. A
    caption member's bytes are read here, into its entry (a long one's sha256 instead): keyed by its name, a caption
    rewritten in a shard of the same size and mtime was read from the stale decoded cache."""
    count = 0
    try:
        for member in iter_members(shard):
            if member.name is None:
                notes.append(f"{rel}: member {member.raw} not read ({member.problem})")
                continue
            suffix = _suffix(member.name)
            if not suffix:
                continue
            data = digest = None
            if suffix in TEXT_SUFFIXES:  # a caption's bytes key the decoded cache and its identity, not its name
                with member.open() as f:
                    head, data, digest = _text_member(f)
                examples.setdefault(suffix, head)
            elif suffix not in examples:  # a longer member's head: a 100 MB video's suffix was not known (a KeyError)
                with member.open() as f:
                    examples[suffix] = f.read(EXAMPLE_BYTES)
            items.append(
                (
                    f"{rel}/{member.name[: -len(suffix)]}",
                    suffix,
                    Entry(f"{rel}/{member.name}", shard=shard, member=member.raw, data=data, digest=digest),
                )
            )
            count += 1
            if limit is not None and count >= limit:
                return
    except ARCHIVE_ERRORS as e:
        notes.append(
            f"shard {rel} is damaged after {count} members ({type(e).__name__}: {e}); the rest of it is left out"
        )


def _text_member(f: BinaryIO) -> tuple[bytes, bytes | None, str | None]:
    """(head, bytes, None) of a text member up to CAPTION_BYTES long, else (head, None, its sha256) streamed: a
    shard's 40 MiB .txt members were held whole for the run. The head, CAPTION_BYTES at most, is for sniffing."""
    head = f.read(CAPTION_BYTES + 1)
    if len(head) <= CAPTION_BYTES:
        return head, head, None
    h = hashlib.sha256(head)
    while chunk := f.read(1 << 20):
        h.update(chunk)
    return head[:CAPTION_BYTES], None, h.hexdigest()


def _most_paired(groups: dict[str, dict[str, list[Entry]]]) -> tuple[str, str]:
    """The two modalities that most samples hold both of."""
    counts: Counter = Counter()
    for found in groups.values():
        for pair in combinations(sorted(found), 2):
            counts[pair] += 1
    if not counts:
        kinds = Counter(m for found in groups.values() for m in found)
        held = ", ".join(f"{n} {m}" for m, n in kinds.most_common()) or "no file of a known modality"
        raise UserError(
            f"found no pairs: no two files of different modalities share a name ({held}); expected {LAYOUT}."
        )
    best = max(counts.values())
    return min(p for p, n in counts.items() if n == best)


def _collect(listing: Listing, groups: dict[str, dict[str, list[Entry]]]) -> None:
    """Fill the listing's complete pairs, orphans and left-out files from samples grouped by key."""
    a, b = listing.modalities
    listing.entries = {a: [], b: []}
    listing.orphans = {a: [], b: []}
    for key in sorted(groups):
        found = groups[key]
        for modality, entries in found.items():
            if modality not in (a, b):
                listing.left_out += [e.name for e in entries]
        if a in found and b in found:
            listing.keys.append(key)
            for modality in (a, b):
                first, *extra = sorted(found[modality], key=lambda e: e.name)
                listing.entries[modality].append(first)
                listing.left_out += [f"{e.name} (a second {modality} of {key})" for e in extra]
        else:
            for modality in (a, b):
                listing.orphans[modality] += [e.name for e in found.get(modality, [])]


# ---------------------------------------------------------------------------------------------------------
# metadata.jsonl / metadata.csv


class UnreadableMetadata(UserError):
    """A metadata.csv / metadata.jsonl that cannot be read (not UTF-8, a malformed line). data=auto says so,
    rather than read the folder beside it as another modality."""


def _rows(meta: Path, limit: int | None) -> list[tuple[int, dict[str, Any]]]:
    """(line number, row) of a metadata file; at most SNIFF_BYTES of it when limit is set."""
    raw = read_head(meta, SNIFF_BYTES) if limit is not None else read_file(meta)
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        if limit is None or e.start < len(raw) - 4:
            raise UnreadableMetadata(f"{meta} is not UTF-8 text (byte {e.start}); save it as UTF-8.") from None
        text = raw[: e.start].decode("utf-8-sig")
    cut = limit is not None and len(raw) == SNIFF_BYTES
    if cut:
        text = text.rsplit("\n", 1)[0]  # the last line may be cut
    try:
        if meta.name.lower().endswith(".csv"):  # a cut head may leave a quoted field over several lines open
            return csv_objects(text, str(meta), whole=not cut)
        return jsonl_objects(text, str(meta), "an object with file_name")
    except UserError as e:
        raise UnreadableMetadata(str(e)) from None


def _from_metadata(
    metas: list[Path],
    root: Path,
    wanted: tuple[str, str] | None,
    text_column: str,
    limit: int | None,
    key: str,
    files: list[tuple[str, Path]] = (),
) -> Listing:
    rows = [(meta, number, row) for meta in sorted(metas) for number, row in _rows(meta, limit)]
    where = ", ".join(sorted({m.name for m in metas}))
    file_columns, columns_used = _used_columns(rows, text_column, where, key)
    examples: dict[str, Path] = {}
    samples: list[tuple[str, dict[str, Entry]]] = []  # (key, column -> entry)
    named: set[Path] = set()
    orphans_by_column: dict[str, list[str]] = {c: [] for c in columns_used}
    absent: list[str] = []  # "metadata.jsonl line 3: images/3.png does not exist", of each named file not found
    for meta, number, row in rows:
        label = f"{meta.relative_to(root) if meta.is_relative_to(root) else meta.name} line {number}"
        sample: dict[str, Entry] = {}
        why: dict[str, str] = {}  # per column without an entry: why not
        for column in columns_used:
            value = row.get(column)
            if column in file_columns:
                entry = _file_entry(meta.parent, value, root)
                if isinstance(entry, Entry):
                    named.add(entry.path.resolve())
                    examples.setdefault(_suffix(entry.name), entry.path)
                    sample[column] = entry
                elif entry is not None:
                    why[column] = f"its {column} is missing: {value.strip()} {entry}"
                    absent.append(f"{label}: {value.strip()} {entry}")
            elif isinstance(value, str) and value.strip():
                sample[column] = Entry(f"{label} ({column})", text=value)
        if len(sample) == 2:
            samples.append((label, sample))
        else:
            for column, entry in sample.items():
                missing = next(c for c in columns_used if c not in sample)
                orphans_by_column[column].append(f"{entry.name} ({why.get(missing, f'its {missing} is missing')})")
    if not samples and absent:  # every row's file is absent: a folder moved, or paths relative to another place
        raise UnreadableMetadata(
            f"{key}: none of the {len(absent)} files {where} names is there (e.g. {absent[0]}); file_name paths are "
            f"relative to the metadata file's folder ({metas[0].parent}): fix them or move the files there."
        )
    kinds = {c: _column_modality(c, file_columns, samples, examples) for c in columns_used}
    pair = _paired_modalities(kinds, columns_used, wanted, where, key)
    how = f"{where} ({' + '.join(columns_used)})"
    listing = Listing(how, pair, partial=limit is not None)
    by_modality = {kinds[c]: c for c in columns_used}
    listing.entries = {m: [s[by_modality[m]] for _, s in samples] for m in pair}
    listing.keys = [label for label, _ in samples]
    listing.orphans = {m: orphans_by_column[by_modality[m]] for m in pair}
    file_modalities = {kinds[c] for c in columns_used if c in file_columns}
    for rel, full in files:  # files of a paired modality that no row names have no partner either
        if full.resolve() not in named and _suffix(rel) in examples:
            modality = next(iter(file_modalities)) if len(file_modalities) == 1 else None
            if modality is not None:
                listing.orphans[modality].append(f"{rel} (no metadata row)")
    return listing


def _used_columns(rows: list, text_column: str, where: str, key: str) -> tuple[list[str], list[str]]:
    """(the file columns, the two columns paired): two file columns, else (or where data.text_column names one)
    file_name and its caption column."""
    columns = list(dict.fromkeys(c for _, _, row in rows for c in row))
    file_columns = [c for c in columns if c == "file_name" or c.endswith("_file_name")]
    if not rows:  # its header's file_name was reported missing ("columns: ")
        raise UserError(
            f"{key}: {where} holds no rows; add one per pair (its file_name and caption), or remove it to pair the "
            "files by their shared names."
        )
    if not file_columns:
        raise UserError(
            f"{key}: {where} has no file_name column (columns: {', '.join(columns[:8])}); expected {LAYOUT}."
        )
    if len(file_columns) >= 2 and text_column in (None, "auto"):
        return file_columns, file_columns[:2]
    # (a data.text_column given pairs file_name with it: an imagefolder's masks beside its captions)
    return file_columns, [file_columns[0], _text_column(rows, columns, file_columns, text_column, where)]


def _paired_modalities(
    kinds: dict[str, str], columns_used: list[str], wanted: tuple[str, str] | None, where: str, key: str
) -> tuple[str, str]:
    """data.modalities, or the modalities of the two columns: two of one modality (file_name + mask_file_name, a .txt
    file + its caption) are refused, as a dual encoder's sides are keyed by modality (data=auto took them for pairs,
    and training stopped on a traceback)."""
    first, second = (kinds[c] for c in columns_used)
    if first == second:
        raise UserError(
            f"{key}: {where} pairs {first} ({columns_used[0]}) with {second} ({columns_used[1]}); a dual encoder's "
            f"two sides are two different modalities (e.g. image and text): set data.text_column=NAME to pair "
            f"{columns_used[0]} with a caption column instead."
        )
    pair = wanted or (first, second)
    if set(pair) != {first, second}:
        raise UserError(
            f"data.modalities={list(pair)} but {where} pairs {first} ({columns_used[0]}) with {second} "
            f"({columns_used[1]})."
        )
    return pair


def _file_entry(folder: Path, value: Any, root: Path) -> Entry | str | None:
    """The Entry of a file_name value (relative to the metadata's folder); None for a row without one; for a file
    named but not there, why not ("does not exist", "is an absolute path, not read"), for the user's message."""
    if not isinstance(value, str) or not value.strip():
        return None
    try:
        rel = clean_member_name(value.strip())
    except UnsafeMemberNameError as e:
        return f"is {e}"  # an absolute or '..' path is never followed
    path = folder / rel
    if not path.is_file():
        return "does not exist"
    return Entry(str(path.relative_to(root)) if path.is_relative_to(root) else rel, path=path)


def _text_column(rows, columns: list[str], file_columns: list[str], wanted: str, where: str) -> str:
    if wanted not in (None, "auto"):
        if wanted not in columns:
            raise UserError(f"data.text_column={wanted}: {where} has no such column (columns: {', '.join(columns)}).")
        return wanted
    texts = [
        c
        for c in columns
        if c not in file_columns
        and _plain(c) not in LABEL_COLUMNS
        and any(isinstance(r.get(c), str) and r[c].strip() and not _looks_numeric(r[c]) for _, _, r in rows)
    ]
    for name in CAPTION_COLUMNS:  # "Caption" too: a url column before it was taken for the captions
        named = [c for c in texts if _plain(c) == name]
        if named:
            return named[0]
    labels = [c for c in columns if _plain(c) in LABEL_COLUMNS]
    if labels:  # classification data, whatever else it holds (a speaker id): captions only where named as such
        texts = []
    if not texts:
        raise UserError(
            f'{where} has no text column to pair with file_name (columns: {", ".join(columns)}); add one, e.g. "text"'
            + (
                f", or set data.text_column={labels[0]} to pair each file with its class name as text."
                if labels
                else "."
            )
        )
    return texts[0]


def _plain(column: str) -> str:
    """A column's name as CAPTION_COLUMNS and LABEL_COLUMNS spell it: a spreadsheet's "Caption " is a caption."""
    return column.strip().lower()


def _looks_numeric(value: str) -> bool:
    try:
        float(value)
    except ValueError:
        return False
    return True


def _column_modality(column: str, file_columns: list[str], samples, examples: dict[str, Path]) -> str:
    if column not in file_columns:
        return TEXT
    suffixes = Counter(_suffix(s[column].name) for _, s in samples if column in s)
    for suffix, _ in suffixes.most_common():
        modality = modality_of(suffix, examples[suffix])
        if modality is not None:
            return modality
    raise UserError(
        f"no registered modality reads the files of column {column} ({', '.join(suffixes) or 'none found'})."
    )
