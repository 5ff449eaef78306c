"""data=...: one schema per modality. A conf/data option names its modality's schema in its defaults list
(conf/data/image.yaml: `/schema/data/image@_here_`), so a key of another modality fails at compose time.

The values are in the YAML files. Nested blocks that an option may give in part (data.augment, say) keep
the values that turn a setting off here, so `augment: {hflip: 0.5}` needs no other key."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING


@dataclass
class DataConfig:
    name: str = MISSING
    modality: str = MISSING  # which modality reads it (auto: sniffed from source)
    source: Any = MISSING  # a file, folder, archive or builtin:NAME


@dataclass
class SplitData(DataConfig):
    """What every labelled-sample modality shares: batches, held-out splits, bad files, residency."""

    num_classes: Any = MISSING  # auto: from the data; a number also checks every label is below it
    classes: list[str] | None = MISSING  # class names in label order; null: from the data
    batch_size: int = MISSING
    eval_batch_size: int | None = MISSING  # validation/test/inference batch; null: 2 x batch_size
    val_split: float = MISSING  # held out of train (seeded) when the data has no val split
    val_source: str | None = MISSING
    test_source: str | None = MISSING
    max_bad_fraction: float = MISSING  # unreadable files are skipped and named; fail above this fraction
    resident: Any = MISSING  # auto | true | false: decoded samples held on the compute device
    resident_max_mb: Any = MISSING
    num_workers: int = MISSING  # streamed datasets: DataLoader workers that decode files
    batch_groups: str | None = MISSING  # a regex whose group names a sample's group: one group per batch


@dataclass
class ColorJitter:
    brightness: float = 0.0
    contrast: float = 0.0
    saturation: float = 0.0
    hue: float = 0.0  # not supported: must stay 0


@dataclass
class RandomErasing:
    p: float = 0.5
    scale: list[float] = field(default_factory=lambda: [0.02, 0.33])
    ratio: list[float] = field(default_factory=lambda: [0.3, 3.3])
    value: Any = 0  # a number, or random


@dataclass
class ImageAugment:
    """Per sample, on the device, training batches only (onn/modalities/image/augment.py)."""

    crop_padding: int = 0  # random crop of the original size from the image padded by this many pixels
    padding_mode: str = "reflect"  # reflect | zeros
    hflip: float = 0.0  # probability of a horizontal flip
    # blocks that are there and off (not null), so data.augment.color_jitter.brightness=0.2 on the command line
    # sets one key (Hydra cannot set a key inside a null); null, as a saved config may hold, is off too
    color_jitter: ColorJitter | None = field(default_factory=ColorJitter)
    random_erasing: RandomErasing | None = field(default_factory=lambda: RandomErasing(p=0.0))


@dataclass
class ImageData(SplitData):
    format: str = MISSING  # auto | folder | archive | idx | cifar_binary | svhn_mat | stl10_binary | parquet | csv
    channels: Any = MISSING  # auto | 1 | 3
    image_size: list[int] | None = MISSING  # [H, W]; null: keep their size (must agree)
    resize: str = MISSING  # error | resize | center_crop
    mean: Any = MISSING  # auto, or one value per channel
    std: Any = MISSING
    augment: ImageAugment | None = MISSING


@dataclass
class AudioFeatures:
    n_mels: int = MISSING
    n_fft: int = MISSING
    hop_length: int = MISSING
    f_min: float = 20.0
    f_max: float | None = None
    top_db: float = MISSING
    normalize: str = "instance"  # instance | dataset | none


@dataclass
class AudioAugment:
    """Each 0 turns it off (onn/modalities/audio/features.py)."""

    gain_db: float = 0.0
    shift_seconds: float = 0.0
    truncate: float = 0.0
    speed: float = 0.0
    noise_snr_db: float = 0.0
    freq_warp: float = 0.0
    time_warp: float = 0.0
    freq_mask: float = 0.0
    time_mask: float = 0.0
    masks: float = 0.0


@dataclass
class LabelledFiles(SplitData):
    """Audio and video: labels from folders, file names or a manifest; held-out files by pattern."""

    label_from: str = MISSING  # auto | folder | a regex on the file name | manifest
    label_column: str = MISSING
    val_pattern: str | None = MISSING
    test_pattern: str | None = MISSING


@dataclass
class AudioData(LabelledFiles):
    sample_rate: int = MISSING
    channels: int = MISSING
    clip_seconds: float = MISSING
    store_seconds: float | None = MISSING  # stored length (null: clip_seconds); longer leaves room to shift
    features: AudioFeatures = MISSING
    augment: AudioAugment | None = MISSING


@dataclass
class VideoMotion:
    """builtin:motion, the generated clips of squares moving four ways."""

    train_per_class: int = MISSING
    test_per_class: int = MISSING
    frames: int = MISSING
    size: int = MISSING
    fps: int = MISSING
    codec: str = MISSING
    seed: int = MISSING


@dataclass
class VideoData(LabelledFiles):
    frames: int = MISSING
    decode_frames: int | None = MISSING
    sampling: str = MISSING  # uniform | random
    image_size: list[int] = MISSING
    resize: str = MISSING
    channels: int = MISSING
    mean: Any = MISSING
    std: Any = MISSING
    augment: ImageAugment | None = MISSING
    motion: VideoMotion = MISSING


@dataclass
class MeshAugment:
    rotate: str = "none"  # up | any | none
    up_axis: str = "y"
    scale: list[float] | None = None  # [low, high]
    jitter: float = 0.0
    jitter_clip: float = 0.0


@dataclass
class MeshBuiltin:
    per_class: int = MISSING
    test_per_class: int = MISSING


@dataclass
class MeshData(SplitData):
    points: int = MISSING
    normals: bool = MISSING
    align: str = MISSING
    augment: MeshAugment | None = MISSING
    builtin: MeshBuiltin | None = MISSING


@dataclass
class GraphBuiltin:
    """builtin:primitives read as graphs (graph level), builtin:communities (node level)."""

    per_class: int = MISSING  # primitives: training shapes of each class
    test_per_class: int = MISSING  # primitives: held-out shapes of each class (another random stream)
    nodes: int = MISSING  # communities: nodes of the one generated graph
    communities: int = MISSING  # communities: its classes
    features: int = MISSING  # communities: node features (noisy hints of the community)


@dataclass
class GraphData(SplitData):
    level: str = MISSING  # graph: one class per graph | node: one class per node of one graph (train/val/test masks)
    align: str = MISSING  # mesh graphs: none | pca (vertex positions turned onto their principal axes)
    max_nodes: int = MISSING  # a graph with more nodes is skipped with its reason
    builtin: GraphBuiltin | None = MISSING


@dataclass
class TextFields:
    input: str = MISSING
    output: str = MISSING


@dataclass
class MathBuiltin:
    train_size: int = MISSING
    val_size: int = MISSING
    max_operand: int = MISSING
    operations: list[str] = MISSING


@dataclass
class TextData(DataConfig):
    format: str = MISSING
    fields: TextFields = MISSING
    template: str = MISSING
    chat_template: Any = MISSING
    answer_pattern: str | None = MISSING
    max_length: int = MISSING
    batch_size: int = MISSING
    val_split: float = MISSING
    val_source: str | None = MISSING
    num_workers: int = MISSING
    streaming: Any = MISSING
    resident_max_mb: Any = MISSING
    shuffle_buffer: int = MISSING
    trace: str | None = MISSING
    builtin: MathBuiltin | None = MISSING


@dataclass
class PairsData(DataConfig):
    modalities: Any = MISSING
    text_column: str = MISSING
    batch_size: int = MISSING
    eval_batch_size: int | None = MISSING
    val_split: float = MISSING
    max_bad_fraction: float = MISSING
    sides: dict[str, Any] = field(default_factory=dict)  # per side: keys of that modality's data config
    # task=eval: every pair of this source is scored (eval sets it to a data.source it is given); training holds
    # out data.val_split of data.source instead
    val_source: str | None = None


@dataclass
class CaptionData:
    """data.sides.text: the captions of a pair (onn/modalities/pairs/sides.py), read as they are and encoded
    by the zoo's text encoder; not the text modality's data config, which is prompt/answer records."""

    modality: str = "text"
    max_length: int = MISSING  # bytes kept of each caption (ONN's byte tokenizer: one token per byte)


def eval_batch(data: SplitData | PairsData) -> int:
    """The validation, test and inference batch: data.eval_batch_size, or twice the training batch (null)."""
    return int(data.eval_batch_size or 2 * data.batch_size)
