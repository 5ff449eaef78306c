"""Hydra's Optuna sweeper, as recipes/optuna_lr.yaml runs it, with two of ONN's sweep rules added.

A trial that fails is recorded as failed and the search goes on (the recipe's max_failure_rate: 1.0). When every
trial failed, the stock sweeper asks Optuna for the best trial and ends in Optuna's traceback ("No trials are
completed yet"); here the search ends as a failed basic sweep does: one line naming the jobs and why, exit 1.
And a trial whose folder holds a finished job of other overrides (a fixed hydra.sweep.dir searched again with
another range) is refused before it is launched, as a basic sweep is before it starts (onn/tasks/record.py): Optuna
picks each trial's values only as the search goes, so they cannot be compared sooner.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

try:
    from hydra_plugins.hydra_optuna_sweeper.optuna_sweeper import OptunaSweeper as _Stock
except ImportError:  # hydra-optuna-sweeper not installed: no Optuna searches, nothing to add to
    _Stock = None


class _Guarded:
    """The sweeper's launcher, refusing a trial that would overwrite another sweep's finished job and noting whether
    any trial returned a value."""

    def __init__(self, launcher: Any, sweep_dir: Path) -> None:
        self.launcher, self.sweep_dir = launcher, sweep_dir
        self.launched, self.valued = 0, False

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[Any]:
        from hydra.core.utils import JobStatus

        from onn.tasks.record import job_taken

        for num, overrides in enumerate(job_overrides, start=initial_job_idx):
            if problem := job_taken(self.sweep_dir, num, list(overrides)):
                print(f"error: {problem}", file=sys.stderr, flush=True)
                raise SystemExit(1)
        returns = self.launcher.launch(job_overrides, initial_job_idx=initial_job_idx)
        self.launched += len(returns)
        self.valued |= any(r.status == JobStatus.COMPLETED and r.return_value is not None for r in returns)
        return returns


if _Stock is not None:

    class OptunaSweeper(_Stock):
        """hydra_plugins.hydra_optuna_sweeper's OptunaSweeper (its settings unchanged): ONN's recipes name it in
        hydra.sweeper._target_."""

        def setup(self, *, hydra_context: Any, task_function: Any, config: Any) -> None:
            super().setup(hydra_context=hydra_context, task_function=task_function, config=config)
            self.objective = config.get("sweep_objective")
            self.guard = _Guarded(self.sweeper.launcher, Path(config.hydra.sweep.dir))
            self.sweeper.launcher = self.guard

        def sweep(self, arguments: list[str]) -> None:
            started = time.time()
            try:
                return super().sweep(arguments)
            except ValueError:  # Optuna's "No trials are completed yet", from the study's best trial
                if self.guard.valued or not self.guard.launched:  # not that: the search's own error
                    raise
            print(f"error: {self._no_trial(started)}", file=sys.stderr, flush=True)
            raise SystemExit(1)

        def _no_trial(self, started: float) -> str:
            """Why the search has no best trial, in one sentence: the jobs that failed, or the objective none gave."""
            from onn.tasks.record import failed_jobs

            failed = failed_jobs(self.guard.sweep_dir, started)
            if failed:
                named = "; ".join(f"job {name}: {why}" for name, why in failed[:3])
                return (
                    f"no trial of the Optuna search ended ok, so it has no best one ({len(failed)} failed: {named}); "
                    "fix the setting they name and search again."
                )
            return (
                f"no trial of the Optuna search gave a finite sweep_objective={self.objective}, so it has no best one; "
                "give sweep_objective a metrics.json key that every trial writes as a number."
            )
