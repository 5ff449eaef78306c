"""Graph files as torch_geometric `Data`: edge lists, safetensors tensors and meshes (their vertex-edge graphs).

One graph per file, its class from its folder (CLASS/FILE, train/CLASS/FILE, ...: the mesh modality's layouts,
onn/modalities/mesh/read.py's `place`), or a .zip/.tar of that layout:

  NAME.edges / NAME.edgelist   `SRC DST` a line: two whole numbers apart by spaces, tabs or a comma (what follows
                               them, a weight or the `{}` of attributes networkx's write_edgelist adds, is not
                               read); `# ...` comments; a first line of column names (`source,target`, `src dst`:
                               a line that starts with a word, as CSV exporters write) is skipped. The numbers are
                               node ids, as networkx's read_edgelist takes them: the nodes are the ids the edges
                               name, numbered in increasing order (SNAP's ids 1..N are nodes 0..N-1; an id that no
                               edge names is no node). A `nodes N` line makes them positions instead: nodes
                               0..N-1, those that no edge names left alone. Undirected; every node's one feature
                               is 1. The plan's size estimate (file_size) reads the lines by the same rule
                               (edge_lines)
  NAME.safetensors             x [nodes, features] (optional: ones), edge_index [2, edges] (positions 0..nodes-1,
                               as torch_geometric's), optional y
  NAME.obj, .ply, .stl, ...    a mesh through trimesh: vertices (merged where they coincide; those no face uses
                               left out) are the nodes, the faces' edges the edges, positions centred and scaled
                               into the unit sphere (turned onto their principal axes with align=pca); a point
                               cloud's points are joined to their 6 nearest neighbours

Every graph is made undirected without self-loops. A file that cannot be used is skipped with its reason
(unreadable, no nodes, an edge that points past the nodes, non-finite features, too many nodes), as broken
images and meshes are; the run fails only when more than data.max_bad_fraction of the files are bad.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from onn.data.files import ARCHIVE_ERRORS, archive_kind, existing_source, walk_files, wanted_members
from onn.data.labelled import check_bad, sort_classes
from onn.errors import UserError
from onn.modalities.mesh.read import MESH_SUFFIXES, MeshError, load_geometry, place, principal_axes, unwrap

log = logging.getLogger(__name__)

EDGE_SUFFIXES = (".edges", ".edgelist")
TENSOR_SUFFIXES = (".safetensors",)
GRAPH_SUFFIXES = EDGE_SUFFIXES + TENSOR_SUFFIXES
NEIGHBOURS = 6  # a point cloud's points are joined to this many nearest ones
INT64_MAX = 2**63 - 1  # the largest node number an edge_index (int64) holds
HEADER_BYTES = 64 * 1024  # the most of a .safetensors file's JSON header read for its tensors' shapes
EDGE_HEAD_BYTES = 8 * 2**20  # an edge list's head a plan reads; a longer list is sized by its head's lines a byte
# an edge list's lines (line ends made `\n`), read by these alone, by the reader and the plan's estimate alike:
PAIR_LINE = re.compile(rb"^[ \t]*(\d+)[ \t,]+(\d+)(?=[ \t,#]|$)", re.M)  # `SRC DST`, then anything after a gap
NODES_LINE = re.compile(rb"^[ \t]*nodes[ \t]+(-?\d+)[ \t]*(?=#|$)", re.M | re.I)  # `nodes N`
CONTENT_LINE = re.compile(rb"^[ \t]*[^ \t\n#].*$", re.M)  # neither blank nor a comment
OTHER_LINE = re.compile(  # a content line that is no pair and no `nodes N`: refused, but for a header
    rb"^(?![ \t]*(?:#|$)|" + PAIR_LINE.pattern[1:] + rb"|" + NODES_LINE.pattern[1:] + rb").+$", re.M | re.I
)
HEADER_LINE = re.compile(rb"[ \t]*(?!nodes\b)[^\d\s#,.+-]", re.I)  # a first line that starts with a word (not `nodes`)
BOM = b"\xef\xbb\xbf"  # the byte-order mark Notepad and Excel write before UTF-8 text
HELP = (
    f"expected graph files ({', '.join(GRAPH_SUFFIXES)}, or meshes: {', '.join(MESH_SUFFIXES)}) in class folders: "
    "CLASS/FILE, train/CLASS/FILE + test/CLASS/FILE, or a .zip/.tar of that layout (see conf/data/graph.yaml)"
)


class GraphError(ValueError):
    """Why a file cannot be used as a graph (the message is the reason its skip names)."""


@dataclass
class Graphs:
    """One split of a source: its graphs (each a torch_geometric Data with y), names and skipped files."""

    graphs: list  # torch_geometric.data.Data, y set (-1 where the class is unknown)
    classes: list[str]
    names: list[str]
    skipped: list[str] = field(default_factory=list)

    @property
    def labels(self) -> torch.Tensor:
        return torch.tensor([int(g.y.view(-1)[0]) for g in self.graphs], dtype=torch.long)


def is_graph_name(name: str) -> bool:
    return os.path.splitext(name)[1].lower() in GRAPH_SUFFIXES


def readable(name: str) -> bool:
    """A graph file or a mesh: what a graph source may hold."""
    return os.path.splitext(name)[1].lower() in GRAPH_SUFFIXES + MESH_SUFFIXES


def make_graph(x: torch.Tensor | None, edge_index: torch.Tensor, nodes: int | None, max_nodes: int):
    """A checked, undirected Data without self-loops; GraphError naming what is wrong."""
    from torch_geometric.data import Data
    from torch_geometric.utils import remove_self_loops, to_undirected

    if edge_index.dim() != 2 or edge_index.shape[0] != 2:
        raise GraphError(f"its edge_index has shape {list(edge_index.shape)}, not [2, edges]")
    if edge_index.is_floating_point() and not torch.isfinite(edge_index).all():  # (.long() made inf a number)
        raise GraphError(f"its edge_index is {str(edge_index.dtype).removeprefix('torch.')} with non-finite entries")
    if edge_index.is_floating_point() and not torch.equal(edge_index, edge_index.round()):
        raise GraphError(
            f"its edge_index is {str(edge_index.dtype).removeprefix('torch.')} with fractional node numbers"
        )
    edge_index = edge_index.long()
    if x is not None and (x.dim() == 0 or (x.dim() > 1 and x.shape[1:].numel() == 0)):
        raise GraphError(f"its x has shape {list(x.shape)}, not [nodes, features] with one feature or more")
    if x is not None:
        n = int(x.shape[0])
    elif nodes is not None:
        n = nodes
    else:
        n = int(edge_index.max()) + 1 if edge_index.numel() else 0
    if n == 0:
        raise GraphError("holds no nodes (an empty graph)")
    if n > max_nodes and x is None and nodes is None:  # ids, not a count: a user's own ids want renumbering
        raise GraphError(
            f"numbers a node {n - 1}, so has {n} nodes (numbered 0..{n - 1}), more than data.max_nodes={max_nodes}: "
            "renumber its nodes 0..nodes-1, or raise data.max_nodes for a graph this large"
        )
    if n > max_nodes:
        raise GraphError(f"has {n} nodes, more than data.max_nodes={max_nodes}")
    if edge_index.numel() and (int(edge_index.min()) < 0 or int(edge_index.max()) >= n):
        bad = int(((edge_index < 0) | (edge_index >= n)).any(0).nonzero()[0])
        src, dst = edge_index[:, bad].tolist()
        raise GraphError(f"edge {bad} ({src} -> {dst}) points past its {n} nodes (numbered 0..{n - 1})")
    if x is None:
        x = torch.ones(n, 1)
    x = x.float().reshape(n, -1)
    if not torch.isfinite(x).all():
        raise GraphError(f"{int((~torch.isfinite(x)).any(1).sum())} of its {n} nodes have non-finite features")
    edge_index, _ = remove_self_loops(edge_index)
    return Data(x=x, edge_index=to_undirected(edge_index, num_nodes=n))


@dataclass
class EdgeLines:
    """An edge list's `SRC DST` pairs and its `nodes N` (None: none given, so the ids are names, not positions)."""

    pairs: list[tuple[int, int]]
    nodes: int | None


def line_ends(data: bytes) -> bytes:
    """Text with its line ends made `\\n` (Windows' `\\r\\n`, old Macs' `\\r`), as the line patterns read them."""
    return data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")


def edge_lines(data: bytes) -> EdgeLines:
    """An edge list's lines, by one rule for the reader and the plan's estimate (which sizes a file the reader
    reads, and none it skips): a header (the first content line, if it starts with a word) is skipped, and any other
    line that is no pair, `nodes N`, comment or blank is refused with its number; GraphError says why."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise GraphError(f"is not UTF-8 text (byte {e.start}); an edge list is `SRC DST` lines") from e
    text = line_ends(data.removeprefix(BOM))
    start, first = 0, CONTENT_LINE.search(text)
    if first and OTHER_LINE.match(text, first.start()) and HEADER_LINE.match(first[0]):
        start = first.end()  # column names (`source,target`), as CSV exporters write them first
    other = OTHER_LINE.search(text, start)
    if other:
        shown = other[0].decode("utf-8").strip()[:60]
        raise GraphError(f"line {line_of(text, other.start())} is {shown!r}, not `SRC DST` (two node numbers)")
    counts = list(NODES_LINE.finditer(text))
    if len(counts) > 1:
        raise GraphError(f"line {line_of(text, counts[1].start())} is a second `nodes N` line: give the count once")
    nodes = int(counts[0][1]) if counts else None
    if nodes is not None and nodes < 0:
        raise GraphError(f"its `nodes {nodes}` line gives a negative count of nodes")
    pairs = [(int(a), int(b)) for a, b in PAIR_LINE.findall(text)]
    if start and not pairs and nodes is None:  # an edge of names (`alice bob`) read as column names: not "empty"
        shown = first[0].decode("utf-8").strip()[:60]
        raise GraphError(
            f"holds no nodes (an empty graph): its one line {shown!r} is read as column names; give edges as "
            "`SRC DST` lines of whole numbers (named nodes numbered 0..N-1)"
        )
    if pairs and max(map(max, pairs)) > INT64_MAX:  # past int64: torch.tensor cannot hold it
        big = next(m for m in PAIR_LINE.finditer(text) if max(int(m[1]), int(m[2])) > INT64_MAX)
        raise GraphError(
            f"line {line_of(text, big.start())} numbers a node {max(int(big[1]), int(big[2]))}: node ids are whole "
            f"numbers up to {INT64_MAX} (int64); renumber its nodes"
        )
    return EdgeLines(pairs, nodes)


def line_of(text: bytes, offset: int) -> int:
    return text.count(b"\n", 0, offset) + 1


def read_edge_list(data: bytes, max_nodes: int, level: str = "graph"):
    """An edge-list file as a graph (see the module's docstring): its ids renumbered 0..N-1 in increasing order,
    or with a `nodes N` line taken as positions. At level=node the file's ids are kept (node_ids) for infer to name
    each node's row by: a node-level label or prediction belongs to the id the file gave it, not to its position."""
    lines = edge_lines(data)
    edge_index = torch.tensor(lines.pairs, dtype=torch.long).reshape(-1, 2).t()
    if lines.nodes is not None:
        return make_graph(None, edge_index, lines.nodes, max_nodes)
    ids, edge_index = torch.unique(edge_index, sorted=True, return_inverse=True)
    graph = make_graph(None, edge_index, len(ids), max_nodes)
    if level == "node":
        graph.node_ids = ids
    if len(ids) and int(ids[-1]) != len(ids) - 1:  # from 1, or with gaps: read_source says how many, once
        graph.renumbered = True
    return graph


def read_tensors(payload: bytes, max_nodes: int, level: str):
    """A .safetensors file's x, edge_index and y as a graph (y kept: a class number, or [nodes] labels)."""
    from safetensors.torch import load

    try:
        tensors = load(payload)
    except Exception as e:  # safetensors raises its own error types on a damaged header
        raise GraphError(f"unreadable as safetensors ({type(e).__name__}: {str(e)[:120]})") from e
    if "edge_index" not in tensors:
        raise GraphError(f"holds no edge_index tensor (it has {', '.join(sorted(tensors)) or 'none'})")
    # no x: every node's feature is 1, and a node-level y says how many nodes there are (the last may have no edge);
    # a y shorter than the edges' nodes is left to the label count's check below, which names it
    nodes = None
    if level == "node" and "x" not in tensors and "y" in tensors:
        edges = tensors["edge_index"]
        finite = not edges.is_floating_point() or bool(torch.isfinite(edges).all())  # (else make_graph says why)
        named = int(edges.max()) + 1 if edges.numel() and finite else 0
        nodes = tensors["y"].numel() if tensors["y"].numel() >= named else None
    graph = make_graph(tensors.get("x"), tensors["edge_index"], nodes, max_nodes)
    # a graph's class y, or a node-level graph's labels (node_y) and masks; a graph-level file's masks are not
    # read: kept on some graphs of a folder and not others, they would fail the collation of a batch of them
    kept = ("y", "train_mask", "val_mask", "test_mask") if level == "node" else ("y",)
    for key in kept:
        if key in tensors:
            graph["node_y" if key == "y" and level == "node" else key] = tensors[key]
    if level == "node" and "y" in tensors and tensors["y"].numel() != graph.num_nodes:
        raise GraphError(f"has y of {tensors['y'].numel()} labels for its {graph.num_nodes} nodes (level=node)")
    return graph


def mesh_graph(vertices: np.ndarray, faces: np.ndarray | None, align: str, max_nodes: int):
    """A mesh's vertex-edge graph (vertices merged where they coincide), positions normalised as node features and
    as torch_geometric's `pos`."""
    import trimesh

    if faces is not None:
        vertices, faces = referenced_only(vertices, faces)
    vertices = unit_box(vertices)
    if faces is not None:
        mesh = trimesh.Trimesh(vertices=vertices, faces=faces, process=True, validate=False)
        vertices, edges = np.asarray(mesh.vertices), np.asarray(mesh.edges_unique)
    else:
        edges = nearest_neighbours(vertices)
    xyz = vertices - vertices.mean(axis=0)
    if align == "pca" and len(xyz) >= 3:
        xyz = xyz @ principal_axes(xyz)
    radius = float(np.linalg.norm(xyz, axis=1).max()) if len(xyz) else 0.0
    if radius > 0:
        xyz = xyz / radius
    edge_index = torch.from_numpy(np.ascontiguousarray(edges.T, dtype=np.int64)).reshape(2, -1)
    graph = make_graph(torch.from_numpy(xyz.astype(np.float32)), edge_index, None, max_nodes)
    graph.pos = graph.x.clone()  # its features are its positions: the infer picture draws it at them (picture.layout)
    return graph


def referenced_only(vertices: np.ndarray, faces: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The vertices the faces use, and the faces renumbered onto them. A vertex no face uses (an OFF or PLY keeps
    them; trimesh's OBJ reader drops them) is no node, and one far off put the shape in a corner of unit_box's box,
    below trimesh's merging step: the whole shape became one node."""
    used = np.zeros(len(vertices), dtype=bool)  # a mask, not np.unique: see load_geometry
    used[faces.ravel()] = True
    return vertices[used], (np.cumsum(used) - 1)[faces]


def unit_box(vertices: np.ndarray) -> np.ndarray:
    """The vertices moved and scaled into a box of side 1 (non-finite ones left so, for trimesh to drop). trimesh
    merges vertices closer than 1e-8 and rounds them to integers of that step: in a file's own units, a shape of
    1e-9 metres became one node, and one of 1e12 overflowed the rounding into a handful."""
    finite = vertices[np.isfinite(vertices).all(axis=1)]
    if not len(finite):
        return vertices
    low, high = finite.min(axis=0), finite.max(axis=0)
    with np.errstate(over="ignore", invalid="ignore"):
        centre, side = low / 2 + high / 2, float((high - low).max())
    if not np.isfinite(side):
        raise GraphError("its coordinates are too large to normalise")
    return (vertices - centre) / side if side > 0 else vertices - centre


def nearest_neighbours(points: np.ndarray) -> np.ndarray:
    """[pairs, 2]: each point joined to its NEIGHBOURS nearest others (a point cloud has no faces to give edges)."""
    from scipy.spatial import cKDTree

    k = min(NEIGHBOURS + 1, len(points))
    if k < 2:
        return np.zeros((0, 2), dtype=np.int64)
    _, index = cKDTree(points).query(points, k=k)
    return np.stack([np.repeat(np.arange(len(points)), k - 1), index[:, 1:].reshape(-1)], axis=1)


def decode(payload: Path | bytes, name: str, align: str, max_nodes: int, level: str = "graph"):
    """One file (a path, or an archive member's bytes) as a graph; GraphError if it cannot be one."""
    suffix = os.path.splitext(name)[1].lower()
    if suffix in MESH_SUFFIXES:
        try:
            vertices, faces = load_geometry(payload, suffix)
        except MeshError as e:
            raise GraphError(str(e)) from e
        return mesh_graph(vertices, faces, align, max_nodes)
    data = payload if isinstance(payload, bytes) else Path(payload).read_bytes()
    if suffix in TENSOR_SUFFIXES:
        return read_tensors(data, max_nodes, level)
    return read_edge_list(data, max_nodes, level)


def tensor_shapes(path: Path) -> dict[str, list[int]] | None:
    """A .safetensors file's tensors' shapes, from its JSON header alone (at most HEADER_BYTES of it); None where the
    header cannot be read."""
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > HEADER_BYTES:
                return None
            header = json.loads(f.read(size))
        return {k: list(v["shape"]) for k, v in header.items() if k != "__metadata__"}
    except (OSError, ValueError, struct.error, TypeError, KeyError, AttributeError):
        return None


def file_size(path: Path) -> tuple[int, int] | None:
    """A graph file's (nodes, edges) as the reader makes it, without decoding it, for the planner: a .safetensors
    file's x and edge_index shapes from its header (edges as listed: PyG's edge_index lists both directions; no x:
    the length of a node-level y or mask, else half the edges), an edge list's `SRC DST` lines (edge_lines, the
    reader's rule) counted twice (the reader makes each two-way) and its `nodes N` line or its distinct ids; a list
    over EDGE_HEAD_BYTES by its head's lines and ids scaled by its size, the ids at most the span of those in its
    head and tail. None for a mesh, a file the reader would skip, or one that does not say."""
    suffix = path.suffix.lower()
    if suffix in TENSOR_SUFFIXES:
        shapes = tensor_shapes(path)
        edges = (shapes or {}).get("edge_index")
        if not edges or len(edges) != 2:
            return None
        if shapes.get("x"):
            return (shapes["x"][0], edges[1]) if shapes["x"][0] > 0 else None
        rows = [shapes[k][0] for k in ("y", "train_mask") if len(shapes.get(k, [])) == 1 and shapes[k][0] > 1]
        return (rows[0] if rows else max(1, edges[1] // 2)), edges[1]
    if suffix not in EDGE_SUFFIXES:
        return None
    try:
        with open(path, "rb") as f:
            text, tail, total = f.read(EDGE_HEAD_BYTES + 1), b"", os.fstat(f.fileno()).st_size
            if len(text) > EDGE_HEAD_BYTES:  # a long list: its lines counted in its head, scaled by the file's size
                text = text[: text.rfind(b"\n") + 1]
                f.seek(max(len(text), total - EDGE_HEAD_BYTES // 8))
                tail = f.read()  # a list sorted by node holds its largest numbers last
    except OSError:
        return None
    try:
        head = edge_lines(text)
    except GraphError:
        return None  # a file the reader skips
    scale = total / max(1, len(text))
    if head.nodes is not None:
        nodes = head.nodes
    else:  # the distinct ids: counted in a whole file, scaled from a long one's head, at most its span of ids
        named = {i for pair in head.pairs for i in pair}
        ends = named.union(int(i) for pair in PAIR_LINE.findall(line_ends(tail).partition(b"\n")[2]) for i in pair)
        nodes = min(max(ends) - min(ends) + 1, round(len(named) * scale)) if named else 0
    return (nodes, round(2 * len(head.pairs) * scale)) if nodes > 0 else None


def source_sizes(source: str | os.PathLike, files: int, listed: int, budget: int) -> list[tuple[int, int]]:
    """(nodes, edges) of at most `files` graph files of a file or folder (file_size), spread evenly over its first
    `listed` graph files, reading at most `budget` bytes of edge lists after the first: the planner's sample of the
    data, bounded however large the source. Nothing for an archive, nor for a mesh or a file that does not say."""
    path = Path(source).expanduser()
    if path.is_file():
        paths = [path]
    elif path.is_dir():
        paths = [full for rel, full in itertools.islice(walk_files(path), listed) if is_graph_name(rel)]
        paths = paths[:: max(1, -(-len(paths) // files))]
    else:
        return []
    sizes, spent = [], 0
    for full in paths:
        if spent > budget:
            break
        size = file_size(full)
        if size is not None:
            sizes.append(size)
        if full.suffix.lower() in EDGE_SUFFIXES:
            spent += min(full.stat().st_size, EDGE_HEAD_BYTES)
    return sizes


def class_number(y: torch.Tensor, allow_unlabelled: bool) -> int | None:
    """A graph file's y as its class: one whole number. None for anything else (a regression target, a label per
    node), which read as a class would train on a number the user did not mean; -1 (unknown) where labels are
    optional, as for task=infer's files."""
    if y.numel() == 1 and not (y.is_floating_point() or y.is_complex()):
        return int(y.view(-1)[0])
    return -1 if allow_unlabelled else None


def graph_entries(path: Path, key: str, refused: list[str]) -> Iterator[tuple[str, Path | bytes]]:
    """(relative name, path or bytes) of every graph or mesh file in a file, folder or archive; an archive's
    members whose names cannot be used go to `refused`."""
    if path.is_file() and readable(path.name):
        yield path.name, path
        return
    if path.is_dir():
        for rel, full in walk_files(path):
            if readable(rel):
                yield rel, full
        return
    # an archive: the mesh reader's listing takes mesh names only, so members are read here by the same helper
    kind = archive_kind(path)
    if kind is None:
        raise UserError(f"{key} {path} is not a graph file, a folder or a .zip/.tar archive; {HELP}.")
    try:
        yield from wanted_members(path, kind, readable, refused)
    except ARCHIVE_ERRORS as e:
        raise UserError(f"{key} {path} is not a readable archive ({e}); repack it, or unpack it into a folder.") from e


def read_source(
    source: str | os.PathLike,
    *,
    align: str,
    max_nodes: int,
    max_bad_fraction: float,
    allow_unlabelled: bool = False,
    key: str = "data.source",
    level: str = "graph",
) -> dict[str, Graphs]:
    """Every split of a graph source: {train, val, test} as its folders say, else {all}. A graph's class is its
    folder's name, or (in no class folder) the number in its y."""
    path = existing_source(source, key, HELP)
    refused: list[str] = []
    outcomes: dict[str, object] = {}  # a Data or its GraphError; a .tar.gz's name stored twice: its last entry
    for name, payload in graph_entries(path, key, refused):
        try:
            outcomes[name] = decode(payload, name, align, max_nodes, level)
        except GraphError as e:
            outcomes[name] = e
    names = [name for name, outcome in outcomes.items() if not isinstance(outcome, GraphError)]
    graphs = [outcomes[name] for name in names]
    skipped = [f"{name}: {e}" for name, e in outcomes.items() if isinstance(e, GraphError)] + refused
    total = len(outcomes) + len(refused)
    if not total:
        raise UserError(f"{key} {path}: found no graph files; {HELP}.")
    renumbered = sum(bool(graph.pop("renumbered", False)) for graph in graphs)
    if renumbered:  # said: ids were read as positions before (a gap or a missing node 0 was an edgeless node)
        log.info(
            "%s %s: %d of %d edge lists number their nodes other than 0..N-1 (from 1, or with gaps): their ids are "
            "names, renumbered in increasing order; a `nodes N` line keeps ids as positions (edgeless nodes included)",
            key,
            path,
            renumbered,
            len(graphs),
        )
    check_bad(skipped, total, max_bad_fraction, path, key, "graph files", "cannot be used")
    if not all("pos" in graph for graph in graphs):  # a mesh's, beside other graphs: a batch needs every graph's keys
        for graph in graphs:
            graph.pop("pos", None)
    short = unwrap(names) if path.is_dir() or archive_kind(path) else names
    placed = [place(n) for n in short]
    folders = sort_classes({c for _, c in placed if c is not None})  # 2 before 10, as images and meshes sort them
    given = {} if folders else {n: class_number(g.y, allow_unlabelled) for g, n in zip(graphs, names) if "y" in g}
    unusable = next((n for n, number in given.items() if number is None), None)
    if unusable is not None:
        y = graphs[names.index(unusable)].y
        raise UserError(
            f"{key} {path}: {unusable}'s y is {str(y.dtype).removeprefix('torch.')} of shape {list(y.shape)}, not one "
            "class number: save one whole number y (int64) per graph file, or set data.level=node for a label per node."
        )
    classes = folders or [str(i) for i in range(max(given.values(), default=-1) + 1)]
    found: dict[str, Graphs] = {}
    for graph, name, (split, folder) in zip(graphs, names, placed):
        if folder is not None:
            label = classes.index(folder)
        elif name in given:
            label = given[name]
        elif allow_unlabelled or level == "node":
            label = -1
        else:
            raise UserError(f"{key} {path}: {name} is not in a class folder and holds no class number y; {HELP}.")
        graph.y = torch.tensor([label], dtype=torch.long)
        part = found.setdefault(split, Graphs([], classes, []))
        part.graphs.append(graph)
        part.names.append(name)
    if not found:
        found["all"] = Graphs([], classes, [])
    next(iter(found.values())).skipped = skipped  # the skips are the source's; one split carries them for the report
    return found
