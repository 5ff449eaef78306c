"""Eighth review of run records, checkpoints and the app: `ckpt=.` in a run folder, a NaN score in an earlier
run's history, a sweep job refused another config's checkpoints, and a sweep whose jobs share one folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from conftest import read_metrics, run_cli

from onn.errors import UserError
from onn.training.checkpoints import load, resolve, run_best, save

TRAIN = [
    "model=llama_tiny",
    "hardware=cpu_16gb",
    "data.builtin.train_size=40",
    "data.builtin.val_size=8",
    "tracking=none",
    "task.validate_before=false",
    "task.exact_match_samples=0",
    "trainer.max_steps=2",
]


def a_checkpoint(path: Path, **fields: object) -> None:
    save({"state_dict": {"w": torch.arange(4.0)}, "global_step": 3, **fields}, path)


def test_ckpt_dot_in_a_run_folder_finds_its_last_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """`ckpt=.` from inside a run folder raised ValueError ('.' has an empty name) while building the NAME.ckpt
    candidate, also in hydra.run.dir's ${onn.ckpt:model}: a traceback where the checkpoint was right there."""
    run = tmp_path / "run"
    a_checkpoint(run / "checkpoints" / "last.ckpt")
    monkeypatch.chdir(run)
    found = resolve(".", tmp_path / "outputs")
    assert found.resolve() == (run / "checkpoints" / "last.ckpt").resolve()
    assert torch.equal(load(found)["state_dict"]["w"], torch.arange(4.0))
    with pytest.raises(UserError, match="no ONN checkpoint there"):  # `/` has no name either: one sentence
        resolve("/", tmp_path / "outputs")


def test_a_nan_score_in_the_earlier_runs_history_does_not_hide_a_better_resumed_best(tmp_path: Path):
    """An earlier run whose first validation gave NaN (Lightning ranks NaN last) made min() of its history NaN: the
    resumed run's better best.ckpt was replaced by the earlier one, and the run's best score read NaN."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    earlier = tmp_path / "earlier" / "checkpoints"
    history = [{"epoch": 0, "val/loss": float("nan")}, {"epoch": 1, "val/loss": 0.5}]
    a_checkpoint(earlier / "last.ckpt", onn={"history": history})
    a_checkpoint(earlier / "best.ckpt")
    run = tmp_path / "resumed"
    ours = run / "checkpoints" / "best.ckpt"
    save({"state_dict": {"w": torch.ones(4)}}, ours)
    callback = ModelCheckpoint(dirpath=run / "checkpoints", monitor="val/loss", mode="min")
    callback.best_model_path, callback.best_model_score = str(ours), torch.tensor(0.25)  # as its fit leaves them

    path, score = run_best(callback, earlier / "last.ckpt", run, "val/loss", "min")
    assert (path, score) == (str(ours), 0.25)
    assert torch.equal(load(ours)["state_dict"]["w"], torch.ones(4))  # not the earlier run's weights

    callback.best_model_score = torch.tensor(0.75)  # worse than the earlier run's 0.5: its best is copied in
    path, score = run_best(callback, earlier / "last.ckpt", run, "val/loss", "min")
    assert (path, score) == (str(ours), 0.5)
    assert torch.equal(load(ours)["state_dict"]["w"], torch.arange(4.0))


@pytest.mark.slow  # two CLI runs: about 20-40 s on two busy cores
def test_a_sweep_job_refused_another_configs_checkpoints_is_refused_again_when_run_again(tmp_path: Path):
    """The refused job's failed record took this job's config_digest, so the same sweep run again found 'its own'
    digest beside the other config's checkpoints and resumed from them: the other run's model, trained on."""
    sweep = tmp_path / "sweep"
    job = sweep / "0"
    a_checkpoint(job / "checkpoints" / "last.ckpt")
    other = {"status": "failed", "error": "killed", "task": "train", "config_digest": "0123456789abcdef"}
    (job / "metrics.json").write_text(json.dumps(other))
    command = ["-m", *TRAIN, f"paths.outputs={tmp_path / 'outputs'}", f"hydra.sweep.dir={sweep}"]

    for attempt in (1, 2):
        proc = run_cli(*command)
        assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
        m = read_metrics(job)
        assert m["status"] == "failed" and "of a run of another config" in m["error"], (attempt, m["error"])
        assert m["config_digest"] == "0123456789abcdef"  # the checkpoints' config: only a run of it resumes them
    assert load(job / "checkpoints" / "last.ckpt")["global_step"] == 3  # never trained over


@pytest.mark.slow  # a sweep of two jobs: 38 s on two busy cores
def test_a_sweep_whose_jobs_share_one_folder_ends_before_the_second_overwrites_the_first(tmp_path: Path):
    """hydra.sweep.subdir that is the same for every job: each job wrote its .hydra/, config.yaml, plan and
    metrics.json over the one before, and the sweep ended `ok` with one record for two jobs."""
    sweep, shared = tmp_path / "sweep", tmp_path / "sweep" / "one"
    proc = run_cli(
        "-m",
        "task=plan",
        "model=llama_tiny",
        "hardware=cpu_16gb",
        "tracking=none",
        "optim.lr=0.001,0.0002",
        "hydra.sweep.subdir=one",
        f"hydra.sweep.dir={sweep}",
        f"paths.outputs={tmp_path / 'outputs'}",
    )
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"hydra.sweep.subdir=one gives job 1 the folder {shared.resolve()}, where job 0" in proc.stderr
    assert read_metrics(shared)["status"] == "ok"
    assert yaml.safe_load((shared / "config.yaml").read_text())["optim"]["lr"] == 0.001  # job 0's, kept
    assert "optim.lr=0.001" in yaml.safe_load((shared / ".hydra" / "overrides.yaml").read_text())


GSM8K = Path("/work/shared/data/gsm8k/train.jsonl")


def test_a_misspelt_data_key_of_a_data_auto_run_is_one_sentence_naming_the_nearest(tmp_path: Path):
    """data=auto composes the config again with the data config it found: a misspelt +data.KEY failed there with
    Hydra's ConfigCompositionException, whose advice was to write +data.KEY, what the user had written."""
    if not GSM8K.is_file():
        pytest.skip(f"{GSM8K} is absent")
    run = tmp_path / "run"
    proc = run_cli(
        "task=plan",
        "data=auto",
        f"data.source={GSM8K}",
        "+data.batch_sise=8",
        "hardware=cpu_16gb",
        "tracking=none",
        f"paths.outputs={tmp_path / 'outputs'}",
        f"hydra.run.dir={run}",
    )
    said = "+data.batch_sise: data=text, which data=auto chose, has no key batch_sise (did you mean data.batch_size?)"
    assert proc.returncode == 1 and said in proc.stdout + proc.stderr, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "To append to your config" not in proc.stdout + proc.stderr
    m = read_metrics(run)
    assert m["status"] == "failed" and m["error"].startswith(said)


@pytest.mark.slow  # a sweep of three jobs
def test_a_shared_folder_is_refused_to_another_config_only_and_named_as_written(tmp_path: Path):
    """A value listed twice gives two jobs of one config one folder: the second finds the first's record (it was
    refused as a job that would replace it). The refusal names the subdir as written, not its resolved value."""
    sweep = tmp_path / "sweep"
    proc = run_cli(
        "-m",
        "task=plan",
        "model=llama_tiny",
        "hardware=cpu_16gb",
        "tracking=none",
        "optim.lr=0.001,0.001,0.0002",
        "hydra.sweep.subdir=${hydra.job.name}",
        f"hydra.sweep.dir={sweep}",
        f"paths.outputs={tmp_path / 'outputs'}",
    )
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    said = proc.stderr.replace("\n", " ")
    assert "hydra.sweep.subdir=${hydra.job.name} gives job 2 the folder" in said and "where job 0" in said, said
    assert "gives job 1" not in said
