"""Text data: records with an empty answer are left out (said once per file), and bench_giant's held-out prompts
are laid out exactly as training lays them."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from conftest import compose

from onn.bench import giant
from onn.errors import UserError
from onn.modalities.text.datamodule import IGNORE, TextDataModule
from onn.models.tokenizer import byte_tokenizer


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_records_with_an_empty_answer_are_left_out_in_one_warning(tmp_path, caplog):
    """A CSV row whose answer cell was blank (or spaces) trained silently on the end-of-sequence token alone."""
    source = tmp_path / "qa.csv"
    answers = ["1", "", "3", "  ", "5", "6", "7", "8"]
    source.write_text("question,answer\n" + "".join(f"what is {i}?,{a}\n" for i, a in enumerate(answers)))
    data = compose("data=text", f"data.source={source}", "data.val_split=0.25").data
    dm = TextDataModule(data, byte_tokenizer(), batch_size=2)
    with caplog.at_level(logging.WARNING, logger="onn"):
        dm.setup("fit")
    encoded = dm.train_set + dm.val_set
    assert len(encoded) == 6 and dm.train_records == len(dm.train_set)
    assert all(sum(t != IGNORE for t in labels) > 1 for _, labels in encoded)  # an answer, not EOS alone
    kept = sorted(dm.train_where + dm.val_where)
    assert not any(place.endswith(("row 2 (line 3)", "row 4 (line 5)")) for place in kept)
    said = [r.getMessage() for r in caplog.records if "answer is empty" in r.getMessage()]
    assert len(said) == 1 and f"data.source {source}: left out 2 of 8 records" in said[0]


def test_a_file_whose_answers_are_all_empty_is_refused(tmp_path):
    source = write_jsonl(tmp_path / "qa.jsonl", [{"question": f"q{i}", "answer": " "} for i in range(6)])
    data = compose("data=text", f"data.source={source}").data
    with pytest.raises(UserError, match=r"data.source .*qa.jsonl: all \d+ of its training records have an empty"):
        TextDataModule(data, byte_tokenizer(), batch_size=2).setup("fit")


PLAIN = [{"text": f"Story {i}: once upon a time."} for i in range(10)]
QA = [{"question": f"Capital of country {i}?", "answer": "Paris"} for i in range(4)]


@pytest.mark.parametrize("held_out", [None, QA], ids=["plain-text-split", "questions-for-a-plain-model"])
def test_bench_giant_prompts_are_the_prompts_training_encodes(tmp_path, held_out):
    """giant._prompts tokenized with add_special_tokens alone: a plain-text model on a tokenizer that adds no BOS
    (GPT-2's, the byte one) was prompted without the BOS training began every text with, and a held-out file of
    questions took its own layout instead of the training data's."""
    overrides = ["data=text", f"data.source={write_jsonl(tmp_path / 'train.jsonl', PLAIN)}", "data.max_length=64"]
    if held_out:
        overrides.append(f"data.val_source={write_jsonl(tmp_path / 'val.jsonl', held_out)}")
    config = compose(*overrides)
    tokenizer = byte_tokenizer()
    dm = TextDataModule(config.data, tokenizer, batch_size=2, seed=config.seed)
    dm.setup("validate")
    trained = [ids[: next(i for i, t in enumerate(labels) if t != IGNORE)] for ids, labels in dm.val_set]
    prompts = giant._prompts(config, tokenizer, len(trained))
    assert prompts == trained and all(p[0] == tokenizer.bos_token_id for p in prompts)
