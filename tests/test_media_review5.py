"""Review of media decoding against real-world video files (round 5): MPEG-TS with B-frames and clips trimmed
without re-encoding (mp4 edit lists) are sampled by seeking, and give the clip that decoding every frame gives."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from onn.modalities.video import decode
from onn.modalities.video.builtin import write_clip

FRAMES = 240  # 10 s at 24 fps


def _ramp() -> np.ndarray:
    """uint8 [240, 32, 32, 3] whose red level rises and blue falls frame by frame: each frame says which it is."""
    frames = np.zeros((FRAMES, 32, 32, 3), np.uint8)
    frames[:, :, :, 0] = np.arange(FRAMES)[:, None, None]
    frames[:, :, :, 2] = 255 - np.arange(FRAMES)[:, None, None]
    return frames


def _sampled(path: Path, count: int, monkeypatch) -> tuple[torch.Tensor, int]:
    """The clip decode_video gives, and how many frames it converted (decoding every frame converts all 240)."""
    converted, original = [], decode.convert

    def counted(frame, fit):
        converted.append(frame.pts)
        return original(frame, fit)

    with monkeypatch.context() as patch:
        patch.setattr(decode, "convert", counted)
        clip, _ = decode.decode_video(str(path), decode.Fit(count, 3, (8, 8), "resize"))
    return clip, len(converted)


def _everything(path: Path, count: int) -> torch.Tensor:
    frames, _ = decode._decode_all(str(path), decode.Fit(count, 3, (8, 8), "resize"))
    return torch.from_numpy(np.stack(frames).transpose(3, 0, 1, 2).copy())


@pytest.mark.parametrize(
    "codec, options",
    [
        ("mpeg4", {"gop_size": 24, "max_b_frames": 2, "options": {"sc_threshold": "1000000000"}}),
        ("libx264", {"gop_size": 24, "max_b_frames": 3, "options": {"x264-params": "open-gop=1:scenecut=0"}}),
    ],
)
def test_an_mpeg_ts_with_b_frames_is_sampled_by_seeking_to_its_keyframes(tmp_path, monkeypatch, codec, options):
    """MPEG-TS has no index: FFmpeg's binary search lands on the packet of the dts asked for, and seeking to a
    keyframe's pts landed on the packet after it, so every such file (broadcast recordings, camcorder .mts) fell back
    to decoding every frame. The seek now tries the dts too, and frames decoded before the keyframe (garbage from
    missing references under the right timestamps) are never taken."""
    path = tmp_path / "b_frames.ts"
    write_clip(path, _ramp(), 24, codec, **options)
    for count in (6, 13, 16, 27):
        clip, converted = _sampled(path, count, monkeypatch)
        assert torch.equal(clip, _everything(path, count)), count
        assert converted <= count, (count, converted)  # only the chosen frames, not all 240


def _write_trimmed(path: Path, frames: np.ndarray, cut: int) -> None:
    """An mp4 whose first `cut` frames are cut by its edit list, as `ffmpeg -ss T -c copy` trims a clip between
    keyframes: the packets stay (the frames after them need them) under negative timestamps, never shown."""
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=24)
        stream.height, stream.width, stream.pix_fmt = 32, 32, "yuv420p"
        stream.gop_size, stream.max_b_frames = 12, 2
        packets = [p for a in frames for p in stream.encode(av.VideoFrame.from_ndarray(a, format="rgb24"))]
        for packet in packets + list(stream.encode()):
            packet.pts, packet.dts = packet.pts - cut, packet.dts - cut  # in frames (the encoder's time base)
            container.mux(packet)


def test_a_clip_trimmed_by_an_edit_list_is_sampled_by_seeking_and_starts_at_its_first_shown_frame(
    tmp_path, monkeypatch
):
    """The timestamp pass counted the packets the edit list cuts as frames, so the first frame wanted never decoded
    and every trimmed clip fell back to decoding every frame; those packets are no frames now."""
    path = tmp_path / "trimmed.mp4"
    frames = _ramp()
    _write_trimmed(path, frames, cut=5)
    clip, converted = _sampled(path, 16, monkeypatch)
    assert torch.equal(clip, _everything(path, 16))
    assert converted <= 16, converted
    red = clip[0, 0].float().mean().item()  # the first frame shown is the sixth encoded one (red level 5)
    assert abs(red - 5) < 3, red


def _flac_in_mka(seconds: float, rate: int = 44100) -> bytes:
    """A stereo sine recording, FLAC in Matroska (a format libsndfile does not read: FFmpeg decodes it)."""
    import io

    import av

    buffer = io.BytesIO()
    t = np.arange(int(seconds * rate)) / rate
    wave = np.stack([np.sin(2 * np.pi * 220 * t), np.sin(2 * np.pi * 330 * t)]).astype(np.float32) * 0.5
    with av.open(buffer, "w", format="matroska") as container:
        stream = container.add_stream("flac", rate=rate, layout="stereo")
        for first in range(0, wave.shape[1], 4096):
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(wave[:, first : first + 4096]), "fltp", "stereo")
            frame.rate, frame.pts = rate, first
            for resampled in av.AudioResampler(format=stream.format.name, layout="stereo", rate=rate).resample(frame):
                for packet in stream.encode(resampled):
                    container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return buffer.getvalue()


def test_a_recording_with_one_damaged_stretch_decodes_around_it(tmp_path):
    """200 bytes of damage in a 5 s recording (a bad download block) made one packet fail to decode, and PyAV's
    error threw the whole recording away as not decodable audio; the packet is skipped now, as FFmpeg's command line
    skips it. A stream of which most packets fail is still a bad file."""
    from onn.data.media import BadFile
    from onn.modalities.audio import decode as audio

    data = bytearray(_flac_in_mka(5.0))
    damaged = tmp_path / "damaged.mka"
    middle = len(data) * 3 // 10
    damaged.write_bytes(
        data[:middle] + bytes(np.random.default_rng(1).integers(0, 256, 200, np.uint8)) + data[middle + 200 :]
    )
    fit = audio.Fit(16000, 2, 16000)
    clip, seconds = audio.load(str(damaged), fit)
    assert clip.shape == (2, 16000) and 4.0 < seconds <= 5.0, seconds
    assert clip.abs().max() > 0.3  # the sine, not silence

    ruined = tmp_path / "ruined.mka"
    ruined.write_bytes(data[:600] + bytes(np.random.default_rng(2).integers(0, 256, len(data) - 600, np.uint8)))
    with pytest.raises(BadFile):
        audio.load(str(ruined), fit)
