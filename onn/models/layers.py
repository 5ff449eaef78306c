"""The LayerMap: any model as prefix modules -> repeated blocks -> suffix modules.

One discovery serves three users: the planner sizes memory by it, the streaming strategy chunks
the blocks by it, and the .omny exporter cuts the graph at its block boundaries. Discovery knows
no model names: the blocks are a run of same-typed sibling modules (a decoder's layer list, a
ResNet's stages, the middle of a user's nn.Sequential; a ModuleList of composite layers of two kinds, a hybrid's
such as Jamba's or a UNet's up blocks, is a run too, and nothing inside it is): composite modules before leaf
layers (a list of one composite module, a one-layer stack, after any run), then the run holding the most
parameters, then the longest. A run of whole models (T5's encoder and decoder stacks) is none: the blocks are inside
one of them; a run one of whose members holds nearly all its weights (timm's [stem, stages]) gives way to the run
inside that member. A model config can name the blocks explicitly instead
(`model.layer_map.blocks: model.layers`).
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import sys
import textwrap
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from onn.errors import UserError

if TYPE_CHECKING:  # torch is imported by whoever built the model; planning from a cache needs none
    from torch import nn


@dataclass
class LayerMap:
    """Where a model's repeated blocks live, and what runs before and after them."""

    blocks_path: str  # dotted path of the module whose children hold the blocks ("" for the root)
    block_names: list[str]  # child names of the blocks, in execution order
    blocks: list[nn.Module]
    prefix: list[tuple[str, nn.Module]] = field(default_factory=list)  # (dotted name, module) before the blocks
    suffix: list[tuple[str, nn.Module]] = field(default_factory=list)  # after the blocks
    # parameters registered on the blocks' ancestors themselves, in no prefix or suffix module (a ViT's cls_token
    # and pos_embed on its root): counted with the prefix, as a model uses them before its blocks (a token and the
    # positions added to the patches), so that prefix, blocks and suffix hold all of its weights
    loose: list[tuple[str, nn.Parameter]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def block_paths(self) -> list[str]:
        return [f"{self.blocks_path}.{n}" if self.blocks_path else n for n in self.block_names]

    @property
    def layers_pattern(self) -> str:
        """peft's `layers_pattern`: the blocks' whole path, as a regular expression (peft matches it after any
        prefix). The last name alone ("layers") also matched BART's encoder.layers.N beside its decoder's blocks,
        which sparse_lora then adapted outside the blocks (in the prefix, where streaming trains nothing)."""
        return re.escape(self.blocks_path)

    def block_params(self) -> list[int]:
        return [_count(b) for b in self.blocks]

    def prefix_params(self) -> int:
        seen = _param_ids([m for _, m in self.prefix])
        loose = {id(p): p.numel() for _, p in self.loose if id(p) not in seen}
        return _count_unique([m for _, m in self.prefix]) + sum(loose.values())

    def suffix_params(self, exclude_shared_with_prefix: bool = True) -> int:
        seen = _param_ids([m for _, m in self.prefix]) if exclude_shared_with_prefix else set()
        seen |= {id(p) for _, p in self.loose} if exclude_shared_with_prefix else set()
        return sum(p.numel() for _, m in self.suffix for p in m.parameters() if id(p) not in seen)

    def describe(self) -> str:
        pre = ", ".join(n for n, _ in self.prefix) or "-"
        suf = ", ".join(n for n, _ in self.suffix) or "-"
        kind = type(self.blocks[0]).__name__
        return f"prefix [{pre}] -> {len(self.blocks)} x {kind} at '{self.blocks_path or '<root>'}' -> suffix [{suf}]"


@dataclass
class GatedMLP:
    """Where a gated MLP's three projections are: the gate's rows start at 0 of its linear, the up
    projection's at `up_row` of its own (one fused linear: the intermediate size; separate ones: 0)."""

    module: nn.Module
    gate: nn.Module
    up: nn.Module
    down: nn.Module
    act: nn.Module
    up_row: int
    intermediate: int


def linear_of(module: nn.Module | None) -> nn.Linear | None:
    """The nn.Linear a module is, or wraps (peft's LoRA layer), or None."""
    from torch import nn

    base = getattr(module, "base_layer", module)
    return base if isinstance(base, nn.Linear) else None


def gated_mlps(block: nn.Module) -> list[GatedMLP]:
    """The gated MLPs (down(act(gate(x)) * up(x))) in a block, whose slices of intermediate features layer
    streaming may compute one at a time (onn/streaming/tiled_mlp.py). One is a module whose forward is, bytecode
    for bytecode, transformers' Llama MLP's (gate_proj, up_proj, down_proj, act_fn: the form Mistral, Qwen and
    Gemma copy) or Phi-3's (one fused gate_up_proj, its first half the gate): a module of the same names that
    computes anything else (a scale, a norm, a clamp across the features) is not one. Its linears are plain or
    carry vanilla LoRA (no DoRA or other peft variant)."""
    return [m for m in map(gated_mlp, block.modules()) if m is not None]


def gated_mlp(module: nn.Module) -> GatedMLP | None:
    """`module` as a gated MLP (see gated_mlps), or None."""
    form = _gated_forms().get(_code_key(type(module).forward))
    if form is None:
        return None
    fused = form == "fused"
    gate = module.gate_up_proj if fused else module.gate_proj
    up = gate if fused else module.up_proj
    down, act = module.down_proj, module.activation_fn if fused else module.act_fn
    if not all(linear_of(m) is not None and _plain_lora(m) for m in (gate, up, down)):
        return None
    size = linear_of(down).in_features
    return GatedMLP(module, gate, up, down, act, size if fused else 0, size)


def _code_key(function) -> tuple | None:
    code = getattr(function, "__code__", None)
    return None if code is None else (code.co_code, code.co_names, code.co_consts)


@functools.cache
def _gated_forms() -> dict[tuple, str]:
    """The bytecode of transformers' two gated MLP forwards: Llama's (separate) and Phi-3's (fused)."""
    from transformers.models.llama.modeling_llama import LlamaMLP
    from transformers.models.phi3.modeling_phi3 import Phi3MLP

    return {_code_key(LlamaMLP.forward): "separate", _code_key(Phi3MLP.forward): "fused"}


def _plain_lora(module: nn.Module) -> bool:
    """A plain linear, or peft's LoRA linear with vanilla adapters only (no DoRA or other variant)."""
    if not hasattr(module, "lora_A"):
        return True
    return not getattr(module, "lora_variant", {}) and not getattr(module, "merged", False)


def resolve_indices(layers, n: int, key: str = "strategy.layers") -> list[int]:
    """`all`, or a list of block indices (negative counts from the end) -> sorted unique indices."""
    if layers in (None, "all"):
        return list(range(n))
    if isinstance(layers, str) or not isinstance(layers, list | tuple) or not layers:
        # an empty list too: peft reads an empty layers_to_transform as every layer
        raise UserError(f"{key}={layers!r}: give all, or a list of block indices such as [0, 1, -2, -1].")
    out = set()
    for i in layers:
        if not isinstance(i, int) or not -n <= i < n:
            raise UserError(
                f"{key}: block index {i!r} is out of range; this model has {n} blocks (0..{n - 1}, or -{n}..-1)."
            )
        out.add(i % n)
    return sorted(out)


def discover(model: nn.Module, blocks_path: str | None = None) -> LayerMap:
    """Find the LayerMap of `model`; `blocks_path` overrides discovery (the model config's layer_map.blocks, the
    path in the model as loaded, which names the same blocks under peft's wrapper)."""
    if blocks_path is not None:
        try:
            container = _configured_container(model, blocks_path)
        except AttributeError as e:
            raise UserError(
                f"model.layer_map.blocks: '{blocks_path}' is not a submodule of {type(model).__name__}."
            ) from e
        names = [n for n, _ in container.named_children()]
        if not names or not any(True for _ in container.parameters()):  # (an empty map failed on its first block)
            raise UserError(
                f"model.layer_map.blocks: '{blocks_path}' ({type(container).__name__}) holds no blocks with weights; "
                "name the list that holds the repeated blocks (such as model.layers), or null to discover it."
            )
        return _assemble(model, _tree_path(model, container, blocks_path), names)

    candidates = []  # (key, path, names)
    hybrids = [p for p, m in model.named_modules() if _mixed_list(m)]
    for path, module in model.named_modules():
        if any(path.startswith(f"{h}.") if h else path for h in hybrids):
            continue  # inside a hybrid's layers: its parts, not its blocks
        mixed = _mixed_list(module)  # a hybrid's layers: its runs of one kind are stretches of them, not its blocks
        runs = [] if mixed else [r for r in _same_type_runs(module) if not _towers(module, r)]
        for names in [*runs, *_lone_block(module), *mixed]:
            # Blocks are composite modules (a decoder layer, a ResNet stage); a list of layers of two kinds (a
            # hybrid's) is a run too, by the weights it holds, and nothing inside it is; a list of one block (a
            # one-layer stack) comes after any run, and a pair of leaf layers (GPT-2's wte/wpe embeddings) only
            # counts when no composite block is found at all.
            composite = any(True for _ in module.get_submodule(names[0]).children())
            rank = (1 if len(names) == 1 else 3) if composite else 0
            coverage = sum(_count(module.get_submodule(n)) for n in names)
            candidates.append(((rank, coverage, len(names)), path, names))
    if not candidates:
        raise UserError(
            f"{type(model).__name__} has no repeated blocks (no run of two or more same-typed sibling modules, nor "
            "a list of one); set model.layer_map.blocks to the module that holds them, or use strategy=lora."
        )
    _, path, names = _past_the_stem(max(candidates, key=lambda c: c[0]), candidates)
    return _assemble(model, path, names)


def _configured_container(model: nn.Module, blocks_path: str) -> nn.Module:
    """The module `blocks_path` names: a path in `model`'s own tree (a wrapped model's, as calibration gives it),
    else in the model as loaded, where the config's layer_map.blocks names it. Under peft's wrapper (the model
    the streaming engine and the exporters get) that is the model under it: through the wrapper's attribute
    forwarding, `model.layers` reached the LlamaForCausalLM (peft's LoraModel.model), which has no `layers`."""
    tree = dict(model.named_modules())
    if blocks_path in tree:
        return tree[blocks_path]
    peft = sys.modules.get("peft")  # (none loaded: no peft wrapper)
    loaded = model.get_base_model() if peft is not None and isinstance(model, peft.PeftModel) else model
    return loaded.get_submodule(blocks_path)


def _tree_path(model: nn.Module, container: nn.Module, given: str) -> str:
    """`container`'s path in `model`'s module tree (under peft's wrapper: `base_model.model.` + the config's path),
    by which the LayerMap splits the tree into prefix, blocks and suffix."""
    return next((path for path, module in model.named_modules() if module is container), given)


def _towers(module: nn.Module, names: list[str]) -> bool:
    """Whether a run is of whole models (transformers' PreTrainedModel: T5's encoder and decoder stacks), each a
    tower with blocks of its own: the blocks are inside one of them (as BART's are), and the stacks were no blocks
    the streaming engine could call with a hidden state."""
    loaded = sys.modules.get("transformers.modeling_utils")  # (none loaded: no model of transformers')
    return loaded is not None and all(isinstance(module.get_submodule(n), loaded.PreTrainedModel) for n in names)


def _past_the_stem(best: tuple, candidates: list[tuple]) -> tuple:
    """The run inside one member of `best` (its own children or a child's) when that member holds nearly all of
    `best`'s weights: timm's ConvNeXt, ResNetV2 and CSPNet are [stem, stages], a run of two Sequentials whose
    second holds 99.98% of the weights in its four stages, which are the blocks. A run whose members share the
    weights (ResNet's layer1..4, Swin's stages) stands."""
    (_, coverage, _), path, names = best
    members = [f"{path}.{n}" if path else n for n in names]
    inner = [
        c
        for c in candidates
        if c[0][0] == 3 and c[0][1] >= 0.99 * coverage and (c[1] in members or c[1].rpartition(".")[0] in members)
    ]
    return _past_the_stem(max(inner, key=lambda c: c[0]), candidates) if inner else best


def _lone_block(module: nn.Module) -> list[list[str]]:
    """[[name]] when `module` is a ModuleList or Sequential of one composite module (a one-layer recurrent stack,
    a one-layer decoder), else []: that module is the stack's one block, not the layers inside it."""
    from torch import nn

    children = list(module.named_children())  # (not len(module), which counts a list's None entries)
    if not isinstance(module, nn.ModuleList | nn.Sequential) or len(children) != 1:
        return []
    name, child = children[0]
    if type(child) in (nn.ModuleList, nn.ModuleDict) or not any(True for _ in child.children()):
        return []
    return [[name]] if any(True for _ in child.parameters()) else []


def _mixed_list(module: nn.Module) -> list[list[str]]:
    """[names] when `module` is a ModuleList of two or more composite modules with weights, not all of one type
    (a hybrid's decoder layers: Jamba's Mamba and attention layers, each with a dense or an expert MLP), else [].
    Its children are the blocks: found by type alone, the runs inside one layer (four leaf Linears of layer 0's
    Mamba mixer) were taken for them."""
    from torch import nn

    children = list(module.named_children())
    if not isinstance(module, nn.ModuleList) or len(children) < 2 or len({type(c) for _, c in children}) < 2:
        return []
    if _stem_and_head_around_a_run([type(c) for _, c in children]):
        return []  # a stem or a head beside a run of one kind: the run is the blocks, as before
    blocks = all(
        type(c) not in (nn.ModuleList, nn.ModuleDict)
        and not isinstance(c, nn.RNNBase)
        and any(True for _ in c.children())
        and any(True for _ in c.parameters())
        for _, c in children
    )
    return [[name for name, _ in children]] if blocks else []


def _stem_and_head_around_a_run(types: list[type]) -> bool:
    """Whether the types are two or more of one kind with at most one other at either end ([Stem, Block, Block]):
    a hybrid's other kind sits among its layers (Jamba's attention at layer 4 of 8, Zamba2's [mamba, hybrid, mamba])."""
    start = 1 if types[0] is not types[1] else 0
    stop = len(types) - 1 if types[-1] is not types[-2] else len(types)
    middle = types[start:stop]
    return len(middle) >= 2 and len(set(middle)) == 1


def _same_type_runs(module: nn.Module) -> list[list[str]]:
    """Runs of >= 2 consecutive children of one type (a ModuleList of decoder layers, ResNet's layer1..4).
    Plain containers (ModuleList, ModuleDict: no forward of their own) are blocks only inside a list of blocks;
    as a model's attributes they are separate stages (a UNet's down_blocks and up_blocks), whose own children
    are the blocks (a graph network's `convs` and `norms` lists side by side are two stages, not a run of
    two blocks). PyTorch's RNN modules are never blocks: each returns its output with its state, a tuple that
    no next block takes (a bidirectional layer's forward and backward LSTMs read the same input side by side)."""
    from torch import nn

    in_list = isinstance(module, nn.ModuleList | nn.Sequential)
    runs, current = [], []
    for name, child in module.named_children():
        # (any parameters, even the empty placeholders of blocks whose weights live in a layer store)
        has_params = any(True for _ in child.parameters())
        if (type(child) in (nn.ModuleList, nn.ModuleDict) and not in_list) or isinstance(child, nn.RNNBase):
            has_params = False  # a stage's container, or a recurrence, never a block
        if current and type(child) is type(module.get_submodule(current[-1])) and has_params:
            current.append(name)
        else:
            if len(current) >= 2:
                runs.append(current)
            current = [name] if has_params else []
    if len(current) >= 2:
        runs.append(current)
    return runs


def _assemble(model: nn.Module, blocks_path: str, names: list[str]) -> LayerMap:
    """Split the rest of the module tree into what runs before the blocks and after them."""
    container = model.get_submodule(blocks_path) if blocks_path else model
    blocks = [container.get_submodule(n) for n in names]
    prefix, suffix = [], []
    # Walk from the container up to the root: at each level, the siblings of the branch that leads to the blocks
    # run before them or after them (_split_siblings).
    path = blocks_path.split(".") if blocks_path else []
    level_names = names
    loose = []
    for depth in range(len(path), -1, -1):
        base = ".".join(path[:depth])
        parent = model.get_submodule(base) if depth else model
        before, after = _split_siblings(parent, base, set(level_names))
        prefix = before + prefix
        suffix = suffix + after
        loose = [(f"{base}.{n}" if base else n, p) for n, p in parent.named_parameters(recurse=False)] + loose
        if depth:
            level_names = [path[depth - 1]]
    return LayerMap(blocks_path, list(names), blocks, prefix, suffix, loose)


def _split_siblings(
    parent: nn.Module, base: str, inside: set[str]
) -> tuple[list[tuple[str, nn.Module]], list[tuple[str, nn.Module]]]:
    """`parent`'s children other than `inside` (the branch that leads to the blocks), as (those before the blocks,
    those after). A child goes by where it is registered, unless the parent's forward uses it only after its last
    use of the branch (OPT's decoder registers its final norm and output projection before its layers, and runs
    them after), or only before its first use (Llama's rotary embedding, registered after the layers)."""
    uses = _uses_in_forward(type(parent).forward)
    branch = [span for name in inside for span in uses.get(name, [])]
    before, after, late, early, seen = [], [], [], [], False
    for name, child in parent.named_children():
        if name in inside:
            seen = True
            continue
        entry = ((f"{base}.{name}" if base else name), child)
        spans = uses.get(name)
        if branch and spans and not seen and min(s for s, _ in spans) > max(e for _, e in branch):
            late.append((min(spans), entry))
        elif branch and spans and seen and max(e for _, e in spans) < min(s for s, _ in branch):
            early.append((min(spans), entry))
        else:
            (after if seen else before).append(entry)
    in_order = lambda moved: [entry for _, entry in sorted(moved, key=lambda m: m[0])]  # noqa: E731
    return before + in_order(early), in_order(late) + after


@functools.cache
def _uses_in_forward(forward) -> dict[str, list[tuple[tuple[int, int], tuple[int, int]]]]:
    """Where a forward uses each `self.NAME`, as (start, end) source positions in the order they run: a called
    attribute runs at the end of its call (in `self.head(self.norm(x))` the norm runs first), the list a loop
    walks over lasts to the loop's end (what the loop's body calls runs among its items); a presence check (`if
    self.norm is not None`) runs nothing. A name also used where its place in the source is not when it runs
    (inside a lambda or nested function, or read otherwise: `head = self.head` before the loop) is left out, as is
    everything where the forward has no Python source (a container's): registration order then stands."""
    function = inspect.unwrap(forward)  # past transformers' decorators, which wrap it
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return {}
    definition = tree.body[0] if tree.body else None
    if not isinstance(definition, ast.FunctionDef | ast.AsyncFunctionDef) or not definition.args.args:
        return {}
    me = definition.args.args[0].arg
    called: dict[int, tuple[int, int]] = {}  # id(attribute) -> the end of its call
    looped: dict[int, tuple[int, int]] = {}  # id(node in a loop's iterable or test) -> the end of the loop
    for node in ast.walk(definition):
        if isinstance(node, ast.Call):
            called[id(node.func)] = (node.end_lineno, node.end_col_offset)
        elif isinstance(node, ast.For | ast.AsyncFor | ast.While):
            walked = node.test if isinstance(node, ast.While) else node.iter
            looped.update({id(inner): (node.end_lineno, node.end_col_offset) for inner in ast.walk(walked)})
    nested = {  # what runs when a lambda or inner function is called, not where it stands
        id(inner)
        for node in ast.walk(definition)
        if node is not definition and isinstance(node, ast.Lambda | ast.FunctionDef | ast.AsyncFunctionDef)
        for inner in ast.walk(node)
    }
    checks = {  # `if self.norm is not None:`: a presence check, which runs nothing
        id(child)
        for node in ast.walk(definition)
        if isinstance(node, ast.Compare | ast.BoolOp | ast.UnaryOp | ast.If | ast.IfExp | ast.While | ast.Assert)
        for child in ast.iter_child_nodes(node)
    }
    uses: dict[str, list[tuple[tuple[int, int], tuple[int, int]]]] = {}
    unplaced: set[str] = set()
    for node in ast.walk(definition):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == me:
            runs = id(node) in called or id(node) in looped
            if id(node) in nested or not (runs or id(node) in checks):
                unplaced.add(node.attr)
            if not runs:
                continue
            start = called.get(id(node), (node.lineno, node.col_offset))
            uses.setdefault(node.attr, []).append((start, looped.get(id(node), start)))
    return {name: spans for name, spans in uses.items() if name not in unplaced}


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _param_ids(modules) -> set[int]:
    return {id(p) for m in modules for p in m.parameters()}


def _count_unique(modules) -> int:
    seen, total = set(), 0
    for m in modules:
        for p in m.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
    return total


def block_runs(model: nn.Module, blocks_path: str | None = None) -> list[list[str]]:
    """Dotted paths of the blocks of every tower: the LayerMap's own run first, then the other runs
    of repeated composite blocks that do not overlap it (a two-tower model's second encoder).
    The .omny exporter cuts the graph at all of their boundaries."""
    main = discover(model, blocks_path)
    runs = [main.block_paths]
    taken = set(runs[0])
    candidates = []
    for path, module in model.named_modules():
        for names in _same_type_runs(module):
            if not any(True for _ in module.get_submodule(names[0]).children()):
                continue  # leaf layers, not blocks
            paths = [f"{path}.{n}" if path else n for n in names]
            coverage = sum(_count(module.get_submodule(n)) for n in names)
            candidates.append((coverage, paths))
    for _, paths in sorted(candidates, key=lambda c: -c[0]):
        if not any(_nested(p, t) for p in paths for t in taken):
            runs.append(paths)
            taken.update(paths)
    return runs


def _nested(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def blocks_crossed(model: nn.Module, inputs: tuple, blocks_path: str | None = None) -> str | None:
    """Where a block reads the output of a block other than the one just before it (a UNet's skip connections:
    an up block reads its down block's features), as "up_blocks.0 reads down_blocks.2's output"; None when
    each block reads only its predecessor's output (and the model's own inputs), so that blocks can run one
    after another, as streaming runs them. Found by one forward pass of `inputs` (meta tensors will do)
    with a hook on every block of every run (block_runs), in the order they are called."""
    import torch

    paths = [p for run in block_runs(model, blocks_path) for p in run]
    made: dict[int, int] = {}  # id(tensor) -> the call that returned it
    calls: list[str] = []
    kept: list = []  # every hooked tensor stays alive, so no id is reused during the pass
    found: list[str] = []

    def tensors(value) -> list[torch.Tensor]:
        if isinstance(value, torch.Tensor):
            return [value]
        if isinstance(value, list | tuple):
            return [t for v in value for t in tensors(v)]
        if isinstance(value, dict):
            return [t for v in value.values() for t in tensors(v)]
        return [t for v in vars(value).values() for t in tensors(v)] if hasattr(value, "__dataclass_fields__") else []

    def hook(path: str):
        def after(module, args, kwargs, output) -> None:
            here = len(calls)
            for t in tensors((args, kwargs)):
                source = made.get(id(t))
                if source is not None and source != here - 1 and not found:
                    found.append(f"{path} reads {calls[source]}'s output")
            for t in tensors(output):
                made.setdefault(id(t), here)
            calls.append(path)
            kept.append((args, kwargs, output))

        return after

    handles = [model.get_submodule(p).register_forward_hook(hook(p), with_kwargs=True) for p in paths]
    try:
        with torch.no_grad():
            model(*inputs)
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else None
