"""The data layer as a sixth review found it: a manifest row with a quoted field over several lines named by its last
line, a manifest quote never closed read to the end of the file in silence, a manifest saved with carriage returns
alone refused as "line 0", data.label_from=manifest without a manifest
told that its manifest names none of the files, and predictions of files whose names are not UTF-8 on disk lost to
an encoding error after the whole inference."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from test_data_review import audio_data, wav_bytes

from onn.data.files import walk_files, write_jsonl
from onn.data.labelled import list_labelled
from onn.errors import UserError

WAV = frozenset({".wav"})


def class_folders(root: Path, per_class: int = 3) -> Path:
    """root/cat/N.wav and root/dog/N.wav, each a real WAV of its own tone."""
    for c, label in enumerate(("cat", "dog")):
        (root / label).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            (root / label / f"{i}.wav").write_bytes(wav_bytes(300 + 200 * c + 20 * i))
    return root


def test_a_manifest_row_with_a_quoted_field_over_lines_is_named_by_its_first_line(tmp_path):
    """csv's line_num is the line a row ends on: a row whose quoted label spans two lines was named by its second,
    and the user looked for the conflict one line too far down."""
    ds = class_folders(tmp_path / "ds")
    (ds / "metadata.csv").write_text('file_name,label\ncat/0.wav,cat\ncat/0.wav,"tabby\ncat"\n', encoding="utf-8")
    with pytest.raises(UserError, match=r"metadata\.csv line 3 labels cat/0\.wav 'tabby\\ncat'"):
        list_labelled(ds, WAV, label_from="manifest", kind="audio")


def test_a_manifest_with_multi_line_labels_keeps_every_row_and_names_a_bad_one_by_its_first_line(tmp_path):
    """Rows after a multi-line quoted field are read, and an extra field in the row that starts on line 4 is named
    at line 4 (csv named line 5, where that row ends)."""
    ds = class_folders(tmp_path / "ds", per_class=1)
    rows = 'file_name,label\ncat/0.wav,"a cat,\nsleeping"\ndog/0.wav,"a dog,\nrunning",extra\n'
    (ds / "metadata.csv").write_text(rows, encoding="utf-8")
    with pytest.raises(UserError, match=r"metadata\.csv line 4 has 1 more field"):
        list_labelled(ds, WAV, label_from="manifest", kind="audio")
    (ds / "metadata.csv").write_text(rows.replace(",extra", ""), encoding="utf-8")
    listing = list_labelled(ds, WAV, label_from="manifest", kind="audio")
    assert {f.name: f.label for f in listing.splits["all"]} == {
        "cat/0.wav": "a cat,\nsleeping",
        "dog/0.wav": "a dog,\nrunning",
    }


def test_a_manifest_quote_that_is_never_closed_is_named_not_read_to_the_end(tmp_path):
    """csv reads an unclosed quote to the end of the file without a word: every row after it became part of one label
    and its files were left out as "not in the manifest". It is one sentence naming the line the quote opens on."""
    ds = class_folders(tmp_path / "ds")
    rows = ["file_name,label", 'cat/0.wav,"cat'] + [f"{c}/{i}.wav,{c}" for c in ("cat", "dog") for i in range(3)][1:]
    (ds / "metadata.csv").write_text("\n".join(rows) + "\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"metadata\.csv line 2 opens a double quote that no later line closes"):
        list_labelled(ds, WAV, label_from="manifest", kind="audio")
    (ds / "metadata.csv").write_text("\n".join(rows).replace('"cat', '"cat"') + "\n", encoding="utf-8")
    listing = list_labelled(ds, WAV, label_from="manifest", kind="audio")
    assert sum(len(files) for files in listing.splits.values()) == 6


def test_a_manifest_saved_with_carriage_returns_alone_labels_its_files(tmp_path):
    """Excel for Mac's "CSV (Macintosh)" ends lines with a lone \\r: csv read the whole file as one line and refused
    it as "line 0 is not valid CSV". The audio datamodule now trains on its labels."""
    ds = class_folders(tmp_path / "ds")
    lines = ["file_name,label"] + [
        f"{c}/{i}.wav,{'feline' if c == 'cat' else 'canine'}" for c in ("cat", "dog") for i in range(3)
    ]
    (ds / "metadata.csv").write_bytes("\r".join(lines).encode() + b"\r")
    dm = audio_data(tmp_path, ds, "data.label_from=manifest", "data.val_split=0.34")
    assert dm.classes == ["canine", "feline"]
    names = {name for split in dm.splits.values() for name in split.names}
    assert names == {f"{c}/{i}.wav" for c in ("cat", "dog") for i in range(3)}


def test_label_from_manifest_without_a_manifest_says_there_is_none(tmp_path):
    """data.label_from=manifest on a folder that holds no metadata.csv was told "the manifest names none of the
    files beside it; check its file_name column", about a manifest that does not exist."""
    ds = class_folders(tmp_path / "ds")
    with pytest.raises(UserError) as raised:
        list_labelled(ds, WAV, label_from="manifest", kind="audio")
    assert "holds no metadata.csv or metadata.jsonl" in str(raised.value)
    assert "data.label_from" in str(raised.value)


def test_predictions_of_files_whose_names_are_not_utf8_are_written_and_read_back(tmp_path):
    """A folder copied from an old Latin-1 system holds names Python reads as lone surrogates ("caf\\udce9.wav"):
    write_jsonl raised UnicodeEncodeError after a whole run's inference, and no prediction was written."""
    ds = tmp_path / "ds"
    ds.mkdir()
    raw = b"caf\xe9.wav"
    try:
        (ds / os.fsdecode(raw)).write_bytes(wav_bytes(440))
    except (OSError, UnicodeEncodeError):
        pytest.skip("this file system takes UTF-8 names only")
    (name,) = [rel for rel, _ in walk_files(ds)]
    out = tmp_path / "run" / "predictions.jsonl"
    write_jsonl([{"name": name, "predicted": "café"}], out)
    text = out.read_bytes().decode("utf-8")  # valid UTF-8 JSON lines
    row = json.loads(text)
    assert os.fsencode(row["name"]) == raw
    assert row["predicted"] == "café"
    assert (ds / row["name"]).is_file()
