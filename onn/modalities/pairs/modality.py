"""Paired data: two modalities whose files belong together, learned as a dual encoder (CLIP-style).

The pairs modality. It finds pairs by itself (onn/modalities/pairs/detect.py): files that
share a stem (`0001.jpg` + `0001.txt`, `clip7.wav` + `clip7.obj`; webdataset's convention, also
inside tar shards) or a metadata.jsonl/.csv with file_name and a caption (Hugging Face's
imagefolder convention). Each side is the encoder its modality brings (Modality.pair_side: the
image CNNs, the point-cloud network, any classifier modality registered later such as audio) or,
for captions, the zoo's byte-level text encoder (sides.py). Training is a symmetric contrastive
loss with a learnable temperature (module.py); the metric is retrieval recall@1/@5 in both
directions on held-out pairs; inference ranks a folder of one side against queries of the other.
"""

from __future__ import annotations

from pathlib import Path

from onn.config import ONNConfig
from onn.config.data import PairsData
from onn.config.model import DualEncoderConfig
from onn.errors import UserError
from onn.modalities.base import Modality


class PairsModality(Modality):
    name = "pairs"
    data_schema = PairsData
    model_schema = DualEncoderConfig
    implementation = "onn.modalities.pairs.tasks"
    default_data = "pairs"
    default_model = "dual_encoder"
    description = "paired data (a dual encoder of two modalities)"
    several_graphs = True  # one per side
    sniff_priority = 10  # a folder of pairs also holds images (or meshes, or text): pairs are the more specific reading

    def sniff(self, path: Path) -> str | None:
        from onn.modalities.pairs.detect import SNIFF_FILES, UnreadableMetadata, find_pairs

        if str(path).startswith("builtin:") or not (
            path.is_dir() or path.suffix.lower() in (".tar", ".gz", ".tgz", ".jsonl", ".csv")
        ):
            return None
        try:
            listing = find_pairs(path, limit=SNIFF_FILES)
        except UnreadableMetadata:
            raise  # the folder's metadata file names pairs: reading the folder as another modality would hide it
        except (UserError, OSError):
            return None
        items = listing.complete * 2 + listing.orphan_count + len(listing.left_out)
        if (
            listing.complete < 2 or listing.complete * 2 < 0.1 * items
        ):  # a few sidecar files in an image folder are not pairs
            return None
        return listing.summary()

    def check(self, config: ONNConfig) -> None:
        from onn.modalities.pairs.detect import wanted_modalities
        from onn.modalities.pairs.sides import TEXT, registered

        data: PairsData = config.data
        for name in wanted_modalities(data.modalities) or ():
            if name != TEXT:
                registered(name)
        model = config.model
        if not isinstance(model, DualEncoderConfig):
            raise UserError(f"model={model.name} is not a dual encoder: use model=dual_encoder with paired data.")
        for key in ("feature_dim", "embed_dim"):
            if getattr(model, key) < 1:
                raise UserError(f"model.{key}={getattr(model, key)!r}: give a whole number of dimensions, 1 or more.")
        for key in ("temperature", "max_logit_scale"):
            if not getattr(model, key) > 0:
                raise UserError(f"model.{key}={getattr(model, key)!r}: give a number above 0.")
        if data.val_source is not None and config.task.name != "eval":
            raise UserError(
                f"data.val_source={data.val_source} is what task=eval of paired data scores (every pair of it); "
                "training holds out data.val_split of data.source: leave data.val_source unset."
            )
        if data.batch_size < 2:
            raise UserError(f"data.batch_size={data.batch_size!r}: a contrastive batch needs 2 pairs or more.")
        check_numbers(data, config.task.name)
        check_sides(config)
        if config.strategy.name not in ("auto", "full"):
            raise UserError(f"strategy={config.strategy.name}: a dual encoder trains with strategy=full (or auto).")
        if config.export.name == "omny":
            raise UserError(
                "export=omny is not available for a dual encoder; export=onnx writes one ONNX file per side."
            )
        if config.task.name == "infer" and config.task.top_k < 1:
            raise UserError(
                f"task.top_k={config.task.top_k!r}: give the number of matches to keep per query, 1 or more."
            )


def check_sides(config: ONNConfig) -> None:
    """Side settings a pair cannot honour, refused rather than ignored: an audio side's normalize=dataset needs
    statistics measured on the training split, which nothing measures for a side (it fed the tower raw dB). Only
    for an audio side the pair may use: settings of sides it does not use are not read."""
    from onn.config.data import AudioData
    from onn.modalities.pairs.detect import wanted_modalities
    from onn.modalities.pairs.sides import side_config

    if "audio" not in config.data.sides or "audio" not in (wanted_modalities(config.data.modalities) or ("audio",)):
        return
    data = side_config("audio", config).data
    if isinstance(data, AudioData) and data.features.normalize == "dataset":
        raise UserError(
            "data.sides.audio.features.normalize=dataset is not available for a side of a pair (nothing measures "
            "the training clips' statistics); use instance (or none)."
        )


def check_numbers(data: PairsData, task: str) -> None:
    """The fractions and the evaluation batch, before the pairs are decoded: a data.val_split outside (0, 1) was
    said once every pair had been read, a negative data.max_bad_fraction failed a source of readable pairs as "0 of
    12 pairs cannot be read", and a data.eval_batch_size below 1 embedded nothing (a gallery "could not be read")."""
    if task == "train" and not 0 < data.val_split < 1:
        raise UserError(
            f"data.val_split={data.val_split!r}: give the fraction of the pairs held out to measure retrieval, "
            "above 0 and below 1."
        )
    if not 0 <= data.max_bad_fraction <= 1:
        raise UserError(f"data.max_bad_fraction={data.max_bad_fraction!r}: give a fraction from 0 to 1.")
    if data.eval_batch_size is not None and data.eval_batch_size < 1:
        raise UserError(
            f"data.eval_batch_size={data.eval_batch_size!r}: give a number of pairs, 1 or more (or null: twice "
            "data.batch_size)."
        )
