"""The command line's config mistakes, as a third review of the typed config found them (2026-12-07): a key given
under the wrong block whose name another block has (`trainer.lr=0.1`, `task.max_steps=10`) passed the misspelt-key
check and got Hydra's advice to add it with `+`, a key nothing reads; and a sweep (`-m`) skipped every check, so a
misspelt key got that same advice, and a key under a null block (`-m strategy=full strategy.lora.r=4,8`) Hydra's
29-line AssertionError traceback before any job ran. Each is one sentence now, whose advice composes."""

from __future__ import annotations

import pytest
from conftest import ROOT, compose, run_cli
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from onn.config import as_dict
from onn.config.registry import compose_problem

CONF = ROOT / "conf"
ADVICE = "fix its name (docs/config.md lists the groups' keys)."


def _hydra_refuses(*overrides: str) -> None:
    """Hydra's own composition refuses the command line: the mistake is a real one, not one the check invents."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"), pytest.raises(ConfigCompositionException):
        hydra_compose("config", overrides=list(overrides))


@pytest.mark.parametrize(
    "given, meant, value",
    [("trainer.lr=0.1", "optim.lr", 0.1), ("task.max_steps=7", "trainer.max_steps", 7),
     ("optim.batch_size=3", "data.batch_size", 3)],
)  # fmt: skip
def test_a_key_under_another_block_names_the_block_that_has_it(given, meant, value):
    """`lr` is a field of OptimConfig, so the check took trainer.lr for a good key and Hydra said "To append to
    your config use +trainer.lr=0.1", which only adds a key nothing reads."""
    key = given.split("=")[0]
    _hydra_refuses(given)
    assert (
        compose_problem([given], CONF)
        == f"{given}: {key} is not a key of ONN's config (did you mean {meant}?); {ADVICE}"
    )
    block, leaf = meant.split(".")
    advised = f"{meant}={given.split('=')[1]}"
    assert compose_problem([advised], CONF) is None
    assert getattr(getattr(compose(advised), block), leaf) == value


@pytest.mark.parametrize(
    "argv, said",
    [
        (["-m", "seed=1,2", "trainer.max_epoch=3"], "trainer.max_epoch=3: trainer.max_epoch is not a key of ONN's "
         f"config (did you mean trainer.max_epochs?); {ADVICE}"),
        (["--multirun", "trainer.max_epoch=1,2"], "trainer.max_epoch=1,2: trainer.max_epoch is not a key of ONN's "
         f"config (did you mean trainer.max_epochs?); {ADVICE}"),
        (["-m", "model=v28_cnn,resnet18", "data=mnist", "data.augment.hflp=0.5"], "data.augment.hflp=0.5: "
         f"data.augment.hflp is not a key of ONN's config (did you mean data.augment.hflip?); {ADVICE}"),
    ],
)  # fmt: skip
def test_a_sweeps_misspelt_key_is_one_sentence_naming_the_closest(argv, said):
    assert compose_problem(argv, CONF) == said


@pytest.mark.parametrize(
    "argv, said, advised",
    [
        (["-m", "strategy=full", "strategy.lora.r=4,8"], "strategy.lora.r=4,8: strategy.lora is null in this config, "
         "so it has no r to set; choose an option that gives strategy.lora (strategy=lora, ", ["strategy=lora"]),
        (["-m", "strategy=lora,full", "strategy.lora.r=4"], "strategy.lora.r=4: strategy.lora is null in this config, "
         "so it has no r to set; choose an option that gives strategy.lora (strategy=lora, ", ["strategy=lora"]),
        (["-m", "task=plan", "serve.slots=2,4"], "serve.slots=2,4: serve is null in this config, so it has no slots "
         "to set; choose an option that gives serve (task=serve", ["task=serve"]),
    ],
)  # fmt: skip
def test_a_sweeps_key_under_a_null_block_is_one_sentence_whose_advice_composes(argv, said, advised):
    """Hydra validates every job's overrides before the first runs: OmegaConf's AssertionError, a traceback."""
    problem = compose_problem(argv, CONF)
    assert problem is not None and problem.startswith(said), problem
    key, values = argv[-1].split("=")
    assert problem.endswith(f"then set {argv[-1]}.") and compose_problem(["-m", *advised, argv[-1]], CONF) is None
    first = int(values.split(",")[0])  # the advice's first job, as Hydra composes it
    assert OmegaConf.select(OmegaConf.create(as_dict(compose(*advised, f"{key}={first}"))), key) == first


@pytest.mark.parametrize(
    "argv",
    [
        ["-m", "model=v28_cnn,resnet18", "data=mnist", "data.augment.hflip=0.5,0.2"],
        ["-m", "strategy=lora,qlora", "strategy.lora.r=4,8", "optim.lr=0.1,0.01"],
        ["-m", "model=llama_tiny", "model.architecture.hidden_size=32,64", "optim.betas.0=0.8"],
        ["-m", "task=serve,bench_serve", "serve.slots=2"],
    ],
)
def test_sweeps_of_good_keys_are_not_refused(argv):
    assert compose_problem(argv, CONF) is None


@pytest.mark.slow  # a run.py process (20-50 s on 2 busy cores)
def test_a_sweep_with_a_key_under_a_null_block_stops_in_one_sentence_before_any_job(tmp_path):
    sweep = tmp_path / "sweep"
    done = run_cli("-m", "task=plan", "strategy=full", "strategy.lora.r=4,8", f"hydra.sweep.dir={sweep}")
    assert done.returncode == 1, done.stderr[-2000:]
    assert "error: strategy.lora.r=4,8: strategy.lora is null in this config" in done.stderr
    assert "Traceback" not in done.stderr and "AssertionError" not in done.stderr
    assert not sweep.exists()
