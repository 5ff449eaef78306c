"""Media decoding on files made here: a one-frame MP2, a video whose display matrix is not a quarter turn, and
bench_vision's standard pipeline decoding a phone photo as training does."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from onn.modalities.audio.decode import decode_audio

RATE = 44100
MP2_FRAME = 1152  # samples in an MPEG audio Layer II frame


def _mp2_frames(path: Path) -> list[bytes]:
    """An MP2 of a 440 Hz tone, eight frames long, written to `path`; its frames' bytes."""
    import av

    tone = (0.3 * np.sin(2 * np.pi * 440 * np.arange(8 * MP2_FRAME) / RATE) * 32767).astype(np.int16)
    with av.open(str(path), "w", format="mp2") as container:
        stream = container.add_stream("mp2", rate=RATE, layout="mono")
        frame = av.AudioFrame.from_ndarray(tone[None], "s16", "mono")
        frame.rate, frame.pts = RATE, 0
        for packet in [*stream.encode(frame), *stream.encode()]:
            container.mux(packet)
    with av.open(str(path)) as container:
        return [bytes(packet) for packet in container.demux(audio=0) if packet.size]


@pytest.mark.parametrize("as_bytes", [False, True])
def test_a_file_of_one_mp2_frame_decodes_to_that_frames_samples(tmp_path, as_bytes):
    """FFmpeg's MPEG audio demuxer opens a stream only where a second frame follows the first, and libsndfile's
    mpg123 refused the one frame too: a one-frame MP2 (a click, a short effect) was a bad file. It decodes now to
    the frame's 1,152 samples, those the whole recording starts with."""
    whole = tmp_path / "tone.mp2"
    first = _mp2_frames(whole)[0]
    one = tmp_path / "one.mp2"
    one.write_bytes(first)
    wave, rate, start, total = decode_audio(io.BytesIO(first) if as_bytes else str(one))
    expected = decode_audio(str(whole))[0][:, :MP2_FRAME]
    assert (rate, start, total, wave.shape) == (RATE, 0, MP2_FRAME, (1, MP2_FRAME))
    assert np.abs(wave).max() > 0.2  # the tone, not silence
    np.testing.assert_allclose(wave, expected, atol=1e-3)


def _clip_with_display_matrix(path: Path, degrees: float, hflip: bool) -> None:
    """Two lossless frames of a pattern every turn and mirror of which looks different, shown by `degrees`."""
    import av

    image = np.zeros((32, 48, 3), np.uint8)
    image[:12, :12] = 255
    image[:12, -12:] = 128
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=4, options={"qp": "0"})
        stream.height, stream.width, stream.pix_fmt = 32, 48, "yuv444p"
        stream.set_display_rotation(degrees, hflip=hflip, vflip=False)
        for _ in range(2):
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


@pytest.mark.parametrize(
    "degrees, hflip, nearest, size, said",
    [
        (50, False, 90, (48, 32), (50, 90)),
        (-40, False, 0, (32, 48), (-40, 0)),
        (-140, True, -180, (32, 48), (-40, 0)),  # ffprobe's rotation of a mirror: 180 degrees less
    ],
)
def test_a_rotation_between_quarter_turns_is_rounded_to_the_nearest_and_said_once(
    tmp_path, caplog, degrees, hflip, nearest, size, said
):
    """A display matrix that is no quarter turn (ffmpeg's tools call it odd and rotate by the exact angle, cutting
    corners off) was rounded to the nearest quarter turn without a word. It still is, mirror kept, as torchcodec
    rounds it; the user is told once per angle, however many frames and clips carry it."""
    from onn.modalities.video import decode

    decode._warn_odd_rotation.cache_clear()  # a warning said earlier in this process is said once more here
    odd, exact = tmp_path / "odd.mp4", tmp_path / "exact.mp4"
    _clip_with_display_matrix(odd, degrees, hflip)
    _clip_with_display_matrix(exact, nearest, hflip)
    fit = decode.Fit(2, 3, size, "resize")
    with caplog.at_level(logging.WARNING, logger="onn"):
        shown = [decode.load(str(odd), fit)[0] for _ in range(2)]
    assert torch.equal(shown[0], decode.load(str(exact), fit)[0])
    assert [r.getMessage() for r in caplog.records if "display matrix" in r.getMessage()] == [
        f"a video's display matrix rotates it by {said[0]} degrees (ffprobe's rotation), not a quarter turn: its "
        f"frames are rotated by the nearest quarter turn, {said[1]} degrees, instead."
    ]


def _portrait_photo() -> tuple[bytes, np.ndarray]:
    """A JPEG stored 16 high and 24 wide, with EXIF orientation 6 (a phone held upright: turn it a quarter
    clockwise to show it), and the pattern as shown, [24, 16, 3]."""
    from PIL import Image

    stored = np.zeros((16, 24, 3), np.uint8)
    stored[:, :8] = (250, 20, 20)
    stored[:, 8:] = (20, 20, 250)
    stored[:4, :] = 255
    exif = Image.Exif()
    exif[0x0112] = 6
    buffer = io.BytesIO()
    Image.fromarray(stored).save(buffer, format="JPEG", quality=95, exif=exif.tobytes())
    return buffer.getvalue(), np.rot90(stored, k=-1)


def test_bench_visions_standard_pipeline_shows_a_photo_as_training_does():
    """The standard pipeline opened each image with PIL alone, ignoring EXIF orientation, which training's decoder
    applies: a portrait phone photo reached the model sideways (stretched to data.image_size) on one side of the
    benchmark and upright on the other. It decodes with training's decoder now."""
    from onn.bench.vision import _EncodedImages, _Transform
    from onn.config.data import ImageData
    from onn.modalities.image.formats.decode import decode

    data, upright = _portrait_photo()
    config = ImageData(image_size=[24, 16], resize="resize", augment=None)
    items = _EncodedImages([(data, 7)], _Transform([3, 24, 16], config, mean=[0, 0, 0], std=[1, 1, 1]))
    image, label = items[0]
    trained_on = torch.from_numpy(decode(data, 3)).permute(2, 0, 1).float() / 255
    assert label == 7 and image.shape == trained_on.shape == (3, 24, 16)
    assert torch.equal(image, trained_on)
    assert np.abs(image.permute(1, 2, 0).numpy() * 255 - upright).mean() < 8  # upright, as a viewer shows it
