"""The faces of files that mix polygons of different sizes, where trimesh's own readers refuse them.

trimesh reads a binary PLY's face lists as if every face had the first one's number of corners ("PLY is unexpected
length!": Blender and MeshLab write quads and n-gons beside triangles), and an OFF file that mixes faces of five or
more corners with others fails inside its fan triangulation (it is handed the corners as strings). These read such a
file's vertices and polygons; trimesh.geometry.triangulate_quads turns the polygons into triangle fans. Both raise
ValueError (or struct.error) on a file they cannot read either. (plyfile, which reads such PLYs, is GPL-licensed: a
package of ONN's cannot depend on it.)
"""

from __future__ import annotations

import struct

import numpy as np

# PLY's scalar types as struct (and numpy) type codes
PLY_TYPES = {
    **dict.fromkeys(("char", "int8"), "b"),
    **dict.fromkeys(("uchar", "uint8"), "B"),
    **dict.fromkeys(("short", "int16"), "h"),
    **dict.fromkeys(("ushort", "uint16"), "H"),
    **dict.fromkeys(("int", "int32"), "i"),
    **dict.fromkeys(("uint", "uint32"), "I"),
    **dict.fromkeys(("float", "float32"), "f"),
    **dict.fromkeys(("double", "float64"), "d"),
}
FACE_LISTS = ("vertex_indices", "vertex_index")
# (name, the list's count type or None for a scalar, the value type), all as struct codes
Property = tuple[str, str | None, str]


def triangles(polygons: list) -> np.ndarray:
    """int64 [F, 3]: polygons of three or more corners, the larger ones as fans (lines and points are left out)."""
    import trimesh

    kept = [p for p in polygons if len(p) >= 3]
    return np.asarray(trimesh.geometry.triangulate_quads(kept), dtype=np.int64).reshape(-1, 3)


def is_binary_ply(data: bytes) -> bool:
    return data.startswith(b"ply") and b"format binary_" in data[:512]


def _ply_header(data: bytes) -> tuple[str, list[tuple[str, int, list[Property]]], int]:
    """A binary PLY's byte order, its elements (name, count, properties) and where their records start."""
    end = data.index(b"end_header")
    offset = data.index(b"\n", end) + 1
    lines = [line.split() for line in data[:end].decode("ascii", "replace").splitlines()]
    order = "<" if ["format", "binary_little_endian"] in [words[:2] for words in lines] else ">"
    elements: list[tuple[str, int, list[Property]]] = []
    for words in lines:
        if words[:1] == ["element"]:
            elements.append((words[1], int(words[2]), []))
        elif words[:2] == ["property", "list"]:
            elements[-1][2].append((words[4], PLY_TYPES[words[2]], PLY_TYPES[words[3]]))
        elif words[:1] == ["property"]:
            elements[-1][2].append((words[2], None, PLY_TYPES[words[1]]))
    return order, elements, offset


def mixed_face_sizes(data: bytes) -> bool:
    """Whether a binary PLY's faces may have different numbers of corners, which trimesh reads wrongly: it takes
    every face to have the first one's, and refuses the file only where the bytes then do not add up (a quad, a
    triangle and a pentagon are three quads' bytes, read as three wrong faces). False where the faces are read as
    one stride (numpy, at once) and all have the first face's corners."""
    order, elements, offset = _ply_header(data)
    for name, count, properties in elements:
        lists = [p for p in properties if p[1] is not None]
        if name == "face" and count:
            if len(lists) != 1:
                return True  # a face's other list (texcoords): read record by record
            (_, count_type, _) = lists[0]
            before = sum(struct.calcsize(code) for _, kind, code in properties[: properties.index(lists[0])])
            (corners,) = struct.unpack_from(order + count_type, data, offset + before)
            stride = np.dtype(
                [(n, order + code, ()) if kind is None else (n, [("n", order + kind), ("i", order + code, corners)])
                 for n, kind, code in properties]
            )  # fmt: skip
            if offset + count * stride.itemsize > len(data):
                return True
            rows = np.frombuffer(data, stride, count, offset)
            return bool((rows[lists[0][0]]["n"] != corners).any())
        if lists:
            return True  # an element of lists before the faces: its records' sizes vary
        offset += count * np.dtype([(n, order + code) for n, _, code in properties]).itemsize
    return False


def binary_ply_polygons(data: bytes) -> tuple[np.ndarray, np.ndarray]:
    """(vertices [V, 3] float64, triangles [F, 3]) of a binary PLY whose faces may have any number of corners each."""
    order, elements, offset = _ply_header(data)
    vertices, polygons = None, None
    for name, count, properties in elements:
        if all(count_type is None for _, count_type, _ in properties):
            dtype = np.dtype([(p, order + code) for p, _, code in properties])
            if name == "vertex":
                rows = np.frombuffer(data, dtype, count, offset)
                vertices = np.column_stack([rows["x"], rows["y"], rows["z"]]).astype(np.float64)
            offset += count * dtype.itemsize
        else:
            lists, offset = _records(data, offset, count, properties, order)
            polygons = lists if name == "face" else polygons
        if vertices is not None and polygons is not None:
            break
    if vertices is None:
        raise ValueError("no vertex element with x, y and z")
    return vertices, triangles(polygons or [])


def _records(data: bytes, offset: int, count: int, properties: list[Property], order: str) -> tuple[list, int]:
    """(the face lists of `count` records from `offset`, the offset after them), read one record at a time."""
    fields = [
        (name in FACE_LISTS, count_type and struct.Struct(order + count_type), struct.calcsize(code), code)
        for name, count_type, code in properties
    ]
    lists, corner_structs = [], {}
    for _ in range(count):
        for is_face, count_struct, size, code in fields:
            if not count_struct:
                offset += size
                continue
            (corners,) = count_struct.unpack_from(data, offset)
            offset += count_struct.size
            if is_face:
                if corners not in corner_structs:
                    corner_structs[corners] = struct.Struct(f"{order}{corners}{code}")
                lists.append(corner_structs[corners].unpack_from(data, offset))
            offset += corners * size
    if offset > len(data):
        raise ValueError(f"its faces end {offset - len(data)} bytes past the end of the file (a truncated file)")
    return lists, offset


def off_polygons(data: bytes) -> tuple[np.ndarray, np.ndarray]:
    """(vertices [V, 3] float64, triangles [F, 3]) of an OFF file (OFF, COFF, NOFF: the counts after the keyword or on
    the next line) whose faces may have any number of corners each."""
    rows = [words for line in data.splitlines() if (words := line.split(b"#", 1)[0].split())]
    keyword = rows[0][0]
    if b"OFF" not in keyword:
        raise ValueError(f"its first word is {keyword[:20]!r}, not OFF")
    counts, start = [keyword[keyword.index(b"OFF") + 3 :], *rows[0][1:]], 1
    counts = [c for c in counts if c]
    if not counts:
        counts, start = rows[1], 2
    vertex_count, face_count = int(counts[0]), int(counts[1])
    vertex_rows = rows[start : start + vertex_count]
    face_rows = rows[start + vertex_count : start + vertex_count + face_count]
    if len(vertex_rows) != vertex_count or len(face_rows) != face_count:
        raise ValueError(f"it holds fewer than the {vertex_count} vertices and {face_count} faces it counts")
    vertices = np.array([row[:3] for row in vertex_rows], dtype=np.float64)
    polygons = [[int(i) for i in row[1 : 1 + int(row[0])]] for row in face_rows]
    return vertices, triangles(polygons)
