"""The machine profile and the measured peak memory, as round 94's review found them: `forward_bf16` timed on the
LoRA-adapted model where `forward` times the plain one, a safetensors model's weights (mapped file pages) left out of
the peak memory, and a cached profile's disk figure reused for a paths.cache on another disk."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import transformers
from conftest import compose
from transformers import LlamaConfig, LlamaForCausalLM

from onn.hardware import profile
from onn.hardware.memory import PeakMemory, anon_rss_mb
from onn.hardware.profile import VERSION, disk_key, machine_fingerprint, resolve
from onn.models.load import from_pretrained_whole


@pytest.mark.slow  # 8 s on 2 shared cores: block_call_s builds and steps four tiny Llamas
def test_forward_bf16_times_the_plain_model_as_forward_does():
    """The planner reads `forward` and `forward_bf16` as one no-grad block call switched by dtype; `forward_bf16`
    timed the LoRA-adapted Llama, whose adapters cost a bf16 block 1.8x its plain call. Every module call is seen by
    a global forward hook: none of the no-grad bf16 calls goes through a LoRA layer, and they do run decoder blocks."""
    from peft.tuners.lora import LoraLayer
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    seen = {"lora": 0, "blocks": 0}

    def hook(module, args, output):
        if torch.is_grad_enabled() or not torch.is_autocast_enabled("cpu"):
            return
        seen["lora"] += isinstance(module, LoraLayer)
        seen["blocks"] += isinstance(module, LlamaDecoderLayer)

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        calls = profile.block_call_s("cpu", repeats=1)
    finally:
        handle.remove()
    assert {"forward", "forward_bf16"} <= set(calls)
    assert seen["blocks"] > 0 and seen["lora"] == 0


def test_peak_memory_counts_a_safetensors_models_mapped_weights(tmp_path):
    """transformers 5 maps a safetensors model's weights from their file: a forward makes them resident as file
    pages (RssFile), which anonymous RSS alone left out (11 of 165 MB counted). A tiny Llama saved and loaded as
    onn/models/load.py loads it: the peak above the baseline counts most of its weight bytes."""
    config = LlamaConfig(
        vocab_size=8000, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    model = from_pretrained_whole(transformers.AutoModelForCausalLM, str(tmp_path), False, dtype=torch.float32)
    weights_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    before = anon_rss_mb()
    with PeakMemory("cpu") as peak, torch.no_grad():
        model(torch.randint(0, 8000, (1, 16)))
    assert peak.peak_mb - before > 0.8 * weights_mb


def test_a_paths_cache_on_another_disk_measures_that_disk(tmp_path):
    """A cached profile was keyed by the machine alone: a run whose paths.cache lay on another disk read the first
    disk's bandwidth (tmpfs's for the real disk's). The cached profile keeps a figure per disk probed, and a disk it
    has none for is measured (that disk alone), added and read from the cache after."""
    shm = Path(tempfile.mkdtemp(dir="/dev/shm")) if Path("/dev/shm").is_dir() else None
    if shm is None or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("needs /dev/shm on another device than the test's temporary folder")
    try:
        here = disk_key(tmp_path, 1)
        preset = resolve(compose("hardware=cpu_16gb").hardware, tmp_path, tmp_path).as_dict()
        cached = {**preset, "name": "auto", "version": VERSION, "fingerprint": machine_fingerprint(), "source": None}
        cached.update(busy_while_measuring=0.0, disk_read_mb_s=123.0, disk_read_by_device={here: 123.0})
        cache = tmp_path / "hardware" / f"{machine_fingerprint()}.json"
        cache.parent.mkdir()
        cache.write_text(json.dumps(cached))
        auto = compose("hardware=auto", "hardware.disk_probe_mb=1", f"hardware.cache={cache.parent}").hardware
        other = resolve(auto, tmp_path / "cache", shm)
        assert other.source.startswith("cache") and other.source.endswith("measured")
        table = json.loads(cache.read_text())["disk_read_by_device"]
        assert set(table) == {here, disk_key(shm, 1)} and table[here] == 123.0
        again = resolve(auto, tmp_path / "cache", shm)
        assert "measured" not in again.source and again.disk_read_mb_s == table[disk_key(shm, 1)]
    finally:
        shutil.rmtree(shm)


def test_peak_memory_leaves_a_memmapped_datasets_page_cache_out(tmp_path):
    """Pages of other files read during the work (a dataset through np.memmap, libraries' code run for the first
    time) are reclaimable page cache the planner does not predict: counting every new file page moved the CPU
    grid's bench/memory_error by six points. Reading a 64 MB memmap adds little to the peak."""
    import numpy as np

    data = np.lib.format.open_memmap(tmp_path / "data.npy", mode="w+", dtype=np.float32, shape=(16, 2**20))
    data[:] = 1.0
    data.flush()
    del data
    read = np.load(tmp_path / "data.npy", mmap_mode="r")
    before = anon_rss_mb()
    with PeakMemory("cpu") as peak:
        assert float(read.sum(dtype=np.float64)) == 16 * 2**20
    assert peak.peak_mb - before < 16


@pytest.mark.skipif(not Path("/proc/self/mountinfo").exists(), reason="Linux's mount table")
def test_a_disks_key_names_its_file_system_not_a_device_number(tmp_path):
    """st_dev numbers an overlay or a tmpfs anew at each mount: keyed by it, a container's every start measured its
    disk again (up to disk_probe_mb written and read) and the cached table grew by one entry each time. The key is
    the file system's type and source, as psutil's own reading of the mount table names them."""
    import psutil

    where = tmp_path.resolve()
    mounts = [p for p in psutil.disk_partitions(all=True) if Path(p.mountpoint) in (where, *where.parents)]
    mount = max(mounts, key=lambda p: len(Path(p.mountpoint).parts))
    assert disk_key(tmp_path / "not_yet", 64) == f"{mount.fstype} {mount.device}:64"


def test_an_automounted_or_escaped_disk_is_keyed_by_the_mount_over_it():
    """Of two mounts at one point the first listed (systemd's autofs placeholder) was taken, so every automounted
    disk shared the key "autofs systemd-1"; and only \\040 was decoded, so a mount point with a backslash never
    matched and its parent's disk was named."""
    from onn.hardware.profile import mounted_under

    table = [
        "22 1 252:1 / / rw - ext4 /dev/vda1 rw",
        "40 22 0:35 / /data rw - autofs systemd-1 rw",
        "41 40 8:17 / /data rw - ext4 /dev/sdb1 rw",
        "50 22 0:36 / /scratch rw - autofs systemd-1 rw",
        "51 50 259:1 / /scratch rw - xfs /dev/nvme0n1 rw",
        "60 22 8:1 / /mnt/a\\134b rw - xfs /dev/sdc1 rw",
        "61 22 8:2 / /mnt/with\\040space rw - ext4 /dev/sdd1 rw",
    ]
    assert mounted_under(Path("/data/cache"), table) == "ext4 /dev/sdb1"
    assert mounted_under(Path("/scratch/cache"), table) == "xfs /dev/nvme0n1"
    assert mounted_under(Path("/mnt/a\\b/cache"), table) == "xfs /dev/sdc1"
    assert mounted_under(Path("/mnt/with space"), table) == "ext4 /dev/sdd1"
    assert mounted_under(Path("/home"), table) == "ext4 /dev/vda1"
