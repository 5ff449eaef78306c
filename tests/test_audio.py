"""The audio track on generated tones: every format decoded to one rate, length and channel count, labels
from folders, names and manifests, bad files skipped and named, log-mel features and their augmentation,
and a whole run (train with a held-out name pattern, eval, infer with a picture, ONNX export); FSDD's real
recordings split by speaker when the shared data is there."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SHARED_DATA, compose

from onn.config.data import AudioAugment
from onn.errors import UserError
from onn.hardware.profile import resolve

FSDD = SHARED_DATA / "fsdd" / "recordings"
TONES = {"low": 300.0, "mid": 700.0, "high": 1500.0}


def tone(freq: float, seconds: float = 0.3, rate: int = 8000, channels: int = 1, seed: int = 0) -> np.ndarray:
    """A sine with a little noise, [samples, channels] float32 (soundfile's layout)."""
    rng = np.random.default_rng(seed)
    t = np.arange(round(seconds * rate)) / rate
    wave = 0.4 * np.sin(2 * np.pi * freq * t + rng.uniform(0, 6)) + 0.02 * rng.standard_normal(len(t))
    return np.repeat(wave[:, None], channels, axis=1).astype(np.float32)


def make_tones(root: Path, per_class: int = 8, speakers: tuple[str, ...] = ("ann", "bob")) -> Path:
    """FSDD-like names, {class}_{speaker}_{i}.wav in one folder; each speaker a little off-pitch."""
    import soundfile as sf

    root.mkdir(parents=True, exist_ok=True)
    for s, speaker in enumerate(speakers):
        for name, freq in TONES.items():
            for i in range(per_class):
                seconds = 0.2 + 0.05 * (i % 3)
                sf.write(
                    root / f"{name}_{speaker}_{i}.wav",
                    tone(freq * (1 + 0.03 * s), seconds, seed=i + 100 * s),
                    8000,
                )
    return root


def peak_hz(x: torch.Tensor, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(x[0].numpy()))
    return float(spectrum.argmax() * rate / x.shape[-1])


def test_every_format_decodes_to_one_rate_length_and_channel_count(tmp_path):
    """WAV/FLAC/OGG/MP3/AIFF/Opus through soundfile, M4A (AAC) through PyAV; stereo 44.1 kHz -> mono 16 kHz."""
    import av
    import soundfile as sf

    from onn.modalities.audio.decode import Fit, load

    stereo = np.concatenate([tone(440, 0.3, 44100), 0.5 * tone(440, 0.3, 44100)], axis=1)
    files = {}
    for ext, kwargs in (("wav", {}), ("flac", {}), ("ogg", {"subtype": "VORBIS"}), ("mp3", {}), ("aiff", {})):
        files[ext] = tmp_path / f"a.{ext}"
        sf.write(files[ext], stereo, 44100, **kwargs)
    files["opus"] = tmp_path / "a.opus"
    sf.write(
        files["opus"],
        np.concatenate([tone(440, 0.3, 48000)] * 2, axis=1),
        48000,
        format="OGG",
        subtype="OPUS",
    )
    files["m4a"] = tmp_path / "a.m4a"
    with av.open(str(files["m4a"]), "w") as container:
        stream = container.add_stream("aac", rate=44100, layout="stereo")
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(stereo.T), format="fltp", layout="stereo")
        frame.sample_rate, frame.pts = 44100, 0
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            container.mux(packet)
    fit = Fit(sample_rate=16000, channels=1, samples=8000)
    for ext, path in files.items():
        x, seconds = load(str(path), fit)
        assert x.shape == (1, 8000) and x.dtype == torch.float32, ext
        assert seconds == pytest.approx(0.3, abs=0.03), ext
        assert peak_hz(x, 16000) == pytest.approx(440, abs=6), ext  # resampled, not re-pitched
    kept, _ = load(str(files["flac"]), Fit(8000, 2, 4000))  # keep two channels: the second is half as loud
    assert kept.shape == (2, 4000) and float(kept[1].abs().max()) == pytest.approx(
        float(kept[0].abs().max()) / 2, rel=0.05
    )
    short, _ = load(files["wav"].open("rb"), Fit(16000, 1, 16000))  # 0.3 s padded to 1 s, centred
    assert short[0, :3000].abs().max() == 0 and short[0, -3000:].abs().max() == 0 and short[0, 8000].abs() > 0


def test_labels_from_folders_names_and_manifests(tmp_path):
    import soundfile as sf

    from onn.data.labelled import list_labelled
    from onn.modalities.audio.modality import SUFFIXES

    folders = tmp_path / "folders"
    for split in ("train", "test"):
        for label in ("dog", "cat"):
            (folders / split / label).mkdir(parents=True)
            sf.write(folders / split / label / "1.wav", tone(300), 8000)
    listing = list_labelled(folders, SUFFIXES)
    assert listing.classes == ["cat", "dog"] and set(listing.splits) == {"train", "test"}
    assert [f.label for f in listing.splits["train"]] == ["cat", "dog"]

    names = make_tones(tmp_path / "names", per_class=1)
    listing = list_labelled(names, SUFFIXES, label_from=r"^([a-z]+)_")
    assert listing.classes == ["high", "low", "mid"] and len(listing.splits["all"]) == 6

    manifest = tmp_path / "manifest"
    manifest.mkdir()
    rows = []
    for i, label in enumerate(["10", "2", "2"]):
        sf.write(manifest / f"clip{i}.flac", tone(300), 8000)
        rows.append({"file_name": f"clip{i}.flac", "label": label})
    (manifest / "metadata.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (manifest / "README.md").write_text("sidecars are not data")
    listing = list_labelled(manifest, SUFFIXES)
    assert listing.classes == ["2", "10"]  # whole numbers in numeric order
    assert {f.name: f.label for f in listing.splits["all"]} == {
        "clip0.flac": "10",
        "clip1.flac": "2",
        "clip2.flac": "2",
    }
    assert listing.unknown == []
    (manifest / "metadata.jsonl").write_text(json.dumps({"file_name": "clip0.flac", "speaker": "x"}))
    with pytest.raises(UserError, match="no 'label' column"):
        list_labelled(manifest, SUFFIXES)


def test_bad_audio_files_are_skipped_counted_and_named(tmp_path, caplog):
    """Corrupt, truncated, zero-length and sound-less files, one at a time; an unknown extension is named."""
    from onn.modalities.audio.dataset import READER
    from onn.modalities.audio.decode import BadFile, Fit, load
    from onn.modalities.video.builtin import write_clip

    data = make_tones(tmp_path / "tones", per_class=10, speakers=("ann",))
    good = (data / "low_ann_0.wav").read_bytes()
    bad = {
        "low_ann_90.wav": b"RIFF" + bytes(range(256)) * 4,
        "mid_ann_91.wav": good[:44],
        "high_ann_92.flac": b"",
    }
    for name, content in bad.items():
        (data / name).write_bytes(content)
    write_clip(data / "mid_ann_93.m4a", np.zeros((4, 64, 64, 3), np.uint8), 4)  # a video without sound
    (data / "low_ann_94.xyz").write_bytes(good)
    fit = Fit(8000, 1, 4000)
    expected = {
        "low_ann_90.wav": "not decodable audio",
        "mid_ann_91.wav": "no audio samples",
        "high_ann_92.flac": "empty file",
        "mid_ann_93.m4a": "no audio stream",
    }
    for name, why in expected.items():
        with pytest.raises(BadFile, match=why):
            load(str(data / name), fit)
    cfg = compose("data=audio", "data.label_from='^([a-z]+)_'").data
    with pytest.raises(
        UserError, match=r"4 of 34 audio files could not be decoded \(first: high_ann_92.flac: an empty file"
    ):
        READER.read(str(data), cfg, fit)
    with caplog.at_level(logging.WARNING, logger="onn"):
        decoded, seconds = READER.read(str(data), dataclasses.replace(cfg, max_bad_fraction=0.2), fit)
    assert len(decoded["all"].labels) == 30 and len(decoded["all"].skipped) == 4
    assert (
        "mid_ann_93.m4a: no audio stream" in caplog.text and "low_ann_94.xyz" in caplog.text
    )  # named, not silently ignored


def test_a_float_file_louder_than_float16_holds_is_scaled_not_infinite(tmp_path):
    """32-bit float WAVs peaking at 70000 and at 1e30 became infinities in the float16 store: the training's loss
    was NaN with "train ok", and infer wrote "probability": NaN. They are scaled to a peak of 1, their sound kept;
    a stored value that is not finite after the cast is a skipped file, not a NaN loss."""
    import soundfile as sf

    from onn.data.media import stored
    from onn.modalities.audio.dataset import READER
    from onn.modalities.audio.decode import BadFile, Fit

    data = make_tones(tmp_path / "tones", per_class=2, speakers=("ann",))
    wave = tone(700.0)
    for name, peak in (("mid_ann_7.wav", 7e4), ("mid_ann_8.wav", 1e30)):
        sf.write(data / name, wave * (peak / np.abs(wave).max()), 8000, subtype="FLOAT")
    cfg = compose("data=audio", "data.label_from='^([a-z]+)_'").data
    (split,) = READER.read(str(data), cfg, Fit(8000, 1, 2400))[0].values()
    assert torch.isfinite(split.inputs).all() and not split.skipped and len(split.names) == 8
    for name in ("mid_ann_7.wav", "mid_ann_8.wav"):
        loud = split.inputs[split.names.index(name)].float()
        assert loud.abs().max() == pytest.approx(1.0, abs=0.05) and peak_hz(loud, 8000) == pytest.approx(700, abs=30)
    with pytest.raises(BadFile, match="values beyond what float16 holds"):
        stored(torch.tensor([7e4]), torch.float16, BadFile)


def test_settings_that_make_no_sense_name_their_key():
    from onn.modalities import get

    audio = get("audio")
    for override, key in (
        ("data.sample_rate=0", "data.sample_rate"),
        ("data.clip_seconds=-1", "data.clip_seconds"),
        ("data.features.n_fft=0", "data.features.n_fft"),
        ("data.features.f_max=99999", "f_max"),
        ("data.augment.freq_warp=2", "data.augment.freq_warp"),
        ("model=video_r3d_18", "does not take spectrograms"),
        ("model=pointnet", "does not take spectrograms"),  # was: model.kwargs does not fit (none were given)
        ("data.features.top_db=0", "data.features.top_db"),  # every bin at the clip's peak: a constant picture
        ("data.features.top_db=-5", "data.features.top_db"),
    ):
        with pytest.raises(UserError, match=key):
            audio.check(compose("data=audio", "model=audio_cnn", override))
    with pytest.raises(Exception, match="data.augment.pitch"):  # no such key: Hydra refuses it when composing
        compose("data=audio", "model=audio_cnn", "data.augment.pitch=1")


def test_log_mels_on_the_device_augment_training_batches_only():
    from onn.modalities.audio.features import LogMel, feature_settings

    cfg = compose("data=fsdd").data
    settings = feature_settings(cfg)
    augment = AudioAugment(
        gain_db=6, shift_seconds=0.1, freq_warp=0.1, time_warp=0.1, freq_mask=4, time_mask=10, masks=2
    )
    transform = LogMel(settings, augment)
    waves = torch.from_numpy(np.stack([tone(f, 1.0).T for f in (300, 700, 1500, 2500)])).to(torch.float16)
    waves[3] *= 0.01  # a quiet one: its floor is its own, not the batch's loudest
    evaluated = transform(waves, train=False)
    assert evaluated.shape == (4, 1, 24, 101) and evaluated.dtype == torch.float32
    assert torch.equal(evaluated, transform(waves, train=False))  # evaluation is deterministic
    alone = transform(waves[3:], train=False)
    assert torch.allclose(alone, evaluated[3:], atol=1e-4)  # per-sample, whatever the batch holds
    torch.manual_seed(0)
    trained = transform(waves, train=True)
    assert trained.shape == evaluated.shape and not torch.allclose(trained, evaluated)
    top = evaluated[:, 0].mean(dim=-1).argmax(dim=-1)  # the tone's mel band rises with its frequency
    assert top[0] < top[1] < top[2]


@pytest.mark.modalities
@pytest.mark.slow
def test_train_held_out_pattern_eval_infer_and_export(tmp_path):
    """Tones by two 'speakers': bob's are the test set (data.test_pattern); then eval, infer with a picture, ONNX."""
    from onn.app import execute, given_keys

    data = make_tones(tmp_path / "tones", per_class=10)
    common = [
        "tracking=none",
        "trainer.enable_progress_bar=false",
        f"paths.outputs={tmp_path / 'outputs'}",
        f"paths.cache={tmp_path / 'cache'}",
    ]
    cfg = compose(
        "recipe=fsdd_audio_cnn",
        *common,
        f"data.source={data}",
        "data.label_from='^([a-z]+)_'",
        "data.classes=null",
        "data.test_pattern=_bob_",
        "data.clip_seconds=0.4",
        "data.batch_size=4",
        "trainer.max_epochs=6",
        "optim.schedule=constant",
        "optim.lr=0.01",
        "data.features.top_db=50",  # tones over a noise floor: FSDD's 80 dB would show the noise
        "data.augment.truncate=0",
        "data.augment.noise_snr_db=0",  # ten tones a class, six epochs: no harder task
        "+model.kwargs.widths=[8,16]",
        "data.val_split=0.2",
        "export=onnx",
    )
    metrics = execute(cfg, tmp_path / "train")
    assert metrics["modality"] == "audio" and metrics["resident"] is True
    # learned: the held-out loss fell (the first training batch's loss, of 4 samples, is too noisy a baseline)
    history = [h["val/loss"] for h in metrics["val/history"]]
    assert history[-1] < history[0], history
    assert metrics["test/acc"] > 0.5  # three tones, chance 1/3; bob's never heard
    assert metrics["export/max_abs_diff"] < 1e-3
    import onnx

    dims = [d.dim_value for d in onnx.load(metrics["export/onnx"]).graph.input[0].type.tensor_type.shape.dim]
    assert dims[1:] == [1, 3200]  # the stored samples (0.4 s at 8 kHz): the graph computes the log-mel itself
    import onnxruntime as ort

    # what to feed it and what its outputs mean travel in the file: resampling to 8 kHz happens outside the graph
    meta = ort.InferenceSession(metrics["export/onnx"]).get_modelmeta().custom_metadata_map
    assert sorted(json.loads(meta["onn.classes"])) == ["high", "low", "mid"]
    assert json.loads(meta["onn.inputs"])["classes"] == json.loads(meta["onn.classes"])
    ckpt = str(tmp_path / "train" / "checkpoints" / "best.ckpt")
    # the recipe's AdaBN (task.adapt_norm) again, for the test only
    evaluated = compose(*common, "task=eval", f"ckpt={ckpt}", "task.adapt_norm=true")
    evaluated = execute(evaluated, tmp_path / "eval")
    assert evaluated["test/acc"] == pytest.approx(metrics["test/acc"], abs=1e-6)
    # new recordings: the checkpoint's test_pattern names its own files (none here), and eval was refused for it
    given = [f"data.source={make_tones(tmp_path / 'other', per_class=4, speakers=('cy',))}"]
    other = execute(compose(*common, "task=eval", f"ckpt={ckpt}", *given), tmp_path / "other_eval", given_keys(given))
    assert other["val/acc"] is not None and "test/acc" not in other
    new = tmp_path / "new"
    new.mkdir()
    for name in ("low_bob_1.wav", "high_bob_2.wav"):
        (new / name).write_bytes((data / name).read_bytes())
    out = execute(compose(*common, "task=infer", f"ckpt={ckpt}", f"task.input={new}"), tmp_path / "infer")
    rows = [json.loads(line) for line in Path(out["infer/output"]).read_text().splitlines()]
    assert [r["name"] for r in rows] == ["high_bob_2.wav", "low_bob_1.wav"] and {r["true"] for r in rows} == {
        "high",
        "low",
    }
    from PIL import Image

    assert Image.open(out["infer/picture"]).size[1] >= 24 * 4  # spectrograms drawn 4x


def tone_run(root: Path) -> list[str]:
    """A run in `root`, planned for a named machine (measuring this one takes half a minute)."""
    return [
        "tracking=none",
        "trainer.enable_progress_bar=false",
        f"paths.outputs={root}",
        f"paths.cache={root}/cache",
        "hardware=cpu_16gb",
    ]


TONE_DATA = ["data=audio", "data.label_from='^([a-z]+)_'", "data.clip_seconds=0.3", "data.max_bad_fraction=0.2"]


@pytest.fixture(scope="module")
def tone_ckpt(tmp_path_factory) -> tuple[Path, Path]:
    """(tones, the checkpoint of two epochs of a small audio CNN on them at 8 kHz, ann's tested with AdaBN)."""
    from onn.app import execute

    root = tmp_path_factory.mktemp("tone_ckpt")
    data = make_tones(root / "tones", per_class=6)
    cfg = compose(
        *tone_run(root),
        *TONE_DATA,
        f"data.source={data}",
        *("data.sample_rate=8000", "data.test_pattern=_ann_", "data.batch_size=4", "data.val_split=0.2"),
        *("model=audio_cnn", "+model.kwargs.widths=[8,16]", "trainer.max_epochs=2", "trainer.val_check_interval=1.0"),
        "task.adapt_norm=true",
    )
    execute(cfg, root / "train")
    return data, root / "train" / "checkpoints" / "last.ckpt"


def test_a_run_with_validation_off_and_no_test_split_ends_ok_and_says_nothing_was_scored(tmp_path, caplog):
    """trainer.limit_val_batches=0 without a test split: nothing held out is scored, so there is no confusion matrix
    to draw (a KeyError ended the finished run), and the run says so in one line."""
    from onn.app import execute

    data = make_tones(tmp_path / "tones", per_class=3)
    cfg = compose(
        *tone_run(tmp_path),
        *TONE_DATA,
        f"data.source={data}",
        *("data.sample_rate=8000", "data.test_pattern=null", "data.batch_size=4", "trainer.max_epochs=1"),
        *("model=audio_cnn", "+model.kwargs.widths=[8,16]", "trainer.limit_val_batches=0"),
    )
    metrics = execute(cfg, tmp_path / "train")
    assert metrics["steps"] > 0 and "confusion_matrix" not in metrics and metrics["val/history"] == []
    assert "no val batches were scored (trainer.limit_val_batches)" in caplog.text


def eval_of(root: Path, ckpt: Path, *given: str) -> dict:
    from onn.app import execute, given_keys

    name = f"eval{len(list(root.glob('eval*')))}"
    return execute(compose(*tone_run(root), "task=eval", f"ckpt={ckpt}", *given), root / name, given_keys(list(given)))


def test_eval_with_data_named_decodes_as_the_checkpoint_was_trained(tone_ckpt, tmp_path, caplog):
    """`data=audio` with ckpt= brought that config's 16 kHz: the checkpoint's 8 kHz log-mels got twice the samples
    (FSDD's val/acc 0.88 -> 0.04), without a word. The checkpoint's decoding settings are used, the difference said;
    the plan sizes the checkpoint's network."""
    data, ckpt = tone_ckpt
    own = eval_of(tmp_path, ckpt, f"data.source={data}")
    with caplog.at_level(logging.WARNING, logger="onn"):
        named = eval_of(tmp_path, ckpt, *TONE_DATA, f"data.source={data}")
    assert named["val/loss"] == pytest.approx(own["val/loss"], abs=1e-6) and named["val/acc"] == own["val/acc"]
    assert "decoding the audio as its model was trained (sample_rate 8000, channels 1, samples 2400)" in caplog.text
    assert "not as the data config says (sample_rate 16000" in caplog.text
    assert named["params_total"] == own["params_total"]


def test_adapt_norm_measures_a_given_source(tone_ckpt, tmp_path):
    """task.adapt_norm=true was dropped on a given data.source, which eval scores as val: AdaBN ran before tests
    only, and the figures were the same with it as without. It runs before eval's validation now."""
    data, ckpt = tone_ckpt
    plain = eval_of(tmp_path, ckpt, f"data.source={data}")
    adapted = eval_of(tmp_path, ckpt, f"data.source={data}", "task.adapt_norm=true")
    assert adapted["val/loss"] != pytest.approx(plain["val/loss"], abs=1e-6)  # other norms, other figures
    again = eval_of(tmp_path, ckpt, f"data.source={data}")
    assert again["val/loss"] == pytest.approx(plain["val/loss"], abs=1e-6)  # the checkpoint keeps the trained ones


def test_eval_says_when_it_runs_without_the_checkpoints_adapt_norm(tone_ckpt, tmp_path, caplog):
    """A run tested with AdaBN, evaluated without (task.adapt_norm is the command line's): its test figures
    differed from the training's without a word. Needs /tmp/rv2/fixmedia/classification.diff (evaluate calls
    adapt_norm_note)."""
    _, ckpt = tone_ckpt
    with caplog.at_level(logging.WARNING, logger="onn"):
        eval_of(tmp_path, ckpt)
    assert "was tested with task.adapt_norm=true" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="onn"):
        eval_of(tmp_path, ckpt, "task.adapt_norm=true")
    assert "was tested with task.adapt_norm" not in caplog.text


@pytest.mark.slow
def test_fsdd_holds_a_speaker_out(tmp_path):
    """The real recordings: data.test_pattern puts every one of a speaker's 500 recordings in the test split."""
    if not FSDD.is_dir():
        pytest.skip(f"{FSDD} is not here (the shared data lives beside the repository)")
    from onn.modalities import classification, get

    cfg = compose(
        "recipe=fsdd_audio_cnn", f"data.source={FSDD}", "data.test_pattern=_lucas_", f"paths.cache={tmp_path}"
    )
    dm = classification.setup_data(get("audio"), cfg, "cpu")
    assert len(dm.splits["test"]) == 500 and all("_lucas_" in n for n in dm.splits["test"].names)
    assert not any("_lucas_" in n for split in ("train", "val") for n in dm.splits[split].names)
    assert len(dm.splits["train"]) + len(dm.splits["val"]) == 1500 and dm.classes == [str(d) for d in range(10)]
    assert dm.splits["train"].inputs.shape[1:] == (1, 8000) and dm.splits["train"].inputs.dtype == torch.float16


@pytest.mark.parametrize(
    "recipe, modality, shape",
    [
        ("fsdd_audio_cnn", "audio", [1, 8000]),
        ("video_motion", "video", [3, 12, 32, 32]),
        ("bench_media", "audio", [1, 8000]),
    ],
)
def test_recipes_compose_check_and_plan(recipe, modality, shape):
    from onn.modalities import get

    cfg = compose(f"recipe={recipe}", "hardware=cpu_16gb")
    m = get(cfg.data.modality)
    m.check(cfg)
    plan, spec = m.plan(cfg, resolve(cfg.hardware, "/tmp", "/tmp"))
    assert m.name == modality and m.planned_inputs(cfg)["input_shape"] == shape
    assert plan.strategy == "full" and spec.kind == "network" and spec.sample_flops > 0 and spec.n_blocks >= 3


def test_streamed_fallback_decodes_per_item(tmp_path):
    """A dataset over data.resident_max_mb is decoded item by item in DataLoader workers."""
    from onn.modalities import classification, get

    data = make_tones(tmp_path / "tones", per_class=4, speakers=("ann",))
    (data / "low_ann_9.wav").write_bytes(b"")  # a bad file is skipped and counted, as resident data's are
    cfg = compose(
        "data=audio",
        "model=audio_cnn",
        f"data.source={data}",
        "data.label_from='^([a-z]+)_'",
        "data.resident=false",
        "data.max_bad_fraction=0.1",
        "data.num_workers=0",
        "data.batch_size=4",
        "data.clip_seconds=0.3",
        "data.sample_rate=8000",
        f"paths.cache={tmp_path / 'cache'}",
    )
    dm = classification.setup_data(get("audio"), cfg, "cpu")
    assert dm.streamed and dm.input_shape == (1, 2400) and dm.skipped == ["low_ann_9.wav"]
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (4, 1, 2400) and x.dtype == torch.float16 and y.shape == (4,)


def bench_media_on(tones: Path, *overrides: str):
    """recipe=bench_media on make_tones' folder, its classes read from the file names."""
    return compose(
        "recipe=bench_media", f"data.source={tones}", "data.label_from='^([a-z]+)_'", "data.classes=null", *overrides
    )


@pytest.mark.slow
def test_bench_media_reports_decoding_and_both_pipelines(tmp_path):
    from onn.app import execute

    data = make_tones(tmp_path / "tones", per_class=6, speakers=("ann",))
    cfg = bench_media_on(
        data,
        "data.batch_size=4",
        "task.steps=2",
        "task.warmup=1",
        "task.repeats=1",
        "task.standard_workers=0",
        "+model.kwargs.widths=[8,16]",
        f"paths.cache={tmp_path / 'cache'}",
        f"paths.outputs={tmp_path / 'out'}",
    )
    metrics = execute(cfg, tmp_path / "bench")
    assert metrics["media/clips"] == 18 and metrics["media/decoded_seconds"] == pytest.approx(18 * 0.25, abs=0.05)
    for key in (
        "media/decode_clips_per_s",
        "media/decode_audio_s_per_s",
        "media/cache_speedup",
        "media/resident_speedup",
        "media/train_speedup",
        "media/pipeline_standard_samples_per_s",
    ):
        assert metrics[key] > 0, key


def test_bench_medias_per_file_pipeline_batches_a_split_smaller_than_a_batch(tmp_path):
    """bench_media's standard (per-file) pipeline gives a training split smaller than data.batch_size its batch
    each epoch (drop_last gave none, and the timing loops spun for ever at 100% CPU), and both timing loops run it
    epoch after epoch."""
    from onn.bench.media import _pipeline, _train, standard_items
    from onn.modalities import classification, get

    data = make_tones(tmp_path / "tones", per_class=2, speakers=("ann",))
    cfg = bench_media_on(
        data,
        "data.batch_size=16",
        "+model.kwargs.widths=[8,16]",
        f"paths.cache={tmp_path / 'cache'}",
    )
    audio = get("audio")
    dm = classification.setup_data(audio, cfg, "cpu")
    inputs = classification.data_inputs(audio, cfg, dm)
    items = standard_items(audio, cfg, dm, inputs, audio.transform(cfg, inputs))
    train = len(dm.splits["train"])
    assert 0 < len(items) == train < 16
    loader = items.loader(16, 0, dm.device)
    assert [len(labels) for _, labels in loader] == [train]
    assert _pipeline(loader, 2, 1, None, dm.device) > 0
    assert _train(audio, cfg, inputs, loader, 2, 1, None, "32-true", dm.device) > 0


def test_truncation_ends_each_recording_early_and_keeps_its_start():
    """data.augment.truncate: each training recording loses up to that fraction of its end to silence."""
    from onn.modalities.audio.features import LogMel, feature_settings

    settings = feature_settings(compose("data=fsdd").data)
    transform = LogMel(settings, AudioAugment(truncate=0.5))
    waves = torch.zeros(64, 1, 8000)
    waves[:, :, 1000:5000] = torch.from_numpy(tone(440.0, 0.5).T)  # 4,000 samples of sound, silence around
    torch.manual_seed(0)
    cut = transform._truncate(waves)
    sound = (cut != 0).any(dim=1)
    position = torch.arange(8000)
    ends = torch.where(sound, position, -1).amax(dim=-1) + 1
    assert torch.equal(cut[:, :, :1000], waves[:, :, :1000]) and sound[:, 1000].all()  # the start stays
    assert (ends >= 3000).all() and (ends <= 5000).all()  # at most half of the 4,000 samples go
    assert ends.unique().numel() > 32  # each recording its own cut
    kept = position < ends.unsqueeze(-1)
    assert torch.equal(cut[:, 0][kept], waves[:, 0][kept])  # what is kept is untouched
