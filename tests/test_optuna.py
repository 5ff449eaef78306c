"""recipes/optuna_lr.yaml composes into an Optuna sweep over optim.lr (no training)."""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import ROOT, compose, run_cli


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
    assert sweeper["_target_"] == "hydra_plugins.onn_launcher.sweeper.OptunaSweeper"  # Hydra's, with ONN's rules
    assert hydra["runtime"]["choices"]["hydra/sweeper"] == "optuna"
    assert hydra["mode"] == RunMode.MULTIRUN  # `python run.py recipe=optuna_lr` sweeps without -m
    assert sweeper["sampler"]["_target_"] == "optuna.samplers.TPESampler"
    assert sweeper["sampler"]["seed"] == 0
    assert sweeper["direction"] == "minimize"
    assert sweeper["n_trials"] == 4
    params = sweeper["params"]
    assert params["optim.lr"] == "tag(log, interval(1e-4, 3e-2))"
    job = compose("recipe=optuna_lr")  # what each trial starts from, before the sweeper's overrides
    assert job.trainer.max_steps == job.trainer.val_check_interval == 30
    assert job.task.exact_match_samples == 0
    assert job.sweep_objective == "val/loss_final" and job.optim.warmup_steps == 5  # the recipe wins over root keys
    assert (job.model.name, job.data.name, job.task.name) == ("phi4_tiny", "math", "train")


def test_optuna_sweeper_parses_the_lr_search_space():
    """The sweeper's own parser (hydra-optuna-sweeper with the installed optuna) reads the recipe's params."""
    from hydra_plugins.hydra_optuna_sweeper._impl import create_params_from_overrides

    params = _compose_with_hydra("recipe=optuna_lr")["hydra"]["sweeper"]["params"]
    space, fixed = create_params_from_overrides([f"{k}={v}" for k, v in params.items()])
    lr = space["optim.lr"]
    assert (lr.low, lr.high) == (1e-4, 3e-2)
    assert type(lr).__name__ == "LogUniformDistribution"
    assert set(space) == {"optim.lr"}


@pytest.mark.slow
def test_optuna_runs_two_real_trials_and_reports_the_best_lr(outputs):
    sweep = outputs / "optuna"
    proc = run_cli(
        "recipe=optuna_lr",
        "hydra.sweeper.n_trials=2",
        "model=llama_tiny",
        "trainer.max_steps=6",
        "trainer.val_check_interval=6",
        "data.builtin.train_size=64",
        "data.builtin.val_size=16",
        "tracking=none",
        f"paths.outputs={outputs}",
        f"hydra.sweep.dir={sweep}",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    trials = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/metrics.json"))]
    lrs = [
        yaml.safe_load((p.parent / "config.yaml").read_text())["optim"]["lr"]
        for p in sorted(sweep.glob("*/metrics.json"))
    ]
    assert len(trials) == 2 and all(t["status"] == "ok" and t["val/loss_final"] > 0 for t in trials)
    assert len(set(lrs)) == 2 and all(1e-4 <= lr <= 3e-2 for lr in lrs)  # Optuna picked two rates in the range
    results = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    best = min(range(2), key=lambda i: trials[i]["val/loss_final"])
    assert results["best_params"]["optim.lr"] == pytest.approx(lrs[best])
    assert results["best_value"] == pytest.approx(trials[best]["val/loss_final"])


PLAN_SEARCH = ("recipe=optuna_lr", "task=plan", "hardware=cpu_16gb", "model=llama_tiny")  # trials that only plan


@pytest.mark.slow  # 12-32 s in ci137's fast suite, which took 646 s
def test_an_optuna_search_whose_trials_all_failed_ends_in_one_line(tmp_path):
    """Every trial of a mistyped setting failed in one sentence each, then the sweeper asked Optuna for the best
    trial and the search ended in Optuna's traceback ("No trials are completed yet"), without the sweep's summary."""
    sweep = tmp_path / "search"
    proc = run_cli(*PLAN_SEARCH, "data.batch_size=0", "hydra.sweeper.n_trials=2", f"paths.outputs={tmp_path}",
                   f"hydra.sweep.dir={sweep}")  # fmt: skip
    assert proc.returncode == 1 and "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    assert (
        "error: no trial of the Optuna search ended ok, so it has no best one (2 failed: job 0: failed: "
        "data.batch_size=0: give a whole number, 1 or more." in proc.stderr
    )
    assert not (sweep / "optimization_results.yaml").exists()


@pytest.mark.slow  # three searches
def test_an_optuna_search_of_another_range_into_a_folder_of_finished_trials_is_refused(tmp_path):
    """The recipe's own example, another range (`hydra.sweeper.params={optim.lr:...}`), searched into a fixed
    hydra.sweep.dir replaced the finished trials there with trials of other learning rates."""
    sweep = tmp_path / "search"
    common = (*PLAN_SEARCH, "sweep_objective=predicted_peak_memory_mb", "hydra.sweeper.n_trials=1",
              f"paths.outputs={tmp_path}", f"hydra.sweep.dir={sweep}")  # fmt: skip
    first = run_cli(*common)
    assert first.returncode == 0, first.stderr[-3000:]
    before = {p: p.read_bytes() for p in sorted((sweep / "0").rglob("*")) if p.is_file()}
    other = run_cli(*common, "hydra.sweeper.params={optim.lr:'tag(log, interval(1e-6, 1e-5))'}")
    assert other.returncode == 1 and "Traceback" not in other.stderr, other.stderr[-3000:]
    assert f"hydra.sweep.dir={sweep} holds the finished jobs of another sweep: its job 0 ran `optim.lr=" in other.stderr
    assert {p: p.read_bytes() for p in sorted((sweep / "0").rglob("*")) if p.is_file()} == before
    again = run_cli(*common)  # the same search (its sampler seeded) picks the same rate: the finished trial stays
    assert again.returncode == 0 and "already finished for this config" in again.stderr + again.stdout
