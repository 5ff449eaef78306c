"""The base of ONN's LightningModules: a LightningModule whose per-hook bookkeeping skips nn.Module's __setattr__,
and which notes its parameters' shapes before a strategy shards them."""

from __future__ import annotations

from typing import Any

import lightning as L

from onn.training.optim import BUILT_SHAPE, built_shape


class ONNModule(L.LightningModule):
    """Lightning sets `_current_fx_name` before and after every hook it calls (lightning/pytorch/trainer/call.py),
    some 44 times a training step, where a small CNN's step on a fast GPU is the host's time. The value is only ever
    a str or None, so it is set as nn.Module.__init__ sets its own attributes, without nn.Module.__setattr__'s checks
    for parameters, buffers and submodules (docs/gpu.md, "Where the image runner's overhead lives")."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "_current_fx_name":
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    def setup(self, stage: str) -> None:
        """Each parameter's shape as built, noted on it before a strategy shards it: FSDP over several processes
        makes each a 1-D view of its shard before configure_optimizers, where weight decay goes to matrices only
        (onn.training.optim.decay_groups)."""
        for param in self.parameters():
            setattr(param, BUILT_SHAPE, built_shape(param))
