"""Log-mel spectrograms of a waveform batch, on the compute device, with augmentation for training.

The stored batch is float16 [B, channels, samples] (data.store_seconds long). For training each sample
gets its own random clip_seconds window (a seeded random crop; evaluation takes the centre), its
recording ended early by a random fraction (a word cut short), a random shift padded with silence, a
random speed (pitch, formants and tempo together, as another voice), white noise over the recording at
a random signal-to-noise ratio (noisier rooms and microphones) and a random gain; then its log-mel
spectrogram (torchaudio.transforms), a random warp of the frequency and time axes, and
SpecAugment's frequency and time masks. Log-mels are in dB, each sample's floor `top_db` below its own
peak (so a batch's loudest sample does not set the floor of the others), then normalised: `instance`
takes out each mel band's mean over the clip and scales by the clip's deviation (speaker and microphone
colour go), `dataset` uses the training data's mean and deviation, `none` leaves dB. Output: float32
[B, channels, n_mels, frames], the network's input (ONNX export traces this, evaluation's form, in front of it).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from onn.config import as_dict
from onn.config.data import AudioAugment, AudioData
from onn.errors import UserError

NORMALIZE = ("instance", "dataset", "none")


def feature_settings(data_cfg: AudioData) -> dict[str, Any]:
    """The data config's log-mel settings, checked; what `inputs` keeps (plain values) so a checkpoint computes
    the same features."""
    f = data_cfg.features
    rate = int(data_cfg.sample_rate)
    for key, value in (("n_mels", f.n_mels), ("n_fft", f.n_fft), ("hop_length", f.hop_length)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"data.features.{key}={value!r}: give a whole number of 1 or more.")
    if f.hop_length > f.n_fft:
        raise UserError(
            f"data.features.hop_length={f.hop_length} is longer than n_fft={f.n_fft}: frames would skip samples."
        )
    f_max = f.f_max if f.f_max is not None else rate / 2
    if not 0 <= float(f.f_min) < float(f_max) <= rate / 2:
        raise UserError(
            f"data.features.f_min={f.f_min} / f_max={f.f_max}: give 0 <= f_min < f_max <= "
            f"data.sample_rate / 2 = {rate / 2:g} Hz."
        )
    top_db = f.top_db
    if isinstance(top_db, bool) or not isinstance(top_db, int | float) or not 0 < top_db < float("inf"):
        # at 0 or below, every bin is clamped to the clip's peak: a constant picture
        raise UserError(
            f"data.features.top_db={top_db!r}: give a positive number of dB below each clip's peak (e.g. 80)."
        )
    if f.normalize not in NORMALIZE:
        raise UserError(f"data.features.normalize={f.normalize!r}: use one of {', '.join(NORMALIZE)}.")
    clip = round(float(data_cfg.clip_seconds) * rate)
    if clip < f.n_fft // 2 + 1:
        raise UserError(
            f"data.clip_seconds={data_cfg.clip_seconds} is {clip} samples at {rate} Hz, shorter than half of "
            f"data.features.n_fft={f.n_fft}; give a longer clip or a smaller n_fft."
        )
    return {
        **as_dict(f),
        "f_max": float(f_max),
        "f_min": float(f.f_min),
        "top_db": float(f.top_db),
        "sample_rate": rate,
        "clip_samples": clip,
    }


def augment_settings(cfg: AudioAugment | None) -> AudioAugment:
    """data.augment checked, each value a float (null: every step off, as each 0 turns one off)."""
    out = as_dict(cfg if cfg is not None else AudioAugment())
    for key, value in out.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise UserError(f"data.augment.{key}={value!r}: give a number of 0 or more (0 turns it off).")
        out[key] = float(value)
    for key in ("truncate", "speed", "freq_warp", "time_warp"):
        if out[key] >= 1:
            raise UserError(f"data.augment.{key}={out[key]}: give a fraction below 1 (0.1 changes by up to 10%).")
    if out["masks"] != int(out["masks"]):
        raise UserError(f"data.augment.masks={out['masks']}: give a whole number of masks per axis.")
    return AudioAugment(**out)


class LogMel:
    """Stored waveforms -> (augmented) normalised log-mels; one callable for training, evaluation and plan."""

    def __init__(self, settings: dict[str, Any], augment: AudioAugment | None, mean: float = 0.0, std: float = 1.0):
        self.s = settings  # feature_settings: a checkpoint's inputs["features"]
        self.augment = augment_settings(augment)
        self.mean, self.std = float(mean), float(std)
        self._mels: dict[torch.device, torch.nn.Module] = {}

    def frames(self) -> int:
        return self.s["clip_samples"] // self.s["hop_length"] + 1

    def _mel(self, device: torch.device) -> torch.nn.Module:
        if device not in self._mels:  # the filter bank and window, made once per device
            import torchaudio.transforms as T

            s = self.s
            self._mels[device] = T.MelSpectrogram(
                s["sample_rate"],
                n_fft=s["n_fft"],
                hop_length=s["hop_length"],
                n_mels=s["n_mels"],
                f_min=s["f_min"],
                f_max=s["f_max"],
                power=2.0,
            ).to(device)
        return self._mels[device]

    def __call__(self, waves: torch.Tensor, train: bool, normalize: bool = True) -> torch.Tensor:
        if waves.dim() != 3:
            raise ValueError(f"LogMel expects a [B, channels, samples] batch, got {tuple(waves.shape)}")
        x = waves.float()
        a = self.augment
        if train and a.truncate:
            x = self._truncate(x)
        x = self._window(x, train)
        if train and a.noise_snr_db:
            x = self._noise(x)
        if train and a.gain_db:
            gain = torch.empty(x.shape[0], 1, 1, device=x.device).uniform_(-a.gain_db, a.gain_db)
            x = x * torch.pow(10.0, gain / 20)
        power = self._mel(x.device)(x)  # [B, C, n_mels, frames]
        db = 10 * torch.log10(power.clamp_min(1e-10))
        peak = db.amax(dim=(-3, -2, -1), keepdim=True)
        db = torch.maximum(db, peak - self.s["top_db"])
        if normalize:
            db = self._normalize(db)
        if train:
            db = self._warp(db)
            db = self._mask(db)
        return db

    def _window(self, x: torch.Tensor, train: bool) -> torch.Tensor:
        """The clip_samples window: the centre one in evaluation; in training a random one per sample (a
        random start, a random shift with silence filling the gap), played at a random speed (pitch, formants
        and tempo together, as another voice would), read by linear interpolation."""
        b, _, n = x.shape
        clip, a = self.s["clip_samples"], self.augment
        if not train:
            start = (n - clip) // 2
            return x if n == clip else x[:, :, start : start + clip]
        shift = round(a.shift_seconds * self.s["sample_rate"])
        if n == clip and not shift and not a.speed:
            return x
        dev = x.device
        start = torch.randint(0, n - clip + 1, (b, 1), device=dev).float()
        if shift:
            start = start + torch.randint(-shift, shift + 1, (b, 1), device=dev)
        offsets = torch.arange(clip, device=dev).float() - clip / 2
        if a.speed:
            offsets = offsets * torch.empty(b, 1, device=dev).uniform_(1 - a.speed, 1 + a.speed)
        position = start + clip / 2 + offsets  # [B, clip], fractional sample positions
        left = position.floor()
        weight = (position - left).unsqueeze(1)
        out = 0
        for index, w in ((left, 1 - weight), (left + 1, weight)):
            valid = ((index >= 0) & (index < n)).unsqueeze(1)
            picked = x.gather(2, index.clamp(0, n - 1).long().unsqueeze(1).expand(-1, x.shape[1], -1))
            out = out + picked * w * valid
        return out

    def _truncate(self, x: torch.Tensor) -> torch.Tensor:
        """End each recording early by a random fraction of its length, up to `truncate`, silence after it:
        a word cut short by a hurried speaker or a recorder. Held out, FSDD's nicolas (the last sound of
        most of his words cut off: "six" without its final "ks") read "six" as "eight" or "three"."""
        n = x.shape[-1]
        position = torch.arange(n, device=x.device)
        sound = (x != 0).any(dim=1)  # [B, n]: the store pads with exact silence
        first = torch.where(sound, position, n).amin(dim=-1)
        last = torch.where(sound, position, -1).amax(dim=-1)
        length = (last - first + 1).clamp_min(0).float()
        end = last + 1 - length * torch.rand(x.shape[0], device=x.device) * self.augment.truncate
        return x * (position < end.unsqueeze(-1)).unsqueeze(1)

    def _noise(self, x: torch.Tensor) -> torch.Tensor:
        """White noise over each recording (from its first to its last non-silent sample, not over the padding)
        at a random signal-to-noise ratio from noise_snr_db to 30 dB above it: noisier rooms and microphones."""
        sound = (x.abs() > 0).any(dim=1, keepdim=True)  # [B, 1, n]
        inside = (sound.cumsum(-1) > 0) & (sound.flip(-1).cumsum(-1).flip(-1) > 0)
        power = (x * x).sum(dim=(1, 2), keepdim=True) / (inside.sum(dim=(1, 2), keepdim=True) * x.shape[1]).clamp_min(1)
        snr = torch.empty(x.shape[0], 1, 1, device=x.device).uniform_(0, 30) + self.augment.noise_snr_db
        return x + torch.randn_like(x) * (power / torch.pow(10.0, snr / 10)).sqrt() * inside

    def _normalize(self, db: torch.Tensor) -> torch.Tensor:
        mode = self.s["normalize"]
        if mode == "instance":
            db = db - db.mean(
                dim=-1, keepdim=True
            )  # each band's mean over the clip: the speaker's and microphone's colour
            return db / db.std(dim=(-3, -2, -1), keepdim=True).clamp_min(1e-3)
        if mode == "dataset":
            return (db - self.mean) / self.std
        return db

    def _warp(self, x: torch.Tensor) -> torch.Tensor:
        """Stretch each sample's frequency axis (from its low edge) and time axis (about the centre) by its
        own random factor; bilinear, the edge row repeated where the stretch reads past the top."""
        fw, tw = self.augment.freq_warp, self.augment.time_warp
        if not (fw or tw):
            return x
        b, c, h, w = x.shape
        freq = torch.empty(b, device=x.device).uniform_(1 - fw, 1 + fw)
        time = torch.empty(b, device=x.device).uniform_(1 - tw, 1 + tw)
        theta = torch.zeros(b, 2, 3, device=x.device)
        theta[:, 0, 0], theta[:, 1, 1], theta[:, 1, 2] = time, freq, freq - 1  # y' = -1 + (y + 1) * freq
        grid = F.affine_grid(theta, [b, c, h, w], align_corners=False)
        return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)

    def _mask(self, x: torch.Tensor) -> torch.Tensor:
        """SpecAugment: `masks` frequency bands of up to freq_mask mels and time spans of up to time_mask
        frames, each sample its own, set to the sample's mean; in dB (normalize=none) to its floor, silence, so a
        masked band does not read as sound in the silence around a word (model=audio_lstm finds the sound by it)."""
        a = self.augment
        count = int(a.masks)
        if not count or not (a.freq_mask or a.time_mask):
            return x
        b, _, h, w = x.shape
        reduce = torch.amin if self.s["normalize"] == "none" else torch.mean
        fill = reduce(x, dim=(-3, -2, -1), keepdim=True)
        keep = torch.ones(b, 1, h, w, dtype=torch.bool, device=x.device)
        for axis, size, limit in ((2, a.freq_mask, h), (3, a.time_mask, w)):
            if not size:
                continue
            for _ in range(count):
                width = (torch.rand(b, device=x.device) * (min(size, limit) + 1)).floor()
                start = (torch.rand(b, device=x.device) * (limit - width + 1)).floor()
                span = torch.arange(limit, device=x.device).view(1, -1)
                hit = (span >= start.view(-1, 1)) & (span < (start + width).view(-1, 1))  # [B, limit]
                keep &= ~(hit.view(b, 1, limit, 1) if axis == 2 else hit.view(b, 1, 1, limit))
        return torch.where(keep, x, fill)


def measure_stats(transform: LogMel, waves: torch.Tensor) -> tuple[float, float]:
    """Mean and deviation of the training data's log-mels (dB), over up to 2,000 samples in chunks."""
    picks = torch.randperm(len(waves), generator=torch.Generator().manual_seed(0))[:2000].to(waves.device)
    total, squares, count = 0.0, 0.0, 0
    for chunk in picks.split(256):
        db = transform(waves[chunk], train=False, normalize=False).double()
        total += float(db.sum())
        squares += float((db * db).sum())
        count += db.numel()
    mean = total / count
    return round(mean, 4), round(math.sqrt(max(squares / count - mean * mean, 1e-6)), 4)
