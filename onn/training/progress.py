"""How far this process's run got: the last optimizer step, for the run's record (onn/tasks/record.py).

Kept apart from the callbacks (which import Lightning) so that the record can read it in any run.
"""

from __future__ import annotations

_last_step: int | None = None


def reached(step: int) -> None:
    """A training step finished (the Progress callback calls this)."""
    global _last_step
    _last_step = int(step)


def last_step() -> int | None:
    """The last optimizer step a training loop of this process finished, or None before the first."""
    return _last_step


def reset() -> None:
    """A new run starts in this process (each job of a Hydra multirun runs in the same one): no step reached yet, so
    that its record never shows the previous job's last step."""
    global _last_step
    _last_step = None
