"""Any model source -> an nn.Module and its tokenizer, offline, without pickle.

Sources (model.source):
  random                        build the architecture in the model config with random weights
  org/name                      a Hugging Face hub id, read from the local cache only
  path/to/folder                a Hugging Face folder (config.json + *.safetensors)
  path/to/model.gguf            a GGUF file (transformers de-quantizes it; needs `gguf`)
  path/to/model.safetensors     weights for the architecture in the model config
  path/to/folder/model-00001-of-00003.safetensors (or model.safetensors beside config.json): its folder
  path/to/file.py:function      a Python builder returning an nn.Module (or (module, tokenizer))
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import importlib.util
import json
import logging
import os
import re
import zlib
from collections.abc import Iterator
from pathlib import Path

from hydra.utils import to_absolute_path

from onn.config.model import LanguageModelConfig
from onn.errors import UserError
from onn.models.layers import discover
from onn.models.tokenizer import byte_tokenizer, wordpiece_tokenizer

# random weights (model.source=random) are drawn from this seed, each block from its own (`block_seed`): the
# same model every run, resident or streamed
INIT_SEED = 0
WEIGHT_FILES = ("*.safetensors", "*.gguf", "config.json")  # what a folder source's fingerprint stats
# keys transformers reads with getattr off a config of any class (its model code, generation, tokenizers), whether
# or not the class declares them: model.architecture may give them to any model type
GENERIC_CONFIG_KEYS = {"tie_word_embeddings", "is_decoder", "add_cross_attention", "cross_attention_hidden_size",
                       "tokenizer_class", "prefix"}  # fmt: skip
log = logging.getLogger("onn")
SHARD_NAME = re.compile(r"-\d+-of-(\d+)\.safetensors$")  # transformers' name for one file of a sharded model
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".joblib")
CONVERT_HINT = (
    "ONN loads safetensors only (pickle files can run code when loaded). Convert it once on a machine you trust: "
    "python -c \"import torch, safetensors.torch as st; st.save_file(torch.load('{p}', weights_only=True), "
    "'{stem}.safetensors')\""
)


def source_kind(source: str | None) -> str:
    """Classify model.source: random | python | gguf | safetensors | folder | hub."""
    if source in (None, "", "random"):
        return "random"
    src = str(source)
    if ".py:" in src:
        return "python"
    path = Path(local_path(src))
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise UserError(
            f"model.source {src} is a pickle checkpoint. " + CONVERT_HINT.format(p=src, stem=path.with_suffix(""))
        )
    if path.suffix.lower() in (".gguf", ".safetensors"):
        if not path.is_file():
            raise UserError(
                f"model.source {src} does not exist; check the path (SmolLM2's GGUF: docs/models.md says where "
                "to get it)."
            )
        return "folder" if weights_folder(path) else path.suffix.lower().lstrip(".")
    if path.is_dir():
        return "folder"
    if src.startswith((".", "/", "~")) or src.count("/") != 1:
        raise UserError(
            f"model.source {src} does not exist; give a Hugging Face folder, a .gguf/.safetensors file, "
            "file.py:function, a hub id, or `random`."
        )
    return "hub"


def is_pretrained(model_cfg: LanguageModelConfig) -> bool:
    """Weights that carry knowledge (anything but random init): the planner prefers LoRA for them."""
    return model_cfg.source not in (None, "", "random")


def architecture(model_cfg: LanguageModelConfig):
    """The transformers config of the model, from the model YAML (no weights needed)."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    register_zoo_models()
    arch = dict(model_cfg.architecture or {})  # a copy: model_type is taken out of it
    if not arch:
        kind = source_kind(model_cfg.source)
        if kind == "folder":
            return read_config(expand(model_cfg.source), model_cfg.trust_remote_code)
        if kind == "hub":
            return read_config(hub_folder(model_cfg.source), model_cfg.trust_remote_code)
        return None
    model_type = arch.pop("model_type", None)
    if model_type is None:
        raise UserError(f"model.architecture of '{model_cfg.name}' needs a model_type (e.g. llama, phi3, gpt2).")
    if model_type not in CONFIG_MAPPING:  # transformers' own error listed all 400 model types on one line
        close = difflib.get_close_matches(str(model_type), list(CONFIG_MAPPING.keys()), n=1)
        raise UserError(
            f"model.architecture.model_type={model_type} of '{model_cfg.name}' is not a model type transformers "
            f"knows{f' (did you mean {close[0]}?)' if close else ''}; give one of its model types (llama, phi3, gpt2, "
            "...), or upgrade transformers for a newer model."
        )
    config = AutoConfig.for_model(model_type, **arch)
    check_architecture_keys(config, arch)
    check_token_ids(config, arch)
    return config


def context_length(model) -> int | None:
    """The positions a language model learned (max_position_embeddings; GPT-2's n_positions is read by that name),
    from its text config: a multimodal model (Gemma 3, Llava) holds them in config.text_config, and its top-level
    config has none, so prompts past them went unchecked."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    room = getattr(text, "max_position_embeddings", None)
    return room if isinstance(room, int) and not isinstance(room, bool) else None


def check_token_ids(config, arch: dict) -> None:
    """The special token ids model.architecture gives are rows of its vocabulary: a pad id past it failed on an
    assertion inside nn.Embedding, and an eos or bos id past it at the first batch (on a GPU, a device-side assert)."""
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int):
        return
    for key, value in arch.items():
        ids = [value] if isinstance(value, int) else value if isinstance(value, list | tuple) else []
        if key.endswith("_token_id") and any(isinstance(i, int) and i >= vocab for i in ids):
            raise UserError(
                f"model.architecture.{key}={value} is past the vocabulary (vocab_size={vocab}: ids 0 to {vocab - 1}); "
                f"give ids below {vocab}, or a larger model.architecture.vocab_size."
            )


def check_architecture_keys(config, arch: dict) -> None:
    """A model.architecture key that the transformers config class neither has nor reads is kept as a bare
    attribute that nothing reads: `+model.architecture.num_hiden_layers=3` built all 40 layers without a word, and a
    recipe's keys for another model (cell: lstm) rode along into a Llama. A key the class takes and turns into
    another (rope_theta into rope_parameters, torch_dtype into dtype) is not kept as itself, and passes; so does a
    special token id (`*_token_id`) or another key transformers reads off any config (GENERIC_CONFIG_KEYS)."""
    try:
        default = type(config)()
    except (TypeError, ValueError):
        return  # a class that cannot be built bare: its keys are not known here, so none is refused
    known = set(default.to_dict()) | set(type(config).attribute_map) | GENERIC_CONFIG_KEYS
    bare = [k for k in arch if k in vars(config) and k not in known and not k.endswith("_token_id")]
    if bare:
        close = difflib.get_close_matches(bare[0], sorted(known), n=1)
        hint = f" (did you mean model.architecture.{close[0]}?)" if close else ""
        raise UserError(
            f"model.architecture.{bare[0]} is not a key of {config.model_type}'s config ({type(config).__name__})"
            f"{hint}; fix its name, or drop it (a recipe's architecture keys are for the model it names)."
        )


def meta_model(model_cfg: LanguageModelConfig):
    """The model built on PyTorch's meta device: exact shapes and parameter counts, no memory, no weights."""
    import torch

    with torch.device("meta"):
        if source_kind(model_cfg.source) == "python":
            return _split_builder_result(_call_builder(model_cfg.source))[0]
        config = architecture(model_cfg)
        if config is None:
            raise UserError(
                f"model '{model_cfg.name}' has no architecture in its config; "
                "add model.architecture to plan it without weights."
            )
        return auto_class(config).from_config(config, trust_remote_code=model_cfg.trust_remote_code)


def load(model_cfg: LanguageModelConfig, dtype=None, cache_dir: str | os.PathLike | None = None):
    """Build or load the model and its tokenizer, in eval mode whatever the source (from_pretrained's mode: a random,
    safetensors-file or Python-built model came back in train mode, dropout on); training sets train mode itself.
    `dtype` is the weights dtype the plan chose; `cache_dir` keeps converted GGUF models so the slow conversion
    happens once per file."""
    source = model_cfg.source
    kind, remote = source_kind(source), model_cfg.trust_remote_code
    tokenizer = None
    if kind == "random":
        model = _random_model(model_cfg, dtype)
    elif kind == "python":
        model, tokenizer = _split_builder_result(_call_builder(source))
    elif kind == "gguf":
        model, tokenizer = _load_gguf(expand(source), dtype, cache_dir)
    elif kind == "safetensors":
        model = _load_safetensors_file(model_cfg, expand(source))
    else:
        folder = expand(source) if kind == "folder" else hub_folder(source)
        model = _load_folder(folder, dtype, remote)
        tokenizer = None if model_cfg.tokenizer else tokenizer_from(folder, remote)  # (model.tokenizer replaces it)
    if dtype is not None:
        model = model.to(dtype)
    tokenizer = finish_tokenizer(model_cfg, tokenizer, remote)
    check_vocabulary(model_cfg, model, tokenizer)
    return model.eval(), tokenizer


def _load_folder(folder: str, dtype, remote: bool):
    """A Hugging Face folder's model, read whole and checked (`from_pretrained_whole`)."""
    config = checked_folder(folder, remote)
    return from_pretrained_whole(auto_class(config), folder, remote, dtype=dtype or "auto")


def checked_folder(folder: str, remote: bool):
    """The config of a Hugging Face folder whose weights transformers will read as safetensors, all there and
    whole: the checks before any from_pretrained of a folder."""
    refuse_pickle_folder(folder)
    check_shards(folder)
    config = read_config(folder, remote)
    refuse_named_pickles(folder, config)
    return config


def refuse_named_pickles(folder: str, config) -> None:
    """Pickle files transformers reads even with use_safetensors=True, beside the folder's safetensors: the weights
    file config.json names (`transformers_weights`, which may be adapter_model.bin) and the adapter of a folder
    with adapter_config.json (peft's adapter_model.bin, when there is no adapter_model.safetensors)."""
    named = getattr(config, "transformers_weights", None)  # (transformers reads it so, off any config)
    if named is not None and not str(named).endswith((".safetensors", ".safetensors.index.json")):
        raise UserError(
            f"model.source {Path(folder) / 'config.json'} names its weights file {named} (transformers_weights), "
            "not safetensors. " + CONVERT_HINT.format(p=Path(folder) / named, stem=Path(folder) / Path(named).stem)
        )
    adapter, folder_path = Path(folder) / "adapter_model.bin", Path(folder)
    peft_reads = (folder_path / "adapter_config.json").is_file() and not (
        folder_path / "adapter_model.safetensors"
    ).is_file()
    if peft_reads and adapter.is_file():
        raise UserError(
            f"model.source {folder} holds a pickle adapter (adapter_model.bin) that transformers applies on load. "
            + CONVERT_HINT.format(p=adapter, stem=adapter.with_suffix(""))
        )


def from_pretrained_whole(auto: type, folder: str, remote: bool, **options):
    """`auto.from_pretrained(folder)`, offline and from safetensors only. Weights its config describes but its files
    lack are refused (transformers would print a table and train them from a random init), as are wrong shapes: the
    one rule for a resident model and a QLoRA base (load_4bit), which loaded a partial folder half random."""
    import transformers

    try:
        model, info = auto.from_pretrained(
            folder,
            local_files_only=True,
            use_safetensors=True,
            trust_remote_code=remote,
            output_loading_info=True,
            **options,
        )
    except RuntimeError as e:  # transformers prints a table of mismatched tensors, then raises
        if "mismatched_sizes" not in str(e) and "size mismatch" not in str(e):
            raise
        raise UserError(
            f"model.source {folder}: its weights do not have the shapes its config.json describes "
            "(see the table above); the folder mixes two models' files."
        ) from None
    missing = sorted(info["missing_keys"])
    if missing and auto is transformers.AutoModelForCausalLM:  # (a composite model's heads may start fresh)
        raise UserError(
            f"model.source {folder}: its weights lack {len(missing)} tensors its config.json describes "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); the folder mixes two models' files "
            "or misses some of them."
        )
    return model


def check_shards(folder: str) -> None:
    """Every shard a folder's model.safetensors.index.json names is in the folder (a missing one was a bare
    FileNotFoundError from inside transformers), and each weights file is whole (`check_whole`)."""
    index = Path(folder) / "model.safetensors.index.json"
    if not index.is_file():
        check_unindexed_shards(folder)
        check_whole([Path(folder) / "model.safetensors"])
        return
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise UserError(f"model.source {index} is not a readable shard index (no weight_map): {e}.") from None
    absent = [s for s in shards if not (Path(folder) / s).is_file()]
    if absent:
        raise UserError(
            f"model.source {folder}: {index.name} names {len(shards)} shards and {len(absent)} are not in the "
            f"folder ({', '.join(absent[:2])}{', ...' if len(absent) > 2 else ''}); copy every shard of the model."
        )
    check_whole([Path(folder) / shard for shard in shards])


def check_whole(files: list[Path]) -> None:
    """Each safetensors file that is there opens: its header reads and its tensors lie inside it. A truncated or
    corrupt shard (an interrupted copy) was a bare SafetensorError from inside transformers."""
    from safetensors import SafetensorError, safe_open

    for file in files:
        if not file.is_file():
            continue
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except (SafetensorError, OSError) as e:
            raise UserError(
                f"model.source {file} is not a readable safetensors file (truncated or corrupt? {e}); copy it again."
            ) from None


def check_unindexed_shards(folder: str) -> None:
    """Shards (model-00001-of-00003.safetensors) without the index that names them: transformers looked for
    model.safetensors and raised a bare OSError; say which files are there, which are not, and what to copy."""
    if (Path(folder) / "model.safetensors").is_file():
        return
    found = sorted(f.name for f in Path(folder).glob("*.safetensors"))
    shards = [name for name in found if SHARD_NAME.search(name)]
    if found and not shards:  # (Mistral's consolidated.safetensors, an adapter's: transformers raised a bare OSError)
        raise UserError(
            f"model.source {folder} has no model.safetensors (nor a shard index), only {', '.join(found[:2])}; "
            "give the folder of a transformers model (save_pretrained writes model.safetensors), or one file as "
            "model.source with model.architecture."
        )
    total = int(SHARD_NAME.search(shards[0]).group(1))
    absent = f" and {total - len(shards)} of the {total} shards" if len(shards) < total else ""
    raise UserError(
        f"model.source {folder} holds {len(shards)} shard(s) of a sharded model ({shards[0]}, ...) but lacks "
        f"model.safetensors.index.json{absent}; copy the model's whole folder."
    )


def check_vocabulary(model_cfg: LanguageModelConfig, model, tokenizer) -> None:
    """The tokenizer's ids all have an embedding row: past it, an id failed inside the embedding (an IndexError on
    a CPU, a device-side assert that ends the process on a GPU). Where ONN put the two together (a random init, a
    bare .safetensors file, or model.tokenizer given) that is refused; a source's own pair (a folder whose tokenizer
    got added tokens, saved without resizing the model) has its embeddings resized (`resize_own_embeddings`)."""
    if tokenizer is None:
        return
    try:
        rows = model.get_input_embeddings().num_embeddings
    except (AttributeError, NotImplementedError):  # no token embedding to check (a user's own module)
        return
    ids = max(tokenizer.get_vocab().values()) + 1  # (not len(tokenizer): a vocabulary's ids may leave gaps)
    if not isinstance(rows, int) or ids <= rows:
        return
    if not (model_cfg.tokenizer or source_kind(model_cfg.source) in ("random", "safetensors")):
        resize_own_embeddings(model_cfg, model, rows, ids)
        return
    raise UserError(
        f"model '{model_cfg.name}': its tokenizer ({model_cfg.tokenizer or model_cfg.source}) gives ids up to "
        f"{ids - 1} and the model embeds {rows}; set model.architecture.vocab_size to {ids} or more."
    )


def resize_own_embeddings(model_cfg: LanguageModelConfig, model, rows: int, ids: int) -> None:
    """A source whose own tokenizer gives ids past its embeddings (tokens added to the tokenizer, the model saved
    without transformers' resize_token_embeddings): resized as transformers' recipe for added tokens does, the new
    rows drawn from INIT_SEED, so every load of the source gives the same model."""
    import torch

    if not hasattr(model, "resize_token_embeddings"):
        raise UserError(
            f"model '{model_cfg.name}': its tokenizer ({model_cfg.source}) gives ids up to {ids - 1} and the model "
            f"embeds {rows}; resize its token embeddings to {ids} rows, or set model.tokenizer to one that fits."
        )
    log.warning(
        "model %s: its tokenizer gives ids up to %d and the model embeds %d (added tokens the model was not resized "
        "for): the embeddings are resized to %d rows, the new ones untrained",
        model_cfg.source,
        ids - 1,
        rows,
        ids,
    )
    with torch.random.fork_rng(devices=[]):  # the CPU's generator (where load builds the model) only, given back
        torch.random.default_generator.manual_seed(INIT_SEED)
        model.resize_token_embeddings(ids)


def load_4bit(model_cfg: LanguageModelConfig, compute_dtype, cache_dir: str | os.PathLike, device: str = "cpu"):
    """The model with its linear layers in 4-bit NF4 (QLoRA's base), through transformers' own
    BitsAndBytesConfig. A Hugging Face folder loads quantized directly; any other source is built,
    written once as a safetensors folder under cache_dir/nf4 and loaded from there, quantized."""
    import torch
    from transformers import BitsAndBytesConfig

    kind, remote = source_kind(model_cfg.source), model_cfg.trust_remote_code
    tokenizer = None
    if kind in ("folder", "hub"):
        folder = expand(model_cfg.source) if kind == "folder" else hub_folder(model_cfg.source)
        checked_folder(folder, remote)
        tokenizer = tokenizer_from(folder, remote)
    else:  # the source's own tokenizer (a GGUF's, a builder's) is kept beside the weights: a later run reads both
        folder = Path(cache_dir) / "nf4" / model_fingerprint(model_cfg)
        if not (folder / ".complete").is_file():
            model, tokenizer = load(model_cfg, dtype=torch.float32, cache_dir=cache_dir)
            model.save_pretrained(folder, safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(folder)
            (folder / ".complete").write_text("")
            del model
        else:
            tokenizer = tokenizer_from(str(folder), remote)
        folder = str(folder)
    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute_dtype
    )
    model = from_pretrained_whole(
        auto_class(read_config(folder, remote)),
        folder,
        remote,
        quantization_config=quantization,
        device_map={"": device},
    )
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            # On CPUs with AVX512-BF16, bitsandbytes repacks 4-bit weights for inference on the first
            # no-grad forward in eval mode (a validation), for good: its packed kernel has no autograd,
            # so every later LoRA gradient through the layer would be zero. Keep the trainable path.
            module.support_avx512bf16_for_cpu = False
    tokenizer = finish_tokenizer(model_cfg, tokenizer, remote)
    check_vocabulary(model_cfg, model, tokenizer)  # as load() checks (a folder's tokenizer may outgrow its model)
    return model, tokenizer


def block_seed(seed: int, index: int) -> int:
    """The seed block `index`'s random weights are drawn from."""
    return seed * 100_003 + index + 1


def edge_seed(seed: int, name: str) -> int:
    """The seed a module outside the blocks is drawn from: its dotted name's."""
    return seed + zlib.crc32(name.encode())


def _random_model(model_cfg: LanguageModelConfig, dtype):
    """model.source=random: built empty, then each block drawn from its own seed and every module outside the
    blocks from its name's, as the layer store's loader draws them, so that a config gives the same weights
    resident and streamed (`-m strategy=full,lora,sparse_lora` compares one starting model). A model that is never
    layer-streamed (no causal LM: SAM2, Grounding DINO, TrOCR, whose composite initialisers only the whole model
    runs; or one without repeated blocks) is drawn whole from INIT_SEED."""
    import torch
    import transformers
    from accelerate import init_empty_weights

    config, remote = architecture(model_cfg), model_cfg.trust_remote_code
    auto = auto_class(config)
    layer_map = None
    if auto is transformers.AutoModelForCausalLM:
        with init_empty_weights(include_buffers=False):
            model = auto.from_config(config, trust_remote_code=remote)
        with contextlib.suppress(UserError):  # no repeated blocks: never streamed
            layer_map = discover(model, model_cfg.layer_map.blocks)
    if layer_map is None:
        with seeded_draw(INIT_SEED, torch.device("cpu")):  # built on the CPU
            return auto.from_config(config, trust_remote_code=remote)
    device = random_draw_device(None)
    for i, block in enumerate(layer_map.blocks):
        draw_random(model, block, block_seed(INIT_SEED, i), device, dtype=dtype)
    for name, module in outside_blocks(model, layer_map):
        draw_random(model, module, edge_seed(INIT_SEED, name), device, recurse=False, dtype=dtype, in_dtype=True)
    model.tie_weights()
    return model


def random_draw_device(store_kind: str | None, device: str = "cpu") -> str:
    """The one rule for where model.source=random draws its weights: on the compute device for a layer store in
    host memory (a GPU draws Phi-4's 14.7B in 22 s, the CPU's one generator thread in 140 s and more), else on the
    CPU (resident models, disk stores). The two generators give other numbers for one seed: see random_base."""
    return device if store_kind == "cpu" else "cpu"


def random_base(model_cfg: LanguageModelConfig, store_kind: str | None, device: str = "cpu") -> str | None:
    """Where a model.source=random base is drawn, as its checkpoints record it: "cpu" or the CUDA device's name
    (CUDA's numbers for a seed differ from the CPU's and depend on the GPU). None: a source with weights, the
    same base everywhere."""
    import torch

    if source_kind(model_cfg.source) != "random":
        return None
    drawn = torch.device(random_draw_device(store_kind, device))
    return torch.cuda.get_device_name(drawn) if drawn.type == "cuda" else drawn.type


def draw_random(model, module, seed: int, device="cpu", recurse: bool = True, dtype=None, in_dtype=False) -> None:
    """Fill `module`'s empty weights from `seed` with the model's own initialiser, on `device`, then cast them to
    `dtype`; in float32 and cast (fast), or with `in_dtype` straight in `dtype` (no float32 copy of a large
    embedding). The one rule for random weights wherever they then live (in memory, in a layer store)."""
    import torch

    # buffers built for real (init_empty_weights leaves them: position tables, rotary frequencies, index maps) keep
    # their values; to_empty would leave them uninitialised, and _init_weights knows only some of them
    kept = {name: b for name, b in module.named_buffers(recurse=recurse) if not b.is_meta}
    module.to_empty(device=device, recurse=recurse)
    for name, buffer in kept.items():
        owner, _, leaf = name.rpartition(".")
        (module.get_submodule(owner) if owner else module)._buffers[leaf] = buffer.to(device)
    if in_dtype and dtype is not None:
        for param in module.parameters(recurse=recurse):
            param.data = torch.empty_like(param.data, dtype=dtype)
    with seeded_draw(seed, torch.device(device)):
        if recurse:
            _init_children_first(model._init_weights, module)
        else:
            model._init_weights(module)
    for param in module.parameters(recurse=recurse):
        param.data = param.data.to(dtype or param.dtype)


@contextlib.contextmanager
def seeded_draw(seed: int, device) -> Iterator[None]:
    """Draws seeded with `seed` on `device`'s generator (and the CPU's), whose states are given back afterwards: a
    random model's build leaves the run's own seeded streams (dropout, sampling) as seed= set them."""
    import torch

    cuda = device.type == "cuda"
    index = device.index if device.index is not None else torch.cuda.current_device() if cuda else None
    with torch.random.fork_rng(devices=[index] if cuda else []):
        torch.random.default_generator.manual_seed(seed)
        if cuda:
            with torch.cuda.device(index):
                torch.cuda.manual_seed(seed)
        yield


def _init_children_first(init, module) -> None:
    """`init` each module under `module`, and then `module`, in the order of transformers' own initialisation
    (PreTrainedModel.initialize_weights' smart_apply): a parent's special init of its children then stands (GPT-2's
    scaled c_proj, Mamba's dt_proj bias), where parents first let their generic init overwrite it. A model inside
    (a vision tower) initialises its modules with its own _init_weights, as there."""
    from transformers import PreTrainedModel

    for child in module.children():
        _init_children_first(child._init_weights if isinstance(child, PreTrainedModel) else init, child)
    init(module)


def outside_blocks(model, layer_map) -> Iterator[tuple[str, object]]:
    """(name, module) of each module outside the blocks that holds empty (meta) weights of its own when reached,
    each after the modules under it (as _init_children_first draws them: a parent's init of its children stands)."""
    blocks, inside = set(layer_map.block_paths), tuple(f"{b}." for b in layer_map.block_paths)
    for name, module in reversed(list(model.named_modules())):
        if name in blocks or name.startswith(inside):
            continue
        if any(p.is_meta for p in module.parameters(recurse=False)):
            yield name, module


def finish_tokenizer(model_cfg: LanguageModelConfig, tokenizer, remote: bool):
    """The tokenizer the model config asks for (or the source's), with a pad token."""
    tok_cfg = model_cfg.tokenizer
    if tok_cfg == "none":
        return None  # the model reads no text (SAM2)
    if tok_cfg == "byte":
        tokenizer = byte_tokenizer()
    elif tok_cfg == "wordpiece":
        tokenizer = wordpiece_tokenizer()
    elif tok_cfg:
        local = expand(tok_cfg)  # a folder where it exists, else a hub id as given (not a path under the cwd)
        tokenizer = tokenizer_from(local if Path(local).exists() else str(tok_cfg), remote)
        if tokenizer is None:  # (it said the model had no tokenizer, and to set the key the user had set)
            where = "the folder holds none" if Path(local).is_dir() else "no such folder, nor hub id in the cache"
            raise UserError(
                f"model.tokenizer={tok_cfg} loads no tokenizer ({where}); give a folder with tokenizer.json or "
                "tokenizer_config.json (a hub id must be in the local cache), `byte` or `wordpiece`."
            )
    if tokenizer is None:
        raise UserError(
            f"model '{model_cfg.name}' has no tokenizer; "
            "set model.tokenizer to a folder with one, `byte` or `wordpiece`."
        )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.pad_token is None:  # the batches' padding (a Collator's torch.full of None) had no id to pad with
        raise UserError(
            f"the tokenizer of model '{model_cfg.name}' ({tok_cfg or model_cfg.source}) has neither a pad token nor an "
            "end-of-sequence token: give it an eos_token (its tokenizer_config.json), or set model.tokenizer to "
            "another (`byte`, `wordpiece` or a folder)."
        )
    return tokenizer


def _gguf_cache_folder(path: str, cache_dir) -> Path | None:
    """Where a GGUF file's conversion to safetensors is kept, keyed by its path, size and mtime (and `float32`:
    conversions kept before were in the first run's dtype, and are not read)."""
    import hashlib

    if not cache_dir:
        return None
    stat = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}|{stat.st_size}|{stat.st_mtime_ns}|float32".encode()).hexdigest()
    return Path(cache_dir) / "gguf" / key[:16]


def converted_gguf(source: str, cache_dir) -> str | None:
    """The safetensors folder a GGUF file was converted to by an earlier load, if there is one."""
    converted = _gguf_cache_folder(expand(source), cache_dir)
    return str(converted) if converted is not None and (converted / ".complete").exists() else None


def auto_class(config):
    """The auto class that builds `config`: a causal LM's, else the one that maps it to the class its `architectures`
    names (Sam2Model, GroundingDinoForObjectDetection, VisionEncoderDecoderModel), else AutoModel."""
    import transformers

    archs = getattr(config, "architectures", None) or []
    if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs) or not archs:
        return transformers.AutoModelForCausalLM
    for name in AUTO_CLASSES:
        auto = getattr(transformers, name, None)
        mapped = auto._model_mapping.get(type(config), None) if auto is not None else None
        if mapped is not None and mapped.__name__ == archs[0]:
            return auto
    return transformers.AutoModel


AUTO_CLASSES = (
    "AutoModel",
    "AutoModelForZeroShotObjectDetection",
    "AutoModelForImageTextToText",
    "AutoModelForVision2Seq",
    "AutoModelForSeq2SeqLM",  # BART, T5: without it their folder loaded as the bare BartModel, its LM head dropped
)


def register_zoo_models() -> None:
    """ONN's own transformers models (the recurrent LM, model_type onn_recurrent_lm), known to the Auto classes
    before a config names one."""
    from onn.models.zoo.recurrent_lm import register_auto

    register_auto()


def expand(path: str) -> str:
    """`path` as `local_path` reads it; a Hugging Face folder's own weights file (`weights_folder`) is its folder."""
    full = local_path(path)
    folder = weights_folder(Path(full))
    return str(folder) if folder else full


def local_path(path: str) -> str:
    """`path` with ~ expanded, and a relative path taken from where `python run.py` was started: under
    hydra.job.chdir=true the run works in its run folder, where `model.source=models/x.gguf` did not exist."""
    return to_absolute_path(os.path.expanduser(str(path)))


def weights_folder(path: Path) -> Path | None:
    """The Hugging Face folder `path` is the weights of, when model.source names a file of one: a shard
    (model-00001-of-00003.safetensors), which is never a whole model, or the model.safetensors that has its
    config.json beside it. A Hugging Face user means the model the folder holds; read alone, a shard was refused
    as missing most of its tensors, and model.safetensors asked for a model.architecture its folder already gives."""
    if path.suffix != ".safetensors" or not path.is_file():
        return None
    if SHARD_NAME.search(path.name) or (path.name == "model.safetensors" and (path.parent / "config.json").is_file()):
        return path.parent
    return None


def hub_folder(repo_id: str) -> str:
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


def read_config(folder: str, remote: bool):
    """The folder's config.json as its transformers config; one that transformers cannot read (not JSON, no
    model_type, a model type it does not know) is one sentence, where it was a bare ValueError or OSError."""
    from transformers import AutoConfig

    register_zoo_models()
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise UserError(f"model.source {folder} has no config.json; a Hugging Face model folder needs one.")
    try:
        return AutoConfig.from_pretrained(folder, trust_remote_code=remote)
    except (ValueError, OSError, KeyError) as e:
        raise UserError(config_problem(path, e)) from None


def config_problem(path: Path, error: Exception) -> str:
    """Why transformers could not read the config.json at `path`, and what to do, in one sentence."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        model_type = json.loads(path.read_text()).get("model_type")  # (a user's file, not ONN's config)
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        return f"model.source {path} is not a JSON object ({e}); copy the model's config.json again."
    if model_type is None:
        return f"model.source {path} has no model_type; a transformers config.json names one (llama, phi3, ...)."
    if model_type not in CONFIG_MAPPING:
        return (
            f"model.source {path} names model_type '{model_type}', which transformers {transformers.__version__} "
            "does not know; upgrade transformers, or set model.trust_remote_code=true if the folder ships its own "
            "modeling code you trust."
        )
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return (
        f"model.source {path} cannot be read by transformers {transformers.__version__} ({first_line}); copy the "
        "model's config.json again, or upgrade transformers if the model is newer."
    )


def refuse_pickle_folder(folder: str) -> None:
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


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")


def tokenizer_from(folder: str, remote: bool):
    """The folder's tokenizer, or None where it holds none. A tokenizer file that is there but not JSON (an
    interrupted copy) is one sentence naming it: it was reported as no tokenizer at all, which sent the user to
    model.tokenizer for a folder that has one."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=remote)
    except (OSError, ValueError, TypeError) as e:
        for file in (Path(folder) / name for name in TOKENIZER_FILES):
            if not file.is_file():
                continue
            try:
                json.loads(file.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as bad:
                raise UserError(
                    f"the tokenizer file {file} is not readable JSON (truncated or corrupt? {bad}); copy it again."
                ) from e
        return None


def _load_gguf(path: str, dtype, cache_dir=None):
    """De-quantize a GGUF file with transformers; keep the result as a safetensors folder in the cache, in float32
    (what de-quantizing gives) whatever this run's dtype: a later run in float32 must not read a bf16 run's rounding."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    converted = _gguf_cache_folder(path, cache_dir)
    if converted_gguf(path, cache_dir):
        model = AutoModelForCausalLM.from_pretrained(converted, local_files_only=True, dtype=dtype or "auto")
        return model, AutoTokenizer.from_pretrained(converted, local_files_only=True)
    folder, name = os.path.dirname(path) or ".", os.path.basename(path)
    try:
        with gguf_parsed_once():
            check_gguf(path)
            model = AutoModelForCausalLM.from_pretrained(
                folder,
                gguf_file=name,
                local_files_only=True,
                dtype="float32" if converted is not None else dtype or "auto",
            )
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    except (ValueError, OSError, KeyError, IndexError) as e:
        raise UserError(f"model.source {path} could not be read as GGUF: {e}") from e
    if converted is not None:
        _save_converted(model, tokenizer, path, converted)
        if dtype is not None:
            model = model.to(dtype)
    return model, tokenizer


def _save_converted(model, tokenizer, path: str, converted: Path) -> None:
    """The de-quantized model as a safetensors folder, written whole under a temporary name, then renamed."""
    import shutil

    from safetensors.torch import save_model

    tmp = converted.with_name(converted.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # transformers refuses save_pretrained on GGUF-flagged models; the weights are plain
    # tensors after de-quantization, so write them and a config without the GGUF flag.
    save_model(model, str(tmp / "model.safetensors"))
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(tmp)
    (tmp / ".complete").write_text(path)
    shutil.rmtree(converted, ignore_errors=True)
    tmp.rename(converted)


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Within this block, each GGUF file's header is parsed once. transformers parses it anew for the
    config, the tokenizer and the weights (4-6 times a load), and a parse walks every vocabulary string in
    Python: 5 s for SmolLM2's 49k tokens on one core. The readers are read-only memory maps, so sharing is safe."""
    import gguf

    parse, parsed = gguf.GGUFReader, {}

    def reader(path, mode: str = "r"):
        key = (os.path.realpath(path), mode)
        if key not in parsed:
            parsed[key] = parse(path, mode)
        return parsed[key]

    gguf.GGUFReader = reader  # transformers imports it from the package at each call
    try:
        yield
    finally:
        gguf.GGUFReader = parse


def check_gguf(path: str) -> None:
    """Read the GGUF header and tensor table, and check every tensor's data lies inside the file."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError, MemoryError) as e:
        raise UserError(f"model.source {path} is not a readable GGUF file (truncated or corrupt?): {e}") from e
    size = os.path.getsize(path)
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise UserError(
                f"model.source {path} is truncated: tensor '{t.name}' ends at byte {t.data_offset + t.n_bytes} of a "
                f"{size}-byte file."
            )


def _load_safetensors_file(model_cfg: LanguageModelConfig, path: str):
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
        raise UserError(f"model.source {path} is not a readable safetensors file (truncated or corrupt?): {e}") from e
    model = auto_class(config).from_config(config)
    own = model.state_dict()
    wrong = [
        f"{k} {list(v.shape)} (the architecture's: {list(own[k].shape)})"
        for k, v in state.items()
        if k in own and v.shape != own[k].shape
    ]
    if wrong:  # load_state_dict raises on a wrong shape even when not strict
        raise UserError(
            f"model.source {path} does not match model.architecture: wrong shapes {', '.join(wrong[:2])}"
            f"{' ...' if len(wrong) > 2 else ''}; give the architecture these weights were trained with."
        )
    missing_keys, unexpected = model.load_state_dict(state, strict=False)
    # A tied pair is one tensor saved under either name (safetensors' save_model keeps lm_head.weight, a Hugging Face
    # save the embedding's): transformers ties them either way round and takes the one saved off `missing`.
    missing = set(missing_keys)
    model.tie_weights(missing_keys=missing)
    missing = sorted(missing)
    if missing or unexpected:
        raise UserError(
            f"model.source {path} does not match model.architecture: "
            f"missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
            f"unexpected {unexpected[:3]}{'...' if len(unexpected) > 3 else ''}{untied_hint(model, missing)}."
        )
    return model


def untied_hint(model, missing: list[str]) -> str:
    """Where the one weight missing is the token embedding or the output head: a file of a model whose two share
    one matrix holds it once (under either name), and an architecture that does not tie them (Llama's default)
    asked for the other. Say which key ties them."""
    try:
        ends = [model.get_input_embeddings(), model.get_output_embeddings()]
    except (AttributeError, NotImplementedError):  # (a model without token embeddings)
        return ""
    names = {f"{name}.weight" for name, module in model.named_modules() if any(module is end for end in ends)}
    if len(missing) != 1 or missing[0] not in names or len(names) != 2:
        return ""
    return (
        "; the file holds one matrix for the token embedding and the output head: set "
        "model.architecture.tie_word_embeddings=true"
    )


def _call_builder(spec: str):
    return user_function(spec, "model.source")()


def user_function(spec: str, key: str):
    """The function `file.py:name` names (a model builder, a loss), loaded from the file; `key` is the config
    key that named it, for the message when the file or the function is not there."""
    file, _, func = str(spec).rpartition(":")
    path = Path(expand(file))
    if not file.endswith(".py") or not path.is_file():
        raise UserError(f"{key} {spec}: {file or '(no file)'} is not a Python file; give path/to/file.py:function.")
    module_spec = importlib.util.spec_from_file_location(f"onn_user_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not callable(getattr(module, func, None)):
        raise UserError(f"{key} {spec}: {file} defines no function '{func}'.")
    return getattr(module, func)


def _split_builder_result(result):
    return result if isinstance(result, tuple) else (result, None)


def model_fingerprint(model_cfg: LanguageModelConfig) -> str:
    """Identifies the frozen weights: source (with its files' sizes and mtimes), architecture, dtype, and
    model.layer_map.blocks where set (a layer store holds block i of one block list: another list's store is no
    use). (`init_seed` stays in the key, as null, and an unset layer_map out of it, so that the stores and tune
    results cached before keep their folders.)"""
    parts = {
        "source": model_cfg.source,
        "architecture": model_cfg.architecture,
        "init_seed": None,
        "dtype": model_cfg.dtype,
    }
    if model_cfg.layer_map.blocks is not None:
        parts["layer_map"] = model_cfg.layer_map.blocks
    parts.update(_source_stat(model_cfg.source) if is_pretrained(model_cfg) else {})
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _source_stat(source: str) -> dict[str, list]:
    """The size and mtime of the source file (a builder's .py), or of each weights and config file in a source
    folder (a file replaced in place leaves the folder's own stat as it was): cheap, no hashing of gigabytes."""
    path = Path(expand(str(source).rpartition(":")[0] if ".py:" in str(source) else source))
    if path.is_dir():
        files = sorted({f for pattern in WEIGHT_FILES for f in path.glob(pattern) if f.is_file()})
        return {"files": [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]}
    return {"stat": [path.stat().st_size, path.stat().st_mtime_ns]} if path.is_file() else {}
