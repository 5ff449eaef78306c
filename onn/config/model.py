"""model=...: three kinds of model, each its schema; a conf/model option names its kind in its defaults list."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING


@dataclass
class LayerMapOverride:
    """Where a model's repeated blocks are, for a model whose blocks discovery does not find
    (onn/models/layers.py): `model.layer_map.blocks=model.layers`."""

    blocks: str | None = MISSING  # the blocks' ModuleList path; null: discovered


@dataclass
class ModelConfig:
    name: str = MISSING


@dataclass
class LanguageModelConfig(ModelConfig):
    """A transformers model: a causal language model (what it trains), CLIP, or one of the models exported as
    .omny pipelines (SAM2, Grounding DINO, TrOCR). Hugging Face weights (hub id, folder, .gguf, .safetensors) or
    a random init."""

    source: str = MISSING  # hub id, HF folder, .gguf, .safetensors, file.py:function, or random
    # null: from source; `byte` or `wordpiece`: ONN's built-in ones (onn/models/tokenizer.py); `none`: reads no text
    tokenizer: str | None = MISSING
    dtype: str = MISSING  # auto | float32 | bfloat16 | float16
    trust_remote_code: bool = MISSING
    layer_map: LayerMapOverride = MISSING
    architecture: dict[str, Any] | None = MISSING  # a transformers config: the shapes, before weights load
    # Grounded SAM2: the SAM2 model (a conf/model option's keys, `- sam2_hiera_large@segmenter` in the defaults)
    # that segments what this detector finds; exported beside it as one pipeline
    segmenter: dict[str, Any] | None = None


@dataclass
class NetworkConfig(ModelConfig):
    """A network for images, audio, video or point clouds: timm, torchvision or ONN's zoo."""

    source: str = MISSING  # timm:NAME | torchvision:NAME | zoo:NAME | file.py:function
    kwargs: dict[str, Any] = field(default_factory=dict)  # the constructor's arguments
    weights: str | None = None  # a .safetensors state dict to start from (the head may differ)
    small_input: Any = "auto"  # timm models: auto | true | false (a stem for pictures of 64 px or less)
    channels_last: bool = False
    compile: bool = False  # torch.compile the network
    temporal_pool: str = "mean"  # per-frame image networks on video: mean | tconv
    layer_map: LayerMapOverride = field(default_factory=lambda: LayerMapOverride(blocks=None))
    # file.py:function computing the training (and validation) loss as loss(outputs, labels) -> a scalar tensor;
    # null: cross-entropy (with task.label_smoothing)
    loss: str | None = None


@dataclass
class GraphNetworkConfig(NetworkConfig):
    """A graph network of torch_geometric's convolutions (onn/modalities/graph/network.py); `source` names the
    convolution: pyg:gcn | pyg:sage | pyg:gin | pyg:gat."""

    hidden: int = MISSING  # every block's width
    layers: int = MISSING  # message-passing blocks (conv, norm, ReLU, dropout)
    heads: int = MISSING  # gat: attention heads (hidden is split among them)
    dropout: float = MISSING
    norm: str = MISSING  # batch | none: after every conv
    pooling: list[str] = MISSING  # graph level: mean | max | sum over each graph's nodes, side by side


@dataclass
class DualEncoderConfig(ModelConfig):
    """Two networks trained with CLIP's contrastive loss (conf/model/dual_encoder.yaml)."""

    feature_dim: int = MISSING  # what each side's encoder outputs
    embed_dim: int = MISSING  # the shared space both sides are projected into
    temperature: float = MISSING  # the initial softmax temperature
    learn_temperature: bool = MISSING
    max_logit_scale: float = MISSING  # 1 / temperature is clamped at this
    sides: dict[str, Any] = field(default_factory=dict)  # per side: a conf/model option, or a dict of its keys


@dataclass
class DenoiserConfig(ModelConfig):
    """A diffusion denoiser from diffusers (onn/modalities/diffusion): a UNet2DModel or a DiTTransformer2DModel
    predicting the noise added to an image at a timestep, trained under a DDPMScheduler's noise schedule."""

    architecture: str = MISSING  # unet (diffusers.UNet2DModel) | dit (diffusers.DiTTransformer2DModel)
    kwargs: dict[str, Any] = field(default_factory=dict)  # the diffusers constructor's arguments (not sizes/channels)
    train_timesteps: int = MISSING  # the noise schedule's length (DDPMScheduler's num_train_timesteps)
    beta_schedule: str = MISSING  # linear | scaled_linear | squaredcos_cap_v2 (DDPMScheduler's)
    ema_decay: float = MISSING  # weights sampled from: an exponential moving average of the trained ones; 0: off
    layer_map: LayerMapOverride = field(default_factory=lambda: LayerMapOverride(blocks=None))
