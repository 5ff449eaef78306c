"""Load a model block by block straight into the layer store, so it never has to fit in memory.

The model is built with empty weights; each block the store lacks is read from the source's
safetensors files (or randomly initialised, seeded per block) and written to the store, one block in
memory at a time. Only the prefix/suffix weights are materialised; the blocks keep empty
placeholders, which the streaming engine fills from the store.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onn.config.model import LanguageModelConfig
from onn.hardware.memory import large_frees_returned
from onn.models.layers import discover
from onn.models.load import (
    INIT_SEED,
    architecture,
    auto_class,
    block_seed,
    check_shards,
    check_vocabulary,
    converted_gguf,
    draw_random,
    edge_seed,
    expand,
    finish_tokenizer,
    gguf_parsed_once,
    hub_folder,
    outside_blocks,
    random_draw_device,
    read_config,
    refuse_pickle_folder,
    source_kind,
    tokenizer_from,
)
from onn.streaming.store import build_progress, stored_name


@dataclass
class Source:
    """Where a streamed model's weights come from: its config, its safetensors files (and which file holds
    each tensor), or a GGUF file read tensor by tensor, or neither (random weights, seeded per block)."""

    config: Any
    files: list[str] = field(default_factory=list)
    where: dict[str, str] = field(default_factory=dict)  # tensor name -> file
    gguf: GGUFBlocks | None = None
    tokenizer: Any = None

    @classmethod
    def open(cls, model_cfg: LanguageModelConfig, cache_dir) -> Source | None:
        """The model config's source, or None where it cannot be read block by block (a Python builder)."""
        source, remote = model_cfg.source, model_cfg.trust_remote_code
        kind = source_kind(source)
        if kind == "random":
            return cls(architecture(model_cfg))
        if kind == "safetensors":
            return cls(architecture(model_cfg), [expand(source)])._indexed()
        if kind == "gguf" and converted_gguf(source, cache_dir) is None:
            with gguf_parsed_once():
                gguf = GGUFBlocks(expand(source))  # read tensor by tensor: a GGUF larger than RAM loads too
                return cls(gguf.config, gguf=gguf, tokenizer=gguf.tokenizer())
        if kind not in ("folder", "hub", "gguf"):
            return None
        folder = {"folder": expand, "hub": hub_folder}.get(kind, lambda s: converted_gguf(s, cache_dir))(source)
        refuse_pickle_folder(folder)
        check_shards(folder)  # a missing or truncated shard: one sentence, not a SafetensorError in _indexed
        files = sorted(str(f) for f in Path(folder).glob("*.safetensors"))
        return cls(read_config(folder, remote), files, tokenizer=tokenizer_from(folder, remote))._indexed()

    def _indexed(self) -> Source:
        from safetensors import safe_open

        for file in self.files:
            with safe_open(file, framework="pt") as f:
                self.where.update({key: file for key in f.keys()})  # noqa: SIM118 (safe_open is not iterable)
        return self

    def reads(self, model) -> bool:
        """Whether every weight of the model is in the files by its own name (renamed or fused weights are not)."""
        return not self.files or all(n in self.where for n, _ in model.named_parameters())


@dataclass
class Materialiser:
    """Real weights for a module of the empty model: read from the source's files or GGUF, or initialised
    from a seed (in float32 and cast, which is fast; `in_dtype`: straight in the weights dtype, which holds no
    float32 copy of a large embedding) on `init_device`; a prefix or suffix module ends on the host, as a
    loaded model's does. Random weights for a store in host memory (rebuilt every run, never resumed) are
    drawn on the compute device when it is a GPU: Phi-4's 14.7B values take seconds there and minutes on a
    CPU's one RNG thread; a disk store draws them on the CPU, so a build resumed elsewhere continues the stream."""

    source: Source
    model: Any
    dtype: Any
    init_device: str

    def __call__(self, module, prefix: str, seed: int, recurse: bool = True, in_dtype: bool = False) -> None:
        from safetensors import safe_open

        src = self.source
        if src.files:  # each file opened once per module; assign=True replaces the meta parameters
            names = [n for n, _ in module.named_parameters(recurse=recurse)]
            state = {}
            for file in {src.where[prefix + n] for n in names}:
                with safe_open(file, framework="pt") as f:
                    state.update({n: f.get_tensor(prefix + n) for n in names if src.where[prefix + n] == file})
            module.load_state_dict(state, strict=False, assign=True)
        elif src.gguf is not None:
            names = [n for n, _ in module.named_parameters(recurse=recurse) if src.gguf.has(prefix + n)]
            module.load_state_dict({n: src.gguf.tensor(prefix + n) for n in names}, strict=False, assign=True)
        else:  # as `load` draws a resident model: the same weights wherever they live
            draw_random(self.model, module, seed, self.init_device, recurse, self.dtype, in_dtype)
        for param in module.parameters(recurse=recurse):
            param.data = param.data.to(self.dtype or param.dtype)
            if not recurse and not param.is_meta:  # (a tied weight the GGUF lacks is tied after the load)
                param.data = param.data.to("cpu")


def load_into_store(
    model_cfg: LanguageModelConfig, dtype, cache_dir, store, device: str = "cpu"
) -> tuple[Any, Any] | None:
    """Load a model for layer streaming one block at a time, so it never has to fit in memory.

    The model is built with empty weights; each block the store lacks is read from the source's
    safetensors files (or randomly initialised, seeded per block) and written to the store; only
    the prefix/suffix weights are materialised. The blocks keep empty placeholders, which the
    streaming engine fills from the store. Returns None where a source cannot be read this way
    (a Python builder, checkpoint names that differ from the model's): the caller then loads the whole model."""
    from accelerate import init_empty_weights

    source = Source.open(model_cfg, cache_dir)
    if source is None:
        return None
    remote = model_cfg.trust_remote_code
    with init_empty_weights(include_buffers=False):
        model = auto_class(source.config).from_config(source.config, trust_remote_code=remote)
    if not source.reads(model):
        return None
    if source.gguf is not None:
        source.gguf.map_names(model)
    materialise = Materialiser(source, model, dtype, random_draw_device(store.kind, device))
    layer_map = discover(model, model_cfg.layer_map.blocks)
    with large_frees_returned():  # block-sized buffers come and go here: don't let them pile up in the heap
        _write_blocks(layer_map, store, materialise, INIT_SEED, dtype)
        _materialise_edges(model, layer_map, materialise, INIT_SEED)
    model.tie_weights()
    tokenizer = finish_tokenizer(model_cfg, source.tokenizer, remote)
    check_vocabulary(model_cfg, model, tokenizer)  # as load() checks a resident model
    return model.eval(), tokenizer  # in eval mode as load() returns one: from_config built it in train mode


def _write_blocks(layer_map, store, materialise: Materialiser, seed: int, dtype) -> None:
    """Each block the store lacks, materialised, written and emptied: one block in memory at a time. Every
    block ends an empty placeholder, which the streaming engine fills from the store."""
    import torch

    shapes = {
        i: {stored_name(n): list(p.shape) for n, p in b.named_parameters()} for i, b in enumerate(layer_map.blocks)
    }

    def empty(block) -> None:
        for module in block.modules():
            for name, p in list(module._parameters.items()):
                if p is not None:
                    module._parameters[name] = torch.nn.Parameter(
                        torch.empty(0, dtype=dtype or torch.float32), requires_grad=False
                    )

    with store.building():  # another process building the same store waits, then finds these blocks whole
        missing = store.missing(shapes)  # the disk's room is checked here, before anything is written
        with build_progress(store, missing, shapes):
            for i in missing:
                block = layer_map.blocks[i]
                materialise(block, layer_map.block_paths[i] + ".", block_seed(seed, i))
                store.write(i, {stored_name(n): p.data for n, p in block.named_parameters()})
                empty(block)
    for block in layer_map.blocks:
        empty(block)


def _materialise_edges(model, layer_map, materialise: Materialiser, seed: int) -> None:
    """The prefix and suffix: every module outside the blocks, seeded by its name."""
    for name, module in outside_blocks(model, layer_map):
        materialise(module, f"{name}." if name else "", edge_seed(seed, name), recurse=False, in_dtype=True)


class GGUFBlocks:
    """A GGUF file read one tensor at a time (memory-mapped, de-quantized to float32 on demand), with
    transformers' own name mapping and tensor fix-ups (Llama's q/k permutation), so that a model
    larger than RAM goes from a GGUF file into the layer store block by block."""

    def __init__(self, path: str):
        import os

        from gguf import GGUFReader
        from transformers import AutoConfig
        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS,
            TensorProcessor,
            load_gguf_checkpoint,
            read_field,
        )

        from onn.errors import UserError
        from onn.models.load import check_gguf

        check_gguf(path)
        self.path, folder = path, os.path.dirname(path) or "."
        try:
            self.config = AutoConfig.from_pretrained(folder, gguf_file=os.path.basename(path), local_files_only=True)
            meta = load_gguf_checkpoint(path, return_tensors=False)["config"]  # the metadata: no tensor is read
        except (ValueError, OSError, KeyError) as e:
            raise UserError(f"model.source {path} could not be read as GGUF: {e}") from e
        self.reader = GGUFReader(path)
        arch = read_field(self.reader, "general.architecture")[0]
        self.processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=meta)
        self.by_name = {t.name: t for t in self.reader.tensors}
        self.to_hf: dict[str, str] = {}
        self.from_hf: dict[str, str] = {}

    def tokenizer(self):
        import os

        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(
            os.path.dirname(self.path) or ".", gguf_file=os.path.basename(self.path), local_files_only=True
        )

    def map_names(self, model) -> None:
        from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

        self.to_hf = get_gguf_hf_weights_map(model, self.processor)
        self.from_hf = {hf: gguf for gguf, hf in self.to_hf.items() if gguf in self.by_name}

    def has(self, hf_name: str) -> bool:
        return hf_name in self.from_hf

    def tensor(self, hf_name: str):
        """One weight as float32, as transformers' GGUF loader would have made it."""
        import numpy as np
        import torch
        from gguf import dequantize

        t = self.by_name[self.from_hf[hf_name]]
        result = self.processor.process(
            weights=dequantize(t.data, t.tensor_type),
            name=t.name,
            tensor_key_mapping=self.to_hf,
            parsed_parameters={"tensors": {}, "config": {}},
        )
        return torch.from_numpy(np.copy(result.weights))
