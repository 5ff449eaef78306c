"""Plan -> objects -> Trainer for image classification: the train, eval and infer tasks on image data.

Training runs in epochs over the device-resident dataset, validates every epoch (or every
trainer.val_check_interval steps), keeps the best checkpoint by validation accuracy beside the last,
and ends by testing the best checkpoint on the test split when the data has one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from onn.errors import UserError
from onn.training.fit import _device

log = logging.getLogger("onn")


def is_image_run(config: dict[str, Any]) -> bool:
    return (config.get("data") or {}).get("modality") == "image"


def datamodule(config: dict[str, Any], plan: dict[str, Any]):
    from onn.data.images import ImageDataModule

    dm = ImageDataModule(
        config["data"], config["paths"]["cache"], _device(plan), seed=int(config.get("seed", 0))
    )
    dm.setup()
    return dm


def input_stats(config: dict[str, Any], dm) -> tuple[list[float], list[float]]:
    """data.mean / data.std, or measured on the training images when `auto` (0.5 for streamed data)."""
    mean, std = config["data"].get("mean", "auto"), config["data"].get("std", "auto")
    if mean not in (None, "auto") and std not in (None, "auto"):
        return [float(m) for m in mean], [float(s) for s in std]
    if dm.streamed:
        channels = dm.image_shape[0]
        return [0.5] * channels, [0.5] * channels
    images = dm.splits["train"].images
    picks = torch.randperm(len(images), generator=torch.Generator().manual_seed(0))[:10_000].to(images.device)
    total = torch.zeros(images.shape[1], dtype=torch.float64, device=images.device)
    squares, count = torch.zeros_like(total), 0
    for chunk in picks.split(500):  # float64 sums over chunks: no float copy of the whole sample
        x = images[chunk].to(torch.float64).transpose(0, 1).flatten(1) / 255
        total += x.sum(1)
        squares += (x * x).sum(1)
        count += x.shape[1]
    mean = total / count
    std = (squares / count - mean * mean).clamp_min(1e-6).sqrt()
    return [round(float(v), 4) for v in mean], [round(float(v), 4) for v in std]


def build(config: dict[str, Any], plan: dict[str, Any], inputs: dict[str, Any]):
    """The ImageClassifier for `inputs` (classes, image_shape, mean, std): from data, or from a checkpoint."""
    from onn.data.augment import BatchAugment
    from onn.models.vision import build_classifier, feature_extractor
    from onn.training.classifier import ImageClassifier, LinearProbe

    torch.manual_seed(int(config.get("seed", 0)))
    model_cfg, strategy = config["model"], plan["strategy"]
    channels, height, width = inputs["image_shape"]
    model = build_classifier(model_cfg, channels, len(inputs["classes"]), [height, width])
    if strategy == "linear_probe":  # the plan admits full and linear_probe only
        backbone, features = feature_extractor(model)
        model = LinearProbe(backbone, features, len(inputs["classes"]))
    augment = BatchAugment(config["data"].get("augment"), inputs["mean"], inputs["std"])
    onn_config = {"model": model_cfg, "strategy": {**config["strategy"], "name": strategy}, "data": config["data"],
                  "inputs": inputs}  # fmt: skip
    task = config["task"]
    module = ImageClassifier(model, inputs["classes"], config["optim"], onn_config, augment=augment,
                             label_smoothing=float(task.get("label_smoothing", 0.0) or 0.0),
                             channels_last=bool(model_cfg.get("channels_last", False)),
                             inputs="features" if strategy == "linear_probe" else "images")  # fmt: skip
    if model_cfg.get("compile"):
        module.model = torch.compile(module.model)  # the Lightning module keeps the same parameters
    return module


def _inputs(config: dict[str, Any], dm) -> dict[str, Any]:
    mean, std = input_stats(config, dm)
    # the seed picks the validation split held out of train: eval and infer of a checkpoint reuse it
    return {"classes": dm.classes, "image_shape": list(dm.image_shape), "mean": mean, "std": std,
            "seed": int(config.get("seed", 0))}  # fmt: skip


def features(module, dm, config: dict[str, Any]):
    """A datamodule of backbone features for every split, computed once and cached (safetensors)."""
    from safetensors.torch import load_file, save_file

    from onn.data.images import ImageDataModule, ResidentBatches, Split, decode_settings

    if dm.streamed:
        raise UserError("strategy=linear_probe needs the dataset resident in memory; set data.resident=true.")
    probe = module.model
    state = probe.backbone.state_dict()
    weights = hashlib.sha256()
    for k in sorted(state):
        weights.update(k.encode())
        weights.update(state[k].detach().float().cpu().numpy().tobytes())
    key = json.dumps({"weights": weights.hexdigest(), "inputs": module.onn_config["inputs"],
                      "data": {k: hashlib.sha256("\n".join(v.names).encode()).hexdigest() for k, v in dm.splits.items()},
                      "decode": decode_settings(config["data"]), "source": str(config["data"].get("source"))},
                     sort_keys=True)  # fmt: skip
    cache = (
        Path(config["paths"]["cache"])
        / "features"
        / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.safetensors"
    )
    if cache.is_file():
        saved = load_file(str(cache), device=str(dm.device))
        log.info("linear probe: features from the cache %s", cache)
    else:
        saved = {}
        backbone = probe.backbone.to(dm.device).eval()
        with torch.no_grad():
            for name, split in dm.splits.items():
                chunks = []
                for images, _ in ResidentBatches(split, dm.eval_batch_size, shuffle=False):
                    x = module.augment(images, train=False)
                    chunks.append(backbone(x).float().flatten(1))
                saved[name] = torch.cat(chunks)
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".tmp{os.getpid()}")
        save_file({k: v.cpu().contiguous() for k, v in saved.items()}, str(tmp))
        tmp.replace(cache)
        log.info("linear probe: %d-wide features of %d images cached to %s", next(iter(saved.values())).shape[1],
                 sum(len(v) for v in saved.values()), cache)  # fmt: skip
    out = ImageDataModule(config["data"], config["paths"]["cache"], dm.device, seed=dm.seed)
    out.classes, out.skipped = dm.classes, dm.skipped
    out.splits = {k: Split(saved[k], v.labels, v.names) for k, v in dm.splits.items()}
    return out


def _mode(monitor: str) -> str:
    return "min" if monitor.endswith("loss") else "max"


def _callbacks(config: dict[str, Any], run_dir: Path) -> list:
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    from onn.training.callbacks import ResourceMonitor, StepClock

    task = config["task"]
    monitor = task.get("monitor", "val/acc")
    # the best by `monitor` (the first ModelCheckpoint: trainer.checkpoint_callback), and the latest every epoch
    best = ModelCheckpoint(dirpath=str(run_dir / "checkpoints"), filename="best", monitor=monitor,
                           mode=_mode(monitor), save_top_k=1,
                           auto_insert_metric_name=False, enable_version_counter=False)  # fmt: skip
    last = ModelCheckpoint(dirpath=str(run_dir / "checkpoints"), save_top_k=0, save_last=True)
    callbacks = [
        best,
        last,
        StepClock(),
        ResourceMonitor(int(config["trainer"].get("log_every_n_steps", 10))),
    ]
    stop = task.get("early_stopping")
    if stop:
        callbacks.append(EarlyStopping(monitor=monitor, mode=_mode(monitor),
                                       patience=int(stop.get("patience", 5)), min_delta=float(stop.get("min_delta", 0.0))))  # fmt: skip
    return callbacks


def _trainer(config: dict[str, Any], plan: dict[str, Any], run_dir: Path, callbacks: list, train_batches: int,
             with_loggers: bool = True):  # fmt: skip
    import lightning as L
    from hydra.utils import instantiate

    from onn.training.checkpoint_io import SafetensorsCheckpointIO

    kwargs = dict(config["trainer"])
    kwargs["precision"] = (
        plan["precision"] if kwargs.get("precision") in (None, "auto") else kwargs["precision"]
    )
    if isinstance(kwargs.get("val_check_interval"), int):  # a step count cannot exceed one epoch's batches
        kwargs["val_check_interval"] = min(kwargs["val_check_interval"], max(train_batches, 1))
    elif kwargs.get("check_val_every_n_epoch") is None:  # a fraction of an epoch: validate every epoch
        kwargs["check_val_every_n_epoch"] = 1
    if kwargs.get("accelerator") in (None, "auto"):
        kwargs["accelerator"], kwargs["devices"] = _device(plan), 1
    loggers = [instantiate(c, save_dir=str(run_dir)) for c in (config.get("tracking") or {}).get("loggers", [])] if with_loggers else []  # fmt: skip
    if loggers:
        from lightning.pytorch.callbacks import LearningRateMonitor

        callbacks = [*callbacks, LearningRateMonitor("step")]
    kwargs.setdefault("enable_checkpointing", True)
    return L.Trainer(default_root_dir=str(run_dir), logger=loggers or False, callbacks=callbacks,
                     plugins=[SafetensorsCheckpointIO()], **kwargs)  # fmt: skip


def train(config: dict[str, Any], plan: dict[str, Any], run_dir: Path, ckpt: Path | None) -> dict[str, Any]:
    from onn.hardware.memory import PeakMemory
    from onn.training.callbacks import StepClock
    from onn.training.classifier import save_confusion

    saved = _saved_inputs(ckpt) if ckpt is not None else None
    if saved:  # a resumed run keeps the validation split it started with
        config = {**config, "seed": saved.get("seed", config.get("seed", 0))}
    dm = datamodule(config, plan)
    inputs = saved or _inputs(config, dm)
    module = build(config, plan, inputs)
    if module.inputs == "features":
        dm = features(module, dm, config)
    callbacks = _callbacks(config, run_dir)
    clock = next(c for c in callbacks if isinstance(c, StepClock))
    trainer = _trainer(config, plan, run_dir, callbacks, len(dm.train_dataloader()))
    with PeakMemory(_device(plan)) as peak:
        trainer.fit(module, datamodule=dm, ckpt_path=str(ckpt) if ckpt else None)
        trainer.save_checkpoint(str(run_dir / "checkpoints" / "last.ckpt"))  # the final state, also mid-epoch
    best, best_score = _best(
        trainer.checkpoint_callback, ckpt, run_dir, config["task"].get("monitor", "val/acc")
    )
    metrics: dict[str, Any] = {
        "epochs": trainer.current_epoch,
        "steps": trainer.global_step,
        "train/loss_initial": float(module.train_losses[0]) if module.train_losses else None,
        "train/loss_final": float(torch.stack(module.train_losses[-20:]).mean())
        if module.train_losses
        else None,
        "val/history": module.history,
        "val/acc_best": round(best_score, 5) if best_score is not None else None,
        "val/acc_final": module.history[-1]["val/acc"] if module.history else None,
        "samples_per_s": clock.samples_per_s(dm.batch_size, skip=min(2, len(clock.step_s) - 1)),
        "peak_memory_mb": round(peak.peak_mb, 1),
        "params_total": sum(p.numel() for p in module.model.parameters()),
        "params_trainable": sum(p.numel() for p in module.model.parameters() if p.requires_grad),
        "checkpoint": str(run_dir / "checkpoints" / "last.ckpt"),
        "checkpoint_best": best or None,
        "resumed_from": str(ckpt) if ckpt else None,
        "images_skipped": len(dm.skipped),
        "resident": not dm.streamed,
    }
    stage = "test" if dm.has_test() else "val"
    if stage == "test":
        trainer.test(module, datamodule=dm, ckpt_path=best or None, verbose=False)
    else:
        trainer.validate(module, datamodule=dm, ckpt_path=best or None, verbose=False)
    metrics.update(
        {k: round(float(v), 5) for k, v in trainer.callback_metrics.items() if k.startswith(f"{stage}/")}
    )
    picture = run_dir / f"confusion_{stage}.png"
    save_confusion(module.confusion[stage], module.classes, picture)
    metrics["confusion_matrix"] = str(picture)
    log.info("%s accuracy %.4f (best checkpoint %s)", stage, metrics.get(f"{stage}/acc", float("nan")), best)
    if (config.get("export") or {}).get("name") not in (None, "none"):
        metrics.update(_export(config, module, run_dir))
    return metrics


def _best(callback, ckpt: Path | None, run_dir: Path, monitor: str) -> tuple[str | None, float | None]:
    """The whole run's best checkpoint and score. Lightning forgets the best score when a resumed run
    writes to a new folder, so an earlier run's best.ckpt that beats this run's is copied in here."""
    import shutil

    from onn.training.checkpoint_io import read_meta

    here = run_dir / "checkpoints"
    path = callback.best_model_path or None
    score = None
    if path and Path(path).parent == here and callback.best_model_score is not None:
        score = float(callback.best_model_score)
    if ckpt is not None:
        earlier = [h[monitor] for h in read_meta(ckpt).get("onn", {}).get("history") or [] if monitor in h]
        old = Path(ckpt).parent / "best.ckpt"
        better = min if _mode(monitor) == "min" else max
        if earlier and old.is_dir() and (score is None or better(better(earlier), score) != score):
            target = here / "best.ckpt"
            if target.exists():
                shutil.rmtree(target)
            shutil.copytree(old, target)
            path, score = str(target), float(better(earlier))
    return path, score


def _saved_inputs(ckpt: Path) -> dict[str, Any]:
    from onn.training.checkpoint_io import read_meta

    inputs = read_meta(ckpt).get("onn", {}).get("config", {}).get("inputs")
    if not inputs:
        raise UserError(
            f"ckpt {ckpt} was not written by an image-classifier run; it cannot be used with image data."
        )
    return inputs


def load_trained(config: dict[str, Any], plan: dict[str, Any], ckpt: Path | None, dm=None):
    """The classifier with the checkpoint's weights (or as model.source gives it, without one)."""
    from onn.training.checkpoint_io import load

    if ckpt is None:
        if dm is None:
            raise UserError(
                "task=infer on images needs ckpt=RUN_DIR (a trained classifier) to know its classes."
            )
        log.warning("no ckpt: using the model as model.source gives it (untrained unless it has weights)")
        return build(config, plan, _inputs(config, dm))
    module = build(config, plan, _saved_inputs(ckpt))
    state = load(ckpt)["state_dict"]
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [k for k in missing if ".backbone." not in k]
    if unexpected or missing:
        raise UserError(
            f"ckpt {ckpt} does not match the model it names: missing {missing[:3]}, unexpected {unexpected[:3]}."
        )
    return module


def export(config: dict[str, Any], plan: dict[str, Any], run_dir: Path, ckpt: Path | None) -> dict[str, Any]:
    """task=export for an image classifier: the trained network from `ckpt` (the whole network for a
    linear probe), or without one the network as model.source gives it, sized by the data config."""

    if ckpt is not None:
        module = load_trained(config, plan, ckpt)
    else:
        data = config["data"]
        size, channels, classes = data.get("image_size"), data.get("channels"), data.get("num_classes")
        if not (size and isinstance(channels, int) and isinstance(classes, int)):
            raise UserError(
                "task=export of an image model without ckpt needs data.image_size, data.channels and data.num_classes."
            )
        size = [size, size] if isinstance(size, int) else list(size)
        inputs = {"classes": [str(i) for i in range(classes)], "image_shape": [channels, *size],
                  "mean": [0.5] * channels, "std": [0.5] * channels}  # fmt: skip
        module = build(config, plan, inputs)
    return _export(config, module, run_dir)


def _export(config: dict[str, Any], module, run_dir: Path) -> dict[str, Any]:
    """safetensors: the network's state dict plus what rebuilds it (config.json; model.weights loads it);
    onnx / omny: the network as a graph with a [batch, C, H, W] input."""
    from onn.training.fit import export_trained

    settings = config["export"]
    network = module.model.eval()
    if settings["name"] == "safetensors":
        from safetensors.torch import save_model

        folder = Path(settings.get("output") or run_dir / "export" / "safetensors")
        folder.mkdir(parents=True, exist_ok=True)
        save_model(network, str(folder / "model.safetensors"), metadata={"format": "pt"})
        (folder / "config.json").write_text(
            json.dumps({"model": config["model"], "inputs": module.onn_config["inputs"]}, indent=2)
        )
        log.info("export: %s", folder)
        return {"export/format": "safetensors", "export/path": str(folder)}
    size = module.onn_config["inputs"]["image_shape"][1]
    config = {
        **config,
        "export": {**settings, "sample": {**(settings.get("sample") or {}), "image_size": size}},
    }
    return export_trained(config, network, None, run_dir)


def evaluate(
    config: dict[str, Any], plan: dict[str, Any], run_dir: Path, ckpt: Path | None
) -> dict[str, Any]:
    dm = datamodule(config, plan)
    module = load_trained(config, plan, ckpt, dm)
    if module.inputs == "features":
        dm = features(module, dm, config)
    trainer = _trainer(config, plan, run_dir, [], 1, with_loggers=False)
    metrics: dict[str, Any] = {"checkpoint": str(ckpt) if ckpt else None}
    trainer.validate(module, datamodule=dm, verbose=False)
    metrics.update(
        {k: round(float(v), 5) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
    )
    if dm.has_test():
        trainer.test(module, datamodule=dm, verbose=False)
        metrics.update(
            {k: round(float(v), 5) for k, v in trainer.callback_metrics.items() if k.startswith("test/")}
        )
    print("  ".join(f"{k} {v:.4f}" for k, v in metrics.items() if isinstance(v, float)))
    return metrics


def infer(config: dict[str, Any], plan: dict[str, Any], run_dir: Path, ckpt: Path | None) -> dict[str, Any]:
    """Predict the classes of an image, a folder or an archive: predictions.jsonl and a PNG grid."""
    from onn.data.image_formats import read_splits
    from onn.infer.generate import write_jsonl
    from onn.infer.images import write_grid

    task = config["task"]
    source = task.get("input")
    if not source:
        raise UserError(
            "task=infer on images needs task.input=PATH (an image, a folder or an archive of images)."
        )
    if ckpt is None:
        raise UserError("task=infer on images needs ckpt=RUN_DIR (a trained classifier) to know its classes.")
    module = load_trained(config, plan, ckpt)
    inputs = module.onn_config["inputs"]
    channels, height, width = inputs["image_shape"]
    if not Path(str(source)).expanduser().exists():
        raise UserError(f"task.input={source} does not exist.")
    sets = read_splits(Path(str(source)).expanduser(), "auto", channels=channels, image_size=[height, width],
                       resize=config["data"].get("resize") if config["data"].get("resize") not in (None, "error") else "resize",
                       max_bad_fraction=float(config["data"].get("max_bad_fraction", 0.01)), allow_unlabelled=True,
                       key="task.input")  # fmt: skip
    device = torch.device(_device(plan))
    model = module.to(device).eval()
    rows, shown, predicted_names, true_names, correct, known = [], [], [], [], 0, 0
    classes = inputs["classes"]
    batch = int(config["data"].get("eval_batch_size") or 256)
    for split, images in sets.items():
        found = list(images.classes)
        for start in range(0, len(images.labels), batch):
            x = images.images[start : start + batch].to(device)
            with torch.no_grad():
                x = module.augment(x, train=False)
                if module.channels_last:
                    x = x.contiguous(memory_format=torch.channels_last)
                probs = torch.softmax(model.model(x).float(), dim=1).cpu()
            top = probs.topk(min(5, len(classes)), dim=1)
            for i in range(x.shape[0]):
                j = start + i
                label = int(images.labels[j])
                true = found[label] if 0 <= label < len(found) else None
                guess = classes[int(top.indices[i, 0])]
                row = {"name": images.names[j], "predicted": guess, "probability": round(float(top.values[i, 0]), 5),
                       "top5": [[classes[int(c)], round(float(p), 5)] for c, p in zip(top.indices[i], top.values[i])],
                       "true": true}  # fmt: skip
                if split != "all":
                    row["split"] = split
                rows.append(row)
                if true is not None:
                    known += 1
                    correct += true == guess
                if len(shown) < 64:
                    shown.append(images.images[j])
                    predicted_names.append(guess)
                    true_names.append(true)
    output = Path(task.get("output") or run_dir / "predictions.jsonl")
    write_jsonl(rows, output)
    grid = output.with_suffix(".png")
    write_grid(torch.stack(shown), predicted_names, true_names, grid)
    print(f"wrote {len(rows)} predictions to {output} and a grid of the first {len(shown)} to {grid}")
    metrics = {"infer/images": len(rows), "infer/output": str(output), "infer/grid": str(grid)}
    if known:
        metrics["infer/acc"] = round(correct / known, 5)
    return metrics
