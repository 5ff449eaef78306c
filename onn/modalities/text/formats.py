"""Text records from .jsonl, .json, .csv, .parquet and .txt files, the format read from the content.

Every reader returns a list of dicts; every problem with a file is a UserError that names the
file and the line or row.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

from onn.data.files import read_head
from onn.errors import UserError

FORMATS = ("jsonl", "json", "csv", "parquet", "txt")


def read_records(path: str | Path, fmt: str = "auto", key: str = "data.source") -> list[dict[str, Any]]:
    """All records of a text dataset file; `fmt` is one of FORMATS or auto."""
    path = Path(path).expanduser()
    if not path.exists():
        raise UserError(f"{key} {path} does not exist; check the path.")
    if path.is_dir():
        raise UserError(
            f"{key} {path} is a folder; point it at a .jsonl, .json, .csv, .parquet or .txt file."
        )
    if path.stat().st_size == 0:
        raise UserError(f"{key} {path} is empty.")
    fmt = detect_format(path) if fmt == "auto" else fmt
    if fmt not in FORMATS:
        raise UserError(f"data.format '{fmt}' is not one of auto, {', '.join(FORMATS)}.")
    records = _READERS[fmt](path)
    if not records:
        raise UserError(f"{key} {path} holds no records.")
    return records


def detect_format(path: Path) -> str:
    """Decide from the bytes, not the name: parquet magic, JSON document vs JSON lines, CSV header, else text."""
    with open(path, "rb") as f:
        head = f.read(65536)
    if head[:4] == b"PAR1":
        return "parquet"
    text = head.decode("utf-8", errors="replace").lstrip("\ufeff")
    stripped = text.lstrip()
    if stripped.startswith("["):
        return "json"
    if stripped.startswith("{"):
        first, _, rest = stripped.partition("\n")
        try:
            json.loads(first)
        except json.JSONDecodeError:
            return "json"  # a multi-line JSON document
        return "jsonl" if rest.strip() else "json"  # several one-line objects, or one document on one line
    lines = [ln for ln in text.splitlines()[:20] if ln.strip()]
    if len(lines) >= 2:
        try:
            dialect = csv.Sniffer().sniff("\n".join(lines), delimiters=",\t;|")
            counts = {len(row) for row in csv.reader(lines[:-1], dialect)}
            if len(counts) == 1 and counts.pop() >= 2:
                return "csv"
        except csv.Error:
            pass
    return "txt"


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(
                    f"{path} line {lineno} is not valid JSON ({e.msg} at column {e.colno})."
                ) from e
            if not isinstance(row, dict):
                raise UserError(
                    f"{path} line {lineno} is a JSON {type(row).__name__}, not an object with fields."
                )
            records.append(row)
    return records


def _read_json(path: Path) -> list[dict[str, Any]]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise UserError(f"{path} line {e.lineno} is not valid JSON ({e.msg} at column {e.colno}).") from e
    if isinstance(doc, dict):
        lists = {k: v for k, v in doc.items() if isinstance(v, list)}
        if len(lists) == 1 and all(isinstance(r, dict) for r in next(iter(lists.values()))):
            doc = next(iter(lists.values()))  # {"data": [ {...}, ... ]}
        elif lists and len({len(v) for v in lists.values()}) == 1:
            n = len(next(iter(lists.values())))
            doc = [
                {k: v[i] for k, v in lists.items()} for i in range(n)
            ]  # columns {"input": [...], "output": [...]}
        elif not lists:
            doc = [doc]  # a single record
        else:
            raise UserError(
                f"{path} is a JSON object but neither {{'rows': [...]}} nor columns of equal length."
            )
    if not isinstance(doc, list):
        raise UserError(f"{path} must hold a JSON list of objects (or an object of columns).")
    for i, row in enumerate(doc):
        if not isinstance(row, dict):
            raise UserError(f"{path} item {i} is a JSON {type(row).__name__}, not an object with fields.")
    return doc


def _read_csv(path: Path) -> list[dict[str, Any]]:
    text = path.read_text(encoding="utf-8-sig")
    sample = "\n".join(text.splitlines()[:20])
    try:
        dialect = csv.Sniffer().sniff(sample, delimiters=",\t;|")
    except csv.Error:
        dialect = csv.excel
    reader = csv.DictReader(io.StringIO(text), dialect=dialect)
    records = []
    for row in reader:
        if None in row or None in row.values():
            raise UserError(
                f"{path} row {reader.line_num} has {len(row) - (None in row)} cells but the header has {len(reader.fieldnames)}."
            )
        records.append(row)
    return records


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises several types for damaged files
        raise UserError(f"{path} is not a readable parquet file: {e}") from e


def _read_txt(path: Path) -> list[dict[str, Any]]:
    return [{"text": line.rstrip("\n")} for line in open(path, encoding="utf-8") if line.strip()]


_READERS = {
    "jsonl": _read_jsonl,
    "json": _read_json,
    "csv": _read_csv,
    "parquet": _read_parquet,
    "txt": _read_txt,
}


def sniff_text(path: Path) -> str | None:
    """Why `path` is text data (a built-in generator, or a regular file of JSON, CSV, parquet with text
    columns, or UTF-8/UTF-16 text), or None. Reads at most 64 KB."""
    if str(path).startswith("builtin:"):
        return f"a built-in generator ({path})"
    if not path.is_file():
        return None
    head = read_head(path, 65536)
    if head[:4] == b"PAR1":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            schema = pq.read_schema(path)
        except Exception:  # noqa: BLE001 - pyarrow raises several types for damaged files
            return None
        texts = [f.name for f in schema if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)]
        return f"a parquet table with text columns ({', '.join(texts[:3])})" if texts else None
    text = _decode_head(head)
    if text is None or not text.strip():
        return None
    printable = sum(c.isprintable() or c in "\n\r\t" for c in text) / len(text)
    if printable < 0.95:
        return None
    return f"{detect_format(path)} text"


def _decode_head(head: bytes) -> str | None:
    """The first bytes of a file as text (UTF-8, or UTF-16 with its BOM), or None for binary data."""
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):
        return head.decode("utf-16", "ignore")
    try:
        return head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start >= len(head) - 4:  # a character cut at the end of the window
            return head[: e.start].decode("utf-8")
        return None
