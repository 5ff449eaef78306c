"""The causal-LM LightningModule: the whole training step on one screen.

Loss is the model's own shifted cross-entropy over answer tokens (labels of prompt tokens are
-100). Validation loss is averaged over tokens, not batches, so it does not depend on batching.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch

from onn.data.module import IGNORE


class CausalLM(L.LightningModule):
    def __init__(
        self, model: torch.nn.Module, optim: dict[str, Any], max_steps: int, onn_config: dict[str, Any]
    ):
        super().__init__()
        self.model = model
        self.optim = optim
        self.max_steps = max_steps
        self.onn_config = onn_config  # stored in every checkpoint so eval/infer can rebuild the model
        self._val_sum, self._val_tokens = 0.0, 0
        self.train_losses: list[float] = []  # one mean loss per optimizer step, kept across resume
        self.val_losses: list[float] = []
        self.val_at_step: int | None = None  # global step of the latest validation
        self._micro_losses: list[float] = []
        self.engine = None  # set by LayerStreamingStrategy: batches are then macro-batches it streams
        # LoRA checkpoints hold only what trains; the frozen base comes from model.source again.
        self.strict_loading = all(p.requires_grad for p in model.parameters())

    def forward(self, **batch: torch.Tensor):
        return self.model(**batch)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.engine is not None:  # forward and backward of every micro-batch, chunk by chunk
            loss = self.engine.forward_train(
                self.engine.split(batch), loss_scale=self.trainer.strategy.loss_scale()
            )
        else:
            loss = self.model(**batch).loss
        self._micro_losses.append(loss.detach().float().item())
        self.log(
            "train/loss",
            loss,
            prog_bar=True,
            on_step=True,
            on_epoch=False,
            batch_size=batch["input_ids"].shape[0],
        )
        return loss

    def on_before_optimizer_step(self, optimizer) -> None:
        # Recorded here, not in on_train_batch_end: ModelCheckpoint saves before that hook runs,
        # and the step's loss must be in the checkpoint's history.
        self.train_losses.append(sum(self._micro_losses) / len(self._micro_losses))
        self._micro_losses.clear()

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        if self.engine is not None:
            pieces = self.engine.split(batch)
            losses = self.engine.loss(pieces)
        else:
            pieces, losses = [batch], [self.model(**batch).loss]
        for piece, loss in zip(pieces, losses):
            tokens = int((piece["labels"][:, 1:] != IGNORE).sum())
            self._val_sum += float(loss) * tokens
            self._val_tokens += tokens

    def on_validation_epoch_end(self) -> None:
        loss = self._val_sum / max(self._val_tokens, 1)
        self._val_sum, self._val_tokens = 0.0, 0
        self.log("val/loss", loss, prog_bar=True)
        self.log("val/perplexity", math.exp(min(loss, 50)))
        if not self.trainer.sanity_checking:
            self.val_losses.append(loss)
            self.val_at_step = self.trainer.global_step

    def configure_optimizers(self):
        from transformers import get_scheduler

        params = [p for p in self.model.parameters() if p.requires_grad]
        name = self.optim.get("name", "adamw")
        if name == "adamw":
            optimizer = torch.optim.AdamW(params, lr=self.optim["lr"], weight_decay=self.optim.get("weight_decay", 0.0),
                                          betas=tuple(self.optim.get("betas", (0.9, 0.999))))  # fmt: skip
        elif name == "sgd":
            optimizer = torch.optim.SGD(
                params, lr=self.optim["lr"], momentum=0.9, weight_decay=self.optim.get("weight_decay", 0.0)
            )
        else:
            from onn.errors import UserError

            raise UserError(f"optim.name '{name}' is not one of adamw, sgd.")
        schedule = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}[
            self.optim.get("schedule", "cosine")
        ]
        scheduler = get_scheduler(
            schedule,
            optimizer,
            num_warmup_steps=int(self.optim.get("warmup_steps", 0)),
            num_training_steps=self.max_steps,
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if not self.strict_loading:
            trainable = {n for n, p in self.named_parameters() if p.requires_grad}
            checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in trainable}
        checkpoint["onn"] = {
            "config": self.onn_config,
            "train_losses": self.train_losses,
            "val_losses": self.val_losses,
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        onn = checkpoint.get("onn", {})
        self.train_losses = list(onn.get("train_losses", []))
        self.val_losses = list(onn.get("val_losses", []))


def summarize_losses(losses: list[float]) -> tuple[float | None, float | None]:
    """(initial, final): the first step's loss, and the mean of the last 5% of steps (at least one)."""
    if not losses:
        return None, None
    tail = max(1, math.ceil(len(losses) * 0.05))
    return losses[0], sum(losses[-tail:]) / tail
