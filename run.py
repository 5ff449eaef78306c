"""ONN's entry point: compose the config with Hydra and hand it to onn.app.run."""

import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from onn.config.registry import (
    compose_problem,
    delete_problem,
    expand_home,
    group_problem,
    no_recipe,
    register,
    value_problem,
    yaml_problem,
)

register()  # the config's types (dataclasses only: nothing heavy is imported here)


def checkpoint_name(group: str, *, _root_: DictConfig) -> str:
    """`${onn.ckpt:model}` in hydra.run.dir: the model (or strategy) the run runs. With ckpt= that is the
    checkpoint's, and a data config with no model named runs its modality's default (onn.app reads both)."""
    if _root_.ckpt is None and group != "model":
        return str(_root_[group].name)
    from onn.app import checkpoint_name as name

    return name(group, _root_=_root_)


# replace: a bench child or a test's forked interpreter may run run.py twice in one process
OmegaConf.register_new_resolver("onn.ckpt", checkpoint_name, replace=True)


def other_rank_overrides(argv: list[str]) -> list[str]:
    """torchrun and srun start this same command once per process. A process of rank N > 0 logs to
    rank_N.log and writes no .hydra/ of its own (Lightning's own launcher does the same for its children);
    give every node the same hydra.run.dir so that they share one run folder."""
    rank = os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or "0"
    if rank == "0" or any(a.startswith(("hydra.output_subdir=", "hydra.job.name=", "-m", "--multirun")) for a in argv):
        return []
    return ["hydra.output_subdir=null", f"hydra.job.name=rank_{rank}"]


sys.argv[1:] = expand_home(sys.argv[1:])  # `data.source=~/shapes`: bash leaves that ~ as it is, and Hydra refuses it
sys.argv[1:] = no_recipe(sys.argv[1:])  # `recipe=null`: no recipe, as Hydra writes it (~recipe)
sys.argv += other_rank_overrides(sys.argv[1:])
# mistakes Hydra would report as a traceback or in its own terms, each one sentence before Hydra composes
ARGS, CONF = sys.argv[1:], Path(__file__).resolve().parent / "conf"
problem = (
    yaml_problem(ARGS, CONF)
    or group_problem(ARGS, CONF)
    or value_problem(ARGS)
    or delete_problem(ARGS, CONF)
    or compose_problem(ARGS, CONF)
)
if problem:
    sys.exit(f"error: {problem}")


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    from onn.app import run  # imported here so `--help` stays fast

    return run(cfg)  # a sweeper (Optuna) optimises this: metrics[sweep_objective]


if __name__ == "__main__":
    main()
