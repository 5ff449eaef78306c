"""Video files -> uint8 clips [C, T, H, W]: T frames sampled uniformly in time, resized to one size.

PyAV (its wheel bundles FFmpeg: h264, h265, vp8/vp9, av1 through dav1d, mpeg4, mjpeg, prores, ffv1; mp4,
mov, avi, mkv, webm, ...) decodes; torchvision 0.26 no longer has a video reader. Frames are picked by
their presentation time, not their index, so variable frame rates sample the clip evenly: a first pass
reads the packets' timestamps and keyframes (no decoding), the frame shown at each of T evenly spaced times is
chosen, and a second pass seeks to the keyframe before each chosen frame that lies past one and decodes from
there, converting only the chosen frames (a long film decodes a few groups of pictures, not every frame; MPEG-PS,
whose frames FFmpeg mistimes after a seek, is read in one pass that converts only the chosen frames).
Rotation metadata (phones' portrait clips) is applied, 10-bit streams are converted to 8-bit RGB, and odd frame
sizes are scaled by FFmpeg's swscale. A file FFmpeg cannot open, with no video stream, or with no frame that
decodes is a `BadFile` naming why; the caller skips it and counts it against data.max_bad_fraction.
"""

from __future__ import annotations

import bisect
import contextlib
import io
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO

import numpy as np
import torch

from onn.config.data import VideoData
from onn.data.media import BadFile, decoder_complaint, nonempty
from onn.errors import UserError

# the files the video decoder reads (the sniffer and the listings go by them)
SUFFIXES = frozenset(
    {
        ".mp4",
        ".m4v",
        ".mov",
        ".avi",
        ".mkv",
        ".webm",
        ".mpg",
        ".mpeg",
        ".ts",
        ".mts",
        ".m2ts",
        ".wmv",
        ".flv",
        ".3gp",
        ".ogv",
        ".mxf",
        ".y4m",
    }
)

RESIZE_MODES = ("resize", "center_crop")


@dataclass(frozen=True)
class Fit:
    """How every clip is brought to one shape."""

    frames: int  # frames stored per clip (data.decode_frames, or data.frames)
    channels: int  # 3: RGB, 1: grey
    size: tuple[int, int]  # (H, W)
    resize: str  # resize (stretch) | center_crop (short side, then the centre)


def fit_settings(data_cfg: VideoData) -> Fit:
    """The data config's decoding settings, checked: a value that makes no sense is one error naming its key."""
    frames, stored = data_cfg.frames, data_cfg.decode_frames
    stored = frames if stored is None else stored
    for key, value in (("frames", frames), ("decode_frames", stored)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1024:
            raise UserError(
                f"data.{key}={value!r}: give the number of frames to sample from each clip, "
                "a whole number from 1 to 1024."
            )
    if stored < frames:
        raise UserError(
            f"data.decode_frames={stored} is fewer than data.frames={frames}; "
            "store at least the frames the model sees (or null)."
        )
    channels = data_cfg.channels
    if channels not in (1, 3) or isinstance(channels, bool):
        raise UserError(f"data.channels={channels!r}: use 3 (RGB) or 1 (grey).")
    size = data_cfg.image_size
    sizes = list(size or [])
    if len(sizes) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and 8 <= v <= 4096 for v in sizes):
        raise UserError(
            f"data.image_size={size!r}: give [height, width] in pixels, each 8 to 4096 (every frame is resized to it)."
        )
    if data_cfg.resize not in RESIZE_MODES:
        raise UserError(f"data.resize={data_cfg.resize!r}: use resize (stretch) or center_crop.")
    return Fit(stored, channels, (sizes[0], sizes[1]), data_cfg.resize)


def _open(source: str | bytes):
    import av

    return av.open(source if isinstance(source, str) else io.BytesIO(source))


def decode_video(source: str | IO[bytes], fit: Fit) -> tuple[torch.Tensor, float]:
    """(uint8 [C, T, H, W], the clip's duration in seconds) of a file path or a binary file object."""
    source = nonempty(source)
    try:
        timing = _timestamps(source)
        if timing is not None:
            frames, duration = _decode_chosen(source, timing, fit)
        else:
            frames, duration = _decode_all(source, fit)
    except BadFile:
        raise
    except Exception as e:  # PyAV raises FFmpegError subclasses (InvalidDataError, ...), and OSError/ValueError
        raise BadFile(f"not a decodable video ({decoder_complaint(e)})") from e
    clip = np.stack(frames)  # [T, H, W, C]
    return torch.from_numpy(np.ascontiguousarray(clip.transpose(3, 0, 1, 2))), duration


def _stream(container):
    if not container.streams.video:
        raise BadFile("no video stream" + (" (an audio-only file)" if container.streams.audio else ""))
    stream = container.streams.video[0]
    stream.thread_type = "AUTO"
    return stream


@dataclass(frozen=True)
class Timing:
    """A stream's frame times from its packets (seconds, sorted), those of its keyframes (where a seek lands), and
    each keyframe's seek timestamps in stream units: its pts, then its dts where that differs. Matroska indexes
    keyframes by pts; MPEG-TS/PS have no index, and FFmpeg's binary search there lands on the packet of the dts
    asked for, so with B-frames only the dts lands on the keyframe itself."""

    times: list[float]
    keyframes: list[float]
    seek_at: dict[float, tuple[int, ...]]
    seekable: bool = True  # False for MPEG-PS: see UNSEEKABLE


# Demuxers whose seeks cannot be trusted. MPEG-PS (.mpg, .mpeg, .vob) packs several frames into one PES packet and
# FFmpeg's parser times the frames between PES timestamps by interpolation; after a seek it interpolates at the wrong
# rate (half a frame apart), so no frame decoded after a seek is reliably the one wanted. These are read in one pass
# instead, converting only the chosen frames.
UNSEEKABLE = frozenset({"mpeg"})


def _timestamps(source: str | bytes) -> Timing | None:
    """Every shown frame's presentation time from the packets, without decoding; None when the container does not
    give every packet one (then frames are timed as they decode). A packet an edit list cuts (a clip trimmed without
    re-encoding starts between keyframes) is decoded for the frames after it but never shown, so it is no frame."""
    with _open(source) as container:
        stream = _stream(container)
        base = stream.time_base
        times, seek_at = [], {}
        for packet in container.demux(stream):
            if packet.size == 0 or packet.is_discard:
                continue  # the flush packet at the end, or a frame the edit list cuts
            if packet.pts is None or base is None:
                return None
            times.append(float(packet.pts * base))
            if packet.is_keyframe:
                seek_at[times[-1]] = tuple(dict.fromkeys(t for t in (packet.pts, packet.dts) if t is not None))
        seekable = container.format.name not in UNSEEKABLE
    if not times:
        raise BadFile("a video stream with no frames")
    return Timing(sorted(set(times)), sorted(seek_at), seek_at, seekable)


def pick(times: list[float], count: int) -> list[int]:
    """The index of the frame shown at each of `count` evenly spaced times from the first frame to the last."""
    t = np.asarray(times)
    targets = np.linspace(t[0], t[-1], count)
    return np.clip(np.searchsorted(t, targets + 1e-9, side="right") - 1, 0, len(t) - 1).tolist()


def _decode_chosen(source: str | bytes, timing: Timing, fit: Fit) -> tuple[list[np.ndarray], float]:
    times = timing.times
    chosen = pick(times, fit.frames)
    wanted = sorted({round(times[i], 6) for i in chosen})
    with _open(source) as container:
        stream = _stream(container)
        got = _seek_and_decode(container, stream, wanted, timing, fit) if timing.seekable else None
        rate = float(stream.average_rate or stream.guessed_rate or 25)
    if got is None:  # a seek that missed (or no seeking): one pass from the start, converting the chosen frames only
        got = {}
        with _open(source) as container, contextlib.suppress(Exception):  # damage: _decode_all keeps what decodes
            _decode_to(decoded_frames(container, _stream(container)), wanted[-1], wanted, got, fit, sought=False)
    if len(got) < len(wanted):  # a damaged stream: frames its packets promised did not decode
        return _decode_all(source, fit)
    # the clip lasts to the end of its last frame: one frame is shown for a frame's time at the stream's rate
    step = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 1 / rate
    return [got[round(times[i], 6)] for i in chosen], times[-1] - times[0] + step


def _seek_and_decode(
    container, stream, wanted: list[float], timing: Timing, fit: Fit
) -> dict[float, np.ndarray] | None:
    """The frames shown at the `wanted` times (sorted), converted, or None when one cannot be reached. A keyframe
    between the frame last decoded and the next one wanted is sought to rather than decoded up to: 16 frames of a
    long film decode a few groups of pictures each, not the whole film. A seek tries the keyframe's pts, then its
    dts (the one that worked is tried first from then on); where neither reaches the frame the caller decodes
    every frame instead."""
    got: dict[float, np.ndarray] = {}
    frames, position, dts_first = None, -np.inf, False  # the decoding iterator, the time of its last frame
    for target in wanted:
        if target in got:
            continue
        key = _keyframe_before(timing.keyframes, target)
        if key is None or key <= max(position, timing.times[0]):  # decoding on (or from the start) reaches it
            frames = frames or decoded_frames(container, stream)
            position = _decode_to(frames, target, wanted, got, fit, sought=False)
        else:
            tries = timing.seek_at[key]
            for offset in reversed(tries) if dts_first else tries:
                container.seek(offset, stream=stream)  # lands on a keyframe at or before it, where the index is right
                frames = decoded_frames(container, stream)
                position = _decode_to(frames, target, wanted, got, fit, sought=True)
                if target in got:
                    dts_first = offset == tries[-1] != tries[0]
                    break
        if target not in got:
            return None
    return got


def _decode_to(frames: Iterator, target: float, wanted: list[float], got: dict, fit: Fit, sought: bool) -> float:
    """Decodes on to the frame shown at `target`, converting the wanted ones on the way into `got`; the time of the
    last frame decoded. After a seek a frame counts only once a keyframe at or before the target has decoded: the
    frames before it are the leading pictures of an open group of pictures or a seek that landed between
    keyframes (MPEG-TS), decoded from references the decoder never saw (garbage under the right timestamp)."""
    trusted, position = not sought, -np.inf
    for frame in frames:
        if frame.pts is None:
            break
        position = round(float(frame.time), 6)
        trusted = trusted or (frame.key_frame and position <= target + 1e-6)
        if trusted and position in wanted and position not in got:
            got[position] = convert(frame, fit)
        if position >= target:
            break
    return position


def _keyframe_before(keyframes: list[float], target: float) -> float | None:
    """The last keyframe at or before `target` (None when the packets marked none)."""
    index = bisect.bisect_right(keyframes, target + 1e-6) - 1
    return keyframes[index] if index >= 0 else None


def decoded_frames(container, stream) -> Iterator:
    """The stream's frames from the container's position (a test counts them: the point of seeking is fewer)."""
    return container.decode(stream)


def _decode_all(source: str | bytes, fit: Fit) -> tuple[list[np.ndarray], float]:
    """The chosen frames of a stream timed only as it decodes (packets without timestamps, or damage): a first
    pass decodes every frame for its time (its own timestamp, or its index at the stream's rate) and keeps none, a
    second converts only the chosen ones. Twice the decoding, but a long clip is never held whole in memory."""
    times, rate = _decoded_times(source)
    order = np.argsort(times, kind="stable")  # decode order -> presentation order
    ordered = [times[i] for i in order]
    chosen = [int(order[i]) for i in pick(ordered, fit.frames)]  # decode-order indices, in presentation order
    wanted, got = set(chosen), {}
    with _open(source) as container, contextlib.suppress(Exception):  # damage: the first pass stopped there too
        for i, frame in enumerate(decoded_frames(container, _stream(container))):
            if i in wanted:
                got[i] = convert(frame, fit)
            if len(got) == len(wanted):
                break
    if len(got) < len(wanted):
        raise BadFile("a video stream that decodes differently twice (frames the first pass read did not decode)")
    return [got[i] for i in chosen], ordered[-1] - ordered[0] + 1 / rate


def _decoded_times(source: str | bytes) -> tuple[list[float], float]:
    """Every frame's time in decode order (a truncated stream: those before the damage), and the stream's rate."""
    times = []
    with _open(source) as container:
        stream = _stream(container)
        rate = float(stream.average_rate or stream.guessed_rate or 25)
        try:
            for i, frame in enumerate(decoded_frames(container, stream)):
                times.append(float(frame.time) if frame.time is not None else i / rate)
        except Exception:  # a truncated stream: keep the frames before the damage
            if not times:
                raise
    if not times:
        raise BadFile("a video stream with no frame that decodes")
    return times, rate


def convert(frame, fit: Fit) -> np.ndarray:
    """One decoded frame as uint8 [H, W, C] upright (rotation metadata applied) at fit.size."""
    quarter = round((frame.rotation or 0) / 90) % 4  # counter-clockwise quarter turns that make it upright
    height, width = fit.size
    shown_w, shown_h = (frame.height, frame.width) if quarter % 2 else (frame.width, frame.height)
    if fit.resize == "center_crop":
        scale = max(height / shown_h, width / shown_w)
        out_w, out_h = max(width, round(shown_w * scale)), max(height, round(shown_h * scale))
    else:
        out_w, out_h = width, height
    if quarter % 2:  # scale in the stored orientation, then turn
        out_w, out_h = out_h, out_w
    array = frame.to_ndarray(format="rgb24" if fit.channels == 3 else "gray", width=out_w, height=out_h)
    if array.ndim == 2:
        array = array[:, :, None]
    if quarter:
        array = np.rot90(array, k=quarter)
    h, w = array.shape[:2]
    top, left = (h - height) // 2, (w - width) // 2
    return np.ascontiguousarray(array[top : top + height, left : left + width])


def load(source: str | IO[bytes], fit: Fit) -> tuple[torch.Tensor, float]:
    """One file decoded to its stored clip, and its duration in seconds (for throughput figures)."""
    return decode_video(source, fit)
