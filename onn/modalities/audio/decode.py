"""Audio files -> float waveforms at one sample rate, channel count and length.

WAV, FLAC, OGG (Vorbis, Opus), MP3, AIFF and the other formats libsndfile reads go through soundfile,
whose wheel bundles libsndfile; M4A/AAC, WMA, MKA, AMR and anything soundfile refuses go through PyAV,
whose wheel bundles FFmpeg (torchaudio 2.11's own load() would need torchcodec and a system FFmpeg).
A file that neither can decode, that is empty or that holds no audio is a `BadFile` naming why; the
caller skips it and counts it against data.max_bad_fraction.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import IO

import numpy as np
import torch

from onn.config.data import AudioData
from onn.data.media import BadFile, decoder_complaint, nonempty
from onn.errors import UserError

# the files the audio decoder reads (the sniffer and the listings go by them)
SUFFIXES = frozenset(
    {
        ".wav",
        ".wave",
        ".flac",
        ".ogg",
        ".oga",
        ".opus",
        ".mp3",
        ".aiff",
        ".aif",
        ".aifc",
        ".au",
        ".snd",
        ".caf",
        ".w64",
        ".rf64",
        ".m4a",
        ".aac",
        ".mka",
        ".wma",
        ".amr",
        ".ac3",
        ".mp2",
        ".alac",
        ".weba",
    }
)


FLOAT16_MAX = 65504.0  # the largest float16, the dtype audio is stored in (dataset.DTYPE)


@dataclass(frozen=True)
class Fit:
    """How every waveform is brought to one shape: the sample rate, the channels, the stored length."""

    sample_rate: int
    channels: int  # 1: mix down; N: keep N (a mono file is repeated)
    samples: int  # the stored length: longer files are centre-cropped, shorter ones padded with silence around them


def fit_settings(data_cfg: AudioData) -> Fit:
    """The data config's decoding settings, checked: a value that makes no sense is one error naming its key."""
    rate, channels, clip = data_cfg.sample_rate, data_cfg.channels, data_cfg.clip_seconds
    stored = data_cfg.store_seconds if data_cfg.store_seconds is not None else clip
    if isinstance(rate, bool) or not isinstance(rate, int) or not 1000 <= rate <= 384_000:
        raise UserError(
            f"data.sample_rate={rate!r}: give the rate to resample to in Hz, "
            "a whole number from 1000 to 384000 (e.g. 16000)."
        )
    if isinstance(channels, bool) or not isinstance(channels, int) or not 1 <= channels <= 32:
        raise UserError(f"data.channels={channels!r}: give 1 (mix down to mono) or the number of channels to keep.")
    for name, value in (("clip_seconds", clip), ("store_seconds", stored)):
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not 0 < value <= 3600
            or not math.isfinite(value)
        ):
            raise UserError(f"data.{name}={value!r}: give a length in seconds above 0 (e.g. 1.0).")
    if stored < clip:
        raise UserError(
            f"data.store_seconds={stored} is shorter than data.clip_seconds={clip}; keep at least a clip (or null)."
        )
    samples = round(float(stored) * rate)
    if round(float(clip) * rate) < 16:
        raise UserError(
            f"data.clip_seconds={clip} at data.sample_rate={rate} is {round(float(clip) * rate)} samples; "
            "give a longer clip."
        )
    return Fit(rate, channels, samples)


def decode_audio(source: str | IO[bytes]) -> tuple[np.ndarray, int]:
    """(float32 [channels, samples] in [-1, 1], sample rate) of a file path or a binary file object. A float file
    whose samples reach past float16's largest value (65504) is scaled to a peak of 1, its sound kept."""
    import soundfile as sf

    source = nonempty(source)
    if isinstance(source, bytes):
        source = io.BytesIO(source)
    try:
        wave, rate = sf.read(source, dtype="float32", always_2d=True)
        wave = wave.T
    except (sf.LibsndfileError, RuntimeError, ValueError, TypeError) as first:
        if not isinstance(source, str):
            source.seek(0)
        try:
            wave, rate = _decode_ffmpeg(source)
        except BadFile:
            raise
        except Exception as e:  # PyAV raises FFmpegError subclasses, and ValueError/OSError for odd inputs
            raise BadFile(
                f"not decodable audio (libsndfile: {decoder_complaint(first)}; FFmpeg: {decoder_complaint(e)})"
            ) from e
    if wave.shape[1] == 0:
        raise BadFile("no audio samples (a header and nothing after it)")
    if not np.isfinite(wave).all():
        raise BadFile("samples that are not finite numbers (NaN or infinity)")
    peak = float(np.abs(wave).max())
    if peak > FLOAT16_MAX:  # a float file far outside ±1: the float16 store would hold infinities, the loss NaN
        wave = wave / peak
    return np.ascontiguousarray(wave), int(rate)


def _decode_ffmpeg(source: str | IO[bytes]) -> tuple[np.ndarray, int]:
    import av

    with av.open(source) as container:
        if not container.streams.audio:
            raise BadFile("no audio stream" + (" (a video without sound)" if container.streams.video else ""))
        stream = container.streams.audio[0]
        rate = stream.rate or stream.codec_context.sample_rate
        if not rate:
            raise BadFile("an audio stream without a sample rate")
        resampler = av.AudioResampler(format="fltp", layout=stream.layout.name if stream.layout else None, rate=rate)
        chunks = [out.to_ndarray() for frame in container.decode(stream) for out in resampler.resample(frame)]
        chunks += [out.to_ndarray() for out in resampler.resample(None)]
    if not chunks:
        raise BadFile("an audio stream with no samples")
    return np.concatenate(chunks, axis=1).astype(np.float32, copy=False), int(rate)


def fit_waveform(wave: np.ndarray, rate: int, fit: Fit) -> torch.Tensor:
    """float32 [channels, samples] at `rate` -> float32 [fit.channels, fit.samples] at fit.sample_rate:
    resampled with torchaudio's windowed-sinc resampler, mixed down or channel-matched, centre-cropped or
    padded with silence on both sides."""
    x = torch.from_numpy(wave)
    have = x.shape[0]
    if fit.channels == 1:
        x = x.mean(0, keepdim=True)
    elif have == 1:
        x = x.expand(fit.channels, -1)
    elif have >= fit.channels:
        x = x[: fit.channels]
    else:
        raise BadFile(f"{have} channels, fewer than data.channels={fit.channels}")
    if rate != fit.sample_rate:
        import torchaudio.functional as AF

        x = AF.resample(x.contiguous(), rate, fit.sample_rate)
    n = x.shape[1]
    if n >= fit.samples:
        start = (n - fit.samples) // 2
        return x[:, start : start + fit.samples].contiguous()
    out = torch.zeros(fit.channels, fit.samples)
    start = (fit.samples - n) // 2
    out[:, start : start + n] = x
    return out


def load(source: str | IO[bytes], fit: Fit) -> tuple[torch.Tensor, float]:
    """One file decoded and fitted, and its duration in seconds (for throughput figures)."""
    wave, rate = decode_audio(source)
    return fit_waveform(wave, rate, fit), wave.shape[1] / rate
