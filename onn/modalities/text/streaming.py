"""Text datasets larger than memory: read in order with bounded memory, shuffled in a seeded buffer, and
resumed on the exact sample after a kill.

A reader walks one file record by record (JSONL and txt by line, CSV by record, parquet by row group
through pyarrow's iter_batches) and says where each record starts (a `ref`) and where the next one
begins (a position). The stream keeps `data.shuffle_buffer` records and yields a random one as each new
record comes in (numpy PCG64 seeded by seed, epoch and worker). Its state is the reader's position, the
buffer as refs (re-read on resume) and the generator's state: a few JSON-able ints per slot.
torchdata's StatefulDataLoader collects that state per worker, and Lightning's fit loop stores the
loader's state_dict in every checkpoint (loops.fit_loop.state_dict.combined_loader), which ONN's
safetensors CheckpointIO writes as JSON: a resumed run continues on the sample where it stopped, in the
same shuffled order.

The stream and its loader are in stream_loader.py (they import torch; this module is read by task=plan).
Prompts are built by the same Prompter (data.fields, data.template, chat template) as resident data;
tokens are made when a sample is drawn, so nothing but the buffer is held.
"""

from __future__ import annotations

import contextlib
import csv
import heapq
import json
import logging
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from onn.config.data import TextData
from onn.data.files import existing_source, json_type, read_head
from onn.errors import UserError
from onn.modalities.text.formats import BOMS, HEAD_BYTES, csv_delimiter, detect_format, header_names

log = logging.getLogger("onn")
MB = 1024**2
STREAM_FORMATS = ("jsonl", "csv", "parquet", "txt")
VAL_MAX = 1000  # a streamed file's held-out records kept for validation: at most this many (held in memory)
SAMPLE_BYTES = 1 * MB  # what the decoded-size estimate reads of a file
Ref = list[int]  # where a record starts: [byte offset, line (, row)] or [row] for parquet


# ---- readers: a file record by record --------------------------------------------------------------


def file_signature(path: Path) -> list[int]:
    """[size, modification time in ns]: what a checkpoint's stream position is only valid for (byte offsets and
    row numbers into those bytes)."""
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns]


@contextlib.contextmanager
def reopened(path: Path) -> Iterator[None]:
    """The streamed file opened again (each epoch, each resume): gone or unreadable since the run began is one
    sentence naming data.source, not an OSError from inside the data loader."""
    try:
        yield
    except OSError as e:
        raise UserError(
            f"data.source {path} can no longer be read ({e.strerror or e}): it was moved, deleted or made unreadable "
            "while the run streamed it; put it back and resume with ckpt=<this run>."
        ) from None


def wide_text(path: Path) -> str | None:
    """UTF-16 or UTF-32 where the file starts with that byte-order mark: the readers here walk UTF-8 bytes."""
    head = read_head(path, 4)
    return next((codec.upper() for bom, codec in BOMS if codec != "utf-8-sig" and head.startswith(bom)), None)


def refuse_wide(path: Path) -> None:
    """Streaming asked for (data.streaming=true) of text it cannot walk: one sentence, not garbled records."""
    if wide := wide_text(path):
        raise UserError(
            f"data.source {path} is {wide} text, which is not streamed: save it as UTF-8, or set data.streaming=false."
        )


def blank(raw: bytes) -> bool:
    """A line of whitespace only, by str.strip as the resident readers judge it: a line of NBSP or U+3000 (which
    bytes.strip keeps) is no sample. Bytes that are not UTF-8 are not blank: parsing names them."""
    return not raw.decode("utf-8", "replace").strip()


class LineReader:
    """JSON lines (one object a line) or plain text (one sample a line); position [byte offset, line]."""

    def __init__(self, path: Path, fmt: str):
        self.path, self.fmt = path, fmt
        refuse_wide(path)
        self.start = [3 if read_head(path, 4).startswith(BOMS[2][0]) else 0, 0]

    def records(self, at: Ref) -> Iterator[tuple[Ref, Ref, dict[str, Any], str]]:
        offset, line = at
        with reopened(self.path), open(self.path, "rb") as f:
            f.seek(offset)
            for raw in f:
                start, offset, line = offset, offset + len(raw), line + 1
                if not blank(raw):
                    yield [start, line], [offset, line], self.parse(raw, line), f"{self.path} line {line}"

    def fetch(self, refs: list[Ref]) -> list[tuple[dict[str, Any], str]]:
        out = []
        with reopened(self.path), open(self.path, "rb") as f:
            for offset, line in refs:
                f.seek(offset)
                out.append((self.parse(f.readline(), line), f"{self.path} line {line}"))
        return out

    def count(self, at: Ref) -> int:
        """Records from `at` on; a last line cut off mid-record says so now, not hours into training."""
        n, line, last = 0, at[1], b""
        with open(self.path, "rb") as f:
            f.seek(at[0])
            for raw in f:
                line += 1
                if not blank(raw):
                    n, last = n + 1, raw
        if last and not last.endswith(b"\n"):
            self.parse(last, line)
        return n

    def parse(self, raw: bytes, line: int) -> dict[str, Any]:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(
                f"{self.path} line {line} is not UTF-8 text (byte 0x{raw[e.start]:02x}); convert the file to UTF-8."
            ) from None
        if self.fmt == "txt":  # the line less its newline and a \r before it, as the resident reader splits it
            return {"text": text.removesuffix("\n").removesuffix("\r")}
        try:
            row = json.loads(text)
        except json.JSONDecodeError as e:
            if not raw.endswith(b"\n"):  # only the file's last line lacks its newline
                raise UserError(
                    f"{self.path} line {line} is cut off mid-record (the file ends inside it: a truncated "
                    "copy?); copy the file again or delete that line."
                ) from None
            raise UserError(f"{self.path} line {line} is not valid JSON ({e.msg} at column {e.colno}).") from None
        if not isinstance(row, dict):
            raise UserError(f"{self.path} line {line} is a JSON {json_type(row)}, not an object with fields.")
        return row


class _Lines:
    """A binary file's lines from `offset` on, decoded for csv.reader, noting the offset after and the number of
    the last line handed out, and whether the file has run out."""

    def __init__(self, f, offset: int, line: int, path: Path):
        self.f, self.offset, self.line, self.path, self.eof = f, offset, line, path, False

    def __iter__(self) -> Iterator[str]:
        for raw in self.f:
            self.offset, self.line = self.offset + len(raw), self.line + 1
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UserError(
                    f"{self.path} line {self.line} is not UTF-8 text (byte 0x{raw[e.start]:02x}); convert the "
                    "file to UTF-8."
                ) from None
        self.eof = True


class CsvReader:
    """A CSV with a header; records may span lines (quoted newlines). Position [byte offset, line, row]."""

    def __init__(self, path: Path):
        self.path = path
        refuse_wide(path)
        head = read_head(path, HEAD_BYTES)
        bom = 3 if head.startswith(BOMS[2][0]) else 0
        text = head[bom:].decode("utf-8", "ignore")
        self.delimiter = csv_delimiter(text if len(head) < HEAD_BYTES else text[: text.rfind("\n") + 1]) or ","
        self.header: list[str] = []
        for _, _, after, last, cells in self._rows(bom, 0):
            if any(c.strip() for c in cells):
                self.header, self.start = header_names(cells), [after, last, 0]
                break
        if not self.header:
            raise UserError(f"data.source {path} holds no CSV header.")

    def _rows(self, offset: int, line: int) -> Iterator[tuple[int, int, int, int, list[str]]]:
        """(start, first line, offset after, last line, cells) per record, split by csv.reader itself: a quote
        opens a field only at the field's start (`The 40" model` is one field), as the resident reader reads it."""
        with reopened(self.path), open(self.path, "rb") as f:
            f.seek(offset)
            lines = _Lines(f, offset, line, self.path)
            reader = csv.reader(lines, delimiter=self.delimiter)
            try:
                for cells in reader:  # csv.reader takes no line past the record's last: `lines` is at its end
                    if lines.eof and cells:  # it asked past the file's last line: a quote is still open
                        raise UserError(
                            f"{self.path} line {line + 1} opens a quoted field that the file never closes (it ends "
                            "inside it: a truncated copy?); copy the file again or fix that row."
                        )
                    yield offset, line + 1, lines.offset, lines.line, cells
                    offset, line = lines.offset, lines.line
            except csv.Error as e:
                raise UserError(f"{self.path} line {lines.line} is not valid CSV ({e}); fix that row.") from None

    def records(self, at: Ref) -> Iterator[tuple[Ref, Ref, dict[str, Any], str]]:
        offset, line, row = at
        for start, first, after, last, cells in self._rows(offset, line):
            if not any(c.strip() for c in cells):
                continue
            row += 1
            yield (
                [start, first, row],
                [after, last, row],
                self._record(cells, row, first),
                self._where(row, first),
            )

    def _record(self, cells: list[str], row: int, line: int) -> dict[str, Any]:
        if len(cells) != len(self.header):
            raise UserError(
                f"{self._where(row, line)} has {len(cells)} cells but the header has {len(self.header)} "
                f"(a row cut off, or a field holding the delimiter {self.delimiter!r} unquoted); fix the row."
            )
        return dict(zip(self.header, cells))

    def _where(self, row: int, line: int) -> str:
        return f"{self.path} row {row} (line {line})"

    def fetch(self, refs: list[Ref]) -> list[tuple[dict[str, Any], str]]:
        out = []
        for offset, line, row in refs:
            _, first, _, _, cells = next(self._rows(offset, line - 1))
            out.append((self._record(cells, row, first), self._where(row, first)))
        return out

    def count(self, at: Ref) -> int:
        """Records from `at` on, every one parsed: a row cut off or a quote never closed is named now."""
        return sum(1 for _ in self.records(at))


class ParquetReader:
    """A parquet table read one row group at a time (pyarrow iter_batches); position [row]."""

    def __init__(self, path: Path):
        import pyarrow.parquet as pq

        self.path = path
        try:
            meta = pq.ParquetFile(path).metadata
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types for damaged files
            raise UserError(f"{path} is not a readable parquet file (truncated? {e}); copy it again.") from None
        self.group_starts = np.cumsum([0] + [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]).tolist()
        self.rows = meta.num_rows
        self.start = [0]

    def _file(self):
        import pyarrow.parquet as pq

        with reopened(self.path):
            return pq.ParquetFile(self.path)

    def records(self, at: Ref) -> Iterator[tuple[Ref, Ref, dict[str, Any], str]]:
        row = at[0]
        if row >= self.rows:
            return
        group = int(np.searchsorted(self.group_starts, row, side="right")) - 1
        index = self.group_starts[group]
        pf = self._file()
        for g in range(group, len(self.group_starts) - 1):
            try:
                for batch in pf.iter_batches(batch_size=1024, row_groups=[g]):
                    for record in batch.to_pylist():
                        index += 1
                        if index > row:
                            yield [index - 1], [index], record, f"{self.path} row {index}"
            except (OSError, ValueError) as e:  # pyarrow's ArrowIOError / ArrowInvalid
                raise UserError(
                    f"{self.path} row group {g} cannot be read (truncated or damaged: {e}); copy the file again."
                ) from None

    def fetch(self, refs: list[Ref]) -> list[tuple[dict[str, Any], str]]:
        pf, groups = self._file(), {}
        out = []
        for (row,) in refs:
            g = int(np.searchsorted(self.group_starts, row, side="right")) - 1
            if g not in groups:
                groups = {g: pf.read_row_group(g)}  # refs come roughly in file order: keep one group
            out.append((groups[g].slice(row - self.group_starts[g], 1).to_pylist()[0], f"{self.path} row {row + 1}"))
        return out

    def count(self, at: Ref) -> int:
        return self.rows - at[0]  # the footer (read on opening) is at the end: a cut file has none


def open_reader(path: str | Path, fmt: str, key: str = "data.source"):
    path = existing_source(path, key, "a .jsonl, .csv, .parquet or .txt file")
    if path.is_dir():
        raise UserError(f"{key} {path} is a folder; point it at a .jsonl, .csv, .parquet or .txt file.")
    fmt = detect_format(path, key) if fmt == "auto" else fmt
    if fmt not in STREAM_FORMATS:
        raise UserError(
            f"{key} {path} is one {fmt.upper()} document, which cannot be read in pieces: convert it to "
            "JSON lines (one object a line), or set data.streaming=false."
        )
    if fmt == "parquet":
        return ParquetReader(path)
    return CsvReader(path) if fmt == "csv" else LineReader(path, fmt)


# ---- the held-out split of a streamed file ------------------------------------------------------


class HeldOutDraws:
    """One pass over a streamed file's answered records, each with its draw (sources.record_share), in bounded
    memory: the `cap` (VAL_MAX) lowest-drawn records and how many draws fall under data.val_split. A record is held
    out when its draw is under `cut` (val_split, as resident files hold out), so appending records never moves one
    into training. Validation keeps the `cap` lowest-drawn of them: a kept record stays kept unless more than `cap`
    lower-drawn records are appended, and a record drawn under the cut that is not kept still never trains. As
    sources.held_out, a file with no draw under val_split holds out its lowest-drawn records, and one with every
    draw under it trains its highest-drawn (a tiny file gets no empty split)."""

    def __init__(self, fraction: float, cap: int):
        self.fraction, self.cap, self.seen, self.over = fraction, cap, 0, 0
        self.heap: list[tuple[float, int, dict[str, Any], str]] = []  # (-draw, -order): the highest draw on top
        self.low, self.high = (math.inf, 0), (-math.inf, 0)  # (lowest draw, its records), (highest draw, its records)

    def add(self, share: float, record: dict[str, Any], where: str) -> None:
        self.seen += 1
        self.over += share >= self.fraction
        self.low = _tally(self.low, share, share < self.low[0])
        self.high = _tally(self.high, share, share > self.high[0])
        entry = (-share, -self.seen, record, where)  # of equal draws, the earlier record is kept
        if len(self.heap) < self.cap:
            heapq.heappush(self.heap, entry)
        elif entry[:2] > self.heap[0][:2]:
            heapq.heapreplace(self.heap, entry)

    def cut(self) -> tuple[float, int]:
        """(records drawn under this are held out, records that train)."""
        if self.over == self.seen:  # none drawn under val_split: the lowest-drawn is held out
            return math.nextafter(self.low[0], math.inf), self.seen - self.low[1]
        if not self.over:  # every record drawn under val_split: the highest-drawn trains
            return self.high[0], self.high[1]
        return self.fraction, self.over

    def kept(self, cut: float) -> tuple[list[dict[str, Any]], list[str]]:
        """The held-out records kept for validation, lowest draw first (sources.held_out's order), and their places."""
        held = sorted((e for e in self.heap if -e[0] < cut), key=lambda e: (-e[0], -e[1]))
        return [e[2] for e in held], [e[3] for e in held]


def _tally(at: tuple[float, int], share: float, beyond: bool) -> tuple[float, int]:
    """`at` (a draw, how many records have it) after one more record's `share`: replaced where beyond it."""
    if beyond:
        return share, 1
    return (share, at[1] + 1) if share == at[0] else at


# ---- when to stream --------------------------------------------------------------------------------


def decoded_mb(path: Path, fmt: str, max_length: int) -> tuple[float, int]:
    """(MB the resident path would hold, estimated rows), from the first MB of records: the parsed
    records (Python objects), their prompt/answer strings and two token lists of up to max_length ids."""
    reader = open_reader(path, fmt)
    size, read, rows, held = path.stat().st_size, 0, 0, 0
    for _, after, record, _ in reader.records(reader.start):
        rows += 1
        chars = sum(len(str(v)) for v in record.values())
        held += _deep_size(record) + 2 * chars + 2 * 8 * min(max_length, chars) + 200
        read = after[0] if len(after) > 1 else read
        if (read >= SAMPLE_BYTES) or rows >= 4096:
            break
    if not rows:
        return 0.0, 0
    total = reader.rows if isinstance(reader, ParquetReader) else max(rows, round(rows * size / max(1, read)))
    return held / rows * total / MB + size / MB, total  # the resident reader holds the file's bytes too


def _deep_size(value: Any) -> int:
    import sys

    if isinstance(value, dict):
        return sys.getsizeof(value) + sum(_deep_size(k) + _deep_size(v) for k, v in value.items())
    if isinstance(value, list):
        return sys.getsizeof(value) + sum(_deep_size(v) for v in value)
    return sys.getsizeof(value)


def budget_mb(data_cfg: TextData) -> float:
    """data.resident_max_mb, or for auto a third of the host memory available now."""
    budget = data_cfg.resident_max_mb
    if budget in (None, "auto"):
        import psutil

        return psutil.virtual_memory().available / MB / 3
    if isinstance(budget, bool) or not isinstance(budget, int | float) or budget <= 0:
        raise UserError(f"data.resident_max_mb={budget!r}: give a number of MB above 0, or auto.")
    return float(budget)


def streaming_choice(data_cfg: TextData) -> tuple[bool, str]:
    """(stream?, the reason the plan and the log give) for data.streaming auto | true | false."""
    setting = data_cfg.streaming
    if setting not in ("auto", True, False):
        raise UserError(f"data.streaming={setting!r} is not one of auto, true, false.")
    source = str(data_cfg.source or "")
    if source.startswith("builtin:"):
        return False, f"data: {source} is generated in memory (data.streaming does not apply)"
    if setting is False:
        return False, "data: read whole into memory (data.streaming=false)"
    if setting is True:
        return (
            True,
            f"data: streamed from {source} (data.streaming=true): read in order, "
            f"shuffled in a buffer of {data_cfg.shuffle_buffer} records",
        )
    budget, fmt, path = budget_mb(data_cfg), data_cfg.format, Path(source).expanduser()
    if not path.is_file():
        return False, f"data: read whole into memory (data.source {source} is not a file to stream)"
    if (fmt == "auto" and detect_format(path) not in STREAM_FORMATS) or fmt == "json":
        return False, "data: read whole into memory (a JSON document cannot be streamed)"
    if wide := wide_text(path):
        return _resident_wide(path, wide, budget)
    mb, rows = decoded_mb(path, fmt, data_cfg.max_length)
    if mb > budget:
        return True, (
            f"data: streamed from {path.name}: about {mb:.0f} MB decoded ({rows:,} records) is over "
            f"data.resident_max_mb={budget:.0f} (data.streaming=auto)"
        )
    return (
        False,
        f"data: held in memory: about {mb:.0f} MB decoded ({rows:,} records), within data.resident_max_mb={budget:.0f}",
    )


def _resident_wide(path: Path, wide: str, budget: float) -> tuple[bool, str]:
    """UTF-16/32 text is read whole (only UTF-8 is streamed): said, and refused where the file alone passes the
    budget, which its decoded records would pass further."""
    mb = path.stat().st_size / MB
    if mb > budget:
        raise UserError(
            f"data.source {path} is {wide} text of {mb:.0f} MB, over data.resident_max_mb={budget:.0f}, and only UTF-8 "
            f"text is streamed: save it as UTF-8 (iconv -f {wide.lower()} -t utf-8) or raise data.resident_max_mb."
        )
    return False, f"data: read whole into memory ({path.name} is {wide} text, which is not streamed; {mb:.1f} MB)"
