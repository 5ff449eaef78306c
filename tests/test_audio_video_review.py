"""The audio and video review's fixes, each on real files made here: a long recording is decoded only where its
clip is cut from (WAV through libsndfile, M4A through PyAV), and gives the clip the whole recording gives."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest


def noise(seconds: float, rate: int, channels: int = 2, seed: int = 0) -> np.ndarray:
    """Quiet white noise, float32 [channels, samples]."""
    rng = np.random.default_rng(seed)
    return (0.1 * rng.standard_normal((channels, round(seconds * rate)))).astype(np.float32)


def write_m4a(path: Path, wave: np.ndarray, rate: int) -> None:
    """Stereo AAC in an M4A (a format libsndfile does not read: PyAV decodes it)."""
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("aac", rate=rate)
        stream.layout = "stereo"
        for i in range(0, wave.shape[1] - 1024, 1024):
            frame = av.AudioFrame.from_ndarray(
                np.ascontiguousarray(wave[:, i : i + 1024]), format="fltp", layout="stereo"
            )
            frame.sample_rate = rate
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def every_sample(path: Path) -> np.ndarray:
    """The whole recording, float32 [channels, samples], decoded here (libsndfile for WAV, PyAV for M4A)."""
    import av
    import soundfile as sf

    if path.suffix == ".wav":
        return sf.read(path, dtype="float32", always_2d=True)[0].T
    with av.open(str(path)) as container:
        frames = [f.to_ndarray() for f in container.decode(audio=0)]
    return np.concatenate(frames, axis=1).astype(np.float32)


@pytest.mark.parametrize("suffix, seconds", [("wav", 60.0), ("m4a", 20.0)])
def test_a_long_recording_decodes_only_the_window_its_clip_is_cut_from(tmp_path, suffix, seconds):
    """A 1 s clip of a long 44.1 kHz stereo recording: the whole file was decoded to float32 and resampled before
    the centre second was cut (a 10-minute file took 1.4 GB of memory, an hour's several GB per decoding thread).
    Now only a window around the centre is decoded, and the clip, at 16 kHz, is the one the whole file gives."""
    import soundfile as sf

    from onn.modalities.audio.decode import Fit, fit_waveform, load

    rate = 44100
    wave = noise(seconds, rate)
    path = tmp_path / f"long.{suffix}"
    if suffix == "wav":
        sf.write(path, wave.T, rate, subtype="PCM_16")
    else:
        write_m4a(path, wave, rate)
    fit = Fit(16000, 1, 16000)
    whole = every_sample(path)
    total = whole.shape[1]
    expected = fit_waveform(whole, rate, fit)
    del whole
    tracemalloc.start()  # numpy's buffers are traced: libsndfile's and PyAV's samples
    try:
        clip, duration = load(str(path), fit)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    full_bytes = total * 2 * 4  # the whole recording in float32 stereo
    assert peak < full_bytes / 5, f"decoding took {peak / 1e6:.1f} MB; the whole recording is {full_bytes / 1e6:.1f} MB"
    assert duration == pytest.approx(total / rate) and duration >= seconds - 0.1
    assert clip.shape == (1, 16000)
    assert float((clip - expected).abs().max()) < 1e-6


def test_streamed_audio_with_dataset_normalisation_measures_the_training_data(tmp_path):
    """data.features.normalize=dataset on a dataset too big to hold (streamed) trained on raw dB (mean 0, std 1:
    about -60 and 20 away from the data's) without a word; the statistics now come from its training recordings,
    as a resident store's do."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from conftest import MODALITY_HARDWARE, compose
    from test_audio import make_tones

    from onn.app import execute
    from onn.modalities import classification, get

    data = make_tones(tmp_path / "tones", per_class=3)
    common = [
        MODALITY_HARDWARE,
        "tracking=none",
        "trainer.enable_progress_bar=false",
        f"paths.outputs={tmp_path / 'outputs'}",
        f"paths.cache={tmp_path / 'cache'}",
        *("data=audio", "model=audio_cnn", "+model.kwargs.widths=[8,16]", f"data.source={data}"),
        *("data.label_from='^([a-z]+)_'", "data.sample_rate=8000", "data.clip_seconds=0.3", "data.batch_size=4"),
        *("data.features.normalize=dataset", "data.features.top_db=50", "data.num_workers=0"),
    ]
    resident = compose(*common)
    dm = classification.setup_data(get("audio"), resident, "cpu")
    measured = get("audio").input_stats(resident, dm)
    assert measured["mean"] < -3 and measured["std"] > 3  # dB of tones over a floor: far from 0 and 1
    streamed = compose(*common, "data.resident=false", "trainer.max_steps=2")
    metrics = execute(streamed, tmp_path / "streamed")
    assert metrics["resident"] is False
    saved = classification.saved_inputs(tmp_path / "streamed" / "checkpoints" / "last.ckpt")
    assert saved["mean"] == pytest.approx(measured["mean"], abs=0.01)
    assert saved["std"] == pytest.approx(measured["std"], abs=0.01)


def test_streamed_statistics_over_recordings_that_no_longer_decode_are_one_sentence(tmp_path):
    """Every recording picked to measure a streamed dataset's statistics broken after the run's check that each
    decodes: torch.stack of nothing raised a RuntimeError; now one sentence naming the key and what to do."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from conftest import compose
    from test_audio import make_tones

    from onn.errors import UserError
    from onn.modalities import classification, get

    data = make_tones(tmp_path / "tones", per_class=2)
    config = compose(
        *("data=audio", "model=audio_cnn", f"data.source={data}", "data.label_from='^([a-z]+)_'"),
        *("data.features.normalize=dataset", "data.resident=false", f"paths.cache={tmp_path / 'cache'}"),
    )
    dm = classification.setup_data(get("audio"), config, "cpu")
    for wav in data.glob("*.wav"):
        wav.write_bytes(b"")
    with pytest.raises(UserError, match=r"data.features.normalize=dataset: none of the \d+ training recordings"):
        get("audio").input_stats(config, dm)
