"""The command line's config mistakes, as a second review of the typed config found them (2026-12-07): a misspelt
key that Hydra answered with advice to add it (`+trainer.max_epoch=3`, a key nothing reads), an option that does not
exist answered with the group's whole list and no hint, and a YAML file with a key given twice that passed run.py's
check and ended in Hydra's loader. Each is one sentence naming the closest key or option now."""

from __future__ import annotations

import pytest
from conftest import ROOT, run_cli
from hydra import compose as hydra_compose
from hydra import initialize_config_dir

from onn.errors import UserError

CONF = ROOT / "conf"


@pytest.mark.parametrize(
    "argv, said",
    [
        (["trainer.max_epoch=3"], "trainer.max_epoch=3: trainer.max_epoch is not a key of ONN's config (did you mean "
         "trainer.max_epochs?); fix its name (docs/config.md lists the groups' keys)."),
        (["trainr.max_steps=3"], "trainr.max_steps=3: trainr.max_steps is not a key of ONN's config (did you mean "
         "trainer?); fix its name (docs/config.md lists the groups' keys)."),
        (["seeds=3"], "seeds=3: seeds is not a key of ONN's config (did you mean seed?); fix its name "
         "(docs/config.md lists the groups' keys)."),
        (["model=v28_cnn", "data=mnist", "data.augment.hflp=0.5"], "data.augment.hflp=0.5: data.augment.hflp is not "
         "a key of ONN's config (did you mean data.augment.hflip?); fix its name (docs/config.md lists the groups' "
         "keys)."),
    ],
)  # fmt: skip
def test_a_misspelt_key_is_one_sentence_naming_the_closest_key(argv, said):
    """Hydra said "Could not override 'trainer.max_epoch'. To append to your config use +trainer.max_epoch=3": the
    key it advised is one no dataclass has."""
    from onn.config.registry import compose_problem

    assert compose_problem(argv, CONF) == said


def test_keys_of_free_form_blocks_and_good_keys_are_not_taken_for_misspelt_ones():
    from onn.config.registry import compose_problem

    argv = ["model=llama_tiny", "model.architecture.hidden_size=32", "trainer.max_epochs=2", "model.source=random"]
    assert compose_problem(argv, CONF) is None
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):  # and Hydra takes each as it is
        assert hydra_compose("config", overrides=argv).model.architecture.hidden_size == 32


@pytest.mark.slow  # a run.py process (50 s on 2 busy cores, its first start)
def test_a_misspelt_key_on_the_command_line_is_one_sentence_before_hydra(tmp_path):
    done = run_cli("trainer.max_epoch=3", "task=plan", f"hydra.run.dir={tmp_path / 'run'}")
    assert done.returncode == 1, done.stderr[-2000:]
    assert "error: trainer.max_epoch=3: trainer.max_epoch is not a key of ONN's config (did you mean " in done.stderr
    assert "+trainer.max_epoch" not in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "run").exists()


def test_an_option_that_does_not_exist_names_the_closest_and_the_others():
    """Hydra listed the group's 40 models ("Could not find 'model/lama_small'"), leaving llama_small to be found."""
    from onn.config.registry import group_problem

    problem = group_problem(["model=lama_small", "task=plan"], CONF)
    assert problem is not None and problem.startswith(
        "model=lama_small: conf/model has no option lama_small (did you mean model=llama_small?); give one of "
    )
    assert "llama_tiny" in problem and "v28_cnn" in problem
    problem = group_problem(["-m", "model=llama_tiny,lama_small"], CONF)  # one name of a sweep
    assert problem is not None and "has no option lama_small (did you mean model=llama_small?)" in problem
    problem = group_problem(["recipe=cifar10_v82"], CONF)
    assert problem is not None and "(did you mean recipe=cifar10_v28?)" in problem and "mesh_gnn" in problem
    for argv in (["model=llama_tiny", "recipe=null"], ["-m", "model=glob(llama_*)"], ["hydra/launcher=slurm"]):
        assert group_problem(argv, CONF) is None


@pytest.mark.slow  # a run.py process
def test_an_option_that_does_not_exist_on_the_command_line_is_one_sentence(tmp_path):
    done = run_cli("strategy=sparse_lorra", "task=plan", f"hydra.run.dir={tmp_path / 'run'}")
    assert done.returncode == 1, done.stderr[-2000:]
    assert "error: strategy=sparse_lorra: conf/strategy has no option sparse_lorra (did you mean " in done.stderr
    assert "strategy=sparse_lora?" in done.stderr and "Traceback" not in done.stderr


def test_a_yaml_file_with_a_key_given_twice_is_one_sentence_naming_its_line(tmp_path):
    """PyYAML's safe_load keeps the last of a duplicate key, so the check passed it; Hydra's loader (OmegaConf's)
    refuses it, in its own terms and not naming the file's line."""
    from onn.config.registry import yaml_problem

    (tmp_path / "recipe").mkdir()
    twice = tmp_path / "recipe" / "twice.yaml"
    twice.write_text("# @package _global_\ntrainer:\n  max_steps: 3\n  max_epochs: 1\n  max_steps: 5\n")
    problem = yaml_problem(["recipe=twice"], tmp_path)
    assert problem == f"{twice.resolve()} line 5, column 3: found duplicate key max_steps; fix the YAML there."


def test_an_unset_environment_variable_is_named_with_what_to_do(monkeypatch):
    """An unset ${oc.env:X} was answered "fix the ${...} to name a key of the config": advice for a key, not for an
    environment variable."""
    from onn.app import to_config

    monkeypatch.delenv("ONN_TEST_DATA_ROOT", raising=False)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = hydra_compose("config", overrides=[f"paths.root={ROOT}", "data.source=${oc.env:ONN_TEST_DATA_ROOT}"])
    with pytest.raises(UserError) as refused:
        to_config(cfg)
    said = str(refused.value)
    assert said.startswith("data.source=${oc.env:ONN_TEST_DATA_ROOT}:")
    assert "set ONN_TEST_DATA_ROOT in the environment, or give a default (${oc.env:ONN_TEST_DATA_ROOT,DEFAULT})" in said
