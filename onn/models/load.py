"""Any model source -> an nn.Module and its tokenizer, offline, without pickle.

Sources (model.source):
  random                        build the architecture in the model config with random weights
  org/name                      a Hugging Face hub id, read from the local cache only
  path/to/folder                a Hugging Face folder (config.json + *.safetensors)
  path/to/model.gguf            a GGUF file (transformers de-quantizes it; needs `gguf`)
  path/to/model.safetensors     weights for the architecture in the model config
  path/to/file.py:function      a Python builder returning an nn.Module (or (module, tokenizer))
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

from onn.errors import UserError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".joblib")
CONVERT_HINT = (
    "ONN loads safetensors only (pickle files can run code when loaded). Convert it once on a machine you trust: "
    "python -c \"import torch, safetensors.torch as st; st.save_file(torch.load('{p}', weights_only=True), '{stem}.safetensors')\""
)


def source_kind(source: str | None) -> str:
    """Classify model.source: random | python | gguf | safetensors | folder | hub."""
    if source in (None, "", "random"):
        return "random"
    src = str(source)
    if ".py:" in src:
        return "python"
    path = Path(src).expanduser()
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise UserError(
            f"model.source {src} is a pickle checkpoint. "
            + CONVERT_HINT.format(p=src, stem=path.with_suffix(""))
        )
    if path.suffix.lower() in (".gguf", ".safetensors"):
        if not path.is_file():
            raise UserError(
                f"model.source {src} does not exist; check the path (for SmolLM2 run ../shared/scripts/fetch-smollm2.sh)."
            )
        return path.suffix.lower().lstrip(".")
    if path.is_dir():
        return "folder"
    if src.startswith((".", "/", "~")) or src.count("/") != 1:
        raise UserError(
            f"model.source {src} does not exist; give a Hugging Face folder, a .gguf/.safetensors file, file.py:function, a hub id, or `random`."
        )
    return "hub"


def is_pretrained(model_cfg: dict[str, Any]) -> bool:
    """Weights that carry knowledge (anything but random init): the planner prefers LoRA for them."""
    return model_cfg.get("source") not in (None, "", "random")


def architecture(model_cfg: dict[str, Any]):
    """The transformers config of the model, from the model YAML (no weights needed)."""
    from transformers import AutoConfig

    arch = dict(model_cfg.get("architecture") or {})
    if not arch:
        kind = source_kind(model_cfg.get("source"))
        if kind == "folder":
            return AutoConfig.from_pretrained(
                _expand(model_cfg["source"]), trust_remote_code=bool(model_cfg.get("trust_remote_code"))
            )
        if kind == "hub":
            return AutoConfig.from_pretrained(
                _hub_folder(model_cfg["source"]), trust_remote_code=bool(model_cfg.get("trust_remote_code"))
            )
        return None
    model_type = arch.pop("model_type", None)
    if model_type is None:
        raise UserError(
            f"model.architecture of '{model_cfg.get('name')}' needs a model_type (e.g. llama, phi3, gpt2)."
        )
    return AutoConfig.for_model(model_type, **arch)


def meta_model(model_cfg: dict[str, Any]):
    """The model built on PyTorch's meta device: exact shapes and parameter counts, no memory, no weights."""
    import torch

    with torch.device("meta"):
        if source_kind(model_cfg.get("source")) == "python":
            return _split_builder_result(_call_builder(model_cfg["source"], model_cfg.get("kwargs") or {}))[0]
        config = architecture(model_cfg)
        if config is None:
            raise UserError(
                f"model '{model_cfg.get('name')}' has no architecture in its config; add model.architecture to plan it without weights."
            )
        return _auto_class(config).from_config(
            config, trust_remote_code=bool(model_cfg.get("trust_remote_code"))
        )


def load(model_cfg: dict[str, Any], dtype=None, cache_dir: str | os.PathLike | None = None):
    """Build or load the model and its tokenizer. `dtype` is the weights dtype the plan chose;
    `cache_dir` keeps converted GGUF models so the slow conversion happens once per file."""
    import torch

    kind = source_kind(model_cfg.get("source"))
    source = model_cfg.get("source")
    remote = bool(model_cfg.get("trust_remote_code"))
    tokenizer = None
    if kind == "random":
        config = architecture(model_cfg)
        torch.manual_seed(int(model_cfg.get("init_seed", 0)))
        model = _auto_class(config).from_config(config, trust_remote_code=remote)
    elif kind == "python":
        model, tokenizer = _split_builder_result(_call_builder(source, model_cfg.get("kwargs") or {}))
    elif kind == "gguf":
        model, tokenizer = _load_gguf(_expand(source), dtype, cache_dir)
    elif kind == "safetensors":
        model = _load_safetensors_file(model_cfg, _expand(source))
    else:
        folder = _expand(source) if kind == "folder" else _hub_folder(source)
        _refuse_pickle_folder(folder)
        config = _read_config(folder, remote)
        model = _auto_class(config).from_pretrained(
            folder,
            local_files_only=True,
            use_safetensors=True,
            trust_remote_code=remote,
            dtype=dtype or "auto",
        )
        tokenizer = _tokenizer_from(folder, remote)
    if dtype is not None:
        model = model.to(dtype)
    return model, _finish_tokenizer(model_cfg, tokenizer, remote)


def _finish_tokenizer(model_cfg: dict[str, Any], tokenizer, remote: bool):
    """The tokenizer the model config asks for (or the source's), with a pad token."""
    tok_cfg = model_cfg.get("tokenizer")
    if tok_cfg == "byte":
        from onn.models.tokenizer import byte_tokenizer

        tokenizer = byte_tokenizer()
    elif tok_cfg:
        tokenizer = _tokenizer_from(_expand(tok_cfg), remote)
    if tokenizer is None:
        raise UserError(
            f"model '{model_cfg.get('name')}' has no tokenizer; set model.tokenizer to a folder with one, or `byte`."
        )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_into_store(model_cfg: dict[str, Any], dtype, cache_dir, store) -> tuple[Any, Any] | None:
    """Load a model for layer streaming one block at a time, so it never has to fit in memory.

    The model is built with empty weights; each block the store lacks is read from the source's
    safetensors files (or randomly initialised, seeded per block) and written to the store; only
    the prefix/suffix weights are materialised. The blocks keep empty placeholders, which the
    streaming engine fills from the store. Returns None where a source cannot be read this way
    (a Python builder, a GGUF file not converted yet, checkpoint names that differ from the
    model's): the caller then loads the whole model."""
    import zlib

    import torch
    from accelerate import init_empty_weights
    from safetensors import safe_open

    from onn.hardware.memory import return_large_frees_to_os
    from onn.models.layers import discover
    from onn.strategies.streaming import stored_name

    return_large_frees_to_os()  # block-sized buffers come and go here: don't let them pile up in the heap

    kind, source = source_kind(model_cfg.get("source")), model_cfg.get("source")
    remote = bool(model_cfg.get("trust_remote_code"))
    files: list[str] = []
    tokenizer = None
    if kind == "random":
        config = architecture(model_cfg)
    elif kind == "safetensors":
        config, files = architecture(model_cfg), [_expand(source)]
    elif kind in ("folder", "hub", "gguf"):
        folder = (
            _expand(source)
            if kind == "folder"
            else _hub_folder(source)
            if kind == "hub"
            else _converted_gguf(source, cache_dir)
        )
        if folder is None:
            return None
        _refuse_pickle_folder(folder)
        config = _read_config(folder, remote)
        files = sorted(str(f) for f in Path(folder).glob("*.safetensors"))
        tokenizer = _tokenizer_from(folder, remote)
    else:
        return None
    with init_empty_weights(include_buffers=False):
        model = _auto_class(config).from_config(config, trust_remote_code=remote)
    where = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            where.update({key: file for key in f.keys()})  # noqa: SIM118 (safe_open is not iterable)
    names = [n for n, _ in model.named_parameters()]
    if files and any(n not in where for n in names):
        return None  # checkpoint names differ from the model's (renamed or fused weights)

    def materialise(module: torch.nn.Module, prefix: str, seed: int, recurse: bool = True) -> None:
        if files:  # each file opened once per module; assign=True replaces the meta parameters
            names = [n for n, _ in module.named_parameters(recurse=recurse)]
            state = {}
            for file in {where[prefix + n] for n in names}:
                with safe_open(file, framework="pt") as f:
                    state.update({n: f.get_tensor(prefix + n) for n in names if where[prefix + n] == file})
            module.load_state_dict(state, strict=False, assign=True)
        else:
            module.to_empty(device="cpu", recurse=recurse)
            torch.manual_seed(seed)
            for sub in module.modules() if recurse else [module]:
                model._init_weights(sub)
        if dtype is not None:
            for param in module.parameters(recurse=recurse):
                param.data = param.data.to(dtype)

    layer_map = discover(model, (model_cfg.get("layer_map") or {}).get("blocks"))
    full = layer_map.block_paths
    shapes = {
        i: {stored_name(n): list(p.shape) for n, p in b.named_parameters()}
        for i, b in enumerate(layer_map.blocks)
    }
    seed = int(model_cfg.get("init_seed", 0))
    placeholder_dtype = dtype or torch.float32

    def empty(block: torch.nn.Module) -> None:
        for module in block.modules():
            for name, p in list(module._parameters.items()):
                if p is not None:
                    module._parameters[name] = torch.nn.Parameter(
                        torch.empty(0, dtype=placeholder_dtype), requires_grad=False
                    )

    for i in store.missing(shapes):  # one block in memory at a time
        block = layer_map.blocks[i]
        materialise(block, full[i] + ".", seed * 100_003 + i + 1)
        store.write(i, {stored_name(n): p.data for n, p in block.named_parameters()})
        empty(block)
    for block in layer_map.blocks:
        empty(block)
    for name, module in model.named_modules():  # the prefix and suffix: every module outside the blocks
        inside = any(name == b or name.startswith(b + ".") for b in full)
        if not inside and any(p.is_meta for p in module.parameters(recurse=False)):
            materialise(module, f"{name}." if name else "", seed + zlib.crc32(name.encode()), recurse=False)
    model.tie_weights()
    return model, _finish_tokenizer(model_cfg, tokenizer, remote)


def _gguf_cache_folder(path: str, cache_dir) -> Path | None:
    """Where a GGUF file's conversion to safetensors is kept, keyed by its path, size and mtime."""
    import hashlib

    if not cache_dir:
        return None
    stat = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
    return Path(cache_dir) / "gguf" / key[:16]


def _converted_gguf(source: str, cache_dir) -> str | None:
    """The safetensors folder a GGUF file was converted to by an earlier load, if there is one."""
    converted = _gguf_cache_folder(_expand(source), cache_dir)
    return str(converted) if converted is not None and (converted / ".complete").exists() else None


def _auto_class(config):
    from transformers import AutoModel, AutoModelForCausalLM

    archs = getattr(config, "architectures", None) or []
    if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs) or not archs:
        return AutoModelForCausalLM
    return AutoModel


def _expand(path: str) -> str:
    return os.path.expanduser(str(path))


def _hub_folder(repo_id: str) -> str:
    """The local snapshot of a hub model; never downloads."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(repo_id, local_files_only=True)
    except (LocalEntryNotFoundError, OSError, ValueError) as e:
        raise UserError(
            f"model.source '{repo_id}' is not in the local Hugging Face cache and ONN never downloads at run time; "
            f"on a connected machine run `huggingface-cli download {repo_id}` (then copy ~/.cache/huggingface), "
            "or set model.source to a local folder, .safetensors or .gguf file."
        ) from e


def _read_config(folder: str, remote: bool):
    from transformers import AutoConfig

    if not (Path(folder) / "config.json").is_file():
        raise UserError(f"model.source {folder} has no config.json; a Hugging Face model folder needs one.")
    return AutoConfig.from_pretrained(folder, trust_remote_code=remote)


def _refuse_pickle_folder(folder: str) -> None:
    files = [p.name for p in Path(folder).iterdir()]
    if not any(f.endswith(".safetensors") for f in files):
        pickles = [f for f in files if f.endswith(PICKLE_SUFFIXES)]
        if pickles:
            p = str(Path(folder) / pickles[0])
            raise UserError(
                f"model.source {folder} holds only pickle weights ({pickles[0]}). "
                + CONVERT_HINT.format(p=p, stem=p.rsplit(".", 1)[0])
            )
        raise UserError(f"model.source {folder} has no .safetensors weights.")


def _tokenizer_from(folder: str, remote: bool):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=remote)
    except (OSError, ValueError, TypeError):
        return None


def _load_gguf(path: str, dtype, cache_dir=None):
    """De-quantize a GGUF file with transformers; keep the result as a safetensors folder in the cache."""
    import shutil

    from transformers import AutoModelForCausalLM, AutoTokenizer

    converted = _gguf_cache_folder(path, cache_dir)
    if _converted_gguf(path, cache_dir):
        model = AutoModelForCausalLM.from_pretrained(converted, local_files_only=True, dtype=dtype or "auto")
        return model, AutoTokenizer.from_pretrained(converted, local_files_only=True)
    _check_gguf(path)
    folder, name = os.path.dirname(path) or ".", os.path.basename(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, local_files_only=True, dtype=dtype or "auto"
        )
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    except (ValueError, OSError, KeyError, IndexError) as e:
        raise UserError(f"model.source {path} could not be read as GGUF: {e}") from e
    if converted is not None:
        tmp = converted.with_name(converted.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        # transformers refuses save_pretrained on GGUF-flagged models; the weights are plain
        # tensors after de-quantization, so write them and a config without the GGUF flag.
        from safetensors.torch import save_model

        save_model(model, str(tmp / "model.safetensors"))
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tokenizer.save_pretrained(tmp)
        (tmp / ".complete").write_text(path)
        shutil.rmtree(converted, ignore_errors=True)
        tmp.rename(converted)
    return model, tokenizer


def _check_gguf(path: str) -> None:
    """Read the GGUF header and tensor table, and check every tensor's data lies inside the file."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError, MemoryError) as e:
        raise UserError(
            f"model.source {path} is not a readable GGUF file (truncated or corrupt?): {e}"
        ) from e
    size = os.path.getsize(path)
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise UserError(
                f"model.source {path} is truncated: tensor '{t.name}' ends at byte {t.data_offset + t.n_bytes} of a {size}-byte file."
            )


def _load_safetensors_file(model_cfg: dict[str, Any], path: str):
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config = architecture(model_cfg)
    if config is None:
        raise UserError(
            f"model.source {path} is a bare .safetensors file; add model.architecture so ONN knows what to build."
        )
    try:
        state = load_file(path)
    except (SafetensorError, OSError) as e:
        raise UserError(
            f"model.source {path} is not a readable safetensors file (truncated or corrupt?): {e}"
        ) from e
    model = _auto_class(config).from_config(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if "lm_head" in k and getattr(config, "tie_word_embeddings", False)}
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise UserError(
            f"model.source {path} does not match model.architecture: missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
            f"unexpected {unexpected[:3]}{'...' if len(unexpected) > 3 else ''}."
        )
    model.tie_weights()
    return model


def _call_builder(spec: str, kwargs: dict[str, Any]):
    file, _, func = str(spec).rpartition(":")
    path = Path(_expand(file))
    if not path.is_file():
        raise UserError(f"model.source {spec}: {file} does not exist.")
    module_spec = importlib.util.spec_from_file_location(f"onn_user_model_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not hasattr(module, func):
        raise UserError(f"model.source {spec}: {file} defines no function '{func}'.")
    return getattr(module, func)(**kwargs)


def _split_builder_result(result):
    return result if isinstance(result, tuple) else (result, None)


def model_fingerprint(model_cfg: dict[str, Any]) -> str:
    """Identifies the frozen weights: source (with its size and mtime), architecture, init seed, dtype."""
    parts = {k: model_cfg.get(k) for k in ("source", "architecture", "init_seed", "dtype")}
    source = os.path.expanduser(str(model_cfg.get("source") or ""))
    if os.path.exists(source):
        stat = os.stat(source)
        parts["stat"] = [stat.st_size, stat.st_mtime_ns]
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]
