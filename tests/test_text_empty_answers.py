"""Records with an empty answer are left out everywhere: streamed training rows too (with an exact epoch length and
resume), a held-out split is cut from answered records, and bench_giant prompts the held-out set training scores."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import pytest
from conftest import compose

from onn.bench import giant
from onn.errors import UserError
from onn.modalities.text.datamodule import IGNORE, TextDataModule
from onn.modalities.text.sources import held_out, record_share
from onn.models.tokenizer import byte_tokenizer


def write_jsonl(path: Path, answers: list[str]) -> Path:
    path.write_text("".join(json.dumps({"question": f"q{i}?", "answer": a}) + "\n" for i, a in enumerate(answers)))
    return path


def module(source: Path, *over: str, batch_size: int = 3) -> TextDataModule:
    data = compose("data=text", f"data.source={source}", "data.max_length=64", *over).data
    return TextDataModule(data, byte_tokenizer(), batch_size=batch_size)


def drawn_split(answers: list[str], fraction: float) -> tuple[list[int], list[int]]:
    """(training, held-out) record numbers of write_jsonl's file: its answered records split by their draw, as
    sources.held_out splits a resident file and the streamed path splits it too."""
    lines = [i for i, a in enumerate(answers) if a]
    train, held = held_out([record_share(0, {"question": f"q{i}?", "answer": answers[i]}) for i in lines], fraction)
    return [lines[i] for i in train], [lines[i] for i in held]


def questions(batch) -> list[str]:
    """Each row's question (`qN?`), read back from its tokens."""
    tokenizer = byte_tokenizer()
    texts = [tokenizer.decode(i[m.bool()].tolist()) for i, m in zip(batch["input_ids"], batch["attention_mask"])]
    return [t[t.index("q") : t.index("?") + 1] for t in texts]


def answered_targets(batch) -> bool:
    """Every row trains on more than the end-of-sequence token (the shifted labels' first target is the EOS alone
    for an empty answer)."""
    return bool(((batch["labels"] != IGNORE).sum(1) > 1).all())


@pytest.mark.parametrize("workers", [0, 2])
def test_streamed_training_leaves_out_empty_answers_with_an_exact_epoch(tmp_path, caplog, workers):
    """46dc100 checked only the streamed held-out records: 18 of 36 training rows trained on EOS alone, and the
    warning said 'left out 2 of 4' for a 40-row file. The loader's length (what Lightning was told) is the number
    of batches it gives, with each worker skipping the same records."""
    answers = ["" if i % 2 else f"a{i}" for i in range(40)]
    source = write_jsonl(tmp_path / "qa.jsonl", answers)
    train, held = drawn_split(answers, 0.1)
    dm = module(
        source, "data.streaming=true", "data.val_split=0.1", "data.shuffle_buffer=4", f"data.num_workers={workers}"
    )
    with caplog.at_level(logging.WARNING, logger="onn"):
        dm.setup("fit")
    said = [r.getMessage() for r in caplog.records if "answer is empty" in r.getMessage()]
    assert len(said) == 1 and f"data.source {source}: left out 20 of 40 records" in said[0]
    assert dm.train_records == len(train) and len(dm.val_set) == len(held) and len(train) + len(held) == 20
    loader = dm.train_dataloader()
    batches = list(loader)
    assert len(batches) == len(loader) == dm.steps_per_epoch
    seen = [q for b in batches for q in questions(b)]
    assert all(answered_targets(b) for b in batches)
    assert sorted(seen) == sorted(f"q{i}?" for i in train)  # the answered records drawn under 0.1 are held out


def test_a_streamed_stream_resumes_on_the_same_record_past_skipped_ones(tmp_path):
    """The stream's position counts kept records: a loader state taken mid-epoch continues as the unbroken run."""
    answers = ["" if i % 3 == 0 else f"a{i}" for i in range(60)]
    source = write_jsonl(tmp_path / "qa.jsonl", answers)
    over = ("data.streaming=true", "data.val_split=0.05", "data.shuffle_buffer=5", "data.num_workers=0")
    whole_dm = module(source, *over)
    whole_dm.setup("fit")
    whole_loader = whole_dm.train_dataloader()
    whole = [q for b in list(whole_loader) + list(whole_loader) for q in questions(b)]
    assert len(whole) == 2 * whole_dm.train_records == 2 * len(drawn_split(answers, 0.05)[0])  # 40 answered
    dm = module(source, *over)
    dm.setup("fit")
    loader = dm.train_dataloader()
    it, first = iter(loader), []
    for _ in range(5):
        first += questions(next(it))
    state = json.loads(json.dumps(loader.state_dict()))
    resumed_dm = module(source, *over)
    resumed_dm.setup("fit")
    resumed = resumed_dm.train_dataloader()
    resumed.load_state_dict(state)
    rest = [q for b in list(resumed) + list(resumed) for q in questions(b)]
    assert first + rest == whole


def test_a_streamed_file_starting_unanswered_holds_out_its_first_answered_records(tmp_path):
    """A file whose first rows (once the streamed held-out split) have no answer was refused after 46dc100, though
    its training rows had answers; now its answered records are held out by their draw."""
    answers = [""] * 4 + [f"a{i}" for i in range(4, 40)]
    source = write_jsonl(tmp_path / "qa.jsonl", answers)
    dm = module(source, "data.streaming=true", "data.val_split=0.1")
    dm.setup("fit")
    train, held = drawn_split(answers, 0.1)
    assert [int(w.rsplit(" ", 1)[1]) - 1 for w in dm.val_where] == held and min(held) >= 4
    assert dm.train_records == len(train) == 36 - len(held) and dm.steps_per_epoch == -(-len(train) // 3)


def test_an_unanswered_resident_held_out_split_is_cut_again_from_answered_records(tmp_path, caplog):
    """The resident held-out split drawn by load_splits may be all unanswered rows: 46dc100 refused the file."""
    rows = lambda blank: [{"question": f"q{i}?", "answer": blank if i == 3 else f"a{i}"} for i in range(10)]  # noqa: E731
    draws = lambda blank: [record_share(0, r) for r in rows(blank)]  # noqa: E731
    blank = next(" " * k for k in range(200) if min(draws(" " * k)) == draws(" " * k)[3])  # record 3 drawn lowest
    source = write_jsonl(tmp_path / "qa.jsonl", [r["answer"] for r in rows(blank)])
    dm = module(source, "data.val_split=0.1", "data.streaming=false")
    with caplog.at_level(logging.WARNING, logger="onn"):
        dm.setup("fit")
    answered_lines = [i for i in range(10) if i != 3]
    _, held = held_out([draws(blank)[i] for i in answered_lines], 0.1)
    assert dm.val_set and dm.val_where == [f"{source} line {answered_lines[i] + 1}" for i in held]
    assert sorted(dm.val_where + dm.train_where) == sorted(f"{source} line {i + 1}" for i in answered_lines)
    assert any("left out 1 of 10 records" in r.getMessage() for r in caplog.records)
    full = write_jsonl(tmp_path / "full.jsonl", [f"a{i}" for i in range(10)])  # every answer given: load_splits' split
    dm = module(full, "data.val_split=0.1", "data.streaming=false")
    dm.setup("fit")
    _, held = held_out([record_share(0, r) for r in rows("a3")], 0.1)
    assert dm.val_where == [f"{full} line {i + 1}" for i in held]
    spaces = write_jsonl(tmp_path / "blank.jsonl", [" "] * 3)
    dm = module(full, f"data.val_source={spaces}", "data.streaming=false")
    with pytest.raises(UserError, match=r"data.val_source .*blank.jsonl: all 3 of its validation records"):
        dm.setup("fit")


def test_bench_giant_prompts_leave_out_unanswered_held_out_records(tmp_path):
    """giant._prompts took the held-out records without the empty-answer filter: its prompts were not the ones
    training evaluates on."""
    order = list(range(12))
    random.Random(0).shuffle(order)
    answers = [f"a{i}" for i in range(12)]
    answers[order[0]] = ""  # the first held-out record has no answer
    source = write_jsonl(tmp_path / "qa.jsonl", answers)
    config = compose("data=text", f"data.source={source}", "data.val_split=0.25", "data.max_length=64")
    dm = TextDataModule(config.data, byte_tokenizer(), batch_size=2, seed=config.seed)
    dm.setup("validate")
    trained = [ids[: next(i for i, t in enumerate(labels) if t != IGNORE)] for ids, labels in dm.val_set]
    assert giant._prompts(config, byte_tokenizer(), len(trained) + 5) == trained
