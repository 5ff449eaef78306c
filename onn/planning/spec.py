"""What the planner knows about a model: sizes read off its build on PyTorch's meta device.

A language model is sized by its LayerMap (blocks, prefix, suffix), its linear layers (what LoRA
adapts) and its attention shapes; a classifier network by what one sample costs: forward FLOPs and
the bytes autograd keeps, counted during a forward pass on the meta device.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

from onn.config.model import LanguageModelConfig
from onn.errors import UserError
from onn.hardware.disk import read_json, write_text_atomically
from onn.hardware.profile import OpBytes
from onn.models.adapters import lora_refused
from onn.models.layers import discover, gated_mlps
from onn.models.load import expand, hub_folder, is_pretrained, meta_model, source_kind, tokenizer_from

log = logging.getLogger("onn")
T = TypeVar("T")


@dataclass
class ModelSpec:
    """What the planner needs to know about a model, read off its meta-device build."""

    name: str
    params: int
    block_params: list[int]
    prefix_params: int
    suffix_params: int
    lora_params_per_block: list[int]  # at the configured rank, all-linear targets
    linear_params_per_block: list[int]
    hidden: int
    intermediate: int
    kv_dim: int
    vocab: int
    layer_map: str
    pretrained: bool
    kind: str = "lm"  # lm | network (a classifier sized per sample)
    sample_activation_bytes: int = 0  # networks: what autograd keeps per sample (fp32), counted on meta
    sample_flops: int = 0  # networks: forward FLOPs per sample
    # networks: what a training step's memory-bound ops (norms, activations, pooling, their backward) read and write
    # per sample, counted op by op on meta (fp32); 0 where it could not be counted
    sample_step_bytes: int = 0
    # networks: what the device-side transform of a training batch (image augmentation and normalisation, audio
    # features) reads and writes per sample, counted as sample_step_bytes is (transform_bytes)
    sample_transform_bytes: int = 0
    head_params: int = 0  # networks: the classifier head, what a linear probe trains
    block_activation_bytes: list[int] | None = None  # networks: what autograd keeps per sample inside each block
    boundary_bytes: int = 0  # networks: a block's input per sample (what layer streaming keeps per chunk)
    edge_trainable_params: int = 0  # networks: trainable weights outside the blocks
    recurrent_blocks: bool = (
        False  # networks: the blocks hold a recurrence (LSTM, GRU), whose backward steps through time
    )
    gated_mlp: bool = False  # the blocks have a gated MLP, which streaming may compute a slice at a time
    conv3d: bool = False  # networks: holds a 3-D convolution, which the plan keeps out of bf16 on CPUs
    # language models: the weights a token multiplies through in each block (a mixture of experts' top-k experts,
    # not all of them); [] where not counted: the linear layers stand in
    token_weights_per_block: list[int] | None = None
    # language models: query heads x head_dim (Gemma's and Qwen3's exceed hidden; multi-head latent attention's: the
    # mean of its query-key and value head widths); 0: hidden
    attention_dim: int = 0
    # language models: what each block's KV cache holds per token (elements), and the tokens it keeps at most (a
    # sliding window's; 0: every token); None: 2 x kv_dim in every block, over every token
    kv_cache_per_block: list[int] | None = None
    kv_window_per_block: list[int] | None = None
    # encoder-decoder language models (T5, BART): what each decoder block's cross-attention caches per token of the
    # encoder's input (elements); kv_cache_per_block is then the decoder blocks' self-attention; None: no encoder
    kv_cross_per_block: list[int] | None = None
    head_weights: int = 0  # language models: the weights a token multiplies through after the blocks; 0: vocab x hidden
    # language models: each block's linear layers as (module name in the model, in features, out features), which
    # strategy.lora.target_modules picks the adapted ones from (targeted_linears); None: not recorded
    linears_per_block: list[list[tuple[str, int, int]]] | None = None
    # language models: the linears' last names peft will not adapt on this model (a Mamba mixer's out_proj), which
    # training leaves out of every target list (onn.models.adapters): the plan leaves them out too
    lora_refused: list[str] = field(default_factory=list)
    # language models: the store dtypes under which streamed edges' prefix takes weights to the device besides the
    # rows its embeddings look up (BLOOM's embedding norm, OPT's positions; nf4 a table whose rows straddle its runs):
    # the engine gives the resident chunk back first (StreamingEngine._edges_loaded), so the forward reads chunk 0
    prefix_device_stores: list[str] = field(default_factory=list)

    @property
    def n_blocks(self) -> int:
        return len(self.block_params)


def model_spec(model_cfg: LanguageModelConfig, lora_rank: int, cache_dir: str | None = None) -> ModelSpec:
    """A language model's sizes, read off its meta-device build. The result is cached under cache_dir
    for models described by an architecture dict, so a repeated `task=plan` imports no torch."""
    cache = _spec_cache_path(model_cfg, lora_rank, cache_dir)
    saved = read_json(cache) if cache is not None else None
    if isinstance(saved, dict):
        return ModelSpec(**saved)  # (a damaged file reads as None: measured again)
    spec = _measure_spec(model_cfg, lora_rank)
    if cache is not None:
        write_text_atomically(cache, json.dumps(asdict(spec)))
    return spec


def _spec_cache_path(model_cfg: LanguageModelConfig, lora_rank: int, cache_dir: str | None) -> Path | None:
    if cache_dir is None or not model_cfg.architecture:
        return None
    from importlib.metadata import version

    key = {
        "architecture": model_cfg.architecture,
        "layer_map": model_cfg.layer_map.blocks,
        "lora_rank": lora_rank,
        "pretrained": is_pretrained(model_cfg),
        "own_tokenizer": _folder_files(_own_tokenizer_folder(model_cfg)),  # it may resize the embeddings
        "name": model_cfg.name,
        "transformers": version("transformers"),
        "peft": version("peft"),  # lora_refused is peft's own check
        "fields": [f.name for f in fields(ModelSpec)],  # a spec of another ONN version's shape is measured again
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return Path(cache_dir) / "specs" / f"{digest}.json"


def _measure_spec(model_cfg: LanguageModelConfig, lora_rank: int) -> ModelSpec:
    model = meta_model(model_cfg)
    fit_own_tokenizer(model_cfg, model)
    lmap = discover(model, model_cfg.layer_map.blocks)
    config = _language_config(getattr(model, "config", None))
    hidden = _cfg_int(config, "hidden_size", "n_embd", "d_model", default=0)
    heads = _cfg_int(config, "num_attention_heads", "n_head", default=1)
    head_dim = _cfg_int(config, "head_dim", default=hidden // max(heads, 1))
    attention_dim = _attention_width(config, heads, head_dim)
    kv_dim = _kv_activation_width(config, heads, head_dim, attention_dim)
    experts = [_experts_of(b) for b in lmap.blocks]
    # a config may name experts per token on a dense model (Qwen2-MoE with num_experts=0): only routed blocks count
    routed = _cfg_int(config, "num_experts_per_tok", default=0) if any(experts) else 0
    seen, params = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            params += p.numel()
    names = {id(m): name for name, m in model.named_modules()}
    named = [[(names[id(m)], *size) for m in b.modules() if (size := _linear_size(m))] for b in lmap.blocks]
    linear = [[(i, o) for _, i, o in block] for block in named]
    refused = sorted(lora_refused(model, [n for block in named for n, _, _ in block]))
    adapted = [[(i, o) for n, i, o in block if n.rsplit(".", 1)[-1] not in refused] for block in named]
    self_cache, cross_cache = _kv_caches(config, heads, head_dim, hidden, len(lmap.blocks))
    return ModelSpec(
        name=str(model_cfg.name),
        params=params,
        block_params=lmap.block_params(),
        prefix_params=lmap.prefix_params(),
        suffix_params=lmap.suffix_params(),
        lora_params_per_block=[lora_rank * sum(i + o for i, o in sizes) for sizes in adapted],
        linear_params_per_block=[sum(i * o for i, o in sizes) for sizes in linear],
        hidden=hidden,
        intermediate=_mlp_width(config, hidden, routed),
        kv_dim=kv_dim,
        vocab=_cfg_int(config, "vocab_size", default=0),
        layer_map=lmap.describe(),
        pretrained=is_pretrained(model_cfg),
        gated_mlp=bool(gated_mlps(lmap.blocks[0])),
        token_weights_per_block=[
            _token_weights(b, found, routed, _cfg_int(config, *EXPERT_COUNTS, default=0))
            for b, found in zip(lmap.blocks, experts, strict=True)
        ],
        attention_dim=attention_dim,
        kv_cache_per_block=self_cache,
        kv_window_per_block=_kv_windows(config, len(self_cache)),
        kv_cross_per_block=cross_cache,
        head_weights=_head_weights(config, hidden),
        linears_per_block=named,
        lora_refused=refused,
        prefix_device_stores=_prefix_device_stores(lmap),
    )


def _prefix_device_stores(lmap) -> list[str]:
    """The store dtypes under which the prefix computes with a weight the engine cannot look up in host memory (as
    StreamingEngine._find_edges decides): one outside its embeddings, a loose one, or an embedding's table that
    looks_up_ids refuses for that dtype."""
    from torch import nn

    from onn.streaming.quantized import looks_up_ids

    modules = [m for _, pm in lmap.prefix for m in pm.modules()]
    params = {id(p) for m in modules for p in m.parameters(recurse=False)} | {id(p) for _, p in lmap.loose}
    embeddings = [m for m in modules if isinstance(m, nn.Embedding)]
    stores = ("float32", "bfloat16", "float16", "int8", "nf4")
    return [sd for sd in stores if params - {id(m.weight) for m in embeddings if looks_up_ids(m, sd)}]


def targeted_linears(spec: ModelSpec, target_modules: Any) -> list[list[tuple[str, int, int]]] | None:
    """Each block's linear layers that LoRA adapts under `target_modules` (strategy.lora's): every one for all-linear,
    else those peft's own matcher picks (a list: a name's last parts; a string: a regular expression over the whole
    name), less those peft refuses (spec.lora_refused), as training leaves them out. None where the spec recorded no
    names. The plan sized adapters on every linear whatever the targets."""
    if spec.linears_per_block is None:
        return None
    refused = set(spec.lora_refused)
    kept = [[lin for lin in block if lin[0].rsplit(".", 1)[-1] not in refused] for block in spec.linears_per_block]
    if target_modules == "all-linear":
        return kept
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    config = LoraConfig(target_modules=target_modules if isinstance(target_modules, str) else list(target_modules))
    return [[lin for lin in block if check_target_module_exists(config, lin[0])] for block in kept]


def fit_own_tokenizer(model_cfg: LanguageModelConfig, model) -> None:
    """The meta model's token embeddings resized as load() resizes a folder's (resize_own_embeddings) where its own
    tokenizer gives ids past them (tokens added, the model saved without resizing): the plan counted config.json's
    rows, short of the parameters, memory and logits the run holds."""
    folder = _own_tokenizer_folder(model_cfg)
    if folder is None or not hasattr(model, "resize_token_embeddings"):
        return
    tokenizer = tokenizer_from(folder, model_cfg.trust_remote_code)
    try:
        rows = model.get_input_embeddings().num_embeddings
    except (AttributeError, NotImplementedError):  # a model without token embeddings
        return
    ids = max(tokenizer.get_vocab().values()) + 1 if tokenizer is not None else 0
    if isinstance(rows, int) and ids > rows:
        model.resize_token_embeddings(ids, mean_resizing=False)  # (meta rows have no mean to draw new ones from)


def _own_tokenizer_folder(model_cfg: LanguageModelConfig) -> str | None:
    """The folder whose own tokenizer fit_own_tokenizer reads: a folder's or a downloaded hub model's, unless
    model.tokenizer names another (a tokenizer ONN pairs with the model is refused where it outgrows it, not resized);
    None for any other source, and for a hub model not downloaded here (planned from model.architecture)."""
    kind = source_kind(model_cfg.source)
    if model_cfg.tokenizer or kind not in ("folder", "hub"):
        return None
    try:
        return expand(model_cfg.source) if kind == "folder" else hub_folder(model_cfg.source)
    except UserError:
        return None


def _folder_files(folder: str | None) -> list[tuple[str, int, int]]:
    """(name, size, mtime) of each file in `folder`, for the spec cache's key: a tokenizer saved with tokens added
    changes them, and the spec it resized the embeddings for is measured again (stat only: no tokenizer is read)."""
    if folder is None:
        return []
    files = sorted(p for p in Path(folder).iterdir() if p.is_file())
    return [(p.name, (st := p.stat()).st_size, st.st_mtime_ns) for p in files]


# the config keys of a mixture of experts' routed expert count: Mixtral, PhiMoE | Qwen-MoE, OLMoE | DeepSeek
EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")


def _language_config(config):
    """The config that holds the language model's sizes: a multimodal model's `text_config` (Gemma 3, Llava) where
    the top level names no width, else the config itself."""
    if _cfg_int(config, "hidden_size", "n_embd", "d_model", default=0) == 0 and hasattr(config, "text_config"):
        return config.text_config
    return config


def _linear_size(module) -> tuple[int, int] | None:
    """(in, out) features of a linear layer: nn.Linear, or transformers' Conv1D (GPT-2's, weight stored [in, out]),
    which LoRA adapts and bitsandbytes quantizes as it does nn.Linear; None for any other module."""
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if isinstance(module, Conv1D):
        return module.weight.shape[0], module.weight.shape[1]
    return None


def _experts_of(block) -> list:
    """The routed experts of a mixture-of-experts block (transformers names them `experts`: a module of stacked
    expert weights, or a ModuleList of expert MLPs), outermost only; [] for a dense block."""
    named = [(name, m) for name, m in block.named_modules() if name.rsplit(".", 1)[-1] == "experts"]
    return [m for name, m in named if not any(name.startswith(outer + ".") for outer, _ in named)]


def _token_weights(block, experts: list, routed: int, count: int) -> int:
    """The weights each token multiplies through in `block`: its linear layers outside the routed experts, and of
    the experts' weights the share a token is routed to (`routed` of `count` experts). A mixture of experts holds
    every expert in memory but computes only the top-k of them per token."""
    inside = {id(m) for e in experts for m in e.modules()}
    sizes = [_linear_size(m) for m in block.modules() if id(m) not in inside]
    dense = sum(size[0] * size[1] for size in sizes if size)
    # a router's weight (Mixtral's, OLMoE's, DeepSeek's `gate`) is a matrix each token multiplies through too, held
    # as a parameter of its own module, not a linear layer's
    in_linear = {id(p) for m in block.modules() if id(m) not in inside and _linear_size(m) for p in m.parameters()}
    counted = in_linear | {id(p) for e in experts for p in e.parameters()}
    dense += sum(p.numel() for p in block.parameters() if p.dim() == 2 and id(p) not in counted)
    active = 0
    for e in experts:
        total = getattr(e, "num_experts", None) or (len(e) if hasattr(e, "__len__") else 0) or count
        held = sum(p.numel() for p in e.parameters())
        active += held * routed // total if total and routed else held
    return dense + active


def _mlp_width(config, hidden: int, routed: int) -> int:
    """The MLP width each token computes (what its activations hold): the dense MLP's (GPT-2's n_inner, OPT's ffn_dim,
    Falcon's ffn_hidden_size; 4 x hidden where none is given), or of a mixture of experts the `routed` experts'
    and the shared experts' (Qwen2-MoE's shared expert, DeepSeek's n_shared_experts)."""
    dense = _cfg_int(config, "intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size", default=4 * hidden)
    if not routed:
        return dense
    expert = _cfg_int(config, "moe_intermediate_size", default=dense)
    shared = _cfg_int(config, "shared_expert_intermediate_size", default=0)
    return routed * expert + (shared or _cfg_int(config, "n_shared_experts", default=0) * expert)


def _latent_attention(config) -> bool:
    """Multi-head latent attention (DeepSeek-V2 and V3): keys and values compressed to a latent of kv_lora_rank."""
    return _cfg_int(config, "kv_lora_rank", default=0) > 0


def _attention_width(config, heads: int, head_dim: int) -> int:
    """The width attention's products run at per token: query heads x head_dim, or for multi-head latent attention the
    mean of its query-key heads' (qk_nope_head_dim + qk_rope_head_dim) and value heads' (v_head_dim) widths, whose
    config's head_dim names its rotary part only."""
    if not _latent_attention(config):
        return heads * head_dim
    query_key = _cfg_int(config, "qk_nope_head_dim", default=0) + _cfg_int(config, "qk_rope_head_dim", default=0)
    return heads * (query_key + _cfg_int(config, "v_head_dim", default=head_dim)) // 2


def _kv_activation_width(config, heads: int, head_dim: int, attention_dim: int) -> int:
    """The key and value width the activations are sized by (each kept four times: ModelSpec.kv_dim). Multi-head latent
    attention expands its keys and values to every query head (attention_dim), and keeps its query and key-value
    latents as often (a projection's output, its norm's input and output, the next projection's input)."""
    if not _latent_attention(config):
        return _kv_heads(config, heads) * head_dim
    latents = _cfg_int(config, "q_lora_rank", default=0) + _cfg_int(config, "kv_lora_rank", default=0)
    return attention_dim + latents


def _kv_cache_width(config, heads: int, head_dim: int) -> int:
    """Elements a block's KV cache holds per token, as transformers caches them: multi-head latent attention's
    compressed latent and rotary key (kv_lora_rank + qk_rope_head_dim); Falcon's new decoder architecture's keys and
    values broadcast to every query head before they are cached; else keys and values of every KV head."""
    if _latent_attention(config):
        return _cfg_int(config, "kv_lora_rank", default=0) + _cfg_int(config, "qk_rope_head_dim", default=0)
    if getattr(config, "new_decoder_architecture", False):
        return 2 * heads * head_dim
    return 2 * _kv_heads(config, heads) * head_dim


def _kv_caches(config, heads: int, head_dim: int, hidden: int, n_blocks: int) -> tuple[list[int], list[int] | None]:
    """Each decoder block's KV cache width per token, and an encoder-decoder's cross-attention cache width per token
    of the encoder's input (None for a decoder-only model). transformers caches, in each of an encoder-decoder's
    decoder layers, its self-attention's keys and values over the tokens generated and its cross-attention's over the
    encoder's output, both with the decoder's heads (BART's decoder_attention_heads, not num_attention_heads: the
    encoder's), in num_decoder_layers (T5) or decoder_layers (BART) blocks, which need not be the LayerMap's."""
    if not getattr(config, "is_encoder_decoder", False):
        return [_kv_cache_width(config, heads, head_dim)] * n_blocks, None
    heads = _cfg_int(config, "decoder_attention_heads", default=heads)
    head_dim = _cfg_int(config, "head_dim", default=hidden // heads)
    width = 2 * _kv_heads(config, heads) * head_dim
    layers = _cfg_int(config, "num_decoder_layers", "decoder_layers", default=n_blocks)
    return [width] * layers, [width] * layers


def _kv_windows(config, n_blocks: int) -> list[int]:
    """The tokens each block's KV cache keeps (0: every one), by transformers' rule: a block whose layer_types entry
    is sliding_attention keeps the last sliding_window; without layer_types (Mistral), every block does where the
    config names a sliding_window."""
    window = _cfg_int(config, "sliding_window", default=0)
    types = getattr(config, "layer_types", None)
    if not window:
        return [0] * n_blocks
    if types is None:
        return [window] * n_blocks
    if len(types) != n_blocks:  # a LayerMap of other blocks than the config's layers: no window assumed
        return [0] * n_blocks
    return [window if kind == "sliding_attention" else 0 for kind in types]


def _head_weights(config, hidden: int) -> int:
    """The weights a token multiplies through after the blocks: the vocabulary's projection, and OPT's projections
    to and from a word_embed_proj_dim narrower than hidden (OPT-350m's), which its head reads instead of hidden."""
    vocab = _cfg_int(config, "vocab_size", default=0)
    projected = _cfg_int(config, "word_embed_proj_dim", default=hidden)
    if projected == hidden:
        return vocab * hidden
    return vocab * projected + 2 * hidden * projected


def _kv_heads(config, heads: int) -> int:
    """Key and value heads: grouped-query attention's (num_key_value_heads; Falcon's num_kv_heads), one where the
    config asks for multi-query attention the old way (Falcon-7B's and GPT-BigCode's multi_query), else every head."""
    if getattr(config, "multi_query", None) is True and not getattr(config, "new_decoder_architecture", False):
        return 1
    return _cfg_int(config, "num_key_value_heads", "num_kv_heads", default=heads)


def network_spec(
    model,
    sample,
    name: str,
    pretrained: bool,
    head_params: int = 0,
    blocks_path: str | None = None,
    transform_bytes: int = 0,
) -> ModelSpec:
    """A network's sizes for one sample: parameters, and the forward FLOPs and the bytes autograd saves
    for backward, both counted during one forward pass on the meta device (nothing is allocated).
    `model` is built on the meta device and `sample` is a meta tensor of one sample's batch of 1 (or a tuple of
    them, for a model of several inputs: a denoiser's image and timestep); `head_params` is what a linear probe
    would train; `transform_bytes`: what the training batches' transform moves per sample (transform_bytes())."""

    from torch.nn import Conv3d, RNNBase

    try:
        lmap = discover(model, blocks_path)
    except UserError:  # a network without repeated blocks plans as well; only cut points and streaming need them
        lmap = None
    blocks = lmap.blocks if lmap is not None else []
    saved, inside, boundary, flops = _saved_bytes(model, sample, blocks)
    if lmap is not None:
        blocks, prefix, suffix, described = (
            lmap.block_params(),
            lmap.prefix_params(),
            lmap.suffix_params(),
            lmap.describe(),
        )
    else:
        blocks, prefix, suffix, described = [], 0, 0, "no repeated blocks"
    in_blocks = {id(p) for b in (lmap.blocks if lmap is not None else []) for p in b.parameters()}
    recurrent = any(isinstance(m, RNNBase) for b in (lmap.blocks if lmap is not None else []) for m in b.modules())
    params = sum(p.numel() for p in model.parameters())
    return ModelSpec(
        name=name,
        params=params,
        block_params=blocks,
        prefix_params=prefix,
        suffix_params=suffix,
        # what trains in each block (a network's LoRA adapters, when its blocks stream)
        lora_params_per_block=[sum(p.numel() for p in b.parameters() if p.requires_grad) for b in lmap.blocks]
        if lmap is not None
        else [],
        linear_params_per_block=[0] * len(blocks),
        hidden=0,
        intermediate=0,
        kv_dim=0,
        vocab=0,
        layer_map=described,
        pretrained=pretrained,
        kind="network",
        sample_activation_bytes=saved,
        sample_flops=flops,
        sample_step_bytes=0 if recurrent else step_bytes(model, sample),
        sample_transform_bytes=transform_bytes,
        head_params=head_params,
        block_activation_bytes=inside,
        boundary_bytes=boundary,
        edge_trainable_params=sum(p.numel() for p in model.parameters() if p.requires_grad and id(p) not in in_blocks),
        recurrent_blocks=recurrent,
        conv3d=any(isinstance(m, Conv3d) for m in model.modules()),
    )


def _saved_bytes(model, sample, blocks: list) -> tuple[int, list[int], int, int]:
    """One forward of `sample` on the meta device: the bytes autograd saves for backward (in all, and inside each
    of `blocks`), the bytes of the first block's input, and the FLOPs."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    saved, inside, boundary = 0, [0] * len(blocks), []  # (forward() below sets them afresh)
    current: list[int] = []  # the block being run (hooks below)

    def pack(t: torch.Tensor):
        nonlocal saved
        # a parameter, or a view of one (a recurrence saves its weight's transpose at every step), is no new memory
        if not isinstance(t, torch.nn.Parameter) and not isinstance(t._base, torch.nn.Parameter):
            # an expanded view holds its storage, not its numel: torch_geometric's scatter saves each layer's edge
            # index broadcast to [edges, width] (stride 0), 8 x width bytes an edge counted where 8 are held
            held = t.numel() * t.element_size()
            if t.layout == torch.strided:  # (a sparse tensor has no storage to ask)
                held = min(held, t.untyped_storage().nbytes())
            saved += held
            if current:
                inside[current[-1]] += held
        return t

    def enter(i: int):
        def hook(module, args):
            current.append(i)
            if i == 0 and args and isinstance(args[0], torch.Tensor):
                boundary.append(args[0].numel() * args[0].element_size())

        return hook

    def leave(module, args, output) -> None:
        current.pop()

    inputs = [t.requires_grad_(False) for t in (sample if isinstance(sample, tuple) else (sample,))]

    def forward() -> int:
        nonlocal saved
        saved, inside[:], current[:], boundary[:] = 0, [0] * len(blocks), [], []
        handles = [b.register_forward_pre_hook(enter(i)) for i, b in enumerate(blocks)]
        handles += [b.register_forward_hook(leave) for b in blocks]
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        try:
            with hooks, FlopCounterMode(display=False) as flops, one_sample_norms(model.train()):
                model(*inputs)
        finally:
            for h in handles:
                h.remove()
        return int(flops.get_total_flops())

    flops = on_one_thread(forward, model, inputs)
    return saved, inside, boundary[0] if boundary else 0, flops


def step_bytes(model, sample) -> int:
    """What a training step's memory-bound ops read and write per sample: a forward and backward on the meta device
    of a batch of 2 less one of 1 (what the weights' own tensors cost is per step, not per sample). Norms, activations
    and pooling read and write every activation and its gradient several times over, where the bytes autograd saves
    count each once: v28's step moves 1.8x those saved bytes twice over. 0 where it cannot be counted (no meta
    kernel for an op, an output with nothing to backpropagate): the planner then counts the saved bytes. A
    recurrent network is not counted (network_spec): its meta backward steps through every frame in Python, seconds
    of task=plan."""
    import torch
    from torch.utils._pytree import tree_leaves

    inputs = sample if isinstance(sample, tuple) else (sample,)

    def count(batch: int) -> int:
        counter = OpBytes()
        try:
            with counter.mode, one_sample_norms(model.train()):
                output = model(*[torch.cat([t] * batch) for t in inputs])
                # a tuple, dict or ModelOutput too: every tensor of it that carries a gradient
                outputs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
                if not outputs:
                    return 0
                sum(t.float().sum() for t in outputs).backward()
        finally:
            model.zero_grad(set_to_none=True)
        return counter.total

    def both() -> int:
        one = count(1)
        return max(0, count(2) - one) if one else 0

    try:
        return on_one_thread(both, model, inputs)
    except Exception as e:  # noqa: BLE001 -- an estimate never ends a plan (an op without a meta kernel, say)
        log.debug(
            "plan: a step's memory traffic not counted (%s: %s); the saved activations stand in", type(e).__name__, e
        )
        return 0


def transform_bytes(transform: Callable[..., Any], stored: Any) -> int:
    """What the device-side transform of a training batch (an image batch's crop, flip and normalisation; audio's
    features and augmentation) reads and writes per sample, counted as step_bytes counts a network's ops: a batch of 4
    less one of 2, run for real on `stored` (one stored sample: kilobytes), the random generator's state restored
    after. It runs at every training step beside the network, and was left out of the planned step. 0 where it
    cannot be counted."""
    import torch

    def count(batch: int) -> int:
        counter, stored_batch = OpBytes(), torch.cat([stored] * batch)  # (the batch arrives made)
        with counter.mode:
            transform(stored_batch, train=True)
        return counter.total

    try:
        with torch.random.fork_rng(devices=[]):
            return max(0, count(4) - count(2)) // 2  # (a batch of one can take another path: a 1-image layout)
    except Exception as e:  # noqa: BLE001 -- an estimate never ends a plan
        log.debug("plan: the batch transform's memory traffic not counted (%s: %s)", type(e).__name__, e)
        return 0


def on_one_thread(measure: Callable[[], T], model, inputs) -> T:
    """`measure()` (a forward, or a forward and backward, that counts shapes and bytes) on one thread where the model
    or its input holds real tensors: a graph network is built for real (its forward runs on no meta device) and
    counted on its plan graph, whose tiny ops torch split over every core; on a busy 2-core machine each waited for
    the other thread, and the count took 1.2-2.8 s of task=plan, 0.1 s on one thread (the same figures: the same
    run). Fake tensors (no arithmetic) took 0.5 s of Python. A meta model computes nothing and runs as it is."""
    import torch

    if all(t.is_meta for t in itertools.chain(model.parameters(), model.buffers(), inputs)):
        return measure()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return measure()
    finally:
        torch.set_num_threads(before)


@contextmanager
def one_sample_norms(model):
    """The model as it is, with each BatchNorm in eval mode (its running statistics): the spec's batch of one
    reaches some norms as one value per channel (a 16 px clip after a video ResNet's four downsamplings), which
    training's batch statistics refuse, where a real batch of 2 or more trains. A norm in eval mode saves as many
    bytes for backward (the same totals for ResNets and video ResNets)."""
    from torch.nn.modules.batchnorm import _BatchNorm

    norms = [m for m in model.modules() if isinstance(m, _BatchNorm) and m.training]
    for m in norms:
        m.eval()
    try:
        yield model
    finally:
        for m in norms:
            m.train()


def _cfg_int(config, *names: str, default: int) -> int:
    for n in names:
        v = getattr(config, n, None)
        if isinstance(v, int) and v > 0:
            return v
    return default
