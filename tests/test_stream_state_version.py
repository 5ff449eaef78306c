"""A streamed loader's state saved before 49bff7c counted every record read in `index`; since then it counts kept
records (those with an answer). Resumed with several workers on a file with blank answers, the old meaning gave the
workers disagreeing partitions (some records trained twice, some never), so it is refused; elsewhere it resumes."""

import json
from pathlib import Path

import pytest

from onn.errors import UserError
from onn.modalities.text.stream_loader import ShuffledStream, _Stream
from onn.modalities.text.streaming import open_reader


def stream_over(path: Path, rows: int, blank_every: int) -> ShuffledStream:
    """The reviewer's case: `rows` records, every `blank_every`-th (from the second) with an empty answer."""
    answers = ["" if blank_every and i % blank_every == 1 else f"a{i}" for i in range(rows)]
    path.write_text("".join(json.dumps({"question": f"q{i}", "answer": a}) + "\n" for i, a in enumerate(answers)))
    reader = open_reader(path, "auto")
    kept = sum(a != "" for a in answers)
    return ShuffledStream(reader, reader.start, kept, 1, 0, lambda r, w: r["question"], lambda r, w: r["answer"] != "")


def interrupted(ds: ShuffledStream, workers: int, drop_marker: bool) -> tuple[dict, dict]:
    """Each worker draws a few records, then its saved state (as an old checkpoint's, without the marker)."""
    drawn, states = {}, {}
    for w in range(workers):
        s = _Stream(ds, 0, w, workers)
        drawn[w] = [next(s) for _ in range(3 + w)]
        states[w] = json.loads(json.dumps(s.state_dict()))
        if drop_marker:
            states[w].pop("counts", None)
    return drawn, states


def resumed(ds: ShuffledStream, workers: int, drawn: dict, states: dict) -> list[str]:
    out = []
    for w in range(workers):
        s = _Stream(ds, 0, w, workers)
        s.load_state_dict(states[w])
        out += drawn[w] + list(s)
    return out


def test_an_old_state_with_two_workers_on_blank_answers_is_refused(tmp_path):
    ds = stream_over(tmp_path / "d.jsonl", 30, 3)
    drawn, states = interrupted(ds, 2, drop_marker=True)
    with pytest.raises(UserError, match=r"saved before .* resume with data\.num_workers=0 or 1, or train from the"):
        _Stream(ds, 0, 0, 2).load_state_dict(states[0])


def test_a_new_state_with_two_workers_resumes_every_answered_record_once(tmp_path):
    ds = stream_over(tmp_path / "d.jsonl", 30, 3)
    drawn, states = interrupted(ds, 2, drop_marker=False)
    assert states[0]["counts"] == "kept"
    assert sorted(resumed(ds, 2, drawn, states)) == sorted(f"q{i}" for i in range(30) if i % 3 != 1)


@pytest.mark.parametrize(("workers", "blank_every"), [(1, 3), (2, 0)])
def test_an_old_state_resumes_where_the_partition_cannot_differ(tmp_path, workers, blank_every):
    """One worker (data.num_workers 0 or 1) owns every record; a file with no blank answer counts alike."""
    ds = stream_over(tmp_path / "d.jsonl", 30, blank_every)
    drawn, states = interrupted(ds, workers, drop_marker=True)
    answered = [f"q{i}" for i in range(30) if not (blank_every and i % blank_every == 1)]
    assert sorted(resumed(ds, workers, drawn, states)) == sorted(answered)
