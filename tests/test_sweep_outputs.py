"""Where a sweep's jobs write: their folders under paths.outputs (hydra.sweep.dir), and a relative task.output or
export.output in each job's own folder, not one file in the working directory that every job overwrites."""

import json
from pathlib import Path

import pytest
from conftest import ROOT, compose, run_cli
from hydra import compose as hydra_compose
from hydra import initialize_config_dir

from onn import app
from onn.app import config_digest, sweep_outputs
from onn.errors import UserError

PLAN = ("task=plan", "model=llama_tiny", "hardware=cpu_16gb", "tracking=none")


def _ok_jobs(folder: Path) -> list[Path]:
    """The metrics.json of each job under folder that ended ok."""
    jobs = sorted(folder.glob("multirun/*/*/metrics.json"))
    return [j for j in jobs if json.loads(j.read_text())["status"] == "ok"]


@pytest.mark.slow  # two sweeps of task=plan through the real CLI: about 20 s on two busy cores
def test_a_sweep_goes_under_paths_outputs_and_by_default_under_outputs(tmp_path):
    """hydra.sweep.dir was outputs/multirun/... from the working directory whatever paths.outputs said, so
    `-m paths.outputs=/big/disk` still filled ./outputs/multirun."""
    start = tmp_path / "start"
    start.mkdir()
    proc = run_cli("-m", *PLAN, f"paths.outputs={tmp_path / 'big'}", cwd=start)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(_ok_jobs(tmp_path / "big")) == 1
    assert not (start / "outputs").exists()
    proc = run_cli("-m", *PLAN, f"paths.cache={tmp_path / 'cache'}", cwd=start)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(_ok_jobs(start / "outputs")) == 1


@pytest.mark.parametrize("recipe", [None, "equitable_grid", "optuna_lr", "bench_omny"])
def test_the_sweep_folder_is_under_paths_outputs(tmp_path, recipe):
    """conf/config.yaml's hydra.sweep.dir, and those of the recipes that fix their own, were under ./outputs
    whatever paths.outputs said."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = hydra_compose(
            "config",
            overrides=[f"paths.outputs={tmp_path}", *([f"recipe={recipe}"] if recipe else [])],
            return_hydra_config=True,
        )
    assert Path(str(cfg.hydra.sweep.dir)).is_relative_to(tmp_path)


def test_an_absolute_output_two_jobs_of_other_configs_write_is_refused(tmp_path, monkeypatch):
    """Every job of a sweep given one absolute task.output wrote that file, each over the one before; a path that
    differs by job (${hydra:job.num} in it), or a job of the same config, writes its own or the same answers."""
    monkeypatch.setattr(app, "OUTPUTS_CLAIMED", {})
    sweep = tmp_path / "sweep"
    common = ("task=infer", "model=llama_tiny", f"paths.outputs={tmp_path}")
    shared = f"task.output={tmp_path / 'preds.jsonl'}"
    cold, hot = (compose(*common, shared, f"task.temperature={t}") for t in (0.0, 1.0))
    sweep_outputs(cold, sweep / "0", sweep, 0, config_digest(cold))
    sweep_outputs(cold, sweep / "2", sweep, 2, config_digest(cold))  # the same config again: the same file
    with pytest.raises(UserError, match=r"^task\.output=.*preds\.jsonl is also written by job 0 of this sweep"):
        sweep_outputs(hot, sweep / "1", sweep, 1, config_digest(hot))
    for num in (3, 4):
        own = compose(*common, f"task.output={tmp_path}/preds_{num}.jsonl", f"task.temperature={num}")
        sweep_outputs(own, sweep / str(num), sweep, num, config_digest(own))
        assert own.task.output == f"{tmp_path}/preds_{num}.jsonl"


def test_a_relative_export_output_is_the_job_folders_in_a_sweep(tmp_path, monkeypatch):
    """export.output=model.onnx in a sweep: each job's folder, so two jobs never write one export."""
    monkeypatch.setattr(app, "OUTPUTS_CLAIMED", {})
    sweep = tmp_path / "sweep"
    for num in (0, 1):
        config = compose("model=llama_tiny", "export=onnx", "export.output=model.onnx", f"seed={num}")
        sweep_outputs(config, sweep / str(num), sweep, num, config_digest(config))
        assert config.export.output == str(sweep / str(num) / "model.onnx")


@pytest.mark.slow  # two generations of a random llama_tiny through the real CLI: about 15 s on two busy cores
def test_a_sweep_of_infer_jobs_keeps_each_jobs_completions(tmp_path):
    """`-m task=infer task.output=preds.jsonl task.temperature=0.0,1.0` wrote ./preds.jsonl twice: only the last
    job's completions were left, and both records named that one file."""
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "2+2?"}\n')
    proc = run_cli(
        "-m",
        *PLAN[1:],
        "task=infer",
        "task.input=prompts.jsonl",
        "task.output=preds.jsonl",
        "task.temperature=0.0,1.0",
        "task.max_new_tokens=2",
        "paths.outputs=out",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not (tmp_path / "preds.jsonl").exists()
    jobs = sorted((tmp_path / "out" / "multirun").glob("*/[0-9]"))
    assert [j.name for j in jobs] == ["0", "1"]
    for job in jobs:
        (row,) = [json.loads(line) for line in (job / "preds.jsonl").read_text().splitlines()]
        assert row["prompt"] == "2+2?"
        assert json.loads((job / "metrics.json").read_text())["status"] == "ok"
