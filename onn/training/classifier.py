"""The classifier LightningModule: a transform on the batch, cross-entropy, torchmetrics accuracy.

Batches arrive in the modality's stored form already on the device (uint8 pixels, raw samples,
points); the module's `transform` turns them into the network's input itself (augmented only in
training: image crops and flips, SpecAugment masks, point-cloud rotations), so the data pipeline
does no per-sample work. For a linear probe the batches are cached backbone features and only the
head runs. Layer-streamed (strategy=sparse_lora on a recurrent stack), the engine runs the network's blocks
from the layer store with ClassifierObjective.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from onn.config import OptimConfig
from onn.errors import UserError
from onn.streaming.engine import Objective
from onn.training.distributed import clip_gradients
from onn.training.metrics import ClassPairs, WeightedMean
from onn.training.module import ONNModule
from onn.training.optim import make_optimizer, make_schedule
from onn.training.record import EpochRecord, log_train_loss

LOOP = "epochs"
log = logging.getLogger("onn")
MONITORED = ("val/acc", "val/acc_top5", "val/loss", "train/loss")  # the figures a classifier logs (task.monitor)


@contextlib.contextmanager
def in_float32(batch: torch.Tensor) -> Iterator[None]:
    """A transform's context: autocast off and float32 the default dtype. Under strategy.precision=bf16-true
    Lightning makes bf16 the default inside a step, so an augmentation's random draws (a rotation, noise) came out
    in bf16 beside its float32 inputs."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with torch.autocast(batch.device.type, enabled=False):
            yield
    finally:
        torch.set_default_dtype(before)


class ClassifierObjective(Objective):
    """A classifier's batches, for the layer-streaming engine and the resident step alike: the network's prepared
    input `x` in, its loss (the module's: cross-entropy with label smoothing, or model.loss) against the labels
    `y`, or with task.mixup the blend of its losses against `y` and `y_mixed` (Classifier.mixed_batch)."""

    hold_mmap_threshold = True  # a network's activations: unmapped when freed (Objective)

    def __init__(self, loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        self._loss = loss

    def inputs(self, batch: dict[str, Any], targets: bool = False) -> dict[str, Any]:
        return {"x": batch["x"]}

    def loss(self, output: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
        """In float32: under strategy.precision=bf16-true the logits are bf16, and a cross-entropy of bf16 logits
        is a bf16 loss (train/loss rounded to 3 digits), as the evaluation's float32 loss is not."""
        return mixed_loss(self._loss, output.float(), batch["y"], batch.get("y_mixed"), batch.get("weight"))

    def weight(self, batch: dict[str, Any]) -> int:
        return int(batch["x"].shape[0])


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


class Classifier(EpochRecord, ONNModule):
    loop = LOOP
    describes = "ONN's image classifier"

    def __init__(
        self,
        model: nn.Module,
        classes: list[str],
        optim: OptimConfig,
        onn_config: dict[str, Any],
        transform: nn.Module | None = None,
        label_smoothing: float = 0.0,
        channels_last: bool = False,
        inputs: str = "data",
        monitor: str = "val/acc",
        adapt_norm: bool = False,
        loss: tuple[str, Callable] | None = None,
        mixup: float = 0.0,
    ):
        super().__init__()
        from torchmetrics.classification import MulticlassAccuracy

        if monitor not in MONITORED:  # Lightning's checkpoint refused it with a traceback after the first epoch
            raise UserError(
                f"task.monitor={monitor!r} is not a figure {self.describes} logs, so no checkpoint could be picked "
                f"by it: give one of {', '.join(MONITORED)}."
            )
        self.model = model
        self.classes = list(classes)
        self.optim = optim
        self.optimizer_steps: int | None = None  # the schedule's length, when the runner knows it (optimizer_steps)
        self.onn_config = onn_config  # plain values, stored in every checkpoint so eval/infer/export rebuild this model
        self.transform = transform  # stored form -> the network's input (augmented in training)
        self.label_smoothing = float(label_smoothing)
        self.mixup = float(mixup)  # mixup's Beta(alpha, alpha) (task.mixup; 0: off): see mixed_batch
        self.channels_last = channels_last
        self.inputs = inputs  # "data", or "features" for a linear probe on cached features
        self.monitor = monitor  # what the plateau schedule watches (task.monitor)
        self.adapt_norm = adapt_norm  # AdaBN before a test or a validation on its own (task.adapt_norm): _adapt_for
        self._trained_norms: dict[str, torch.Tensor] | None = None
        self.loss = loss  # (model.loss, the user's loss(outputs, labels)); None: cross-entropy
        if channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)
        n = len(self.classes)
        # figures that add up on the device and are read once per evaluation (onn/training/metrics.py); the
        # labels are the data module's class indices, so torchmetrics need not check them each batch
        self.metrics = nn.ModuleDict(
            {
                f"{stage}_{name}": metric
                for stage in ("val", "test")
                for name, metric in (
                    ("acc", MulticlassAccuracy(n, average="micro", validate_args=False)),
                    ("acc_top5", MulticlassAccuracy(n, top_k=min(5, n), average="micro", validate_args=False)),
                    ("confusion", ClassPairs(n)),
                    ("loss", WeightedMean()),
                )
            }
        )
        self.train_losses: list[torch.Tensor] = []  # detached per step; read once at the end (no per-step sync)
        self.engine = None  # set by LayerStreamingStrategy: the blocks' frozen weights stream from a layer store
        self.store = None  # a layer store the blocks were loaded into beforehand (none: the strategy makes it)
        # streamed: checkpoints hold what trains and the buffers; the frozen base is the seed's, built again
        self.strict_loading = all(p.requires_grad for p in model.parameters())
        self.history: list[dict[str, float]] = []  # per validation: epoch, step, val/acc, val/loss
        self.confusion: dict[str, torch.Tensor] = {}

    # -- the steps ------------------------------------------------------------------------------------
    def prepare(self, batch_x: torch.Tensor, train: bool) -> torch.Tensor:
        """The batch as this module's forward takes it: cached features as they are, stored data transformed."""
        if self.inputs == "features":
            return batch_x.to(self.dtype)
        return self.network_input(batch_x, train)

    def network_input(self, batch_x: torch.Tensor, train: bool) -> torch.Tensor:
        """A stored batch as the network takes it (normalised with data.mean/std, the log-mel, ...): what a linear
        probe's backbone computes its cached features from, as infer and export run it."""
        if batch_x.is_floating_point():  # points in bf16 under bf16-true, as Lightning casts a float batch
            batch_x = batch_x.float()
        with in_float32(batch_x):  # the transform runs in fp32; the model in autocast
            x = self.transform(batch_x, train=train) if self.transform is not None else batch_x.float()
        x = x.to(self.dtype)  # the weights' dtype: bf16 under strategy.precision=bf16-true, not the transform's float32
        return x.contiguous(memory_format=torch.channels_last) if self.channels_last and x.dim() == 4 else x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.head(x) if self.inputs == "features" else self.model(x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The network's output for a prepared batch, through the layer-streaming engine when its blocks stream."""
        if self.engine is None:
            return self(x)
        return torch.cat(self.engine.outputs(self.engine.split({"x": x})))

    def objective(self) -> ClassifierObjective:
        """What the training loss is computed with, streamed or resident: this module's own loss."""
        return ClassifierObjective(lambda logits, labels: self._loss(logits, labels, self.label_smoothing))

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, labels = batch
        batch = self.mixed_batch(self.prepare(x, train=True), labels)
        if self.engine is not None:  # the blocks' backward runs in the strategy's backward
            loss = self.engine.forward_train(self.engine.split(batch), loss_scale=self.trainer.strategy.loss_scale())
        else:
            loss = self.objective().loss(self(batch["x"]), batch)
        self.record_step(loss, batch)
        log_train_loss(self, loss, labels.shape[0], over_ranks=True)  # under DDP each rank's loss is its share's
        return loss

    def mixed_batch(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        """A prepared training batch as the loss reads it: `x` and its labels `y`; with task.mixup (Zhang et al.,
        2018) `x` blended with itself reversed by one weight drawn from Beta(alpha, alpha), and per sample its
        partner's labels `y_mixed` and the `weight`, so that each micro-batch the streaming engine splits off
        blends its loss alike (mixed_loss). Written here: timm's Mixup needs an even batch and gives soft
        targets, which a model.loss of class labels cannot take."""
        if not self.mixup:
            return {"x": x, "y": labels}
        # float32 named: under bf16-true Lightning makes bf16 the default dtype, which Beta cannot sample from
        alpha = torch.tensor(self.mixup, dtype=torch.float32)
        weight = float(torch.distributions.Beta(alpha, alpha).sample())  # drawn on the host: no copy to wait for
        return {
            "x": weight * x + (1 - weight) * x.flip(0),
            "y": labels,
            "y_mixed": labels.flip(0),
            "weight": torch.full(labels.shape, weight, dtype=torch.float32, device=x.device),
        }

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float) -> torch.Tensor:
        """Cross-entropy, or the user's model.loss, which must give one number to backpropagate."""
        if self.loss is None:
            return F.cross_entropy(logits, labels, label_smoothing=label_smoothing)
        name, function = self.loss
        loss = function(logits, labels)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
            got = f"a tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise UserError(
                f"model.loss {name} returned {got}; it must return one floating-point number (a scalar tensor), "
                "e.g. the .mean() of its per-item losses."
            )
        return loss.reshape(())

    def validation_step(self, batch, batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch, batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def _evaluate(self, batch, stage: str) -> None:
        x, labels = batch
        if not labels.shape[0]:  # an empty batch adds nothing (and its mean loss is 0/0)
            return
        logits = self.logits(self.prepare(x, train=False)).float()
        self.metrics[f"{stage}_loss"].update(self._loss(logits, labels, 0.0), labels.shape[0])
        for name in ("acc", "acc_top5", "confusion"):
            self.metrics[f"{stage}_{name}"].update(logits, labels)

    def on_test_epoch_start(self) -> None:
        if self.adapt_norm:
            self._adapt_for(self.trainer.test_dataloaders)

    def on_validation_epoch_start(self) -> None:
        """AdaBN before a validation run on its own (task=eval: the held-out split, or the data.source it was given,
        which it scores as val), not before training's validations, which pick the best checkpoint as trained."""
        from lightning.pytorch.trainer.states import TrainerFn

        if self.adapt_norm and self.trainer.state.fn == TrainerFn.VALIDATING:
            self._adapt_for(self.trainer.val_dataloaders)

    def _adapt_for(self, batches) -> None:
        """adapt_batch_norm on `batches`; the trained statistics come back when the stage ends (_epoch_end)."""
        self._trained_norms = {
            k: v.clone()
            for k, v in self.model.state_dict().items()
            if k.rsplit(".", 1)[-1] in ("running_mean", "running_var", "num_batches_tracked")
        }
        # under the evaluation's precision (bf16-mixed: autocast): the norms measure the inputs they will normalise
        with self.trainer.precision_plugin.forward_context():
            self.adapt_batch_norm(batches)

    def samples(self, inputs) -> int:
        """The samples in a batch's inputs (a graph batch counts its graphs)."""
        return inputs.shape[0]

    @torch.no_grad()
    def adapt_batch_norm(self, batches) -> int:
        """AdaBN (Li et al., 2016): measure every BatchNorm's statistics again on `batches` (their inputs
        only, never their labels), as those of all the samples measured. A new speaker, microphone or camera shifts
        the features' statistics away from the training data's; normalising by the new data's own undoes
        that shift. Returns the samples measured.

        Each norm's inputs are accumulated (NormInputs: per-channel count, mean and squared deviations) as the
        batches pass in training mode, and set as its running mean and (unbiased, as torch keeps it) variance at the
        end: a mean of the batches' variances left out the spread of their means, far too small on class-sorted
        test data. Nothing is read to the host per batch. A batch that a norm refuses in training mode (one value
        per channel: a batch of one sample whose features are pooled to 1x1) is left out, said once; a batch of one
        an HxW map normalises is measured. With no batch measured the trained statistics stay.

        Under DDP each rank measures its own share of the batches; the ranks' accumulations are then combined
        (combine_over_ranks), so that every rank evaluates, and rank 0 saves, the same model. Returns the samples
        measured by all ranks."""
        norms = [m for m in self.model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        if not norms:
            return 0
        saved = [(m.momentum, m.training) for m in norms]
        inputs = NormInputs([m for m in norms if m.running_mean is not None])
        trained = norm_buffers(inputs.norms)
        try:
            for m in norms:  # the batches normalised by their own statistics; the running ones left as they are
                m.train()
                m.momentum = 0.0  # not None: torch's cumulative average reads its batch count back at every forward
            with measured_on_this_rank(norms), inputs.hooked():
                measured, seen, left_out = self._measure(inputs, batches)
        finally:
            for m, (momentum, training) in zip(norms, saved):
                m.momentum = momentum
                m.train(training)
            restore_norm_buffers(inputs.norms, trained)  # their batch counts went up
        measured, seen = combine_over_ranks(inputs, measured, seen)
        if left_out:
            kept = (
                ""
                if measured
                else "; no batch was measured, so the trained statistics are kept (set data.eval_batch_size to "
                "2 or more to measure them)"
            )
            log.warning(
                "task.adapt_norm: %d sample(s) in batches of one left out of AdaBN's statistics (a norm sees one value "
                "per channel in them)%s",
                left_out,
                kept,
            )
        return seen

    def _measure(self, inputs: NormInputs, batches) -> tuple[int, int, int]:
        """adapt_batch_norm's pass over `batches`, the norms' inputs accumulated in `inputs`. Returns the batches
        measured, their samples, and the samples left out (batches of one)."""
        measured = seen = left_out = 0
        for x, _ in batches:
            samples = self.samples(x)
            if not samples:
                continue
            try:
                self.logits(self.prepare(to_device(x, self.device), train=False))
            except ValueError as e:  # raised from the batch's shape, by the refusing norm
                if samples >= 2 or "Expected more than 1 value per channel" not in str(e):
                    raise
                inputs.drop()  # the norms before it had measured the batch
                left_out += samples
                continue
            inputs.keep()
            measured += 1
            seen += samples
        return measured, seen, left_out

    def on_validation_epoch_end(self) -> None:
        self._epoch_end("val")
        self._trained_back()

    def on_test_epoch_end(self) -> None:
        self._epoch_end("test")
        self._trained_back()

    def _trained_back(self) -> None:
        if self._trained_norms is not None:
            self.model.load_state_dict(self._trained_norms, strict=False)
            self._trained_norms = None

    def _epoch_end(self, stage: str) -> None:
        loss = self.metrics[f"{stage}_loss"].compute(self.device, self.trainer.world_size)
        figures = {
            f"{stage}/acc": self.metrics[f"{stage}_acc"].compute(),
            f"{stage}/acc_top5": self.metrics[f"{stage}_acc_top5"].compute(),
            f"{stage}/loss": float("nan") if loss is None else loss,
        }
        self.confusion[stage] = self.metrics[f"{stage}_confusion"].compute()
        for metric in ("acc", "acc_top5"):
            self.metrics[f"{stage}_{metric}"].reset()
        # already each figure over every process (compute() above): sync_dist only says so to Lightning
        self.log_dict(figures, prog_bar=stage == "val", sync_dist=True)
        if stage == "val" and not self.trainer.sanity_checking:
            self.record_epoch(figures, list(figures))
            self._log_confusion(stage)

    def _log_confusion(self, stage: str) -> None:
        """The confusion matrix as a picture in TensorBoard (other loggers take no figures)."""
        from lightning.pytorch.loggers import TensorBoardLogger

        loggers = [lg for lg in self.trainer.loggers if isinstance(lg, TensorBoardLogger)]
        if loggers:
            import matplotlib.pyplot as plt

            figure = confusion_figure(self.confusion[stage], self.classes)
            for lg in loggers:
                lg.experiment.add_figure(f"{stage}/confusion_matrix", figure, self.global_step)
            plt.close(figure)

    def on_before_optimizer_step(self, optimizer) -> None:
        clip_gradients(self, optimizer, float(self.optim.clip_grad_norm))

    # -- optimiser and schedule -----------------------------------------------------------------------
    def configure_optimizers(self):
        optimizer = make_optimizer([p for p in self.model.parameters() if p.requires_grad], self.optim)
        schedule = make_schedule(
            optimizer, self.optim, self.optimizer_steps or int(self.trainer.estimated_stepping_batches), self.monitor
        )
        return {"optimizer": optimizer, "lr_scheduler": schedule}

    # -- checkpoints ------------------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.inputs == "features":  # the frozen backbone comes from model.weights again
            checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if ".backbone." not in k}
        elif not self.strict_loading:  # streamed: the frozen weights are the seed's (and live in the store)
            kept = {n for n, p in self.named_parameters() if p.requires_grad} | {n for n, _ in self.named_buffers()}
            checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in kept}
        super().on_save_checkpoint(checkpoint)
        # whether its test figures were measured with AdaBN: task=eval says so when it runs without (adapt_norm_note)
        checkpoint["onn"]["config"] = {**self.onn_config, "task": {"adapt_norm": bool(self.adapt_norm)}}

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if self.inputs == "features":
            strict = False  # checkpoints hold the head only
        return super().load_state_dict(state_dict, strict=strict, assign=assign)


def norm_buffers(norms: list[nn.Module]) -> list[dict[str, torch.Tensor]]:
    """Copies of the norms' running statistics and batch counts, on their device (nothing read to the host)."""
    return [{k: v.clone() for k, v in m.named_buffers(recurse=False)} for m in norms]


def restore_norm_buffers(norms: list[nn.Module], copies: list[dict[str, torch.Tensor]]) -> None:
    """The norms' buffers as norm_buffers copied them."""
    for m, buffers in zip(norms, copies):
        for k, v in m.named_buffers(recurse=False):
            v.copy_(buffers[k])


@contextlib.contextmanager
def measured_on_this_rank(norms: list[nn.Module]) -> Iterator[None]:
    """The norms' SyncBatchNorms normalising by this rank's batch alone (plain batch norm) for the body. In training
    mode a SyncBatchNorm's forward is a collective, so AdaBN's ranks, whose shares may differ by a batch (and which
    leave out batches of one on their own), would wait on each other for ever on a GPU, and a CPU refuses it
    (ValueError); each rank measures its own batches and combine_over_ranks combines them in one collective."""
    synced = [m for m in norms if isinstance(m, nn.SyncBatchNorm)]
    for m in synced:
        m.forward = types.MethodType(nn.modules.batchnorm._BatchNorm.forward, m)
    try:
        yield
    finally:
        for m in synced:
            del m.forward


@dataclasses.dataclass
class Moments:
    """Per channel: how many values (`count`, the same for every channel), their mean and the sum of their squared
    deviations from it (`m2`)."""

    count: int
    mean: torch.Tensor
    m2: torch.Tensor

    @classmethod
    def of(cls, x: torch.Tensor) -> Moments:
        """The moments of a norm's input [N, C, ...] over every dimension but the channels', in float64 (float32 on
        Apple's MPS, which has none)."""
        dims = [0, *range(2, x.dim())]
        var, mean = torch.var_mean(x.float(), dim=dims, correction=0)
        dtype = torch.float32 if x.device.type == "mps" else torch.float64
        count = x.numel() // x.shape[1]
        return cls(count, mean.to(dtype), var.to(dtype) * count)

    @classmethod
    def none(cls, norm: nn.Module) -> Moments:
        """The moments of no value, for a norm that measured none."""
        return cls(0, torch.zeros_like(norm.running_mean), torch.zeros_like(norm.running_mean))

    def merged(self, other: Moments | None) -> Moments:
        """The moments of both sets of values (Chan et al.'s pairwise formula): M2 gains the spread of the two
        means, which a mean of the sets' variances leaves out."""
        if other is None or not other.count:
            return self
        if not self.count:
            return other
        count = self.count + other.count
        delta = other.mean - self.mean
        mean = self.mean + delta * (other.count / count)
        return Moments(count, mean, self.m2 + other.m2 + delta.square() * (self.count * other.count / count))


class NormInputs:
    """The moments of every input each of `norms` normalised while hooked (a forward pre-hook per norm): a batch's
    join the measured ones once its whole forward ran (keep), and are dropped when a later norm refuses the batch."""

    def __init__(self, norms: list[nn.Module]):
        self.norms = norms
        self.measured: list[Moments | None] = [None] * len(norms)
        self._batch: list[Moments | None] = [None] * len(norms)

    @contextlib.contextmanager
    def hooked(self) -> Iterator[None]:
        handles = [m.register_forward_pre_hook(self._hook(i)) for i, m in enumerate(self.norms)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _hook(self, i: int) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def measure(norm: nn.Module, args: tuple[Any, ...]) -> None:
            if args[0].numel():  # a norm in training mode takes an empty batch: its moments are NaN
                self._batch[i] = Moments.of(args[0]).merged(self._batch[i])

        return measure

    def keep(self) -> None:
        self.measured = [m if b is None else b.merged(m) for m, b in zip(self.measured, self._batch)]
        self.drop()

    def drop(self) -> None:
        self._batch = [None] * len(self.norms)

    def set_norms(self, batches: int) -> None:
        """Each measured norm's running mean and unbiased running variance those of all it measured."""
        for norm, moments in zip(self.norms, self.measured):
            if moments is None or not moments.count:
                continue
            norm.running_mean.copy_(moments.mean)
            norm.running_var.copy_(moments.m2 / max(moments.count - 1, 1))
            if norm.num_batches_tracked is not None:
                norm.num_batches_tracked.fill_(batches)


def combine_over_ranks(inputs: NormInputs, measured: int, seen: int) -> tuple[int, int]:
    """Every rank's norms set to the statistics of all ranks' batches, as one process measuring them all has them:
    the ranks' counts, sums and sums of squares (about zero, in float64) added in one collective. A rank that
    measured none adds nothing; with none measured anywhere the trained statistics stay. Returns the batches and
    samples measured over all ranks (this rank's own without a process group of two or more)."""
    if inputs.norms and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        measured, seen = _summed_over_ranks(inputs, measured, seen)
    if measured:
        inputs.set_norms(measured)
    return measured, seen


def _summed_over_ranks(inputs: NormInputs, measured: int, seen: int) -> tuple[int, int]:
    """combine_over_ranks' collective: `inputs` become the moments of every rank's, and the batches and samples
    measured are summed. Read to the host once: the counts."""
    device = inputs.norms[0].running_mean.device
    found = [m if m is not None else Moments.none(n) for n, m in zip(inputs.norms, inputs.measured)]
    counts = torch.tensor([measured, seen, *(m.count for m in found)], dtype=torch.float64)
    sums = [m.mean.to(device, torch.float64) * m.count for m in found]
    squares = [m.m2.to(device, torch.float64) + s * m.mean.to(device, torch.float64) for m, s in zip(found, sums)]
    flat = torch.cat([counts.to(device), *sums, *squares])
    dist.all_reduce(flat)  # one collective
    numbers = [int(v) for v in flat[: len(counts)].tolist()]
    widths = [len(s) for s in sums]
    summed = flat[len(counts) :].split(widths + widths)
    for i, count in enumerate(numbers[2:]):
        mean = summed[i] / max(count, 1)
        m2 = (summed[len(found) + i] - mean.square() * count).clamp_min(0)
        inputs.measured[i] = Moments(count, mean, m2) if count else None
    return numbers[0], numbers[1]


def to_device(x, device: torch.device):
    """A batch (a tensor, or a torch_geometric Batch) on `device` without the host waiting for the GPU: a copy to it
    from pageable host memory waits for every kernel queued there, one from pinned memory (a DataLoader's
    pin_memory, or pinned here; pinned memory pins as itself) is queued behind them."""
    if device.type == "cuda" and not x.is_cuda:
        x = x.pin_memory()
    return x.to(device, non_blocking=True)


def trained_config(config) -> dict[str, Any] | None:
    """The run config saved in the classifier checkpoint that `ckpt=` names, or None without one. What decodes and
    featurises the data belongs to the model (its `inputs`): eval, infer and a resumed run decode with these
    settings, whatever the data config given with the checkpoint (`data=NAME`) says."""
    ckpt = getattr(config, "ckpt", None)  # (a dual encoder's side config has none)
    if not ckpt:
        return None
    from onn.training.checkpoints import resolve, saved_config

    saved = saved_config(resolve(ckpt, config.paths.outputs))
    return saved if isinstance(saved.get("inputs"), dict) else None


def adapt_norm_note(module: Classifier, saved: dict[str, Any], ckpt) -> None:
    """Say so when the checkpoint's run measured its test figures with AdaBN (task.adapt_norm) and this evaluation
    keeps the trained statistics: task.adapt_norm is the command line's (false unless given), and the figures
    would differ from the training's without a word."""
    if (saved.get("task") or {}).get("adapt_norm") and not module.adapt_norm:
        log.warning(
            "ckpt %s was tested with task.adapt_norm=true (AdaBN: the norms measured again on the test inputs); this "
            "evaluation keeps the trained norms, so its figures differ from the training's: add task.adapt_norm=true "
            "to measure as it did",
            ckpt,
        )


def evaluation_autocast(config, plan, device: torch.device | str):
    """The autocast Lightning's mixed precision evaluates under (trainer.precision, or the plan's), for code that
    calls the network itself (task=infer, task=serve): their answers are then task=eval's, where a bf16 network can
    put a close call the other way than float32. No autocast for a plan without one (or without a plan)."""
    import contextlib

    trainer = getattr(config, "trainer", None)
    precision = getattr(trainer, "precision", None)
    if precision in (None, "auto"):
        precision = getattr(plan, "precision", None)
    dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(str(precision))
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)


def mixed_loss(
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    logits: torch.Tensor,
    labels: torch.Tensor,
    mixed: torch.Tensor | None,
    weight: torch.Tensor | None,
) -> torch.Tensor:
    """loss(logits, labels), or for a mixed batch (Classifier.mixed_batch) the same blend of the losses against both
    inputs' labels as of the inputs: weight x loss(labels) + (1 - weight) x loss(mixed)."""
    if mixed is None or weight is None:
        return loss(logits, labels)
    weight = weight.reshape(-1)[0]  # one weight per batch: each micro-batch carries it per sample
    return weight * loss(logits, labels) + (1 - weight) * loss(logits, mixed)


def confusion_figure(matrix: torch.Tensor, classes: list[str]):
    """A matplotlib figure of a confusion matrix (rows: true class, columns: predicted), drawn by torchmetrics."""
    import matplotlib

    matplotlib.use("Agg")
    from torchmetrics.classification import MulticlassConfusionMatrix

    n = len(classes)
    figure, _ = MulticlassConfusionMatrix(n).plot(val=matrix, add_text=n <= 20, labels=classes if n <= 40 else None)
    size = min(4 + 0.35 * n, 24)
    figure.set_size_inches(size, size)
    if figure.get_layout_engine() is None:  # torchmetrics may have set one: tight_layout() would warn
        figure.tight_layout()
    return figure


def save_confusion(matrix: torch.Tensor, classes: list[str], path: Path) -> None:
    import matplotlib.pyplot as plt

    figure = confusion_figure(matrix, classes)
    figure.savefig(path, dpi=100)
    plt.close(figure)
