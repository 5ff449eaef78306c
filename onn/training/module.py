"""The base of ONN's LightningModules: a LightningModule whose per-hook bookkeeping skips nn.Module's __setattr__."""

from __future__ import annotations

from typing import Any

import lightning as L


class ONNModule(L.LightningModule):
    """Lightning names the hook it is in by setting `_current_fx_name` on the module before and after every hook
    (44 times a training step: 13 module hooks, each set and restored, and the closure's). Each goes through
    nn.Module.__setattr__, which checks the value against parameters, buffers and submodules first: 0.07 ms of a
    bare LightningModule's 0.43 ms loop overhead a step on 2 Xeon cores, where a small CNN's step on a fast GPU is
    the host's. The name is a string or None, never a tensor or a module, so it is set as a plain attribute is,
    as PyTorch sets its own in nn.Module.__init__."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "_current_fx_name":
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)
