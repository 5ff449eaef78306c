"""The mesh reader on legal files a third review found it skipping: binary PLYs and OFFs that mix polygon sizes
(Blender and MeshLab write quads and n-gons beside triangles), and text files with a UTF-8 byte-order mark or tabs."""

from __future__ import annotations

import codecs
import struct

import numpy as np
import pytest
from conftest import SHARED_DATA

from onn.modalities.mesh.read import MeshError, Sampling, decode, load_geometry, read_source

MESHES = SHARED_DATA / "meshes" / "trimesh"
SETTINGS = Sampling(256, True, 0)


def triangle_set(vertices: np.ndarray, faces: np.ndarray) -> list:
    """A mesh's triangles as sorted tuples of corner coordinates: equal for the same surface, whatever the order."""
    return sorted(tuple(sorted(map(tuple, vertices[f].round(6).tolist()))) for f in faces)


def binary_twin(ascii_ply: bytes, order: str) -> bytes:
    """An ASCII PLY of float vertex properties and one `list uchar uint|int vertex_indices` face property, written
    again as a binary one (`order`: < little-endian, > big-endian), value for value."""
    header, _, body = ascii_ply.partition(b"end_header\n")
    lines = header.decode().splitlines()
    vertex_count = next(int(line.split()[2]) for line in lines if line.startswith("element vertex"))
    vertex_properties = sum(line.startswith("property float") for line in lines)
    rows = [row.split() for row in body.decode().splitlines() if row.strip()]
    data = b"".join(struct.pack(f"{order}{vertex_properties}f", *map(float, r)) for r in rows[:vertex_count])
    data += b"".join(struct.pack(f"{order}B{len(r) - 1}i", *map(int, r)) for r in rows[vertex_count:])
    kind = "binary_little_endian" if order == "<" else "binary_big_endian"
    return header.replace(b"format ascii", f"format {kind}".encode()) + b"end_header\n" + data


def pentagon_house() -> tuple[list[list[float]], list[list[int]]]:
    """A pentagonal prism with a pyramid roof: a pentagon floor, five quad walls, five triangles up to the tip."""
    ring = [[np.cos(a), np.sin(a)] for a in np.linspace(0, 2 * np.pi, 5, endpoint=False)]
    vertices = [[x, y, 0.0] for x, y in ring] + [[x, y, 1.0] for x, y in ring] + [[0.0, 0.0, 1.8]]
    faces = [[4, 3, 2, 1, 0]] + [[i, (i + 1) % 5, 5 + (i + 1) % 5, 5 + i] for i in range(5)]
    faces += [[5 + i, 5 + (i + 1) % 5, 10] for i in range(5)]
    return vertices, faces


def ascii_ply(vertices: list[list[float]], faces: list[list[int]]) -> bytes:
    head = f"ply\nformat ascii 1.0\nelement vertex {len(vertices)}\n" + "".join(f"property float {a}\n" for a in "xyz")
    head += f"element face {len(faces)}\nproperty list uchar int vertex_indices\nend_header\n"
    rows = [" ".join(f"{c:.6f}" for c in v) for v in vertices] + [" ".join(map(str, [len(f), *f])) for f in faces]
    return (head + "\n".join(rows) + "\n").encode()


@pytest.mark.skipif(not MESHES.is_dir(), reason="../shared/data/meshes/trimesh is not here")
@pytest.mark.parametrize("order", ["<", ">"])
def test_blenders_suzanne_as_a_binary_ply_reads_as_its_ascii_original(tmp_path, order):
    """suzanne.ply (Blender 2.83, ASCII: 500 faces, quads beside triangles, with normals and texture coordinates)
    reads; the same file binary, as Blender writes by default, was skipped: trimesh read every face as having the
    first one's corners ("PLY is unexpected length!"). It is now the same surface, and a cut-off copy is still named."""
    original = (MESHES / "suzanne.ply").read_bytes()
    (tmp_path / "suzanne.ply").write_bytes(binary_twin(original, order))
    expected = load_geometry(MESHES / "suzanne.ply", ".ply")
    vertices, faces = load_geometry(tmp_path / "suzanne.ply", ".ply")
    assert len(faces) == 968 and triangle_set(vertices, faces) == triangle_set(*expected)
    points = decode(tmp_path / "suzanne.ply", "suzanne.ply", SETTINGS)
    assert np.isfinite(points).all() and np.allclose(np.linalg.norm(points[:, 3:], axis=1), 1, atol=1e-5)
    (tmp_path / "cut.ply").write_bytes(binary_twin(original, order)[:-100])
    with pytest.raises(MeshError, match="unreadable as PLY"):
        load_geometry(tmp_path / "cut.ply", ".ply")


def test_binary_ply_and_off_of_pentagons_quads_and_triangles_read_as_the_ascii_ply(tmp_path):
    """A pentagon floor, quad walls, triangle roof: the ASCII PLY read; the binary PLY was skipped (unexpected
    length), and the OFF too (trimesh's fan triangulation was handed the corners as strings). All three are now the
    same 18 triangles, in a folder read as a dataset with nothing skipped."""
    vertices, faces = pentagon_house()
    folder = tmp_path / "house"
    folder.mkdir()
    (folder / "ascii.ply").write_bytes(ascii_ply(vertices, faces))
    (folder / "binary.PLY").write_bytes(binary_twin(ascii_ply(vertices, faces), "<"))
    rows = [f"{len(vertices)} {len(faces)} 0"] + [" ".join(map(str, v)) for v in vertices]
    (folder / "house.off").write_text(
        "OFF\n# a comment\n" + "\n".join(rows + [" ".join(map(str, [len(f), *f])) for f in faces]) + "\n"
    )
    expected = triangle_set(*load_geometry(folder / "ascii.ply", ".ply"))
    assert len(expected) == 18
    for name in ("binary.PLY", "house.off"):
        assert triangle_set(*load_geometry(folder / name, name[-4:])) == expected, name
    (split,) = read_source(tmp_path, SETTINGS, max_bad_fraction=0.0).values()
    assert sorted(split.names) == ["house/ascii.ply", "house/binary.PLY", "house/house.off"] and not split.skipped
    (tmp_path / "short.off").write_text("OFF\n11 11 0\n" + "\n".join(rows[1:4] + ["5 0 1 2 3 4", "3 0 1 2"]) + "\n")
    with pytest.raises(MeshError, match="unreadable as OFF"):  # fewer vertices than it counts: still refused
        load_geometry(tmp_path / "short.off", ".off")


@pytest.mark.parametrize("variant", ["byte-order mark", "tabs", "both, with relative indices"])
def test_an_obj_with_a_byte_order_mark_or_tabs_reads_as_without(tmp_path, variant):
    """A UTF-8 byte-order mark (Windows editors write one) made trimesh miss an OBJ's first vertex and refuse its
    faces as pointing past the others; `v<TAB>x y z` lines were no vertices at all (the file "held no geometry")."""
    rows = ["v 0 0 0", "v 1 0 0", "v 0 1 0", "v 0 0 1", "f 1 2 3", "f 1 2 4", "f 1 3 4", "f 2 3 4"]
    (tmp_path / "plain.obj").write_text("\n".join(rows) + "\n")
    text = "\n".join(rows) + "\n"
    if variant != "byte-order mark":
        text = text.replace("v ", "v\t").replace("f ", "f\t").replace(" ", "\t")
    if variant.startswith("both"):
        text = text.replace("f\t1\t2\t3", "f\t-4\t-3\t-2")
    data = (codecs.BOM_UTF8 if variant != "tabs" else b"") + text.encode()
    (tmp_path / "odd.obj").write_bytes(data)
    expected = triangle_set(*load_geometry(tmp_path / "plain.obj", ".obj"))
    assert triangle_set(*load_geometry(tmp_path / "odd.obj", ".obj")) == expected
    assert triangle_set(*load_geometry(data, ".OBJ")) == expected  # an archive member's bytes, upper-case name


def test_an_xyz_point_cloud_with_a_byte_order_mark_keeps_every_point(tmp_path):
    """trimesh refused an XYZ file with a byte-order mark (its first number read as '\\ufeff0')."""
    (tmp_path / "scan.xyz").write_bytes(codecs.BOM_UTF8 + b"0 0 0\n1 0 0\n0 1 0\n0 0 1\n")
    points, faces = load_geometry(tmp_path / "scan.xyz", ".xyz")
    assert faces is None and points.tolist() == [[0, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 1]]


@pytest.mark.parametrize("order", ["<", ">"])
def test_a_binary_ply_whose_mixed_faces_add_up_to_the_first_faces_size_reads_its_own_faces(order):
    """A quad, a triangle and a pentagon take the bytes of three quads: trimesh read them as three wrong faces
    without a word (it refuses only bytes that do not add up), so the reader looks at the corner counts first."""
    vertices = [[0, 0, 0], [1, 0, 0], [1, 1, 0], [0, 1, 0], [0.5, 1.5, 0], [0, 0, 1]]
    faces = [[0, 1, 2, 3], [0, 1, 5], [0, 1, 2, 4, 3]]
    text = ascii_ply(vertices, faces)
    want = triangle_set(*load_geometry(text, ".ply"))
    assert len(want) == 2 + 1 + 3
    assert triangle_set(*load_geometry(binary_twin(text, order), ".ply")) == want
    quads = [[0, 1, 2, 3], [0, 1, 5, 3], [1, 2, 4, 3]]  # one corner count: trimesh's own reading, the same surface
    assert triangle_set(*load_geometry(binary_twin(ascii_ply(vertices, quads), order), ".ply")) == triangle_set(
        *load_geometry(ascii_ply(vertices, quads), ".ply")
    )
