"""ONN's entry point: compose the config with Hydra and hand it to onn.app.run."""

import hydra
from omegaconf import DictConfig

from onn.config import register

register()  # the config's types (dataclasses only: nothing heavy is imported here)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    from onn.app import run  # imported here so `--help` stays fast

    return run(cfg)  # a sweeper (Optuna) optimises this: metrics[sweep_objective]


if __name__ == "__main__":
    main()
