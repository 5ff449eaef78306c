"""task=bench_vision: what ONN's image runner costs, and what its device-resident pipeline saves.

runner overhead   the same model, optimiser, augmentation, precision and batches from the same
                  device-resident tensors, trained by a plain hand-written PyTorch loop and by ONN
                  (Lightning Trainer + ImageClassifier, as a run uses them): plain / ONN - 1.
lightning floor   the plain loop's step as a bare LightningModule's training_step (automatic optimisation)
                  under a Trainer with nothing of ONN's (no logger, checkpoint, progress bar or summary):
                  plain / bare - 1, what Lightning's loop costs by itself. Where a step's kernels take less
                  time than the host takes to queue them (a small CNN on a fast GPU), that cost is the step's.
resident speedup  the two ways of feeding v28 its training batches (the recipe's batch size, augmentation
                  and normalisation, on the compute device), timed alone: ONN's resident uint8
                  tensors sliced by a shuffled index and augmented on the device, against the standard
                  per-sample pipeline (a Dataset that decodes each image as training does and applies
                  torchvision transforms, a DataLoader with workers collating batches): resident / standard
                  batches-ready samples/s.
device ops        what each side of the runner's overhead asks of the device per training step, counted rather
                  than timed: the aten ops it dispatches, views aside (on a GPU most launch a kernel: the
                  host's share of a step), and those that make the host wait for the GPU (a value read back,
                  a blocking copy, an output sized by its values; onn/hardware/waits.py). Equal counts leave
                  the runner's overhead to its own Python time per step.
train speedup     the same two pipelines each training v28 end to end: resident / standard samples/s.
                  Where the model's compute dominates (v28 on a few CPU cores) this is far below the
                  pipeline ratio; on a GPU, where v28's step takes a millisecond, it approaches it.

Throughput is the rows the timed iterations held over their wall time (data, step, loop overhead), after
warm-up steps; loops run epoch after epoch, full batches only unless the training split holds less than one.
Each of `task.repeats` rounds times the plain loop, ONN and the bare LightningModule back to back, each
side first in turn; the runner overhead and the floor are the median round's ratios (a noisy neighbour
slows a round's sides alike), the speedups compare each side's best round.
"""

from __future__ import annotations

import dataclasses
import gc
import io
import logging
import math
import statistics
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from onn.config import ONNConfig
from onn.config.data import ImageData
from onn.config.task import BenchVisionTask
from onn.errors import UserError
from onn.hardware.waits import DeviceOps
from onn.training.callbacks import batch_rows

log = logging.getLogger("onn")


def run(job) -> dict[str, Any]:
    config, plan, run_dir = job.config, job.plan, job.run_dir
    import lightning as L

    from onn.modalities import classification, get

    image = get("image")
    task: BenchVisionTask = config.task
    steps, warmup, repeats = task.steps, task.warmup, task.repeats
    if steps < 2 or warmup < 1 or repeats < 1:
        raise UserError("task.steps must be 2 or more, task.warmup and task.repeats 1 or more.")
    dm = classification.setup_data(image, config, job.device)
    inputs = classification.data_inputs(image, config, dm)
    batch = dm.batch_size
    results: dict[str, list[float]] = {"plain": [], "onn": [], "lightning": [], "standard": [], "resident": []}
    # the ONN side trains without validation, on purpose: Lightning's note that the classifier has a validation_step
    warnings.filterwarnings("ignore", message=r"You defined a `validation_step` but have no `val_dataloader`")
    sides = [
        ("plain", lambda: _plain_loop(config, plan, inputs, dm, steps, warmup)),
        ("onn", lambda: _onn_run(config, plan, inputs, dm, run_dir, steps, warmup)),
        ("lightning", lambda: _bare_lightning(config, plan, inputs, dm, run_dir, steps, warmup)),
    ]
    for round_ in range(repeats):  # each round times every side, in turn first: a slow spell hits them all
        for name, measure in sides[round_ % 3 :] + sides[: round_ % 3]:
            gc.collect()  # not the previous side's garbage in this side's timed steps
            L.seed_everything(0, verbose=False)
            results[name].append(measure())
    standard = StandardPipeline(config, dm, inputs)
    pipe = {"standard": [], "resident": []}
    for _ in range(repeats):
        results["standard"].append(_plain_loop(config, plan, inputs, dm, steps, warmup, loader=standard.loader()))
        results["resident"].append(_plain_loop(config, plan, inputs, dm, steps, warmup))
        pipe["standard"].append(_pipeline_only(standard.loader(), steps, warmup, None, dm.device))
        pipe["resident"].append(
            _pipeline_only(dm.train_dataloader(), steps, warmup, _augment(config, inputs), dm.device)
        )
    ops = _device_work(config, plan, inputs, dm, run_dir)
    best = {k: max(v) for k, v in results.items()}
    best_pipe = {k: max(v) for k, v in pipe.items()}
    metrics = {
        "vision/runner_overhead": _median_ratio(results["plain"], results["onn"]),
        "vision/runner_overhead_best": round(best["plain"] / best["onn"] - 1, 4),
        "vision/lightning_floor": _median_ratio(results["plain"], results["lightning"]),
        "vision/plain_samples_per_s": round(best["plain"], 1),
        "vision/onn_samples_per_s": round(best["onn"], 1),
        "vision/lightning_samples_per_s": round(best["lightning"], 1),
        "vision/resident_speedup": round(best_pipe["resident"] / best_pipe["standard"], 2),
        "vision/pipeline_resident_samples_per_s": round(best_pipe["resident"], 1),
        "vision/pipeline_standard_samples_per_s": round(best_pipe["standard"], 1),
        "vision/train_speedup": round(best["resident"] / best["standard"], 3),
        "vision/train_resident_samples_per_s": round(best["resident"], 1),
        "vision/train_standard_samples_per_s": round(best["standard"], 1),
        "vision/rounds": {
            **{k: [round(x, 1) for x in v] for k, v in results.items()},
            **{f"pipeline_{k}": [round(x, 1) for x in v] for k, v in pipe.items()},
        },
        "vision/device_ops_per_step": {side: counts["ops"] for side, counts in ops.items()},
        "vision/host_waits_per_step": {side: counts["waits"] for side, counts in ops.items()},
        "vision/batch_size": batch,
        "vision/timed_steps": steps,
        "vision/standard_workers": standard.workers,
    }
    counted = [f"{side}: {c['ops']:g} device ops, {c['waits']:g} waits for the device" for side, c in ops.items()]
    for line in (
        f"runner overhead: plain loop {best['plain']:.0f} samples/s, ONN {best['onn']:.0f} samples/s (best rounds); "
        f"median round plain/ONN - 1 = {metrics['vision/runner_overhead']:+.3f} "
        f"(a bare LightningModule: {metrics['vision/lightning_floor']:+.3f})",
        f"pipelines: resident {best_pipe['resident']:.0f} samples/s, standard Dataset+DataLoader "
        f"{best_pipe['standard']:.0f} samples/s -> resident_speedup x{metrics['vision/resident_speedup']:.1f}",
        f"per training step: {'; '.join(counted) or 'not counted (model.compile)'}",
        f"training v28 on each: resident {best['resident']:.0f} samples/s, standard {best['standard']:.0f} samples/s "
        f"-> train_speedup x{metrics['vision/train_speedup']:.2f}",
    ):
        print(line)
    return metrics


def _device_work(config: ONNConfig, plan, inputs, dm, run_dir: Path) -> dict[str, dict[str, float]]:
    """Each side's device ops and waits per step (_device_ops); none under model.compile, whose kernels bypass
    the dispatcher where the ops are counted."""
    if config.model.compile:
        return {}
    trains = {
        "plain": lambda n: _plain_loop(config, plan, inputs, dm, n, 1),
        "onn": lambda n: _onn_run(config, plan, inputs, dm, run_dir, n, 1),
    }
    return {side: _device_ops(train, dm.device, len(dm.train_dataloader())) for side, train in trains.items()}


def _device_ops(train, device: torch.device, per_epoch: int) -> dict[str, float]:
    """A side's device ops and waits per training step: a run of 1 + 2n steps less a run of 1 + n, so what a
    run does once (building the model and optimiser, the Trainer's setup) cancels out. n is 4, or whole epochs
    where the longer run would reach an epoch's end (`per_epoch` steps), so each epoch's own work counts at
    its share per step. A wait on a logging step counts where one falls among the n steps."""
    steps = 4 if per_epoch > 2 * 4 + 1 else per_epoch * math.ceil(4 / per_epoch)
    runs = []
    for n in (steps, 2 * steps):
        with DeviceOps(device) as counted:
            train(n)
        runs.append(counted)
    return {"ops": (runs[1].ops - runs[0].ops) / steps, "waits": (runs[1].waits - runs[0].waits) / steps}


def _loss_function(config: ONNConfig) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The loss ONN's classifier trains with (onn/training/classifier.py): the user's model.loss, or cross-entropy
    with task.label_smoothing."""
    from onn.models.load import user_function

    if config.model.loss:
        return user_function(config.model.loss, "model.loss")
    smoothing = float(config.task.label_smoothing)
    return lambda logits, labels: F.cross_entropy(logits, labels, label_smoothing=smoothing)


def _mixup(x: torch.Tensor, labels: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor | None, float]:
    """task.mixup as ONN's classifier mixes a batch (Classifier.mixed_batch), written as a plain loop would: the
    batch blended with itself reversed by one weight from Beta(alpha, alpha), drawn on the host; the reversed
    labels and the weight beside it. Without it ONN's side alone mixed, and its mixing counted as runner overhead."""
    if not alpha:
        return x, None, 1.0
    concentration = torch.tensor(alpha, dtype=torch.float32)
    weight = float(torch.distributions.Beta(concentration, concentration).sample())
    return weight * x + (1 - weight) * x.flip(0), labels.flip(0), weight


def _blended(loss_of, logits: torch.Tensor, labels: torch.Tensor, mixed: torch.Tensor | None, weight: float):
    """The loss against the labels, or for a mixed batch the same blend of the losses against both labels."""
    loss = loss_of(logits, labels)
    return loss if mixed is None else weight * loss + (1 - weight) * loss_of(logits, mixed)


def _augment(config: ONNConfig, inputs: dict[str, Any]):
    from onn.modalities.image.augment import BatchAugment

    return BatchAugment(config.data.augment, inputs["mean"], inputs["std"])


def _plain_model(config: ONNConfig, inputs: dict[str, Any], device: torch.device):
    from onn.models.vision import build_classifier

    torch.manual_seed(config.seed)
    channels, height, width = inputs["input_shape"]
    model = build_classifier(config.model, channels, len(inputs["classes"]), [height, width]).to(device)
    if config.model.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return torch.compile(model) if config.model.compile else model  # as ONN's side compiles it (classification.build)


def _plain_loop(config: ONNConfig, plan, inputs, dm, steps: int, warmup: int, loader=None) -> float:
    """The hand-written loop: samples/s over `steps` iterations after `warmup` ones."""
    device = dm.device
    model = _plain_model(config, inputs, device).train()
    from onn.modalities.classification import mixup_alpha
    from onn.training.optim import make_optimizer, make_schedule

    optimizer = make_optimizer(model.parameters(), config.optim)
    schedule = make_schedule(optimizer, config.optim, warmup + steps, config.task.monitor)
    scheduler = schedule["scheduler"] if schedule["interval"] == "step" else None  # per-epoch ones never step here
    clip = config.optim.clip_grad_norm
    augment = _augment(config, inputs)
    channels_last = config.model.channels_last
    loss_of, alpha = _loss_function(config), mixup_alpha(config.task)
    weights, half = plain_precision(trainer_precision(config, plan))
    if weights is not None:  # bf16-true, 16-true, 64-true: Lightning trains the converted weights on converted inputs
        model.to(weights)
    scaler = torch.amp.GradScaler(device.type, enabled=half is torch.float16)  # Lightning's 16-mixed scales too
    from_resident = loader is None
    stamps: list[float] = []
    rows: list[int] = []
    for images, labels in epochs(dm.train_dataloader() if from_resident else loader, warmup + steps + 1):
        stamp(stamps, device, warmup, steps)
        if len(stamps) > warmup + steps:
            break
        rows.append(len(labels))
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        x = augment(images, train=True) if from_resident else images  # the standard pipeline augmented per sample
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        x, mixed, weight = _mixup(x if weights is None else x.to(weights), labels, alpha)
        with torch.autocast(device.type, dtype=half or torch.float32, enabled=half is not None):
            loss = _blended(loss_of, model(x).float(), labels, mixed, weight)  # as ONN's, in float32
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if clip > 0:  # the same work as ONN's step, which clips by optim.clip_grad_norm
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(optimizer)
        scaler.update()
        if scheduler is not None:
            scheduler.step()
    return samples_per_s(stamps, rows, warmup, steps)


def epochs(loader: Iterable, count: int) -> Iterator:
    """`count` batches, the loader's epochs one after another (a split of fewer batches than the steps to time
    takes several). An epoch without a batch would have the loop spin for ever: it is an error."""
    given = 0
    while given < count:
        before = given
        for batch in loader:
            yield batch
            given += 1
            if given == count:
                return
        if given == before:
            raise UserError(
                "data.source's training split gave no batch to time: give it more items, or hold fewer out "
                "(data.val_split)."
            )


def samples_per_s(stamps: list[float], rows: list[int], warmup: int, steps: int) -> float:
    """The rows the timed steps had over their time: a step's batch may be smaller than data.batch_size (an
    epoch's partial batch, a split smaller than a batch), and each side is measured on what it processed.
    `stamps[i]` is the start of step i, `rows[i]` its batch's rows."""
    return sum(rows[warmup : warmup + steps]) / (stamps[warmup + steps] - stamps[warmup])


def synchronize(device: torch.device) -> None:
    """CUDA runs asynchronously: a time stamp must wait for the work queued before it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def stamp(stamps: list[float], device: torch.device, warmup: int, steps: int) -> None:
    """The start of an iteration. Only the timed window's two ends wait for the device: a stamp that waited
    at every step would stop either side from queueing the next step while the GPU runs this one, and add
    each side's host time to its steps one for one (the window holds all of both anyway)."""
    if len(stamps) in (warmup, warmup + steps):
        synchronize(device)
    stamps.append(time.perf_counter())


class _Stamps:
    """A Lightning callback that stamps the start of every training batch and counts its rows."""

    def __init__(self, warmup: int, steps: int):
        import lightning as L

        class Callback(L.Callback):
            def on_train_batch_start(cb, trainer, pl_module, batch, batch_idx):  # noqa: N805
                stamp(self.stamps, pl_module.device, self.warmup, self.steps)
                self.rows.append(batch_rows(batch))

            def on_train_end(cb, trainer, pl_module):  # noqa: N805
                synchronize(pl_module.device)
                self.stamps.append(time.perf_counter())

        self.stamps: list[float] = []
        self.rows: list[int] = []
        self.warmup, self.steps = warmup, steps
        self.callback = Callback()


def _onn_run(config: ONNConfig, plan, inputs, dm, run_dir: Path, steps: int, warmup: int) -> float:
    """ONN as a run trains: the ImageClassifier under a Lightning Trainer with ONN's callbacks."""
    from onn.modalities import classification, get
    from onn.training.callbacks import ResourceMonitor, StepClock
    from onn.training.trainer import build_trainer

    module = classification.build(get("image"), config, plan, inputs)
    stamps = _Stamps(warmup, steps)
    callbacks = [StepClock(), ResourceMonitor(config.trainer.log_every_n_steps)]
    # no checkpoint callback: the Trainer writes no checkpoint (onn/training/trainer.py)
    run_trainer = dataclasses.replace(
        config.trainer, max_steps=warmup + steps, max_epochs=-1, limit_val_batches=0, num_sanity_val_steps=0
    )
    cfg = dataclasses.replace(config, trainer=run_trainer)
    trainer = build_trainer(
        cfg,
        plan,
        run_dir / "bench",
        [*callbacks, stamps.callback],
        loggers=False,
        steps_per_epoch=len(dm.train_dataloader()),
    )
    trainer.fit(module, train_dataloaders=dm.train_dataloader())
    # stamps: the start of each step, then the end of training (after the last step)
    return samples_per_s(stamps.stamps, stamps.rows, warmup, steps)


def _bare_lightning(config: ONNConfig, plan, inputs, dm, run_dir: Path, steps: int, warmup: int) -> float:
    """Lightning's own floor: the plain loop's step as a bare LightningModule's training_step (automatic
    optimisation; the same model, optimiser, schedule, clipping and precision) under a Trainer with nothing of
    ONN's and no logger, checkpoint, progress bar or summary."""
    import lightning as L

    from onn.modalities.classification import mixup_alpha
    from onn.training.optim import make_optimizer, make_schedule

    device, model, augment = dm.device, _plain_model(config, inputs, dm.device).train(), _augment(config, inputs)
    channels_last, loss_of, alpha = config.model.channels_last, _loss_function(config), mixup_alpha(config.task)

    class Bare(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx: int) -> torch.Tensor:
            images, labels = batch
            with torch.autocast(device.type, enabled=False):  # augmented in float32, as both other sides do
                x = augment(images, train=True)
            x = x.to(self.dtype)  # the weights': bf16 under bf16-true, as ONN's classifier prepares its input
            x = x.contiguous(memory_format=torch.channels_last) if channels_last else x
            x, mixed, weight = _mixup(x, labels, alpha)
            return _blended(loss_of, self.model(x).float(), labels, mixed, weight)

        def configure_optimizers(self):
            optimizer = make_optimizer(self.model.parameters(), config.optim)
            schedule = make_schedule(optimizer, config.optim, warmup + steps, config.task.monitor)
            # as the plain loop: a per-step schedule steps, a per-epoch one never does within the timed steps
            return {"optimizer": optimizer, "lr_scheduler": schedule} if schedule["interval"] == "step" else optimizer

    stamps = _Stamps(warmup, steps)
    trainer = L.Trainer(
        default_root_dir=str(run_dir / "bench"),
        max_steps=warmup + steps,
        accelerator=device.type,
        devices=[device.index or 0] if device.type == "cuda" else 1,
        precision=trainer_precision(config, plan),
        gradient_clip_val=config.optim.clip_grad_norm or None,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[stamps.callback],
    )
    trainer.fit(Bare(), train_dataloaders=dm.train_dataloader())
    return samples_per_s(stamps.stamps, stamps.rows, warmup, steps)


def plain_precision(precision: str) -> tuple[torch.dtype | None, torch.dtype | None]:
    """(the weights' dtype, the autocast dtype) of Lightning's `precision` (or its alias: 16, bf16, 32, 64), as its
    plugin runs a step: -true converts the module and autocasts nothing, -mixed autocasts over the built weights."""
    kind, _, mode = str(precision).partition("-")
    dtype = {"bf16": torch.bfloat16, "16": torch.float16, "64": torch.float64}.get(kind)
    if mode == "true" or kind == "64":
        return dtype, None
    return None, dtype


def trainer_precision(config: ONNConfig, plan) -> str:
    """What ONN's Trainer runs with: trainer.precision, or where it is auto the plan's."""
    precision = config.trainer.precision
    return plan.precision if precision in (None, "auto") else str(precision)


def median_ratio(tops: list[float], bottoms: list[float]) -> float:
    """The median of the rounds' top / bottom (a rate each, paired by round: a noisy neighbour slows a round's sides
    alike). Of an even number of rounds, the mean of the middle two: the upper one alone made two rounds' ratio
    their larger."""
    return statistics.median(t / b for t, b in zip(tops, bottoms))


def _median_ratio(plain: list[float], other: list[float]) -> float:
    """The median round's plain / other - 1 (samples/s each)."""
    return round(median_ratio(plain, other) - 1, 4)


def _pipeline_only(loader, steps: int, warmup: int, augment, device: torch.device) -> float:
    """Batches ready for the model (decoded, augmented, normalised, on the device), no model."""
    stamps: list[float] = []
    rows: list[int] = []
    for images, _ in epochs(loader, warmup + steps + 1):
        stamp(stamps, device, warmup, steps)
        if len(stamps) > warmup + steps:
            break
        rows.append(len(images))
        images = images.to(device, non_blocking=True)
        if augment is not None:
            augment(images, train=True)
    return samples_per_s(stamps, rows, warmup, steps)


class _EncodedImages(torch.utils.data.Dataset):
    """The standard pipeline's Dataset: one encoded image per item, decoded and transformed on access. It decodes
    as training's resident split was decoded (onn/modalities/image/formats/decode.py: EXIF orientation applied, the
    same grey and colour conversions), so both pipelines feed the model the same pictures: a phone's portrait photo
    opened with PIL alone came out sideways."""

    def __init__(self, items: list[tuple[bytes, int]], transform):
        self.items, self.transform = items, transform

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        from PIL import Image

        from onn.modalities.image.formats.decode import decode

        data, label = self.items[i]
        return self.transform(Image.fromarray(decode(data, self.transform.channels))), label


class _Transform:
    """Per sample, as the resident side does per batch: sized as the decoder sizes images, data.augment's
    steps (onn/modalities/image/augment.py), normalised."""

    def __init__(self, shape: list[int], data: ImageData, mean, std):
        from torchvision import transforms as T

        self.channels = shape[0]
        size = tuple(shape[1:])
        steps = []
        if data.image_size and data.resize == "center_crop":  # as the decoder sizes images
            steps += [T.Resize(min(size)), T.CenterCrop(size)]
        elif data.image_size:
            steps.append(T.Resize(size))
        augment = data.augment
        if augment is not None and augment.crop_padding:
            mode = augment.padding_mode.replace("zeros", "constant")
            steps.append(T.RandomCrop(size, padding=augment.crop_padding, padding_mode=mode))
        if augment is not None and augment.hflip:
            steps.append(T.RandomHorizontalFlip(augment.hflip))
        jitter = augment.color_jitter if augment is not None else None  # hue is not supported (it must stay 0)
        if jitter is not None and (jitter.brightness or jitter.contrast or jitter.saturation):
            steps.append(
                T.ColorJitter(brightness=jitter.brightness, contrast=jitter.contrast, saturation=jitter.saturation)
            )
        steps += [T.ToTensor(), T.Normalize(mean, std)]
        erasing = augment.random_erasing if augment is not None else None
        if erasing is not None and erasing.p:  # blocks that are there and off add no step, as BatchAugment's
            steps.append(
                T.RandomErasing(
                    p=erasing.p, scale=tuple(erasing.scale), ratio=tuple(erasing.ratio), value=erasing.value
                )
            )
        self.compose = T.Compose(steps)

    def __call__(self, image):
        return self.compose(image)


class StandardPipeline:
    """torchvision's usual recipe: encoded images -> Dataset (decode, transforms per sample) -> DataLoader."""

    def __init__(self, config: ONNConfig, dm, inputs: dict[str, Any]):
        self.config, self.dm = config, dm
        self.workers = config.task.standard_workers
        channels = inputs["input_shape"][0]
        self.transform = _Transform(inputs["input_shape"], config.data, inputs["mean"], inputs["std"])
        self.items = _encoded_train_images(str(config.data.source), dm, channels)
        log.info(
            "standard pipeline: %d encoded training images, %d DataLoader workers",
            len(self.items),
            self.workers,
        )

    def loader(self):
        """Full batches only, as the resident side draws them, unless the split holds less than a batch."""
        return torch.utils.data.DataLoader(
            _EncodedImages(self.items, self.transform),
            batch_size=self.dm.batch_size,
            shuffle=True,
            drop_last=len(self.items) >= self.dm.batch_size,
            num_workers=self.workers,
            persistent_workers=False,
            pin_memory=self.dm.device.type == "cuda",
        )


def _encoded_train_images(source: str, dm, channels: int) -> list[tuple[bytes, int]]:
    """The datamodule's training split (the held-out validation and test images left out, so both pipelines
    draw from one set) as its files' bytes (image folders and archives), or PNG-encoded from the decoded arrays
    for formats that store raw pixels (IDX, CIFAR binary, .mat)."""
    from onn.data.files import archive_kind, iter_members, walk_files

    path = Path(source).expanduser()
    split = dm.splits["train"]
    labels = dict(zip(split.names, split.labels.cpu().tolist()))
    items: list[tuple[bytes, int]] = []
    if path.is_dir():
        items = [(file.read_bytes(), labels[name]) for name, file in walk_files(path) if name in labels]
    elif path.is_file() and archive_kind(path) is not None:
        for member in iter_members(path):
            if member.name in labels:
                with member.open() as f:
                    items.append((f.read(), labels[member.name]))
    if items:
        return items
    from PIL import Image

    for image, label in zip(split.inputs.cpu(), split.labels.cpu().tolist()):
        buffer = io.BytesIO()
        array = image.permute(1, 2, 0).numpy()
        Image.fromarray(array[..., 0] if channels == 1 else array).save(buffer, format="PNG")
        items.append((buffer.getvalue(), label))
    return items
