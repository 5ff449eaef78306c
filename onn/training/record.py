"""What an epoch-based LightningModule keeps beside its weights: shared by the classifier and the dual encoder."""

from __future__ import annotations

import logging
from typing import Any

import lightning as L
import torch

from onn.errors import UserError
from onn.training.callbacks import batch_rows, logs_now

log = logging.getLogger("onn")


class EpochRecord:
    """A checkpoint's record for resume and for the run's report: its loop (a checkpoint of another loop
    is refused), config, validation history and per-step losses. The losses live on the device while
    training; saving reads them once and keeps host scalars after, so later steps never sync for them.

    The module sets `loop` and `describes` (what writes checkpoints of that loop, for the refusal) and
    the attributes `onn_config`, `history` and `train_losses`; `train_rows` (each step's samples, beside its loss)
    is kept here."""

    loop: str
    describes: str
    current_epoch: int  # LightningModule's
    global_step: int
    onn_config: dict[str, Any]
    history: list[dict[str, float]]
    train_losses: list[torch.Tensor]
    train_rows: list[int | None]
    losses_over_ranks: int = 0  # the leading train_losses that are already every rank's (combine_losses_over_ranks)

    def setup(self, stage: str) -> None:
        """Each step's samples, one beside each loss kept (unknown for steps whose samples were not seen)."""
        super().setup(stage)
        self.train_rows = _beside(getattr(self, "train_rows", []), len(self.train_losses))

    def record_step(self, loss: torch.Tensor, batch: Any) -> None:
        """A training step's loss (detached, read at the end) and its samples, together: a checkpoint a callback
        saves at this step's end holds both (the module's own batch-end hook runs after the callbacks')."""
        self.train_losses.append(loss.detach())
        self.train_rows.append(batch_rows(batch))

    def final_loss(self, steps: int = 20) -> float | None:
        """train/loss_final: the mean loss per sample over the last `steps` steps, each step's mean loss weighted by
        its samples (an epoch's short last batch counts for its samples, not as a whole batch); a plain mean of the
        steps' losses where a step's samples are unknown (a checkpoint saved before they were kept)."""
        losses, rows = [float(x) for x in self.train_losses[-steps:]], self.train_rows[-steps:]
        if not losses:
            return None
        if len(rows) != len(losses) or None in rows or not sum(rows):
            return sum(losses) / len(losses)
        return sum(loss * n for loss, n in zip(losses, rows, strict=True)) / sum(rows)

    def record_epoch(self, figures: dict[str, Any], shown: list[str]) -> None:
        """An epoch's validation figures into the history (the report and resume read it) and the log
        (`shown`: the names printed)."""
        self.history.append(
            {
                "epoch": self.current_epoch,
                "step": self.global_step,
                **{k: round(float(v), 5) for k, v in figures.items()},
            }
        )
        text = "  ".join(f"{k} {float(figures[k]):.4f}" for k in shown)
        log.info("epoch %d step %d: %s", self.current_epoch, self.global_step, text)

    def combine_losses_over_ranks(self) -> None:
        """Each step's loss and samples not yet combined become every rank's: the sample-weighted mean of the ranks'
        losses and the sum of their samples, in one collective. Under DDP each rank's loss is its own share's, and the
        checkpoint and train/loss_initial and train/loss_final held rank 0's alone. Every rank calls it (at a save and
        at the end of training, which Lightning runs on every rank); every rank has trained as many steps."""
        start = self.losses_over_ranks
        if self.trainer.world_size > 1 and len(self.train_losses) > start:
            losses = torch.stack([x.detach().float().to(self.device) for x in self.train_losses[start:]])
            rows = self.train_rows[start:]
            weights = torch.tensor([1 if n is None else n for n in rows], dtype=torch.float32, device=self.device)
            summed = self.trainer.strategy.reduce(torch.cat([losses * weights, weights]), reduce_op="sum")
            totals, counts = summed.split(len(rows))
            self.train_losses[start:] = list((totals / counts).unbind())
            self.train_rows[start:] = [None if n is None else int(c) for n, c in zip(rows, counts.tolist())]
        self.losses_over_ranks = len(self.train_losses)

    def on_train_end(self) -> None:
        super().on_train_end()
        self.combine_losses_over_ranks()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.combine_losses_over_ranks()
        losses = [float(x) for x in self.train_losses]  # read once: each read of a device loss waits for the GPU
        checkpoint["onn"] = {
            "loop": self.loop,
            "config": self.onn_config,
            "history": self.history,
            "train_losses": losses,
            "train_rows": [-1 if n is None else n for n in self.train_rows],
        }
        self.train_losses = [torch.tensor(x) for x in losses]  # on the host now: the next save reads none of them

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if checkpoint.get("onn", {}).get("loop") != self.loop:  # another tool's checkpoint has no `onn` record
            raise UserError(f"this checkpoint was not written by {self.describes}: it cannot resume this run.")
        onn = checkpoint["onn"]
        self.history = list(onn["history"])
        self.train_losses = [torch.tensor(x) for x in onn["train_losses"]]
        saved = onn.get("train_rows", [])  # a checkpoint saved before they were kept has none
        self.train_rows = _beside([None if n < 0 else int(n) for n in saved], len(self.train_losses))
        self.losses_over_ranks = len(self.train_losses)  # as saved: every rank's (combine_losses_over_ranks)


def _beside(rows: list[int | None], losses: int) -> list[int | None]:
    """Samples per step, as many as the losses kept: unknown (None) where a step's samples were not recorded."""
    kept = rows[:losses]
    return kept + [None] * (losses - len(kept))


def log_train_loss(module: L.LightningModule, loss: torch.Tensor, batch_size: int, over_ranks: bool = False) -> bool:
    """train/loss on a logging step only (logs_now: reading it syncs the device); whether it was one.

    Logged as a host tensor: Lightning turns a logged number into a tensor on the module's device and reads
    every progress-bar figure back at the end of every batch, logged on that step or not, which on a GPU
    would wait for the GPU at every step. `over_ranks`: `loss` is this rank's share's alone, and the figure is
    the ranks' sample-weighted mean (one collective on the device, on a logging step): Lightning logs rank 0's
    value, and a checkpoint or early stopping that monitors train/loss compared each rank's own."""
    if not logs_now(module):
        return False
    if over_ranks and module.trainer.world_size > 1:
        weighted = torch.stack([loss.detach().float(), torch.ones((), device=loss.device)]) * batch_size
        total, count = module.trainer.strategy.reduce(weighted, reduce_op="sum")
        loss = total / count
    value = torch.tensor(float(loss.detach()))
    module.log("train/loss", value, prog_bar=True, on_step=True, on_epoch=False, batch_size=batch_size)
    return True
