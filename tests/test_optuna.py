"""recipes/optuna_lr.yaml composes into an Optuna sweep over optim.lr (no training)."""

from __future__ import annotations

from conftest import ROOT, compose


def _compose_with_hydra(*overrides: str) -> dict:
    """Like conftest.compose, but keeps the hydra node (where the sweeper lives)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = hydra_compose("config", overrides=[f"paths.root={ROOT}", *overrides], return_hydra_config=True)
    return OmegaConf.to_container(cfg, resolve=False)


def test_optuna_lr_recipe_is_an_optuna_lr_search():
    from hydra.types import RunMode

    cfg = _compose_with_hydra("recipe=optuna_lr")
    hydra = cfg["hydra"]
    sweeper = hydra["sweeper"]
    assert sweeper["_target_"] == "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"
    assert hydra["runtime"]["choices"]["hydra/sweeper"] == "optuna"
    assert hydra["mode"] == RunMode.MULTIRUN  # `python run.py recipe=optuna_lr` sweeps without -m
    assert sweeper["sampler"]["_target_"] == "optuna.samplers.TPESampler"
    assert sweeper["sampler"]["seed"] == 0
    assert sweeper["direction"] == "minimize"
    assert sweeper["n_trials"] == 4
    params = sweeper["params"]
    assert params["optim.lr"] == "tag(log, interval(1e-4, 3e-2))"
    job = compose("recipe=optuna_lr")  # what each trial starts from, before the sweeper's overrides
    assert job["trainer"]["max_steps"] == job["trainer"]["val_check_interval"] == 30
    assert job["task"]["exact_match_samples"] == 0
    assert (
        job["sweep_objective"] == "val/loss_final" and job["optim"]["warmup_steps"] == 5
    )  # the recipe wins over root keys
    assert (job["model"]["name"], job["data"]["name"], job["task"]["name"]) == ("phi4_tiny", "math", "train")


def test_optuna_sweeper_parses_the_lr_search_space():
    """The sweeper's own parser (hydra-optuna-sweeper with the installed optuna) reads the recipe's params."""
    from hydra_plugins.hydra_optuna_sweeper._impl import create_params_from_overrides

    params = _compose_with_hydra("recipe=optuna_lr")["hydra"]["sweeper"]["params"]
    space, fixed = create_params_from_overrides([f"{k}={v}" for k, v in params.items()])
    lr = space["optim.lr"]
    assert (lr.low, lr.high) == (1e-4, 3e-2)
    assert type(lr).__name__ == "LogUniformDistribution"
    assert set(space) == {"optim.lr"}
