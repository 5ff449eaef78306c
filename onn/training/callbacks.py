"""Callbacks ONN adds to every training run."""

from __future__ import annotations

import time

import lightning as L


class Throughput(L.Callback):
    """Training samples per second, counting only time spent in training batches and optimizer steps."""

    def __init__(self, batch_size: int):
        self.batch_size = batch_size
        self.train_s = 0.0
        self.steps = 0
        self._t0: float | None = None
        self._start_step = 0

    def on_train_start(self, trainer, pl_module) -> None:
        self._start_step = trainer.global_step
        self._t0 = time.perf_counter()

    def on_validation_start(self, trainer, pl_module) -> None:
        if self._t0 is not None:
            self.train_s += time.perf_counter() - self._t0
            self._t0 = None

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._t0 is None and trainer.state.fn == "fit":
            self._t0 = time.perf_counter()

    def on_train_end(self, trainer, pl_module) -> None:
        if self._t0 is not None:
            self.train_s += time.perf_counter() - self._t0
            self._t0 = None
        self.steps = trainer.global_step - self._start_step

    @property
    def samples_per_s(self) -> float | None:
        return self.steps * self.batch_size / self.train_s if self.train_s > 0 and self.steps else None
