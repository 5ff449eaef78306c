"""The small datasets bench_chaos's tracks train on, written once under the bench's folder: each kind gives
the data.* overrides that point a run at it. Built-in sources (builtin:math, builtin:motion,
builtin:primitives) need none."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from onn.errors import UserError


def generate(kind: str | None, root: Path, seed: int) -> list[str]:
    """Write the `kind` dataset under root (once) and return the overrides that use it."""
    if kind is None:
        return []
    if kind not in WRITERS:
        raise UserError(f"task.tracks.*.data={kind!r} is not one of {', '.join(WRITERS)} (or null).")
    folder = root / kind
    source = folder / "sums.jsonl" if kind == "jsonl" else folder
    if not (folder / ".complete").is_file():
        WRITERS[kind](folder, np.random.default_rng(seed))
        (folder / ".complete").write_text("")
    return [f"data.source={source}"]


def _images(folder: Path, rng: np.random.Generator) -> None:
    """Two classes of 16x16 pictures a small CNN tells apart: dark and bright, with noise."""
    from PIL import Image

    for split, count in (("train", 48), ("val", 16)):
        for name, level in (("dark", 60), ("bright", 190)):
            (folder / split / name).mkdir(parents=True, exist_ok=True)
            for i in range(count):
                pixels = np.clip(level + rng.normal(0, 40, (16, 16, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / split / name / f"{i}.png")


def _audio(folder: Path, rng: np.random.Generator) -> None:
    """Two classes of short tones, low and high, at 8 kHz."""
    import soundfile as sf

    for name, freq in (("low", 300.0), ("high", 1500.0)):
        (folder / name).mkdir(parents=True, exist_ok=True)
        for i in range(24):
            t = np.arange(2400) / 8000
            wave = 0.4 * np.sin(2 * np.pi * freq * t + rng.uniform(0, 6)) + 0.02 * rng.standard_normal(len(t))
            sf.write(folder / name / f"{i}.wav", wave.astype(np.float32), 8000)


def _jsonl(folder: Path, rng: np.random.Generator) -> None:
    """Question/answer records of small sums, as JSON lines (a streamed text dataset)."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "sums.jsonl", "w") as f:
        for _ in range(600):
            a, b = (int(x) for x in rng.integers(0, 50, 2))
            f.write(json.dumps({"question": f"{a}+{b}=", "answer": str(a + b)}) + "\n")


def _pairs(folder: Path, rng: np.random.Generator) -> None:
    """Captioned shape pictures (onn/modalities/pairs/demo.py)."""
    from onn.modalities.pairs.demo import write_shapes

    write_shapes(folder, 96, seed=int(rng.integers(0, 2**31)), size=16)


# what task.tracks.NAME.data may name (bench_chaos checks every track's before its first run)
WRITERS = {"images": _images, "audio": _audio, "jsonl": _jsonl, "pairs": _pairs}
