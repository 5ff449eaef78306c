"""The tasks app runs, by name (TASKS): what each does with a Job, what it checks first, and what it needs.

    TASKS["train"].run(job) -> metrics

A task's `check` reads its own settings before anything is profiled, planned, loaded or written,
so a mistake costs a second, not the minutes a model build takes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from onn.config import ONNConfig
from onn.errors import UserError
from onn.modalities.base import Job
from onn.tasks.serve import task as serve


def _no_check(config: ONNConfig) -> None:
    pass


@dataclass(frozen=True)
class Task:
    run: Callable[[Job], dict[str, Any]]
    check: Callable[[ONNConfig], None] = _no_check  # the task's own settings, before anything is planned
    modalities: frozenset[str] | None = None  # None: every modality
    model: bool = True  # False: the task neither plans nor builds a model (a benchmark of the planner alone)
    heavy: bool = True  # the task trains or runs a model: Lightning and transformers are imported before planning
    trains: bool = False  # the task fits weights: its trainer.max_steps/max_epochs must end
    gpu: bool = False  # the task measures a CUDA GPU: refused on a machine without one, before anything is planned


def _train(job: Job) -> dict[str, Any]:
    return job.modality.train(job)


def _evaluate(job: Job) -> dict[str, Any]:
    return job.modality.evaluate(job)


def _infer(job: Job) -> dict[str, Any]:
    return job.modality.infer(job)


def _export(job: Job) -> dict[str, Any]:
    return job.modality.export(job)


def _serve(job: Job) -> dict[str, Any]:
    return serve.run(job)


def _plan(job: Job) -> dict[str, Any]:
    return {}  # app prints and saves the plan; nothing else runs


def _check_export(config: ONNConfig) -> None:
    if config.export.name == "none":
        raise UserError("task=export needs a format: export=safetensors, export=onnx or export=omny.")


TASKS: dict[str, Task] = {
    "train": Task(_train, trains=True),
    "eval": Task(_evaluate),
    "infer": Task(_infer),
    "export": Task(_export, check=_check_export),
    "plan": Task(_plan, heavy=False),
    "serve": Task(_serve, check=serve.check),
}
