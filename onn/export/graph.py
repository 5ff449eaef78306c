"""Where an ONNX graph can be cut, and what each piece between two cuts needs.

A cut point is a tensor that crosses from one side of the graph to the other alone: everything
computed to produce it is used only to produce it. Removing it splits the graph in two, so the
model can run as two programs that pass that one tensor between them.

Tensors computed from the model's inputs and small constants alone (attention masks, position
ids, rotary tables) are *free*: every piece recomputes what it needs from the inputs, so they
never have to cross. Whatever holds a weight (an initializer of rank >= 2 in a floating or
quantized type) is never free.

Pieces between consecutive cuts are the document's blocks. With module scopes (what
torch.onnx.export records for each node), the exporter keeps only the cuts at LayerMap block
boundaries; for a graph made elsewhere, every cut is kept that leaves a weight on each side.
"""

from __future__ import annotations

import ast
import contextlib
import logging
import math
import tempfile
from dataclasses import dataclass, field
from typing import Any

import onnx
from onnx import TensorProto

from onn.errors import UserError

log = logging.getLogger("onn")

WEIGHT_TYPES = {
    TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE, TensorProto.INT8,
    TensorProto.UINT8, TensorProto.INT4, TensorProto.UINT4, TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E5M2,
}  # fmt: skip
SCOPES_KEY = "pkg.torch.onnx.name_scopes"  # torch.onnx.export's module path of each node


def dtype_name(elem_type: int) -> str:
    return onnx.helper.tensor_dtype_to_np_dtype(elem_type).name if elem_type else "undefined"


def itemsize(elem_type: int) -> float:
    if elem_type in (TensorProto.INT4, TensorProto.UINT4):
        return 0.5
    return onnx.helper.tensor_dtype_to_np_dtype(elem_type).itemsize


def tensor_bytes(t: TensorProto) -> int:
    return math.ceil(math.prod(t.dims) * itemsize(t.data_type))


def is_weight(t: TensorProto) -> bool:
    return len(t.dims) >= 2 and t.data_type in WEIGHT_TYPES and math.prod(t.dims) > 1


@dataclass
class Piece:
    """The nodes between two consecutive cuts (or before the first / after the last)."""

    nodes: list[int]  # non-free node indices, in graph order
    weights: set[str]  # weight initializers its nodes read
    cut_after: str | None  # the cut point that ends it (None for the last piece)
    name: str = ""
    role: str = "block"  # prefix | block | suffix | segment


@dataclass
class Graph:
    """Indexes over one ONNX graph: who produces and who consumes each tensor, and what is free."""

    model: onnx.ModelProto
    nodes: list = field(init=False)
    producer: dict[str, int] = field(init=False)
    consumers: dict[str, list[int]] = field(init=False)
    initializers: dict[str, TensorProto] = field(init=False)
    inputs: list[str] = field(init=False)
    outputs: list[str] = field(init=False)
    free_tensors: set[str] = field(init=False)
    free_nodes: set[int] = field(init=False)

    def __post_init__(self) -> None:
        g = self.model.graph
        self.nodes = list(g.node)
        self.initializers = {t.name: t for t in g.initializer}
        for node in self.nodes:  # constants made by Constant nodes count as initializers
            if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
                self.initializers.setdefault(node.output[0], node.attribute[0].t)
        self.inputs = [i.name for i in g.input if i.name not in self.initializers]
        self.outputs = [o.name for o in g.output]
        self.producer = {name: i for i, node in enumerate(self.nodes) for name in node.output if name}
        # Nodes no output depends on run in no shard (onnx's extractor drops them): leave them out.
        live, stack = set(), [self.producer[o] for o in self.outputs if o in self.producer]
        while stack:
            i = stack.pop()
            if i not in live:
                live.add(i)
                stack.extend(self.producer[t] for t in node_inputs(self.nodes[i]) if t in self.producer)
        self.consumers = {}
        for i in sorted(live):
            for name in node_inputs(self.nodes[i]):
                self.consumers.setdefault(name, []).append(i)
        self.free_tensors = set(self.inputs) | {
            "",
            *(n for n, t in self.initializers.items() if not is_weight(t)),
        }
        self.free_nodes = {i for i in range(len(self.nodes)) if i not in live}  # (dead: never cut, never stored)
        for i, node in enumerate(self.nodes):
            if i not in live:
                continue
            held = self.initializers.get(node.output[0]) if node.op_type == "Constant" else None
            if held is not None and is_weight(held):
                continue  # a weight stored as a Constant node
            if all(name in self.free_tensors for name in node_inputs(node)):
                self.free_nodes.add(i)
                self.free_tensors.update(o for o in node.output if o)

    def stored(self, nodes) -> set[str]:
        """Every initializer (and Constant value) these nodes read: what a shard holding them stores."""
        return {n for i in nodes for n in node_inputs(self.nodes[i]) if n in self.initializers}

    def stored_bytes(self, nodes) -> int:
        return sum(tensor_bytes(self.initializers[n]) for n in self.stored(nodes))

    def weights_of(self, i: int) -> set[str]:
        return {n for n in node_inputs(self.nodes[i]) if n in self.initializers and is_weight(self.initializers[n])}

    def scopes(self, i: int) -> list[str]:
        for p in self.nodes[i].metadata_props:
            if p.key == SCOPES_KEY:
                try:
                    return [str(s) for s in ast.literal_eval(p.value)]
                except (ValueError, SyntaxError):
                    return []
        return []

    def free_inputs_needed(self, nodes: list[int], tensors: list[str] = ()) -> tuple[set[int], set[str]]:
        """The free nodes and graph inputs that `nodes` (and `tensors`) need: a piece recomputes these itself."""
        free, graph_inputs = set(), set()
        stack = [n for i in nodes for n in node_inputs(self.nodes[i])] + list(tensors)
        inputs = set(self.inputs)
        while stack:
            name = stack.pop()
            if name in inputs:
                graph_inputs.add(name)
                continue
            p = self.producer.get(name)
            if p is not None and p in self.free_nodes and p not in free:
                free.add(p)
                stack.extend(node_inputs(self.nodes[p]))
        return free, graph_inputs


def node_inputs(node) -> list[str]:
    """A node's inputs, with the outer tensors its subgraphs (If, Loop, Scan) read."""
    names = [n for n in node.input if n]
    for attr in node.attribute:
        for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
            names.extend(_outer_names(sub))
    return names


def _outer_names(graph) -> list[str]:
    defined = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    defined |= {o for n in graph.node for o in n.output}
    used = [name for n in graph.node for name in node_inputs(n)]
    return [n for n in used if n not in defined]


def cut_points(g: Graph) -> tuple[list[str], dict[int, int], dict[int, int]]:
    """Every tensor that crosses alone, in graph order, with the ancestor bitsets that prove it.

    Bitsets over the non-free nodes: anc[n] is n and everything it depends on; esc[n] is every
    node that reads a tensor made in anc[n]. The output T of node p crosses alone when the
    tensors made by p's ancestors are read only inside anc[p], none of them is a graph output,
    and T is p's only used output. Returns (cuts, anc, pos): pos numbers the non-free nodes.
    """
    order = [i for i in range(len(g.nodes)) if i not in g.free_nodes]
    pos = {n: k for k, n in enumerate(order)}
    outputs = set(g.outputs)
    anc, esc, leaks, cuts = {}, {}, {}, []
    for n in order:
        parents = {g.producer[t] for t in node_inputs(g.nodes[n]) if t in g.producer} - g.free_nodes
        a, e, leak = 1 << pos[n], 0, False
        for q in parents:
            a |= anc[q]
            e |= esc[q]
            leak = leak or leaks[q]
        readers = 0
        for t in g.nodes[n].output:
            for c in g.consumers.get(t, []):
                readers |= 1 << pos[c]
        used = [t for t in g.nodes[n].output if t and (g.consumers.get(t) or t in outputs)]
        holds_weight = g.nodes[n].op_type == "Constant"
        if len(used) == 1 and used[0] not in outputs and not leak and not (e & ~a) and not holds_weight:
            cuts.append(used[0])
        anc[n], esc[n] = a, e | readers
        leaks[n] = leak or any(t in outputs for t in g.nodes[n].output)
    return cuts, anc, pos


def pieces(
    g: Graph, cuts: list[str], anc: dict[int, int], pos: dict[int, int], closures: dict[str, int] | None = None
) -> list[Piece]:
    """Split the non-free nodes at `cuts` (in graph order): piece i holds what cut i needs that no
    earlier cut did; the last piece holds the rest (the suffix and any parallel branch's tail).
    `closures` gives a cut that other tensors cross with (a block with two outputs) the nodes before it."""
    order = sorted(pos, key=pos.get)
    done, out = 0, []
    for cut in cuts:
        closure = done | (closures or {}).get(cut, anc[g.producer[cut]])
        out.append(_piece(g, order, closure & ~done, cut))
        done = closure
    everything = (1 << len(order)) - 1
    out.append(_piece(g, order, everything & ~done, None))
    return out


def _piece(g: Graph, order: list[int], bits: int, cut: str | None) -> Piece:
    nodes = [order[k] for k in range(len(order)) if bits >> k & 1]
    weights = set().union(*(g.weights_of(i) for i in nodes)) if nodes else set()
    return Piece(nodes, weights, cut)


def crossing(g: Graph, done_nodes: set[int]) -> list[str]:
    """Tensors made inside `done_nodes` that something outside reads (or that the graph outputs)."""
    outputs = set(g.outputs)
    out = []
    for i in sorted(done_nodes):
        for t in g.nodes[i].output:
            if t and (t in outputs or any(c not in done_nodes for c in g.consumers.get(t, []))):
                out.append(t)
    return out


def select_block_cuts(g: Graph, runs: list[list[str]], anc: dict[int, int]) -> list[tuple[str, str, int]]:
    """The cuts at LayerMap block boundaries, as (tensor, block path it ends or "" for a prefix, the
    bitset of the nodes before the cut).

    `runs` lists the module paths of each run of repeated blocks (a decoder's layers; each tower
    of a two-tower model). A node belongs to the block whose path is one of its scopes (the
    exporter's wrapper adds a leading module name, hence the suffix match). A block's output need
    not cross alone: Hiera's stage outputs wait for the neck and Grounding DINO's fusion layers pass
    image and text features on, so what else crosses is carried past the cut (FORMAT_SPEC.md). A
    block with several outputs is cut after the last of them it makes; the cut holds all of them.
    """
    member = _block_members(g, runs)
    chosen: dict[str, tuple[str, int]] = {}
    for run in runs:
        for k, path in enumerate(run):
            made = [t for i, b in member.items() if b == path for t in g.nodes[i].output if t]
            leaving = [t for t in made if t in g.outputs or any(member.get(c) != path for c in g.consumers.get(t, []))]
            leaving = [t for t in leaving if t not in g.free_tensors and t in g.producer]
            if leaving:
                closure = 0
                for t in leaving:
                    closure |= anc[g.producer[t]]
                last = max(leaving, key=lambda t: g.producer[t])
                chosen.setdefault(last, (path, closure))
            else:
                log.info("block %s: nothing leaves it; no cut after it", path)
            if k == 0:  # the tensor entering the run: the prefix's output
                entering = {t for i, b in member.items() if b == path for t in node_inputs(g.nodes[i])}
                entering = [t for t in entering if t in g.producer and member.get(g.producer[t]) != path]
                entering = [t for t in entering if t not in g.free_tensors]
                if entering:  # (Grounding DINO's fusion encoder: image and text features enter it)
                    closure = 0
                    for t in entering:
                        closure |= anc[g.producer[t]]
                    chosen.setdefault(max(entering, key=lambda t: g.producer[t]), ("", closure))
    order = {t: g.producer[t] for t in chosen}
    return sorted(((t, *chosen[t]) for t in chosen), key=lambda x: order[x[0]])


def _block_members(g: Graph, runs: list[list[str]]) -> dict[int, str]:
    """The block each node belongs to, by its module scope; a node the exporter's optimizer made (a fused
    Split, say) has no scope: it belongs to the block that makes all of its inputs."""
    member: dict[int, str] = {}
    paths = {p for run in runs for p in run}
    for i in range(len(g.nodes)):
        scopes = g.scopes(i)
        for scope in scopes:
            hit = next((p for p in paths if scope == p or scope.endswith("." + p)), None)
            if hit:
                member[i] = hit
                break
        if not scopes and i not in g.free_nodes:
            owners = {member.get(g.producer[t]) for t in node_inputs(g.nodes[i]) if t in g.producer}
            owners.discard(None)
            if len(owners) == 1:
                member[i] = owners.pop()
    return member


def merge_weightless(g: Graph, cuts: list[str], anc: dict[int, int], pos: dict[int, int]) -> list[str]:
    """For a graph made elsewhere, where every op between two layers (the residual Add, a Relu, a
    reshape) is also a cut: of several cuts with no weight between them keep the last, so every
    block holds a weight and the cuts fall where one layer hands over to the next."""
    order = sorted(pos, key=pos.get)

    def has_weight(bits: int) -> bool:
        return any(g.weights_of(order[k]) for k in range(len(order)) if bits >> k & 1)

    kept, done, pending = [], 0, None
    for cut in cuts:
        if pending is not None:
            between = (done | anc[g.producer[cut]]) & ~(done | anc[g.producer[pending]])
            if has_weight(between):
                kept.append(pending)
                done |= anc[g.producer[pending]]
        pending = cut
    everything = (1 << len(order)) - 1
    if pending is not None and has_weight(everything & ~(done | anc[g.producer[pending]])):
        kept.append(pending)
    # Interleaved branches can still leave a piece of ops alone (its neighbours in graph order
    # belong to the other branch): drop such cuts until every piece holds a weight.
    while True:
        parts = pieces(g, kept, anc, pos)
        empty = [p.cut_after for p in parts[:-1] if not any(g.weights_of(n) for n in p.nodes)]
        if not empty:
            return kept
        kept = [c for c in kept if c != empty[0]]


NOT_FOLDED = {
    "RandomNormal",
    "RandomUniform",
    "RandomNormalLike",
    "RandomUniformLike",
    "Multinomial",
    "Bernoulli",
    "If",
    "Loop",
    "Scan",
    "Constant",
}


def fold_constants(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """The model with every node that computes from constants alone replaced by the initializers it computes
    (onnx's reference evaluator runs them), and how many nodes went. onnx's own light_* test models build
    their weights with ConstantOfShape: folded, those weights are initializers that blocks can hold.
    A node that would store a weight-sized copy wider than the weights it reads (a Cast of fp16 weights to fp32, a
    DequantizeLinear of int8 ones) stays, as does one the evaluator cannot run: the file keeps the weights' own
    dtype and size. A copy of a weight an unfolded node still reads (a tied head's transpose) stays unfolded too. Shape
    and size arithmetic on weights still folds. Nodes are evaluated one at a time, each on just the constants it
    reads, so the work is linear and a widened copy is dropped as soon as it is judged.
    Nothing else changes: the graph keeps its nodes, names and order."""
    from onnx import numpy_helper

    graph = model.graph
    constants = {o: n for n in graph.node if n.op_type == "Constant" for o in n.output if o}
    stored = {t.name: t for t in graph.initializer} | {
        o: n.attribute[0].t for o, n in constants.items() if n.attribute and n.attribute[0].name == "value"
    }
    weights = {name: tensor_bytes(t) for name, t in stored.items() if is_weight(t)}  # weight -> stored bytes
    initializers = {t.name: t for t in graph.initializer}
    # IR 3 lists every initializer among the inputs too (light_* models do): ONN never feeds those
    known = set(initializers) | set(constants)
    staying = _read_unfolded(graph, known)
    values: dict[str, Any] = {}
    folded = []
    for node in graph.node:
        given = {i for i in node.input if i}
        if node.domain not in ("", "ai.onnx") or node.op_type in NOT_FOLDED or not given or not given <= known:
            continue
        made = _evaluate(model, node, constants, initializers, values)
        if made is None or _widens(node, made, weights, staying):
            staying.update(given)  # the node stays, so what it reads stays too
            continue
        folded.append(node)
        values.update(made)
        known.update(made)
        if given & weights.keys() and node.op_type not in SHAPE_OPS:  # a weight's reshape or transpose is one too
            weights.update((o, _bytes(v)) for o, v in made.items())
    if not folded:
        return model, 0
    gone = {id(n) for n in folded}
    kept_nodes = [n for n in graph.node if id(n) not in gone]
    used = {i for n in kept_nodes for i in node_inputs(n)} | {o.name for o in graph.output}
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    out.graph.node.extend(kept_nodes)
    kept = [t for t in graph.initializer if t.name in used]
    computed = [numpy_helper.from_array(v, o) for o, v in values.items() if o in used]
    del out.graph.initializer[:]
    out.graph.initializer.extend([*kept, *computed])
    gone = set(initializers) - used  # constants only the folded nodes read
    kept_inputs = [i for i in graph.input if i.name not in gone]
    if model.ir_version < 4:  # IR 3 lists every initializer among the graph's inputs
        kept_inputs += [onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in computed]
    del out.graph.input[:]
    out.graph.input.extend(kept_inputs)
    return out, len(folded)


def _bytes(value: Any) -> int:
    """Bytes `value` takes stored as an initializer (int4 packs two to a byte, unlike its numpy array)."""
    return math.ceil(value.size * itemsize(onnx.helper.np_dtype_to_tensor_dtype(value.dtype)))


def _read_unfolded(graph, known: set[str]) -> set[str]:
    """The names that nodes which cannot fold read (with what their subgraphs read), and the graph's outputs:
    those stay in the file whatever folds, so a fold that copies one of them adds its bytes."""
    staying = {o.name for o in graph.output}
    known = set(known)
    for node in graph.node:
        given = {i for i in node.input if i}
        if node.domain in ("", "ai.onnx") and node.op_type not in NOT_FOLDED and given and given <= known:
            known.update(o for o in node.output if o)
        else:
            staying.update(node_inputs(node))
    return staying


SHAPE_OPS = {"Shape", "Size"}  # their outputs are a weight's metadata, a few int64s, not a copy of it


def _widens(node: onnx.NodeProto, made: dict[str, Any], weights: dict[str, int], staying: set[str]) -> bool:
    """Whether folding `node` would store more bytes than it lets go: a widened copy of the weights it reads (fp16
    cast to fp32, int8 dequantized), or any copy of a weight that stays because an unfolded node reads it too (the
    transpose of a tied head). A Shape or Size of a weight makes a few int64s and folds, as does the transpose or
    reshape of a weight nothing else reads."""
    read = [i for i in set(node.input) if i in weights]
    if not read or node.op_type in SHAPE_OPS:
        return False
    freed = sum(weights[i] for i in read if i not in staying)
    return sum(_bytes(v) for v in made.values()) > freed


def _evaluate(
    model: onnx.ModelProto, node: onnx.NodeProto, constants: dict, initializers: dict, values: dict[str, Any]
) -> dict[str, Any] | None:
    """The arrays `node` computes, by onnx's reference evaluator on a graph of just the node and the constants it
    reads; None where the evaluator cannot run it (an op it lacks at the graph's opset, e.g. DequantizeLinear below
    opset 19): that node stays in the graph."""
    import numpy as np
    from onnx import numpy_helper
    from onnx.reference import ReferenceEvaluator

    reads = dict.fromkeys(i for i in node.input if i)
    nodes = [*(constants[i] for i in reads if i in constants), node]
    given = [initializers[i] for i in reads if i in initializers]
    given += [numpy_helper.from_array(values[i], i) for i in reads if i in values]
    made = [o for o in node.output if o]
    program = onnx.helper.make_model(
        onnx.helper.make_graph(nodes, "fold", [], [onnx.helper.make_empty_tensor_value_info(o) for o in made], given),
        opset_imports=model.opset_import,
        ir_version=model.ir_version,
    )
    try:
        results = ReferenceEvaluator(program).run(None, {})
    except Exception as e:  # the evaluator raises many kinds; a fold it cannot do is simply not done
        log.debug("not folding %s '%s': %s", node.op_type, node.name, e)
        return None
    if not all(isinstance(r, np.ndarray) for r in results):
        return None
    return dict(zip(made, results))


def concrete_shapes(
    model: onnx.ModelProto,
    input_shapes: dict[str, list[int]],
    value_ranges: dict[str, tuple[int, int]] | None = None,
) -> dict[str, int]:
    """Bytes of every tensor when the inputs have these shapes. The graph's own value_info, with
    the inputs' symbolic dims filled in, where it sizes a tensor (torch.onnx's mostly does); then
    onnxruntime's symbolic shape inference, which follows shape arithmetic through Range, Reshape
    and friends; what is still unsized is measured by running the graph once at these shapes
    (integer inputs drawn from `value_ranges`)."""
    symbols = {}
    for i in model.graph.input:
        for d, v in zip(i.type.tensor_type.shape.dim, input_shapes.get(i.name, [])):
            if d.dim_param:
                symbols[d.dim_param] = int(v)
    sizes = _sizes(model.graph, symbols)
    made = {o for n in model.graph.node for o in n.output if o}
    if made <= sizes.keys():
        return sizes
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    fixed = onnx.ModelProto()
    fixed.CopyFrom(model)
    del fixed.graph.value_info[:]
    for i in fixed.graph.input:
        for d, v in zip(i.type.tensor_type.shape.dim, input_shapes.get(i.name, [])):
            d.Clear()
            d.dim_value = int(v)
    try:
        # where it stops short, it saves sym_shape_infer_temp.onnx in the working directory: keep that out of the user's
        with tempfile.TemporaryDirectory(prefix="onn-shapes-") as tmp, contextlib.chdir(tmp):
            inferred = SymbolicShapeInference.infer_shapes(fixed, auto_merge=True)
        sizes.update(_sizes(inferred.graph, {}))
    except Exception as e:  # its asserts cover op types it does not know: the run below sizes what it left
        log.debug("symbolic shape inference stopped: %s: %s", type(e).__name__, e)
    if missing := made - sizes.keys():
        log.info(
            "export: %d tensor sizes of the graph cannot be worked out from the graph alone, so it is run once on "
            "the sample to measure them (normal for some graphs; the export is not affected)",
            len(missing),
        )
        sizes.update(_measured_sizes(model, input_shapes, value_ranges or {}, missing))
    return sizes


def _measured_sizes(
    model: onnx.ModelProto,
    input_shapes: dict[str, list[int]],
    value_ranges: dict[str, tuple[int, int]],
    names: set[str],
) -> dict[str, int]:
    """Run the graph once with `names` as extra outputs and read their sizes off the results."""
    import numpy as np
    import onnxruntime as ort

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    del probe.graph.value_info[:]
    have = {o.name for o in probe.graph.output}
    probe.graph.output.extend(onnx.ValueInfoProto(name=n) for n in sorted(names - have))
    rng = np.random.default_rng(0)
    feeds = {}
    for i in model.graph.input:
        if i.name not in input_shapes:
            continue
        dtype = onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type)
        shape = input_shapes[i.name]
        if np.issubdtype(dtype, np.integer) or np.issubdtype(dtype, np.bool_):
            low, high = value_ranges.get(i.name, (0, 2))
            feeds[i.name] = rng.integers(low, high, size=shape).astype(dtype)
        else:
            feeds[i.name] = rng.standard_normal(shape).astype(dtype)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # keep every tensor
    try:
        session = ort.InferenceSession(probe.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as e:  # a graph newer than this onnxruntime (its IR version or opset), or one it cannot build
        said = str(e).rsplit(") ", 1)[-1][:160]  # onnxruntime's reason, after the C++ signature it names
        raise UserError(
            f"onnxruntime {ort.__version__} cannot load the graph ({said}); export it at an IR version and opset "
            "this onnxruntime supports, or upgrade onnxruntime."
        ) from None
    wanted = [o.name for o in session.get_outputs() if o.name in names]
    try:
        results = session.run(wanted, feeds)
    except Exception as e:  # onnxruntime raises its own Fail/InvalidArgument types
        raise UserError(
            f"the graph does not run at the reference shapes {input_shapes} ({str(e).splitlines()[0][:160]}); "
            "set the reference length within the model's longest sequence (export.reference_sequence_length in a "
            "run, --reference-length for python -m onn.export.omny enrich)."
        ) from None
    return {n: int(v.nbytes) for n, v in zip(wanted, results)}


def _sizes(graph, symbols: dict[str, int]) -> dict[str, int]:
    out = {}
    for v in [*graph.value_info, *graph.output, *graph.input]:
        if not v.type.HasField("tensor_type"):
            continue
        t = v.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else symbols.get(d.dim_param) for d in t.shape.dim]
        if t.HasField("shape") and None not in dims:
            out[v.name] = math.ceil(math.prod(dims) * itemsize(t.elem_type))
    return out


def symbolic_shapes(model: onnx.ModelProto) -> dict[str, tuple[str, list[int | str | None]]]:
    """(dtype, shape with symbolic dims kept) of every tensor the graph describes; onnx's own
    inference fills in a graph that came without value_info."""
    g = model.graph
    described = [*g.value_info, *g.output, *g.input]
    if len(g.value_info) < len(g.node) // 2:
        described = [*onnx.shape_inference.infer_shapes(model).graph.value_info, *described]
    out = {}
    for v in described:
        t = v.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim]
        out[v.name] = (dtype_name(t.elem_type), dims)
    return out


IN_PLACE = frozenset(
    {
        "Add",
        "Sub",
        "Mul",
        "Div",
        "Relu",
        "LeakyRelu",
        "Sigmoid",
        "Tanh",
        "Erf",
        "Gelu",
        "Exp",
        "Neg",
        "Sqrt",
        "Clip",
        "Softmax",
    }
)


# Buffers an op holds only while it runs, beyond its inputs and output, in multiples of its output's bytes.
# onnxruntime's CPU Where broadcasts the condition with each value into a buffer of its own (UntypedSelect) and
# merges the two into the output: measured (onnxruntime 1.31, [1, 8, 512, 512] float32 and int64, the run alone as
# pipelines/measure.py runs a shard), 16 MB beside an 8 MB output. torch.onnx writes every Llama-style attention's
# softmax as IsNaN -> Where on [batch, heads, seq, seq], so at long sequences it is a decoder block's peak. (A
# condition smaller than the output with a scalar value makes one buffer smaller: the figure errs high, by at most
# one output.) Transpose, Expand, Concat, Cast, Gather, Slice, Trilu, LayerNormalization, Softmax, the reductions
# and the elementwise ops measured none.
WORKSPACE = {"Where": 2}


def activation_peak(g: Graph, nodes: list[int], entering: set[str], leaving: set[str], sizes: dict[str, int]) -> int:
    """Largest sum of tensors alive at once while `nodes` run in graph order: each lives from its
    producer (or the start, for what enters) to its last reader in the piece (or the end, for
    what leaves), and an op's WORKSPACE while it runs. Weights are not activations."""
    order = sorted(nodes)
    step = {n: k for k, n in enumerate(order)}
    last: dict[str, int] = {}
    first: dict[str, int] = {t: 0 for t in entering}
    for n in order:
        for t in node_inputs(g.nodes[n]):
            if t not in g.initializers:
                last[t] = max(last.get(t, 0), step[n])
                first.setdefault(t, 0)
        for t in g.nodes[n].output:
            if t:
                first.setdefault(t, step[n])
                last.setdefault(t, step[n])
    for t in leaving:
        last[t] = len(order)
    # An elementwise op (or a softmax) whose input of its output's size dies there writes over that input,
    # as runtimes do (onnxruntime's kernels that may run in place, PyTorch's in-place ops): one buffer, not two.
    for n in order:
        node = g.nodes[n]
        if node.op_type not in IN_PLACE or not node.output or not node.output[0]:
            continue
        out = node.output[0]
        for t in node_inputs(node):
            if (
                t not in entering
                and last.get(t) == step[n]
                and first.get(t, 0) < step[n]
                and sizes.get(t) == sizes.get(out)
            ):
                last[t] = step[n] - 1  # freed as the output takes its place
                break
    delta = [0] * (len(order) + 2)
    for t, start in first.items():
        b = sizes.get(t, 0)
        delta[start] += b
        delta[last.get(t, start) + 1] -= b
    for n in order:
        node = g.nodes[n]
        if node.op_type in WORKSPACE and node.output and node.output[0]:
            held = WORKSPACE[node.op_type] * sizes.get(node.output[0], 0)
            delta[step[n]] += held
            delta[step[n] + 1] -= held
    live = peak = 0
    for d in delta:
        live += d
        peak = max(peak, live)
    return peak
