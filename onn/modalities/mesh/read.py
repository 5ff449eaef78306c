"""Meshes and point clouds as fixed-size point sets: read through trimesh, sampled by area, normalised.

Every file becomes `points` surface points (sampled by face area, seeded by the file's content, so a
file decodes to the same points every time, wherever it lies), optionally with their face normals, centred,
optionally turned onto their principal axes (data.align=pca: for shapes that have no common
orientation), and scaled into the unit sphere: float32 [points, 3] or [points, 6].

Geometry only: `trimesh.load(..., force=None, process=False)`, and a scene's parts are put where its
graph places them and concatenated with numpy. trimesh's own concatenation merges the parts' visuals
too (textures: slow, and it needs PIL or scipy for some files). A binary PLY or an OFF that trimesh refuses for
mixing polygon sizes is read by onn.modalities.mesh.polygons. A file holding only points (a PLY
point cloud) is taken as its finite points (a depth scan writes NaN for the pixels it did not measure) and
sampled with replacement; its normals are zeros. An OBJ's relative indices are made absolute first (trimesh
counts them back from the file's last vertex, not from the vertices before the face). Faces flat up to the
files' rounding are not sampled (face_weights).

A file that cannot be used is skipped with its reason, as undecodable images are: unreadable
(trimesh raises), empty (trimesh reads some broken files as an empty scene without a word), faces
that point past their part's vertex list, non-finite vertices, zero surface area, points that all coincide. The run
fails only when more than data.max_bad_fraction of the files are bad.
"""

from __future__ import annotations

import codecs
import io
import logging
import os
import re
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from onn.config.data import MeshData
from onn.data.files import ARCHIVE_ERRORS, archive_kind, existing_source, walk_files, wanted_members
from onn.data.labelled import check_bad, sort_classes
from onn.data.resident import Decoded
from onn.errors import UserError
from onn.modalities.mesh.polygons import binary_ply_polygons, is_binary_ply, mixed_face_sizes, off_polygons

if TYPE_CHECKING:
    import trimesh

log = logging.getLogger("onn")

# What trimesh reads without extra packages: meshes (OBJ, PLY, STL ascii and binary, OFF, glTF) and
# point clouds (PLY without faces, XYZ).
ALIGNMENTS = ("none", "pca")
MESH_SUFFIXES = (".obj", ".ply", ".stl", ".off", ".glb", ".gltf", ".xyz")
TEXT_TYPES = ("obj", "off", "xyz")  # formats that are text only: a byte-order mark in front is not their content
SPLITS = {"train": "train", "test": "test", "val": "val", "valid": "val", "validation": "val"}
LAYOUT = "CLASS/FILE (e.g. chair/0001.obj), train/CLASS/FILE + test/CLASS/FILE, or CLASS/train/FILE + CLASS/test/FILE"
# A face line with a relative index (f -3 -2 -1, f 1/-1/2): counted back from the vertices read so far
RELATIVE_FACE = re.compile(rb"^[ \t]*f[ \t][^\n#]*[ \t/]-[0-9]", re.MULTILINE)
HELP = f"expected mesh files ({', '.join(MESH_SUFFIXES)}) in class folders: {LAYOUT}, or a .zip/.tar of that layout"


class MeshError(ValueError):
    """Why a file cannot be used (the message is the reason a skip names)."""


@dataclass(frozen=True)
class Sampling:
    """How every mesh becomes the same input: data.points, data.normals, data.align, the sampling's seed."""

    points: int
    normals: bool
    seed: int = 0
    align: str = "none"

    @property
    def channels(self) -> int:
        return 6 if self.normals else 3


def sampling(data_cfg: MeshData, seed: int = 0) -> Sampling:
    """The checked data.points / data.normals, or one UserError naming the key."""
    points, normals = data_cfg.points, data_cfg.normals
    if isinstance(points, bool) or not isinstance(points, int) or points < 1:
        raise UserError(
            f"data.points={points!r}: give the number of surface points per mesh, a whole number, 1 or more."
        )
    if not isinstance(normals, bool):
        raise UserError(
            f"data.normals={normals!r}: give true (points and their normals, 6 values) or false (3 values)."
        )
    if data_cfg.align not in ALIGNMENTS:
        raise UserError(
            f"data.align={data_cfg.align!r}: give none (keep the files' orientation) "
            "or pca (turn each shape onto its principal axes)."
        )
    return Sampling(points, normals, seed, data_cfg.align)


def is_mesh_name(name: str) -> bool:
    return os.path.splitext(name)[1].lower() in MESH_SUFFIXES


# ---------------------------------------------------------------------------------------------------------
# One file


def load_geometry(source: Path | bytes, suffix: str) -> tuple[np.ndarray, np.ndarray | None]:
    """(vertices [V, 3] float64, faces [F, 3] int64 or None for a point cloud) of a file's whole content,
    or MeshError saying why it cannot be used. `source` is a path, or the bytes of an archive member."""
    logging.getLogger("trimesh").setLevel(logging.ERROR)  # texture warnings: geometry is all that is read
    file_type = suffix.lower().lstrip(".")
    if (len(source) if isinstance(source, bytes) else os.stat(source).st_size) == 0:
        raise MeshError("is an empty file (0 bytes)")
    if file_type in TEXT_TYPES:
        text = source if isinstance(source, bytes) else Path(source).read_bytes()
        plain = plain_text(text, file_type)
        source = plain if plain != text else source
    parts = read_parts(source, file_type)
    meshes = [(v, f) for v, f in parts if f is not None and len(f)]
    for v, f in meshes:  # each part on its own: past its end are the next part's vertices, a wrong shape
        if f.min() < 0 or f.max() >= len(v):
            whose = "one part's" if len(meshes) > 1 else "its"
            raise MeshError(f"faces point past {whose} {len(v)} vertices (a damaged file)")
    if meshes:
        vertices, faces, offset = [], [], 0
        for v, f in meshes:
            vertices.append(v)
            faces.append(f + offset)
            offset += len(v)
        v, f = np.concatenate(vertices), np.concatenate(faces)
        used = np.zeros(len(v), dtype=bool)  # a mask, not np.unique: that sort took 20 s on a 5M-face file
        used[f.ravel()] = True
        bad = used & ~np.isfinite(v).all(axis=1)
        if bad.any():
            raise MeshError(f"{int(bad.sum())} of its {int(used.sum())} vertices are not finite (NaN or inf)")
        return v, f
    points = [v for v, _ in parts if len(v)]
    if not points:
        raise MeshError("holds no geometry (an empty file or scene)")
    p = np.concatenate(points)
    finite = np.isfinite(p).all(axis=1)  # a scan's NaN points are pixels it did not measure (PCL, Open3D write them)
    if not finite.any():
        raise MeshError(f"none of its {len(p)} points is finite (NaN or inf)")
    return p[finite], None


def read_parts(source: Path | bytes, file_type: str) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """(vertices, faces or None) of every part of a file, placed where its scene graph puts them; MeshError if
    neither trimesh nor, for the mixed polygon sizes trimesh refuses, onn.modalities.mesh.polygons reads it."""
    import trimesh

    if file_type == "ply" and (polygons := mixed_binary_ply(source)) is not None:
        return [polygons]
    try:
        if isinstance(source, bytes):
            loaded = trimesh.load(io.BytesIO(source), file_type=file_type, force=None, process=False)
        else:
            loaded = trimesh.load(str(source), file_type=file_type, force=None, process=False)
    except Exception as e:  # trimesh's parsers raise every kind of error on a malformed file
        polygons = mixed_polygons(source, file_type)
        if polygons is not None:
            return [polygons]
        text = " ".join(str(e).split())[:160]
        raise MeshError(f"unreadable as {file_type.upper()} ({type(e).__name__}{': ' + text if text else ''})") from e
    if not isinstance(loaded, trimesh.Scene):
        return [_part(loaded, None)]
    parts = []
    for node in loaded.graph.nodes_geometry:  # every placed instance, with its world transform
        transform, name = loaded.graph[node]
        parts.append(_part(loaded.geometry[name], transform))
    return parts


def mixed_polygons(source: Path | bytes, file_type: str) -> tuple[np.ndarray, np.ndarray] | None:
    """(vertices, triangles) of a binary PLY or an OFF that trimesh refused, read as files that mix polygons of
    different sizes; None for another type, or where that fails too (trimesh's reason is then the one given)."""
    data = source if isinstance(source, bytes) else Path(source).read_bytes()
    try:
        if file_type == "ply" and is_binary_ply(data):
            return binary_ply_polygons(data)
        if file_type == "off":
            return off_polygons(data)
    except (ValueError, TypeError, IndexError, KeyError, struct.error):
        return None
    return None


def mixed_binary_ply(source: Path | bytes) -> tuple[np.ndarray, np.ndarray] | None:
    """(vertices, triangles) of a binary PLY whose faces have different numbers of corners, which trimesh reads as
    wrong faces without a word where their bytes add up to the first face's size; None for any other PLY (trimesh
    reads it, and says what is wrong with a damaged one)."""
    data = source if isinstance(source, bytes) else Path(source).read_bytes()
    try:
        if is_binary_ply(data) and mixed_face_sizes(data):
            return binary_ply_polygons(data)
    except (ValueError, TypeError, IndexError, KeyError, struct.error):
        return None
    return None


def plain_text(text: bytes, file_type: str) -> bytes:
    """A text file's bytes as trimesh reads them: without a UTF-8 byte-order mark (Windows editors write one, and
    trimesh took an OBJ's first vertex for an unknown line and its faces for damaged ones), an OBJ's tabs as spaces
    (trimesh read no vertex from `v<TAB>0 0 0`) and its relative indices made absolute."""
    text = text.removeprefix(codecs.BOM_UTF8)
    if file_type == "obj":
        text = text.replace(b"\t", b" ")
        if RELATIVE_FACE.search(text):
            text = absolute_obj_indices(text)
    return text


def absolute_obj_indices(text: bytes) -> bytes:
    """An OBJ's face lines with their relative (negative) indices made absolute. -1 is the last vertex read so far;
    trimesh counts back from the file's last vertex, which put every object but the last on another's vertices."""
    counts = {b"v": 0, b"vt": 0, b"vn": 0}
    lines = text.split(b"\n")
    for number, line in enumerate(lines):
        words = line.split(b"#", 1)[0].split()
        if not words:
            continue
        if words[0] in counts:
            counts[words[0]] += 1
        elif words[0] == b"f" and b"-" in line:
            corners = [_absolute_corner(corner, counts, number + 1) for corner in words[1:]]
            lines[number] = b" ".join([b"f", *corners])
    return b"\n".join(lines)


def _absolute_corner(corner: bytes, counts: dict[bytes, int], line: int) -> bytes:
    """One face corner (v, v/vt, v//vn or v/vt/vn) with its negative indices counted back from `counts`."""
    fields = corner.split(b"/")
    for i, kind in enumerate((b"v", b"vt", b"vn")[: len(fields)]):
        if fields[i].startswith(b"-") and fields[i][1:].isdigit():
            index = counts[kind] + int(fields[i]) + 1
            if index < 1:
                raise MeshError(
                    f"line {line}: a face refers to {kind.decode()} {int(fields[i])}, with only {counts[kind]} "
                    "before it (a damaged file)"
                )
            fields[i] = str(index).encode()
    return b"/".join(fields)


def _part(geometry, transform) -> tuple[np.ndarray, np.ndarray | None]:
    import trimesh

    vertices = np.asarray(getattr(geometry, "vertices", np.zeros((0, 3))), dtype=np.float64).reshape(-1, 3)
    if transform is not None and len(vertices):
        vertices = trimesh.transform_points(vertices, transform)
    faces = getattr(geometry, "faces", None) if isinstance(geometry, trimesh.Trimesh) else None
    if faces is None:
        return vertices, None
    faces = np.asarray(faces, dtype=np.int64).reshape(-1, 3)
    if transform is not None and np.linalg.det(np.asarray(transform)[:3, :3]) < 0:
        faces = faces[:, ::-1]  # a mirrored instance: its winding turns over too, or its normals point inwards
    return vertices, faces


def sample_points(vertices: np.ndarray, faces: np.ndarray | None, settings: Sampling, name: str) -> np.ndarray:
    """float32 [points, 3 or 6]: surface points sampled by area (a point cloud's points with replacement),
    seeded by (seed, name), centred and scaled into the unit sphere; normals after the xyz when asked. A shape
    whose points all coincide is refused: scaled up, the rounding left by centring would become its shape."""
    import trimesh

    rng = np.random.default_rng([settings.seed, zlib.crc32(name.encode())])
    n = settings.points
    if faces is not None:
        mesh = trimesh.Trimesh(vertices=vertices, faces=faces, process=False, validate=False)
        weight, unit_normals = face_weights(mesh)
        xyz, face_index = trimesh.sample.sample_surface(mesh, n, face_weight=weight, seed=rng)
        normals = unit_normals[face_index]
    else:
        xyz = vertices[rng.choice(len(vertices), n, replace=len(vertices) < n)]
        normals = np.zeros_like(xyz)
    extent = float(np.abs(xyz).max())
    if not 0 < extent < np.inf:
        raise MeshError("has no extent (all its points coincide)")
    xyz = xyz / extent  # into [-1, 1] first: squares of coordinates past 1e154 overflow (a radius of inf, PCA's NaN)
    xyz = xyz - xyz.mean(axis=0)
    if settings.align == "pca":
        turn = principal_axes(xyz)
        xyz, normals = xyz @ turn, normals @ turn
    radius = float(np.linalg.norm(xyz, axis=1).max())
    if radius <= 1e-9:
        raise MeshError("has no extent (all its points coincide)")
    xyz = xyz / radius
    out = np.concatenate([xyz, normals], axis=1) if settings.normals else xyz
    return out.astype(np.float32)


def face_weights(mesh: trimesh.Trimesh) -> tuple[np.ndarray, np.ndarray]:
    """(sampling weight [F], unit normal [F, 3]) of every face: its area and its normal, or 0 and zeros where it is
    flat, narrower than a millionth of the shape (collinear corners, off by the rounding of the file's floats: a mesh
    of only such faces was sampled as a line with made-up normals). trimesh's face_normals are zeros below an absolute
    area (1e-13), so a shape drawn in small units had no normals at all; the cross products have them at any scale."""
    with np.errstate(over="ignore", invalid="ignore"):  # coordinates near float64's limit: said below, not warned
        area = mesh.area_faces
        if not np.isfinite(area.sum()):
            raise MeshError("its coordinates are too large to sample (its surface area overflows)")
        corners = mesh.triangles
        size = float(np.linalg.norm(np.ptp(corners.reshape(-1, 3), axis=0)))
        longest = np.linalg.norm(corners - np.roll(corners, 1, axis=1), axis=2).max(axis=1)
        flat = 2 * area <= 1e-6 * size * longest  # the face's height, 2 * area / longest edge, within 1e-6 of the size
    if flat.all():
        raise MeshError("has zero surface area (every face is degenerate)")
    cross = mesh.triangles_cross
    unit = np.zeros_like(cross)
    unit[~flat] = cross[~flat] / np.linalg.norm(cross[~flat], axis=1, keepdims=True)
    return np.where(flat, 0.0, area), unit


def principal_axes(xyz: np.ndarray) -> np.ndarray:
    """The rotation [3, 3] (for row vectors) onto the centred points' principal axes, the widest first; each
    axis points where the points are skewed (a cone's tip always the same way), and the frame is right-handed."""
    values, vectors = np.linalg.eigh(np.cov(xyz.T))
    vectors = vectors[:, np.argsort(values)[::-1]]
    skew = ((xyz @ vectors) ** 3).mean(axis=0)
    vectors = vectors * np.where(skew < 0, -1.0, 1.0)
    if np.linalg.det(vectors) < 0:  # a reflection, not a turn: flip the least skewed axis
        vectors[:, int(np.argmin(np.abs(skew)))] *= -1
    return vectors


def decode(source: Path | bytes, name: str, settings: Sampling) -> np.ndarray:
    """One file (a path, or an archive member's bytes) as its normalised point set; MeshError if unusable. Its
    points are seeded by its content, not its name: a name is relative to the folder given, and the same file
    read from its class folder, from the folder above or alone would be sampled three ways."""
    vertices, faces = load_geometry(source, os.path.splitext(name)[1])
    return sample_points(vertices, faces, settings, content_key(source))


def content_key(source: Path | bytes) -> str:
    """The CRC-32 of a file's bytes (read 1 MB at a time) or of an archive member's, in hex."""
    if isinstance(source, bytes):
        return f"{zlib.crc32(source):08x}"
    crc = 0
    with open(source, "rb") as f:
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


# ---------------------------------------------------------------------------------------------------------
# A source: a file, a folder or an archive of class folders


def entries(path: Path, key: str, refused: list[str]) -> Iterator[tuple[str, Path | bytes]]:
    """(relative name, path or bytes) of every mesh file in a file, folder or zip/tar archive; an archive's
    members whose names cannot be used go to `refused`."""
    if path.is_dir():
        for rel, full in walk_files(path):
            if is_mesh_name(rel):
                yield rel, full
        return
    kind = archive_kind(path)
    if kind is None:
        if not is_mesh_name(path.name):
            raise UserError(f"{key} {path} is not a mesh file, a folder or a .zip/.tar archive; {HELP}.")
        yield path.name, path
        return
    try:
        yield from wanted_members(path, kind, is_mesh_name, refused)
    except ARCHIVE_ERRORS as e:
        raise UserError(f"{key} {path} is not a readable archive ({e}); repack it, or unpack it into a folder.") from e


def place(name: str) -> tuple[str, str | None]:
    """(split, class or None) of a relative name: the first split folder on its path (train, test, val)
    decides the split ("all" without one), the first other folder the class."""
    folders = name.split("/")[:-1]
    split = next((SPLITS[p.lower()] for p in folders if p.lower() in SPLITS), "all")
    classes = [p for p in folders if p.lower() not in SPLITS]
    return split, classes[0] if classes else None


def unwrap(names: list[str]) -> list[str]:
    """Names without a folder that wraps them all (ModelNet10/chair/train/x.off -> chair/train/x.off)."""
    while names and all(n.count("/") >= 2 for n in names):
        tops = {n.split("/", 1)[0] for n in names}
        if len(tops) != 1 or next(iter(tops)).lower() in SPLITS:
            break
        names = [n.split("/", 1)[1] for n in names]
    return names


def read_source(
    source: str | os.PathLike,
    settings: Sampling,
    *,
    max_bad_fraction: float,
    allow_unlabelled: bool = False,
    key: str = "data.source",
) -> dict[str, Decoded]:
    """Every split of a mesh source, decoded: {train, val, test} as its folders say, else {all}."""
    path = existing_source(source, key, HELP)
    refused: list[str] = []
    outcomes: dict[str, np.ndarray | MeshError] = {}  # a .tar.gz's name stored twice: its last entry, once
    for name, payload in entries(path, key, refused):
        try:
            outcomes[name] = decode(payload, name, settings)
        except MeshError as e:
            outcomes[name] = e
    names = [name for name, outcome in outcomes.items() if not isinstance(outcome, MeshError)]
    arrays = [outcomes[name] for name in names]
    skipped = [f"{name}: {e}" for name, e in outcomes.items() if isinstance(e, MeshError)] + refused
    total = len(outcomes) + len(refused)
    if not total:
        raise UserError(f"{key} {path}: found no mesh files; {HELP}.")
    check_bad(skipped, total, max_bad_fraction, path, key, "mesh files", "cannot be used")
    short = unwrap(names) if path.is_dir() or archive_kind(path) else names
    placed = [place(n) for n in short]
    labelled = [c is not None for _, c in placed]
    if not allow_unlabelled and not all(labelled):
        loose = next(n for n, ok in zip(names, labelled) if not ok)
        raise UserError(f"{key} {path}: {loose} is not in a class folder; {HELP}.")
    classes = sort_classes({c for _, c in placed if c is not None})  # 2 before 10, as labelled files sort them
    order: dict[str, list[int]] = {}
    for i, (split, _) in enumerate(placed):
        order.setdefault(split, []).append(i)
    found: dict[str, Decoded] = {}
    stacked = np.stack(arrays) if arrays else np.zeros((0, settings.points, settings.channels), np.float32)
    for split, index in order.items():
        labels = [classes.index(placed[i][1]) if placed[i][1] is not None else -1 for i in index]
        found[split] = Decoded(
            torch.from_numpy(stacked[index]),
            torch.tensor(labels, dtype=torch.long),
            classes,
            [names[i] for i in index],
            [],
        )
    if skipped:
        # the skips are the source's; one split carries them for the report
        first = next(iter(found.values()))
        first.skipped = skipped
    return found
