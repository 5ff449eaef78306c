"""csv: path,label rows (header optional; comma, tab or semicolon, and spaces in a .txt list), image paths relative
to the csv file. A folder holding train.csv / test.csv / val.csv gives one split per file."""

from __future__ import annotations

import csv
import io
import re
from pathlib import Path

import numpy as np

from onn.errors import UserError
from onn.modalities.image.formats.common import (
    Listing,
    PathFetch,
    Split,
    is_image_name,
    split_of,
)

_PATH_HEADERS = ("path", "file", "filename", "file_name", "filepath", "image", "image_path", "img")
_LABEL_HEADERS = ("label", "labels", "class", "class_name", "target", "category", "y")
TABLE_SUFFIXES = (".csv", ".tsv", ".txt")  # a .txt list is "path label" lines (ImageNet's val.txt, Caltech's lists)


def is_int(s: str) -> bool:
    return bool(re.fullmatch(r"[+-]?\d+", s.strip()))


def csv_rows(path: Path, key: str, labelled: bool = True) -> list[tuple[int, str, str | None]]:
    """(row number, image path, label or None) of a path,label csv; the header is optional."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise UserError(f"{key} {path} is not a UTF-8 text csv: {e}") from e
    sample = "\n".join(text.splitlines()[:20])
    try:
        dialect = csv.Sniffer().sniff(sample, delimiters=",\t;" + (" " if path.suffix.lower() == ".txt" else ""))
    except csv.Error:
        dialect = csv.excel_tab if path.suffix.lower() == ".tsv" else csv.excel
    rows = [(n, r) for n, r in enumerate(csv.reader(io.StringIO(text), dialect), 1) if any(c.strip() for c in r)]
    if not rows:
        raise UserError(f"{key} {path} holds no rows; expected path,label rows.")
    first = [c.strip() for c in rows[0][1]]
    pcol, lcol = 0, 1 if len(first) > 1 else None
    if len(first) > 1:
        later = {r[1].strip() for _, r in rows[1:] if len(r) > 1}
        header = not is_int(first[1]) and first[1] not in later and not is_image_name(first[0])
    else:
        header = first[0].lower() in _PATH_HEADERS or not is_image_name(first[0])
    if header:
        low = [c.lower() for c in first]
        pcol = next((low.index(h) for h in _PATH_HEADERS if h in low), 0)
        lcol = next((low.index(h) for h in _LABEL_HEADERS if h in low), None)
        if lcol is None:
            lcol = next((i for i in range(len(first)) if i != pcol), None)
        rows = rows[1:]
    out = []
    for n, r in rows:
        if len(r) <= pcol or not r[pcol].strip():
            raise UserError(f"{key}: {path} row {n} has no image path.")
        label = r[lcol].strip() if lcol is not None and len(r) > lcol else None
        out.append((n, r[pcol].strip(), label or None))
    if labelled and not out:
        raise UserError(f"{key} {path} holds a header but no rows.")
    return out


def csv_path(csv_file: Path, name: str) -> Path:
    """Where an image a csv names is: absolute, or relative to the csv's folder."""
    p = Path(name).expanduser()
    return p if p.is_absolute() else csv_file.parent / p


def split_tables(folder: Path) -> dict[str, Path]:
    """{split: its table} of a folder holding train.csv / test.csv / val.csv (.tsv too)."""
    files: dict[str, Path] = {}
    for f in sorted(folder.iterdir()):
        if f.suffix.lower() in (".csv", ".tsv") and split_of(f.name) and f.is_file():
            files.setdefault(split_of(f.name), f)
    return files


def list_csv(path: Path, key: str, allow_unlabelled: bool) -> Listing:
    if path.is_dir():
        files = split_tables(path)
        if not files:
            raise UserError(f"{key} {path} holds no train.csv / test.csv / val.csv; point {key} at a csv file.")
    else:
        files = {"all": path}
    tables = {split: csv_rows(f, key) for split, f in files.items()}
    given = [(files[split], n, lab) for split, rows in tables.items() for n, _, lab in rows if lab is not None]
    numeric = sum(is_int(lab) for _, _, lab in given)
    if 0 < numeric < len(given):  # one class name among numbers (or the other way round) is a typo
        most = numeric * 2 >= len(given)
        f, n, lab = next(g for g in given if is_int(g[2]) != most)
        raise UserError(
            f"{key}: {f} row {n} has label {lab!r}, but the other labels are "
            f"{'numbers' if most else 'class names'}; use class numbers on every row or names on every row."
        )
    numeric = numeric == len(given)
    classes = None if numeric else sorted({lab for _, _, lab in given})
    index = {c: i for i, c in enumerate(classes or [])}
    splits = {}
    for split, rows in tables.items():
        f = files[split]
        labels = np.empty(len(rows), np.int64)
        for j, (n, _, lab) in enumerate(rows):
            if lab is None:
                if not allow_unlabelled:
                    raise UserError(
                        f"{key}: {f} row {n} has no label; give every row one (for predictions on unlabelled "
                        "images use task=infer task.input=PATH)."
                    )
                labels[j] = -1
            elif numeric:
                labels[j] = int(lab)
                if labels[j] < 0 and not (labels[j] == -1 and allow_unlabelled):
                    raise UserError(f"{key}: {f} row {n} has label {lab}; labels must be 0 or more.")
            else:
                labels[j] = index[lab]
        splits[split] = Split(
            [name for _, name, _ in rows],
            labels,
            PathFetch([csv_path(f, name) for _, name, _ in rows]),
            origin=[f"{f.name} row {n} ({name})" for n, name, _ in rows],
        )
    return Listing(splits, classes)  # (held-out classes training lacks: said when training starts, as folders')
