"""The hardware layer's fixes: the host-wait counter, launcher rank variables with odd values, a job's own cgroup
limits, a GPU budget the CUDA context fills, page-locked buffers freed after a CUDA error."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from onn.hardware import cluster
from onn.hardware.waits import DeviceOps
from onn.tasks.record import is_first_process
from tests.conftest import ROOT

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _waits(fn: Callable[[], object]) -> int:
    with DeviceOps(DEVICE) as counted:
        fn()
    return counted.waits


def test_waits_count_ops_that_read_values_or_sizes_on_the_host() -> None:
    """torch.equal / allclose return a Python bool, repeat_interleave without output_size is sized by its
    repeats, and `x[mask] = values` turns the mask into positions first: each makes the host wait for the GPU,
    and the counter missed them, so a step that waited passed as one that did not."""
    x = torch.randn(64, device=DEVICE)
    mask = x > 0
    values = torch.ones(64, device=DEVICE)
    repeats = torch.full((64,), 2, device=DEVICE)
    assert _waits(lambda: torch.equal(x, x)) == 1
    assert _waits(lambda: torch.allclose(x, x)) == 1
    assert _waits(lambda: torch.repeat_interleave(repeats)) == 1
    assert _waits(lambda: x.clone().index_put_((mask,), values[: int(mask.sum())])) == 2  # the .sum() read, the put
    assert _waits(lambda: x.clone().index_put_((mask,), torch.tensor(1.0, device=DEVICE))) == (DEVICE.type == "cuda")


def test_waits_leave_out_what_does_not_wait() -> None:
    """A masked fill (`x[mask] = 0.0`, whose value PyTorch keeps on the host), a repeat_interleave told its size and
    torch.where with three arguments run on the GPU without waiting."""
    x = torch.randn(64, device=DEVICE)
    mask = x > 0
    repeats = torch.full((64,), 2, device=DEVICE)

    def fill() -> None:
        x.clone()[mask] = 0.0

    assert _waits(fill) == 0
    assert _waits(lambda: torch.repeat_interleave(repeats, output_size=128)) == 0
    assert _waits(lambda: torch.where(mask, x, 0.0)) == 0
    assert _waits(lambda: x.masked_fill(mask, 0.0)) == 0


def test_waits_on_a_gpu_judged_op_by_op() -> None:
    """The same ops as a GPU's dispatcher sees them (meta tensors stand in for the GPU's): a masked write waits
    unless PyTorch turns it into a masked fill (one value from the host), and repeat_interleave unless given its
    output's size."""
    from onn.hardware.waits import aten, makes_the_host_wait

    device, mask = torch.empty(4, device="meta"), torch.empty(4, dtype=torch.bool, device="meta")
    positions, one_on_host = torch.empty(2, dtype=torch.long, device="meta"), torch.tensor(0.0)
    cases = [
        (aten.equal.default, (device, device), {}, True),
        (aten.allclose.default, (device, device), {}, True),
        (aten.index_put_.default, (device, [mask], device), {}, True),  # x[mask] = y
        (aten.index_put_.default, (device, [mask], one_on_host), {}, False),  # x[mask] = 0.0: masked_fill_
        (aten.index_put_.default, (device, [mask], one_on_host, True), {}, True),  # accumulated
        (aten.index_put_.default, (device, [positions], device), {}, False),  # x[idx] = y
        (aten.repeat_interleave.Tensor, (positions,), {}, True),
        (aten.repeat_interleave.Tensor, (positions,), {"output_size": 8}, False),
    ]
    assert [makes_the_host_wait(*case[:3], on_cpu=False) for case in cases] == [case[3] for case in cases]


@pytest.mark.parametrize(("value", "launched"), [("-1", False), ("", False), (" 0", True), ("0\n", True)])
def test_rank_variables_that_hold_no_rank_leave_a_lone_process_rank_zero(
    monkeypatch: pytest.MonkeyPatch, value: str, launched: bool
) -> None:
    """LOCAL_RANK=-1 (Hugging Face's "not distributed") or a stray space made a process running alone not rank
    zero, so it wrote none of its run's files; NODE_RANK with a space ended rank() in a ValueError."""
    for name in cluster.RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_RANK", value)
    monkeypatch.setenv("NODE_RANK", value)
    assert cluster.is_rank_zero()
    assert cluster.rank() == 0
    assert cluster.local_rank() == 0
    assert cluster.launched() == launched
    assert is_first_process()  # else the run neither holds its folder nor refuses an earlier run's (tasks/record.py)


def test_rank_variables_still_name_a_launched_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rank a launcher gives, padded or not, is still read as that rank."""
    for name in cluster.RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1 ")
    monkeypatch.setenv("NODE_RANK", " 2")
    assert not cluster.is_rank_zero()
    assert cluster.rank() == 2001
    assert cluster.local_rank() == 1
    assert cluster.launched()


def _own_cgroup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lines: str) -> Path:
    """cgroup files under tmp_path, and this process placed (as /proc/self/cgroup says) in the cgroups `lines` name."""
    from onn.hardware import profile

    (tmp_path / "self_cgroup").write_text(lines)
    monkeypatch.setattr(profile, "CGROUP", tmp_path / "fs")
    monkeypatch.setattr(profile, "OWN_CGROUP", tmp_path / "self_cgroup")
    return tmp_path / "fs"


def test_a_slurm_jobs_cgroup_limits_are_read_from_its_own_cgroup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a cgroup namespace (SLURM, systemd) a job's --mem and CPU quota sit in its own cgroup's folder, not
    at the root, and a step's cgroup under it sets none: the profile read the root and planned for the whole node's
    memory, which the kernel's OOM killer then enforced."""
    from onn.hardware import profile

    host_mb, cores = profile.host_memory_mb(), profile.usable_cores()
    root = _own_cgroup(tmp_path, monkeypatch, "0::/system.slice/slurmstepd.scope/job_42/step_0\n")
    job, step = root / "system.slice/slurmstepd.scope/job_42", root / "system.slice/slurmstepd.scope/job_42/step_0"
    step.mkdir(parents=True)
    (job / "memory.max").write_text(f"{1024 * 2**20}\n")
    (job / "memory.current").write_text(f"{256 * 2**20}\n")
    (job / "cpu.max").write_text("100000 100000\n")
    (step / "memory.max").write_text("max\n")  # the step inherits the job's limit
    (step / "cpu.max").write_text("max 100000\n")
    assert profile.host_memory_mb() == min(1024, host_mb)
    assert profile.available_memory_mb() <= 768
    assert profile.usable_cores() == 1 <= cores


def test_a_cgroup_v1_jobs_limits_are_read_from_its_controllers_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same under cgroup v1, whose controllers each keep their own tree (cpu,cpuacct shares one)."""
    from onn.hardware import profile

    host_mb = profile.host_memory_mb()
    root = _own_cgroup(tmp_path, monkeypatch, "4:memory:/slurm/uid_0/job_7\n3:cpu,cpuacct:/slurm/uid_0/job_7\n0::/\n")
    memory, cpu = root / "memory/slurm/uid_0/job_7", root / "cpu/slurm/uid_0/job_7"
    memory.mkdir(parents=True)
    cpu.mkdir(parents=True)
    (memory / "memory.limit_in_bytes").write_text(f"{1024 * 2**20}\n")
    (memory / "memory.usage_in_bytes").write_text(f"{512 * 2**20}\n")
    (memory / "memory.stat").write_text(f"total_inactive_file {256 * 2**20}\n")  # reclaimable: counts as free
    (cpu / "cpu.cfs_quota_us").write_text("50000\n")
    (cpu / "cpu.cfs_period_us").write_text("100000\n")
    assert profile.host_memory_mb() == min(1024, host_mb)
    assert profile.available_memory_mb() <= 768
    assert profile.usable_cores() == 1


@pytest.mark.parametrize("left_mb", [-120.0, 0.0])
def test_a_budget_the_cuda_context_fills_is_one_sentence(left_mb: float) -> None:
    """hardware.budget_mb below the CUDA context's size capped the allocator at a fraction of 0: every allocation
    failed as out of memory, the back-off with it (on a CPU machine the call ended in CUDA's own traceback)."""
    from onn.errors import UserError
    from onn.hardware.memory import cap_gpu_memory

    with pytest.raises(UserError, match="hardware.budget_mb .* short of the CUDA context"):
        cap_gpu_memory(left_mb)


UNPIN_AFTER_A_CUDA_ERROR = """
import gc
import torch
from onn.hardware.memory import pinned_empty

buffers = [pinned_empty(1 << 20) for _ in range(3)]
x = torch.zeros(4, device="cuda")
try:
    x[torch.tensor([10], device="cuda")] = 1.0  # out of range: a device-side assert, which stays with the context
    torch.cuda.synchronize()
except RuntimeError as error:
    print("the run's own error:", type(error).__name__)
del buffers
gc.collect()
print("freed")
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locks host memory through CUDA")
def test_pinned_buffers_freed_after_a_cuda_error_print_no_traceback() -> None:
    """After a sticky CUDA error every freed page-locked buffer's unregister fails: torch's unpin raised an
    AssertionError in a finalizer, which Python printed as a traceback per buffer under the run's one error."""
    proc = subprocess.run(
        [sys.executable, "-c", UNPIN_AFTER_A_CUDA_ERROR], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert "freed" in proc.stdout, proc.stdout + proc.stderr
    assert "Exception ignored" not in proc.stderr and "Unpinning" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("major, fast", [(7, False), (8, True)])
def test_a_gpu_that_only_emulates_bf16_is_profiled_without_it(monkeypatch, major: int, fast: bool) -> None:
    """A Turing card (GTX 1650, T4: compute capability 7.x) runs bf16 by emulation, which torch's
    is_bf16_supported() counts as support: the measured profile said bf16, and the plan chose bf16-mixed there."""
    from types import SimpleNamespace

    from onn.hardware.profile import cuda_has_bf16

    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(major=major))
    monkeypatch.setattr(torch.cuda, "_check_bf16_tensor_supported", lambda device: True)  # emulation works
    assert cuda_has_bf16() is fast
