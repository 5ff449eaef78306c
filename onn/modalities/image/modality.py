"""Images: classification datasets in the formats they ship in, decoded once, trained on the device.

The image modality: folders of CLASS/IMAGE (or an archive of them), IDX, CIFAR and STL-10
binaries, SVHN .mat, parquet and path,label CSVs (onn/modalities/image/formats), ONN's v28 CNN or
any timm model (onn/models/vision.py), augmentation on the device, and a grid of predicted images.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onn.config import ONNConfig
from onn.config.data import ImageData
from onn.config.model import NetworkConfig
from onn.data.files import ARCHIVE_ERRORS, archive_kind, is_hidden, iter_members, read_head
from onn.errors import UserError
from onn.hardware.profile import Profile
from onn.modalities.base import ClassifierModality, RunConfig
from onn.models.zoo.sizes import image_sides

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")
ASSUMED_SIZE = [32, 32]  # a plan's image size where data.image_size is null and there is no data to read


@dataclass(frozen=True)
class FirstImage:
    """What the data's first image says of the inputs a null data.image_size trains on."""

    name: str  # the item read
    size: list[int]  # [H, W]
    channels: int  # as channels=auto decodes the data (1 when its first images are all grey, else 3)
    classes: int | None  # the classes its listing found; None where only the first image was read (a .tar.gz)


def first_image(data: ImageData) -> FirstImage | None:
    """The data's first decodable image, listed and decoded as training reads it item by item; None where there is
    no data to read (data.source null, built-in or not on this machine: task=plan for data one does not have). A
    source that is there but cannot be read is the UserError training would end with."""
    source = str(data.source or "")
    if not source or source.startswith("builtin:") or not Path(source).expanduser().exists():
        return None
    key = (source, data.format or "auto", str(data.channels), Path(source).expanduser().stat().st_mtime_ns)
    return _first_image(*key)


@functools.lru_cache(maxsize=4)
def _first_image(source: str, fmt: str, channels: str, _mtime_ns: int) -> FirstImage | None:
    """first_image, read once per source (the plan reads it for its inputs and again for its reasons)."""
    from onn.modalities.image.formats import detect_format, list_items

    path = Path(source).expanduser()
    if fmt in ("auto", "archive") and archive_kind(path) == "targz" and detect_format(path) == "archive":
        return _first_streamed_image(path, channels)
    splits = list_items(path, fmt)
    for items in splits.values():
        items.configure(channels=int(channels) if channels.isdigit() else "auto")
        for i in range(min(len(items), 16)):
            image = items.load(i)
            if image is not None:
                return FirstImage(
                    items.names[i], [int(v) for v in image.shape[1:]], int(image.shape[0]), len(items.classes)
                )
    return None


def trained_inputs(config: RunConfig) -> dict[str, Any] | None:
    """With ckpt=, the classes and input shape the checkpoint's model was trained on, which eval, infer, export and a
    resumed run decode every image to (dataset.as_trained), whatever data.image_size says: the plan sizes that
    network, not one built for data.image_size. None without a checkpoint."""
    from onn.training.classifier import trained_config

    saved = trained_config(config)
    if saved is None:
        return None
    inputs = saved["inputs"]
    shape = inputs.get("input_shape") or inputs["image_shape"]  # image_shape: as an earlier ONN saved it
    return {"classes": [str(c) for c in inputs["classes"]], "input_shape": [int(v) for v in shape]}


def _first_streamed_image(path: Path, channels: str) -> FirstImage | None:
    """A compressed tar's first decodable image member: the archive is read front to back and no further than that
    image (list_items refuses a .tar.gz, which has no random access; reading all of it would decompress the whole
    archive for one image's size). Its classes are not counted: that would take the whole archive."""
    from onn.modalities.image.formats.common import is_image_name
    from onn.modalities.image.formats.decode import decode, strict_pil

    members = iter_members(path, "targz")
    try:
        for tried, member in enumerate(
            m for m in members if m.name and not is_hidden(m.name) and is_image_name(m.name)
        ):
            if tried == 16:  # as list_items' first images: a source whose first 16 do not decode has none to plan by
                return None
            with member.open() as f, strict_pil():
                try:
                    image = decode(f.read(), int(channels) if channels.isdigit() else "auto", member.name)
                except Exception:  # noqa: BLE001 -- PIL raises many types for a damaged image: try the next one
                    continue
            return FirstImage(member.name, [int(v) for v in image.shape[:2]], 1 if image.ndim == 2 else 3, None)
    except ARCHIVE_ERRORS as e:
        raise UserError(f"data.source {path} is not a readable archive: {e}") from e
    finally:
        members.close()  # the archive's file, closed now rather than when the generator is collected
    return None


class ImageModality(ClassifierModality):
    name = "image"
    data_schema = ImageData
    default_data = "image"
    default_model = "v28_cnn"
    description = "image classification"
    stored_dtype = "uint8"

    def reader_version(self) -> int:
        from onn.modalities.image.formats.decode import READER_VERSION

        return READER_VERSION

    def sniff(self, path: Path) -> str | None:
        from onn.modalities.image.formats import detect_format, image_kind
        from onn.modalities.image.formats.csvfile import TABLE_SUFFIXES

        if path.is_file():
            head = read_head(path, 4096)
            if kind := image_kind(head):
                return f"a {kind} image"
            if head[:4] == b"PAR1":  # parquet: image data when a column holds bytes (an image column)
                import pyarrow as pa
                import pyarrow.parquet as pq

                try:
                    schema = pq.read_schema(path)
                except Exception:  # noqa: BLE001 - pyarrow raises several types for damaged files
                    return None
                binary = [
                    f.name
                    for f in schema
                    if pa.types.is_binary(f.type)
                    or pa.types.is_large_binary(f.type)
                    or (pa.types.is_struct(f.type) and any(pa.types.is_binary(c.type) for c in f.type))
                ]
                return f"a parquet table with image bytes ({', '.join(binary[:2])})" if binary else None
            if path.suffix.lower() in TABLE_SUFFIXES:
                # tables the csv reader reads: image data only when their first row names an image file (text
                # tables are text data)
                lines = head.decode("utf-8", "replace").splitlines()
                row = lines[1] if len(lines) > 1 else ""
                return "a table of image paths and labels" if any(s in row.lower() for s in IMAGE_SUFFIXES) else None
        try:
            fmt = detect_format(path)
        except UserError:
            return None
        return f"image data ({fmt})"

    def check(self, config: ONNConfig) -> None:
        from onn.modalities.image.augment import BatchAugment
        from onn.models.vision import check_image_classifier

        check_image_classifier(config.model)  # a denoiser, graph network or point cloud model: before planning
        data: ImageData = config.data
        BatchAugment(data.augment, [0.5], [0.5])  # the augmentation's values, checked now
        size = data.image_size
        if size is not None and (len(size) not in (1, 2) or not all(isinstance(v, int) and v > 0 for v in size)):
            raise UserError(
                f"data.image_size={size}: give [height, width] in pixels (or [side] for a square), each 1 or more "
                "(or null)."
            )

    def datamodule(self, config: ONNConfig, device: str):
        from onn.modalities.image.dataset import ImageDataModule, as_trained
        from onn.training.classifier import trained_config

        data = as_trained(config.data, trained_config(config), config.ckpt)  # with ckpt=, as the model was trained
        return ImageDataModule(data, config.paths.cache, device, seed=int(config.seed))

    def network(self, model_cfg: NetworkConfig, inputs: dict[str, Any]):
        from onn.models.vision import build_classifier

        channels, height, width = inputs["input_shape"]
        return build_classifier(model_cfg, channels, len(inputs["classes"]), [height, width])

    def transform(self, config: RunConfig, inputs: dict[str, Any]):
        from onn.modalities.image.augment import BatchAugment

        return BatchAugment(config.data.augment, inputs["mean"], inputs["std"])

    def input_stats(self, config: ONNConfig, dm) -> dict[str, Any]:
        from onn.modalities.image.dataset import input_stats

        mean, std = input_stats(config, dm)
        return {"mean": mean, "std": std}

    def neutral_stats(self, inputs: dict[str, Any]) -> dict[str, Any]:
        channels = inputs["input_shape"][0]
        return {"mean": [0.5] * channels, "std": [0.5] * channels}

    def planned_inputs(self, config: RunConfig) -> dict[str, Any]:
        """From the config (task=plan, export without a checkpoint, a pair's side): data.image_size, channels and
        num_classes; where image_size is null, the images' own size (and channels and classes where auto) as the
        data's first image has it, or 32 px (3 channels, 10 classes) where there is no data.source to read."""
        if (trained := trained_inputs(config)) is not None:
            return trained
        data: ImageData = config.data
        found = None if data.image_size else first_image(data)
        size = list(image_sides(data.image_size)) if data.image_size else found.size if found else ASSUMED_SIZE
        channels = data.channels if isinstance(data.channels, int) else found.channels if found else 3
        classes = data.num_classes if isinstance(data.num_classes, int) else (found and found.classes) or 10
        return {"classes": [str(i) for i in range(classes)], "input_shape": [channels, *size]}

    def plan(self, config: ONNConfig, hardware: Profile, use_tuned: bool = True):
        """The shared classifier plan, saying where a null data.image_size's size came from: memory and step time
        grow with the pixels (a folder of 224 px images planned as 32 px ones: 1.7 GB for ResNet-18's batch of 128,
        where it takes 7.1 GB)."""
        plan, spec = super().plan(config, hardware, use_tuned)
        data: ImageData = config.data
        if (trained := trained_inputs(config)) is not None:
            height, width = trained["input_shape"][1:]
            plan.reasons.append(
                f"images of {height}x{width} px, as the checkpoint's model was trained (ckpt=: images of another size "
                "are resized to it)"
            )
        elif not data.image_size:
            found = first_image(data)
            plan.reasons.append(
                f"images of {found.size[0]}x{found.size[1]} px, as {found.name} in data.source has them "
                "(data.image_size is null: the images' own size)"
                if found
                else f"images of {ASSUMED_SIZE[0]}x{ASSUMED_SIZE[1]} px assumed: data.image_size is null and there is "
                "no data.source on this machine to read; set data.image_size=[H,W] to plan for your images"
            )
        return plan, spec

    def read_inputs(self, source: Path, inputs: dict[str, Any], config: RunConfig):
        from onn.data.resident import Decoded
        from onn.modalities.image.dataset import trained_resize
        from onn.modalities.image.formats import read_splits
        from onn.training.classifier import trained_config

        channels, height, width = inputs["input_shape"]
        data: ImageData = config.data
        saved = trained_config(config)  # data=image on the command line: the checkpoint's resize, as as_trained
        resize = data.resize if data.resize != "error" else "resize"
        if saved is not None:
            resize = trained_resize(data, saved, config.ckpt)
        sets = read_splits(
            source,
            "auto",
            channels=channels,
            image_size=[height, width],
            resize=resize,
            max_bad_fraction=float(data.max_bad_fraction),
            allow_unlabelled=True,
            key="task.input",
        )
        return {k: Decoded(s.images, s.labels, s.classes, s.names, s.skipped) for k, s in sets.items()}

    def picture(self, samples, predicted, true, path: Path, inputs: dict[str, Any]) -> None:
        from onn.modalities.image.pictures import write_grid

        write_grid(samples, predicted, true, path)
