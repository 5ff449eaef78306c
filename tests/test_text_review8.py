"""Text data as users bring it, review 8: a pandas CSV with its index column, a corpus whose text comes with
metadata, Alpaca records that leave out their input, a JSON lines file whose first record is long, an answer
pattern whose group sits out a match, and the token picture of a model with learned positions."""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import re
from pathlib import Path

import pytest
import torch
from conftest import SHARED_DATA, compose, execute_run

from onn.config.data import TextFields
from onn.errors import UserError
from onn.modalities.text.datamodule import IGNORE, TextDataModule, extract
from onn.modalities.text.formats import detect_format, read_records
from onn.modalities.text.generate import readable_references
from onn.modalities.text.picture import token_probabilities, write_picture
from onn.modalities.text.prompts import Prompter, choose_layout
from onn.modalities.text.streaming import LineReader, open_reader, streaming_choice
from onn.models.tokenizer import byte_tokenizer

GSM8K = SHARED_DATA / "gsm8k" / "train.jsonl"
TEXT = compose("data=text", "data.source=unused.jsonl").data  # fields auto, template {prompt}, chat_template auto
AUTO = dataclasses.replace(TEXT, fields=TextFields(input="auto", output="auto"))


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")  # one hardware profile for the module's runs


def streamed(path: Path) -> list[dict]:
    reader = open_reader(path, "auto")
    return [record for _, _, record, _ in reader.records(reader.start)]


def gsm8k_rows(n: int) -> list[dict]:
    if not GSM8K.is_file():
        pytest.skip("../shared/data/gsm8k is not on this machine")
    with open(GSM8K, encoding="utf-8") as f:
        return [json.loads(next(f)) for _ in range(n)]


def pandas_csv(path: Path, rows: list[dict]) -> Path:
    """What pandas' DataFrame.to_csv(path) writes (index=True, its default): an unnamed index column first."""
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(["", *rows[0]])
        writer.writerows([i, *row.values()] for i, row in enumerate(rows))
    return path


def test_a_pandas_csv_with_its_index_column_is_read_as_a_table(tmp_path):
    """pandas' to_csv writes an unnamed index column, so the header `,question,answer` failed as column names: the
    table was read as plain text, a record a line, and data=gsm8k trained on raw CSV lines without a word."""
    rows = gsm8k_rows(40)
    source = pandas_csv(tmp_path / "gsm8k_train.csv", rows)
    records = read_records(source)
    assert records[0] == {"Unnamed: 0": "0", **rows[0]} and len(records) == 40
    assert streamed(source) == list(records)  # the streaming reader names the column as the resident one does
    gsm8k = compose("data=gsm8k", f"data.source={source}").data
    examples = Prompter(gsm8k, byte_tokenizer()).examples(records)
    assert examples[0] == (f"Question: {rows[0]['question']}\nAnswer: ", rows[0]["answer"])


@pytest.mark.slow
def test_a_pandas_csv_with_its_index_column_trains_on_its_questions_and_answers(tmp_path, cache):
    """The same file through a training run: data=gsm8k maps question -> answer, and the loss falls."""
    source = pandas_csv(tmp_path / "gsm8k_train.csv", gsm8k_rows(40))
    m = execute_run(
        tmp_path,
        cache,
        "data=gsm8k",
        f"data.source={source}",
        "data.max_length=96",
        "data.batch_size=4",
        "data.val_split=0.1",
        "trainer.max_steps=4",
        "task.validate_before=false",
        "task.exact_match_samples=0",
    )
    assert m["data/layout"] == "fields" and m["data/mapping"] == "question -> answer"
    assert m["data/train_records"] + m["data/val_records"] == 40
    assert m["train/loss_final"] < m["train/loss_initial"]


def test_a_corpus_whose_text_comes_with_metadata_is_plain_text(tmp_path):
    """C4's {text, url, timestamp} or the Pile's {text, meta}: no layout matched, and data.fields could not say
    "plain text", so the most common corpus layout could not be trained on at all."""
    source = tmp_path / "c4.jsonl"
    docs = [f"Document {i}: the river runs past the mill." for i in range(20)]
    source.write_text(
        "".join(
            json.dumps({"text": d, "url": f"https://example.org/{i}", "timestamp": "2019-04-25"}) + "\n"
            for i, d in enumerate(docs)
        )
    )
    tokenizer = byte_tokenizer()
    dm = TextDataModule(dataclasses.replace(AUTO, source=str(source), val_split=0.1), tokenizer, batch_size=4)
    dm.setup("fit")
    assert dm.prompter.layout.name == "text"
    ids, labels = dm.train_set[0]
    text = tokenizer.decode([t for t in labels if t != IGNORE], skip_special_tokens=True)
    assert ids[0] == tokenizer.bos_token_id and labels[0] == IGNORE and text in docs  # loss on every token
    answered = tmp_path / "answered.jsonl"  # an answer field beside text is still a mapping to ask for
    answered.write_text(json.dumps({"text": "2+2?", "response": "4"}) + "\n")
    with pytest.raises(UserError, match=r"no prompt/answer layout ONN knows"):
        Prompter(AUTO, tokenizer).examples(read_records(answered))


def test_alpaca_records_that_leave_out_their_input_are_prompted_by_their_instruction(tmp_path):
    """Alpaca's layout takes the input "when it is not empty"; a record without the key at all (datasets written
    with the empty ones dropped) was refused as having no field 'input', named in the layout auto chose."""
    source = tmp_path / "alpaca.jsonl"
    rows = [
        {"instruction": "Add 2 and 3.", "input": "Show the sum.", "output": "5"},
        {"instruction": "Name a colour.", "output": "red"},
        {"instruction": "Spell cat.", "input": None, "output": "c-a-t"},
    ]
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompter = Prompter(AUTO, byte_tokenizer())
    assert prompter.examples(read_records(source)) == [
        ("Add 2 and 3.\n\nShow the sum.", "5"),
        ("Name a colour.", "red"),
        ("Spell cat.", "c-a-t"),
    ]
    assert prompter.layout.name == "alpaca"


def test_a_json_lines_file_whose_first_record_is_long_streams(tmp_path):
    """Format detection reads 64 KB: a first record longer than that (a long document) was taken for one JSON
    document, so data.streaming=true refused the file and auto held it whole in memory."""
    source = tmp_path / "books.jsonl"
    rows = [{"text": "word " * 20_000}] + [{"text": f"short record {i}"} for i in range(30)]
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reader = open_reader(source, "auto")
    assert isinstance(reader, LineReader) and reader.count(reader.start) == 31
    assert streamed(source)[1:3] == rows[1:3]
    streams, reason = streaming_choice(dataclasses.replace(TEXT, source=str(source), resident_max_mb=0.01))
    assert streams, reason
    nulls = tmp_path / "nulls.jsonl"  # a streamed line that is no object is named as the resident reader names it
    nulls.write_text('{"text": "a"}\n{"text": "b"}\nnull\n')
    with pytest.raises(UserError, match=r"nulls.jsonl line 3 is a JSON null, not an object"):
        streamed(nulls)
    document = tmp_path / "one.json"  # one JSON document on one long line is still a document
    document.write_text(json.dumps({"rows": rows}))
    with pytest.raises(UserError, match=r"is one JSON document"):
        open_reader(document, "auto")


def test_an_answer_pattern_whose_group_sits_out_a_match_reads_the_match_that_has_it(caplog):
    """An optional group, or one side of `a|b`, matches with group 1 None: its .strip() was an AttributeError
    after the whole evaluation had generated its answers."""
    assert extract("#### \nso the total is #### 18", r"####\s*(\d+)?") == ("18", "pattern")
    assert extract("she has 7 left", r"####\s*(\d+)?", last_number=True) == ("7", "last number")
    either = r"#### (\d+)|answer is (\d+)"
    examples = [("Q: 2+3", "#### 5"), ("Q: 2+4", "so the answer is 6")]
    with caplog.at_level(logging.WARNING, logger="onn"):
        readable, left_out = readable_references(examples, either)
    assert readable == examples[:1] and left_out == 1 and "1 of 2 references hold no answer" in caplog.text


def test_the_token_picture_stays_within_the_models_learned_positions(tmp_path):
    """The picture tokenizes the completion's text again, which a byte that is no UTF-8 makes longer than what
    was generated (U+FFFD is three bytes): past GPT-2's n_positions that was an IndexError in its embedding."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=259, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=256, eos_token_id=257
    )
    model = GPT2LMHeadModel(config).eval()
    tokenizer = byte_tokenizer()
    texts, probabilities, prompt_tokens = token_probabilities(model, tokenizer, "abcdefgh", "\ufffd" * 4, bos=True)
    assert len(texts) == len(probabilities) == 16 and prompt_tokens == 9
    assert all(0 <= p <= 1 for p in probabilities[1:])
    write_picture(texts, probabilities, prompt_tokens, tmp_path / "tokens.png")
    assert (tmp_path / "tokens.png").stat().st_size > 0


@pytest.mark.parametrize("extra", ["label", "summary", "translation"])
def test_text_beside_another_text_field_is_refused_not_trained_as_plain_text(extra):
    """{text, label} or {text, summary} were taken for a corpus with metadata: the label or summary was dropped
    and the text trained alone. Text beside a field of text that is no metadata asks for data.fields."""
    records = [{"text": f"an article {i}", extra: f"its {extra} {i}"} for i in range(4)]
    with pytest.raises(UserError, match=re.escape(f"fields {sorted([extra, 'text'])}, which are no prompt/answer")):
        choose_layout(records, TextFields("auto", "auto"))
    wiki = [{"id": str(i), "url": f"https://w/{i}", "title": f"Page {i}", "text": f"an article {i}"} for i in range(4)]
    assert choose_layout(wiki, TextFields("auto", "auto")).name == "text"  # a title describes its text


@pytest.mark.parametrize("lines", [["\tfor i in range(10):", "\t\tprint(i)", "\treturn i"], ["\tThe woods", "\tBut I"]])
def test_lines_that_start_with_a_tab_are_text_not_a_table(tmp_path, lines):
    """An empty first header cell is pandas' index column only where every row holds a value there: a poem or
    code whose lines each start with a tab was read as a tab-separated table with an `Unnamed: 0` column."""
    path = tmp_path / "indented.txt"
    path.write_text("\n".join(lines) + "\n")
    assert detect_format(path) == "txt"
