"""Generated shapes: trimesh.creation's primitives at random sizes and rotations, six classes.

`data.source=builtin:primitives` samples them straight into point sets (train, and held-out test
shapes drawn from another seed); `write_primitives` writes them as files (OBJ, PLY, STL, OFF, GLB in
turn) in class folders, for tests and demos:

    python -m onn.modalities.mesh.primitives OUT_FOLDER [PER_CLASS]
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from onn.config.data import MeshBuiltin
from onn.data.resident import Decoded
from onn.errors import UserError
from onn.modalities.mesh.read import Sampling, sample_points

CLASSES = ("box", "capsule", "cone", "cylinder", "sphere", "torus")
BUILTIN = "builtin:primitives"
FILE_TYPES = ("obj", "ply", "stl", "off", "glb")
TEST_SEED_OFFSET = 1_000_003  # held-out shapes come from another stream than the training shapes


def rotation(rng: np.random.Generator) -> np.ndarray:
    """A uniformly random 3D rotation (a normalised Gaussian quaternion) as a 4x4 transform."""
    w, x, y, z = (q := rng.normal(size=4)) / np.linalg.norm(q)
    matrix = np.eye(4)
    matrix[:3, :3] = [
        [1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)],
        [2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)],
        [2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)],
    ]
    return matrix


def primitive(kind: str, rng: np.random.Generator):
    """One trimesh.Trimesh of `kind` with random proportions and a random rotation."""
    from trimesh import creation

    if kind == "box":
        mesh = creation.box(extents=rng.uniform(0.4, 1.6, 3))
    elif kind == "sphere":
        mesh = creation.icosphere(subdivisions=3, radius=rng.uniform(0.5, 1.5))
    elif kind == "cylinder":
        mesh = creation.cylinder(radius=rng.uniform(0.3, 1.0), height=rng.uniform(0.6, 2.0))
    elif kind == "cone":
        mesh = creation.cone(radius=rng.uniform(0.4, 1.0), height=rng.uniform(0.6, 2.0))
    elif kind == "capsule":
        radius = rng.uniform(0.3, 0.8)
        mesh = creation.capsule(height=radius * rng.uniform(1.0, 2.5), radius=radius)
    elif kind == "torus":
        major = rng.uniform(0.8, 1.2)
        mesh = creation.torus(major_radius=major, minor_radius=major * rng.uniform(0.15, 0.45))
    else:
        raise ValueError(f"no primitive {kind!r}; one of {', '.join(CLASSES)}")
    mesh.apply_transform(rotation(rng))
    return mesh


def shapes(per_class: int, seed: int) -> list[tuple[str, Any]]:
    """(name, mesh) for per_class shapes of every class, interleaved, all from one seeded stream."""
    rng = np.random.default_rng(seed)
    return [(f"{kind}/{i:04d}", primitive(kind, rng)) for i in range(per_class) for kind in CLASSES]


def builtin_splits(builtin: MeshBuiltin, settings: Sampling, seed: int) -> dict[str, Decoded]:
    """{train, test}: data.builtin.per_class training shapes and test_per_class held-out ones, sampled."""
    splits = {}
    for split, count, stream in (
        ("train", builtin.per_class, seed),
        ("test", builtin.test_per_class, seed + TEST_SEED_OFFSET),
    ):
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            key = "per_class" if split == "train" else "test_per_class"
            raise UserError(f"data.builtin.{key}={count!r}: give the number of shapes of each class, 1 or more.")
        made = shapes(count, stream)
        points = np.stack([sample_points(m.vertices, m.faces, settings, f"{split}/{n}") for n, m in made])
        labels = [CLASSES.index(n.split("/")[0]) for n, _ in made]
        splits[split] = Decoded(
            torch.from_numpy(points),
            torch.tensor(labels, dtype=torch.long),
            list(CLASSES),
            [f"{split}/{n}" for n, _ in made],
        )
    return splits


def write_primitives(
    folder: str | Path, per_class: int, seed: int = 0, file_types: tuple[str, ...] = FILE_TYPES
) -> Path:
    """per_class shapes of each class written as CLASS/NNNN.EXT under folder, the file types in turn."""
    folder = Path(folder)
    for i, (name, mesh) in enumerate(shapes(per_class, seed)):
        file_type = file_types[i % len(file_types)]
        path = folder / f"{name}.{file_type}"
        path.parent.mkdir(parents=True, exist_ok=True)
        mesh.export(str(path), file_type=file_type)
    return folder


if __name__ == "__main__":
    usage = (
        "usage: python -m onn.modalities.mesh.primitives OUT_FOLDER [PER_CLASS] (PER_CLASS: a whole number, 1 or more)"
    )
    if len(sys.argv) not in (2, 3) or (len(sys.argv) == 3 and not (sys.argv[2].isdigit() and int(sys.argv[2]) > 0)):
        sys.exit(usage)
    out = write_primitives(sys.argv[1], int(sys.argv[2]) if len(sys.argv) == 3 else 20)
    print(f"wrote {len(CLASSES)} classes of primitives to {out}")
