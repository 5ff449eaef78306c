"""Review of the video decoder (round 2) on files made here with PyAV: a display matrix that mirrors (a front
camera, `ffmpeg -display_hflip`) is shown as FFmpeg's own tools show it, and cover art is never the clip."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from onn.modalities.video.decode import BadFile, Fit, load


def _pattern() -> np.ndarray:
    """uint8 [32, 48, 3] grey: a white block top left and a mid-grey one top right, so that every turn and mirror
    of it looks different."""
    image = np.zeros((32, 48, 3), np.uint8)
    image[:12, :12] = 255
    image[:12, -12:] = 128
    return image


def _write_with_display_matrix(path: Path, image: np.ndarray, degrees: float, hflip: bool, vflip: bool) -> None:
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=4, options={"qp": "0"})
        stream.height, stream.width, stream.pix_fmt = image.shape[0], image.shape[1], "yuv444p"
        stream.set_display_rotation(degrees, hflip=hflip, vflip=vflip)
        for _ in range(2):
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


@pytest.mark.parametrize(
    "degrees, hflip, vflip, shown",
    [
        (0, True, False, lambda a: a[:, ::-1]),  # mirrored left-right: frame.rotation says -180
        (0, False, True, lambda a: a[::-1]),  # upside down: frame.rotation says 0
        (90, True, False, lambda a: a[::-1, ::-1].transpose(1, 0, 2)),  # fftools' transpose=clock_flip
    ],
)
def test_a_mirroring_display_matrix_is_a_flip_not_a_half_turn(tmp_path, degrees, hflip, vflip, shown):
    """The decoder turned frames by frame.rotation alone, which reads a mirror as a half turn: a mirrored clip came
    out upside down, and one flipped upside down came out as stored. It is shown now as ffmpeg/ffplay show it."""
    image = _pattern()
    path = tmp_path / "mirrored.mp4"
    _write_with_display_matrix(path, image, degrees, hflip, vflip)
    expected = np.ascontiguousarray(shown(image))[:, :, 0].astype(np.float32)
    clip, _ = load(str(path), Fit(2, 3, expected.shape, "resize"))
    decoded = clip[0, 0].numpy().astype(np.float32)
    assert np.abs(decoded - expected).mean() < 4, np.abs(decoded - expected).mean()


def _song_with_cover_art(path: Path) -> None:
    """An mp4 of one second of sound with an album cover (a JPEG attached picture), as music files carry one."""
    import av
    from av.stream import Disposition

    with av.open(str(path), "w") as container:
        sound = container.add_stream("aac", rate=16000, layout="mono")
        cover = container.add_stream("mjpeg", rate=1)
        cover.width = cover.height = 64
        cover.pix_fmt = "yuvj420p"
        cover.disposition = Disposition.attached_pic
        picture = np.zeros((64, 64, 3), np.uint8)
        picture[16:48, 16:48] = (200, 30, 30)
        for packet in cover.encode(av.VideoFrame.from_ndarray(picture, format="rgb24")):
            container.mux(packet)
        for packet in cover.encode():
            container.mux(packet)
        wave = (0.3 * np.sin(2 * np.pi * 440 * np.arange(16000) / 16000)).astype(np.float32)[None]
        for first in range(0, 16000, 1024):
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(wave[:, first : first + 1024]), "fltp", "mono")
            frame.rate, frame.pts = 16000, first
            for packet in sound.encode(frame):
                container.mux(packet)
        for packet in sound.encode():
            container.mux(packet)


def test_a_song_with_cover_art_is_no_video(tmp_path):
    """A music file carries its album cover as a video stream of one still (an attached picture): it was read as a
    clip of that picture repeated, and trained on as one. It is an audio-only file now, skipped and named."""
    path = tmp_path / "song.mp4"
    _song_with_cover_art(path)
    with pytest.raises(BadFile, match=r"no video stream \(an audio-only file with cover art\)"):
        load(str(path), Fit(4, 3, (16, 16), "resize"))


def _shown_from_the_first_keyframe(path: Path, count: int) -> np.ndarray:
    """uint8 [3, count, 8, 8]: every frame decoded with PyAV alone, those before the first keyframe left out, and the
    one shown at each of `count` evenly spaced times from the first to the last."""
    import av

    with av.open(str(path)) as container:
        decoded = [
            (float(f.time), f.key_frame, f.to_ndarray(format="rgb24", width=8, height=8))
            for f in container.decode(video=0)
        ]
    decoded.sort(key=lambda item: item[0])
    first_key = next(i for i, (_, key, _) in enumerate(decoded) if key)
    assert first_key > 0  # the capture opens with frames cut off from their references
    shown = decoded[first_key:]
    times = np.array([t for t, _, _ in shown])
    at = np.searchsorted(times, np.linspace(times[0], times[-1], count) + 1e-9, side="right") - 1
    return np.stack([shown[i][2] for i in at]).transpose(3, 0, 1, 2)


def test_a_transport_stream_cut_mid_gop_starts_at_its_first_keyframe(tmp_path, monkeypatch):
    """A broadcast capture cut between keyframes opens with frames whose references were cut off: the sampler took
    the first of them, which never decoded right, so the clip began with a garbage frame and the file was decoded
    whole, twice (one hour of capture for 8 frames). Its clip now starts at the first keyframe, reached by seeking."""
    from onn.modalities.video import decode
    from onn.modalities.video.builtin import write_clip

    frames = np.zeros((240, 32, 32, 3), np.uint8)
    frames[..., 0] = np.arange(240)[:, None, None]  # red says which frame it is
    whole = tmp_path / "whole.ts"
    write_clip(whole, frames, 24, "mpeg4", gop_size=24, max_b_frames=2, options={"sc_threshold": "1000000000"})
    cut = tmp_path / "capture.ts"
    cut.write_bytes(whole.read_bytes()[188 * 20 :])  # whole transport packets, from the middle of a GOP
    decoded, original = [], decode.decoded_frames

    def counted(container, stream):
        for frame in original(container, stream):
            decoded.append(frame.pts)
            yield frame

    monkeypatch.setattr(decode, "decoded_frames", counted)
    clip, _ = load(str(cut), Fit(8, 3, (8, 8), "resize"))
    assert np.array_equal(clip.numpy(), _shown_from_the_first_keyframe(cut, 8))
    assert len(decoded) < 230, len(decoded)  # not every frame, let alone twice


def test_a_video_cache_of_the_decoder_before_these_fixes_is_not_read(tmp_path):
    """A mirrored clip, cover art and a cut transport stream decode to other tensors than before: a cache the
    reader of before wrote (version 1) must be decoded again, not read, or a run trains on the old clips."""
    import dataclasses

    from conftest import compose

    from onn.modalities.video.builtin import moving_square, write_clip
    from onn.modalities.video.dataset import READER

    rng = np.random.default_rng(0)
    for label in ("left", "right"):
        (tmp_path / "clips" / label).mkdir(parents=True)
        for i in range(2):
            write_clip(tmp_path / "clips" / label / f"{i}.mp4", moving_square(rng, label, 6, 24), 6)
    cfg = dataclasses.replace(compose("data=video").data, source=str(tmp_path / "clips"))
    loads = []

    def counted(*args, **kwargs):
        loads.append(1)
        return READER.load(*args, **kwargs)

    before = dataclasses.replace(READER, version=1)
    before.read_cached(cfg.source, cfg, tmp_path / "cache")
    dataclasses.replace(READER, load=counted).read_cached(cfg.source, cfg, tmp_path / "cache")
    assert len(loads) == 4  # every clip decoded again
