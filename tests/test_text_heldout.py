"""A text file without data.val_source holds out records by a hash of the seed and each record's content
(sources.record_share), not by a seeded shuffle of positions: appending records to the file re-drew the whole split,
so a resumed run or task=eval validated on records the model had trained on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import compose

from onn.errors import UserError
from onn.modalities.text.datamodule import TextDataModule
from onn.modalities.text.sources import held_out, record_share
from onn.models.tokenizer import byte_tokenizer


def rows(start: int, stop: int) -> list[dict[str, str]]:
    return [{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(start, stop)]


def write(path: Path, records: list[dict[str, str]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def splits(source: Path, seed: int) -> tuple[list[str], list[str]]:
    """(training answers, held-out answers) of a resident TextDataModule over `source`."""
    data = compose("data=text", f"data.source={source}", "data.val_split=0.25", "data.streaming=false").data
    dm = TextDataModule(data, byte_tokenizer(), batch_size=4, seed=seed)
    dm.setup("fit")
    return [a for _, a in dm.train_examples], [a for _, a in dm.val_examples]


def test_appending_records_keeps_the_held_out_records_held_out(tmp_path: Path):
    """40 records, then 40 more appended: every record held out before still is, and no record trained on before
    is held out now (the old shuffle of 80 positions drew another split)."""
    for seed in (0, 7):
        source = write(tmp_path / "qa.jsonl", rows(0, 40))
        train, val = splits(source, seed)
        assert len(train) + len(val) == 40 and val and train
        write(source, rows(0, 80))
        grown_train, grown_val = splits(source, seed)
        assert set(val) <= set(grown_val), seed
        assert not set(train) & set(grown_val), seed
        assert len(grown_train) + len(grown_val) == 80


def test_identical_records_fall_in_the_same_split(tmp_path: Path):
    """Each record written twice, far apart: both copies are held out or both train, so the model is never scored
    on a record it trained on (a shuffle of positions split the copies)."""
    source = write(tmp_path / "twice.jsonl", rows(0, 30) + rows(0, 30))
    train, val = splits(source, 0)
    assert val and train and not set(train) & set(val)
    assert len(train) + len(val) == 60
    assert all(train.count(a) == 2 for a in train) and all(val.count(a) == 2 for a in val)


def test_copies_stay_together_where_the_draw_holds_out_none_or_all():
    """A small file where the draw alone holds out nothing and one record must be moved: the cut moves past a
    record's copies rather than between them (it put one copy in each split for some seeds), and a file of one
    record copied is one sentence."""
    records = [{"t": "A"}, {"t": "A"}, {"t": "B0"}, {"t": "B1"}]
    for seed in range(40):
        train, val = held_out([record_share(seed, r) for r in records], 0.25)
        assert train and val and not {records[i]["t"] for i in train} & {records[i]["t"] for i in val}, seed
    with pytest.raises(UserError, match="records are all one record"):
        held_out([record_share(0, {"t": "A"})] * 3, 0.3)
