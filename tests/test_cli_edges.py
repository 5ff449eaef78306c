"""A user's command line at its edges, as a review of it found them (2026-12-05): a misspelt recipe or key that
ran the default job without a word, a sweep whose failed jobs exited 0, values that passed the type check and ended
in a library's traceback, a recipe file that does not parse, a misspelt sweep_objective found only after the whole
search. Each is one sentence now, and a sweep with a failed job exits 1."""

from __future__ import annotations

import logging

import pytest
from conftest import ROOT, compose, run_cli
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

    for override in ("trainer.precision=32", "trainer.precision=bf16", "trainer.devices=[0,1]"):
        check(compose(override).trainer)
    check(compose("trainer.devices=-1").trainer, launches=False)  # a plan's; a run on a CPU refuses it (round94)


@pytest.mark.slow  # (30 to 45 s on 2 cores: three text plans on this machine, each measuring what it plans from)
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


@pytest.mark.slow  # moved to the slow tier: the fast suite stays under 10 minutes on 2 cores
def test_a_sweep_with_a_failed_job_exits_1_and_names_it(tmp_path):
    """Each job fails on its own and the sweep goes on, but the sweep exited 0 with a job failed."""
    done = run_cli(
        "-m", "task=plan", "data.batch_size=4,0", f"paths.outputs={tmp_path}", f"hydra.sweep.dir={tmp_path / 'sweep'}"
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert "1 job(s) of the sweep did not end ok (job 1: failed: data.batch_size=0: give a whole number" in done.stderr
    assert '"status": "ok"' in (tmp_path / "sweep" / "0" / "metrics.json").read_text()


@pytest.mark.slow  # moved to the slow tier: the fast suite stays under 10 minutes on 2 cores
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


def test_a_key_under_a_block_that_is_null_here_is_one_sentence_naming_the_block():
    """OmegaConf asserted on a null block ("Unexpected type for root: NoneType"), and Hydra printed 23 lines of
    traceback: serve is null unless task=serve gives it, data.builtin is null for a file's data (data=gsm8k)."""
    from onn.config.registry import compose_problem

    conf = ROOT / "conf"
    assert compose_problem(["task=plan", "serve.slots=4"], conf) == (
        "serve.slots=4: serve is null in this config, so it has no slots to set; choose an option that gives serve "
        "(task=serve, task=bench_serve), then set serve.slots=4."
    )
    problem = compose_problem(["data=gsm8k", "data.source=x.jsonl", "data.builtin.train_size=32"], conf)
    assert problem is not None and problem.startswith("data.builtin.train_size=32: data.builtin is null in this")
    problem = compose_problem(["data=diffusion", "data.augment.color_jitter.brightness=0.2"], conf)
    assert problem is not None and problem.endswith("then set data.augment.color_jitter.brightness=0.2.")
    # where the block is there, it is Hydra's to compose; a block given whole cannot fill a null one (a traceback)
    assert compose_problem(["data.builtin.train_size=32"], conf) is None
    assert compose_problem(["task=serve", "serve.slots=4"], conf) is None
    problem = compose_problem(["data=gsm8k", "+data.builtin={train_size: 32}", "data.builtin.val_size=8"], conf)
    assert problem is not None and problem.startswith("data.builtin={train_size: 32}: data.builtin is null in this")


def test_a_recipe_given_twice_or_as_a_list_is_refused():
    """recipe=a recipe=b ran b alone without a word (.hydra/overrides.yaml listed both); recipe=[a,b] merged both
    into one config and failed on the first key of one that the other's data schema lacks."""
    from onn.config.registry import group_problem

    conf = ROOT / "conf"
    assert group_problem(["recipe=phi4_math_sparse_lora", "recipe=char_lstm", "task=plan"], conf) == (
        "recipe is given twice (phi4_math_sparse_lora, char_lstm); a run takes one recipe: copy one and add the "
        "other's keys."
    )
    assert group_problem(["recipe=[phi4_math_sparse_lora,char_lstm]"], conf) == (
        "recipe=[phi4_math_sparse_lora,char_lstm]: a run takes one recipe, not a list; copy one and add the "
        "other's keys."
    )
    assert "model is given twice (llama_tiny, phi4_tiny)" in group_problem(
        ["model=llama_tiny", "model=phi4_tiny"], conf
    )
    assert group_problem(["recipe=char_lstm", "recipe=char_lstm", "-m", "model=llama_tiny,phi4_tiny"], conf) is None


def test_a_recipe_run_as_another_task_names_the_task_its_keys_belong_to():
    """recipe=bench_chaos task=plan failed in Hydra's terms ("Key 'tracks' not in 'TrainTask'"); recipe=bench_serve
    task=plan asked for serve.host, then serve.port, ... on the command line, thirteen keys one at a time."""
    from onn.config.registry import compose_problem

    assert compose_problem(["recipe=bench_chaos", "task=plan"], ROOT / "conf") == (
        "recipe=bench_chaos sets task.tracks, a key of task=bench_chaos (the task the recipe names), and task=plan "
        "has no such key; run the recipe with its own task, or copy the recipe and drop its task.* keys."
    )
    assert compose_problem(["recipe=bench_chaos", "task=bench_chaos"], ROOT / "conf") is None
    with pytest.raises(UserError, match=r"^serve\.host has no value: serve\.\* holds the settings of task=serve and "):
        compose("recipe=bench_serve", "task=plan")
    assert compose("recipe=bench_serve", "task=plan", "~serve").serve is None  # what the sentence says to do


@pytest.mark.slow  # 22-32 s on 2 cores (ci136)
def test_the_command_lines_compose_mistakes_are_one_sentence_before_hydra(tmp_path):
    """run.py asks registry's checks before Hydra composes: each is `error: ...` and exit 1, no traceback."""
    where = (f"paths.outputs={tmp_path}", f"hydra.run.dir={tmp_path / 'run'}")
    for args, said in [
        (("task=plan", "serve.slots=4"), "error: serve.slots=4: serve is null in this config"),
        (("recipe=char_lstm", "recipe=optuna_lr", "task=plan"), "error: recipe is given twice (char_lstm, optuna_lr)"),
        (("recipe=bench_chaos", "task=plan"), "error: recipe=bench_chaos sets task.tracks, a key of task=bench_chaos"),
    ]:
        done = run_cli(*args, *where)
        assert done.returncode == 1 and said in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "override, sentence",
    [
        ("seed=-1", r"^seed=-1: give a whole number from 0 to 4294967295\.$"),  # numpy's ValueError mid-run
        ("seed=18446744073709551617", r"^seed=18446744073709551617: give a whole number from 0 to 4294967295"),
        ("task.exact_match_samples=-1", r"^task\.exact_match_samples=-1: give a whole number, 0 \(none\) or more"),
        ("task.early_stopping.patience=-1", r"^task\.early_stopping\.patience=-1: give a whole number of validations"),
        # task=plan said "plan ok" for the optimizer and trainer settings training refuses
        ("optim.lr=-1", r"^optim\.lr=-1\.0: give a number 0 or more"),
        ("optim.schedule=bogus", r"^optim\.schedule='bogus' is not one of cosine"),
        ("trainer.max_steps=-5", r"^trainer\.max_steps=-5: give a whole number, 1 or more, or -1"),
    ],
)
def test_numbers_training_refuses_are_refused_by_a_plan_before_it_plans(tmp_path, override, sentence):
    """exact_match_samples=-1 scored every held-out problem but the last (examples[:-1]) and reported 7 of 8."""
    from onn.app import execute

    cfg = compose("task=plan", override, f"paths.outputs={tmp_path}")
    with pytest.raises(UserError, match=sentence):
        execute(cfg, tmp_path / "run")
    assert not (tmp_path / "run" / "plan.yaml").exists()


def test_an_evaluations_negative_sample_count_is_one_sentence():
    """task.max_samples=-1 scored all but the last held-out sample, as exact_match_samples did."""
    from onn.app import check_run_numbers

    with pytest.raises(UserError, match=r"^task\.max_samples=-1: give a whole number, 0 \(none\) or more\.$"):
        check_run_numbers(compose("task=eval", "task.max_samples=-1"))
    check_run_numbers(compose("task=eval", "task.max_samples=0", "seed=4294967295"))
