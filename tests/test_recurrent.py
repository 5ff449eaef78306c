"""Recurrent networks: the LSTM/GRU stack over packed variable-length sequences gives what its ONNX graph (the
padded form) gives, its layers are LayerMap blocks, and the audio LSTM trains, evaluates, infers and exports
through the shared classifier path (tones by two 'speakers', the second held out)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import compose
from test_audio import make_tones

from onn.errors import UserError
from onn.models.zoo.recurrent import AudioRNN


def spectrograms(lengths: list[int], mels: int = 8, frames: int = 30) -> torch.Tensor:
    """dB log-mels [B, 1, mels, frames], each clip's sound `length` frames long in the middle, silence around it."""
    torch.manual_seed(0)
    x = torch.randn(len(lengths), 1, mels, frames) * 10 - 30
    floor = torch.full_like(x, -100.0)
    for i, length in enumerate(lengths):
        start = (frames - length) // 2
        floor[i, :, :, start : start + length] = x[i, :, :, start : start + length]
    return floor


@pytest.mark.parametrize("cell, bidirectional, batch_norm", [("lstm", True, False), ("gru", False, True)])
def test_packed_sequences_match_the_onnx_graph(tmp_path, cell, bidirectional, batch_norm):
    """Each clip's sound is found and packed at its own length; onnxruntime runs the padded form of the same
    recurrences and gives the same classes' logits."""
    from onn.export.onnx_export import export_onnx

    model = AudioRNN(1, 3, [8, 30], hidden=6, layers=2, cell=cell, bidirectional=bidirectional, batch_norm=batch_norm)
    model.eval()
    x = spectrograms([30, 11, 4, 19])
    assert model.span(x)[1].tolist() == [30, 11, 4, 19]
    result = export_onnx(model, tmp_path / "rnn.onnx", {"input": x})
    assert result["export/max_abs_diff"] < 1e-5
    # padding a clip with more silence changes nothing: the recurrences never see it
    longer = torch.full((4, 1, 8, 40), -100.0)
    longer[:, :, :, 5:35] = x
    with torch.no_grad():
        assert torch.allclose(model(x), model(longer), atol=1e-5)


def test_layer_map_finds_the_recurrent_stack():
    from onn.models.layers import discover

    lmap = discover(AudioRNN(1, 10, [24, 101], hidden=8, layers=6))
    assert lmap.blocks_path == "layers" and len(lmap) == 6
    assert [n for n, _ in lmap.prefix] == ["span", "project"] and [n for n, _ in lmap.suffix] == ["classifier"]


def test_clip_normalisation_is_refused_with_one_sentence():
    from onn.modalities import get

    with pytest.raises(UserError, match="data.features.normalize=none"):
        get("audio").check(compose("data=audio", "model=audio_lstm"))
    get("audio").check(compose("recipe=fsdd_lstm"))


@pytest.mark.slow
def test_audio_lstm_trains_evaluates_infers_and_exports(tmp_path):
    """recipe=fsdd_lstm on tones by two speakers, bob's held out: the loss falls, bob is recognised above chance,
    eval of the best checkpoint gives the same test accuracy, infer writes predictions and a picture, ONNX agrees."""
    from onn.app import execute

    data = make_tones(tmp_path / "tones", per_class=8)
    common = [
        "tracking=none",
        f"paths.outputs={tmp_path / 'outputs'}",
        f"paths.cache={tmp_path / 'cache'}",
    ]
    cfg = compose(
        "recipe=fsdd_lstm",
        *common,
        f"data.source={data}",
        "data.label_from='^([a-z]+)_'",
        "data.classes=null",
        "data.test_pattern=_bob_",
        "data.clip_seconds=0.4",
        "data.batch_size=8",
        "data.val_split=0.2",
        "data.features.top_db=50",  # tones over a noise floor
        "data.augment.truncate=0",
        "data.augment.noise_snr_db=0",
        "data.augment.speed=0",
        "model.kwargs.hidden=12",
        "trainer.max_epochs=5",
        "optim.schedule=constant",
        "optim.lr=0.02",
        "export=onnx",
    )
    metrics = execute(cfg, tmp_path / "train")
    assert metrics["train/loss_final"] < metrics["train/loss_initial"]
    assert metrics["test/acc"] > 0.5  # three tones, chance 1/3
    assert metrics["export/max_abs_diff"] < 1e-4
    ckpt = str(tmp_path / "train" / "checkpoints" / "best.ckpt")
    evaluated = execute(compose(*common, "task=eval", f"ckpt={ckpt}"), tmp_path / "eval")
    assert evaluated["test/acc"] == pytest.approx(metrics["test/acc"], abs=1e-6)
    new = tmp_path / "new"
    new.mkdir()
    (new / "high_bob_2.wav").write_bytes((data / "high_bob_2.wav").read_bytes())
    out = execute(compose(*common, "task=infer", f"ckpt={ckpt}", f"task.input={new}"), tmp_path / "infer")
    rows = [json.loads(line) for line in Path(out["infer/output"]).read_text().splitlines()]
    assert [r["true"] for r in rows] == ["high"] and Path(out["infer/picture"]).is_file()
