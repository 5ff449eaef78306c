"""Video files -> uint8 clips [C, T, H, W]: T frames sampled uniformly in time, resized to one size.

PyAV (its wheel bundles FFmpeg: h264, h265, vp8/vp9, av1 through dav1d, mpeg4, mjpeg, prores, ffv1; mp4,
mov, avi, mkv, webm, ...) decodes; torchvision 0.26 no longer has a video reader. Frames are picked by
their presentation time, not their index, so variable frame rates sample the clip evenly: a first pass
reads the packets' timestamps and keyframes (no decoding), the frame shown at each of T evenly spaced times is
chosen, and a second pass seeks to the keyframe before each chosen frame that lies past one and decodes from
there, converting only the chosen frames (a long film decodes a few groups of pictures, not every frame; MPEG-PS,
whose frames FFmpeg mistimes after a seek, is read in one pass that converts only the chosen frames).
The display matrix is applied as FFmpeg's own tools apply it (phones' portrait clips turned upright, a mirrored clip
flipped; a rotation that is not a quarter turn is rounded to the nearest one, with a warning), 10-bit streams are
converted to 8-bit RGB, and odd frame sizes are scaled by FFmpeg's swscale (center_crop by the picture's shape as
shown: anamorphic pixels are not square). A clip of fewer frames than asked repeats frames (each time takes the
frame shown then). A file FFmpeg cannot open, with no video stream (cover art is none), or with no frame that decodes
is a `BadFile` naming why; the caller skips it and counts it against data.max_bad_fraction.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import io
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO

import numpy as np
import torch

from onn.config.data import VideoData
from onn.data.media import BadFile, decoder_complaint, nonempty
from onn.errors import UserError

log = logging.getLogger("onn")

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


# MPEG transport stream packet sizes (188; M2TS/AVCHD's 192, a 4-byte time code first; 204, with error correction)
TS_PACKETS = ((188, 0), (192, 4), (204, 0))
TS_SYNC = 0x47


def _open(source: str | bytes):
    """The container. FFmpeg's probe scores an MPEG-TS by how many packets in a row start with its sync byte, so a
    clip of a few packets (a second of small video) scored too low and did not open: one whose packets all start
    with it is opened as MPEG-TS."""
    import av

    def opened(**how):
        return av.open(source if isinstance(source, str) else io.BytesIO(source), **how)

    try:
        return opened()
    except av.FFmpegError:
        if not transport_stream(_head(source)):
            raise
        return opened(format="mpegts")


def _head(source: str | bytes, count: int = 4096) -> bytes:
    if isinstance(source, bytes):
        return source[:count]
    with open(source, "rb") as f:
        return f.read(count)


def transport_stream(head: bytes) -> bool:
    """Whether `head` is MPEG-TS: at least two whole packets of one of TS_PACKETS, each starting with the sync byte."""
    for size, offset in TS_PACKETS:
        starts = range(offset, len(head) - size + 1, size)
        if len(starts) >= 2 and all(head[i] == TS_SYNC for i in starts):
            return True
    return False


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
    """The first video stream that is footage. Cover art (an attached picture: a song's album cover, the thumbnail
    an mp4 or mkv carries) is a video stream of one still to FFmpeg, never the clip: a file with nothing else has
    no video stream."""
    from av.stream import Disposition

    footage = [s for s in container.streams.video if not s.disposition & Disposition.attached_pic]
    if not footage:
        cover = " with cover art" if container.streams.video else ""
        if container.streams.audio:
            raise BadFile(f"no video stream (an audio-only file{cover})")
        raise BadFile("no video stream" + (" (only a cover picture)" if cover else ""))
    stream = footage[0]
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
    re-encoding starts between keyframes) is decoded for the frames after it but never shown, so it is no frame.
    Nor is one shown before the first keyframe: a transport or program stream cut mid-GOP (a broadcast capture)
    opens with frames whose references were cut off, which decode to garbage or not at all."""
    with _open(source) as container:
        stream = _stream(container)
        base = stream.time_base
        times, seek_at, first_key = [], {}, None
        for packet in container.demux(stream):
            if packet.size == 0:
                continue  # the flush packet at the end
            if packet.pts is None or base is None:
                return None
            if packet.is_keyframe and first_key is None:
                first_key = float(packet.pts * base)
            if packet.is_discard:
                continue  # a frame the edit list cuts
            times.append(float(packet.pts * base))
            if packet.is_keyframe:
                seek_at[times[-1]] = tuple(dict.fromkeys(t for t in (packet.pts, packet.dts) if t is not None))
        seekable = container.format.name not in UNSEEKABLE
    shown = sorted({t for t in times if first_key is None or t >= first_key})
    if not shown:
        raise BadFile("a video stream with no frames")
    return Timing(shown, sorted(seek_at), seek_at, seekable)


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
        shape = Shape(fit, pixel_aspect(stream))
        got = _seek_and_decode(container, stream, wanted, timing, shape) if timing.seekable else None
        rate = float(stream.average_rate or stream.guessed_rate or 25)
    if got is None:  # a seek that missed (or no seeking): one pass from the start, converting the chosen frames only
        got = {}
        with _open(source) as container, contextlib.suppress(Exception):  # damage: _decode_all keeps what decodes
            _decode_to(decoded_frames(container, _stream(container)), wanted[-1], wanted, got, shape, sought=False)
    if len(got) < len(wanted):  # a damaged stream: frames its packets promised did not decode
        return _decode_all(source, fit)
    # the clip lasts to the end of its last frame: one frame is shown for a frame's time at the stream's rate
    step = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 1 / rate
    return [got[round(times[i], 6)] for i in chosen], times[-1] - times[0] + step


def _seek_and_decode(
    container, stream, wanted: list[float], timing: Timing, shape: Shape
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
            position = _decode_to(frames, target, wanted, got, shape, sought=False)
        else:
            tries = timing.seek_at[key]
            for offset in reversed(tries) if dts_first else tries:
                container.seek(offset, stream=stream)  # lands on a keyframe at or before it, where the index is right
                frames = decoded_frames(container, stream)
                position = _decode_to(frames, target, wanted, got, shape, sought=True)
                if target in got:
                    dts_first = offset == tries[-1] != tries[0]
                    break
        if target not in got:
            return None
    return got


def _decode_to(frames: Iterator, target: float, wanted: list[float], got: dict, shape: Shape, sought: bool) -> float:
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
            got[position] = convert(frame, shape)
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
        stream = _stream(container)
        for i, frame in enumerate(decoded_frames(container, stream)):
            if i in wanted:
                got[i] = convert(frame, Shape(fit, pixel_aspect(stream)))
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


@dataclass(frozen=True)
class Shape:
    """What a frame is converted to (fit) and the shape of its stream's pixels (width / height)."""

    fit: Fit
    pixel_aspect: float


# pixel aspects past these are a damaged header, not a picture (anamorphic formats stay within 1/2 and 2)
PIXEL_ASPECTS = (1 / 8, 8)


def pixel_aspect(stream) -> float:
    """The width of the stream's pixels over their height, as FFmpeg guesses it: 1 but for anamorphic video (DVD,
    HDV and broadcast store a 16:9 picture in 720x576 or 1440x1080 wide pixels); 1 where the stream does not say,
    or says something past PIXEL_ASPECTS."""
    aspect = stream.sample_aspect_ratio or stream.codec_context.sample_aspect_ratio
    low, high = PIXEL_ASPECTS
    return float(aspect) if aspect and low <= aspect <= high else 1.0


def convert(frame, fit: Fit | Shape) -> np.ndarray:
    """One decoded frame as uint8 [H, W, C] upright (its display matrix applied) at fit.size. Given a Shape, its
    pixels' aspect too: center_crop keeps the picture's shape as shown, not as stored (a Fit: square pixels)."""
    fit, aspect = (fit.fit, fit.pixel_aspect) if isinstance(fit, Shape) else (fit, 1.0)
    matrix = _display_matrix(frame)
    turned = matrix is not None and _quarter_turns(matrix) % 2 == 1  # shown with its width and height swapped
    height, width = fit.size
    stored_w = frame.width * aspect  # the stored width, in pixels as tall as they are wide
    shown_w, shown_h = (frame.height, stored_w) if turned else (stored_w, frame.height)
    if fit.resize == "center_crop":
        scale = max(height / shown_h, width / shown_w)
        out_w, out_h = max(width, round(shown_w * scale)), max(height, round(shown_h * scale))
    else:
        out_w, out_h = width, height
    if turned:  # scale in the stored orientation, then turn
        out_w, out_h = out_h, out_w
    array = frame.to_ndarray(format="rgb24" if fit.channels == 3 else "gray", width=out_w, height=out_h)
    if array.ndim == 2:
        array = array[:, :, None]
    if matrix is not None:
        array = _upright(array, matrix)
    h, w = array.shape[:2]
    top, left = (h - height) // 2, (w - width) // 2
    return np.ascontiguousarray(array[top : top + height, left : left + width])


def _display_matrix(frame) -> np.ndarray | None:
    """The frame's display matrix (FFmpeg's 3x3, row by row, 16.16 fixed point), or None when it has none or one
    that shows nothing (a zero scale)."""
    try:
        side = frame.side_data.get("DISPLAYMATRIX")
    except ValueError:  # side data of a kind newer than PyAV's list of them: the rotation alone, without mirroring
        turn = np.radians(-frame.rotation)
        return np.array([np.cos(turn), np.sin(turn), 0, -np.sin(turn), np.cos(turn), 0, 0, 0, 1]) if turn else None
    if side is None:
        return None
    matrix = np.frombuffer(bytes(side), np.int32)[:9].astype(np.float64)
    return matrix if np.hypot(matrix[0], matrix[3]) > 0 and np.hypot(matrix[1], matrix[4]) > 0 else None


# FFmpeg's tools call a rotation further than this from a quarter turn odd (fftools' get_rotation warns)
ODD_ROTATION_DEGREES = 2.0


def _quarter_turns(matrix: np.ndarray) -> int:
    """The matrix's rotation in clockwise quarter turns, 0 to 3: FFmpeg's get_rotation (fftools) rounded to the
    nearest quarter, as torchcodec rounds it (phones write exact ones; a tie, 45 degrees, keeps the stored width
    and height). A mirror is kept as it is (_upright). A rotation further than ODD_ROTATION_DEGREES from a quarter
    is rounded too, with a warning once per angle: ffmpeg/ffplay rotate such a picture by the exact angle into a
    frame of the stored size, cutting its corners off and filling black, which no clip should learn from."""
    a, b, c, d = matrix[[0, 1, 3, 4]]
    theta = float(np.degrees(np.arctan2(b / np.hypot(b, d), a / np.hypot(a, c))))
    turns = round(theta / 90)
    if abs(theta - 90 * turns) > ODD_ROTATION_DEGREES:
        _warn_odd_rotation(-round(theta), -90 * turns)
    return turns % 4


@functools.cache
def _warn_odd_rotation(degrees: int, shown: int) -> None:
    """Said once per angle (and process): a dataset filmed on one odd rig would say it for every frame."""
    log.warning(
        "a video's display matrix rotates it by %d degrees (ffprobe's rotation), not a quarter turn: its frames are "
        "rotated by the nearest quarter turn, %d degrees, instead.",
        degrees,
        shown,
    )


def _upright(array: np.ndarray, matrix: np.ndarray) -> np.ndarray:
    """[H, W, C] shown as FFmpeg's own tools show it (fftools' autorotate): a quarter turn, or a transpose where the
    matrix also mirrors; a mirror left-right or upside down (a front camera, `ffmpeg -display_hflip`) is a flip, not
    a half turn. frame.rotation alone, which a mirror turns into +-180 degrees, showed those upside down."""
    quarter, mirrored_turn, flips_x, flips_y = _quarter_turns(matrix), matrix[3], matrix[0] < 0, matrix[4] < 0
    if quarter == 1:  # 90 clockwise: transpose=clock, or cclock_flip (a plain transpose) when mirrored
        return array.transpose(1, 0, 2) if mirrored_turn > 0 else np.rot90(array, k=-1)
    if quarter == 3:  # 270 clockwise: transpose=cclock, or clock_flip (the anti-transpose) when mirrored
        return array[::-1, ::-1].transpose(1, 0, 2) if mirrored_turn < 0 else np.rot90(array, k=1)
    if quarter == 2 and flips_x:
        array = array[:, ::-1]
    return array[::-1] if flips_y else array


def load(source: str | IO[bytes], fit: Fit) -> tuple[torch.Tensor, float]:
    """One file decoded to its stored clip, and its duration in seconds (for throughput figures)."""
    return decode_video(source, fit)
