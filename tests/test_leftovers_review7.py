"""Leftovers, reviewed (round 7): bench_gpu's step figures are one GPU's and divide by what the steps held, each
step's limit its own; FFmpeg audio whose container counts its length exactly stops decoding after the window."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import compose

from onn.bench.gpu import micro_batches_held, step_figures
from onn.modalities.audio import decode as audio
from onn.planning.costs import streaming_step_flops
from onn.planning.spec import model_spec
from onn.training.callbacks import StepClock

LINK = 50e9  # bytes/s over the host link
FULL_ROWS = 16384  # a micro-batch's rows (samples x width) that fill the GPU


@pytest.fixture(scope="module")
def spec():
    return model_spec(compose().model, 16)


@pytest.fixture(scope="module")
def rate_at(spec):
    """A GPU's matmul rate by a micro-batch's rows (FLOP/s): a few rows leave it idle, FULL_ROWS fill it, at the
    rate that runs a step of 64 samples x 256 tokens in 1 s."""
    peak = streaming_step_flops(spec, 256, 64, [0])
    return lambda rows: peak * min(rows, FULL_ROWS) / FULL_ROWS


def clock_of(rows: list[int], widths: list[int], copied: list[float], step_s: list[float], tokens: list[int]):
    """A StepClock as a fit leaves it (its rows every process's samples)."""
    clock = StepClock()
    clock.rows, clock.widths, clock.copied_bytes = rows, widths, copied
    clock._step_s, clock._tokens = step_s, tokens
    return clock


def test_two_processes_report_one_gpus_figures_as_one_process_with_its_share_does(spec, rate_at):
    """StepClock counts every process's samples (its share x world_size); bench_gpu set those FLOPs against one
    GPU's matmul rate (a matmul-bound limit twice what the GPU allows: limit_efficiency doubled) and divided the
    step by data.batch_size (the global batch) while tokens_per_s was one process's. Each process's figures are
    now its own: two processes of 64 samples each report what one process of 64 samples does."""
    plan = SimpleNamespace(sparse_layers=[0])
    steps = dict(widths=[16] * 3, copied=[1e6] * 3, step_s=[4.0, 2.0, 2.0], tokens=[900] * 3)
    one = step_figures(spec, plan, clock_of([64] * 3, **steps), slice(1, 3), 1, [64] * 3, LINK, rate_at)
    two = step_figures(spec, plan, clock_of([128] * 3, **steps), slice(1, 3), 2, [64] * 3, LINK, rate_at)
    assert two["gpu/processes"] == 2
    assert {k: v for k, v in two.items() if k != "gpu/processes"} == {
        k: v for k, v in one.items() if k != "gpu/processes"
    }
    flops = streaming_step_flops(spec, 16, 64, [0])
    limit = max(1e6 / LINK, flops / rate_at(64 * 16))
    assert limit > 0.5  # matmul-bound
    assert two["gpu/flops_per_step"] == pytest.approx(flops) and two["gpu/samples_per_step"] == 64
    assert two["gpu/limit_s"] == round(limit, 4) and two["gpu/limit_efficiency"] == round(limit / 2.0, 4)
    assert two["gpu/limit_bound"] == "matmuls"
    assert two["gpu/ms_per_sample"] == round(2.0 / 64 * 1000, 3) and two["gpu/tokens_per_s"] == 450


def test_time_per_sample_divides_by_the_samples_the_steps_held(spec, rate_at):
    """A data set of 100 samples at data.batch_size=64: the timed steps held 36 and 64 samples, 50 a step; the
    figure divided by 64 and gave 22% less time per sample than the steps took."""
    plan = SimpleNamespace(sparse_layers=[0])
    clock = clock_of([64, 36, 64], [16] * 3, [1e6] * 3, [0.02, 0.01, 0.01], [500, 300, 500])
    out = step_figures(spec, plan, clock, slice(1, 3), 1, [64] * 3, LINK, rate_at)
    assert out["gpu/samples_per_step"] == 50
    assert out["gpu/ms_per_sample"] == round(0.01 / 50 * 1000, 3)
    assert out["gpu/tokens_per_s"] == 40_000


def test_each_steps_limit_is_its_own_copies_or_matmuls_not_the_larger_mean(spec, rate_at):
    """A step bound by its copies (a short batch) and one bound by its matmuls: the larger of the two sides' means
    (2 s here) is below the steps' own bounds on average (2.5 s); the limit is the mean of each step's larger
    side. Its matmuls run at the rate of the micro-batches the step held (an out-of-memory back-off halved them
    at step 2: half the rows, half the rate here), not at the plan's micro-batch and the widest batch's width."""
    plan = SimpleNamespace(sparse_layers=[0])
    held = micro_batches_held(32, [{"step": 2, "from": 64, "to": 32}], 3)
    assert held == [64, 64, 32]
    assert micro_batches_held(64, [], 2) == [64, 64]
    copies = LINK  # 1 s over the link
    clock = clock_of([64, 8, 64], [256, 4, 256], [copies, 3 * copies, copies], [4.0, 4.0, 4.0], [1, 1, 1])
    out = step_figures(spec, plan, clock, slice(1, 3), 1, held, LINK, rate_at)
    short = streaming_step_flops(spec, 4, 8, [0]) / rate_at(8 * 4)
    halved = streaming_step_flops(spec, 256, 64, [0]) / rate_at(32 * 256)
    assert short < 1.5 and halved == pytest.approx(2.0)  # step 1 bound by its copies (3 s), step 2 by its matmuls
    expected = (3 + halved) / 2
    assert out["gpu/limit_s"] == round(expected, 4) and out["gpu/limit_efficiency"] == round(expected / 4, 4)
    assert out["gpu/limit_bound"] == "host link"  # 4 s of copies over the two steps, under 3.5 s of matmuls


def _m4a(path: Path, seconds: float, rate: int = 44100, codec: str = "aac", pts: bool = False) -> bytes:
    """Stereo noise in an M4A whose index (moov) comes first, as a download's does (movflags=faststart); with `pts`
    the samples are stamped from 0, so the AAC encoder's priming goes into an edit list the decoder drops."""
    import fractions

    import av

    if codec not in av.codecs_available:
        pytest.skip(f"this FFmpeg has no {codec} encoder")
    wave = (0.1 * np.random.default_rng(0).standard_normal((2, round(seconds * rate)))).astype(np.float32)
    with av.open(str(path), "w", format="ipod", options={"movflags": "faststart"}) as container:
        stream = container.add_stream(codec, rate=rate, layout="stereo")
        resampler = av.AudioResampler(format=stream.codec_context.format.name, layout="stereo", rate=rate)
        frame = av.AudioFrame.from_ndarray(wave, format="fltp", layout="stereo")
        frame.rate = rate
        if pts:
            frame.pts, frame.time_base = 0, fractions.Fraction(1, rate)
        for piece in [*resampler.resample(frame), None]:
            for packet in stream.encode(piece):
                container.mux(packet)
    return path.read_bytes()


def _cut_at(data: bytes, share: float) -> bytes:
    """The file cut where its packets reach `share` of its duration: a download stopped there, its index whole."""
    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        for packet in container.demux(stream):
            if packet.pts is not None and packet.pts >= share * stream.duration:
                return data[: packet.pos]
    raise AssertionError("no packet that far")


def _frames_decoded(monkeypatch) -> list[int]:
    """A count of the frames FFmpeg decodes from here on (the decoder's own generator, counted as it yields)."""
    count, decoded = [0], audio._decoded

    def counted(container, stream, packets):
        for frame in decoded(container, stream, packets):
            count[0] += 1
            yield frame

    monkeypatch.setattr(audio, "_decoded", counted)
    return count


@pytest.mark.parametrize("codec, pts", [("aac", False), ("aac", True), ("alac", False)])
def test_an_m4a_is_decoded_only_to_its_windows_end_and_gives_the_whole_decodes_clip(codec, pts, tmp_path, monkeypatch):
    """An M4A stamps its frames in samples from its index: its centred window was still decoded to the file's end
    for the length (an hour's recording for its centre second). Now the length comes from the first frame and the
    last second's, and decoding stops after the window; the clip is the whole recording's, sample for sample: AAC
    decodes 1,024 samples of priming and pads its last frame, which the duration counts otherwise (with an edit
    list, `pts`, and without)."""
    data = _m4a(tmp_path / "long.m4a", 12.0, codec=codec, pts=pts)
    fit = audio.Fit(16000, 1, 16000)
    frames = _frames_decoded(monkeypatch)
    whole, rate, _, total = audio._decode_ffmpeg(data, None)
    every, frames[0] = frames[0], 0
    wave, wave_rate, start, said = audio._decode_ffmpeg(data, fit)
    assert start > 0 and said == total and wave_rate == rate
    np.testing.assert_array_equal(wave, whole[:, start : start + wave.shape[1]])
    assert frames[0] < 0.7 * every, (frames[0], every)  # to the window's end (55%), and the last second
    clip, seconds = audio.load(io.BytesIO(data), fit)
    assert seconds == total / rate
    assert float((clip - audio.fit_waveform(whole, rate, fit)).abs().max()) < 1e-6
    cut = _cut_at(data, 0.4)  # a download cut before the window's end: windowed at what it holds
    whole, _, _, total = audio._decode_ffmpeg(cut, None)
    assert 0.35 * 12 * rate < total < 0.45 * 12 * rate
    clip, seconds = audio.load(io.BytesIO(cut), fit)
    assert seconds == total / rate
    assert float((clip - audio.fit_waveform(whole, rate, fit)).abs().max()) < 1e-6
