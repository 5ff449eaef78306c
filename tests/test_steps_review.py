"""The training steps of the classifier and the dual encoder, and the callbacks ONN adds, as Lightning runs them:
in the dtype they are meant to compute in under bf16 precision, and without waiting for the device."""

from __future__ import annotations

import csv
import math

import lightning as L
import torch
import torch.nn.functional as F
from conftest import compose
from test_training import watched_trainer

from onn.hardware.waits import DeviceOps


def point_batches(steps: int = 3, rows: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Point sets [rows, 16, 3] and two classes, as the mesh modality's batches reach the classifier."""
    torch.manual_seed(0)
    return [(torch.randn(rows, 16, 3), torch.randint(0, 2, (rows,))) for _ in range(steps)]


def point_classifier(mixup: float = 0.0) -> L.LightningModule:
    """The shared Classifier on ONN's PointNet, without dropout (a forward repeats exactly)."""
    from onn.models.zoo.pointnet import PointNet
    from onn.training.classifier import Classifier

    network = PointNet(3, 2, 16, widths=(8, 16), hidden=(8,), dropout=0.0)
    optim = compose("optim.name=sgd", "optim.lr=0.1", "optim.schedule=constant", "optim.warmup_steps=0").optim
    return Classifier(network, ["a", "b"], optim, {}, mixup=mixup)


def counted_steps(module: L.LightningModule) -> DeviceOps:
    """module.training_step watched by a DeviceOps: what its steps would make the host wait for on a GPU."""
    counter, step = DeviceOps(torch.device("cpu")), module.training_step

    def counted(batch, batch_idx):
        with counter:
            return step(batch, batch_idx)

    module.training_step = counted
    return counter


def test_mixup_trains_under_bf16_true_with_its_weight_in_float32():
    """task.mixup with strategy.precision=bf16-true: Lightning makes bf16 the default dtype inside a step, and the
    mixing weight's Beta was drawn from a bf16 alpha, which torch cannot sample ("dirichlet" not implemented for
    'BFloat16'): the first step failed with a traceback. The weight each sample's loss blends by is float32."""
    module = point_classifier(mixup=0.4)
    weights = []
    mixed_batch = module.mixed_batch

    def kept(x, labels):
        batch = mixed_batch(x, labels)
        weights.append(batch["weight"])
        return batch

    module.mixed_batch = kept
    watched_trainer(3, "bf16-true").fit(module, train_dataloaders=torch.utils.data.DataLoader(point_batches(), None))
    assert len(module.train_losses) == 3 and all(math.isfinite(float(x)) for x in module.train_losses)
    assert all(w.dtype == torch.float32 and 0 <= float(w[0]) <= 1 for w in weights)
    assert next(module.model.parameters()).dtype == torch.bfloat16  # the network did train in bf16


def test_a_classifiers_training_loss_is_float32_under_bf16_true_and_waits_for_nothing():
    """Under strategy.precision=bf16-true the network's logits are bf16: the training loss was their cross-entropy
    in bf16 (train/loss rounded to three digits, where the evaluation's is float32). It is the float32
    cross-entropy of those logits, and a step still makes the host wait for nothing."""
    import torch.nn.functional as F

    module = point_classifier()
    wanted = []

    class Expected(L.Callback):
        """The step's loss from the weights the step starts with: float32 cross-entropy of the bf16 logits."""

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            x, labels = batch
            with torch.no_grad():
                logits = pl_module(pl_module.prepare(x, train=True))
            wanted.append(F.cross_entropy(logits.float(), labels))

    counter = counted_steps(module)
    trainer = watched_trainer(3, "bf16-true", callbacks=[Expected()])
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(point_batches(), None))
    assert counter.waits == 0 and counter.ops > 0
    assert [x.dtype for x in module.train_losses] == [torch.float32] * 3
    for got, want in zip(module.train_losses, wanted):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_the_dual_encoders_loss_is_float32_under_bf16_mixed_and_waits_for_nothing():
    """bf16-mixed's autocast took the similarity matmul of the dual encoder's float32 unit embeddings to bf16
    (similarities near 1 are 0.004 apart in bf16, 0.4 in a logit at a logit scale of 100): the training loss was
    not the float32 loss of the step's embeddings, which validation reports. It is now, and a step still makes
    the host wait for nothing."""
    from onn.modalities.pairs.module import DualEncoder

    cfg = compose("data=pairs", "model=dual_encoder", "model.temperature=0.01", "optim.warmup_steps=0")
    torch.manual_seed(0)
    towers = {"image": torch.nn.Linear(32, 16), "text": torch.nn.Linear(32, 16)}
    module = DualEncoder(towers, 16, cfg.model, cfg.optim, {})
    shared = torch.randn(3, 16, 32)  # partners alike: their similarities lie close together near 1
    batches = [(s, s + 0.2 * torch.randn_like(s)) for s in shared]
    wanted = []

    class Expected(L.Callback):
        """The step's loss from its weights: the embeddings as autocast computes them, their loss in float32."""

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            with torch.no_grad():
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    a, b = (pl_module.embed(name, x) for name, x in zip(pl_module.names, batch))
                with torch.autocast("cpu", enabled=False):
                    logits = pl_module.scale() * a @ b.T
                target = torch.arange(len(a))
                wanted.append((F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2)

    counter = counted_steps(module)
    trainer = watched_trainer(3, "bf16-mixed", callbacks=[Expected()])
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, None))
    assert counter.waits == 0 and counter.ops > 0
    for got, want in zip(module.train_losses, wanted, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


class _NumbersToDevice(torch.overrides.TorchFunctionMode):
    """Counts torch.tensor calls that name a device: Lightning makes each number logged a tensor on the module's
    device so, a blocking copy from the host on a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.copies = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.copies += func is torch.tensor and kwargs.get("device") is not None
        return func(*args, **kwargs)


def test_the_resource_monitor_logs_its_figures_without_a_copy_to_the_device(tmp_path):
    """ResourceMonitor logged its figures as Python numbers, which Lightning turns into tensors on the module's
    device: on a GPU a blocking copy each, after the host has queued the step's backward and optimizer, so the
    host waited for them on every logging step. It logs host tensors: no number goes to the device, and the
    figures still reach the logger."""
    from lightning.pytorch.loggers import CSVLogger

    from onn.training.callbacks import ResourceMonitor

    counter = _NumbersToDevice()

    class Start(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            counter.__enter__()

    class Stop(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            counter.__exit__(None, None, None)

    module = point_classifier()
    trainer = watched_trainer(
        4,
        logger=CSVLogger(tmp_path, name="csv", version=""),
        callbacks=[Start(), ResourceMonitor(every_n_steps=2), Stop()],  # Lightning calls them in this order
        log_every_n_steps=2,
    )
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(point_batches(steps=4), None))
    assert counter.copies == 0
    rows = list(csv.DictReader((tmp_path / "csv" / "metrics.csv").open()))
    rss = [float(r["resource/process_rss_mb"]) for r in rows if r.get("resource/process_rss_mb")]
    assert len(rss) == 2 and all(x > 50 for x in rss)
