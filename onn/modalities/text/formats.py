"""Text records from .jsonl, .json, .csv, .parquet and .txt files, the format read from the content.

Every reader returns `Records`: a list of dicts that also knows where each record came from ("f.jsonl
line 7", "f.csv row 5 (line 9)"), so that a problem found later, after shuffling, still names the line a
user can open. Every problem with a file is a UserError that names the file and the line or row.

Files are decoded as UTF-8, or UTF-16/UTF-32 when they start with a byte-order mark; Latin-1 text and
binary files are named as such. Only regular files are read (data.source=/dev/zero or a FIFO is refused).
"""

from __future__ import annotations

import bisect
import codecs
import csv
import io
import json
import math
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from onn.data.files import existing_source, json_type, jsonl_objects, open_regular, read_file, read_head
from onn.errors import UserError

FORMATS = ("jsonl", "json", "csv", "parquet", "txt")
HEAD_BYTES = 65536  # what format detection reads
FIRST_LINE_MAX = 64 * 1024**2  # a first line cut by HEAD_BYTES is read on to its end, up to this (a JSON record)
DELIMITERS = ",\t;|"
# A CSV header cell: a column name (letters, digits, spaces, _ . - ( ) /), not a sentence
COLUMN_NAME = re.compile(r"[^\W\d][\w .\-()/]{0,63}|Unnamed: \d+")  # the last: pandas' name for an unnamed column
QUOTED = re.compile(r'"(?:[^"]|"")*"', re.S)  # one CSV field in quotes (a quote inside doubled)
BOMS = (  # UTF-32's little-endian mark starts like UTF-16's: check it first
    (codecs.BOM_UTF32_LE, "utf-32"),
    (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF8, "utf-8-sig"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
)


class Records(list):
    """Records (dicts) and, for each, where it came from: what messages about it name."""

    def __init__(self, rows: Iterable[dict[str, Any]] = (), where: Iterable[str] = ()):
        super().__init__(rows)
        self.where = list(where)
        if len(self.where) != len(self):
            raise ValueError("one place per record")

    def pick(self, index: Iterable[int]) -> Records:
        index = list(index)
        return Records([self[i] for i in index], [self.where[i] for i in index])


def read_records(path: str | Path, fmt: str = "auto", key: str = "data.source") -> Records:
    """All records of a text dataset file; `fmt` is one of FORMATS or auto."""
    path = existing_source(path, key, "a .jsonl, .json, .csv, .parquet or .txt file")
    if path.is_dir():
        raise UserError(f"{key} {path} is a folder; point it at a .jsonl, .json, .csv, .parquet or .txt file.")
    if fmt not in ("auto", *FORMATS):
        raise UserError(f"data.format={fmt!r} is not one of auto, {', '.join(FORMATS)}.")
    data = read_file(path)
    if not data.strip():
        raise UserError(f"{key} {path} is empty.")
    if fmt == "parquet" or (fmt == "auto" and data[:4] == b"PAR1"):
        records = _read_parquet(path)
    else:
        text = decode(data, path, key)
        records = _read_text(text, path, fmt)
    if not records:
        raise UserError(f"{key} {path} holds no records.")
    return records


def _read_text(text: str, path: Path, fmt: str) -> Records:
    """The records of a text file in `fmt`, or in the format its content shows (auto); a file taken for JSON by its
    content that is not JSON says how to read it as plain text."""
    if fmt != "auto":
        return _READERS[fmt](text, path)
    fmt = detect(text, complete=True, suffix=path.suffix.lower())
    try:
        return _READERS[fmt](text, path)
    except UserError as e:
        if fmt not in ("json", "jsonl"):
            raise
        hint = f"{str(e).rstrip('.')}; if {path.name} is plain text (one sample a line), set data.format=txt."
        raise UserError(hint) from None


def decode(data: bytes, path: Path, key: str) -> str:
    """The file's text: UTF-8, or the encoding its byte-order mark names; else one sentence on what it is."""
    for bom, codec in BOMS:
        if data.startswith(bom):
            try:
                return data.decode(codec).lstrip("\ufeff")
            except UnicodeDecodeError as e:
                raise UserError(
                    f"{key} {path} starts with a {codec.upper()} byte-order mark but is not {codec.upper()} "
                    f"text (bad bytes at offset {e.start}); save it again as UTF-8."
                ) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        if not _binary(data[:8192]):
            line = data.count(b"\n", 0, e.start) + 1
            raise UserError(
                f"{key} {path} is not UTF-8 text: byte 0x{data[e.start]:02x} on line {line} (Latin-1 or "
                f"Windows-1252?); convert it, e.g. iconv -f latin1 -t utf-8 {path} > {path.stem}.utf8{path.suffix}"
            ) from None
        text = ""
    if not text or _binary(data[:8192]):
        utf16 = data[1:4096:2].count(0) > 0.4 * len(data[1:4096:2]) or data[:4096:2].count(0) > 0.4 * len(data[:4096:2])
        hint = " (it looks like UTF-16 without a byte-order mark: save it as UTF-8)" if utf16 else ""
        raise UserError(
            f"{key} {path} is a binary file, not text{hint}; point it at a .jsonl, .json, .csv, .parquet or .txt file."
        )
    return text


def _binary(head: bytes) -> bool:
    """NUL bytes, or more than 5% control bytes other than tab, newline, carriage return and form feed."""
    if b"\x00" in head:
        return True
    controls = sum(b < 32 and b not in (9, 10, 12, 13) for b in head)
    return controls > 0.05 * max(1, len(head))


def detect_format(path: str | Path, key: str = "data.source") -> str:
    """Decide from the bytes, not the name: parquet magic, a JSON document or JSON lines, a CSV header, else text."""
    head = read_head(path, HEAD_BYTES)
    if head[:4] == b"PAR1":
        return "parquet"
    complete = len(head) < HEAD_BYTES
    start = head.lstrip(codecs.BOM_UTF8 + b" \t\r\n")
    if not complete and start.startswith(b"{") and b"\n" not in start:  # a JSON object cut before its line ends
        head, complete = _through_first_line(path)
    text = _decode_head(head)
    if text is None:  # Latin-1 text (the byte, its line, the iconv command) or a binary file: decode says which
        text = decode(head, Path(path), key)
    return detect(text, complete=complete, suffix=Path(path).suffix.lower())


def _through_first_line(path: str | Path) -> tuple[bytes, bool]:
    """(the file's first line whole and HEAD_BYTES after it, whether that is the whole file). A JSON lines file whose
    first record passes HEAD_BYTES (a long document) was taken for one JSON document: data.streaming=true refused
    it and auto held it in memory."""
    with open_regular(path) as f:
        line = f.readline(FIRST_LINE_MAX)
        after = f.read(HEAD_BYTES)
        return line + after, len(after) < HEAD_BYTES


def detect(text: str, complete: bool, suffix: str = "") -> str:
    """The format of a text (the whole file when `complete`, else its head); `suffix`: the file's (lower case).
    Named .csv, a lone column name on the first line is a one-column CSV's header; named .txt, a text that starts
    with [ or { is JSON only where it parses as JSON (lyrics' "[Verse 1]" line is text); named .jsonl, a first line
    that is a JSON object makes it JSON lines even when it is the only line."""
    text = text.lstrip("\ufeff")
    stripped = text.lstrip()
    if suffix == ".txt" and stripped.startswith(("[", "{")) and not _json_in_txt(stripped, complete):
        return "txt"
    if stripped.startswith("["):
        return "json"
    if stripped.startswith("{"):
        first, _, rest = stripped.partition("\n")
        try:
            json.loads(first)
        except json.JSONDecodeError:
            return "json"  # a multi-line JSON document
        if suffix == ".jsonl" or rest.strip():  # a one-line .jsonl file is one record, not a document to unwrap
            return "jsonl"
        return "json"  # one document on one line
    if complete and _json_scalar(stripped):
        return "json"  # a bare number or string: the JSON reader says it holds no records
    lines = text if complete else text[: text.rfind("\n") + 1]
    if csv_delimiter(lines) or one_column_csv(lines, suffix == ".csv"):
        return "csv"
    return "txt"


def _json_in_txt(text: str, complete: bool) -> bool:
    """Whether a .txt file's text that starts with [ or { is JSON after all: its first line is a JSON value (JSON
    lines, a one-line document), or the whole file parses (a document over several lines)."""
    return _parses(text.partition("\n")[0]) or (complete and _parses(text))


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return False
    return True


def _json_scalar(text: str) -> bool:
    try:
        return not isinstance(json.loads(text), dict | list)
    except (json.JSONDecodeError, RecursionError):
        return False


def csv_delimiter(text: str) -> str | None:
    """The delimiter of a CSV with a header of column names, or None when the text is not one.

    Records are parsed as csv does (quoted fields may hold delimiters, newlines and doubled quotes);
    a table is a header of two or more distinct column names that at least half of the first 50 rows
    match, so ragged rows still read as CSV, and the reader names the first."""
    for delimiter in DELIMITERS:
        try:
            rows = [r for r in csv.reader(io.StringIO(text), delimiter=delimiter) if any(c.strip() for c in r)]
        except csv.Error:
            continue
        rows = rows[:51]
        if len(rows) < 2:
            continue
        header = header_names(rows[0])
        if len(header) < 2 or len(set(header)) < len(header) or not all(COLUMN_NAME.fullmatch(c) for c in header):
            continue
        if not rows[0][0].strip() and not all(r[0].strip() for r in rows[1:]):
            continue  # an index column holds a value on every row; lines that start with a tab (a poem) are text
        if sum(len(r) == len(header) for r in rows[1:]) >= 0.5 * (len(rows) - 1):
            return delimiter
    return None


def header_names(cells: list[str]) -> list[str]:
    """A CSV header's column names; an empty first one is pandas' index (to_csv without index=False) and is named
    as pandas reads it back, `Unnamed: 0`: the header failed as column names and the table was read as plain text."""
    names = [c.strip() for c in cells]
    if len(names) > 1 and not names[0]:
        names[0] = "Unnamed: 0"
    return names


def one_column_csv(text: str, csv_named: bool) -> bool:
    """Whether a text is a CSV of one column, as pandas' to_csv writes one: a lone column name, then a record a
    line, quoted where it holds a comma, a quote or a newline. Named .csv, the header says it; other text also
    needs a quoted record, and no unquoted one that CSV would have quoted (prose is not a table)."""
    records = _raw_records(text, 51)
    try:
        header = next(csv.reader([records[0]])) if len(records) > 1 else []
    except csv.Error:
        return False
    if len(header) != 1 or not COLUMN_NAME.fullmatch(header[0].strip()):
        return False
    if csv_named:
        return True
    quoted = [QUOTED.fullmatch(r.strip()) is not None for r in records[1:]]
    plain = all(q or not any(c in r for c in ',"') for q, r in zip(quoted, records[1:]))
    return any(quoted) and plain


def _raw_records(text: str, limit: int) -> list[str]:
    """The first `limit` non-blank records of a CSV text, unparsed: lines joined while a quote is open."""
    out, pending = [], ""
    for line in text.split("\n"):
        pending += line + "\n"
        if pending.count('"') % 2 == 0:
            if pending.strip():
                out.append(pending.rstrip("\r\n"))
            pending = ""
            if len(out) >= limit:
                break
    return out


def _read_jsonl(text: str, path: Path) -> Records:
    rows = jsonl_objects(text, str(path))
    return Records([row for _, row in rows], [f"{path} line {number}" for number, _ in rows])


def _read_json(text: str, path: Path) -> Records:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{path} line {e.lineno} is not valid JSON ({e.msg} at column {e.colno}).") from None
    if isinstance(doc, list):
        return _located_items(doc, text, path)
    if not isinstance(doc, dict):
        raise UserError(
            f"{path} holds a bare JSON {json_type(doc)} ({text.strip()[:40]}), not records: give JSON lines of "
            '{"input": ..., "output": ...} objects, or a JSON list of them.'
        )
    lists = {k: v for k, v in doc.items() if isinstance(v, list)}
    if len(lists) == 1 and all(isinstance(r, dict) for r in next(iter(lists.values()))):
        name, rows = next(iter(lists.items()))  # {"data": [ {...}, ... ]}
        return _checked(rows, [f"{path} {name}[{i}]" for i in range(len(rows))], path)
    if lists and len({len(v) for v in lists.values()}) == 1 and len(lists) == len(doc):
        n = len(next(iter(lists.values())))  # columns {"input": [...], "output": [...]}
        return Records(
            [{k: v[i] for k, v in lists.items()} for i in range(n)],
            [f"{path} record {i + 1}" for i in range(n)],
        )
    if not lists:
        return Records([doc], [f"{path}"])  # a single record
    raise UserError(f"{path} is a JSON object but neither {{'rows': [...]}} nor columns of equal length.")


def _located_items(doc: list, text: str, path: Path) -> Records:
    """The items of a top-level JSON list, each with the line it starts on."""
    newlines = [m.start() for m in re.finditer("\n", text)]
    decoder, where = json.JSONDecoder(), []
    at = _skip_space(text, text.index("[") + 1)
    for _ in doc:
        where.append(f"{path} line {bisect.bisect_left(newlines, at) + 1}")
        _, end = decoder.raw_decode(text, at)
        at = _skip_space(text, _skip_space(text, end) + 1)  # past the comma
    return _checked(doc, where, path)


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\r\n":
        at += 1
    return at


def _checked(rows: list, where: list[str], path: Path) -> Records:
    for row, place in zip(rows, where):
        if not isinstance(row, dict):
            raise UserError(f"{place} is a JSON {json_type(row)}, not an object with fields.")
    return Records(rows, where)


def _read_csv(text: str, path: Path) -> Records:
    delimiter = csv_delimiter(text) or ("," if one_column_csv(text, csv_named=True) else _sniffed_delimiter(text))
    reader = csv.reader(io.StringIO(text), delimiter=delimiter)
    header, rows, where, line, row_no = None, [], [], 1, 0
    for cells in reader:
        start, line = line, reader.line_num + 1
        if not any(c.strip() for c in cells):
            continue
        if header is None:
            header = header_names(cells)
            continue
        row_no += 1
        if len(cells) != len(header):
            raise UserError(
                f"{path} row {row_no} (line {start}) has {len(cells)} cells but the header has {len(header)}: "
                f'quote fields that hold the delimiter {delimiter!r} ("like{delimiter} this"), or fix the row.'
            )
        rows.append(dict(zip(header, cells)))
        where.append(f"{path} row {row_no} (line {start})")
    return Records(rows, where)


def _sniffed_delimiter(text: str) -> str:
    try:
        return csv.Sniffer().sniff(text[:HEAD_BYTES], delimiters=DELIMITERS).delimiter
    except csv.Error:
        return ","


def _read_parquet(path: Path) -> Records:
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for damaged files
        raise UserError(f"{path} is not a readable parquet file: {e}") from e
    return Records(rows, [f"{path} row {i + 1}" for i in range(len(rows))])


def _read_txt(text: str, path: Path) -> Records:
    """One sample a line, split on newlines only, as the streaming reader and an editor split them: U+2028, NEL or
    a form feed inside a line (str.splitlines() breaks there) belongs to the sample."""
    rows, where = [], []
    for lineno, line in enumerate(text.split("\n"), 1):
        line = line.removesuffix("\r")
        if line.strip():
            rows.append({"text": line})
            where.append(f"{path} line {lineno}")
    return Records(rows, where)


_READERS = {"jsonl": _read_jsonl, "json": _read_json, "csv": _read_csv, "txt": _read_txt}


def is_missing(value: Any) -> bool:
    """A field value that holds nothing: JSON null, or a NaN (parquet and pandas exports)."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def sniff_text(path: Path) -> str | None:
    """Why `path` is text data (a built-in generator, or a regular file of JSON, CSV, parquet with text
    columns, or UTF-8/UTF-16 text), or None. Reads at most 64 KB."""
    if str(path).startswith("builtin:"):
        return f"a built-in generator ({path})"
    if not path.is_file():
        return None
    try:
        head = read_head(path, HEAD_BYTES)
    except OSError:
        return None
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
    return f"{detect(text, complete=len(head) < HEAD_BYTES, suffix=path.suffix.lower())} text"


def _decode_head(head: bytes) -> str | None:
    """The first bytes of a file as text (UTF-8, or UTF-16/32 with its BOM), or None for binary data."""
    for bom, codec in BOMS:
        if head.startswith(bom):
            return head.decode(codec, "ignore").lstrip("\ufeff")
    if _binary(head[:8192]):
        return None
    try:
        return head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start >= len(head) - 4:  # a character cut at the end of the window
            return head[: e.start].decode("utf-8")
        return None
