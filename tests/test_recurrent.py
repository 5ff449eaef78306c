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

from onn.config.data import AudioAugment
from onn.errors import UserError
from onn.models.zoo.recurrent import AudioRNN

SLOW = pytest.mark.slow


def spectrograms(lengths: list[int], mels: int = 8, frames: int = 30) -> torch.Tensor:
    """dB log-mels [B, 1, mels, frames], each clip's sound `length` frames long in the middle, silence around it."""
    torch.manual_seed(0)
    x = torch.randn(len(lengths), 1, mels, frames) * 10 - 30
    floor = torch.full_like(x, -100.0)
    for i, length in enumerate(lengths):
        start = (frames - length) // 2
        floor[i, :, :, start : start + length] = x[i, :, :, start : start + length]
    return floor


@pytest.mark.parametrize(
    "kwargs",
    [
        {"cell": "lstm", "reference": "band"},
        {"cell": "gru", "bidirectional": False, "batch_norm": True, "reference": "band"},
        {"cell": "lstm", "conv_widths": (4, 6), "time_pool": True, "convs_per_stage": 2, "reference": "instance"},
        # the slow tier: about 20 s each on 2 cores (the exporter unrolls every step); the three above cover
        # both cells, batch norm, the conv front-end and reference=instance
        pytest.param({"cell": "gru", "conv_widths": (4,), "time_pool": False, "reference": "band"}, marks=SLOW),
        pytest.param(
            {"conv_widths": (4, 6), "time_pool": True, "frequency_mean": True, "reference": "band"}, marks=SLOW
        ),
        pytest.param(
            {
                "conv_widths": (4, 6),
                "time_pool": True,
                "frequency_mean": True,
                "whole_clip": True,
                "reference": "instance",
            },
            marks=SLOW,
        ),
    ],
)
def test_packed_sequences_match_the_onnx_graph(tmp_path, kwargs):
    """Each clip's sound is found and packed at its own length; onnxruntime runs the padded form of the same
    recurrences (after the conv front-end, when there is one) and gives the same classes' logits."""
    from onn.export.onnx_export import export_onnx

    torch.manual_seed(0)
    model = AudioRNN(1, 3, [8, 8], hidden=6, layers=2, **kwargs)  # 8 frames: the exporter unrolls each step
    for module in model.modules():  # running statistics away from 0/1: padded frames' zeros would show if they leaked
        if isinstance(module, torch.nn.BatchNorm1d | torch.nn.BatchNorm2d):
            module.running_mean.uniform_(-1, 1)
            module.running_var.uniform_(0.5, 2)
    model.eval()
    x = spectrograms([8, 5, 4, 7], frames=8)  # the shortest still a frame after two stages' time pooling
    whole_clip = kwargs.get("whole_clip", False)
    assert model.span(x)[1].tolist() == ([8] * 4 if whole_clip else [8, 5, 4, 7])
    result = export_onnx(model, tmp_path / "rnn.onnx", {"input": x})
    assert result["export/max_abs_diff"] < 1e-5
    if whole_clip:  # the silence is part of every sequence: where the sound sits is seen, as the audio CNN sees it
        return
    # padding a clip with more silence changes nothing: the recurrences (and the front-end) never see it. With
    # reference=instance the clip's statistics include its silence; the store pads every clip to one length.
    longer = torch.full((4, 1, 8, 12), -100.0)
    longer[:, :, :, 2:10] = x
    with torch.no_grad():
        if kwargs["reference"] == "band":
            assert torch.allclose(model(x), model(longer), atol=1e-5)
        else:  # the same sounds elsewhere in a clip of the same length: the same classes' logits
            moved = torch.roll(longer, 2, dims=-1)
            assert torch.allclose(model(longer), model(moved), atol=1e-5)


def test_layer_map_finds_the_recurrent_stack():
    from onn.models.layers import discover

    lmap = discover(AudioRNN(1, 10, [24, 101], hidden=8, layers=6))
    assert lmap.blocks_path == "layers" and len(lmap) == 6
    assert [n for n, _ in lmap.prefix] == ["span", "project"] and [n for n, _ in lmap.suffix] == ["classifier"]
    # a conv front-end is part of the prefix: its stages are one flat Sequential, never a run of blocks
    lmap = discover(AudioRNN(1, 10, [24, 51], hidden=8, layers=3, conv_widths=(64, 64, 64)))
    assert lmap.blocks_path == "layers" and len(lmap) == 3
    assert [n for n, _ in lmap.prefix] == ["span", "conv", "project"]


@pytest.mark.parametrize("bidirectional", [True, False])
def test_a_one_layer_stack_is_one_block_not_its_two_directions(bidirectional):
    """A one-layer stack's LayerMap is that layer: its forward and backward LSTMs read the same input side by side
    and each returns a tuple, so they were never two blocks run one after the other (streaming crashed on them)."""
    from onn.models.layers import discover

    lmap = discover(AudioRNN(1, 10, [24, 51], hidden=8, layers=1, bidirectional=bidirectional, conv_widths=(8,)))
    assert lmap.describe() == "prefix [span, conv, project] -> 1 x RecurrentLayer at 'layers' -> suffix [classifier]"


@pytest.mark.parametrize("kwargs", [{"layers": 0}, {"layers": -1}, {"layers": True}, {"hidden": 0}])
def test_a_stack_without_layers_or_width_is_one_sentence(kwargs):
    """layers=0 or -1 built the front-end and the head with no recurrence between them, and trained it."""
    from onn.models.zoo.registry import build_zoo

    ((key, value),) = kwargs.items()
    said = rf"^model\.kwargs does not build zoo:audio_rnn: {key}={value}: give a whole number, 1 or more\.$"
    with pytest.raises(UserError, match=said):
        build_zoo("audio_rnn", in_channels=1, num_classes=3, image_size=[16, 20], **kwargs)


def test_a_stack_reads_its_sequences_lengths_back_once_whatever_its_depth():
    """Packing needs the lengths on the host, and the network finds them on the device (where each clip's sound
    is): one read per forward, on a GPU one wait for it, not one per layer, nor one per recurrence to unsort
    its outputs (pad_packed_sequence reads the inverse order back when packing sorted the batch)."""
    from conftest import HostReads

    x = spectrograms([30, 12, 20])
    for layers in (1, 4):
        network = AudioRNN(1, 3, [8, 30], hidden=8, layers=layers)
        with HostReads() as reads:
            network(x).sum().backward()
        assert reads.seen == ["cpu"], f"{layers} layers: {reads.seen}"


def test_clip_normalisation_is_refused_with_one_sentence():
    from onn.modalities import get

    with pytest.raises(UserError, match="data.features.normalize=none"):
        get("audio").check(compose("data=audio", "model=audio_lstm"))
    get("audio").check(compose("recipe=fsdd_lstm"))


@pytest.mark.modalities
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
        "model.kwargs.conv_widths=[8,16]",  # the recipe's two convs a stage, fewer stages and filters for 24 clips
        "model.kwargs.frequency_mean=false",  # a tone is its band: two small stages averaged over bands lose it
        "model.kwargs.dropout=0.1",
        "trainer.max_epochs=5",
        "optim.schedule=constant",
        "optim.lr=0.005",
        "export=onnx",
    )
    metrics = execute(cfg, tmp_path / "train")
    assert metrics["train/loss_final"] < metrics["train/loss_initial"]
    assert metrics["test/acc"] > 0.5  # three tones, chance 1/3
    assert metrics["export/max_abs_diff"] < 1e-4
    assert "export/frozen_weights" not in metrics  # a float32 store: the export holds the weights that trained
    ckpt = str(tmp_path / "train" / "checkpoints" / "best.ckpt")
    evaluated = execute(compose(*common, "task=eval", f"ckpt={ckpt}"), tmp_path / "eval")
    assert evaluated["test/acc"] == pytest.approx(metrics["test/acc"], abs=1e-6)
    new = tmp_path / "new"
    new.mkdir()
    (new / "high_bob_2.wav").write_bytes((data / "high_bob_2.wav").read_bytes())
    out = execute(compose(*common, "task=infer", f"ckpt={ckpt}", f"task.input={new}"), tmp_path / "infer")
    rows = [json.loads(line) for line in Path(out["infer/output"]).read_text().splitlines()]
    assert [r["true"] for r in rows] == ["high"] and Path(out["infer/picture"]).is_file()


def test_masks_in_decibels_leave_the_silence_silent():
    """With dB features (normalize=none) SpecAugment's masks are silence: a training batch's sound spans the same
    frames as in evaluation (a band masked at the clip's mean would make the silence around a word read as sound)."""
    from test_audio import tone

    from onn.modalities.audio.features import LogMel, feature_settings

    settings = feature_settings(compose("recipe=fsdd_lstm").data)
    transform = LogMel(settings, AudioAugment(gain_db=0, shift_seconds=0, freq_mask=8, time_mask=0, masks=1))
    waves = torch.zeros(4, 1, 8000, dtype=torch.float16)
    for i, freq in enumerate((300, 700, 1500, 2500)):
        waves[i, :, 3000:5400] = torch.from_numpy(tone(freq, 0.3).T)
    span = AudioRNN(1, 10, [24, 51], hidden=4).span
    evaluated_db = transform(waves, train=False)
    evaluated = span(evaluated_db)[1]
    torch.manual_seed(0)
    trained = transform(waves, train=True)
    floor = evaluated_db.amin(dim=(1, 2, 3), keepdim=True)
    assert ((trained != evaluated_db) & (trained == floor)).any()  # bands of the sound were masked to silence
    assert torch.equal(span(trained)[1], evaluated) and (evaluated < 51).all()


def test_sparse_lora_streams_a_recurrent_classifier_and_refuses_what_it_cannot_stream(tmp_path):
    """strategy=sparse_lora plans an LSTM stack's blocks streamed, sized with what trains (the blocks' biases and
    the head); a block with dropout, or a classifier whose blocks are not a recurrent stack, is one sentence."""
    from onn.hardware.profile import resolve
    from onn.modalities import get

    cfg = compose("recipe=fsdd_lstm", "hardware=cpu_16gb", "strategy=sparse_lora", root=tmp_path)
    hw = resolve(cfg.hardware, tmp_path / "cache", tmp_path)
    with pytest.raises(UserError, match="blocks hold dropout.*model.kwargs.dropout=0"):
        get("audio").plan(cfg, hw)
    streamed = ("strategy=sparse_lora", "strategy.layers=all", "model.kwargs.dropout=0")
    plan, spec = get("audio").plan(compose("recipe=fsdd_lstm", "hardware=cpu_16gb", *streamed), hw)
    assert plan.strategy == "sparse_lora" and plan.streaming.chunk_size >= 1
    assert 0 < sum(spec.lora_params_per_block) < sum(spec.block_params) / 50  # biases only
    # a one-layer stack is one block to stream (it was refused as having none)
    plan, spec = get("audio").plan(
        compose("recipe=fsdd_lstm", "hardware=cpu_16gb", *streamed, "model.kwargs.layers=1"), hw
    )
    assert spec.n_blocks == 1 and plan.strategy == "sparse_lora" and plan.streaming.chunk_size == 1
    cnn = compose("data=audio", "model=audio_cnn", "hardware=cpu_16gb", "strategy=sparse_lora")
    with pytest.raises(UserError, match="model=audio_cnn's blocks are not: use strategy=full"):
        get("audio").plan(cnn, hw)


@pytest.mark.slow
def test_an_lstm_stack_streams_through_the_runner_and_its_checkpoint_evaluates_resident(tmp_path):
    """strategy=sparse_lora on model=audio_lstm: the LSTM weights stream from a disk store a block at a time while
    the biases and head train, and the model learns; eval of the checkpoint (the frozen weights built again from the
    seed, resident) gives the streamed test's accuracy, and the ONNX export agrees."""
    from onn.app import execute

    data = make_tones(tmp_path / "tones", per_class=8)
    common = ["tracking=none", f"paths.outputs={tmp_path / 'outputs'}", f"paths.cache={tmp_path / 'cache'}"]
    cfg = compose(
        "recipe=fsdd_lstm",
        *common,
        *(f"data.source={data}", "data.label_from='^([a-z]+)_'", "data.classes=null", "data.test_pattern=_bob_"),
        *("data.clip_seconds=0.4", "data.batch_size=8", "data.val_split=0.2", "data.features.top_db=50"),
        *("data.augment.truncate=0", "data.augment.noise_snr_db=0", "data.augment.speed=0"),
        *("data.augment.gain_db=0", "data.augment.shift_seconds=0", "data.augment.freq_mask=0"),
        *("data.augment.time_mask=0", "task.label_smoothing=0"),  # only biases and the head train: a clear signal
        *(
            "model.kwargs.hidden=12",
            "model.kwargs.layers=3",
            "model.kwargs.conv_widths=[8,16]",
            "model.kwargs.frequency_mean=false",  # a tone is its band
            "model.kwargs.dropout=0",
        ),
        *("strategy=sparse_lora", "strategy.layers=all", "strategy.streaming.store=disk"),
        *("strategy.streaming.chunk_size=1", "trainer.max_epochs=12", "optim.schedule=constant", "optim.lr=0.3"),
        "export=onnx",
    )
    metrics = execute(cfg, tmp_path / "train")
    assert metrics["strategy"] == "sparse_lora" and any((tmp_path / "train" / "layer_store").rglob("*.safetensors"))
    assert metrics["params_trainable"] < metrics["params_total"] / 5
    # it learned: the test clips (another speaker's) are told apart, where chance is one in three. Held-out loss
    # rises while the front-end's BatchNorm statistics settle (once a step, as resident training moves them), then
    # falls
    assert metrics["test/acc"] >= 0.8, metrics["test/acc"]
    assert metrics["train/loss_final"] < metrics["train/loss_initial"]
    assert metrics["export/max_abs_diff"] < 1e-4
    assert "export/frozen_weights" not in metrics  # a float32 store: the export holds the weights that trained
    ckpt = str(tmp_path / "train" / "checkpoints" / "best.ckpt")
    evaluated = execute(compose(*common, "task=eval", "task.adapt_norm=true", f"ckpt={ckpt}"), tmp_path / "eval")
    assert evaluated["test/acc"] == pytest.approx(metrics["test/acc"], abs=1e-6)  # AdaBN streamed and resident


@SLOW
def test_a_network_streamed_from_an_int8_store_says_its_export_is_rebuilt_at_float32(tmp_path, caplog):
    """Training and its figures used the int8 store's weights; the export is built again from the seed at float32,
    so the run says so in one warning and in metrics.json (export/frozen_weights), and still exports."""
    from onn.app import execute

    data = make_tones(tmp_path / "tones", per_class=4)
    cfg = compose(
        "recipe=fsdd_lstm",
        *("tracking=none", f"paths.outputs={tmp_path / 'outputs'}", f"paths.cache={tmp_path / 'cache'}"),
        *(f"data.source={data}", "data.label_from='^([a-z]+)_'", "data.classes=null", "data.test_pattern=_bob_"),
        *("data.clip_seconds=0.4", "data.batch_size=8", "data.val_split=0.2", "data.features.top_db=50"),
        *(
            "model.kwargs.hidden=12",
            "model.kwargs.layers=2",
            "model.kwargs.conv_widths=[8,16]",
            "model.kwargs.dropout=0",
        ),
        *("strategy=sparse_lora", "strategy.layers=all", "strategy.streaming.store=cpu"),
        *("strategy.streaming.store_dtype=int8", "strategy.streaming.chunk_size=1", "trainer.max_epochs=1"),
        "export=onnx",
    )
    metrics = execute(cfg, tmp_path / "train")
    assert metrics["export/frozen_weights"] == "float32"
    assert any("rebuilt at float32" in r.getMessage() and "int8" in r.getMessage() for r in caplog.records)
    assert list((tmp_path / "train").rglob("*.onnx"))
