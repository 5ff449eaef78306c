"""A streamed text file holds out records by their content's draw (sources.record_share), as a resident file does:
appending records never moves a trained record into the held-out set (the streamed path held out the first
round(total x val_split) answered records, so a grown file validated on records an earlier run trained on), and no
held-out record trains, also one past VAL_MAX that validation does not keep."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest
from conftest import compose

from onn.config.data import TextData
from onn.errors import UserError
from onn.modalities.text import datamodule as text_datamodule
from onn.modalities.text.sources import record_share


def record(i: int) -> dict[str, str]:
    return {"question": f"record {i}: what is {i % 7}+{i % 5}?", "answer": str(i % 7 + i % 5)}


def write(path: Path, first: int, last: int, mode: str = "w") -> None:
    with open(path, mode) as f:
        f.writelines(json.dumps(record(i)) + "\n" for i in range(first, last))


def setup(path: Path, streaming: bool, val_split: float):
    from onn.models.tokenizer import byte_tokenizer

    cfg: TextData = compose("data=text", f"data.source={path}").data
    cfg = dataclasses.replace(cfg, streaming=streaming, val_split=val_split, shuffle_buffer=8, batch_size=4)
    dm = text_datamodule.TextDataModule(cfg, byte_tokenizer(), cfg.batch_size, seed=0)
    dm.setup()
    return dm


def ids(texts) -> list[int]:
    return [int(re.search(r"record (\d+)", t).group(1)) for t in texts]


def split_of(dm) -> tuple[list[int], list[int]]:
    """(records one streamed epoch trains on, in order drawn; records held out for validation)."""
    from onn.models.tokenizer import byte_tokenizer

    tok, trained = byte_tokenizer(), []
    for batch in dm.train_dataloader():
        trained += [tok.decode(i[m.bool()].tolist()) for i, m in zip(batch["input_ids"], batch["attention_mask"])]
    return ids(trained), ids(prompt for prompt, _ in dm.val_examples)


def test_appending_to_a_streamed_file_moves_no_record_between_splits(tmp_path):
    source = tmp_path / "d.jsonl"
    write(source, 0, 60)
    trained, held = split_of(setup(source, True, 0.2))
    assert held and sorted(trained + held) == list(range(60))  # every record in exactly one split
    write(source, 60, 120, mode="a")
    dm = setup(source, True, 0.2)
    trained_now, held_now = split_of(dm)
    assert len(trained_now) == dm.train_records and dm.steps_per_epoch == math.ceil(dm.train_records / 4)
    assert sorted(trained_now + held_now) == list(range(120))
    assert set(held) <= set(held_now) and not set(held) & set(trained_now)  # held out stays held out
    assert [i for i in held_now if i < 60] == held  # and no record that trained is held out now


def test_a_streamed_file_holds_out_what_the_resident_file_holds_out(tmp_path):
    source = tmp_path / "d.jsonl"
    write(source, 0, 50)
    resident = setup(source, False, 0.3)
    streamed = setup(source, True, 0.3)
    assert streamed.val_examples == resident.val_examples  # the same records, in the same (draw) order
    assert sorted(split_of(streamed)[0]) == sorted(ids(p for p, _ in resident.train_examples))


def test_held_out_records_past_val_max_never_train(tmp_path, monkeypatch):
    """With VAL_MAX=3, validation keeps the 3 lowest-drawn records under val_split; the others drawn under it are
    in neither split, and the epoch's length counts what trains."""
    source = tmp_path / "d.jsonl"
    write(source, 0, 40)
    monkeypatch.setattr(text_datamodule, "VAL_MAX", 3)
    dm = setup(source, True, 0.3)
    trained, held = split_of(dm)
    draws = {i: record_share(0, record(i)) for i in range(40)}
    under = sorted((i for i in range(40) if draws[i] < 0.3), key=draws.__getitem__)
    assert len(under) > 3 and held == under[:3]
    assert sorted(trained) == sorted(i for i in range(40) if draws[i] >= 0.3) and len(trained) == dm.train_records


def test_an_earlier_onns_stream_state_is_refused_and_a_tiny_file_as_a_resident_read_refuses_it(tmp_path):
    """A stream state saved before records were held out by draw (it held out the file's first records) would train
    on records now held out and count an epoch the loader does not have: refused in one sentence. A file of two
    answered records among blank ones is too few to hold out, streamed or not (the streamed read counted the blank
    ones and went on)."""
    source = tmp_path / "d.jsonl"
    write(source, 0, 40)
    dm = setup(source, True, 0.2)
    stream = iter(dm.stream)
    state = stream.state_dict()
    assert state["held"] == "drawn"
    stream.load_state_dict(state)  # today's state resumes
    del state["held"]
    with pytest.raises(UserError, match="saved by an earlier ONN, which held out the first records"):
        stream.load_state_dict(state)
    tiny = tmp_path / "tiny.jsonl"
    rows = [record(0), record(1)] + [{"question": f"blank {i}", "answer": ""} for i in range(8)]
    tiny.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for streaming in (False, True):
        with pytest.raises(UserError, match="2 records with an answer: too few to hold out"):
            setup(tiny, streaming, 0.75)
