"""Lightning's hooks without a profiler's bookkeeping, unless `trainer.profiler` names one of Lightning's."""

from __future__ import annotations

import contextlib

from lightning.pytorch.profilers import PassThroughProfiler


class NoProfiler(PassThroughProfiler):
    """Lightning's default profiler records nothing, yet every hook it calls (17 a training step of automatic
    optimisation, and each callback's besides) goes through the profiler's generator-based context manager and its
    start and stop, some five Python calls each. On a fast GPU a small model's step is the host's time, so ONN's
    Trainer hands back one shared empty context instead (docs/gpu.md, "Where the image runner's overhead lives")."""

    _nothing = contextlib.nullcontext()

    def profile(self, action_name: str) -> contextlib.AbstractContextManager:
        return self._nothing
