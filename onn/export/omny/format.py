""".omny: an ONNX model whose metadata carries where it can be cut, what each block needs and how
to shard it over small GPUs. Any ONNX tool still opens it; FORMAT_SPEC.md defines the document.
This module writes, reads, inspects, validates and enriches such files; cli.py is their command line
(`python -m onn.export.omny inspect|validate|enrich|run`).

`validate` is what makes "a .omny file always splits where it says" a checked fact: it cuts the
model with onnx's own extractor at every planned boundary, runs the shards one after another in
onnxruntime and compares their result with the whole model's.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import onnx

from onn.errors import UserError
from onn.export import graph as G
from onn.export import shards
from onn.export.folders import onn_version, sweep_leftovers, temp_prefix
from onn.export.onnx_export import check_onnx, move_into_place, run_onnx, staged_name

if TYPE_CHECKING:
    import onnxruntime as ort

FORMAT_VERSION = "1.1"
METADATA_KEY = "onn.omny"
SCHEMA_FILE = Path(__file__).with_name("omny.schema.json")
MB = 2**20
DEFAULTS = {
    "max_shard_size_mb": shards.MAX_SHARD_SIZE_MB,  # the shard limits live in onn/export/shards.py, once
    "min_vram_mb": shards.MIN_VRAM_MB,
    "headroom_mb": shards.HEADROOM_MB,
    "nodes": None,
    "shard_counts": None,
    "max_configs": 8,
    "reference_sequence_length": 128,
}
EXTERNAL_DATA_BYTES = 2**31 - 2**28  # protobuf holds at most 2 GiB: weights above this go to a file beside the graph
SAMPLE_DIM = 8  # enrich: a named input dimension other than the first, when the command line gives no size


@cache
def schema() -> dict[str, Any]:
    return json.loads(SCHEMA_FILE.read_text())


@cache
def _open_schema() -> dict[str, Any]:
    """The schema without its `additionalProperties: false`: a newer MINOR version may add optional fields."""

    def opened(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: opened(v) for k, v in node.items() if not (k == "additionalProperties" and v is False)}
        return [opened(v) for v in node] if isinstance(node, list) else node

    return opened(schema())


def check_document(doc: dict[str, Any], where: str, newer_minor: bool = False) -> None:
    """Both the writer and the reader hold the document to the schema in FORMAT_SPEC.md and to the rules a schema
    cannot state (consistent_plans); a reader ignores the fields a document of a newer MINOR version adds
    (`newer_minor`), and holds the rest to the schema."""
    import jsonschema

    try:
        jsonschema.validate(doc, _open_schema() if newer_minor else schema())
    except jsonschema.ValidationError as e:
        at = "/".join(str(p) for p in e.absolute_path) or "<root>"
        raise UserError(f"{where}: the .omny document is invalid at {at}: {e.message}.") from None
    if problem := consistent_plans(doc):
        raise UserError(f"{where}: the .omny document is invalid: {problem}.")


ROUNDING_MB = 0.05  # a shard's total_mb is rounded to 0.1 MB: it may read up to half of that over its limit


def consistent_plans(doc: dict[str, Any]) -> str | None:
    """What FORMAT_SPEC.md says of the plans beyond the schema, or None when it holds: blocks numbered in order,
    each ended by the cut point that names it (the last by none);
    each plan's ranges contiguous from block 0 to the last, one per shard and the same as its detail's blocks; a
    shard's weights within max_shard_size_mb and its total within min_vram_mb (a node plan's: its node's memory);
    allowed_counts the configurations' shard counts."""
    count = len(doc["blocks"])
    if (bad := next((i for i, b in enumerate(doc["blocks"]) if b["index"] != i), None)) is not None:
        return f"blocks/{bad} has index {doc['blocks'][bad]['index']}, not its place {bad}"
    ends = {c["after_block"]: c["name"] for c in doc["cut_points"]}
    for i, block in enumerate(doc["blocks"]):
        want = ends.get(i) if i < count - 1 else None
        if block["cut_after"] != want:
            return (
                f"blocks/{i} has cut_after {block['cut_after']!r}, not {want!r}, the cut point whose after_block is {i}"
            )
    plans = doc["shard_plans"]
    limits = (plans["max_shard_size_mb"], plans["min_vram_mb"])
    for k, conf in enumerate(plans["configurations"]):
        at = f"shard_plans/configurations/{k}"
        if problem := _ranges_problem(conf["ranges"], conf["detail"], count, conf["shards"]):
            return f"{at}: {problem}"
        for j, shard in enumerate(conf["detail"]):
            if problem := _over(shard, *limits):
                return f"{at}/detail/{j}: {problem}"
    if plans["allowed_counts"] != [c["shards"] for c in plans["configurations"]]:
        return (
            f"shard_plans/allowed_counts {plans['allowed_counts']} are not the configurations' shard counts "
            f"{[c['shards'] for c in plans['configurations']]}"
        )
    if node := doc["node_plan"]:
        nodes = node["nodes_mb"]
        if problem := _ranges_problem(node["ranges"], node["detail"], count, len(nodes)):
            return f"node_plan: {problem}"
        if len(node["utilisation"]) != len(nodes):
            return f"node_plan has {len(node['utilisation'])} utilisation figures for {len(nodes)} nodes"
        for j, (shard, memory) in enumerate(zip(node["detail"], nodes)):
            if problem := _over(shard, None, memory):
                return f"node_plan/detail/{j}: {problem}"
    return None


def _ranges_problem(ranges: list, detail: list, blocks: int, shards: int) -> str | None:
    """A plan's [start, end) ranges: one per shard, contiguous, from 0 to `blocks`, each its detail's blocks."""
    if len(ranges) != shards or len(detail) != shards:
        return f"{shards} shards, but {len(ranges)} ranges and {len(detail)} details"
    ends = [0, *(end for _, end in ranges)]
    if [start for start, _ in ranges] != ends[:-1] or ends[-1] != blocks or any(a >= b for a, b in ranges):
        return f"ranges {ranges} are not contiguous ranges covering blocks 0 to {blocks}"
    if [d["blocks"] for d in detail] != [list(r) for r in ranges]:
        return f"ranges {ranges} differ from the detail's blocks {[d['blocks'] for d in detail]}"
    return None


def _over(shard: dict, max_shard_mb: float | None, memory_mb: float) -> str | None:
    """A shard's weights over max_shard_size_mb, or its total_mb over the memory it must fit."""
    if max_shard_mb is not None and shard["weight_bytes"] > max_shard_mb * MB:
        return f"weight_bytes {shard['weight_bytes']} is over max_shard_size_mb={max_shard_mb:g}"
    if shard["total_mb"] > memory_mb + ROUNDING_MB:
        return f"total_mb {shard['total_mb']:g} is over the {memory_mb:g} MB it must fit"
    return None


# --- building the document ------------------------------------------------------------------------


def _cut_point(
    name: str,
    index: int,
    symbolic: dict[str, Any],
    sizes: dict[str, int],
    seq_symbols: Any,
    reference_length: int,
) -> dict[str, Any]:
    """The .omny entry of the cut after block `index`: the tensor crossing it and its bytes per sample and token."""
    dtype, shape = symbolic.get(name, ("undefined", []))
    per_sample = sizes.get(name, 0)
    per_token = (
        per_sample / reference_len if (reference_len := _seq_len(shape, seq_symbols, reference_length)) else None
    )
    return {
        "name": name,
        "after_block": index,
        "dtype": dtype,
        "shape": shape,
        "bytes_per_sample": per_sample,
        "bytes_per_token": round(per_token, 3) if per_token else None,
    }


def describe(
    model: onnx.ModelProto,
    sample_input: dict[str, Any],
    settings: dict[str, Any] | None = None,
    runs: list[list[str]] | None = None,
    kv_cache_bytes: dict[str, int] | None = None,
    source: dict[str, Any] | None = None,
    sequence_axes: set[str] | None = None,
) -> dict[str, Any]:
    """The .omny document of an ONNX graph. `runs` (module paths of repeated blocks, from the
    LayerMap) keeps only the cuts at block boundaries; without it every cut that leaves weights
    on both sides is kept. `kv_cache_bytes` gives a decoder block's KV cache per token.
    `sequence_axes` names the axes per-sample figures put at the reference length (default: dim 1
    of the integer inputs, the token axis; a SAM2 decoder's prompt axis is none)."""
    settings = {**DEFAULTS, **(settings or {})}
    g = G.Graph(model)
    seq = _sequence_symbols(model) if sequence_axes is None else set(sequence_axes)
    sample = _check_sample(g, sample_input)
    symbolic = G.symbolic_shapes(model)
    parts, block_of = _pieces(g, symbolic, runs)
    batch, reference = _reference_shapes(g, sample, int(settings["reference_sequence_length"]), seq)
    ranges = {k: (v["low"], v["high"]) for k, v in sample.items() if "low" in v}
    sizes = G.concrete_shapes(model, reference, ranges)
    blocks, cut_points, done, stored = [], [], set(), []
    for index, piece in enumerate(parts):
        free, graph_inputs = g.free_inputs_needed(piece.nodes, () if piece.cut_after else g.outputs)
        stored.append(g.stored(piece.nodes + sorted(free)))
        entering = set(G.crossing(g, done)) if done else set()
        done |= set(piece.nodes)
        crossing = G.crossing(g, done) if piece.cut_after else list(g.outputs)  # in graph order
        leaving = set(crossing)
        name = block_of.get(piece.cut_after) if piece.cut_after else None
        name = name or _name(g, piece, index)
        blocks.append(
            {
                "index": index,
                "name": name,
                "role": _role(index, len(parts), name, block_of),
                "nodes": len(piece.nodes),
                "weight_bytes": sum(G.tensor_bytes(g.initializers[t]) for t in stored[-1]),
                "activation_bytes_per_sample": G.activation_peak(
                    g, piece.nodes + sorted(free), entering | graph_inputs, leaving, sizes
                ),
                "kv_cache_bytes_per_token": (kv_cache_bytes or {}).get(name),
                "cut_after": piece.cut_after,
            }
        )
        if piece.cut_after:
            reference_length = int(settings["reference_sequence_length"])
            cut = _cut_point(piece.cut_after, index, symbolic, sizes, seq, reference_length)
            cut_points.append(cut | _carried(piece.cut_after, crossing, sizes))
    doc = {
        "format": "omny",
        "format_version": FORMAT_VERSION,
        "exporter": _exporter(),
        "source_model": source
        or {"name": model.graph.name or "model", "framework": "onnx", "producer": model.producer_name},
        "opset": next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0),
        "inputs": [_signature(i, symbolic) | {"sample": sample[i]} for i in g.inputs],
        "outputs": [_signature(o, symbolic) for o in g.outputs],
        "reference": {"batch_size": batch, "input_shapes": reference},
        "blocks": blocks,
        "cut_points": cut_points,
    }
    shared = _shared(g, stored)
    doc["shard_plans"] = _shard_plans(g, parts, blocks, settings, shared)
    doc["node_plan"] = _node_plan(g, parts, blocks, settings, shared) if settings["nodes"] else None
    return doc


def _pieces(g: G.Graph, symbolic: dict, runs: list[list[str]] | None) -> tuple[list[G.Piece], dict[str, str]]:
    """The graph's blocks, and the block path each cut ends: at LayerMap block boundaries when `runs` is given,
    else at every cut that leaves weights on both sides."""
    cuts, anc, pos = G.cut_points(g)
    # a shard boundary needs the tensor's type; ops shape inference does not know leave it untyped
    typed = {t for t, (dtype, _) in symbolic.items() if dtype != "undefined"}
    cuts = [c for c in cuts if c in typed]
    if not runs:
        return G.pieces(g, G.merge_weightless(g, cuts, anc, pos), anc, pos), {}
    chosen = [c for c in G.select_block_cuts(g, runs, anc) if c[0] in typed]
    closures = {t: bits for t, _, bits in chosen}
    return G.pieces(g, [t for t, _, _ in chosen], anc, pos, closures), {t: path for t, path, _ in chosen}


def _carried(name: str, crossing: list[str], sizes: dict[str, int]) -> dict[str, Any]:
    """A cut that other tensors cross with (an earlier stage's output waiting for the neck): their names and the
    bytes of all of them."""
    if crossing == [name]:
        return {}
    return {"crossing": crossing, "crossing_bytes_per_sample": sum(sizes.get(t, 0) for t in crossing)}


def _shared(g: G.Graph, stored: list[set[str]]) -> shards.Shared:
    """What two blocks both store (a tied embedding: the prefix's table is the head's matrix), as (block, the next
    block storing it, bytes): a shard holding both stores it once, as its extracted ONNX does."""
    last: dict[str, int] = {}
    out = []
    for index, names in enumerate(stored):
        for name in sorted(names):
            if name in last:
                out.append((last[name], index, G.tensor_bytes(g.initializers[name])))
            last[name] = index
    return out


def _shard_plans(
    g: G.Graph, parts: list[G.Piece], blocks: list[dict], settings: dict, shared: shards.Shared
) -> dict[str, Any]:
    """Planned with what each shard stores (each weight once), the figure its detail gives and validate checks."""
    planned = shards.plan_shards(
        _planner_blocks(blocks),
        max_shard_size_mb=float(settings["max_shard_size_mb"]),
        min_vram_mb=float(settings["min_vram_mb"]),
        headroom_mb=float(settings["headroom_mb"]),
        counts=list(settings["shard_counts"]) if settings["shard_counts"] else None,
        max_configs=int(settings["max_configs"]),
        shared=shared,
    )
    return {
        "max_shard_size_mb": float(settings["max_shard_size_mb"]),
        "min_vram_mb": float(settings["min_vram_mb"]),
        "headroom_mb": float(settings["headroom_mb"]),
        "allowed_counts": [p["shards"] for p in planned],
        "configurations": [
            {
                "shards": p["shards"],
                "ranges": p["ranges"],
                "detail": _detail(g, parts, p["ranges"], p["total_mb"]),
            }
            for p in planned
        ],
    }


def _node_plan(
    g: G.Graph, parts: list[G.Piece], blocks: list[dict], settings: dict, shared: shards.Shared
) -> dict[str, Any]:
    nodes = [float(m) for m in settings["nodes"]]
    headroom = float(settings["headroom_mb"])
    planned = shards.plan_nodes(_planner_blocks(blocks), nodes, headroom_mb=headroom, shared=shared)
    return {
        "nodes_mb": nodes,
        "method": planned["method"],
        "ranges": planned["ranges"],
        "utilisation": planned["utilisation"],
        "detail": _detail(g, parts, planned["ranges"], planned["total_mb"]),
    }


def _planner_blocks(blocks: list[dict]):

    return [shards.Block(b["name"], b["weight_bytes"], b["activation_bytes_per_sample"]) for b in blocks]


def _detail(g: G.Graph, parts: list[G.Piece], ranges: list[list[int]], totals: list[float]) -> list[dict]:
    """What each shard of a partition reads, writes, passes on, and the exact weights it holds."""
    out, done = [], set()
    for (start, end), total in zip(ranges, totals):
        before = G.crossing(g, done) if done else []
        nodes = [n for p in parts[start:end] for n in p.nodes]
        done |= set(nodes)
        free, graph_inputs = g.free_inputs_needed(nodes, g.outputs if end == len(parts) else ())
        read = {t for n in nodes for t in G.node_inputs(g.nodes[n])}
        after = G.crossing(g, done) if end < len(parts) else list(g.outputs)
        out.append(
            {
                "blocks": [start, end],
                "inputs": [i for i in g.inputs if i in graph_inputs] + [t for t in before if t in read],
                "outputs": [t for t in after if t not in before],
                "carry": [t for t in before if t in after],  # passed on to a later shard (read here or not)
                "weight_bytes": g.stored_bytes(nodes + sorted(free)),
                "total_mb": total,
            }
        )
    return out


def _check_sample(g: G.Graph, sample_input: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The sample's shape and value range per graph input, after checking it fits the graph."""
    import numpy as np

    declared = {i.name: i for i in g.model.graph.input}
    missing = [n for n in g.inputs if n not in sample_input]
    extra = [n for n in sample_input if n not in declared]
    if missing or extra:
        raise UserError(
            f"sample input names {sorted(sample_input)} do not match the graph's inputs {g.inputs}"
            f"{' (missing ' + ', '.join(missing) + ')' if missing else ''}"
            f"{' (unknown ' + ', '.join(extra) + ')' if extra else ''}."
        )
    out = {}
    for name in g.inputs:
        value = np.asarray(_numpy(sample_input[name]))
        dims = declared[name].type.tensor_type.shape.dim
        want = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in dims]
        if len(want) != value.ndim or any(isinstance(w, int) and w != v for w, v in zip(want, value.shape)):
            raise UserError(f"sample input '{name}' has shape {list(value.shape)}, but the graph expects {want}.")
        if 0 in value.shape:  # empty outputs would always match: validate could never fail
            raise UserError(
                f"sample input '{name}' has shape {list(value.shape)}, which holds nothing; give at least one "
                "element along every axis."
            )
        takes = onnx.helper.tensor_dtype_to_np_dtype(declared[name].type.tensor_type.elem_type)
        if (np.dtype(takes).kind in "iub") != (value.dtype.kind in "iub"):  # integers (or booleans) or not
            # float ids (numpy's default dtype) would be recorded without their range, and validate fed garbage
            raise UserError(
                f"sample input '{name}' is {value.dtype}, but the graph takes {takes}; give it as {takes} "
                f"(e.g. np.asarray(x, np.{takes}))."
            )
        entry: dict[str, Any] = {"shape": list(value.shape)}
        if np.issubdtype(value.dtype, np.integer) or value.dtype == bool:
            entry.update(low=int(value.min()), high=int(value.max()) + 1)
        out[name] = entry
    return out


def _numpy(value: Any):
    return value.detach().cpu().numpy() if hasattr(value, "detach") else value


def _sequence_symbols(model: onnx.ModelProto) -> set[str]:
    """Dim 1 of integer (token) inputs: the sequence axes."""
    out = set()
    for i in model.graph.input:
        t = i.type.tensor_type
        token_ids = t.elem_type in (onnx.TensorProto.INT64, onnx.TensorProto.INT32)
        if token_ids and len(t.shape.dim) >= 2 and t.shape.dim[1].dim_param:
            out.add(t.shape.dim[1].dim_param)
    return out


def _reference_shapes(
    g: G.Graph, sample: dict[str, dict], sequence_length: int, seq: set[str]
) -> tuple[int, dict[str, list[int]]]:
    """The batch size per-sample figures are at, and the sample's shapes there, with every sequence axis at the
    reference length: batch 1, unless the graph fixes the first axis of its inputs above 1 (a model whose code
    specialised the batch while it was traced runs at no other): then that size, the figures' true batch. Only
    inputs of rank 2 or more tell, and only when none of them has a free first axis: a 1-D side input (a
    per-channel gain [256]) has no batch axis, and its size is not the batch. Nor does its free axis take the
    batch when it is named other than every batch axis (a gain [channels] beside x [batch, channels])."""
    inputs = [i for i in g.model.graph.input if i.name in sample]
    firsts = [i.type.tensor_type.shape.dim[0] for i in inputs if len(i.type.tensor_type.shape.dim) >= 2]
    free = [d for d in firsts if not d.HasField("dim_value")]
    batch = 1 if free else max([1, *(d.dim_value for d in firsts)])
    batch_names = {d.dim_param for d in free}
    out = {}
    for i in inputs:
        shape = list(sample[i.name]["shape"])
        dims = i.type.tensor_type.shape.dim
        for k, d in enumerate(dims):
            side = len(dims) == 1 and bool(d.dim_param) and bool(batch_names) and d.dim_param not in batch_names
            if k == 0 and not d.HasField("dim_value") and not side:
                shape[k] = batch
            elif d.dim_param in seq:
                shape[k] = sequence_length
        out[i.name] = shape
    return batch, out


def _seq_len(shape: list, seq_symbols: set[str], sequence_length: int) -> int | None:
    """The reference sequence length when this (symbolic) shape has a sequence axis."""
    return sequence_length if any(isinstance(d, str) and d in seq_symbols for d in shape) else None


def _signature(name: str, symbolic: dict) -> dict[str, Any]:
    dtype, shape = symbolic.get(name, ("undefined", []))
    return {"name": name, "dtype": dtype, "shape": shape}


def _name(g: G.Graph, piece: G.Piece, index: int) -> str:
    """A block's name: its module (from the exporter's scopes) or its weights' common prefix."""
    modules = []
    for n in piece.nodes:
        if g.weights_of(n):
            scopes = [s for s in g.scopes(n)[:-1] if s]
            if scopes:
                modules.append(_strip_wrapper(scopes[-1]))
    if not modules:
        modules = sorted(w.rsplit(".", 1)[0] for w in piece.weights if "." in w)
    tops = list(dict.fromkeys(modules))
    if not tops:
        return f"segment {index}"
    common = tops[0]
    for m in tops[1:]:
        while common and not (m == common or m.startswith(common + ".")):
            common = common.rsplit(".", 1)[0] if "." in common else ""
    return common if common else ", ".join(tops[:3]) + (" ..." if len(tops) > 3 else "")


def _strip_wrapper(scope: str) -> str:
    """torch.onnx's scopes start with the export wrapper's attribute (onnx_export's NamedOutputs.model); drop it."""
    prefix = "model."
    return scope[len(prefix) :] if scope.startswith(prefix) else scope


def _role(index: int, count: int, name: str, block_of: dict) -> str:
    if name in set(block_of.values()) - {""}:
        return "block"
    if not block_of:
        return "segment"
    return "prefix" if index == 0 else "suffix" if index == count - 1 else "between"


def _exporter() -> dict[str, str]:
    from importlib.metadata import version

    return {"name": "onn", "version": onn_version(), "onnx": onnx.__version__, "torch": version("torch")}


# --- writing and reading --------------------------------------------------------------------------


def _check_output(output: Path) -> None:
    """The .omny file to write: in a folder that exists, and not itself a folder."""
    if output.is_dir():
        raise UserError(f"output {output} is a folder; name the .omny file to write, e.g. {output / 'model.omny'}.")
    if not output.parent.is_dir():
        raise UserError(
            f"export output {output}: the folder {output.parent} does not exist; create it or choose another path."
        )


def write(model: onnx.ModelProto, doc: dict[str, Any], output: str | Path) -> Path:
    """The model with its document in metadata_props, written beside `output` then moved into place (a weights
    file of its own first, the graph last: onnx_export.move_into_place)."""
    output = Path(output)
    _check_output(output)
    check_document(doc, str(output))
    props = {p.key: p.value for p in model.metadata_props}  # other tools' metadata stays
    props[METADATA_KEY] = json.dumps(doc, separators=(",", ":"), allow_nan=False)  # JSON has no inf or NaN
    onnx.helper.set_model_props(model, props)
    stored = sum(G.tensor_bytes(t) for t in model.graph.initializer)
    sweep_leftovers(output)  # a killed export's staged graph, which may hold all the weights
    with tempfile.TemporaryDirectory(dir=output.parent, prefix=Path(temp_prefix(output)).name + "-") as tmp:
        written = Path(tmp) / staged_name(output)  # its weights file, when it has one, is named after it
        large = stored > EXTERNAL_DATA_BYTES
        onnx.save_model(model, str(written), save_as_external_data=large, location=written.name + ".data")
        move_into_place(written, output)
    return output


def read_document(source: str | Path | onnx.ModelProto, where: str | None = None) -> dict[str, Any]:
    """The document of a .omny file: present, parseable, of a version this reader knows, and valid.
    `where` names it in messages (the file's path; a model given in memory has none of its own)."""
    where = where or (str(source) if not isinstance(source, onnx.ModelProto) else "the model")
    model = source if isinstance(source, onnx.ModelProto) else _load(source, weights=False)
    raw = next((p.value for p in model.metadata_props if p.key == METADATA_KEY), None)
    if raw is None:
        raise UserError(
            f"{where} has no .omny metadata (no '{METADATA_KEY}' in metadata_props); "
            "make one with enrich_onnx or task=export export=omny."
        )
    try:
        doc = json.loads(raw, parse_constant=lambda word: _not_finite(where, word))
    except json.JSONDecodeError as e:
        raise UserError(
            f"{where}: the .omny metadata is not valid JSON ({e.msg} at character {e.pos}); re-export the file."
        ) from None
    version = str(doc.get("format_version", "")) if isinstance(doc, dict) else ""
    major, _, minor = version.partition(".")
    if not major.isdigit():
        raise UserError(f"{where}: the .omny metadata has no format_version; re-export the file.")
    ours = [int(v) for v in FORMAT_VERSION.split(".")]
    if int(major) > ours[0]:
        raise UserError(
            f"{where} is .omny format {version}, newer than this ONN reads ({FORMAT_VERSION}); upgrade onn."
        )
    newer_minor = int(major) == ours[0] and minor.isdigit() and int(minor) > ours[1]
    check_document(doc, where, newer_minor=newer_minor)
    return doc


def _not_finite(where: str, word: str) -> Any:
    """Python's json reads NaN and Infinity, which the writer never writes and every limit check lets through."""
    raise UserError(f"{where}: the .omny metadata holds {word}, which is no finite number; re-export the file.")


def _load(path: str | Path, weights: bool = True) -> onnx.ModelProto:
    """The ONNX file at `path`, held to onnx.checker; without `weights`, its graph and metadata alone, read whether
    or not its weights file is there (onnx.checker would look for it)."""
    path = Path(path)
    if path.is_dir():
        inside = sorted(p.name for p in path.iterdir() if p.suffix in (".omny", ".onnx") or p.name == "pipeline.json")
        hint = f" (it holds {', '.join(inside[:3])})" if inside else ""
        raise UserError(f"{path} is a folder, not an ONNX file; name the file in it{hint}.")
    if not path.is_file():
        raise UserError(f"{path} does not exist.")
    if weights:
        return check_onnx(path)
    try:
        return onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf's DecodeError: not an ONNX file
        raise UserError(f"{path} is not a readable ONNX file ({type(e).__name__}: {e}); re-export it.") from None


# --- inspect ----------------------------------------------------------------------------------------


@dataclass
class OmnyInfo:
    path: str
    document: dict[str, Any]

    @property
    def blocks(self) -> list[dict]:
        return self.document["blocks"]

    @property
    def cut_points(self) -> list[dict]:
        return self.document["cut_points"]

    @property
    def shard_plans(self) -> dict:
        return self.document["shard_plans"]

    def summary(self) -> str:
        d = self.document
        src = d["source_model"]
        lines = [
            f"{self.path}: .omny {d['format_version']} by {d['exporter']['name']} {d['exporter']['version']}, "
            f"opset {d['opset']}, from {src.get('class') or src.get('name')} ({src.get('framework', '?')})",
            "inputs:  " + "; ".join(f"{s['name']} {s['dtype']} {_dims(s['shape'])}" for s in d["inputs"]),
            "outputs: " + "; ".join(f"{s['name']} {s['dtype']} {_dims(s['shape'])}" for s in d["outputs"]),
            f"reference shape (per-sample figures, batch {d['reference']['batch_size']}): "
            + ", ".join(f"{k} {v}" for k, v in d["reference"]["input_shapes"].items()),
            "",
            f"blocks ({len(d['blocks'])}) and the cut point after each",
            f"  {'#':>3}  {'block':<34} {'weights':>10} {'activations':>12} {'KV/token':>9}  cut point",
        ]
        cuts = {c["after_block"]: c for c in d["cut_points"]}
        for b in d["blocks"]:
            c = cuts.get(b["index"])
            cut = (
                (
                    f"{c['name']} {c['dtype']} {_dims(c['shape'])}, {_bytes(c['bytes_per_sample'])}/sample"
                    + (f", {_bytes(c['bytes_per_token'])}/token" if c["bytes_per_token"] else "")
                )
                if c
                else "-"
            )
            kv = _bytes(b["kv_cache_bytes_per_token"]) if b["kv_cache_bytes_per_token"] else "-"
            lines.append(
                f"  {b['index']:>3}  {b['name'][:34]:<34} {_bytes(b['weight_bytes']):>10} "
                f"{_bytes(b['activation_bytes_per_sample']):>12} {kv:>9}  {cut}"
            )
        p = d["shard_plans"]
        lines += [
            "",
            f"shard plans: weights <= {p['max_shard_size_mb']:g} MB per shard, weights + activations + "
            f"{p['headroom_mb']:g} MB headroom <= {p['min_vram_mb']:g} MB; allowed counts {p['allowed_counts']}",
            "  (each shard: [first block, end) weights/total MB)",
        ]
        for conf in p["configurations"]:
            lines.append(f"  {conf['shards']} shard{'s' if conf['shards'] > 1 else ''}: " + _ranges(conf["detail"]))
        if d["node_plan"]:
            n = d["node_plan"]
            lines += ["", f"node plan ({n['method']}) over {len(n['nodes_mb'])} nodes:"]
            for mb, util, det in zip(n["nodes_mb"], n["utilisation"], n["detail"]):
                a, b = det["blocks"]
                lines.append(
                    f"  {mb:>7g} MB  blocks [{a}, {b})  weights {_bytes(det['weight_bytes'])}, "
                    f"total {det['total_mb']:g} MB ({util:.0%})"
                )
        return "\n".join(lines)


def inspect_omny(path: str | Path) -> OmnyInfo:
    return OmnyInfo(str(path), read_document(path))


def _ranges(detail: list[dict]) -> str:
    return "  ".join(
        f"[{a}, {b}) {_bytes(d['weight_bytes'])}/{d['total_mb']:g} MB" for d in detail for a, b in [d["blocks"]]
    )


def _dims(shape: list) -> str:
    return "[" + ", ".join(str(d) if d is not None else "?" for d in shape) + "]"


def _bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:g} B"


# --- validate ---------------------------------------------------------------------------------------


def sample_feeds(doc: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    """A sample input like the exporter's: its shapes, integers within its value range."""
    import numpy as np

    rng = np.random.default_rng(seed)
    feeds = {}
    for s in doc["inputs"]:
        dtype = np.dtype(s["dtype"])
        shape = s["sample"]["shape"]
        if "low" in s["sample"]:
            feeds[s["name"]] = rng.integers(s["sample"]["low"], s["sample"]["high"], size=shape).astype(dtype)
        else:
            feeds[s["name"]] = rng.standard_normal(shape).astype(dtype)
    return feeds


@dataclass
class Validation:
    """What validate found: whether everything holds (the object is truthy then) and the largest difference any
    plan's shards made against the whole model."""

    ok: bool
    max_abs_diff: float

    def __bool__(self) -> bool:
        return self.ok


def validate(
    path: str | Path, sample_input: dict[str, Any] | None = None, atol: float = 1e-4, echo=print
) -> Validation:
    """Cut the model at every plan's boundaries, run the shards in sequence, compare with the whole
    model; check each shard's weights against the document. True when all of it holds."""
    model = _load(path)
    doc = read_document(model, where=str(path))
    if missing := unknown_tensors(model, doc):
        echo(f"{path}: the document names tensors the graph does not have: {', '.join(missing[:4])}")
        echo(f"{path}: INVALID")
        return Validation(False, float("nan"))  # no shard ran: no difference was measured
    feeds = {k: _numpy(v) for k, v in (sample_input or sample_feeds(doc)).items()}
    level = _comparison_level()
    whole = run_onnx(str(path), feeds, optimization=level)  # from the file: over 2 GB cannot be serialised again
    extractor = subgraph_extractor(model)
    ok = _blocks_hold_their_weights(doc, extractor, path, echo)
    plans = [
        (f"{c['shards']} shard{'s' if c['shards'] > 1 else ''}", c["detail"], doc["shard_plans"]["max_shard_size_mb"])
        for c in doc["shard_plans"]["configurations"]
    ]
    if doc["node_plan"]:
        plans.append((f"node plan over {doc['node_plan']['nodes_mb']} MB", doc["node_plan"]["detail"], None))
    largest = 0.0
    for title, detail, limit in plans:
        echo(f"{path}: {title}")
        echo(f"  {'shard':>5}  {'blocks':<10} {'weights (doc)':>14} {'weights (file)':>15}  inputs -> outputs")
        env = dict(feeds)
        for k, shard in enumerate(detail):
            try:  # a document naming tensors the graph lacks, or inputs no earlier shard made, is invalid
                part = extractor.extract_model(shard["inputs"], shard["outputs"])
                actual = _stored_bytes(part)
                env.update(run_onnx(part, {n: env[n] for n in shard["inputs"]}, optimization=level))
            except (KeyError, ValueError, TypeError, UserError) as e:
                echo(f"  {k:>5}  cannot be cut or run as the document says: {type(e).__name__}: {e}")
                ok = False
                break
            size_ok = actual == shard["weight_bytes"] and (limit is None or actual <= limit * MB)
            a, b = shard["blocks"]
            carried = f" (passes on {', '.join(shard['carry'])})" if shard["carry"] else ""
            mark = (
                ""
                if size_ok
                else "  <- weights differ from the document"
                if actual != shard["weight_bytes"]
                else "  <- over max_shard_size_mb"
            )
            echo(
                f"  {k:>5}  [{a}, {b}){'':<{max(0, 6 - len(str(a)) - len(str(b)))}} "
                f"{_bytes(shard['weight_bytes']):>14} {_bytes(actual):>15}  "
                f"{', '.join(shard['inputs'])} -> {', '.join(shard['outputs'])}{carried}{mark}"
            )
            ok &= size_ok
        else:  # every shard ran: compare the end result with the whole model's
            if missing := [o for o in whole if o not in env]:
                echo(f"  the shards never produce {', '.join(missing)}")
                ok = False
                continue
            diffs = [_max_diff(env[o], whole[o]) for o in whole]
            worst = max(diffs, default=0.0)
            largest = max(largest, worst)
            ok &= worst <= atol
            echo(f"  max abs diff against the whole model: {worst:.3g} ({'ok' if worst <= atol else f'over {atol:g}'})")
    echo(f"{path}: {'valid' if ok else 'INVALID'}")
    return Validation(bool(ok), largest)


def _comparison_level() -> ort.GraphOptimizationLevel:
    """The onnxruntime optimization level validate runs the whole model and the shards at: none. Fusions see
    different graphs in a shard and in the whole model (a QDQ model's DequantizeLinear + MatMul is fused one way
    when the MatMul reads a graph input, another when it reads an intermediate; basic already fuses Conv with a
    BatchNorm a cut may separate), so their rounding differs; without them both run the same nodes with the same
    kernels, and the comparison stays exact."""
    import onnxruntime as ort

    return ort.GraphOptimizationLevel.ORT_DISABLE_ALL


def _blocks_hold_their_weights(doc: dict[str, Any], extractor, path, echo) -> bool:
    """Each block cut out alone (from the tensors crossing the cut before it to those crossing the cut after it)
    stores exactly its weight_bytes; the blocks the document's figures are wrong for are named."""
    crossing = {c["after_block"]: c.get("crossing") or [c["name"]] for c in doc["cut_points"]}
    inputs, outputs = [s["name"] for s in doc["inputs"]], [s["name"] for s in doc["outputs"]]
    wrong, before = [], []
    for block in doc["blocks"]:
        after = crossing.get(block["index"], outputs) if block["cut_after"] else outputs
        try:
            part = extractor.extract_model(inputs + before, [t for t in after if t not in before])
            actual = _stored_bytes(part)
        except (KeyError, ValueError, TypeError) as e:
            echo(f"{path}: block {block['index']} cannot be cut out as the document says: {type(e).__name__}: {e}")
            return False
        if actual != block["weight_bytes"]:
            wrong.append(f"block {block['index']} '{block['name']}' says {block['weight_bytes']}, stores {actual}")
        before = [t for t in after if t not in inputs]
    for line in wrong:
        echo(f"{path}: weight_bytes differ from the graph: {line}")
    return not wrong


def subgraph_extractor(model: onnx.ModelProto):
    """onnx's Extractor, following the outer tensors subgraphs read (the bodies of Scan, Loop and If): onnx's own
    follows node inputs only, so a shard holding an LSTM's Scan lost the weights its body reads, and no plan of a
    recurrent model could run (onnx 1.23). A shard stores what graph.node_inputs counts, as `weight_bytes` says."""
    from onnx.utils import Extractor

    class SubgraphExtractor(Extractor):
        def _dfs_search_reachable_nodes(self, node_output_name, graph_input_names, reachable) -> None:
            stack = [node_output_name]
            while stack:
                name = stack.pop()
                if name in graph_input_names or name not in self.outmap or self.outmap[name] in reachable:
                    continue
                reachable.add(self.outmap[name])
                stack += G.node_inputs(self.graph.node[self.outmap[name]])

        def _collect_reachable_tensors(self, nodes):
            initializer, value_info = super()._collect_reachable_tensors(nodes)
            taken, read = {t.name for t in initializer}, {n for node in nodes for n in G.node_inputs(node)}
            return initializer + [t for n, t in self.initializers.items() if n in read and n not in taken], value_info

    return SubgraphExtractor(model)


def _max_diff(got, want) -> float:
    """Max |got - want|; equal values agree, infinities included (a detector's masked logits are -inf)."""
    import numpy as np

    if not got.size:
        return 0.0
    got, want = got.astype(np.float64), want.astype(np.float64)
    with np.errstate(invalid="ignore"):
        diff = np.abs(got - want)
    diff[got == want] = 0.0
    return float(np.nan_to_num(diff, nan=np.inf).max())


def unknown_tensors(model: onnx.ModelProto, doc: dict[str, Any]) -> list[str]:
    """Tensors the document names (cut points, blocks' cut_after, the graph's inputs and outputs) that the graph
    lacks."""
    graph = model.graph
    tensors = (
        {i.name for i in graph.input} | {t.name for t in graph.initializer} | {o for n in graph.node for o in n.output}
    )
    named = [c["name"] for c in doc["cut_points"]] + [b["cut_after"] for b in doc["blocks"] if b["cut_after"]]
    named += [s["name"] for s in doc["inputs"]] + [s["name"] for s in doc["outputs"]]
    return [n for n in dict.fromkeys(named) if n not in tensors]


def _stored_bytes(model: onnx.ModelProto) -> int:
    """What an extracted shard stores: its initializers and the values of its Constant nodes."""
    constants = [
        n.attribute[0].t
        for n in model.graph.node
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"
    ]
    return sum(G.tensor_bytes(t) for t in [*model.graph.initializer, *constants])


# --- entry points -----------------------------------------------------------------------------------


def enrich_onnx(
    onnx_path: str | Path,
    output: str | Path,
    sample_input: dict[str, Any] | None = None,
    config: dict[str, Any] | None = None,
    dims: dict[str, int] | None = None,
) -> Path:
    """Make a .omny of an ONNX file made elsewhere: cut points come from the graph itself.

    Nodes that compute from constants alone are folded into initializers first (weights a graph builds with
    ConstantOfShape count as weights, and blocks can hold them). Without `sample_input`, one is made from
    the graph's declared input shapes (see declared_sample; `dims` sizes its named dimensions)."""
    _check_output(Path(output))  # before the graph is read and described, not after
    if dims and sample_input is not None:
        raise UserError("--dim sizes the sample made from the graph's shapes; with --sample give only the sample.")
    model, folded = G.fold_constants(_load(onnx_path))
    _check_dims(model, dims or {})
    if folded:
        print(
            f"{onnx_path}: folded {folded} node(s) that compute from constants alone into initializers",
            flush=True,
        )
    model = _with_shapes(model)
    doc = describe(model, sample_input if sample_input is not None else declared_sample(model, dims), config)
    return write(model, doc, output)


def _check_dims(model: onnx.ModelProto, dims: dict[str, int]) -> None:
    """A --dim names one of the graph's named input dimensions: another name would size nothing, silently."""
    named = {d.dim_param for v in model.graph.input for d in v.type.tensor_type.shape.dim if d.dim_param}
    for name in dims:
        if name not in named:
            raise UserError(
                f"--dim {name}: the graph's inputs have no dimension named {name!r}; "
                f"its named dimensions are {', '.join(sorted(named)) or 'none (every size is fixed)'}."
            )


def declared_sample(model: onnx.ModelProto, dims: dict[str, int] | None = None) -> dict[str, Any]:
    """A sample input from the graph's declared input shapes: a named or unknown dimension is `dims[name]`,
    else 1 for the first (the batch) and SAMPLE_DIM for the others. Floats are standard normal; integers and
    booleans are ones (a valid token id, a full attention mask)."""
    import numpy as np

    dims = dims or {}
    rng = np.random.default_rng(0)
    initializers = {t.name for t in model.graph.initializer}
    sample = {}
    for value in model.graph.input:
        if value.name in initializers:
            continue  # an initializer listed as an input (older exporters): not fed
        tensor = value.type.tensor_type
        shape = []
        for k, d in enumerate(tensor.shape.dim):
            if d.HasField("dim_value") and d.dim_value > 0:
                shape.append(d.dim_value)
            elif d.dim_param in dims:
                shape.append(int(dims[d.dim_param]))
            else:
                shape.append(1 if k == 0 else SAMPLE_DIM)
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type)
        if np.issubdtype(dtype, np.floating):
            sample[value.name] = rng.standard_normal(shape).astype(dtype)
        else:
            sample[value.name] = np.ones(shape, dtype)
    return sample


def _with_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """Shards need the type of every tensor they pass; fill value_info in when the file lacks it."""
    described = {v.name for v in [*model.graph.value_info, *model.graph.output, *model.graph.input]}
    made = {o for n in model.graph.node for o in n.output if o}
    if made <= described:
        return model
    return onnx.shape_inference.infer_shapes(model)
