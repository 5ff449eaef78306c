"""The image-classifier LightningModule: augmentation on the batch, cross-entropy, torchmetrics accuracy.

Batches arrive as uint8 images already on the device (onn.data.images); the module turns them into
normalised float batches itself, augmented only in training, so the data pipeline does no per-sample
work. For a linear probe the batches are cached backbone features and only the head runs.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from onn.errors import UserError

log = logging.getLogger("onn")
LOOP = "epochs"
SCHEDULES = ("cosine", "linear", "constant", "step", "plateau", "onecycle")


class LinearProbe(nn.Module):
    """A frozen backbone and a trainable dense head; trained on cached features, run whole for inference."""

    def __init__(self, backbone: nn.Module, width: int, num_classes: int):
        super().__init__()
        self.backbone = backbone.requires_grad_(False).eval()
        self.head = nn.Linear(width, num_classes)

    def train(self, mode: bool = True) -> LinearProbe:
        super().train(mode)
        self.backbone.eval()  # frozen means its BatchNorm statistics too
        return self

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(images))


class ImageClassifier(L.LightningModule):
    def __init__(self, model: nn.Module, classes: list[str], optim: dict[str, Any], onn_config: dict[str, Any],
                 augment=None, label_smoothing: float = 0.0, channels_last: bool = False,
                 inputs: str = "images"):  # fmt: skip
        super().__init__()
        self.model = model
        self.classes = list(classes)
        self.optim = optim
        self.onn_config = onn_config  # stored in every checkpoint so eval/infer/export rebuild this model
        self.augment = augment  # onn.data.augment.BatchAugment: uint8 -> normalised float
        self.label_smoothing = float(label_smoothing)
        self.channels_last = channels_last
        self.inputs = inputs  # "images", or "features" for a linear probe on cached features
        if channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)
        from torchmetrics.classification import MulticlassAccuracy, MulticlassConfusionMatrix

        n = len(self.classes)
        self.metrics = nn.ModuleDict({
            f"{stage}_{name}": metric
            for stage in ("val", "test")
            for name, metric in (("acc", MulticlassAccuracy(n, average="micro")),
                                 ("acc_top5", MulticlassAccuracy(n, top_k=min(5, n), average="micro")),
                                 ("confusion", MulticlassConfusionMatrix(n)))
        })  # fmt: skip
        self._loss_sum = {"val": 0.0, "test": 0.0}
        self._count = {"val": 0, "test": 0}
        self.train_losses: list[
            torch.Tensor
        ] = []  # detached per step; read once at the end (no per-step sync)
        self.history: list[dict[str, float]] = []  # per validation: epoch, step, val/acc, val/loss
        self.confusion: dict[str, torch.Tensor] = {}

    # -- the steps ------------------------------------------------------------------------------------
    def prepare(self, batch_x: torch.Tensor, train: bool) -> torch.Tensor:
        if self.inputs == "features":
            return batch_x.float()
        with torch.autocast(
            batch_x.device.type, enabled=False
        ):  # pixels stay fp32; the model runs in autocast
            x = self.augment(batch_x, train=train) if self.augment is not None else batch_x.float() / 255
        return x.contiguous(memory_format=torch.channels_last) if self.channels_last else x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.head(x) if self.inputs == "features" else self.model(x)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        logits = self(self.prepare(images, train=True))
        loss = F.cross_entropy(logits, labels, label_smoothing=self.label_smoothing)
        self.train_losses.append(loss.detach())
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=False, batch_size=labels.shape[0])
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch, batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def _evaluate(self, batch, stage: str) -> None:
        images, labels = batch
        logits = self(self.prepare(images, train=False)).float()
        self._loss_sum[stage] += float(F.cross_entropy(logits, labels, reduction="sum"))
        self._count[stage] += labels.shape[0]
        for name in ("acc", "acc_top5", "confusion"):
            self.metrics[f"{stage}_{name}"].update(logits, labels)

    def on_validation_epoch_end(self) -> None:
        self._epoch_end("val")

    def on_test_epoch_end(self) -> None:
        self._epoch_end("test")

    def _epoch_end(self, stage: str) -> None:
        figures = {
            f"{stage}/acc": self.metrics[f"{stage}_acc"].compute(),
            f"{stage}/acc_top5": self.metrics[f"{stage}_acc_top5"].compute(),
            f"{stage}/loss": torch.tensor(self._loss_sum[stage] / max(self._count[stage], 1)),
        }
        self.confusion[stage] = self.metrics[f"{stage}_confusion"].compute().cpu()
        for metric in ("acc", "acc_top5", "confusion"):
            self.metrics[f"{stage}_{metric}"].reset()
        self._loss_sum[stage], self._count[stage] = 0.0, 0
        self.log_dict(figures, prog_bar=stage == "val")
        if stage == "val" and not self.trainer.sanity_checking:
            self.history.append({"epoch": self.current_epoch, "step": self.global_step,
                                 **{k: round(float(v), 5) for k, v in figures.items()}})  # fmt: skip
            log.info("epoch %d step %d: %s", self.current_epoch, self.global_step,
                     "  ".join(f"{k} {float(v):.4f}" for k, v in figures.items()))  # fmt: skip
            self._log_confusion(stage)

    def _log_confusion(self, stage: str) -> None:
        """The confusion matrix as a picture in TensorBoard (other loggers take no figures)."""
        from lightning.pytorch.loggers import TensorBoardLogger

        loggers = [lg for lg in self.trainer.loggers if isinstance(lg, TensorBoardLogger)]
        if loggers:
            figure = confusion_figure(self.confusion[stage], self.classes)
            for lg in loggers:
                lg.experiment.add_figure(f"{stage}/confusion_matrix", figure, self.global_step)
            import matplotlib.pyplot as plt

            plt.close(figure)

    def on_before_optimizer_step(self, optimizer) -> None:
        clip = float(self.optim.get("clip_grad_norm") or 0.0)
        if clip > 0:
            self.clip_gradients(optimizer, gradient_clip_val=clip, gradient_clip_algorithm="norm")

    # -- optimiser and schedule -----------------------------------------------------------------------
    def configure_optimizers(self):
        optimizer = make_optimizer([p for p in self.model.parameters() if p.requires_grad], self.optim)
        schedule = make_schedule(optimizer, self.optim, int(self.trainer.estimated_stepping_batches))
        return {"optimizer": optimizer, "lr_scheduler": schedule}

    # -- checkpoints ------------------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.inputs == "features":  # the frozen backbone comes from model.weights again
            checkpoint["state_dict"] = {
                k: v for k, v in checkpoint["state_dict"].items() if ".backbone." not in k
            }
        checkpoint["onn"] = {"loop": LOOP, "config": self.onn_config, "history": self.history,
                             "train_losses": [float(x) for x in self.train_losses]}  # fmt: skip
        # synced once by the line above; keep them as cheap CPU scalars from here on
        self.train_losses = [torch.tensor(float(x)) for x in self.train_losses]

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        onn = checkpoint.get("onn", {})
        if onn.get("loop") != LOOP:
            raise UserError(
                "this checkpoint was not written by ONN's image classifier: it cannot resume this run."
            )
        self.history = list(onn.get("history") or [])
        self.train_losses = [torch.tensor(x) for x in onn.get("train_losses") or []]

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if self.inputs == "features":
            strict = False  # checkpoints hold the head only
        return super().load_state_dict(state_dict, strict=strict, assign=assign)


def make_optimizer(params, o: dict[str, Any]) -> torch.optim.Optimizer:
    """torch.optim's SGD or AdamW from the optim config (the benchmark's plain loop uses it too)."""
    name, lr, decay = o.get("name", "sgd"), float(o["lr"]), float(o.get("weight_decay", 0.0))
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=decay, betas=tuple(o.get("betas", (0.9, 0.999))))
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=float(o.get("momentum", 0.9)), weight_decay=decay,
                               nesterov=bool(o.get("nesterov", False)))  # fmt: skip
    raise UserError(f"optim.name '{name}' is not one of adamw, sgd.")


def make_schedule(optimizer, o: dict[str, Any], total: int) -> dict[str, Any]:
    """Lightning's lr_scheduler config for optim.schedule over `total` optimizer steps."""
    schedule, lr = o.get("schedule", "cosine"), float(o["lr"])
    if schedule in ("cosine", "linear", "constant"):
        from transformers import get_scheduler

        kind = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}[schedule]
        warmup = min(int(o.get("warmup_steps", 0) or 0), total)
        return {"scheduler": get_scheduler(kind, optimizer, num_warmup_steps=warmup, num_training_steps=total),
                "interval": "step"}  # fmt: skip
    if schedule == "onecycle":
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=max(total, 1),
                                                        pct_start=float(o.get("pct_start", 0.25)))  # fmt: skip
        return {"scheduler": scheduler, "interval": "step"}
    if schedule == "step":
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=int(o.get("step_size", 5)),
                                                    gamma=float(o.get("gamma", 0.1)))  # fmt: skip
        return {"scheduler": scheduler, "interval": "epoch"}
    if schedule == "plateau":
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=float(o.get("gamma", 0.1)),
                                                               patience=int(o.get("patience", 2)))  # fmt: skip
        return {"scheduler": scheduler, "interval": "epoch", "monitor": "val/acc", "strict": False}
    raise UserError(f"optim.schedule '{schedule}' is not one of {', '.join(SCHEDULES)}.")


def confusion_figure(matrix: torch.Tensor, classes: list[str]):
    """A matplotlib figure of a confusion matrix (rows: true class, columns: predicted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(classes)
    size = min(4 + 0.35 * n, 24)
    figure, ax = plt.subplots(figsize=(size, size))
    ax.imshow(matrix.numpy(), cmap="Blues")
    ticks = range(n)
    labels = classes if n <= 40 else [str(i) for i in ticks]
    ax.set_xticks(ticks, labels, rotation=90, fontsize=8 if n <= 40 else 5)
    ax.set_yticks(ticks, labels, fontsize=8 if n <= 40 else 5)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    if n <= 20:
        for i in range(n):
            for j in range(n):
                ax.text(j, i, int(matrix[i, j]), ha="center", va="center", fontsize=7)
    figure.tight_layout()
    return figure


def save_confusion(matrix: torch.Tensor, classes: list[str], path: Path) -> None:
    import matplotlib.pyplot as plt

    figure = confusion_figure(matrix, classes)
    figure.savefig(path, dpi=100)
    plt.close(figure)
