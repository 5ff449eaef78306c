"""The base of ONN's LightningModules: a LightningModule whose per-hook bookkeeping skips nn.Module's __setattr__."""

from __future__ import annotations

from typing import Any

import lightning as L


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
