"""Images: classification datasets in the formats they ship in, decoded once, trained on the device.

The image modality: folders of CLASS/IMAGE (or an archive of them), IDX, CIFAR and STL-10
binaries, SVHN .mat, parquet and path,label CSVs (onn/modalities/image/formats), ONN's v28 CNN or
any timm model (onn/models/vision.py), augmentation on the device, and a grid of predicted images.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from onn.config import ONNConfig
from onn.config.data import ImageData
from onn.config.model import NetworkConfig
from onn.modalities.base import ClassifierModality, RunConfig

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")


class ImageModality(ClassifierModality):
    name = "image"
    data_schema = ImageData
    default_data = "image"
    default_model = "v28_cnn"
    description = "image classification"
    stored_dtype = "uint8"

    def sniff(self, path: Path) -> str | None:
        from onn.data.files import read_head
        from onn.errors import UserError
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
        if size is not None and (len(size) != 2 or not all(isinstance(v, int) and v > 0 for v in size)):
            from onn.errors import UserError

            raise UserError(f"data.image_size={size}: give [height, width] in pixels, each 1 or more (or null).")

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
        """From the config alone (task=plan, a pair's side): its image_size (32 px when null), channels (3
        when auto) and num_classes (10 when auto)."""
        data: ImageData = config.data
        size = [int(v) for v in data.image_size] if data.image_size else [32, 32]
        channels = data.channels if isinstance(data.channels, int) else 3
        classes = data.num_classes if isinstance(data.num_classes, int) else 10
        return {"classes": [str(i) for i in range(classes)], "input_shape": [channels, *size]}

    def read_inputs(self, source: Path, inputs: dict[str, Any], config: RunConfig):
        from onn.data.resident import Decoded
        from onn.modalities.image.formats import read_splits

        channels, height, width = inputs["input_shape"]
        data: ImageData = config.data
        sets = read_splits(
            source,
            "auto",
            channels=channels,
            image_size=[height, width],
            resize=data.resize if data.resize != "error" else "resize",
            max_bad_fraction=float(data.max_bad_fraction),
            allow_unlabelled=True,
            key="task.input",
        )
        return {k: Decoded(s.images, s.labels, s.classes, s.names, s.skipped) for k, s in sets.items()}

    def picture(self, samples, predicted, true, path: Path, inputs: dict[str, Any]) -> None:
        from onn.modalities.image.pictures import write_grid

        write_grid(samples, predicted, true, path)
