"""Text data: formats detected from content, field mapping, answer-only loss, clear errors."""

import json

import pytest
from conftest import compose

from onn.errors import UserError
from onn.modalities.text import builtin as math_data
from onn.modalities.text.datamodule import IGNORE, encode, extract_answer
from onn.modalities.text.formats import Records, detect_format, read_records
from onn.modalities.text.prompts import Prompter
from onn.modalities.text.sources import load_splits
from onn.models.tokenizer import byte_tokenizer

ROWS = [{"q": f"What is {i} + 1?", "a": str(i + 1)} for i in range(20)]


def write_all_formats(tmp_path):
    """The same rows in every format, under misleading names (detection reads content)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = {}
    files["jsonl"] = tmp_path / "rows.txt"
    files["jsonl"].write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    files["json"] = tmp_path / "list.data"
    files["json"].write_text(json.dumps(ROWS, indent=2))
    files["csv"] = tmp_path / "table.dat"
    files["csv"].write_text("q,a\n" + "\n".join(f'"{r["q"]}",{r["a"]}' for r in ROWS) + "\n")
    files["parquet"] = tmp_path / "table.bin"
    pq.write_table(pa.Table.from_pylist(ROWS), files["parquet"])
    return files


def test_every_format_reads_the_same_rows(tmp_path):
    for fmt, path in write_all_formats(tmp_path).items():
        assert detect_format(path) == fmt, path
        rows = read_records(path)
        assert [(r["q"], str(r["a"])) for r in rows] == [(r["q"], r["a"]) for r in ROWS], fmt
    cols = tmp_path / "cols.json"
    cols.write_text(json.dumps({"q": [r["q"] for r in ROWS], "a": [r["a"] for r in ROWS]}))
    assert read_records(cols)[3] == ROWS[3]
    txt = tmp_path / "corpus.jsonl"  # plain text despite the name
    txt.write_text("the cat sat\non the mat\n")
    assert detect_format(txt) == "txt" and read_records(txt) == [
        {"text": "the cat sat"},
        {"text": "on the mat"},
    ]


def test_a_one_column_csv_reads_as_csv(tmp_path):
    """pandas' to_csv of one `text` column (a lone header, a field quoted where it holds a comma, quote or newline)
    was read as plain text: the header became a record, quotes stayed and a quoted newline split a record."""
    import csv
    import io

    from onn.modalities.text.streaming import open_reader

    texts = ["plain row", "a row, with a comma", 'she said "hi"', "first line\nsecond line"] * 3
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows([["text"], *[[t] for t in texts]])
    for name in ("one.csv", "one.dat"):  # by its name, and by its quoting alone
        path = tmp_path / name
        path.write_text(buf.getvalue())
        assert detect_format(path) == "csv" and read_records(path) == [{"text": t} for t in texts], name
        reader = open_reader(path, "auto")
        assert [r for _, _, r, _ in reader.records(reader.start)] == [{"text": t} for t in texts], name
    named = tmp_path / "plain.csv"  # nothing quoted: the .csv name makes its first line a header
    named.write_text("text\nrow 0\nrow 1\n")
    assert read_records(named) == [{"text": "row 0"}, {"text": "row 1"}]
    for prose in ('Chapter 1\n"Hello," she said.\nHe nodded.\n', 'Notes\none, two\n"three"\n'):
        (tmp_path / "story.txt").write_text(prose)  # a title line, then quotes a CSV would not write: text
        assert detect_format(tmp_path / "story.txt") == "txt"


def test_bad_inputs_name_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"q": "a", "a": "1"}\n{"q": "b", "a": \n')
    with pytest.raises(UserError, match=r"bad.jsonl line 2 is not valid JSON"):
        read_records(bad)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(UserError, match="is empty"):
        read_records(empty)
    with pytest.raises(UserError, match="does not exist"):
        read_records(tmp_path / "nope.jsonl")
    mapping = compose(
        "data=text", "data.source=f.jsonl", "data.fields.input=question", "data.fields.output=answer"
    ).data
    records = Records([{"question": "x", "answer": "1"}, {"question": "y"}], ["f.jsonl line 1", "f.jsonl line 2"])
    with pytest.raises(UserError, match=r"f.jsonl line 2 has no field 'answer' \(data.fields.output\)"):
        Prompter(mapping, byte_tokenizer()).examples(records)


def test_loss_only_on_answer_tokens_and_truncation_keeps_answer():
    tok = byte_tokenizer()
    ids, labels = encode(tok, "Question: 2+2\nAnswer: ", "4", max_length=64)
    answer = [t for t in labels if t != IGNORE]
    assert tok.decode(answer, skip_special_tokens=True) == "4" and answer[-1] == tok.eos_token_id
    ids, labels = encode(tok, "x" * 100 + "Answer: ", "42", max_length=16)
    assert len(ids) == 16 and tok.decode([t for t in labels if t != IGNORE], skip_special_tokens=True) == "42"


def test_builtin_math_is_exact_and_deterministic():
    a, b = math_data.generate(200, seed=3), math_data.generate(200, seed=3)
    assert a == b and a != math_data.generate(200, seed=4)
    for r in a:
        q = r["input"]
        if q.startswith("What is"):
            x, op, y = q.removeprefix("What is ").rstrip("?").split()
            assert int(r["output"]) == {"+": int(x) + int(y), "-": int(x) - int(y), "*": int(x) * int(y)}[op]
    train, val = load_splits(
        compose("data=math", "data.builtin.train_size=50", "data.builtin.val_size=10").data, seed=0
    )
    assert len(train) == 50 and len(val) == 10


def test_extract_answer():
    assert extract_answer("She pays 3 * 4 = 12.\n#### 1,200", r"####\s*(-?[0-9][0-9,\.]*)") == "1200"
    assert extract_answer("42<eos>junk".replace("<eos>", "\n"), None) == "42"
    assert extract_answer("7.0", None) == "7"
