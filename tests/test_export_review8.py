"""Export review 8: `enrich` sets the shard limits its planner's messages ask for, `validate` answers a document
naming tensors the graph lacks with its usual result, and a NaN `export.atol` is refused before training."""

from __future__ import annotations

import math

import pytest
from hostile_corpus import rewrite_document, tiny_onnx

from onn.config.export import ExportSample, OmnyExport
from onn.errors import UserError
from onn.export import check_settings, omny
from onn.export.omny import cli as omny_cli

KB = 1024


def test_enrich_takes_the_shard_limits_its_messages_name(tmp_path, capsys):
    """A graph with a block over the default 1200 MB (a large model's embedding) could not be enriched at all: the
    planner's sentence said to raise export.max_shard_size_mb, which the command line had no way to set. Its
    options set the three limits, and its messages name those options."""
    src = tiny_onnx(tmp_path / "tiny.onnx")  # four blocks of a [16, 16] float32 weight: 1 KB each
    out = tmp_path / "tiny.omny"
    too_small = 0.5 * KB / 2**20
    assert omny_cli.main(["enrich", str(src), str(out), "--max-shard-size-mb", str(too_small)]) == 2
    said = capsys.readouterr().err
    assert "--max-shard-size-mb" in said and "export.max_shard_size_mb" not in said and not out.exists()

    limit = 2.5 * KB / 2**20  # two blocks' weights per shard, not three
    args = ["--max-shard-size-mb", str(limit), "--min-vram-mb", "1", "--headroom-mb", "0.25"]
    assert omny_cli.main(["enrich", str(src), str(out), *args]) == 0
    plans = omny.read_document(out)["shard_plans"]
    assert (plans["max_shard_size_mb"], plans["min_vram_mb"], plans["headroom_mb"]) == (limit, 1.0, 0.25)
    assert plans["allowed_counts"][0] == 2 and plans["configurations"][0]["ranges"] == [[0, 2], [2, 4]]
    capsys.readouterr()
    assert omny_cli.main(["validate", str(out)]) == 0  # every plan's shards run in onnxruntime as the whole does

    assert omny_cli.main(["enrich", str(src), str(out), "--min-vram-mb", "1", "--headroom-mb", "2"]) == 2
    said = capsys.readouterr().err
    assert "--headroom-mb (2) leaves no memory under --min-vram-mb (1)" in said


def test_validate_of_a_document_naming_a_missing_tensor_returns_its_result(tmp_path):
    """validate returns a Validation (ok, max_abs_diff), as bench=omny reads it; for a document naming a tensor the
    graph does not have it returned a bare False, and `.max_abs_diff` raised AttributeError."""
    src = tiny_onnx(tmp_path / "tiny.onnx")
    out = omny.enrich_onnx(src, tmp_path / "tiny.omny")
    assert omny.validate(out, echo=lambda *_: None).ok

    def rename(doc: dict) -> None:  # the cut point and the block it ends both name it, as the reader requires
        doc["cut_points"][0]["name"] = doc["blocks"][0]["cut_after"] = "no_such_tensor"

    rewrite_document(out, rename)
    lines: list[str] = []
    result = omny.validate(out, echo=lines.append)
    assert not result and not result.ok and math.isnan(result.max_abs_diff)  # no shard ran: nothing measured
    assert "no_such_tensor" in lines[0] and lines[-1].endswith("INVALID")


def omny_settings(**changes: object) -> OmnyExport:
    """conf/export/omny.yaml's values, with `changes`."""
    values = dict(name="omny", output=None, opset=18, atol=1e-4, sample=ExportSample(2, 16, None), nodes=None)
    values |= dict(max_shard_size_mb=None, min_vram_mb=None, headroom_mb=None, shard_counts=None, max_configs=8)
    return OmnyExport(**{**values, "reference_sequence_length": 128, **changes})


@pytest.mark.parametrize("key", ["atol", "max_shard_size_mb"])
def test_a_nan_limit_is_refused_before_training(key):
    """NaN passes `value < 0`: export.atol=nan (Hydra reads `nan` as the float) was taken, and after training every
    export was refused, each output said to differ from PyTorch "by 0 (more than atol=nan)"."""
    with pytest.raises(UserError, match=rf"export.{key}=nan: give a number"):
        check_settings(omny_settings(**{key: math.nan}))
    check_settings(omny_settings(**{key: 0.5}))
