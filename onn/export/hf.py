"""export=safetensors: the trained model as a Hugging Face folder, LoRA merged; the adapter alone.

The merged weights are produced one group at a time (the weights before the blocks, each block,
the weights after them), so a layer-streamed model is exported from its layer store a block at a
time and never has to fit in memory: the block is read, decoded to the compute dtype, its LoRA
deltas (peft's own `get_delta_weight`) are added to copies of its frozen weights, it goes into
the shard being filled, and it is dropped before the next block is read. The live model is only
read, never changed, so it may go on training or generating after an export.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from itertools import groupby
from pathlib import Path
from typing import TYPE_CHECKING, Any

from onn.errors import UserError
from onn.export.folders import held, is_export, stage, swap_in, sweep_leftovers, temp_prefix, write_atomically
from onn.models.layers import discover
from onn.streaming.store import stored_name

if TYPE_CHECKING:
    import torch
    from torch import nn

log = logging.getLogger("onn")
BASE_LAYER = "base_layer."


def save_folder(
    model: nn.Module,
    tokenizer: Any,
    output: Path,
    *,
    engine: Any = None,
    max_shard_size: str | int = "2GB",
    model_name: str | None = None,
    blocks_path: str | None = None,
    before_swap: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Write `output` as a folder transformers' from_pretrained loads (config, sharded safetensors,
    tokenizer) with LoRA merged. `model` is the trained model (a PeftModel, a transformers model, or
    ONN's CausalLM module); `engine` is the streaming engine when its blocks live in a layer store;
    `model_name` (its config's name) goes into the folder's onn_export.json; `blocks_path` (model.layer_map.blocks)
    names the blocks the weights are merged a block at a time by, where no engine says them."""
    import torch

    start = time.perf_counter()
    model, base, engine = _unwrap(model, engine)
    max_bytes = shard_bytes(max_shard_size)
    from transformers import PreTrainedModel

    if not isinstance(base, PreTrainedModel):
        raise UserError(
            f"export=safetensors writes a Hugging Face folder, which needs a transformers model; "
            f"{type(base).__name__} is not one (use export=onnx)."
        )
    if engine is not None and engine.store.dtype != str(engine.compute_dtype).removeprefix("torch."):
        log.info(
            "export: the layer store holds %s weights; the folder gets them de-quantized/cast to %s, "
            "as streaming computed with them",
            engine.store.dtype,
            str(engine.compute_dtype).removeprefix("torch."),
        )
    from transformers.core_model_loading import revert_weight_conversion

    untied = _untied(base)

    def write(folder: Path) -> int:
        shards = _Shards(folder, max_bytes)
        with torch.no_grad():
            for group in _merged_groups(model, base, engine, blocks_path):
                # back to the checkpoint's names where transformers renamed or fused weights on load
                shards.add(revert_weight_conversion(base, group))
                group.clear()
        count = shards.finish()
        config = copy.deepcopy(base.config)
        if getattr(config, "quantization_config", None) is not None:  # QLoRA's base: written de-quantized
            del config.quantization_config
        config.dtype = str(engine.compute_dtype if engine is not None else base.dtype).removeprefix("torch.")
        config.architectures = [type(base).__name__]
        if untied:
            _untie(config, untied)
        config.save_pretrained(folder)
        if base.can_generate() and getattr(base, "generation_config", None) is not None:
            copy.deepcopy(base.generation_config).save_pretrained(folder)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(folder))
        return count

    shards = write_atomically(Path(output), "hf", write, model_name, before_swap)  # (save_export's adapter)
    output = Path(output)
    files = [p for p in output.iterdir() if p.is_file()]
    total = sum(p.stat().st_size for p in files)
    seconds = time.perf_counter() - start
    log.info("export: wrote %s (%d shards, %.1f MB) in %.1f s", output, shards, total / 2**20, seconds)
    return {
        "export/folder": str(output),
        "export/files": len(files),
        "export/shards": shards,
        "export/bytes": total,
        "export/seconds": round(seconds, 3),
    }


def save_adapter(model: nn.Module, tokenizer: Any, output: Path, model_name: str | None = None) -> dict[str, Any]:
    """Write the LoRA adapter alone in peft's format (adapter_config.json + adapter_model.safetensors),
    loadable with PeftModel.from_pretrained(base, output)."""
    start = time.perf_counter()
    write_atomically(Path(output), "adapter", _adapter_writer(model, tokenizer), model_name)
    return _adapter_metrics(Path(output), start)


def save_export(
    model: nn.Module,
    tokenizer: Any,
    output: Path,
    *,
    engine: Any = None,
    max_shard_size: str | int,
    adapter: bool,
    model_name: str | None = None,
    blocks_path: str | None = None,
) -> dict[str, Any]:
    """The folder (save_folder) and OUTPUT-adapter beside it, replaced together: the adapter is staged before the
    folder is written; the earlier export's adapter is renamed aside (then removed) right before the new folder is
    swapped in, and the new adapter swapped in after it. Killed in between, the folder has no adapter beside it, never
    one trained with other weights (the next export removes the one set aside: sweep_leftovers)."""
    start = time.perf_counter()
    beside = adapter_folder(output)
    sweep_leftovers(beside)  # a killed export's staged or set-aside adapter, also where this export writes none
    staged = stage(beside, "adapter", _adapter_writer(model, tokenizer), model_name)[0] if adapter else None
    aside = Path(temp_prefix(beside) + "-replaced")  # (a leftover's name: removed, never put back)
    earlier: list[int | None] = []  # the folder at `output` when its adapter was set aside (its inode)

    def take_earlier() -> None:
        if beside.is_dir() and is_export(beside) and _earlier_adapter(beside, model_name):
            earlier.append(_inode(Path(output)))
            beside.rename(aside)

    try:
        metrics = save_folder(
            model,
            tokenizer,
            output,
            engine=engine,
            max_shard_size=max_shard_size,
            model_name=model_name,
            blocks_path=blocks_path,
            before_swap=take_earlier,
        )
    except BaseException:
        if staged is not None:
            shutil.rmtree(staged, ignore_errors=True)
        if earlier and earlier[0] == _inode(Path(output)) and not beside.exists():
            aside.rename(beside)  # the folder was not swapped: the earlier pair stays whole
        raise
    if staged is not None:
        swap_in(staged, beside)
        metrics.update(_adapter_metrics(beside, start))
    elif aside.is_dir():
        log.info("export: removed %s, an earlier export's adapter (this model has none)", beside)
    shutil.rmtree(aside, ignore_errors=True)
    return metrics


def save_network(network: nn.Module, folder: Path, onn_config: dict[str, Any]) -> None:
    """A classifier network's export into `folder`: model.safetensors, written by safetensors' save_model (a weight two
    layers share is stored once, where save_file refuses shared memory), in the network's own names (a torch.compile'd
    network's `_orig_mod.` prefix fitted nothing that loads it), and config.json (network_config)."""
    from safetensors.torch import save_model

    network = getattr(network, "_orig_mod", network)
    save_model(network, str(folder / "model.safetensors"), metadata={"format": "pt"})
    text = json.dumps(network_config(network, onn_config), indent=2, default=str)
    (folder / "config.json").write_text(text + "\n")


def network_config(network: nn.Module, onn_config: dict[str, Any]) -> dict[str, Any]:
    """config.json of a classifier network's export: what rebuilds it in ONN (`onn_config`: model, inputs, modality),
    the label names in the logits' order as Hugging Face (id2label, label2id) and timm (label_names, num_classes) keep
    them, the weights' dtype, and for an image network timm builds again by its name, timm's own keys, so that
    timm.create_model("local-dir:FOLDER", pretrained=True) loads it and timm's data config normalises as training
    did."""
    classes = [str(c) for c in onn_config["inputs"]["classes"]]
    config = {
        **onn_config,
        "num_classes": len(classes),
        "label_names": classes,
        "id2label": {str(i): c for i, c in enumerate(classes)},
        "label2id": {c: i for i, c in enumerate(classes)},
    }
    dtype = next((p.dtype for p in network.parameters() if p.is_floating_point()), None)
    if dtype is not None:
        config["dtype"] = str(dtype).removeprefix("torch.")
    if onn_config.get("modality") == "image":
        config.update(_timm_config(network, onn_config["inputs"]))
    return config


def _timm_config(network: nn.Module, inputs: dict[str, Any]) -> dict[str, Any]:
    """timm's keys of its config.json for `network`, with ONN's input size and mean/std (crop_pct 1: ONN brings the
    whole picture to its size); {} for a network timm would not build again from them: not timm's, or one whose
    layers ONN changed (model.small_input), which timm.create_model would build with other shapes."""
    architecture = (getattr(network, "pretrained_cfg", None) or {}).get("architecture")
    if not architecture:
        return {}
    import timm
    import torch

    try:
        from timm.models import get_model_args

        args = get_model_args(network, {})
        json.dumps(args)
        with torch.device("meta"):
            rebuilt = timm.create_model(architecture, pretrained=False, **args)
    except Exception:  # noqa: BLE001 -- an older timm, arguments it cannot write or take back: timm cannot rebuild it
        return {}
    shapes = {k: tuple(v.shape) for k, v in network.state_dict().items()}
    if shapes != {k: tuple(v.shape) for k, v in rebuilt.state_dict().items()}:
        return {}
    cfg = network.pretrained_cfg
    pretrained = {k: cfg[k] for k in ("first_conv", "classifier", "fixed_input_size") if k in cfg}
    pretrained.update(
        input_size=[int(v) for v in inputs["input_shape"]],
        num_classes=int(network.num_classes),
        crop_pct=1.0,
        crop_mode="center",
        interpolation="bilinear",
        mean=[float(v) for v in inputs["mean"]],
        std=[float(v) for v in inputs["std"]],
    )
    return {
        "architecture": architecture,
        "num_features": int(network.num_features),
        "model_args": args,
        "pretrained_cfg": pretrained,
    }


def _inode(path: Path) -> int | None:
    """Which folder is at `path` (None: none), to tell whether a swap happened."""
    return path.stat().st_ino if path.exists() else None


def adapter_folder(output: Path) -> Path:
    """Where export=safetensors puts the adapter alone: OUTPUT-adapter, beside the folder."""
    return output.with_name(output.name + "-adapter")


def _earlier_adapter(folder: Path, model_name: str | None) -> bool:
    """Whether `folder`, an earlier export, is an adapter of this model (or of one its marker does not name)."""
    kind, model = held(folder)
    return kind in ("adapter", None) and (model is None or model_name is None or model == model_name)


def shard_bytes(max_shard_size: str | int) -> int:
    """export.max_shard_size in bytes, as transformers reads it ("2GB", "500MB", 10**9); refused in one sentence
    (settings.check_settings asks before training)."""
    try:
        return _size(max_shard_size)
    except ValueError as e:
        raise UserError(f"export.max_shard_size={max_shard_size!r}: give bytes or a size like 2GB or 500MB.") from e


def _adapter_writer(model: nn.Module, tokenizer: Any) -> Callable[[Path], None]:
    """What writes the adapter into a folder; refuses a model without one before anything is written."""
    from peft import PeftModel

    model, _, _ = _unwrap(model, None)
    if not isinstance(model, PeftModel):
        raise UserError(
            f"{type(model).__name__} has no LoRA adapter to save; strategy=lora, qlora or sparse_lora trains one."
        )

    def write(folder: Path) -> None:
        model.save_pretrained(str(folder))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(folder))

    return write


def _adapter_metrics(output: Path, start: float) -> dict[str, Any]:
    files = [p for p in output.iterdir() if p.is_file()]
    return {
        "export/adapter": str(output),
        "export/adapter_files": len(files),
        "export/adapter_bytes": sum(p.stat().st_size for p in files),
        "export/adapter_seconds": round(time.perf_counter() - start, 3),
    }


def merged_model(model: nn.Module, engine: Any = None, blocks_path: str | None = None) -> nn.Module:
    """A new plain model (no peft layers) holding the merged weights on the CPU, for exporters that
    need the whole graph (ONNX). A streamed model's blocks all come from the store. Weights without
    an adapter share memory with the live model instead of being copied. `blocks_path`: as save_folder's."""
    import torch

    model, base, engine = _unwrap(model, engine)
    state: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for group in _merged_groups(model, base, engine, blocks_path):
            state.update(group)
    # Copy the module tree with empty parameters (deepcopy's memo stands in for every parameter),
    # drop the LoRA layers, then put the merged tensors in place.
    memo = {id(p): torch.nn.Parameter(torch.empty(0, dtype=p.dtype), requires_grad=False) for p in model.parameters()}
    clone = copy.deepcopy(model, memo)
    plain = clone.unload() if hasattr(clone, "unload") else clone
    plain = plain.to("cpu")
    unexpected = []
    # Set, not load_state_dict: a streamed block's placeholders have no shape to check against.
    for name, tensor in state.items():
        owner, _, attr = name.rpartition(".")
        module = plain.get_submodule(owner)
        if attr in module._parameters:
            module._parameters[attr] = torch.nn.Parameter(tensor, requires_grad=False)
        elif attr in module._buffers:
            module._buffers[attr] = tensor
        else:
            unexpected.append(name)
    if _untied(base):  # (the copy's own config: the live model stays tied)
        _untie(plain.config)
    if hasattr(plain, "tie_weights"):
        plain.tie_weights()
    empty = [n for n, p in plain.named_parameters() if p.numel() == 0]
    if unexpected or empty:
        raise RuntimeError(
            f"merged weights do not fit {type(plain).__name__}: unexpected {unexpected[:3]}, empty {empty[:3]}"
        )
    _unpack_4bit(plain)
    return plain.eval()


def _unpack_4bit(model: nn.Module) -> None:
    """QLoRA's 4-bit linears (in merged_model's copy) as plain nn.Linear layers holding the de-quantized, merged
    weights put in place of their packed codes: bitsandbytes' own forward reads the codes, and fails on a dense
    weight; and the copy no longer marked quantized, which transformers' `.to(dtype)` refuses."""
    import torch

    for key, packed in _packed_4bit(model).items():
        linear = torch.nn.Linear(packed.in_features, packed.out_features, bias=packed.bias is not None, device="meta")
        linear.weight = torch.nn.Parameter(packed.weight.data, requires_grad=False)
        if packed.bias is not None:
            linear.bias = torch.nn.Parameter(packed.bias.data, requires_grad=False)
        model.set_submodule(key.removesuffix(".weight"), linear)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:  # transformers refuses to cast a model it loaded quantized: the ONNX export casts it
        quantizer.remove_quantization_config(model)


# -- the merged weights, a group at a time -------------------------------------------------------
def _merged_groups(model, base, engine, blocks_path: str | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """The merged weights in the base model's own names (no peft prefixes, `base_layer` or lora_
    tensors), on the CPU: the weights before the blocks, then each block, then those after."""
    import torch

    state = _state(base)
    lora = _lora_layers(base)
    _check_mergeable(lora)
    _drop_tied(base, state, lora)
    names = {id(m): name for name, m in base.named_modules()}
    layer_map = engine.map if engine is not None else _layer_map(base, blocks_path)
    prefixes = [names[id(b)] for b in layer_map.blocks] if layer_map is not None else []
    blocks = {prefix: i for i, prefix in enumerate(prefixes)}
    cpu = torch.device("cpu")

    def group_of(key: str) -> int | str:
        parts = key.split(".")
        for j in range(1, len(parts)):
            i = blocks.get(".".join(parts[:j]))
            if i is not None:
                return i
        return "edges"

    def frozen(group: int | str, keys: list[str]) -> dict[str, torch.Tensor]:
        """The group's frozen weights from the layer store (streamed), by output name."""
        if engine is None:
            return {}
        if group != "edges":
            tensors = engine.store.decode(engine.store.read(group), cpu, engine.compute_dtype)
            return {f"{prefixes[group]}.{n}": t for n, t in tensors.items()}
        if not engine.edges:
            return {}
        tensors = engine.store.decode(engine.store.read("edges"), cpu, engine.compute_dtype)
        in_engine = {id(p): n for n, p in engine.model.named_parameters()}
        return {
            stored_name(k): tensors[in_engine[id(state[k])]] for k in keys if in_engine.get(id(state[k])) in tensors
        }

    packed = _packed_4bit(base)
    for group, keys in groupby(list(state), key=group_of):
        keys = list(keys)
        stored = frozen(group, keys)
        out = {}
        for key in keys:
            owner = _owner(key, lora)
            rest = key[len(owner) + 1 :] if owner else ""
            head, state_of_weight, _ = key.partition(".weight.")
            if owner and not rest.startswith(BASE_LAYER) or state_of_weight and f"{head}.weight" in packed:
                continue  # the adapter's own tensors; a 4-bit weight's quantisation state (absmax, quant_state...)
            name = f"{owner}.{rest[len(BASE_LAYER) :]}" if owner else key
            tensor = stored.pop(name, None)
            if tensor is None:
                tensor = _dense(state[key], packed.get(key)).to(cpu)
                if tensor.numel() == 0:  # a streamed block's placeholder
                    where = "nor in the layer store" if engine else "(pass the streaming engine that holds it)"
                    raise RuntimeError(f"{key} is not in memory {where}")
            if owner:
                tensor = _merge(lora[owner], rest[len(BASE_LAYER) :], tensor)
            out[name] = tensor
        stored = None  # what was not used: gone before the next group is read
        yield out


def _state(base) -> dict[str, torch.Tensor]:
    """The base model's state dict as the merged folder names it: without what save_pretrained leaves out, and each
    of peft's modules_to_save (a fully trained lm_head beside the adapters) as the copy the model computes with, under
    the module's own name (`lm_head.weight`, not `lm_head.modules_to_save.default.weight` beside the original)."""
    state = base.state_dict(keep_vars=True)
    for key in getattr(base, "_keys_to_ignore_on_save", None) or []:
        state.pop(key, None)
    copies = _saved_copies(base)
    if not copies:
        return state
    out = {}
    for key, tensor in state.items():
        wrapper = next((w for w in copies if key.startswith(f"{w}.")), None)
        if wrapper is None:
            out[key] = tensor
        elif key.startswith(f"{copies[wrapper]}."):
            out[f"{wrapper}.{key[len(copies[wrapper]) + 1 :]}"] = tensor
    return out


def _saved_copies(base) -> dict[str, str]:
    """Each of peft's modules_to_save wrappers -> the prefix of the module it computes with: the active adapter's
    trained copy, or the original where no adapter of it is active (as peft's own unload picks). Trainable tokens
    (trainable_token_indices) are refused: their rows would be written untrained."""
    from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper

    out = {}
    for name, module in base.named_modules():
        if isinstance(module, ModulesToSaveWrapper):
            active = module.active_adapters
            out[name] = f"{name}.modules_to_save.{active[0]}" if active else f"{name}.original_module"
        elif isinstance(module, AuxiliaryTrainingWrapper):
            raise UserError(
                f"{name} is peft's {type(module).__name__} (trainable_token_indices), which the export does not "
                "merge; merge the model with peft's merge_and_unload() first, or save the adapter alone "
                "(save_pretrained)."
            )
    return out


def _check_mergeable(lora: dict[str, Any]) -> None:
    """Refuse an adapter that trained a bias (lora_bias) on a layer that has none: the folder's architecture has no
    bias to hold it, and leaving it out would change the model's outputs (peft's merge refuses it too)."""
    for name, layer in lora.items():
        if getattr(layer.get_base_layer(), "bias", None) is None and any(
            map(getattr(layer, "lora_bias", {}).get, layer.active_adapters)
        ):
            raise UserError(
                f"the LoRA adapter on {name} trained a bias (lora_bias=True), but {name} has none to merge it into; "
                "save the adapter alone (save_pretrained), or train it with lora_bias=False."
            )


def _packed_4bit(base) -> dict[str, Any]:
    """Each 4-bit linear's weight key -> the bitsandbytes module: QLoRA's base holds NF4 codes packed two to a
    byte, and their quantisation state under further keys of the weight (absmax, quant_map, ...)."""
    if getattr(base.config, "quantization_config", None) is None:
        return {}
    import bitsandbytes as bnb

    return {f"{name}.weight": m for name, m in base.named_modules() if isinstance(m, bnb.nn.Linear4bit)}


def _dense(tensor: torch.Tensor, four_bit) -> torch.Tensor:
    """A weight as the folder holds it: a 4-bit one de-quantized (as its forward does), else as it is."""
    if four_bit is None:
        return tensor.detach()
    import bitsandbytes as bnb

    weight = four_bit.weight
    return bnb.functional.dequantize_4bit(weight.data, weight.quant_state)


def _merge(layer, param: str, tensor: torch.Tensor) -> torch.Tensor:
    """A copy of a LoRA layer's base weight (or bias) with the active adapters added, as peft's merge
    adds them (`weight += get_delta_weight(adapter)`, `bias += lora_B.bias * scaling`)."""
    adapters = [
        a
        for a in layer.active_adapters
        if a not in layer.merged_adapters and (a in layer.lora_A or a in getattr(layer, "lora_embedding_A", {}))
    ]
    for a in adapters:
        if a in getattr(layer, "lora_variant", {}):
            raise UserError(
                f"adapter '{a}' is a LoRA variant (e.g. DoRA) that export=safetensors does not merge; "
                "export the adapter alone."
            )
    if param == "weight":
        merged = tensor.clone()
        for a in adapters:
            merged += layer.get_delta_weight(a).to(merged.device)
        return merged
    if param == "bias" and any(getattr(layer, "lora_bias", {}).get(a) for a in adapters):
        merged = tensor.clone()
        for a in adapters:
            if layer.lora_bias.get(a):
                merged += (layer.lora_B[a].bias * layer.scaling[a]).to(merged.device)
        return merged
    return tensor


def _owner(key: str, lora: dict[str, Any]) -> str | None:
    """The LoRA layer a state-dict key belongs to, if any."""
    parts = key.split(".")
    for j in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:j])
        if prefix in lora:
            return prefix
    return None


def _drop_tied(base, state: dict[str, Any], lora: dict[str, Any]) -> set[str]:
    """Leave out what save_pretrained leaves out: the tied copies (lm_head.weight when the embeddings are tied),
    which from_pretrained ties again. A LoRA layer's base weight tied to another (an adapter on a tied lm_head or
    embedding) stays: merged, it is no longer the other's, as in the live model, where the adapter changes one of the
    two alone, and so does a tied weight peft's modules_to_save trained as a copy of its own. Returns those keys (the
    folder is then untied: _untie)."""
    tied = getattr(base, "all_tied_weights_keys", None) or {}
    copies = _saved_copies(base)
    kept: set[str] = set()
    for target, source in tied.items():
        if target not in state or source not in state:
            continue
        if state[target] is state[source]:
            del state[target]
        elif {target.rsplit(".", 1)[0], source.rsplit(".", 1)[0]} & copies.keys():
            kept.add(target)  # a modules_to_save copy (a fully trained head), trained apart from the other
    sharing: dict[int, list[str]] = {}
    for key in state:
        sharing.setdefault(id(state[key]), []).append(key)
    tied_names = set(tied) | set(tied.values())
    for keys in sharing.values():
        adapted = [k for k in keys if _adapted_base(k, lora)]
        plain = [k for k in keys if k not in adapted]
        for key in plain[1:]:  # anything else shared: keep the first name
            del state[key]
        # only a tie the config states (the output embeddings to the input ones) is undone by _untie: blocks that
        # share weights (ALBERT's, Zamba2's shared block) keep their tie, and their head its tie to the embeddings
        if len(keys) > 1 and any(k.replace(BASE_LAYER, "") in tied_names for k in keys):
            kept.update(adapted)
    return kept


def _adapted_base(key: str, lora: dict[str, Any]) -> bool:
    """Whether a state-dict key is a LoRA layer's base weight or bias (what the merge changes)."""
    owner = _owner(key, lora)
    return owner is not None and key[len(owner) + 1 :].startswith(BASE_LAYER)


def _lora_layers(base) -> dict[str, Any]:
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}


def _untied(base) -> set[str]:
    """The LoRA base weights of `base` tied to another weight (see _drop_tied), which the export writes apart."""
    return _drop_tied(base, _state(base), _lora_layers(base))


def _untie(config, keys: set[str] = frozenset()) -> None:
    """A config that no longer ties the output embeddings to the input ones: the merged folder holds both (an
    adapter trained one of them), and from_pretrained would tie them again, dropping what the adapter learned."""
    for part in {id(c): c for c in (config, config.get_text_config(decoder=True))}.values():
        if getattr(part, "tie_word_embeddings", False):
            part.tie_word_embeddings = False
    if keys:
        log.info("export: %s trained apart from the weight it was tied to: written untied", ", ".join(sorted(keys)))


def _layer_map(base, blocks_path: str | None):
    """The blocks the merged weights are grouped by: model.layer_map.blocks where set, else discovered."""
    try:
        return discover(base, blocks_path)
    except UserError:  # no repeated blocks: one group holds everything
        if blocks_path is not None:
            raise  # a layer_map.blocks that names no blocks: its own sentence
        return None


def _unwrap(model, engine):
    """(the model, the transformers model under any peft wrapper, the engine), from what the caller has."""
    from peft import PeftModel
    from torch import nn
    from transformers import PreTrainedModel

    if not isinstance(model, (PeftModel, PreTrainedModel)) and isinstance(getattr(model, "model", None), nn.Module):
        engine = engine if engine is not None else getattr(model, "engine", None)  # ONN's CausalLM module
        model = model.model
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    return model, base, engine


def _size(max_shard_size: str | int) -> int:
    from transformers.utils.hub import convert_file_size_to_int

    size = convert_file_size_to_int(max_shard_size)
    if size <= 0:
        raise ValueError(max_shard_size)
    return size


class _Shards:
    """Safetensors shards filled in order and flushed when the next tensor would overflow one;
    named as save_pretrained names them once their number is known."""

    def __init__(self, folder: Path, max_bytes: int):
        self.folder, self.max_bytes = folder, max_bytes
        self.buffer: dict[str, torch.Tensor] = {}
        self.buffer_bytes = 0
        self.names: list[list[str]] = []  # tensor names per written shard
        self.total_bytes = self.total_params = 0

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            size = tensor.numel() * tensor.element_size()
            if self.buffer and self.buffer_bytes + size > self.max_bytes:
                self.flush()
            self.buffer[name] = tensor.contiguous()
            self.buffer_bytes += size
            self.total_bytes += size
            self.total_params += tensor.numel()

    def flush(self) -> None:
        from safetensors.torch import save_file

        if self.buffer:
            save_file(self.buffer, str(self._part(len(self.names))), metadata={"format": "pt"})
            self.names.append(list(self.buffer))
            self.buffer, self.buffer_bytes = {}, 0

    def _part(self, k: int) -> Path:
        return self.folder / f"part-{k:05d}.tmp"

    def finish(self) -> int:
        self.flush()
        n = len(self.names)
        files = ["model.safetensors"] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
        for k, file in enumerate(files):
            os.replace(self._part(k), self.folder / file)
        if n > 1:
            index = {
                "metadata": {"total_size": self.total_bytes, "total_parameters": self.total_params},
                "weight_map": {name: file for file, names in zip(files, self.names) for name in names},
            }
            text = json.dumps(index, indent=2, sort_keys=True) + "\n"
            (self.folder / "model.safetensors.index.json").write_text(text)
        return n
