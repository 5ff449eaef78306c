"""A warm decoded cache with known classes lists no archive, the spec cache keys on peft, and a sweep's grid with
its own hydra.sweep.subdir keeps its value-named job folders."""

from __future__ import annotations

import csv
import importlib.metadata
import json
import tarfile

import soundfile as sf
from conftest import compose
from omegaconf import OmegaConf
from test_audio import tone

from onn.bench.grid import GridCallback
from onn.data import labelled
from onn.modalities.audio.dataset import READER
from onn.planning.spec import _spec_cache_path
from onn.tasks.record import BASIC_SWEEPER


def test_a_warm_cache_with_known_classes_reads_no_member_of_a_tar_gz(tmp_path, monkeypatch):
    """The cache key's kept-class-folder check listed every member of a tar.gz (decompressing it whole) on each
    eval of a checkpoint, its decoded cache there or not. Now the second read lists none and reads the same data."""
    for name, freq in {"ant": 300.0, "bee": 900.0}.items():
        (tmp_path / "clips" / name).mkdir(parents=True)
        for i in range(3):
            sf.write(tmp_path / "clips" / name / f"{i}.wav", tone(freq, 0.2, seed=i), 8000)
    archive = tmp_path / "clips.tar.gz"
    with tarfile.open(archive, "w:gz") as t:
        t.add(tmp_path / "clips", arcname="clips")
    cfg = compose("data=audio", f"data.source={archive}").data
    first = READER.read_cached(str(archive), cfg, tmp_path / "cache", known=("ant", "bee"))
    listed = []
    real_iter_members = labelled.iter_members

    def counted(path, kind=None):  # the real listing, counted
        listed.append(path)
        return real_iter_members(path, kind)

    monkeypatch.setattr(labelled, "iter_members", counted)
    second = READER.read_cached(str(archive), cfg, tmp_path / "cache", known=("ant", "bee"))
    assert listed == []
    assert second.keys() == first.keys()
    for split in first:
        assert second[split].classes == first[split].classes == ["ant", "bee"]
        assert second[split].inputs.equal(first[split].inputs)


def test_the_spec_cache_key_changes_with_peft(tmp_path, monkeypatch):
    """ModelSpec.lora_refused is peft's own check: a spec measured under another peft was reused."""
    cfg = compose("model=phi4_tiny").model
    before = _spec_cache_path(cfg, 8, str(tmp_path))
    real_version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.0.1" if name == "peft" else real_version(name))
    after = _spec_cache_path(cfg, 8, str(tmp_path))
    assert before is not None and after is not None and before != after


def test_a_sweep_with_its_own_subdir_keeps_every_job_in_its_grid(tmp_path):
    """hydra.sweep.subdir=${data.batch_size} over 32,64,128 names the job folders 32, 64 and 128: all past the job
    count of 3, so all were taken for an earlier sweep's and the grid was empty."""
    sweep = tmp_path / "sweep"
    for bs in (32, 64, 128):
        job = sweep / str(bs)
        (job / ".hydra").mkdir(parents=True)
        (job / ".hydra" / "overrides.yaml").write_text(f"- task=bench\n- data.batch_size={bs}\n")
        (job / "metrics.json").write_text(json.dumps({"status": "ok", "bench/samples_per_s": float(bs)}))
    config = OmegaConf.create(
        {
            "task": {"name": "bench"},
            "hydra": {
                "sweep": {"dir": str(sweep), "subdir": "${data.batch_size}"},
                "sweeper": {"_target_": BASIC_SWEEPER, "params": {"data.batch_size": "32,64,128"}},
                "overrides": {"task": ["task=bench"]},
            },
        }
    )
    GridCallback().on_multirun_end(config)
    with open(sweep / "grid.csv") as f:
        jobs = sorted(row["job"] for row in csv.DictReader(f))
    assert jobs == ["128", "32", "64"]


def test_a_numbered_sweep_still_leaves_out_an_earlier_sweeps_job_past_its_count(tmp_path):
    """Under the default subdir a folder numbered past the count is still left out (record.other_sweep's case)."""
    sweep = tmp_path / "sweep"
    for num in (0, 1, 2):
        job = sweep / str(num)
        (job / ".hydra").mkdir(parents=True)
        (job / ".hydra" / "overrides.yaml").write_text(f"- task=bench\n- data.batch_size={num + 1}\n")
        (job / "metrics.json").write_text(json.dumps({"status": "ok", "bench/samples_per_s": 1.0}))
    config = OmegaConf.create(
        {
            "task": {"name": "bench"},
            "hydra": {
                "sweep": {"dir": str(sweep), "subdir": "${hydra.job.num}"},
                "sweeper": {"_target_": BASIC_SWEEPER, "params": {"data.batch_size": "1,2"}},
                "overrides": {"task": ["task=bench"]},
            },
        }
    )
    GridCallback().on_multirun_end(config)
    with open(sweep / "grid.csv") as f:
        assert sorted(row["job"] for row in csv.DictReader(f)) == ["0", "1"]
