"""parquet: Hugging Face `datasets` exports (an image column, binary or a {bytes, path} struct, and an integer
label column; class names from the ClassLabel metadata), one file or a folder of train-*/test-* shards."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from onn.data.files import archive_kind, read_file, walk_files
from onn.errors import UserError
from onn.modalities.image.formats.common import SPLITS, Lazy, Listing, Split, split_of


def _parquet_columns(schema, f: Path, key: str):
    """(image column, whether it is an {bytes, path} struct, label column or None)."""
    import pyarrow as pa

    def is_bin(t):
        return pa.types.is_binary(t) or pa.types.is_large_binary(t)

    images = []
    for fld in schema:
        t = fld.type
        if pa.types.is_struct(t) and any(
            t.field(i).name == "bytes" and is_bin(t.field(i).type) for i in range(t.num_fields)
        ):
            images.append((fld.name, True))
        elif is_bin(t):
            images.append((fld.name, False))
    if not images:
        raise UserError(f"{key}: {f} has no image column (a binary column or a {{bytes, path}} struct).")
    image = next((c for c in images if c[0].lower() in ("image", "img")), images[0])
    ints = [fld.name for fld in schema if pa.types.is_integer(fld.type)]
    label = next((c for c in ("label", "labels", "fine_label") if c in ints), None)
    if label is None and len(ints) == 1:
        label = ints[0]
    elif label is None and len(ints) > 1:
        raise UserError(f"{key}: {f} has several integer columns ({', '.join(ints)}); name the label column 'label'.")
    return image[0], image[1], label


def _parquet_names(schema, label: str | None) -> list[str] | None:
    """Class names from the Hugging Face `datasets` metadata (a ClassLabel feature), when present."""
    meta = (schema.metadata or {}).get(b"huggingface")
    if not meta or label is None:
        return None
    try:
        doc = json.loads(meta)
    except ValueError:
        return None
    features = (doc.get("info") or {}).get("features") or doc.get("features") or {}
    feat = features.get(label) if isinstance(features, dict) else None
    if isinstance(feat, dict) and isinstance(feat.get("names"), list):
        return [str(n) for n in feat["names"]]
    return None


def _parquet_bytes(f: Path, column: str, nested: bool) -> list[bytes | None]:
    import pyarrow.parquet as pq

    col = pq.read_table(f, columns=[column]).column(0).combine_chunks()
    if not nested:
        return col.to_pylist()
    data = col.field("bytes").to_pylist()
    names = [n.name for n in col.type]
    paths = col.field("path").to_pylist() if "path" in names else [None] * len(data)
    for i, (b, p) in enumerate(zip(data, paths)):
        if b is None and p and (f.parent / p).is_file():
            data[i] = read_file(f.parent / p)  # an image stored by path next to the parquet
    return data


class ParquetFetch(Lazy):
    """Rows of parquet files; a file's image column is read on its first use, then kept."""

    def __init__(self, files: list[Path], column: str, nested: bool, where: list[tuple[int, int]]):
        self.files, self.column, self.nested, self.where = files, column, nested, where

    def _open(self):
        return {}

    def get(self, i: int) -> bytes | None:
        cache = self._handle()
        f, row = self.where[i]
        if f not in cache:
            cache[f] = _parquet_bytes(self.files[f], self.column, self.nested)
        return cache[f][row]


def list_parquet(path: Path, key: str, allow_unlabelled: bool):
    import pyarrow.parquet as pq

    if path.is_dir():
        found = sorted(p for rel, p in walk_files(path) if rel.lower().endswith(".parquet"))
        groups: dict[str, list[Path]] = {}
        for f in found:
            rel = f.relative_to(path).as_posix()
            split = split_of(f.name) or next(
                (SPLITS[p.lower()] for p in rel.split("/")[:-1] if p.lower() in SPLITS), None
            )
            groups.setdefault(split or "all", []).append(f)
        if not found:
            raise UserError(f"{key} {path} holds no .parquet files.")
        if "all" in groups and len(groups) > 1:
            raise UserError(
                f"{key}: {groups['all'][0]} has no split (train, test, validation) in its name, unlike the "
                "other parquet files next to it; rename it or point at one file."
            )
    elif archive_kind(path) is not None:
        raise UserError(f"{key} {path} is an archive of parquet files; extract it and point {key} at the folder.")
    else:
        groups = {"all": [path]}
    classes = None
    splits = {}
    for split, files in groups.items():
        names, labels, where = [], [], []
        column = nested = None
        for k, f in enumerate(files):
            try:
                pf = pq.ParquetFile(f)
                image, nest, label = _parquet_columns(pf.schema_arrow, f, key)
                labs = (
                    pf.read(columns=[label]).column(0).fill_null(-1).to_numpy().astype(np.int64)
                    if label
                    else np.full(pf.metadata.num_rows, -1, np.int64)
                )
            except UserError:
                raise
            except Exception as e:  # pyarrow raises several types for damaged files
                raise UserError(f"{key}: {f} is not a readable parquet file: {e}") from e
            if column is not None and (image, nest) != (column, nested):
                raise UserError(f"{key}: {f} has image column '{image}', but {files[0]} has '{column}'.")
            column, nested = image, nest
            classes = classes or _parquet_names(pf.schema_arrow, label)
            if label is None and not allow_unlabelled:
                raise UserError(
                    f"{key}: {f} has no label column (an integer column named label); add one (for predictions "
                    "on unlabelled images use task=infer task.input=PATH)."
                )
            neg = np.flatnonzero(labs < (-1 if allow_unlabelled else 0)) if label else np.zeros(0, np.int64)
            if neg.size:
                raise UserError(
                    f"{key}: {f} row {int(neg[0])} has label {int(labs[neg[0]])}; labels must be 0 or more "
                    "(-1 or empty: unlabelled; for predictions on unlabelled images use task=infer task.input=PATH)."
                )
            names += [f"{f.name}#{r}" for r in range(len(labs))]
            labels.append(labs)
            where += [(k, r) for r in range(len(labs))]
        splits[split] = Split(names, np.concatenate(labels), ParquetFetch(files, column, nested, where))
    return Listing(splits, classes)
