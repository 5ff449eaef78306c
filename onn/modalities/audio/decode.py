"""Audio files -> float waveforms at one sample rate, channel count and length.

WAV, FLAC, OGG (Vorbis, Opus), MP3, AIFF and the other formats libsndfile reads go through soundfile,
whose wheel bundles libsndfile; M4A/AAC, WMA, MKA, AMR, anything soundfile refuses, a long MP3/MP2 (whose length
libsndfile only estimates) and a WAV whose header lengths were never written go through PyAV, whose wheel bundles
FFmpeg (torchaudio 2.11's own load() would need torchcodec and a system FFmpeg). A file of one MPEG audio frame,
which neither opens, goes through FFmpeg's parser and decoder without a demuxer.
A file that neither can decode, that is empty or that holds no audio is a `BadFile` naming why; the
caller skips it and counts it against data.max_bad_fraction.
"""

from __future__ import annotations

import io
import itertools
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
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


RESAMPLER_MARGIN = 16  # per sample of the lower rate, input read past each end of a window (torchaudio's reaches 7)


def resampled_length(total: int, rate: int, new_rate: int) -> int:
    """How many samples torchaudio's resampler makes of `total` at `rate`."""
    return -(-total * new_rate // rate)


def window(total: int, rate: int, fit: Fit | None) -> tuple[int, int]:
    """(first sample, count) of a `total`-sample recording at `rate` that fit_waveform's centred clip is cut from:
    (0, total) where it starts at the beginning. It starts on a whole resampler period (rate / gcd) and reaches
    past the clip by the resampler's filter, so its resampled clip is the whole recording's."""
    if fit is None:
        return 0, total
    new = fit.sample_rate
    step = rate // math.gcd(rate, new)
    margin = step + RESAMPLER_MARGIN * math.ceil(rate / min(rate, new))
    first = (resampled_length(total, rate, new) - fit.samples) // 2  # the clip's first sample, resampled
    start = max(0, first * rate // new - margin) // step * step
    end = min(total, -(-(first + fit.samples) * rate // new) + margin)
    if first < 0 or start == 0:  # (a window always starts past 0: start 0 means the whole recording)
        return 0, total
    return start, end - start


def decode_audio(source: str | IO[bytes], fit: Fit | None = None) -> tuple[np.ndarray, int, int, int]:
    """(float32 [channels, samples] in [-1, 1], sample rate, the first sample's index, the recording's length in
    samples) of a file path or a binary file object. With `fit`, only the window of a long recording that its
    centred clip is cut from is decoded (an hour of 48 kHz stereo would be 1.4 GB of float32 per decoding thread).
    A float file whose samples reach past float16's largest value (65504) is scaled to a peak of 1."""
    import soundfile as sf

    source = nonempty(source)
    try:
        wave, rate, start, total = _decode_soundfile(source, fit)
    except (sf.LibsndfileError, RuntimeError, ValueError, TypeError) as first:
        try:
            wave, rate, start, total = _decode_ffmpeg(source, fit)
        except BadFile:
            raise
        except Exception as e:  # PyAV raises FFmpegError subclasses, and ValueError/OSError for odd inputs
            alone = _one_mpeg_frame(source)
            if alone is None:
                raise BadFile(
                    f"not decodable audio (libsndfile: {decoder_complaint(first)}; FFmpeg: {decoder_complaint(e)})"
                ) from e
            wave, rate, start, total = alone
    if wave.shape[1] == 0 and lengths_unwritten(_head(source, 12)):  # libsndfile read none, as its header says
        wave, rate, start, total = _read_past_header(source, fit) or (wave, rate, start, total)
    if wave.shape[1] == 0:
        raise BadFile("no audio samples (a header and nothing after it)")
    if not np.isfinite(wave).all():
        raise BadFile("samples that are not finite numbers (NaN or infinity)")
    peak = float(np.abs(wave).max())
    if peak > FLOAT16_MAX:  # a float file far outside ±1: the float16 store would hold infinities, the loss NaN
        wave = wave / peak
    return np.ascontiguousarray(wave), int(rate), start, total


# FFmpeg's decoder of each MPEG audio layer, by the frame header's two layer bits (0 is reserved)
MPEG_LAYER_DECODERS = {1: "mp3", 2: "mp2", 3: "mp1"}


def _one_mpeg_frame(source: str | bytes) -> tuple[np.ndarray, int, int, int] | None:
    """The samples of a file holding one MPEG audio frame (an MP2 or MP3 cut to its first frame: a click, a short
    effect), which FFmpeg's MPEG audio demuxer refuses (it opens a stream only where a second frame follows the
    first) and libsndfile's mpg123 too. FFmpeg's parser and decoder read the frame without a demuxer. None for a
    file that is not one MPEG audio frame (no frame sync first, longer than any frame) or that does not decode."""
    import av

    data, size = _head(source, MPEG_FRAME_BYTES)
    layer = (data[1] >> 1) & 3 if len(data) >= 4 else 0
    if layer not in MPEG_LAYER_DECODERS or size > MPEG_FRAME_BYTES or data[0] != 0xFF or data[1] & 0xE0 != 0xE0:
        return None
    codec = av.CodecContext.create(MPEG_LAYER_DECODERS[layer], "r")
    try:
        frames = [frame for packet in [*codec.parse(data), None] for frame in codec.decode(packet)]
        if not frames:
            return None
        resampler = av.AudioResampler(format="fltp", layout=frames[0].layout.name, rate=frames[0].rate)
        chunks = [out.to_ndarray() for frame in [*frames, None] for out in resampler.resample(frame)]
    except (av.FFmpegError, ValueError):  # a frame FFmpeg cannot convert: the caller's BadFile names both decoders
        return None
    wave = np.concatenate(chunks, axis=1).astype(np.float32, copy=False)
    return wave, frames[0].rate, 0, wave.shape[1]


def _read_past_header(source: str | bytes, fit: Fit | None) -> tuple[np.ndarray, int, int, int] | None:
    """The samples of a WAV whose recorder stopped before it wrote the header's lengths (a crash, a full card, a
    pipe: a data length of 0), in which libsndfile reads none: FFmpeg reads them to the end of the file. None where
    it finds none either (a header and nothing after it)."""
    try:
        return _decode_ffmpeg(source, fit)
    except Exception:  # BadFile, or PyAV's FFmpegError and ValueError/OSError: the caller names the file bad
        return None


def lengths_unwritten(head: tuple[bytes, int]) -> bool:
    """Whether a RIFF (WAV) or FORM (AIFF) file's header lengths were never written: its size field 0 or all ones, or
    less than the file holds (a recorder writes them last). A valid empty take (data of 0 bytes, its notes after) is
    none: FFmpeg read that LIST chunk's text as samples."""
    first, size = head
    if len(first) < 8 or first[:4] not in (b"RIFF", b"RF64", b"FORM"):
        return False
    declared = int.from_bytes(first[4:8], "little" if first[:4] != b"FORM" else "big")
    return declared in (0, 0xFFFFFFFF) or declared + 8 < size


def _head(source: str | bytes, count: int) -> tuple[bytes, int]:
    """A file's first `count` bytes and its size."""
    if isinstance(source, bytes):
        return source[:count], len(source)
    with open(source, "rb") as f:
        return f.read(count), os.fstat(f.fileno()).st_size


def estimated_length(source: str | bytes, subtype: str) -> bool:
    """Whether libsndfile's length of an MPEG audio file is an estimate from its bitrate: MP1 and MP2 always, an MP3
    without a Xing, Info or VBRI header in its first frame (which LAME and libsndfile write, and mpg123 counts by)."""
    if subtype != "MPEG_LAYER_III":
        return True
    first, _ = _head(source, 10)
    skip = 0
    if first[:3] == b"ID3" and len(first) == 10:  # an ID3v2 tag first: its size, 7 bits a byte
        skip = 10 + sum((b & 0x7F) << (7 * (3 - i)) for i, b in enumerate(first[6:10])) + (10 if first[5] & 0x10 else 0)
    frame = _head(source, skip + MPEG_FRAME_BYTES)[0][skip:]
    return not any(tag in frame for tag in (b"Xing", b"Info", b"VBRI"))


def _opened(source: str | bytes) -> str | IO[bytes]:
    return source if isinstance(source, str) else io.BytesIO(source)


# libsndfile's formats whose length (frames) is an estimate: MPEG audio (MP1/MP2/MP3), counted by mpg123 from the
# bitrate without a Xing/LAME header (an MP3 written without one, every MP2); 60 s of MP3 said 288 ms more than it
# decodes to, which put a long recording's centred clip 144 ms off its centre. FFmpeg's decoding windows these.
ESTIMATED_LENGTHS = frozenset({"MP3"})
MPEG_FRAME_BYTES = 2048  # past an MPEG audio frame's largest (1,441 bytes: 320 kbit/s at 32 kHz, padded)


def _decode_soundfile(source: str | bytes, fit: Fit | None) -> tuple[np.ndarray, int, int, int]:
    """(samples, rate, the first one's index, the recording's length) through libsndfile: the window `fit` needs."""
    import soundfile as sf

    with sf.SoundFile(_opened(source)) as f:
        rate, total = f.samplerate, f.frames
        start, count = window(total, rate, fit)
        if start and f.format in ESTIMATED_LENGTHS and estimated_length(source, f.subtype):  # FFmpeg's decoding
            # centres the window on the decoded length
            try:
                return _decode_ffmpeg(source, fit)
            except Exception:  # (PyAV's errors, BadFile) libsndfile's window, placed by its estimate, rather than none
                pass
        if start and not f.seekable():
            start, count = 0, -1
        f.seek(start)
        wave = f.read(count, dtype="float32", always_2d=True).T
    if start and wave.shape[1] < count:  # the header promised more than the file holds: read it whole
        return _decode_soundfile(source, None)
    return wave, rate, start, total if start else wave.shape[1]


@dataclass
class Packets:
    """How many of a stream's packets decoded, and how many did not (a damaged stretch of the file)."""

    decoded: int = 0
    damaged: int = 0


# kept either side of a window placed from an estimated duration: an estimate up to half a second off (the window
# moves by half the error) is cut from one pass, one further off is decoded again at the decoded length
ESTIMATE_SLACK_SECONDS = 0.25

# FFmpeg's demuxers that stamp every audio packet from an index, exactly (MP4/M4A/MOV: their sample tables)
STAMPED_DEMUXERS = frozenset({"mov"})
LAST_FRAMES_SECONDS = 1.0  # how far before the end the length's probe seeks


def _stamped_length(source: str | bytes, rate: int) -> int | None:
    """The samples a whole decode gives, from the frames' timestamps where the container stamps them in samples
    (STAMPED_DEMUXERS, time base 1 / rate): the last frame's end less the first frame's start, its codec's priming
    that an edit list drops and its last frame's padding counted as decoding counts them (its duration counts
    neither: an M4A's AAC said 1,024 samples more or up to 1,023 fewer). Read from the first frame and, after a
    seek, the last second's frames; None where they are not so stamped or none decode there (a file cut short)."""
    import av

    with av.open(_opened(source)) as container:
        stream = container.streams.audio[0]
        names = set(container.format.name.split(","))
        if names.isdisjoint(STAMPED_DEMUXERS) or stream.time_base != Fraction(1, rate) or not stream.duration:
            return None
        begin, last = stream.start_time or 0, None
        try:  # a file that will not seek is decoded to its end instead, as before
            first = next(_decoded(container, stream, Packets()), None)
            container.seek(max(begin, begin + stream.duration - round(LAST_FRAMES_SECONDS * rate)), stream=stream)
            for last in _decoded(container, stream, Packets()):  # noqa: B007 - the last one is wanted
                pass
        except av.FFmpegError:
            return None
    frames = (first, last)
    if any(f is None or f.pts is None or f.sample_rate != rate for f in frames):
        return None
    return last.pts + last.samples - first.pts


def _decode_ffmpeg(source: str | bytes, fit: Fit | None, known: int | None = None) -> tuple[np.ndarray, int, int, int]:
    """(samples, rate, the first one's index, the recording's length) through PyAV: the window `fit` needs.
    A stream's duration is often an estimate (ADTS AAC and MP3 without a Xing header: from the bitrate; Ogg: from
    its last page), tens of ms off, which would move the centred window off the centre of the decoded recording.
    So the stream is decoded to its end for its true length, keeping the estimated window and a quarter second either
    side; the window the true length places is cut from that, or (an estimate off by more) decoded again once
    the length is `known`. Where the frames' timestamps give it exactly (_stamped_length: MP4, M4A, MOV), it is
    `known` at once and decoding stops after the window (an hour's M4A was decoded whole for its centre seconds)."""
    import av

    with av.open(_opened(source)) as container:
        if not container.streams.audio:
            raise BadFile("no audio stream" + (" (a video without sound)" if container.streams.video else ""))
        stream = container.streams.audio[0]
        rate = stream.rate or stream.codec_context.sample_rate
        if not rate:
            raise BadFile("an audio stream without a sample rate")
        said = round(float(stream.duration * stream.time_base) * rate) if stream.duration and stream.time_base else 0
        if known is None and window(said, rate, fit)[0]:
            known = _stamped_length(source, rate)
        start, count = window(known or said, rate, fit)
        slack = 0 if known or not start else round(ESTIMATE_SLACK_SECONDS * rate)
        first, end = (max(0, start - slack), start + count + slack) if start else (0, None)
        packets = Packets()
        chunks, total = _kept_samples(container, stream, packets, rate, first, end, stop=known is not None)
    if packets.damaged > packets.decoded:
        raise BadFile(
            f"mostly damaged audio ({packets.damaged} of {packets.damaged + packets.decoded} packets do not decode)"
        )
    if known and end is not None and 0 < total < end:  # stopped short of the length it said: window the decoded one
        return _decode_ffmpeg(source, fit, known=total)
    if end is not None:
        start, count = window(known or total, rate, fit)
        if start == 0:  # shorter than it said: the whole recording is the window
            return _decode_ffmpeg(source, None)
        kept = sum(chunk.shape[1] for chunk in chunks)
        if known is None and not first <= start <= start + count <= first + kept:
            return _decode_ffmpeg(source, fit, known=total)  # an estimate off by more than the slack
    if not chunks:
        raise BadFile("an audio stream with no samples")
    wave = np.concatenate(chunks, axis=1).astype(np.float32, copy=False)
    if end is None:
        return wave, int(rate), 0, wave.shape[1]
    return wave[:, start - first : start - first + count], int(rate), start, known or total


def _kept_samples(
    container, stream, packets: Packets, rate: int, first: int, end: int | None, stop: bool
) -> tuple[list, int]:
    """The decoded samples from `first` to `end` (None: to the stream's end), as chunks, and how many samples the
    stream held (decoded to its end unless `stop`: then the count where decoding stopped, past `end`)."""
    import av

    resampler = av.AudioResampler(format="fltp", layout=stream.layout.name if stream.layout else None, rate=rate)
    chunks, position = [], 0
    for frame in itertools.chain(_decoded(container, stream, packets), [None]):  # None: the resampler's last samples
        for out in resampler.resample(frame):
            array = out.to_ndarray()
            if end is None:
                chunks.append(array)
            elif position < end and position + array.shape[1] > first:
                chunks.append(array[:, max(0, first - position) : end - position])
            position += array.shape[1]
        if stop and end is not None and position >= end:
            break
    return chunks, position


def _decoded(container, stream, packets: Packets) -> Iterator:
    """The stream's frames. A packet that does not decode is skipped, as FFmpeg's command line skips it: one
    damaged stretch (a flipped byte, a bad download block) cost the whole recording."""
    import av

    for packet in container.demux(stream):
        try:
            frames = packet.decode()
        except av.FFmpegError:
            packets.damaged += 1
            continue
        packets.decoded += packet.size > 0
        yield from frames


# torchaudio's resampler builds one filter per output phase, (new / gcd) x (old / gcd) taps: 44,100 -> 16,000 Hz is
# 76,000 values, but a rate sharing almost no factor with the other (44,101 or 7,999 Hz) is hundreds of millions
# (gigabytes and seconds a clip). Above this many values (16 MB), a rate goes the bounded way (resample_bounded).
EXACT_FILTER_VALUES = 1 << 22
OVERSAMPLING = 16  # resample_bounded interpolates at this many times the lower of the two rates, or more


def resample_filter_values(rate: int, new_rate: int) -> int:
    """How many values torchaudio's resampling filter from `rate` to `new_rate` holds (lowpass width 6)."""
    divisor = math.gcd(rate, new_rate)
    old, new = rate // divisor, new_rate // divisor
    return new * (old + 2 * math.ceil(6 * old / (0.99 * min(old, new))))


def resample(x: torch.Tensor, rate: int, new_rate: int) -> torch.Tensor:
    """[channels, samples] at `rate` -> at `new_rate`: torchaudio's windowed-sinc resampler, or where its filter
    would be huge, resample_bounded (the same length, within about 1% of it)."""
    import torchaudio.functional as AF

    if resample_filter_values(rate, new_rate) <= EXACT_FILTER_VALUES:
        return AF.resample(x, rate, new_rate)
    return resample_bounded(x, rate, new_rate)


def resample_bounded(x: torch.Tensor, rate: int, new_rate: int) -> torch.Tensor:
    """torchaudio's resampler in three cheap steps for rates that share few factors: up by a whole factor (`up`),
    linear interpolation onto a whole multiple of the new rate (`down` times it) at the exact times, then down by
    that whole factor. The interpolated rates are OVERSAMPLING times the lower rate or more, where a straight line
    between samples is within about 0.1% of the band-limited curve (real speech: 0.3% of torchaudio's exact
    resample); sample j still lands at time j / new_rate, as the exact one's."""
    import torchaudio.functional as AF

    up = math.ceil(OVERSAMPLING * min(rate, new_rate) / rate)
    down = math.ceil(up * rate / new_rate)
    fine = AF.resample(x, 1, up) if up > 1 else x  # (1 -> up: torchaudio's filter of `up` x 15 values)
    count = resampled_length(x.shape[-1], rate, new_rate) * down
    where = torch.arange(count, dtype=torch.float64, device=x.device) * (up * rate / (down * new_rate))
    fine = torch.nn.functional.pad(fine, (0, 2))  # past the end is silence, as torchaudio pads it
    left = where.floor().long().clamp_(max=fine.shape[-1] - 2)
    weight = (where - left).clamp_(max=1).to(fine.dtype)
    between = torch.lerp(fine[..., left], fine[..., left + 1], weight)
    return AF.resample(between, down, 1)


def fit_waveform(wave: np.ndarray, rate: int, fit: Fit, start: int = 0, total: int | None = None) -> torch.Tensor:
    """float32 [channels, samples] at `rate` -> float32 [fit.channels, fit.samples] at fit.sample_rate:
    resampled with torchaudio's windowed-sinc resampler (resample), mixed down or channel-matched, centre-cropped or
    padded with silence on both sides. `wave` may be the window (`start`) of a `total`-sample recording."""
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
        x = resample(x.contiguous(), rate, fit.sample_rate)
    n = resampled_length(total, rate, fit.sample_rate) if start else x.shape[1]  # the whole recording's, resampled
    if n >= fit.samples:
        first = (n - fit.samples) // 2 - start * fit.sample_rate // rate  # (a window starts on a whole period)
        return x[:, first : first + fit.samples].contiguous()
    n = x.shape[1]
    out = torch.zeros(fit.channels, fit.samples)
    first = (fit.samples - n) // 2
    out[:, first : first + n] = x
    return out


def load(source: str | IO[bytes], fit: Fit) -> tuple[torch.Tensor, float]:
    """One file decoded and fitted, and its duration in seconds (for throughput figures)."""
    wave, rate, start, total = decode_audio(source, fit)
    return fit_waveform(wave, rate, fit, start, total), total / rate
