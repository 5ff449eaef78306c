"""Review of the audio decoder (round 3) on files made here with libsndfile and PyAV: a long MP3 without a Xing
header, or MP2, gives the centre clip of what it decodes to (libsndfile only estimates its length), and a WAV whose
recorder never wrote the header's lengths is read, not skipped as empty."""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from conftest import compose

from onn.modalities.audio.dataset import READER
from onn.modalities.audio.decode import BadFile, Fit, estimated_length, fit_waveform, load

CLIP = Fit(sample_rate=16000, channels=1, samples=8000)  # the centre half second, at 16 kHz


def chirp(seconds: float, rate: int, channels: int = 1) -> np.ndarray:
    """A rising tone with a little noise, float32 [channels, samples]: every half second of it differs from the next."""
    rng = np.random.default_rng(0)
    t = np.arange(round(seconds * rate)) / rate
    wave = 0.3 * np.sin(2 * np.pi * 300 * t * (1 + t / seconds)) + 0.05 * rng.standard_normal(len(t))
    return np.repeat(wave[None], channels, axis=0).astype(np.float32)


def write_mpeg(path: Path, wave: np.ndarray, rate: int, codec: str, **options: str) -> None:
    """MPEG audio encoded by FFmpeg (PyAV), mono; `options` the muxer's (write_xing=0: no Xing/LAME header)."""
    import av

    try:
        container = av.open(str(path), "w", format=path.suffix[1:], options=options)
        stream = container.add_stream(codec, rate=rate)
    except (av.FFmpegError, ValueError) as e:
        pytest.skip(f"this FFmpeg does not write {codec} to {path.suffix}: {e}")
    with container:
        stream.layout = "mono"
        step = 1152  # samples in an MPEG audio frame (layers II and III)
        for i in range(0, wave.shape[1] - step + 1, step):
            frame = av.AudioFrame.from_ndarray(
                np.ascontiguousarray(wave[:, i : i + step]), format="fltp", layout="mono"
            )
            frame.sample_rate, frame.pts = rate, i
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


@pytest.mark.parametrize(
    "name, codec, options",
    [("no_xing.mp3", "libmp3lame", {"write_xing": "0"}), ("broadcast.mp2", "mp2", {})],
)
def test_a_long_mpeg_recording_is_centred_on_the_length_it_decodes_to(tmp_path, name, codec, options):
    """libsndfile counts an MP2's length, or an MP3's without a Xing header, from its bitrate: 12 s of MP3 said
    62 ms more than it decodes to, and the clip was cut from the centre of that estimate, 31 ms (500 samples at
    16 kHz) off the centre of the recording. The clip is now the one the whole decoded recording gives."""
    rate = 44100
    path = tmp_path / name
    write_mpeg(path, chirp(12.0, rate), rate, codec, **options)
    whole, whole_rate = sf.read(path, dtype="float32", always_2d=True)
    assert sf.info(str(path)).frames != len(whole)  # the case: libsndfile's header length is an estimate
    expected = fit_waveform(np.ascontiguousarray(whole.T), whole_rate, CLIP)
    clip, seconds = load(str(path), CLIP)
    assert float((clip - expected).abs().max()) < 1e-3
    assert seconds == pytest.approx(len(whole) / rate, abs=1e-6)  # the decoded length, not the estimate


def unwritten_lengths(wav: bytes) -> bytes:
    """The WAV as a recorder leaves it when it stops before patching the header (a crash, a full card, a pipe):
    the RIFF and data lengths 0."""
    raw = bytearray(wav)
    data = raw.index(b"data")
    raw[4:8] = raw[data + 4 : data + 8] = bytes(4)
    return bytes(raw)


@pytest.mark.parametrize("seconds", [0.8, 3.0])  # read whole, and windowed around its centre half second
def test_a_wav_whose_header_lengths_were_never_written_is_read_to_its_end(tmp_path, seconds):
    """libsndfile reads no sample of a WAV with a data length of 0, and the file was skipped as 'no audio samples';
    FFmpeg reads it to the end of the file. A header with nothing after it is still a bad file."""
    good = tmp_path / "good.wav"
    sf.write(good, chirp(seconds, 22050, channels=2).T, 22050, subtype="PCM_24")
    stopped = tmp_path / "stopped.wav"
    stopped.write_bytes(unwritten_lengths(good.read_bytes()))
    expected, expected_seconds = load(str(good), CLIP)
    clip, clip_seconds = load(str(stopped), CLIP)
    assert float((clip - expected).abs().max()) < 1e-5 and clip_seconds == pytest.approx(expected_seconds)
    assert float(clip.abs().max()) > 0.2  # the recording, not silence
    empty = tmp_path / "empty.wav"
    empty.write_bytes(unwritten_lengths(good.read_bytes())[:44])
    with pytest.raises(BadFile, match="no audio samples"):
        load(str(empty), CLIP)


def test_a_dataset_keeps_a_recording_whose_header_lengths_were_never_written(tmp_path):
    """Through the dataset's reader, with no bad file allowed: the recording is decoded into the store, not refused."""
    for label, freq in (("low", 300.0), ("high", 1500.0)):
        (tmp_path / label).mkdir()
        for i in range(2):
            t = np.arange(8000) / 8000
            sf.write(tmp_path / label / f"{i}.wav", (0.4 * np.sin(2 * np.pi * freq * t)).astype(np.float32), 8000)
    stopped = tmp_path / "high" / "1.wav"
    stopped.write_bytes(unwritten_lengths(stopped.read_bytes()))
    data = dataclasses.replace(compose("data=audio", f"data.source={tmp_path}").data, max_bad_fraction=0.0)
    decoded, seconds = READER.read(str(tmp_path), data, Fit(8000, 1, 8000))
    store = decoded["all"]
    assert len(store.labels) == 4 and not store.skipped and seconds == pytest.approx(4.0)
    kept = store.inputs[store.names.index(next(n for n in store.names if n.endswith("high/1.wav")))]
    assert float(kept.float().abs().max()) > 0.3


def test_a_valid_empty_take_with_its_notes_after_the_data_is_still_no_audio(tmp_path):
    """A WAV whose lengths are written and whose data chunk is empty, a LIST chunk of notes after it: FFmpeg read the
    notes' text as samples (noise), where it is an empty take. Only lengths never written are read past."""
    fmt = struct.pack("<4sIHHIIHH", b"fmt ", 16, 1, 1, 16000, 32000, 2, 16)
    info = b"INFO" + b"ICMT" + struct.pack("<I", 400) + b"notes " * 66 + b"abcd"
    body = b"WAVE" + fmt + b"data" + struct.pack("<I", 0) + b"LIST" + struct.pack("<I", len(info)) + info
    path = tmp_path / "empty_take.wav"
    path.write_bytes(b"RIFF" + struct.pack("<I", len(body)) + body)
    with pytest.raises(BadFile, match="no audio samples"):
        load(str(path), CLIP)


def test_an_mp3_whose_length_its_header_counts_is_windowed_by_libsndfile(tmp_path):
    """A Xing/Info header (LAME writes one, behind FFmpeg's ID3 tag) gives libsndfile the exact length: such an MP3
    is windowed in place, not decoded whole by FFmpeg to learn it (50 times slower on ten minutes); one without it
    is an estimate."""
    rate = 44100
    tagged, bare = tmp_path / "tagged.mp3", tmp_path / "bare.mp3"
    write_mpeg(tagged, chirp(3.0, rate), rate, "libmp3lame")
    write_mpeg(bare, chirp(3.0, rate), rate, "libmp3lame", write_xing="0")
    assert tagged.read_bytes()[:3] == b"ID3"
    assert not estimated_length(str(tagged), "MPEG_LAYER_III") and not estimated_length(
        tagged.read_bytes(), "MPEG_LAYER_III"
    )
    assert estimated_length(str(bare), "MPEG_LAYER_III") and estimated_length(str(bare), "MPEG_LAYER_II")
    whole, _ = sf.read(tagged, dtype="float32", always_2d=True)
    assert sf.info(str(tagged)).frames == len(whole)  # what the tag promises
