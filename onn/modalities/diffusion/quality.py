"""task=eval of a denoiser: sample quality judged by an ONN image classifier trained on the same data.

No feature network is downloaded (ONN has no network at run time), so there is no FID: the judge is a
classifier ONN trained itself (e.g. `model=v28_cnn` on the same images), named by task.classifier. It
labels task.samples images drawn from task.seed, and the figures are:

  confident_share   the share of samples whose top class probability reaches task.confidence
  classes_present   how many classes the confident samples fall in (and which are missing)
  inception_score   exp(E_x KL(p(y|x) || p(y))) over the samples (Salimans et al. 2016, with ONN's classifier
                    in Inception's place): 1 when every sample looks alike or like nothing, up to the number
                    of classes when each is confidently one class and the classes are used evenly

The same figures for as many held-out real images (the ceiling the classifier allows; all of them where fewer are
held out, their number in real/count), drawn at random with task.seed, are reported beside them, and val/loss:
the held-out noise-prediction loss of the weights the samples come from (the moving average where
model.ema_decay > 0), named in `weights`. Held out means never trained on:
given the very data.source the checkpoint trained on, the figures are on the run's own held-out split of it, not
on the whole source.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path
from typing import Any

import torch

from onn.config import ONNConfig, typed
from onn.config.data import ImageData
from onn.config.model import NetworkConfig
from onn.config.task import TrainTask
from onn.data.resident import StreamedItems, drawn_by_name
from onn.errors import UserError
from onn.hardware.cluster import is_rank_zero
from onn.modalities.base import Job
from onn.modalities.diffusion.module import DiffusionModule
from onn.modalities.diffusion.sample import write_sample_grid
from onn.modalities.diffusion.tasks import build, datamodule, draw_samples, load_trained
from onn.training.checkpoints import check_finite, resolve, saved_config
from onn.training.trainer import build_trainer

log = logging.getLogger("onn")
CKPT_KEY = re.compile(r"(?<![\w./\\-])ckpt=")  # the key `ckpt=`, not a path's "best.ckpt=" or "runs/ckpt="


def load_classifier(config: ONNConfig, plan, path: str):
    """The ONN image classifier at `path` (task.classifier: a run dir, checkpoints dir or .ckpt), rebuilt from its
    own config. Every refusal names task.classifier: the checkpoint loaders' own say `ckpt`, the denoiser's key."""
    from onn.modalities import get
    from onn.modalities.classification import load_trained as load_classifier_ckpt

    try:
        ckpt = resolve(path, config.paths.outputs)
        saved = saved_config(ckpt)
        if saved.get("modality") != "image":  # ({} for another tool's checkpoint)
            raise UserError(
                f"task.classifier={path} is not an ONN image classifier's checkpoint (train one with data=...)."
            )
        run = dataclasses.replace(
            config,
            model=typed(NetworkConfig, saved["model"], f"task.classifier {ckpt}: model"),
            data=typed(ImageData, saved["data"], f"task.classifier {ckpt}: data"),
        )
        plan = dataclasses.replace(plan, strategy="full")
        classifier = load_classifier_ckpt(get("image"), run, plan, ckpt, checked=False)
        check_finite(classifier, f"task.classifier={path}", "eval")
    except UserError as e:
        raise UserError(as_classifier_key(str(e), path)) from None
    return classifier


def as_classifier_key(said: str, path: str) -> str:
    """A checkpoint loader's refusal of the judge, in the key the user set: its `ckpt=...` (the path, or the advice
    ckpt=PATH) becomes `task.classifier=...`, and one that names no key starts with task.classifier=PATH."""
    said = CKPT_KEY.sub("task.classifier=", said)
    if said.startswith("task.classifier"):
        return said
    return f"task.classifier={path}: " + re.sub(r"^ckpt ", "checkpoint ", said)


@torch.no_grad()
def judged(classifier, images: torch.Tensor, confidence: float, device: torch.device) -> dict[str, Any]:
    """The classifier's figures for uint8 images [N, C, H, W] (see the module's docstring)."""
    classifier = classifier.to(device).eval()
    probs = torch.cat(
        [
            torch.softmax(classifier(classifier.prepare(x.to(device), train=False)).float(), dim=1).cpu()
            for x in images.split(256)
        ]
    )
    classes = list(classifier.classes)
    top, label = probs.max(dim=1)
    sure = top >= confidence
    counts = torch.bincount(label[sure], minlength=len(classes))
    marginal = probs.mean(0, keepdim=True)
    kl = (probs * (probs.clamp_min(1e-12).log() - marginal.clamp_min(1e-12).log())).sum(1)
    return {
        "confident_share": round(float(sure.float().mean()), 4),
        "classes_present": int((counts > 0).sum()),
        "classes_missing": [c for c, n in zip(classes, counts.tolist()) if n == 0],
        "class_counts": dict(zip(classes, counts.tolist())),
        "inception_score": round(float(kl.mean().exp()), 3),
        "labels": [classes[int(i)] for i in label],
        "top": top,
    }


def held_out(config: ONNConfig, saved: dict[str, Any]) -> ONNConfig:
    """The config whose validation images the checkpoint (run config `saved`) never trained on: its run's seed,
    and, where task=eval would score the whole of the very source the run trained on, the run's own held-out
    split of it (its data.val_source, or data.val_split of its training images with that seed)."""
    config = dataclasses.replace(config, seed=int(saved["inputs"]["seed"]))
    data: ImageData = config.data
    trained = saved["data"]
    if data.val_source is None or not same_source(data.val_source, trained["source"]):
        drawn_by_name(saved["inputs"], config.ckpt, draws=data.val_source is None)
        return config
    own = trained.get("val_source")
    log.info(
        "%s is what the checkpoint trained on: the held-out figures are on its own held-out images (%s)",
        data.val_source,
        f"data.val_source {own}" if own else f"data.val_split {trained['val_split']} of them, seed {config.seed}",
    )
    data = dataclasses.replace(data, source=trained["source"], val_source=own, val_split=trained["val_split"])
    drawn_by_name(saved["inputs"], config.ckpt, draws=not own)
    return dataclasses.replace(config, data=data)


def same_source(a: str, b: str | None) -> bool:
    """Whether two data sources name the same files (the same path, however written)."""
    if b is None:
        return False
    if str(a) == str(b):
        return True
    try:
        return Path(str(a)).expanduser().resolve() == Path(str(b)).expanduser().resolve()
    except (OSError, RuntimeError):
        return False


def real_images(dm, count: int, seed: int) -> torch.Tensor:
    """`count` held-out real images drawn at random with `seed` (every one when it holds fewer): the first ones
    may all be one class, since many sources list their images class by class. Streamed data (too big to hold, or
    data.resident=false) has no resident split: its picks are decoded one by one."""
    generator = torch.Generator().manual_seed(int(seed))
    if dm.streamed:
        held = StreamedItems(*dm.streamed["val"])
        pick = torch.randperm(len(held), generator=generator)[:count]
        return torch.stack([held[int(i)][0] for i in pick])
    images = dm.splits["val"].inputs
    pick = torch.randperm(len(images), generator=generator)[:count]
    return images[pick.to(images.device)].cpu()  # the picks only leave the device, not the whole split


def judged_weights(module: DiffusionModule) -> str:
    """The weights one eval report describes: those samples are drawn from, whose held-out loss val/loss is."""
    if module.ema is None:
        return "trained weights (model.ema_decay=0)"
    return f"moving average of the weights (model.ema_decay={module.ema_decay})"


def evaluate(job: Job) -> dict[str, Any]:
    config = job.config
    task: TrainTask = config.task
    if not task.classifier:
        raise UserError(
            "task=eval on diffusion data needs task.classifier=RUN_DIR: an ONN image classifier trained on the same "
            "data (e.g. python run.py model=v28_cnn data=mnist ...), which labels the samples."
        )
    classifier = load_classifier(config, job.plan, task.classifier)  # a wrong path: refused before the data loads
    if job.ckpt is None:
        log.warning("task=eval without ckpt: judging a random-weights denoiser (the baseline a trained one must beat)")
    if job.ckpt is not None:
        module = load_trained(config, job.ckpt)
        trained = saved_config(job.ckpt, "diffusion")
        config = held_out(config, trained)
        dm = datamodule(config, job.device, trained)
    else:
        dm = datamodule(config, job.device)
        module = build(config, {"input_shape": list(dm.input_shape), "classes": dm.classes, "seed": config.seed})
    expected = list(classifier.onn_config["inputs"]["input_shape"])
    shape = list(module.onn_config["inputs"]["input_shape"])
    if expected != shape:
        raise UserError(
            f"task.classifier={task.classifier} takes images of {expected} (C, H, W) but the denoiser draws {shape}; "
            "train the classifier on the same data.image_size and data.channels."
        )
    trainer = build_trainer(config, job.plan, job.run_dir, [], loggers=False, steps_per_epoch=1)
    trainer.validate(module, datamodule=dm, verbose=False)
    device = torch.device(job.device)
    images = draw_samples(config, module, device)
    figures = judged(classifier, images, float(task.confidence), device)
    reals = real_images(dm, len(images), task.seed)  # fewer where fewer are held out: said as real/count
    real = judged(classifier, reals, float(task.confidence), device)
    picture = job.run_dir / "samples.png"
    captions = [f"{c}: {float(p):.2f}" for c, p in zip(figures["labels"], figures["top"])]
    if is_rank_zero():  # every process of a multi-process run judges the same samples; one draws the picture
        write_sample_grid(images, picture, captions)
    metrics: dict[str, Any] = {
        "checkpoint": str(job.ckpt) if job.ckpt else None,
        "classifier": task.classifier,
        "weights": judged_weights(module),  # what val/loss and the samples both measure
        **{f"val/{k.split('/')[-1]}": round(v, 5) for k, v in module.last_metrics.items()},
        "samples/count": len(images),
        "samples/sampler": f"{task.sampler} ({task.sample_steps} steps)" if task.sampler == "ddim" else task.sampler,
        "samples/seed": task.seed,
        "samples/confidence": task.confidence,
        **{f"samples/{k}": v for k, v in figures.items() if k not in ("labels", "top")},
        "real/count": len(reals),
        **{f"real/{k}": v for k, v in real.items() if k not in ("labels", "top", "class_counts")},
        "samples/picture": str(picture),
    }
    print(
        f"samples: {figures['confident_share']:.1%} confident (>= {task.confidence}), "
        f"{figures['classes_present']}/{len(classifier.classes)} classes, inception score "
        f"{figures['inception_score']:.2f}; {len(reals)} held-out real images: {real['confident_share']:.1%}, "
        f"{real['inception_score']:.2f}"
    )
    return metrics
