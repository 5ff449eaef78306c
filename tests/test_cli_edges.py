"""A user's command line at its edges, as a review of it found them (2026-12-05): a misspelt recipe or key that
ran the default job without a word, a sweep whose failed jobs exited 0, values that passed the type check and ended
in a library's traceback, a recipe file that does not parse, a misspelt sweep_objective found only after the whole
search. Each is one sentence now, and a sweep with a failed job exits 1."""

from __future__ import annotations

import logging

import pytest
from conftest import compose, run_cli
from hydra.errors import MissingConfigException

from onn.errors import UserError


def test_a_misspelt_recipe_fails_at_compose_time():
    """`- optional recipe: null` let recipe=phi4_locl run the default job; Hydra now names the options."""
    with pytest.raises(MissingConfigException, match="recipe/phi4_locl"):
        compose("recipe=phi4_locl")


def test_a_key_no_dataclass_has_is_one_sentence_with_the_closest_name():
    """Hydra's advice for a misspelt key, `+trainer.max_step=3`, added it; OmegaConf then dropped it without a
    word and the run kept max_steps 200."""
    with pytest.raises(
        UserError, match=r"^trainer\.max_step is not a key of ONN's config \(did you mean trainer\.max_steps\?\)"
    ):
        compose("+trainer.max_step=3")
    with pytest.raises(UserError, match=r"^optim\.lrr is not a key"):
        compose("+optim.lrr=0.1")
    assert compose("model=v28_cnn", "++model.kwargs={widths: [8]}").model.kwargs == {"widths": [8]}  # free-form: kept


@pytest.mark.parametrize(
    "override, sentence",
    [
        ("optim.betas=[0.9]", r"optim\.betas=\[0\.9\]: give two numbers"),
        ("optim.momentum=-1", r"optim\.momentum=-1\.0: give a number 0 or more"),
        ("optim.gamma=2", r"optim\.gamma=2\.0: give a number from 0 to 1"),
        ("optim.pct_start=0", r"optim\.pct_start=0\.0: give a number above 0 and below 1"),
        ("trainer.devices=abc", r"trainer\.devices='abc': give auto, a count"),
        ("trainer.precision=64bit", r"trainer\.precision='64bit': give auto \(the plan's\), or one of Lightning's"),
        ("trainer.accelerator=tpu", r"trainer\.accelerator='tpu': give one of auto, cpu, cuda"),
        ("trainer.num_nodes=0", r"trainer\.num_nodes=0: give a whole number, 1 or more"),
    ],
)
def test_values_lightning_and_torch_would_refuse_with_a_traceback_are_one_sentence(override, sentence):
    from onn.training.optim import check as check_optim
    from onn.training.trainer import check as check_trainer

    cfg = compose(override)
    with pytest.raises(UserError, match=sentence):
        check_optim(cfg.optim)
        check_trainer(cfg.trainer)


def test_lightnings_precision_aliases_and_device_lists_pass():
    from onn.training.trainer import check

    for override in ("trainer.precision=32", "trainer.precision=bf16", "trainer.devices=[0,1]", "trainer.devices=-1"):
        check(compose(override).trainer)


def test_device_counts_layers_and_checkpointing_of_the_wrong_kind_are_one_sentence(tmp_path):
    """hardware.count=0 divided by zero in the multi-device plan; `strategy.layers=abc` said "block index 'a' is
    out of range"; `strategy.gradient_checkpointing=maybe` was read as off."""
    from onn.hardware.profile import resolve
    from onn.modalities import get

    cases = [
        (("hardware.count=0", "task=plan"), r"hardware\.count=0: give a whole number of devices per node"),
        (("strategy=sparse_lora", "strategy.layers=abc"), r"strategy\.layers='abc': give all, or a list"),
        (("strategy.gradient_checkpointing=maybe",), r"strategy\.gradient_checkpointing='maybe': give true"),
    ]
    for overrides, sentence in cases:
        cfg = compose(*overrides, f"paths.cache={tmp_path}")
        with pytest.raises(UserError, match=sentence):
            get("text").plan(cfg, resolve(cfg.hardware, tmp_path, tmp_path))


def test_a_recipe_file_that_does_not_parse_is_one_sentence_naming_its_line(tmp_path):
    """Hydra printed its YAML parser's traceback, 83 lines."""
    from onn.config.registry import yaml_problem

    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "typo.yaml").write_text("trainer:\n max_steps: 3\n  max_epochs: 1\n")
    (tmp_path / "recipe" / "fine.yaml").write_text("trainer:\n  max_steps: 3\n")
    problem = yaml_problem(["recipe=fine", "trainer.max_steps=2", "-m", "recipe=fine,typo"], tmp_path)
    assert problem is not None and problem.startswith(f"{tmp_path.resolve()}/recipe/typo.yaml line 3, column 13:")
    assert yaml_problem(["recipe=fine", "recipe=missing"], tmp_path) is None


def test_a_misspelt_sweep_objective_stops_the_sweep_at_the_first_job(caplog):
    """Every trial returned None, and Optuna ended the search with "No trials are completed yet" (a traceback)."""
    from onn.app import _objective

    metrics = {"status": "ok", "val/loss_final": 1.5, "val/acc": 0.5}
    assert _objective("val/loss_final", metrics) == 1.5 and _objective("val/loss_final", {"status": "failed"}) is None
    with caplog.at_level(logging.ERROR, logger="onn"), pytest.raises(SystemExit):
        _objective("val/loss_finl", metrics)
    assert "did you mean val/loss_final?" in caplog.text


def test_a_record_that_cannot_make_its_folder_is_one_sentence(tmp_path):
    """The temporary file's name was set inside the try, so a folder that could not be made raised
    UnboundLocalError instead of the sentence."""
    from onn.tasks.record import RunRecord

    (tmp_path / "taken").write_text("a file where the run's folder goes")
    with pytest.raises(UserError, match="taken"):
        RunRecord(tmp_path / "taken" / "run", {"status": "ok"}).write()


def test_a_sweep_with_a_failed_job_exits_1_and_names_it(tmp_path):
    """Each job fails on its own and the sweep goes on, but the sweep exited 0 with a job failed."""
    done = run_cli(
        "-m", "task=plan", "data.batch_size=4,0", f"paths.outputs={tmp_path}", f"hydra.sweep.dir={tmp_path / 'sweep'}"
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert "1 job(s) of the sweep did not end ok (job 1: failed: data.batch_size=0: give a whole number" in done.stderr
    assert '"status": "ok"' in (tmp_path / "sweep" / "0" / "metrics.json").read_text()


def test_a_sweep_into_a_folder_of_another_sweeps_finished_jobs_is_refused_before_it_writes(tmp_path):
    """A sweep run into the folder of another sweep took over its job folders (0, 1, ...): .hydra/ and the finished
    jobs' metrics.json were overwritten."""
    sweep = tmp_path / "sweep"
    common = ("task=plan", f"paths.outputs={tmp_path}", f"hydra.sweep.dir={sweep}")
    assert run_cli("-m", *common, "data.batch_size=4").returncode == 0
    files = lambda: {p: p.read_bytes() for p in sorted(sweep.rglob("*")) if p.is_file() and p.name != ".onn.lock"}  # noqa: E731
    before = files()
    other = run_cli("-m", *common, "data.batch_size=2")
    assert other.returncode == 1
    assert f"hydra.sweep.dir={sweep} holds the finished jobs of another sweep" in other.stderr
    assert files() == before  # the same overrides again resume it: tests/test_bench.py's grid test


@pytest.mark.slow  # three runs
def test_a_run_into_a_folder_of_an_earlier_runs_checkpoints_is_refused_unless_it_resumes(tmp_path):
    """A killed run's folder given again (a scheduler's requeue with a fixed folder) had its last.ckpt replaced by
    the new run's step 1 without a word, and its metrics.json and config with it."""
    run = tmp_path / "run"
    common = (f"paths.outputs={tmp_path}", f"hydra.run.dir={run}", "tracking=none", "task.validate_before=false")
    first = run_cli(*common, "trainer.max_steps=2", "checkpoint.every_n_steps=1", "task.exact_match_samples=0")
    assert first.returncode == 0, first.stderr[-2000:]
    files = lambda: {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file() and p.name != ".onn.lock"}  # noqa: E731
    before = files()
    again = run_cli(*common, "trainer.max_steps=1")
    assert again.returncode == 1
    assert f"hydra.run.dir={run} holds an earlier run's checkpoints (last.ckpt) that this run would replace" in (
        again.stderr
    )
    assert files() == before
    resumed = run_cli(*common, "trainer.max_steps=3", f"ckpt={run}", "task.exact_match_samples=0")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert '"steps": 3' in (run / "metrics.json").read_text()
