"""Video: clip classification from folders of videos, decoded once, sampled and augmented on the device.

The video modality: mp4/mov/avi/mkv/webm/... through PyAV (onn/modalities/video/decode.py:
frames sampled evenly in time, rotation applied, any frame size and bit depth), labels from class
folders, a regex on the file names or a manifest (onn/data/labelled.py), a uint8 clip store on the device
(dataset.py), temporal sampling and augmentation the same for every frame of a clip (transform.py),
torchvision's video ResNets, ONN's tiny 3-D CNN or a timm image model per frame with temporal pooling
(onn/models/video.py), a generated motion dataset (`builtin:motion`, builtin.py), and strips of the
predicted clips' frames.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from onn.config import ONNConfig
from onn.config.data import VideoData
from onn.config.model import NetworkConfig
from onn.data.files import archive_kind, walk_files
from onn.data.labelled import sniff_files
from onn.errors import UserError
from onn.modalities.base import MediaModality, RunConfig
from onn.modalities.video.decode import SUFFIXES

TRANSPORT_PACKETS = (188, 192)  # MPEG-TS packets (192: M2TS/AVCHD, a timecode before each), opening with byte 0x47


def _transport_streams(path: Path) -> bool:
    """Whether the first .ts file at `path` (a file or a folder) is an MPEG transport stream rather than TypeScript
    source, which shares the suffix: three packets in a row open with the sync byte, from any offset in the first
    packet (a capture cut at an arbitrary byte starts mid-packet). Archives keep the names' vote, and so does a file
    that cannot be read (the decoder then says why)."""
    first = path if path.is_file() else next((p for _, p in walk_files(path) if p.suffix.lower() == ".ts"), None)
    if first is None or archive_kind(first) is not None:
        return True
    try:
        with open(first, "rb") as f:
            head = f.read(3 * max(TRANSPORT_PACKETS) + max(TRANSPORT_PACKETS))
    except OSError:
        return True
    if len(head) < 3 * min(TRANSPORT_PACKETS):  # a clip shorter than three packets: one sync byte says it
        return head[:1] == b"\x47"
    return any(
        all(start + i * size < len(head) and head[start + i * size] == 0x47 for i in range(3))
        for size in TRANSPORT_PACKETS
        for start in range(size)
    )


class VideoModality(MediaModality):
    name = "video"
    data_schema = VideoData
    dataset = "onn.modalities.video.dataset"
    default_data = "video"
    default_model = "video_c3d_tiny"
    description = "video classification"
    builtins = ("motion",)
    stored_dtype = "uint8"
    sniff_priority = 1  # file extensions say it: asked before the image sniffer reads magic bytes

    def sniff(self, path: Path) -> str | None:
        found = sniff_files(path, SUFFIXES, "video", "a video file")
        if found is None or sniff_files(path, SUFFIXES - {".ts"}, "video", "a video file") is not None:
            return found
        return found if _transport_streams(path) else None  # the vote hung on .ts files: video, or TypeScript?

    def check(self, config: ONNConfig) -> None:
        from onn.modalities.video.decode import fit_settings
        from onn.modalities.video.transform import ClipTransform
        from onn.models.zoo.registry import VIDEO

        data: VideoData = config.data
        model: NetworkConfig = config.model
        fit = fit_settings(data)
        ClipTransform(data.augment, [0.5] * fit.channels, [0.5] * fit.channels, data.frames, data.sampling)
        source = str(model.source or "")
        kind, _, name = source.partition(":")
        if kind not in ("torchvision", "zoo", "timm") or (kind == "zoo" and name not in VIDEO):
            raise UserError(
                f"model={model.name} ({source or 'no source'}) does not take clips; video data trains "
                "model=video_c3d_tiny, video_r3d_18, video_r2plus1d, video_mc3_18 or video_frames_resnet18."
            )
        if model.channels_last:
            raise UserError(
                "model.channels_last=true does not apply to clips [B, C, T, H, W]; set model.channels_last=false."
            )

    def datamodule(self, config: ONNConfig, device: str):
        from onn.data.media import trained_fit
        from onn.modalities.video.dataset import READER, VideoDataModule
        from onn.training.classifier import trained_config

        dm = VideoDataModule(config.data, config.paths.cache, device, seed=int(config.seed))
        dm.fit = trained_fit(READER, config.data, trained_config(config), config.ckpt)  # with ckpt=, the model's
        return dm

    def network(self, model_cfg: NetworkConfig, inputs: dict[str, Any]):
        from onn.models.video import build_video_classifier

        channels, _, height, width = inputs["input_shape"]
        return build_video_classifier(model_cfg, channels, len(inputs["classes"]), inputs["frames"], [height, width])

    def transform(self, config: RunConfig, inputs: dict[str, Any]):
        from onn.modalities.video.transform import ClipTransform

        data: VideoData = config.data
        return ClipTransform(data.augment, inputs["mean"], inputs["std"], inputs["frames"], data.sampling)

    def input_stats(self, config: ONNConfig, dm) -> dict[str, Any]:
        from onn.modalities.video.transform import measure_stats

        data: VideoData = config.data
        settings = self._settings(data)
        mean, std = data.mean, data.std
        if mean in (None, "auto") or std in (None, "auto"):
            channels = settings["fit"]["channels"]
            mean, std = (
                ([0.5] * channels, [0.25] * channels) if dm.streamed else measure_stats(dm.splits["train"].inputs)
            )
        return {**settings, "mean": [float(v) for v in mean], "std": [float(v) for v in std]}

    def neutral_stats(self, inputs: dict[str, Any]) -> dict[str, Any]:
        channels = inputs["input_shape"][0]
        return {"mean": [0.5] * channels, "std": [0.25] * channels}

    def planned_inputs(self, config: RunConfig) -> dict[str, Any]:
        from onn.training.classifier import trained_config

        saved = trained_config(config)
        if saved is not None:  # the checkpoint's network: what eval, infer and a resumed run build
            return saved["inputs"]
        data: VideoData = config.data
        settings = self._settings(data)
        fit = settings["fit"]
        classes = data.classes or [str(i) for i in range(data.num_classes if isinstance(data.num_classes, int) else 10)]
        return {
            "classes": [str(c) for c in classes],
            "input_shape": [fit["channels"], fit["frames"], *fit["size"]],
            **settings,
        }

    def picture(self, samples, predicted, true, path: Path, inputs: dict[str, Any]) -> None:
        from onn.modalities.video import pictures

        pictures.write(samples, predicted, true, path)

    @staticmethod
    def _settings(data: VideoData) -> dict[str, Any]:
        """What decodes this data and what the network sees: saved in every checkpoint's `inputs`."""
        from dataclasses import asdict

        from onn.modalities.video.decode import fit_settings

        fit = asdict(fit_settings(data))
        return {"fit": {**fit, "size": list(fit["size"])}, "frames": int(data.frames)}
