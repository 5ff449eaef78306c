"""Review of media decoding (round 6): a centred audio window placed from the decoded length, not FFmpeg's
estimate; MPEG-PS video sampled in one pass that keeps only the chosen frames; a 16-bit grey+alpha PNG is grey."""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from onn.modalities.audio import decode as audio
from onn.modalities.image.formats.decode import ItemList, decode
from onn.modalities.video import decode as video
from onn.modalities.video.builtin import write_clip


def _chirp(seconds: float, rate: int) -> np.ndarray:
    t = np.arange(round(seconds * rate)) / rate
    return (0.5 * np.sin(2 * np.pi * (200 * t + 150 * t * t))).astype(np.float32)


def _encoded(wave: np.ndarray, rate: int, form: str, codec: str) -> bytes:
    """Mono samples encoded by PyAV into an in-memory file of container `form`."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format=form) as container:
        stream = container.add_stream(codec, rate=rate, layout="mono")
        frame = av.AudioFrame.from_ndarray(wave[None], format="flt", layout="mono")
        frame.rate = rate
        resampler = av.AudioResampler(format=stream.codec_context.format.name, layout="mono", rate=rate)
        for piece in [*resampler.resample(frame), None]:
            for packet in stream.encode(piece):
                container.mux(packet)
    return buf.getvalue()


@pytest.mark.parametrize("form, codec, rate", [("adts", "aac", 44100), ("ogg", "libopus", 48000)])
def test_an_ffmpeg_window_is_centred_on_the_decoded_length_not_the_estimated_one(form, codec, rate):
    """ADTS AAC and Ogg say how long they last by an estimate (the bitrate, the last page) a few ms to tens of ms
    off; the window was placed from it, so the clip was cut that far off the centre of the decoded recording (4
    and 6.5 ms here, sample-exact by cross-correlation). It is placed from the decoded length now."""
    import av

    if codec not in av.codecs_available:
        pytest.skip(f"this FFmpeg has no {codec} encoder")
    data = _encoded(_chirp(5.0, rate), rate, form, codec)
    fit = audio.Fit(16000, 1, 16000)
    whole, whole_rate, _, total = audio._decode_ffmpeg(data, None)
    wave, wave_rate, start, said = audio._decode_ffmpeg(data, fit)
    assert start > 0 and said == total  # a window, of a recording as long as the decoded one
    reference = audio.fit_waveform(whole, whole_rate, fit)[0].numpy()
    clip = audio.fit_waveform(wave, wave_rate, fit, start, said)[0].numpy()
    offset = int(np.correlate(clip, reference, "full").argmax()) - (fit.samples - 1)
    assert offset == 0, offset
    np.testing.assert_allclose(clip, reference, atol=1e-5)


def test_an_estimate_far_off_decodes_the_window_again_once_the_length_is_known(monkeypatch):
    """An estimate off by more than the slack kept either side: the window is decoded again at the true length."""
    data = _encoded(_chirp(6.0, 44100), 44100, "adts", "aac")
    fit = audio.Fit(16000, 1, 16000)
    whole, rate, _, total = audio._decode_ffmpeg(data, None)
    monkeypatch.setattr(audio, "ESTIMATE_SLACK_SECONDS", 0.0)  # no slack: any estimate error needs a second pass
    wave, _, start, said = audio._decode_ffmpeg(data, fit)
    assert said == total and np.array_equal(wave, whole[:, start : start + wave.shape[1]])


FRAMES = 240  # 10 s at 24 fps


def _ramp_mpg(path: Path) -> None:
    """An MPEG-PS (.mpg) with MPEG-2 video, B-frames and a keyframe every 12; each frame's red level says which."""
    frames = np.zeros((FRAMES, 64, 64, 3), np.uint8)
    frames[..., 0] = np.arange(FRAMES)[:, None, None]
    frames[..., 2] = 255 - np.arange(FRAMES)[:, None, None]
    frames[:, ::4, :, 1] = 200
    write_clip(path, frames, 24, "mpeg2video", gop_size=12, max_b_frames=2, options={"sc_threshold": "1000000000"})


def _full_decode(path: Path, fit: video.Fit) -> np.ndarray:
    """Every frame decoded by PyAV and converted, sorted by time, then the chosen ones: [T, H, W, C]."""
    import av

    with av.open(str(path)) as container:
        frames = [(float(f.time), video.convert(f, fit)) for f in container.decode(container.streams.video[0])]
    frames.sort(key=lambda pair: pair[0])
    return np.stack([frames[i][1] for i in video.pick([t for t, _ in frames], fit.frames)])


def _counted(monkeypatch) -> tuple[list, list]:
    """Counts the frames decode_video decodes and those it converts (holds)."""
    decoded, converted = [], []
    decode_frames, convert = video.decoded_frames, video.convert

    def counting_decoder(container, stream):
        for frame in decode_frames(container, stream):
            decoded.append(frame.pts)
            yield frame

    def counting_convert(frame, fit):
        converted.append(frame.pts)
        return convert(frame, fit)

    monkeypatch.setattr(video, "decoded_frames", counting_decoder)
    monkeypatch.setattr(video, "convert", counting_convert)
    return decoded, converted


def test_an_mpeg_ps_is_read_in_one_pass_keeping_only_the_chosen_frames(tmp_path, monkeypatch):
    """MPEG-PS has no index and FFmpeg times frames after a seek by interpolating at the wrong rate, so seeks missed
    and retried: more frames decoded than the clip holds (293 of 240), then a pass from the start. It is read in
    one pass now, converting only the chosen frames, which are those a full decode picks."""
    path = tmp_path / "clip.mpg"
    _ramp_mpg(path)
    fit = video.Fit(16, 3, (16, 16), "resize")
    expected = _full_decode(path, fit)
    decoded, converted = _counted(monkeypatch)
    clip, duration = video.decode_video(str(path), fit)
    assert np.array_equal(clip.numpy().transpose(1, 2, 3, 0), expected)
    assert len(decoded) <= FRAMES and len(converted) == 16, (len(decoded), len(converted))
    assert abs(duration - 10.0) < 1e-6


def test_a_stream_timed_only_as_it_decodes_never_holds_every_frame(tmp_path, monkeypatch):
    """Packets without timestamps (MPEG-PS stamps only some): every frame was converted and held in memory to pick
    16; two passes now, the second converting only the chosen ones."""
    path = tmp_path / "clip.mpg"
    _ramp_mpg(path)
    fit = video.Fit(16, 3, (16, 16), "resize")
    expected = _full_decode(path, fit)
    monkeypatch.setattr(video, "_timestamps", lambda source: None)
    decoded, converted = _counted(monkeypatch)
    clip, duration = video.decode_video(str(path), fit)
    assert np.array_equal(clip.numpy().transpose(1, 2, 3, 0), expected)
    assert len(converted) == 16 and len(decoded) <= 2 * FRAMES, (len(converted), len(decoded))


def _png16(grey: np.ndarray, alpha: np.ndarray) -> bytes:
    """A 16-bit grey+alpha PNG (colour type 4), written by hand: Pillow does not write one."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    h, w = grey.shape
    pixels = np.stack([grey, alpha], -1).astype(">u2")
    raw = b"".join(b"\x00" + pixels[y].tobytes() for y in range(h))
    header = struct.pack(">IIBBBBB", w, h, 16, 4, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def test_a_16_bit_grey_alpha_png_is_grey_under_channels_auto():
    """Pillow opens a 16-bit grey+alpha PNG as RGBA, so channels=auto counted it (and its whole data set) as
    colour; it is grey now, transparency laid on white as for an 8-bit LA picture."""
    grey = (np.arange(12 * 10).reshape(12, 10) * 541).astype(np.uint16)
    alpha = np.full_like(grey, 65535)
    alpha[0] = 0
    data = _png16(grey, alpha)
    a = decode(data, "auto", "grey_alpha.png")
    assert a.shape == (12, 10) and np.array_equal(a[1:], (grey[1:] >> 8).astype(np.uint8))
    assert (a[0] == 255).all()  # transparent: white
    assert np.array_equal(decode(data, 3, "grey_alpha.png"), np.repeat(a[..., None], 3, axis=2))


class _Pictures:
    """An item list's fetch: item i's encoded bytes."""

    def __init__(self, items: list[bytes]):
        self.items = items

    def get(self, i: int) -> bytes:
        return self.items[i]


def test_a_data_set_of_16_bit_grey_alpha_pngs_counts_as_one_channel():
    """The channels=auto probe of a data set of such pictures (and the pass over every item) says 1 channel."""
    import torch

    grey = (np.arange(8 * 8).reshape(8, 8) * 1000).astype(np.uint16)
    data = _png16(grey, np.full_like(grey, 65535))
    items = ItemList(_Pictures([data, data]), torch.zeros(2, dtype=torch.long), ["a"], ["0.png", "1.png"])
    assert items.channels == 1 and items.check(1) == 1
    assert tuple(items.load(0).shape) == (1, 8, 8)
