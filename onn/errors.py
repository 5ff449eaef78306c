"""The one exception type for user mistakes: app.run prints it as a single line, no traceback; and the one
sentence for a write the disk refuses (full, read-only, not permitted)."""

from __future__ import annotations

import errno
import math
import os
import re
import shutil
from pathlib import Path


class UserError(Exception):
    """A problem with the user's input (a file, a config value); the message says what to do."""

    def __init__(self, message: str = "", *args: object) -> None:
        super().__init__(self._from_worker(message), *args)

    def _from_worker(self, message: str) -> str:
        """The sentence a DataLoader worker raised. torch re-raises a worker's error in the main process as
        `type(error)(f"Caught UserError in DataLoader worker process 0.\nOriginal Traceback ...")`: the worker's
        whole traceback, which app.run would print as the one line a user reads."""
        if not (isinstance(message, str) and message.startswith("Caught ") and "\nOriginal Traceback" in message):
            return message
        head, _, rest = message.partition("\n")
        _, found, sentence = rest.rpartition(f"\n{type(self).__module__}.{type(self).__qualname__}: ")
        where = head.removeprefix(f"Caught {type(self).__name__} ").rstrip(".")
        return f"{sentence.strip()} ({where})" if found else message


class FailedAfterTraining(UserError):
    """A run that trained and then failed: `metrics` are the training's figures, which the run's record keeps
    beside the error (the checkpoint is written)."""

    def __init__(self, message: str, metrics: dict):
        super().__init__(message)
        self.metrics = metrics


class ExportFailed(FailedAfterTraining):
    """The export at the end of a training run failed (task=export of its checkpoint needs no training again)."""


class TrainingDiverged(FailedAfterTraining):
    """Training ended with a loss that is not a number: the weights are unusable, and the run is not `ok`."""


def diverged(metrics: dict) -> TrainingDiverged | None:
    """The error for a training run whose last steps' loss (train/loss_final) is NaN or infinite, which
    Lightning trains on without a word; None for a run that did not train or ended finite."""
    final = metrics.get("train/loss_final")  # a run's figures, which only a training task has
    if not isinstance(final, float) or math.isfinite(final):
        return None
    return TrainingDiverged(
        f"training diverged: the loss of its last steps (train/loss_final) is {final}, so its weights are not "
        "usable and nothing was exported; lower optim.lr, set optim.clip_grad_norm, or look for NaN or infinite "
        "values in the data.",
        metrics,
    )


def write_refused(
    error: OSError, path: str | os.PathLike, needed_bytes: int | None = None, what: str = "it"
) -> UserError:
    """One sentence for a write the disk refused, naming the path, and for a full disk the space needed
    beside what is free; the caller has already removed its partial file, so nothing half-written remains."""
    path = Path(path)
    if error.errno == errno.ENOSPC:
        folder = next((p for p in (path, *path.parents) if p.exists()), Path("/"))
        free = shutil.disk_usage(folder).free
        need = f"{needed_bytes / 2**20:,.1f} MB are needed and " if needed_bytes else ""
        return UserError(
            f"cannot write {path}: the disk is full ({need}{free / 2**20:,.1f} MB are free); "
            f"free some space or write {what} elsewhere."
        )
    reason = {
        errno.EROFS: "the file system is read-only",
        errno.EACCES: "permission denied",
        errno.EPERM: "the operation is not permitted (an immutable folder, say: chattr +i)",
    }.get(error.errno, error.strerror or str(error))
    return UserError(f"cannot write {path}: {reason}; write {what} elsewhere.")


def disk_error(error: BaseException) -> OSError | None:
    """The disk's refusal behind a failed write, as an OSError: safetensors' writer raises its own SafetensorError
    for one ("I/O error: No space left on device (os error 28)"); None for any other error."""
    if isinstance(error, OSError):
        return error
    found = re.search(r"\(os error (\d+)\)", str(error)) if type(error).__name__ == "SafetensorError" else None
    return OSError(int(found[1]), os.strerror(int(found[1]))) if found else None
