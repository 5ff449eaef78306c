"""Audio: sound classification from folders of recordings, decoded once, log-mels computed on the device.

The audio modality: WAV/FLAC/OGG/Opus/MP3 through soundfile and M4A/AAC/... through PyAV
(onn/modalities/audio/decode.py), labels from class folders, a regex on the file names or a manifest
(onn/data/labelled.py), a float16 waveform store on the device (dataset.py), log-mel features with
SpecAugment-style augmentation on the batch (features.py), ONN's audio CNN or any timm model on the
1-channel spectrogram, and a grid of predicted spectrograms.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from onn.config import ONNConfig
from onn.config.data import AudioData
from onn.config.model import NetworkConfig
from onn.data.labelled import sniff_files
from onn.errors import UserError
from onn.modalities.audio.decode import SUFFIXES
from onn.modalities.base import MediaModality, RunConfig

if TYPE_CHECKING:
    import torch

SILENCE_READERS = frozenset({"audio_rnn"})  # zoo networks that find each clip's sound by its silent floor
STREAMED_STATS_ITEMS = 256  # training recordings a streamed dataset's normalize=dataset statistics are measured on


def streamed_sample(dm) -> torch.Tensor:
    """Up to STREAMED_STATS_ITEMS of a streamed dataset's training waveforms (a seeded pick, the same on every
    rank), decoded here: normalize=dataset measures its statistics on them, as on a resident store's."""
    import torch

    items, index = dm.streamed["train"]
    picks = torch.randperm(len(index), generator=torch.Generator().manual_seed(0))[:STREAMED_STATS_ITEMS]
    waves = [w for w in (items.load(index[int(i)]) for i in picks) if w is not None]  # None: it decodes no more
    if not waves:
        raise UserError(
            f"data.features.normalize=dataset: none of the {len(picks)} training recordings of data.source picked to "
            "measure its statistics decodes any more; restore the files, or set data.features.normalize=instance."
        )
    return torch.stack(waves)


class AudioModality(MediaModality):
    name = "audio"
    data_schema = AudioData
    dataset = "onn.modalities.audio.dataset"
    default_data = "audio"
    default_model = "audio_cnn"
    description = "audio classification"
    stored_dtype = "float16"
    sniff_priority = 1  # file extensions say it: asked before the image sniffer reads magic bytes

    def sniff(self, path: Path) -> str | None:
        return sniff_files(path, SUFFIXES, "audio", "an audio file")

    def check(self, config: ONNConfig) -> None:
        from onn.modalities.audio.decode import fit_settings
        from onn.modalities.audio.features import augment_settings, feature_settings
        from onn.models.zoo.registry import PICTURES

        data: AudioData = config.data
        model: NetworkConfig = config.model
        fit_settings(data)
        feature_settings(data)
        augment_settings(data.augment)
        source = str(model.source or "")
        kind, _, name = source.partition(":")
        if (kind not in ("zoo", "timm") and ".py:" not in source) or (kind == "zoo" and name not in PICTURES):
            raise UserError(
                f"model={model.name} ({source or 'no source'}) does not take spectrograms; audio data trains "
                "zoo:audio_cnn (model=audio_cnn), zoo:audio_rnn (model=audio_lstm), an image network from timm "
                "(e.g. model=resnet18) or your own file.py:function."
            )
        if name in SILENCE_READERS and data.features.normalize == "instance":
            raise UserError(
                f"model={model.name} finds each clip's sound by its silent floor, which data.features.normalize="
                "instance removes; set data.features.normalize=none (the network normalises over the sound itself)."
            )

    def datamodule(self, config: ONNConfig, device: str):
        from onn.data.media import trained_fit
        from onn.modalities.audio.dataset import READER, AudioDataModule
        from onn.training.classifier import trained_config

        dm = AudioDataModule(config.data, config.paths.cache, device, seed=int(config.seed))
        dm.fit = trained_fit(READER, config.data, trained_config(config), config.ckpt)  # with ckpt=, the model's
        return dm

    def network(self, model_cfg: NetworkConfig, inputs: dict[str, Any]):
        from onn.models.vision import build_classifier

        features = inputs["features"]
        frames = features["clip_samples"] // features["hop_length"] + 1
        return build_classifier(
            model_cfg, inputs["input_shape"][0], len(inputs["classes"]), [features["n_mels"], frames]
        )

    def transform(self, config: RunConfig, inputs: dict[str, Any]):
        from onn.modalities.audio.features import LogMel

        return LogMel(inputs["features"], config.data.augment, inputs["mean"], inputs["std"])

    def input_stats(self, config: ONNConfig, dm) -> dict[str, Any]:
        from onn.modalities.audio.features import LogMel, measure_stats

        settings = self._settings(config.data)
        mean, std = 0.0, 1.0
        if settings["features"]["normalize"] == "dataset":
            waves = streamed_sample(dm) if dm.streamed else dm.splits["train"].inputs
            mean, std = measure_stats(LogMel(settings["features"], None), waves)
        return {**settings, "mean": mean, "std": std}

    def neutral_stats(self, inputs: dict[str, Any]) -> dict[str, Any]:
        return {"mean": 0.0, "std": 1.0}

    def planned_inputs(self, config: RunConfig) -> dict[str, Any]:
        from onn.training.classifier import trained_config

        saved = trained_config(config)
        if saved is not None:  # the checkpoint's network: what eval, infer and a resumed run build
            return saved["inputs"]
        data: AudioData = config.data
        settings = self._settings(data)
        classes = data.classes or [str(i) for i in range(data.num_classes if isinstance(data.num_classes, int) else 10)]
        return {
            "classes": [str(c) for c in classes],
            "input_shape": [settings["fit"]["channels"], settings["fit"]["samples"]],
            **settings,
        }

    def picture(self, samples, predicted, true, path: Path, inputs: dict[str, Any]) -> None:
        from onn.modalities.audio import pictures
        from onn.modalities.audio.features import LogMel

        pictures.write(samples, predicted, true, path, LogMel(inputs["features"], None), inputs)

    @staticmethod
    def _settings(data: AudioData) -> dict[str, Any]:
        """What decodes and featurises this data: saved in every checkpoint's `inputs`."""
        from dataclasses import asdict

        from onn.modalities.audio.decode import fit_settings
        from onn.modalities.audio.features import feature_settings

        return {"fit": asdict(fit_settings(data)), "features": feature_settings(data)}
