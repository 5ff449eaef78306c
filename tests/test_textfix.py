"""A one-line .jsonl file is JSON lines, the empty-prompt check counts a whole file rather than a seed's held-out
slice, task=infer keeps a reference `completion`, and last-number extraction reads "5-10" as 10."""

from __future__ import annotations

import json
import logging

from conftest import compose

from onn.modalities.text.datamodule import TextDataModule, extract
from onn.modalities.text.formats import read_records
from onn.modalities.text.sources import held_out, record_share
from onn.modalities.text.streaming import open_reader
from onn.modalities.text.tasks import prediction_rows
from onn.models.tokenizer import byte_tokenizer

CONVERSATION = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}


def test_one_line_jsonl_is_one_record_resident_and_streamed(tmp_path):
    """Auto-detection took a one-line .jsonl file for one JSON document: its messages became two records (a
    'fields [content, role]' error later), and data.streaming=true refused it as a document."""
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps(CONVERSATION) + "\n")
    assert list(read_records(path, "auto")) == [CONVERSATION]
    reader = open_reader(path, "auto")
    assert [record for _, _, record, _ in reader.records(reader.start)] == [CONVERSATION]


def test_empty_prompt_share_is_the_whole_files_under_every_seed(tmp_path, caplog):
    """4 of 40 prompts empty (10%): a seed that held out two of them refused the file ('100% ... (2 of 2)') while
    seed 0 trained on it. Both seeds now train, with one warning giving the whole file's 4 of 40."""
    source = tmp_path / "empty10.jsonl"
    rows = [{"prompt": "" if i % 10 == 0 else f"q{i}", "completion": f"a{i}"} for i in range(40)]
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    unlucky = next(s for s in range(10_000) if all(i % 10 == 0 for i in _held(s, rows, 0.05)))
    data = compose("data=text", f"data.source={source}", "data.max_length=64", "data.val_split=0.05").data
    for seed in (0, unlucky):
        caplog.clear()
        dm = TextDataModule(data, byte_tokenizer(), batch_size=4, seed=seed)
        with caplog.at_level(logging.WARNING, logger="onn"):
            dm.setup("fit")
        said = [r.getMessage() for r in caplog.records if "is empty in" in r.getMessage()]
        assert len(said) == 1 and "(4 of 40)" in said[0], (seed, said)
        assert len(dm.train_examples) + len(dm.val_examples) == 40 and dm.val_examples


def _held(seed: int, rows: list[dict], fraction: float) -> list[int]:
    """The records load_splits holds out for `seed` (drawn by their content)."""
    return held_out([record_share(seed, r) for r in rows], fraction)[1]


def test_infer_rows_keep_a_reference_completion(caplog):
    """{**row, "completion": generated} overwrote the input's reference answers in predictions.jsonl silently."""
    rows = [{"prompt": "2+2?", "completion": "4"}, {"prompt": "3+3?"}]
    with caplog.at_level(logging.WARNING, logger="onn"):
        out = prediction_rows(rows, ["5", "6"], "prompts.jsonl")
    assert out == [
        {"prompt": "2+2?", "reference_completion": "4", "completion": "5"},
        {"prompt": "3+3?", "completion": "6"},
    ]
    assert rows[0]["completion"] == "4"  # the rows read are left as they were
    assert sum("reference_completion" in r.getMessage() for r in caplog.records) == 1


def test_last_number_reads_a_range_end_without_a_minus():
    assert extract("She works 5-10 hours", r"####\s*(-?[0-9][0-9,\.]*)", last_number=True) == ("10", "last number")
    assert extract("it fell to -5", r"####\s*(\d+)", last_number=True) == ("-5", "last number")
