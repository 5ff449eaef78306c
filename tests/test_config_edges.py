"""The config at its edges, as a review of it found them (2026-12-06): advice for a key under a null block that
ended in a traceback when followed, data=auto without a source, held-out files of built-in data ignored, keys
accepted and never read, Trainer arguments Lightning refused mid-run (or a training that trained nothing), `~` in
paths (a literal folder named ~ beside the checked one), a recipe's block under an option that leaves it null, a
misspelt ${...}, and an empty ONN_CACHE. Each is one sentence now, or works."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import pytest
from conftest import ROOT, compose, read_metrics, run_cli

from onn.errors import UserError

CONF = ROOT / "conf"
PLAN = ("task=plan", "hardware=cpu_16gb", "tracking=none")


def _advised(argv: list[str], problem: str) -> list[str]:
    """The command line the sentence advises: its first option instead of the user's choice of that group, and
    the keys to set instead of the one refused."""
    found = re.search(r"choose an option that gives (\S+) \(([^,)\s]+).*\), then set (.+)\.$", problem)
    assert found is not None, problem
    block, option, sets = found[1], found[2], found[3].split(" ")
    group = option.split("=")[0]
    kept = [a for a in argv if not a.lstrip("+").startswith((block, f"{group}="))]
    return [*kept, option, *sets]


@pytest.mark.parametrize(
    "argv, key, value",
    [
        (["strategy=full", "strategy.lora.r=4", "task=plan"], "strategy.lora.r", 4),
        (["strategy=full", "strategy.lora={r: 4}", "task=plan"], "strategy.lora.r", 4),
        (["task=plan", "serve.slots=4"], "serve.slots", 4),
        (["task=plan", "+serve={slots: 4}"], "serve.slots", 4),
        (["data=gsm8k", "data.source=x.jsonl", "data.builtin.train_size=32"], "data.builtin.train_size", 32),
        (["data=gsm8k", "data.source=x.jsonl", "++data.builtin={train_size: 32}"], "data.builtin.train_size", 32),
    ],
)
def test_a_key_or_block_under_a_null_block_names_the_option_that_gives_it_and_the_advice_runs(argv, key, value):
    """`strategy=full strategy.lora.r=4` advised `strategy.lora={r: 4}`, which Hydra could not merge into the null
    block (AttributeError, 46 lines); the whole block given, with +, ++ or neither, was that traceback at once."""
    from omegaconf import OmegaConf

    from onn.config import as_dict
    from onn.config.registry import compose_problem

    problem = compose_problem(argv, CONF)
    assert problem is not None and "is null in this config" in problem
    advised = _advised(argv, problem)
    assert compose_problem(advised, CONF) is None
    assert OmegaConf.select(OmegaConf.create(as_dict(compose(*advised))), key) == value


@pytest.mark.slow  # moved to the slow tier: the fast suite stays under 10 minutes on 2 cores
def test_a_block_given_whole_for_a_null_block_is_one_sentence_on_the_command_line():
    done = run_cli("strategy=full", "strategy.lora={r: 4}", "task=plan")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip() == (
        "error: strategy.lora={r: 4}: strategy.lora is null in this config, so it cannot be given whole on the "
        "command line; choose an option that gives strategy.lora (strategy=lora, strategy=auto, strategy=qlora, "
        "strategy=sparse_lora), then set strategy.lora.r=4."
    )


def test_data_auto_without_a_source_says_so_as_data_text_does():
    """compose_detected read data.source before anything checked it: MissingMandatoryValue, a traceback."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from onn.app import compose_detected

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = hydra_compose("config", overrides=[f"paths.root={ROOT}", "data=auto", "task=plan"])
        with pytest.raises(UserError, match=r"^data\.source has no value: give it on the command line \(data\.source"):
            compose_detected(cfg, ["data=auto", "task=plan"])


def test_builtin_math_data_reads_a_given_val_source(tmp_path):
    """`task=eval ckpt=RUN data.val_source=my.jsonl` scored the generator's own split while its record named the
    file. Needs /tmp/rv2/fix_config/sources_val_source.diff in onn/modalities/text/sources.py."""
    from onn.modalities.text.sources import load_splits

    held_out = tmp_path / "mine.jsonl"
    rows = [{"input": f"What is {i} + 1?", "output": str(i + 1)} for i in range(3)]
    held_out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = compose(f"data.val_source={held_out}", "data.builtin.train_size=5")
    train, val = load_splits(config.data, config.seed)
    assert len(train) == 5 and [r["input"] for r in val] == [r["input"] for r in rows]


def test_a_held_out_fraction_of_builtin_math_data_is_refused(tmp_path):
    """data.val_split was ignored without a word: the generator draws its own held-out problems."""
    from onn.app import execute

    config = compose("data.val_split=0.2", *PLAN, f"paths.outputs={tmp_path}")
    with pytest.raises(UserError, match=r"^data\.val_split=0\.2: builtin:math data has its own held-out split"):
        execute(config, tmp_path / "run", {"data.val_split"})
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "overrides",
    [
        ("strategy=lora", "strategy.quantize=nf4"),  # planned a plain LoRA
        ("strategy=qlora", "strategy.quantize=banana"),  # planned fine
        ("strategy=full", "strategy.trainable=lora"),
        ("recipe=mesh_primitives", "model.dtype=banana"),  # a classifier's weights are float32
        ("model=ddpm_unet", "data=diffusion", "model.dtype=float16"),
    ],
)
def test_keys_nothing_read_are_no_keys_of_the_config(overrides):
    """strategy.quantize, strategy.trainable and a classifier's or denoiser's model.dtype were accepted, saved and never
    read: the strategy's name says what trains and how (qlora: an NF4 base)."""
    from hydra.errors import ConfigCompositionException

    *choices, given = overrides
    key = given.split("=")[0]
    with pytest.raises(ConfigCompositionException, match=f"Could not override '{re.escape(key)}'"):
        compose(*overrides)
    with pytest.raises(UserError, match=rf"^{re.escape(key)} is not a key of ONN's config"):
        compose(*choices, f"+{given}")


def test_a_checkpoints_saved_config_with_keys_that_are_gone_still_loads():
    """A checkpoint written before holds strategy.trainable, strategy.quantize and a classifier's model.dtype."""
    from onn.config import StrategyConfig, typed
    from onn.config.model import NetworkConfig
    from onn.training.checkpoints import saved_config

    saved = saved_config(ROOT / "tests" / "data" / "mesh_b6b1dee.ckpt")
    assert {"trainable", "quantize"} <= set(saved["strategy"]) and "dtype" in saved["model"]
    assert typed(StrategyConfig, saved["strategy"], "ckpt").name == "full"
    assert typed(NetworkConfig, saved["model"], "ckpt").source == "zoo:pointnet"


@pytest.mark.parametrize(
    "change, sentence",
    [
        ({"limit_train_batches": "abc"}, r"trainer\.limit_train_batches='abc': give a number of batches"),
        ({"limit_val_batches": 1.5}, r"trainer\.limit_val_batches=1\.5: give a number of batches"),
        ({"limit_test_batches": -1}, r"trainer\.limit_test_batches=-1: give a number of batches"),
        ({"check_val_every_n_epoch": 0}, r"trainer\.check_val_every_n_epoch=0: give a whole number of epochs"),
        ({"num_sanity_val_steps": -5}, r"trainer\.num_sanity_val_steps=-5: give a whole number, 0 or more, or -1"),
    ],
)
def test_trainer_arguments_lightning_takes_as_they_are_are_checked_before_anything_is_built(tmp_path, change, sentence):
    """limit_train_batches=abc was Lightning's TypeError, check_val_every_n_epoch=0 a ZeroDivisionError after the
    data and model were built."""
    from onn.app import execute

    config = compose("recipe=mesh_primitives", "tracking=none", f"paths.outputs={tmp_path}")
    config.trainer = dataclasses.replace(config.trainer, **change)
    with pytest.raises(UserError, match=sentence):
        execute(config, tmp_path / "run")
    assert not (tmp_path / "run" / "config.yaml").exists()  # refused before the run wrote anything


def test_values_lightning_accepts_pass_the_check():
    from onn.training.trainer import check

    trainer = compose("recipe=mesh_primitives").trainer
    for change in ({"limit_train_batches": 0.5, "limit_val_batches": 0, "limit_test_batches": 3},
                   {"check_val_every_n_epoch": 2, "num_sanity_val_steps": -1}, {"max_steps": 0}):  # fmt: skip
        check(dataclasses.replace(trainer, **change), trains="max_steps" not in change)


@pytest.mark.parametrize(
    "overrides",
    [
        ("trainer.max_steps=0", "trainer.max_epochs=1"),
        ("trainer.max_epochs=0", "trainer.max_steps=-1"),
        ("trainer.max_epochs=0",),
        ("trainer.limit_train_batches=0",),
        ("trainer.limit_train_batches=0.0",),
    ],
)
def test_a_classifier_training_run_that_would_train_nothing_is_refused(tmp_path, overrides):
    """recipe=mesh_primitives with max_steps=0, max_epochs=0 or limit_train_batches=0 ended "train ok", steps 0."""
    from onn.app import execute

    key = overrides[0].split("=")[0]
    config = compose("recipe=mesh_primitives", "tracking=none", f"paths.outputs={tmp_path}", *overrides)
    with pytest.raises(UserError, match=rf"^{re.escape(key)}=0(\.0)?: a training run would take no step"):
        execute(config, tmp_path / "run")


def test_tilde_in_a_command_line_value_is_the_home_folder():
    """bash leaves `data.source=~/shapes` as it is (no variable assignment), and Hydra's parser refused the `~`."""
    from onn.config.registry import expand_home

    home = os.path.expanduser("~")
    given = ["data.source=~/shapes", 'hydra.run.dir="~/r1"', "a=~/x,~/y", "+x=[~/a]", "paths.outputs=~"]
    assert expand_home(given) == [
        f"data.source={home}/shapes", f'hydra.run.dir="{home}/r1"', f"a={home}/x,{home}/y", f"+x=[{home}/a]",
        f"paths.outputs={home}",
    ]  # fmt: skip
    kept = ["~strategy.lora", 'prompt="~hello"', "--config-dir=~/x", "p=a~/b", "q=~nobody_here/x"]
    assert expand_home(kept) == kept


@pytest.mark.slow  # moved to the slow tier: the fast suite stays under 10 minutes on 2 cores
def test_a_quoted_tilde_run_folder_is_the_folder_onn_checks_and_locks(tmp_path, monkeypatch):
    """`'hydra.run.dir="~/r1"'`: ONN checked and locked $HOME/r1 while Hydra wrote ./~/r1, so a second run
    replaced an earlier training record there unprotected."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    done = run_cli(*PLAN, 'hydra.run.dir="~/r1"', "paths.outputs=~/outputs", cwd=cwd)
    assert done.returncode == 0, done.stderr[-2000:]
    assert read_metrics(home / "r1")["status"] == "ok" and (home / "r1" / ".onn.lock").exists()
    assert list(cwd.iterdir()) == []  # no folder named ~


def test_a_tilde_run_folder_hydra_would_take_literally_is_refused():
    """A `~` that reaches Hydra (a YAML value, an interpolation) makes a folder named ~: one sentence instead."""
    from onn.tasks.record import literal_folder

    assert literal_folder("runs/~x", "hydra.run.dir") == Path("runs/~x")
    with pytest.raises(UserError, match=r"^hydra\.sweep\.dir=~/s: Hydra does not expand ~ in its run folders"):
        literal_folder("~/s", "hydra.sweep.dir")


@pytest.mark.slow  # 18-31 s on 2 cores (ci133)
def test_a_recipe_whose_block_the_chosen_option_leaves_null_names_both(tmp_path):
    """recipe=phi4_math_sparse_lora strategy=full said "strategy.lora.target_modules has no value: give it on the
    command line", which would only add a LoRA block that strategy=full never reads."""
    done = run_cli("recipe=phi4_math_sparse_lora", "strategy=full", *PLAN, f"paths.outputs={tmp_path}")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert (
        "recipe=phi4_math_sparse_lora sets strategy.lora, which strategy=full leaves null, so "
        "strategy.lora.target_modules has no value; run the recipe with its own strategy (strategy=sparse_lora), or "
        "copy the recipe and drop its strategy.lora keys."
    ) in done.stdout  # the run's log


@pytest.mark.slow  # 14-28 s on 2 cores (ci133, ci135)
def test_a_misspelt_interpolation_is_one_sentence_and_a_failed_record(tmp_path):
    """'trainer.val_check_interval=${trainer.max_step}' was a traceback from reading Hydra's overrides, with no
    metrics.json."""
    run = tmp_path / "run"
    done = run_cli(*PLAN, "trainer.val_check_interval=${trainer.max_step}", f"hydra.run.dir={run}")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    sentence = (
        "trainer.val_check_interval=${trainer.max_step}: Interpolation key 'trainer.max_step' not found; fix the "
        "${...} to name a key of the config"
    )
    assert sentence in done.stdout  # the run's log
    metrics = read_metrics(run)
    assert metrics["status"] == "failed" and metrics["error"].startswith(sentence)


def test_an_empty_onn_cache_is_unset(monkeypatch):
    """ONN_CACHE= (set, empty) put every cache in the working directory, and the hardware profiles at /hardware."""
    monkeypatch.setenv("ONN_CACHE", "")
    monkeypatch.setenv("ONN_HARDWARE_CACHE", "")
    config = compose()
    assert config.paths.cache == f"{ROOT}/outputs/.cache"
    assert config.hardware.cache == f"{ROOT}/outputs/.cache/hardware"
    monkeypatch.setenv("ONN_CACHE", "/elsewhere")
    assert compose().paths.cache == "/elsewhere"


@pytest.mark.parametrize("modality", ["model=llama_tiny", "model=v28_cnn data=image"])
def test_infer_output_a_folder_or_under_a_file_is_one_sentence_before_the_model_runs(tmp_path, modality):
    """task.output was written only after every item was answered: a folder there, or a file where its folder
    should be, ended the run in IsADirectoryError or FileExistsError with the answers lost."""
    from onn.app import execute

    afile = tmp_path / "afile"
    afile.write_text("mine")
    common = ("task=infer", *modality.split(), f"paths.outputs={tmp_path}", f"paths.cache={tmp_path / 'cache'}")
    with pytest.raises(UserError, match=r"^task\.output=.* is a folder: give the file to write"):
        execute(compose(*common, f"task.output={tmp_path}"), tmp_path / "run1")
    with pytest.raises(UserError, match=r"^task\.output=.*afile is a file, so it cannot be a folder"):
        execute(compose(*common, f"task.output={afile}/predictions.jsonl"), tmp_path / "run2")
    assert afile.read_text() == "mine"
