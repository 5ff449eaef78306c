"""`data.source=builtin:motion`: a generated clip dataset, written as real video files and read back like any folder.

Each clip is a coloured square moving across a noisy background; the class is its direction (left, right,
up, down). Start, size, speed and colours are random, so only the motion tells the classes apart (a single
frame cannot). The clips are encoded with PyAV (data.motion.codec, libx264 by default) into
train/CLASS/NNN.mp4 and test/CLASS/NNN.mp4 under paths.cache, once per setting, and then decoded through
the same path as a user's folder of clips; the test clips come from another seed than the training ones.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np

from onn.config import as_dict
from onn.config.data import VideoData, VideoMotion
from onn.errors import UserError

DIRECTIONS = {"left": (0, -1), "right": (0, 1), "up": (-1, 0), "down": (1, 0)}


def generated(source: str, data_cfg: VideoData, cache_dir: str | os.PathLike) -> Path:
    """The folder of generated clips for `source` (builtin:motion), made on first use."""
    name = source.split(":", 1)[1]
    if name != "motion":
        raise UserError(f"data.source={source}: the built-in video dataset is builtin:motion.")
    motion = data_cfg.motion
    counts = {
        "train_per_class": motion.train_per_class,
        "test_per_class": motion.test_per_class,
        "frames": motion.frames,
        "size": motion.size,
        "fps": motion.fps,
    }
    for key, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 2:
            raise UserError(f"data.motion.{key}={value!r}: give a whole number of 2 or more.")
    digest = hashlib.sha256(json.dumps(as_dict(motion), sort_keys=True).encode()).hexdigest()[:12]
    folder = Path(cache_dir) / "builtin" / f"motion-{digest}"
    if (folder / ".done").is_file():
        return folder
    import av

    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _write_clips(tmp, motion)
    except (ValueError, av.FFmpegError) as e:  # UnknownCodecError; ExternalError for a size the encoder refuses
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(
            f"data.motion.codec={motion.codec} could not encode {motion.size}x{motion.size} clips ({e}); give an "
            "encoder PyAV has (libx264, mpeg4, libvpx-vp9, ...) and an even data.motion.size (H.264 and the "
            "others store colour at half resolution)."
        ) from None
    (tmp / ".done").write_text("")
    try:
        tmp.rename(folder)
    except OSError:  # another process (a rank of the same run) put its clips there first: the same clips
        shutil.rmtree(tmp, ignore_errors=True)
        if not (folder / ".done").is_file():
            raise UserError(
                f"the cache folder {folder} holds no .done (ONN did not finish writing it); remove it and run again."
            ) from None
    return folder


def _write_clips(folder: Path, motion: VideoMotion) -> None:
    """The train and test clips of every direction, as files under folder/SPLIT/DIRECTION/."""
    for split, count, seed in (
        ("train", motion.train_per_class, motion.seed),
        ("test", motion.test_per_class, motion.seed + 1_000_003),
    ):
        rng = np.random.default_rng(seed)
        for label in DIRECTIONS:
            (folder / split / label).mkdir(parents=True)
            for i in range(count):
                clip = moving_square(rng, label, motion.frames, motion.size)
                write_clip(folder / split / label / f"{i:03d}.mp4", clip, motion.fps, motion.codec)


def moving_square(rng: np.random.Generator, direction: str, frames: int, size: int) -> np.ndarray:
    """uint8 [frames, size, size, 3]: a square moving `direction` at a random speed over noise."""
    dy, dx = DIRECTIONS[direction]
    side = int(rng.integers(size // 6, size // 3 + 1))
    speed = float(rng.uniform(0.5, 1.0)) * (size - side) / (frames - 1)  # crosses half to all of the frame
    travel = speed * (frames - 1)
    lo, hi = 0, size - side
    start = [
        float(rng.uniform(lo, hi)),
        float(rng.uniform(lo, hi)),
    ]  # the moving axis starts where it can travel
    for axis, step in ((0, dy), (1, dx)):
        if step > 0:
            start[axis] = float(rng.uniform(lo, hi - travel))
        elif step < 0:
            start[axis] = float(rng.uniform(lo + travel, hi))
    background = rng.integers(0, 90, (3,))
    colour = rng.integers(150, 256, (3,))
    out = np.empty((frames, size, size, 3), np.uint8)
    for t in range(frames):
        frame = background + rng.normal(0, 12, (size, size, 3))
        y, x = round(start[0] + dy * speed * t), round(start[1] + dx * speed * t)
        frame[y : y + side, x : x + side] = colour
        out[t] = frame.clip(0, 255)
    return out


def write_clip(
    path: Path,
    frames: np.ndarray,
    fps: int,
    codec: str = "libx264",
    pix_fmt: str = "yuv420p",
    **stream_options,
) -> None:
    """Encode uint8 [T, H, W, 3] frames into a video file with PyAV (tests make their fixtures with it too)."""
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.height, stream.width = frames.shape[1], frames.shape[2]
        stream.pix_fmt = pix_fmt
        for key, value in stream_options.items():
            setattr(stream, key, value)
        for array in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(array), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
