"""The benchmarks' figures, reviewed once more: task=bench's step prediction made before the steps it predicts, at
their shapes; bench_gpu's host-link probe sized to the memory the run leaves; bench_omny's file size read from the
export itself, not from leftovers beside it."""

from __future__ import annotations

import statistics
import time

import numpy as np
import pytest
from conftest import compose
from hostile_corpus import tiny_onnx
from test_bench import TINY

from onn.errors import UserError


@pytest.mark.slow  # (a real bench: a child process trains llama_tiny 12 steps while its blocks are timed)
def test_the_benchs_step_prediction_is_timed_before_its_steps_at_their_shapes(outputs, monkeypatch):
    """bench/predicted_step_s came from the model's blocks timed at data.max_length between the steps, then, the
    steps' batches being shorter, timed again after the run at their width (a cache miss): the prediction was
    taken after the run it predicts. Now the child draws its timed steps' shapes from its data before its first
    step, and every timing of the blocks for the prediction is at those shapes, before the steps end."""
    from onn.bench import suite
    from onn.hardware.profile import resolve
    from onn.modalities import get
    from onn.modalities.base import Job
    from onn.modalities.text import calibrate

    config = compose(*TINY, "data.max_length=256", f"paths.outputs={outputs}")
    hardware = resolve(config.hardware, outputs / "cache", outputs)
    plan, spec = get("text").plan(config, hardware, use_tuned=False)
    assert plan.step_time_source == "timed"  # a small model on a CPU: its blocks are timed
    monkeypatch.setattr(suite, "STEP_TIME_TARGET", float("inf"))  # no miss: no timing after the steps on purpose

    timings: list[tuple[float, int, int]] = []  # (when it ended, sequence length, micro-batch) of each timing
    time_steps = calibrate._step_times

    def recorded(config, plan, seq, micro, *args, **kwargs):
        times = time_steps(config, plan, seq, micro, *args, **kwargs)
        timings.append((time.monotonic(), seq, micro))
        return times

    monkeypatch.setattr(calibrate, "_step_times", recorded)
    runs: list[tuple[float, dict]] = []
    measure_isolated = suite.measure_isolated

    def measured(*args, **kwargs):
        raw = measure_isolated(*args, **kwargs)
        runs.append((time.monotonic(), raw))
        return raw

    monkeypatch.setattr(suite, "measure_isolated", measured)
    (outputs / "run").mkdir()
    out = suite.run(Job(config, outputs / "run", get("text"), hardware, plan, spec))

    (steps_ended, raw), warmup = runs[0], config.task.warmup_steps
    width = round(statistics.mean(raw["widths"][warmup:]))
    assert width < 256, raw["widths"]  # the math problems' batches are shorter than data.max_length
    assert out["bench/timing_windows"] == 3 and out["bench/predicted_step_s"] > 0
    assert timings and all(ended <= steps_ended for ended, _, _ in timings), (timings, steps_ended)
    assert {seq for _, seq, _ in timings} == {width}
    assert raw["timed_shapes"] == [width, round(statistics.mean(raw["rows"][warmup:]))]  # drawn as they ran


def test_bench_gpus_host_link_probe_fits_the_room_the_run_leaves():
    """bench_gpu timed the host link after the steps with a 512 MB copy (as much pinned on the host, as much on the
    device): under hardware.budget_mb=1536 with 1.2 GB still held that copy is past the cap, and the bench failed
    after every step had run. Its size is now a quarter of the room left, at most 512 MB."""
    from onn.bench.gpu import H2D_PROBE_MB, h2d_probe_mb

    assert h2d_probe_mb(free_mb=70_000, budget_room_mb=None) == H2D_PROBE_MB == 512  # a large card: as before
    assert h2d_probe_mb(free_mb=1_200, budget_room_mb=None) == 300  # a 4 GB laptop card after the steps
    assert h2d_probe_mb(free_mb=70_000, budget_room_mb=1536 - 300 - 1200) == 9  # the budget's room, not the card's
    assert h2d_probe_mb(free_mb=70_000, budget_room_mb=-50) == 1  # a run already at its cap: the least copy


def test_bench_omnys_file_size_counts_the_exports_own_files_only(tmp_path, monkeypatch):
    """omny/<model>/file_mb summed every file whose name starts with the .omny's: a killed earlier export's weights
    (NAME.omny.<hex>.data, moved beside it before its graph was) and a user's NAME.omny.bak were counted as the
    export's. Now the graph and the weights files it names are."""
    import onnx

    from onn.bench.omny import exported_bytes
    from onn.export.omny import format as omny_format
    from onn.export.onnx_export import weights_files

    monkeypatch.setattr(omny_format, "EXTERNAL_DATA_BYTES", 0)  # its weights in a file beside it, as a large one's
    src = tiny_onnx(tmp_path / "src.onnx")
    out = omny_format.enrich_onnx(src, tmp_path / "tiny.omny", {"x": np.ones((1, 16), np.float32)})
    own = [out, *weights_files(out)]
    assert len(own) == 2 and omny_format.validate(out, echo=lambda *_: None)
    (tmp_path / "tiny.omny.0123456789ab.data").write_bytes(b"\0" * 50_000)  # an earlier export's, stopped midway
    (tmp_path / "tiny.omny.bak").write_bytes(onnx.load(str(src)).SerializeToString())
    assert exported_bytes(out) == sum(f.stat().st_size for f in own)


def test_bench_giants_disk_probe_takes_at_most_a_quarter_of_the_memory_available(tmp_path, monkeypatch):
    """bench_giant read its disk probe (task.disk_probe_mb, 2 GB by default) whole into one buffer, whatever memory
    the machine had: on a machine with less memory than its model, which it is made for, the OOM killer ended it.
    It now sizes the probe as hardware=auto does, at most a quarter of the memory available (here 64 MB)."""
    from onn.bench.giant import disk_now
    from onn.hardware import disk, profile

    monkeypatch.setattr(profile, "available_memory_mb", lambda: 64)  # a small machine's figure, given
    sizes: list[int] = []
    make_buffer = disk.buffer

    def recorded(size: int, pin: bool = False):
        sizes.append(size)
        return make_buffer(size, pin)

    monkeypatch.setattr(disk, "buffer", recorded)
    config = compose("task=bench_giant", "task.disk_probe_mb=128", f"paths.cache={tmp_path}")
    assert disk_now(config) > 0
    assert sizes == [16 * 2**20]  # the file read, into one buffer: a quarter of 64 MB
    assert not list(tmp_path.iterdir())  # the probe file is gone


def test_bench_giants_disk_probe_that_cannot_be_written_names_the_benchmark(tmp_path):
    """A paths.cache under a file: the sentence named hardware=auto, which the user did not ask for."""
    from onn.bench.giant import disk_now

    (tmp_path / "a_file").write_text("")
    config = compose("task=bench_giant", "task.disk_probe_mb=1", f"paths.cache={tmp_path / 'a_file' / 'cache'}")
    with pytest.raises(UserError, match=r"^task=bench_giant measures the disk under .*a_file/cache \(paths\.cache"):
        disk_now(config)
