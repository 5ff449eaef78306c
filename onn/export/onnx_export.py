"""ONNX export: torch.onnx.export (the dynamo exporter) with named inputs/outputs and dynamic batch/sequence
axes, then onnx.checker and an onnxruntime run compared with PyTorch, so a written file is known to work.

Inputs are named after the model's forward arguments (input_ids, attention_mask, pixel_values); a plain
nn.Module (timm/torchvision CNN) takes one image tensor named pixel_values. Outputs are the model's tensor
outputs by name (logits, image_embeds, ...), or `output` for a module that returns a tensor. Every input
shares one `batch` axis; text inputs also share one `sequence` axis (the graph's sizes come from
Shape(attention_mask), which is why decoders keep attention_mask as an explicit input).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import glob
import importlib
import inspect
import itertools
import logging
import mmap
import os
import re
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from onn.errors import UserError
from onn.export.folders import ownerless, sweep_leftovers, temp_prefix
from onn.export.model_facts import weight_bytes
from onn.hardware import failpoints

if TYPE_CHECKING:
    from collections.abc import Callable

    import numpy as np
    import onnx
    import onnxruntime as ort
    import torch

TORCH_OPSET = 18  # the opset torch.onnx's dynamo exporter writes; others are converted from it
# weights above this go to a file beside the graph (torch.onnx's own threshold; protobuf holds at most 2 GiB)
EXTERNAL_DATA_BYTES = 1536 * 2**20
STAGED_WEIGHTS = re.compile(r"(?P<pid>\d{1,7})-[0-9a-f]{12}\.data")  # staged_name's weights, after OUTPUT.NAME.
TEXT_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "position_ids")
IMAGE_INPUTS = ("pixel_values",)
# ModelOutput fields that are not results: caches and per-layer extras (the prefill graph returns none of them).
SKIPPED_OUTPUTS = frozenset(
    {
        "loss",
        "past_key_values",
        "hidden_states",
        "attentions",
        "cross_attentions",
        "encoder_hidden_states",
        "encoder_attentions",
        "decoder_hidden_states",
        "decoder_attentions",
    }
)


# ---------------------------------------------------------------- sample inputs


def sample_inputs(
    model,
    batch_size: int = 2,
    sequence_length: int = 16,
    image_size: list[int] | int | None = None,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """A deterministic input that exercises the whole model: random token ids (no special or pad tokens, no
    padding, so PyTorch and onnxruntime agree everywhere) and/or a random image of the size the model expects.
    `image_size`: [H, W] (export.sample.image_size), or one side of a square."""
    import torch

    model = _unwrap_peft(model, merge=False)
    generator = torch.Generator().manual_seed(seed)
    kind = _kind(model)
    inputs: dict[str, torch.Tensor] = {}
    if kind in ("text", "clip"):
        text = _text_config(model)
        limit = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
        length = min(sequence_length, limit) if limit else sequence_length
        allowed = torch.tensor(sorted(set(range(text.vocab_size)) - _special_ids(model.config)))
        picks = torch.randint(len(allowed), (batch_size, length), generator=generator)
        inputs["input_ids"] = allowed[picks]
        inputs["attention_mask"] = torch.ones(batch_size, length, dtype=torch.long)
    if kind in ("clip", "image"):
        channels, size = _image_shape(model)
        if image_size is not None:
            sides = list(image_size) if isinstance(image_size, list | tuple) else [image_size]
            size = tuple(sides * 2 if len(sides) == 1 else sides)  # one side: a square
        inputs["pixel_values"] = torch.randn(
            batch_size, channels, *size, generator=generator, dtype=_float_dtype(model)
        )
    return inputs


def _kind(model) -> str:
    """clip (vision + text towers), text (has a vocabulary) or image (everything else, plain modules included)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return "image"
    if getattr(config, "vision_config", None) is not None and getattr(config, "text_config", None) is not None:
        return "clip"
    return "text" if getattr(_text_config(model), "vocab_size", None) else "image"


def _text_config(model):
    config = model.config
    return getattr(config, "text_config", None) or config


def _special_ids(config) -> set[int]:
    ids: set[int] = set()
    for cfg in (config, getattr(config, "text_config", None)):
        for key in ("bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "cls_token_id"):
            value = getattr(cfg, key, None) if cfg is not None else None
            ids.update(value if isinstance(value, list | tuple) else [] if value is None else [value])
    return ids


def _image_shape(model) -> tuple[int, tuple[int, int]]:
    """(channels, (height, width)): from the HF config (vision_config for CLIP) or timm's pretrained_cfg, else 224."""
    config = getattr(model, "config", None)
    vision = getattr(config, "vision_config", None) or config
    if vision is not None and getattr(vision, "image_size", None):
        size = vision.image_size
        size = tuple(size) if isinstance(size, list | tuple) else (size, size)
        return int(getattr(vision, "num_channels", 3)), size
    cfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None) or {}
    if cfg.get("input_size"):
        channels, height, width = cfg["input_size"]
        return channels, (height, width)
    return 3, (224, 224)


def _float_dtype(model):
    import torch

    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


# ---------------------------------------------------------------- checking and running ONNX files


def check_onnx(path: str | os.PathLike, load_external_data: bool = True) -> onnx.ModelProto:
    """Load an ONNX file that passed onnx.checker; a broken file is a UserError, not a traceback."""
    import onnx

    _check_file(Path(path))
    return onnx.load(str(path), load_external_data=load_external_data)


def _check_file(path: Path, bound_for: Path | None = None) -> None:
    """onnx.checker on the path (not a loaded proto), so files with external data above 2 GB are checked too.
    `bound_for`: the path an export's temporary file was to be moved to, which the message names instead."""
    import onnx

    if not path.is_file():
        raise UserError(f"ONNX file {path} does not exist; check the path or export the model first.")
    try:
        onnx.checker.check_model(str(path))
    except Exception as e:
        if bound_for is None:
            raise UserError(f"ONNX file {path} fails onnx.checker: {_one_line(e)}") from e
        raise UserError(_sentence(f"the ONNX export {bound_for} fails onnx.checker: {_one_line(e)}", bound_for)) from e


def run_onnx(
    path_or_model,
    feeds: dict[str, Any],
    name: str | None = None,
    optimization: ort.GraphOptimizationLevel | None = None,
) -> dict[str, np.ndarray]:
    """Run a model (path or ModelProto) with onnxruntime on CPU; outputs by name. Torch tensors are accepted.
    `name` is what messages call the model (default: its path). `optimization` sets onnxruntime's graph
    optimization level (default: onnxruntime's own, all of them), for a caller comparing graphs rather than
    running one: validate, whose shards would otherwise be fused differently from the whole model."""
    import numpy as np
    import onnxruntime as ort

    where = name or (str(path_or_model) if isinstance(path_or_model, str | os.PathLike) else "the ONNX model")
    source = str(path_or_model) if isinstance(path_or_model, str | os.PathLike) else path_or_model.SerializeToString()
    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only: ORT's warnings about unused initializers are noise here
    if optimization is not None:
        options.graph_optimization_level = optimization
    try:
        session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
    except Exception as e:
        raise UserError(f"onnxruntime cannot load {where}: {_one_line(e)}") from e
    wanted = [i.name for i in session.get_inputs()]
    missing, unknown = set(wanted) - set(feeds), set(feeds) - set(wanted)
    if missing or unknown:
        raise UserError(
            f"{where} takes inputs {wanted}; the feeds lack {sorted(missing)} and have extra {sorted(unknown)}."
        )
    arrays = {
        name: (value.detach().cpu().numpy() if hasattr(value, "detach") else np.asarray(value))
        for name, value in feeds.items()
    }
    names = [o.name for o in session.get_outputs()]
    try:
        results = session.run(names, arrays)
    except Exception as e:
        shapes = {name: list(a.shape) for name, a in arrays.items()}
        raise UserError(f"onnxruntime failed to run {where} on inputs {shapes}: {_one_line(e)}") from e
    return dict(zip(names, results))


@functools.cache
def newest_opset() -> int:
    """The newest default-domain opset the installed onnx defines and onnxruntime loads (the lower of the two):
    onnxruntime is asked with a one-node model per opset, as it says nothing of its own range."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    def loads(opset: int) -> bool:
        value = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
        graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe", [value], [])
        graph.output.append(helper.make_tensor_value_info("y", TensorProto.FLOAT, [1]))
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
        try:
            ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        except Exception:
            return False
        return True

    low, high = TORCH_OPSET, onnx.defs.onnx_opset_version()
    while low < high:  # the largest opset onnxruntime loads: every lower one loads too
        mid = (low + high + 1) // 2
        low, high = (mid, high) if loads(mid) else (low, mid - 1)
    return low


# ---------------------------------------------------------------- the export


def output_names(model) -> list[str]:
    """The output names export_onnx gives `model`: it runs the model once on a one-row sample to see them, on the
    device the model is on (a GPU, or the meta device of a model built without weights)."""
    import torch

    model = _unwrap_peft(model, merge=False)
    device = next(itertools.chain(model.parameters(), model.buffers()), torch.empty(0)).device
    sample = {k: v.to(device) for k, v in sample_inputs(model, batch_size=1, sequence_length=4).items()}
    with _eval(model), torch.no_grad():
        return [name for name, _ in _named_tensors(call_model(model, sample))]


def export_onnx(
    model,
    output: Path,
    sample_input: dict[str, torch.Tensor],
    opset: int = TORCH_OPSET,
    dynamic: bool = True,
    atol: float = 1e-4,
    axes: dict[str, dict[int, str]] | None = None,
    bounds: dict[str, tuple[int, int]] | None = None,
    follow: Callable[[dict[str, np.ndarray]], contextlib.AbstractContextManager] | None = None,
) -> dict:
    """Export to ONNX, check it, run it in onnxruntime and compare every output with PyTorch's. The files are
    written in a temp folder beside `output` and moved into place only after all of that passed, so a failed
    export never damages an earlier file. `axes` names each input's dynamic axes ({"input_points": {1:
    "prompts"}}) instead of the shared batch and sequence axes, `bounds` an axis's (min, max) where the model
    needs one: the pieces of a pipeline (pipelines/). `follow(onnxruntime's outputs)` is a context in which the
    model takes onnxruntime's discrete choices (a top-k over near-tied scores), for the comparison. A model on a
    GPU, or in bf16, is moved to the CPU in float32 first, in place (`traceable`)."""
    import torch

    started = time.perf_counter()
    _quiet_exporter_logs()
    output = Path(output)
    if output.suffix != ".onnx":
        raise UserError(f"ONNX export path {output} must end in .onnx.")
    if not output.parent.is_dir():
        raise UserError(f"the folder of the ONNX export path {output} does not exist; create it first.")
    if output.is_dir():  # refused before the trace, not by the rename after it
        raise UserError(
            f"ONNX export path {output} is a folder; name the .onnx file to write, e.g. {output / 'model.onnx'}."
        )
    model = _unwrap_peft(model, merge=True)
    _check_sample(model, sample_input, dynamic and axes is None, batched=axes is None)
    model, sample_input = traceable(model, sample_input)
    input_names = list(sample_input)
    tensors = tuple(sample_input.values())

    with _eval(model):
        with torch.no_grad():
            try:
                reference = _named_tensors(call_model(model, sample_input))
            except Exception as e:
                raise UserError(
                    f"{type(model).__name__} fails on the sample input {_shapes(sample_input)}: {_one_line(e)}"
                ) from e
        if not reference:
            raise UserError(f"{type(model).__name__} returned no tensors on the sample input; nothing to export.")
        names = [name for name, _ in reference]
        shapes = _dynamic_shapes(model, input_names, dynamic, axes, bounds or {})
        program = _torch_export(model, input_names, names, tensors, opset, dynamic, shapes)
    _check_opset(model, program, opset)
    fixed = _fixed_axes(model, program, input_names, shapes)

    sweep_leftovers(output)  # a killed export's temporary folder, which may hold all the weights
    folder = Path(tempfile.mkdtemp(prefix=Path(temp_prefix(output)).name + "-", dir=output.parent))
    try:
        written = folder / staged_name(output)  # torch.onnx names the weights file after it: WRITTEN.data
        compared = (model, written, output, sample_input, reference)
        program.save(written, external_data=(weight_bytes(model) or 0) > EXTERNAL_DATA_BYTES)
        graph = program.model.graph
        result = {
            "export/onnx": str(output),
            "export/opset": opset,
            "export/inputs": [v.name for v in graph.inputs],
            "export/outputs": [v.name for v in graph.outputs],
            "export/fixed_axes": fixed,
        }
        del program
        diffs = _verify(model, written, output, opset, lambda: _compare(*compared, atol, follow))
        move_into_place(written, output)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {
        **result,
        "export/max_abs_diff": max(diffs.values()),
        "export/max_abs_diff_per_output": diffs,
        "export/seconds": round(time.perf_counter() - started, 3),
    }


def set_metadata(output: Path, props: dict[str, str], doc: str | None = None) -> None:
    """Key/value metadata (and a doc_string) set in an exported ONNX or .omny file, where Netron and onnxruntime's
    modelmeta show them to whoever runs it; the file's other metadata (a .omny's document) stays, and weights in a
    .data file beside it stay there. Written beside the file, then swapped in."""
    import onnx

    model = onnx.load(str(output), load_external_data=False)
    if doc is not None:
        model.doc_string = doc
    onnx.helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props}, **props})
    staged = Path(temp_prefix(output) + ".described")  # a killed run's is swept by the next export (sweep_leftovers)
    try:
        onnx.save(model, str(staged))
        os.replace(staged, output)
    finally:
        staged.unlink(missing_ok=True)


def traceable(model, sample: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The model and its sample as ONNX traces them: on the CPU, in float32 (the model moved there in place: a
    copy of a large model would double what the export holds). A run on a GPU leaves its model on the device
    (after answering) and in bf16 (strategy.precision=bf16-true; a streamed model's blocks merge in the compute
    dtype, beside float32 edges), and onnxruntime's CPU provider, which checks the export, has no bf16 matmul."""
    import torch

    def ready(t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and (not t.is_floating_point() or t.dtype == torch.float32)

    if not all(ready(t) for t in itertools.chain(model.parameters(), model.buffers())):
        model = model.to("cpu", torch.float32)
    return model, {
        k: v.to("cpu", torch.float32 if v.is_floating_point() else v.dtype) if torch.is_tensor(v) else v
        for k, v in sample.items()
    }


def _quiet_exporter_logs() -> None:
    """The exporter's passes log every rewrite at INFO; torch's scan partitioner (imported with torch) sets its own
    logger to DEBUG and dumps every scan's forward and backward graphs; the version converter's failure is a
    warning with a traceback, which _check_opset says in one sentence instead."""
    for noisy in ("onnx_ir", "onnxscript", "torch._higher_order_ops.partitioner"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.getLogger("onnxscript.version_converter").setLevel(logging.ERROR)


def _verify(model, written: Path, output: Path, opset: int, compare: Callable[[], dict[str, float]]):
    """onnx.checker on the written file, then `compare` (onnxruntime against PyTorch); a failure at an opset torch
    converted its graph to says so, since export.opset=18 may then pass."""
    try:
        _check_file(written, bound_for=output)
        return compare()
    except UserError as e:
        if opset == TORCH_OPSET:
            raise
        raise UserError(
            f"{str(e).rstrip('.')} (export.opset={opset}: torch.onnx converted its opset-{TORCH_OPSET} graph to "
            f"it; export.opset={TORCH_OPSET} is the graph as torch.onnx writes it)."
        ) from e


def _compare(
    model, written: Path, output: Path, sample_input: dict, reference: list, atol: float, follow
) -> dict[str, float]:
    """Each output's max |PyTorch - onnxruntime| on the sample input (`written`, bound for `output`), or a
    UserError for the first beyond atol times the output's largest magnitude (fp32 rounding grows with the
    values: a detector's logits are in the hundreds). Under `follow`, PyTorch's outputs are computed again with
    onnxruntime's discrete choices."""
    import torch

    try:
        ort = run_onnx(written, sample_input, name=str(output))
    except UserError as e:
        raise UserError(_sentence(str(e), output)) from e
    if follow is not None:
        with _eval(model), torch.no_grad(), follow(ort):
            reference = _named_tensors(call_model(model, sample_input))
    diffs = {name: _max_abs_diff(ref, ort[name], sample_input.get("attention_mask")) for name, ref in reference}
    for name, ref in reference:
        finite = ref[ref.isfinite()] if ref.is_floating_point() else ref[:0]
        scale = max(1.0, float(finite.abs().max())) if finite.numel() else 1.0
        if ref.dtype == torch.float32 and not diffs[name] <= atol * scale:
            raise UserError(
                f"ONNX output '{name}' of {type(model).__name__} differs from PyTorch by {diffs[name]:.3g} "
                f"(more than atol={atol:g} x {scale:.3g}, its largest magnitude), so {output} was not written."
            )
    return diffs


def _check_opset(model, program, opset: int) -> None:
    """torch.onnx falls back to the graph it made (opset 18) when its version converter fails on it, with only a
    warning: a file of another opset than the one asked for is refused instead."""
    written = program.model.opset_imports.get("", opset)
    if written != opset:
        raise UserError(
            f"torch.onnx could not convert {type(model).__name__}'s graph to opset {opset} (its version converter "
            f"failed, leaving opset {written}); set export.opset={written}."
        )


def _sentence(message: str, output: Path) -> str:
    """A check's message about an export's temporary file, saying that `output` was not written."""
    return f"{message.rstrip('.')}; {output} was not written."


def _dynamic_shapes(model, input_names: list[str], dynamic: bool, axes: dict | None, bounds: dict) -> dict | None:
    """torch.export's dynamic shapes: each input's `axes`, one Dim per axis name (within `bounds`); else, when
    dynamic, one `batch` axis every input shares and one `sequence` axis the text inputs share."""
    from torch.export import Dim

    if axes is not None:
        names_used = {name for per_input in axes.values() for name in per_input.values()}
        dims = {name: Dim(name, **dict(zip(("min", "max"), bounds.get(name, ())))) for name in names_used}
        return {"tensors": tuple({k: dims[a] for k, a in axes.get(n, {}).items()} or None for n in input_names)}
    if not dynamic:
        return None
    batch, sequence = Dim("batch"), Dim("sequence", max=max_sequence_length(model))
    specs = tuple({0: batch, 1: sequence} if n in TEXT_INPUTS else {0: batch} for n in input_names)
    return {"tensors": specs}  # keyed by the wrapper's *tensors parameter


def _fixed_axes(model, program, input_names: list[str], shapes: dict | None) -> list[str]:
    """Each axis `shapes` asked to be dynamic that the exported graph has at a fixed size ("input_ids axis 1
    (sequence) = 10"), said in a warning: torch.onnx falls back to the traced size when the model's code
    specializes an axis."""
    fixed, graph_inputs = [], {value.name: value for value in program.model.graph.inputs}
    for name, spec in zip(input_names, (shapes or {}).get("tensors", ())):
        shape = graph_inputs[name].shape if name in graph_inputs else None
        for axis, dim in (spec or {}).items():
            if shape is not None and isinstance(shape[axis], int):
                fixed.append(f"{name} axis {axis} ({dim.__name__}) = {shape[axis]}")
    if fixed:
        logging.getLogger("onn").warning(
            f"{type(model).__name__}'s ONNX graph takes only {', '.join(fixed)}: its code fixed those sizes while "
            "torch.export traced it (a Python loop over an axis, or an op torch.export unrolls), so onnxruntime "
            "refuses other sizes."
        )
    return fixed


def _torch_export(
    model, input_names: list[str], names: list[str], tensors: tuple, opset: int, dynamic: bool, shapes: dict | None
):
    """torch.onnx.export with the dynamo exporter and `shapes` (_dynamic_shapes)."""
    import torch

    _reuse_torchlib_ops()
    try:
        return torch.onnx.export(
            _named_outputs(model, input_names),
            tensors,
            None,
            input_names=input_names,
            output_names=names,
            opset_version=opset,
            dynamic_shapes=shapes,
            dynamo=True,
            verbose=False,
        )
    except Exception as e:
        cause = e.__cause__ or e
        raise UserError(
            f"torch.onnx.export could not export {type(model).__name__} (opset {opset}, dynamic={dynamic}): "
            f"{_one_line(cause)}"
        ) from e


@functools.cache
def _reuse_torchlib_ops() -> None:
    """torch.onnx.export (torch 2.11) builds its op registry on every call, and onnxscript's get_torchlib_ops,
    which it asks for the torchlib functions, parses each function's source again to read its domain: about a
    second of every export, however small the graph. The list depends on the installed packages alone, so it is
    built once per process. Only a speed-up: where torch reaches onnxscript another way, exports run as before."""
    from torch.onnx._internal import _lazy_import

    name = getattr(getattr(_lazy_import, "onnxscript_apis", None), "_name", None)  # onnxscript's API for this torch
    module = importlib.import_module(name) if name else None
    if callable(getattr(module, "get_torchlib_ops", None)):
        module.get_torchlib_ops = functools.cache(module.get_torchlib_ops)


def max_sequence_length(model) -> int | None:
    """Learned position tables (GPT-2, CLIP) bound the sequence axis; torch.export wants that bound stated."""
    if not _is_hf(model) or _kind(model) == "image":
        return None
    text = _text_config(model)
    return getattr(text, "n_positions", None) or getattr(text, "max_position_embeddings", None)


def _named_outputs(model, input_names: list[str]):
    """The module torch.onnx.export sees: forward(*tensors) -> the model's tensor outputs as a tuple."""
    import torch

    class NamedOutputs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, *tensors):
            return tuple(t for _, t in _named_tensors(call_model(self.model, dict(zip(input_names, tensors)))))

    return NamedOutputs().eval()


def call_model(model, inputs: dict):
    """HF models by keyword with use_cache=False (the prefill graph: no KV cache outputs); plain modules by position."""
    if _is_hf(model):
        takes_cache = "use_cache" in inspect.signature(model.forward).parameters
        return model(**inputs, **({"use_cache": False} if takes_cache else {}))
    return model(*inputs.values())


def _named_tensors(result) -> list[tuple[str, torch.Tensor]]:
    import torch

    if isinstance(result, torch.Tensor):
        return [("output", result)]
    if hasattr(result, "items"):  # a transformers ModelOutput (only the fields that are set) or a dict
        return [(k, v) for k, v in result.items() if isinstance(v, torch.Tensor) and k not in SKIPPED_OUTPUTS]
    if isinstance(result, list | tuple):
        return [(f"output_{i}", v) for i, v in enumerate(result) if isinstance(v, torch.Tensor)]
    return []


def _is_hf(model) -> bool:
    return hasattr(getattr(model, "config", None), "to_dict") and hasattr(model, "can_generate")


def _unwrap_peft(model, merge: bool):
    """A peft model is exported merged; the merge runs on a deep copy, so the caller's model keeps its adapters."""
    if type(model).__module__.startswith("peft") and hasattr(model, "merge_and_unload"):
        return copy.deepcopy(model).merge_and_unload() if merge else model.get_base_model()
    return model


@contextlib.contextmanager
def _eval(model):
    """Export and compare in eval mode, then give the caller's model back in the mode it came in."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _check_sample(model, sample: dict, dynamic: bool, batched: bool = True) -> None:
    """Catch a sample input that cannot be right before the (slow) export, naming the input and what was expected.
    `batched`: the inputs share their first dim (not so where `axes` names each input's own, e.g. a graph's
    nodes and edges)."""
    import torch

    cls = type(model).__name__
    if not isinstance(sample, dict) or not sample:
        raise UserError(f"the sample input for {cls} must be a non-empty dict of input name -> tensor.")
    for name, value in sample.items():
        if not isinstance(value, torch.Tensor):
            raise UserError(f"sample input '{name}' is a {type(value).__name__}; expected a torch.Tensor.")
    _check_names(model, sample)
    for name, value in sample.items():
        _check_kind(model, name, value)
    _check_together(model, sample, dynamic, batched)


def _check_names(model, sample: dict) -> None:
    """The inputs are the forward's: by name for a transformers model, by count for another."""
    cls = type(model).__name__
    params = inspect.signature(model.forward).parameters
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    if _is_hf(model):
        accepted = [n for n, p in params.items() if p.kind not in variadic]
        for name, value in sample.items():
            if name not in accepted:
                raise UserError(
                    f"sample input '{name}' (shape {list(value.shape)}) is not an input of {cls}.forward; "
                    f"expected some of {accepted}."
                )
        return
    positional = [n for n, p in params.items() if p.kind not in (*variadic, inspect.Parameter.KEYWORD_ONLY)]
    takes_more = any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in params.values())
    if len(sample) > len(positional) and not takes_more:
        raise UserError(
            f"{cls}.forward takes {len(positional)} tensor(s) {positional}; the sample input has "
            f"{len(sample)}: {_shapes(sample)}."
        )


def _check_kind(model, name: str, value) -> None:
    """Token ids are integers [batch, sequence]; images are floats [batch, channels, height, width], of the
    shape a transformers model's config says."""
    shape = list(value.shape)
    if name in TEXT_INPUTS:
        if value.is_floating_point() or value.is_complex():
            raise UserError(f"sample input '{name}' (shape {shape}) is {value.dtype}; expected integer ids.")
        if value.dim() != 2:
            raise UserError(f"sample input '{name}' has shape {shape}; expected 2 dims [batch, sequence].")
    if name in IMAGE_INPUTS:
        if not value.is_floating_point():
            raise UserError(f"sample input '{name}' (shape {shape}) is {value.dtype}; expected a float image.")
        if value.dim() != 4:
            raise UserError(
                f"sample input '{name}' has shape {shape}; expected 4 dims [batch, channels, height, width]."
            )
        if _is_hf(model):
            channels, (height, width) = _image_shape(model)
            if shape[1:] != [channels, height, width]:
                raise UserError(
                    f"sample input '{name}' has shape {shape}; {type(model).__name__}'s config expects "
                    f"[batch, {channels}, {height}, {width}]."
                )


def _check_together(model, sample: dict, dynamic: bool, batched: bool = True) -> None:
    """Ids within the vocabulary, the text inputs of one shape, one batch size, and sizes a dynamic export keeps."""
    cls = type(model).__name__
    ids = sample.get("input_ids")
    if ids is not None and _kind(model) in ("text", "clip") and ids.numel():
        vocab = _text_config(model).vocab_size
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise UserError(
                f"sample input 'input_ids' (shape {list(ids.shape)}) holds ids from {int(ids.min())} to "
                f"{int(ids.max())}; {cls}'s vocabulary is 0..{vocab - 1}."
            )
    text = [n for n in sample if n in TEXT_INPUTS]
    for name in text[1:]:
        if sample[name].shape != sample[text[0]].shape:
            raise UserError(
                f"sample input '{name}' has shape {list(sample[name].shape)}; expected the shape of "
                f"'{text[0]}', {list(sample[text[0]].shape)}."
            )
    first = next(iter(sample))
    for name, value in sample.items():
        if batched and (value.dim() == 0 or value.shape[0] != sample[first].shape[0]):
            raise UserError(
                f"sample input '{name}' has shape {list(value.shape)}; every input needs the batch size of "
                f"'{first}' ({list(sample[first].shape)[:1]}) as its first dim."
            )
        if dynamic and (value.shape[0] < 2 or (name in TEXT_INPUTS and value.shape[1] < 2)):
            raise UserError(
                f"sample input '{name}' has shape {list(value.shape)}; a dynamic export needs batch and "
                "sequence sizes of at least 2 (torch.export fixes sizes 0 and 1): set export.sample.batch_size and "
                "export.sample.sequence_length to 2 or more (export_onnx in Python: or pass dynamic=False)."
            )


def _max_abs_diff(reference, got, attention_mask=None) -> float:
    """Max |PyTorch - ORT|; for sequence outputs ([batch, sequence, ...]) only at positions the attention mask
    keeps (padded positions are fully masked and legitimately differ). A shape mismatch or a one-sided NaN
    counts as infinite."""
    import numpy as np
    import torch

    ref = reference.detach().to(torch.float64).cpu().numpy()
    got = np.asarray(got, dtype=np.float64)
    if ref.shape != got.shape:
        return float("inf")
    if attention_mask is not None and ref.ndim >= 3 and tuple(ref.shape[:2]) == tuple(attention_mask.shape):
        keep = attention_mask.detach().cpu().numpy().astype(bool)
        ref, got = ref[keep], got[keep]
    if ref.size == 0:
        return 0.0
    with np.errstate(invalid="ignore"):  # inf - inf: equal infinities, set to 0 below
        diff = np.abs(ref - got)
    diff[(np.isnan(ref) & np.isnan(got)) | (ref == got)] = 0.0  # equal infinities (masked logits) agree
    return float(np.nan_to_num(diff, nan=np.inf).max())


def staged_name(output: Path) -> str:
    """A name for an export's graph while it is staged, unique to this export: its weights file is that name +
    `.data` (OUTPUT.NAME.PID-<12 hex digits>.data), which no earlier export used, so the graph renamed into place
    reads its own weights, never an earlier export's; the process id tells a killed export's (sweep_weights) from
    those of one still running."""
    return f"{output.name}.{os.getpid()}-{uuid.uuid4().hex[:12]}"


def move_into_place(graph: Path, output: Path) -> None:
    """Move a staged export (`graph` and the weights files beside it) to `output`: the weights first, under names of
    their own, then the graph in one rename, then the weights the replaced graph named. Stopped at any point,
    `output` is the earlier graph beside its weights or the new one beside its own, never one graph beside the
    other's weights; another export's weights beside it (one writing the same path at once) are left alone. Stopped
    by an error or Ctrl-C before the graph's rename, the weights it moved go again: beside the earlier export they
    were gigabytes no graph names (a kill leaves them, as it leaves the staging folder)."""
    weights = [f.name for f in graph.parent.iterdir() if f != graph]
    replaced = replaced_weights(output)
    moved: list[Path] = []
    try:
        for name in weights:
            moved.append(output.parent / name)  # (a name of its own: staged_name) listed first, then moved
            os.replace(graph.parent / name, moved[-1])
        failpoints.reached("export_write")
        os.replace(graph, output)
    except BaseException:
        if graph.exists():  # not renamed: no graph at `output` names the moved weights
            for path in moved:
                path.unlink(missing_ok=True)
        raise
    for stale in replaced:
        if stale.name not in weights:
            stale.unlink(missing_ok=True)
    sweep_weights(output)


def sweep_weights(output: Path) -> None:
    """Remove the weights files beside `output` that a killed export moved there (named by staged_name) and no graph
    in the folder names: killed before its graph's rename, the new weights; after it, the replaced ones. They may be
    gigabytes. Only a dead process's go (folders.ownerless): another export of this path may be running; none a graph
    the user kept names (`mv model.onnx deploy.onnx` still reads model.onnx.PID-HEX.data); and none while the graph
    at `output` cannot be read, as which files are its is then not known."""
    from google.protobuf.message import DecodeError

    try:
        kept = {p.name for p in weights_files(output)} if output.is_file() else set()
    except (DecodeError, OSError, ValueError):
        return
    unnamed = []
    for path in output.parent.glob(f"{glob.escape(output.name)}.*-*.data"):
        found = STAGED_WEIGHTS.fullmatch(path.name[len(output.name) + 1 :])
        if found is not None and path.name not in kept and ownerless(path, int(found["pid"])):
            unnamed.append(path)
    if not unnamed:  # the usual case: no export was killed here, so no graph is read
        return
    named = names_in_graphs(output.parent, {p.name for p in unnamed})
    for path in unnamed:
        if path.name not in named:
            path.unlink(missing_ok=True)


def names_in_graphs(folder: Path, names: set[str]) -> set[str]:
    """Which of `names` a graph file in `folder` (*.onnx, *.omny) holds. An external data location is a plain string
    in the graph's bytes, so a search finds it without parsing graphs or reading their weights; a graph that cannot
    be read may name any of them, so then all are."""
    found: set[str] = set()
    for path in folder.iterdir():
        if path.suffix not in (".onnx", ".omny") or not path.is_file():
            continue
        try:
            with path.open("rb") as file:
                if os.fstat(file.fileno()).st_size == 0:
                    continue
                with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
                    found |= {name for name in names - found if data.find(os.fsencode(name)) != -1}
        except OSError:
            return set(names)
    return found


def replaced_weights(output: Path) -> list[Path]:
    """The weights files the graph at `output` names, which an export over it leaves behind: none where there is no
    graph there, or one ONNX cannot read (its files, if any, are not known to be its)."""
    from google.protobuf.message import DecodeError

    if not output.is_file():
        return []
    try:
        return weights_files(output)
    except (DecodeError, OSError, ValueError):
        return []


def weights_files(path: Path) -> list[Path]:
    """The files beside an ONNX graph that hold its weights (ONNX external data), as its tensors name them."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo, _get_all_tensors, uses_external_data

    model = onnx.load(str(path), load_external_data=False)
    named = {ExternalDataInfo(t).location for t in _get_all_tensors(model) if uses_external_data(t)}
    return sorted(path.parent / name for name in named)


def _shapes(sample: dict) -> dict[str, list[int]]:
    return {name: list(getattr(v, "shape", [])) for name, v in sample.items()}


def _one_line(e: BaseException, limit: int = 300) -> str:
    """An error message as one line (checker messages wrap the node they name over several lines)."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
