"""The GPU check's CPU-side parts: the CUDA context read from nvidia-smi where NVML cannot name the process, and
bench_gpu's image-runner figure naming the images it was measured on (a device copy lacks the default folder)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

from conftest import compose

UUID = "GPU-5d1b4f2e-8c3a-4b7e-9f10-2a6c8e0d4b11"
OTHER = "GPU-0a9e7c3b-1d2f-4e5a-8b6c-7d8e9f0a1b2c"


def test_nvidia_smi_gives_this_processs_memory_on_this_gpu_among_other_processes_and_gpus():
    """The pytest parent's context and cache are another pid's line, and this pid's line on another GPU is another
    device's: only this pid on this GPU is the process's memory (the device's used memory counted them all)."""
    from onn.hardware.profile import nvidia_smi_process_mb

    pid = os.getpid()
    text = f"{UUID}, {pid + 1}, 2210\n{OTHER}, {pid}, 900\n{UUID}, {pid}, 514\n{UUID}, {pid + 7}, 80\n"
    assert nvidia_smi_process_mb(text, pid, UUID) == 514.0
    assert nvidia_smi_process_mb(text, pid, OTHER) == 900.0
    assert nvidia_smi_process_mb(text, pid + 99, UUID) is None  # a container's pid namespace: not listed


def test_nvidia_smi_output_without_a_number_for_this_process_gives_none_so_the_old_fallback_holds():
    """Empty output (nvidia-smi absent or failing), an error message, "[N/A]" (no per-process figure), or a pid
    that only starts like ours: none is a measure of this process."""
    from onn.hardware.profile import nvidia_smi_process_mb

    pid = os.getpid()
    for text in (
        "",
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n",
        f"{UUID}, {pid}, [N/A]\n",
        f"{UUID}, {pid}0, 512\n",
        f"{UUID}, {pid}, 512, extra\n",
    ):
        assert nvidia_smi_process_mb(text, pid, UUID) is None, text


def test_bench_gpus_image_figures_name_the_images_they_were_measured_on(tmp_path: Path):
    """task.vision_source inside the checkout (scripts/gpu_check.sh's .gpu_data/) is what bench_vision's child run
    is given, and bench_gpu says which file that was; past task.time_limit_s no child starts (nothing runs here)."""
    from onn.bench.gpu import _overheads

    source = tmp_path / ".gpu_data" / "cifar10-jpeg.tar.gz"
    source.parent.mkdir()
    source.write_bytes(b"")
    config = compose("recipe=bench_gpu", "task.time_limit_s=1", f"task.vision_source={source}")
    job = SimpleNamespace(config=config, run_dir=tmp_path / "bench")
    out = _overheads(job)
    assert out["gpu/vision_source"] == str(source)
    assert out["gpu/vision_runner_overhead"].startswith("not measured: less than 60 s")
    assert not (tmp_path / "bench").exists()  # no child run was started


def test_bench_gpu_without_its_images_says_how_to_give_them(tmp_path: Path):
    from onn.bench.gpu import _overheads

    missing = tmp_path / "none.tar.gz"
    config = compose("recipe=bench_gpu", "task.time_limit_s=1", f"task.vision_source={missing}")
    out = _overheads(SimpleNamespace(config=config, run_dir=tmp_path / "bench"))
    assert "gpu/vision_source" not in out
    assert out["gpu/vision_runner_overhead"].startswith(f"not measured: task.vision_source {missing} does not exist")
    assert "docs/gpu.md" in out["gpu/vision_runner_overhead"]
