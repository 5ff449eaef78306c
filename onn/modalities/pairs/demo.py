"""Generated paired folders, for tests and for trying data=auto on something at once:

    python -m onn.modalities.pairs.demo shapes OUT [COUNT]      # NNNN.png + NNNN.txt: "a red circle on the left"
    python -m onn.modalities.pairs.demo primitives OUT [COUNT]  # NNNN.obj/.ply/... + NNNN.png: the shape, drawn

`shapes`: pictures of a coloured shape (circle, square, triangle) at one of four places on a noisy
background, each with the sentence that says what and where it is. `primitives`: trimesh.creation's
primitives at random proportions and rotations (onn/modalities/mesh/primitives.py), each with a
picture of its surface points seen from a fixed viewpoint (onn/modalities/mesh/render.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

COLOURS = {"red": (220, 40, 40), "green": (40, 190, 60), "blue": (50, 70, 230), "yellow": (230, 210, 40)}
SHAPES = ("circle", "square", "triangle")
PLACES = {
    "on the left": (0.3, 0.5),
    "on the right": (0.7, 0.5),
    "at the top": (0.5, 0.3),
    "at the bottom": (0.5, 0.7),
}


def shape_picture(colour: str, shape: str, place: str, size: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [size, size, 3]: the shape filled with its colour at its place, on grey noise."""
    image = rng.integers(90, 150, (size, size, 3)).astype(np.float64)
    cx, cy = (np.array(PLACES[place]) + rng.uniform(-0.05, 0.05, 2)) * size
    r = size * rng.uniform(0.16, 0.22)
    yy, xx = np.mgrid[0:size, 0:size] + 0.5
    if shape == "circle":
        inside = (xx - cx) ** 2 + (yy - cy) ** 2 <= r * r
    elif shape == "square":
        inside = (abs(xx - cx) <= r * 0.85) & (abs(yy - cy) <= r * 0.85)
    else:  # an upward triangle
        inside = (yy <= cy + r * 0.8) & (yy >= cy - r) & (abs(xx - cx) <= (yy - (cy - r)) * 0.6)
    image[inside] = COLOURS[colour]
    return np.clip(image + rng.normal(0, 12, image.shape), 0, 255).astype(np.uint8)


def write_shapes(folder: str | Path, count: int, seed: int = 0, size: int = 32) -> Path:
    """count pairs NNNN.png + NNNN.txt under folder."""
    from PIL import Image

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(count):
        colour, shape, place = rng.choice(list(COLOURS)), rng.choice(SHAPES), rng.choice(list(PLACES))
        Image.fromarray(shape_picture(colour, shape, place, size, rng)).save(folder / f"{i:04d}.png")
        (folder / f"{i:04d}.txt").write_text(f"a {colour} {shape} {place}\n")
    return folder


def write_primitives(
    folder: str | Path,
    count: int,
    seed: int = 0,
    size: int = 32,
    file_types: tuple[str, ...] = ("obj", "ply", "stl", "off", "glb"),
) -> Path:
    """count pairs NNNN.<mesh type> + NNNN.png (the shape's points drawn) under folder."""
    import torch
    from PIL import Image

    from onn.modalities.mesh.primitives import CLASSES, primitive
    from onn.modalities.mesh.read import Sampling, sample_points
    from onn.modalities.mesh.render import render

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(count):
        mesh = primitive(CLASSES[i % len(CLASSES)], rng)
        mesh.export(str(folder / f"{i:04d}.{file_types[i % len(file_types)]}"))
        points = sample_points(mesh.vertices, mesh.faces, Sampling(1024, False, seed), str(i))
        picture = render(torch.from_numpy(points)[None], size=size)[0].permute(1, 2, 0).numpy()
        Image.fromarray(picture).save(folder / f"{i:04d}.png")
    return folder


if __name__ == "__main__":
    kinds = {"shapes": write_shapes, "primitives": write_primitives}
    count_ok = len(sys.argv) != 4 or (sys.argv[3].isdigit() and int(sys.argv[3]) > 0)
    if len(sys.argv) not in (3, 4) or sys.argv[1] not in kinds or not count_ok:
        sys.exit("usage: python -m onn.modalities.pairs.demo shapes|primitives OUT_FOLDER [COUNT] (COUNT: 1 or more)")
    out = kinds[sys.argv[1]](sys.argv[2], int(sys.argv[3]) if len(sys.argv) == 4 else 200)
    print(f"wrote {sys.argv[1]} pairs to {out}")
