"""Hydra's submitit launcher, local flavour, with a cap on how many jobs run at once.

Hydra accepts launchers only from the `hydra_plugins` namespace package, hence this folder beside `onn`.
`hydra/launcher=submitit_local` (its config: onn/config.py, register_local_launcher) runs each job of a sweep in its
own process, as submitit_slurm runs each on the cluster. Submitit's local executor starts every job at
once and has no `array_parallelism` (that key is SLURM's); on one machine that is rarely what a user
wants, so this launcher hands the plugin `array_parallelism` jobs at a time and waits for them before
the next ones. Everything else (job folders, logs under .submitit/, results, resume) is the plugin's.

sweeper.py beside it: Hydra's Optuna sweeper with ONN's sweep rules (recipes/optuna_lr.yaml names it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher


class ThrottledLocalLauncher(LocalLauncher):
    def __init__(self, array_parallelism: int, **params: Any) -> None:
        super().__init__(**params)
        self.array_parallelism = max(1, int(array_parallelism))

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[Any]:
        """The jobs in groups of `array_parallelism`: each group runs in parallel, one group after another."""
        results = []
        for start in range(0, len(job_overrides), self.array_parallelism):
            group = job_overrides[start : start + self.array_parallelism]
            results.extend(super().launch(group, initial_job_idx + start))
        return results
