"""task=bench_media: how fast audio and video are decoded, and what the cached on-device pipeline saves.

decode      every file of data.source decoded, resampled / sampled and fitted from disk, as the first run
            does (data.num_workers threads): clips/s, and seconds of audio (or video) decoded per second
cache       the same dataset read back from the decoded safetensors cache, as every later run does
pipeline    training batches ready for the model (features or clips on the compute device, augmented):
            ONN's resident store sliced by a shuffled index with the transform run on the batch, against
            the standard per-file pipeline (a Dataset that decodes one file per item and computes its
            features, a DataLoader with task.standard_workers workers collating them): samples/s of each
            and resident / standard
train       the same two pipelines each training the model for task.steps steps: samples/s and the ratio

Each of task.repeats rounds times both sides; the best round of each side is reported (a noisy
neighbour only ever slows a round down). Figures go to metrics.json under media/.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any

import torch
import torch.nn.functional as F

from onn.bench.vision import epochs, samples_per_s, stamp
from onn.config import ONNConfig
from onn.config.task import BenchVisionTask
from onn.errors import UserError

log = logging.getLogger("onn")


def run(job) -> dict[str, Any]:
    from onn.modalities import classification

    config, m = job.config, job.modality
    task: BenchVisionTask = config.task
    steps, warmup, repeats, workers = task.steps, task.warmup, task.repeats, task.standard_workers
    if steps < 2 or warmup < 1 or repeats < 1 or workers < 0:
        raise UserError(
            "task.steps must be 2 or more, task.warmup and task.repeats 1 or more, task.standard_workers 0 or more."
        )
    if not hasattr(m, "reader"):
        raise UserError(
            f"task=bench_media measures media that is decoded from files (audio, video), not {m.name} data."
        )
    if str(config.data.source).startswith("builtin:"):
        from onn.modalities.video.dataset import resolve

        source = resolve(config.data.source, config.data, config.paths.cache)
        config = dataclasses.replace(config, data=dataclasses.replace(config.data, source=source))
    dm = classification.setup_data(m, config, job.device)  # decodes once (or reads the cache): what the runs use
    if dm.streamed:
        raise UserError("task=bench_media compares the resident store with per-file loading; set data.resident=true.")
    inputs = classification.data_inputs(m, config, dm)
    decoding = _decoding(m, config, inputs, repeats)
    pipe, train = _pipelines(job, config, dm, inputs, steps, warmup, repeats, workers)
    metrics = _figures(m.name, decoding, pipe, train)
    metrics.update({"media/batch_size": dm.batch_size, "media/timed_steps": steps, "media/standard_workers": workers})
    return metrics


def _decoding(m, config: ONNConfig, inputs: dict[str, Any], repeats: int) -> dict[str, Any]:
    """The whole source decoded (the best of `repeats`), and the decoded cache read back."""
    reader, source = m.reader(), str(config.data.source)
    decode_s, cache_s, clips, seconds = [], [], 0, 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        decoded, seconds = reader.read(source, config.data, reader.fit(inputs), workers=config.data.num_workers or 1)
        decode_s.append(time.perf_counter() - start)
        clips = sum(len(d.labels) for d in decoded.values())
        start = time.perf_counter()
        reader.read_cached(source, config.data, config.paths.cache)
        cache_s.append(time.perf_counter() - start)
    return {"decode_s": decode_s, "cache_s": cache_s, "clips": clips, "seconds": seconds}


def _pipelines(job, config: ONNConfig, dm, inputs, steps: int, warmup: int, repeats: int, workers: int):
    """Batches ready for the model, and training on them, from the resident store and from a per-file
    Dataset + DataLoader: samples per second of each, per round."""
    m = job.modality
    transform = m.transform(config, inputs)
    standard = standard_items(m, config, dm, inputs, transform)
    batch = dm.batch_size
    precision = config.trainer.precision  # what a run trains with: auto is the plan's
    precision = job.plan.precision if precision in (None, "auto") else str(precision)
    pipe: dict[str, list[float]] = {"resident": [], "standard": []}
    train: dict[str, list[float]] = {"resident": [], "standard": []}
    for _ in range(repeats):
        pipe["resident"].append(_pipeline(dm.train_dataloader(), steps, warmup, transform, dm.device))
        pipe["standard"].append(_pipeline(standard.loader(batch, workers, dm.device), steps, warmup, None, dm.device))
        train["resident"].append(
            _train(m, config, inputs, dm.train_dataloader(), steps, warmup, transform, precision, dm.device)
        )
        train["standard"].append(
            _train(
                m, config, inputs, standard.loader(batch, workers, dm.device), steps, warmup, None, precision, dm.device
            )
        )
    return pipe, train


def standard_items(m, config: ONNConfig, dm, inputs: dict[str, Any], transform) -> PerFileItems:
    """The standard pipeline's Dataset over the files of the datamodule's training split, as the resident side
    draws them."""
    reader, source = m.reader(), str(config.data.source)
    names = set(dm.splits["train"].names)
    listed = reader.listing(source, config.data, "data.source")
    files = [f for split in listed.splits.values() for f in split if f.name in names]
    index = {c: i for i, c in enumerate(dm.classes)}
    load = functools.partial(reader.load, fit=reader.fit(inputs))
    return PerFileItems(files, [index[f.label] for f in files], load, reader.bad, transform, reader.dtype)


def _figures(
    kind: str, d: dict[str, Any], pipe: dict[str, list[float]], train: dict[str, list[float]]
) -> dict[str, Any]:
    clips, seconds = d["clips"], d["seconds"]
    best_decode, best_cache = min(d["decode_s"]), min(d["cache_s"])
    best_pipe = {k: max(v) for k, v in pipe.items()}
    best_train = {k: max(v) for k, v in train.items()}
    metrics = {
        "media/clips": clips,
        "media/decoded_seconds": round(seconds, 2),
        "media/decode_s": round(best_decode, 3),
        "media/decode_clips_per_s": round(clips / best_decode, 1),
        f"media/decode_{kind}_s_per_s": round(seconds / best_decode, 1),  # seconds of media decoded per second
        "media/cache_read_s": round(best_cache, 4),
        "media/cache_clips_per_s": round(clips / best_cache, 1),
        "media/cache_speedup": round(best_decode / best_cache, 1),
        "media/pipeline_resident_samples_per_s": round(best_pipe["resident"], 1),
        "media/pipeline_standard_samples_per_s": round(best_pipe["standard"], 1),
        "media/resident_speedup": round(best_pipe["resident"] / best_pipe["standard"], 2),
        "media/train_resident_samples_per_s": round(best_train["resident"], 1),
        "media/train_standard_samples_per_s": round(best_train["standard"], 1),
        "media/train_speedup": round(best_train["resident"] / best_train["standard"], 3),
        "media/rounds": {
            "decode_s": [round(x, 3) for x in d["decode_s"]],
            "cache_s": [round(x, 4) for x in d["cache_s"]],
            **{f"pipeline_{k}": [round(x, 1) for x in v] for k, v in pipe.items()},
            **{f"train_{k}": [round(x, 1) for x in v] for k, v in train.items()},
        },
    }
    for line in (
        f"decode: {clips} clips ({seconds:.0f} s of {kind}) "
        f"in {best_decode:.2f} s = {metrics['media/decode_clips_per_s']:.0f} clips/s, "
        f"{metrics[f'media/decode_{kind}_s_per_s']:.0f} s of {kind} per second; from the cache in {best_cache:.3f} s "
        f"(x{metrics['media/cache_speedup']:.0f})",
        f"pipelines: resident {best_pipe['resident']:.0f} samples/s, "
        f"per-file Dataset+DataLoader {best_pipe['standard']:.0f} "
        f"samples/s -> resident_speedup x{metrics['media/resident_speedup']:.1f}",
        f"training on each: resident {best_train['resident']:.0f} samples/s, "
        f"per-file {best_train['standard']:.0f} samples/s "
        f"-> train_speedup x{metrics['media/train_speedup']:.2f}",
    ):
        print(line)
    return metrics


class PerFileItems(torch.utils.data.Dataset):
    """The standard pipeline's Dataset: one file decoded and featurised per item, in the DataLoader's workers."""

    def __init__(self, files, labels: list[int], load, bad, transform, dtype: torch.dtype):
        self.files, self.labels, self.load, self.bad, self.transform, self.dtype = (
            files,
            labels,
            load,
            bad,
            transform,
            dtype,
        )

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        for step in range(len(self)):  # a file that does not decode: the next one stands in
            j = (i + step) % len(self)
            try:
                x, _ = self.load(self.files[j].source.open())
            except self.bad:
                continue
            with torch.no_grad():
                return self.transform(x.to(self.dtype)[None], train=True)[0], self.labels[j]
        raise UserError("no file of the training split decodes")

    def loader(self, batch: int, workers: int, device: torch.device):
        """Full batches only, as the resident side draws them, unless the split holds less than a batch."""
        return torch.utils.data.DataLoader(
            self,
            batch_size=batch,
            shuffle=True,
            drop_last=len(self) >= batch,
            num_workers=workers,
            persistent_workers=False,
            pin_memory=device.type == "cuda",
        )


def _pipeline(loader, steps: int, warmup: int, transform, device: torch.device) -> float:
    """Batches ready for the model (on the device, augmented), no model: samples/s after warm-up. Only the timed
    window's two ends wait for the device (onn/bench/vision.py's `stamp`): a wait at every batch kept the host
    from preparing the next batch while the GPU worked on this one, and timed each side's host work beside its
    device work where they overlap in a run."""
    stamps: list[float] = []
    rows: list[int] = []
    with torch.no_grad():
        for x, _ in epochs(loader, warmup + steps + 1):
            stamp(stamps, device, warmup, steps)
            if len(stamps) > warmup + steps:
                break
            rows.append(len(x))
            x = x.to(device, non_blocking=True)
            if transform is not None:
                transform(x, train=True)
    return samples_per_s(stamps, rows, warmup, steps)


def _train(
    m, config, inputs, loader, steps: int, warmup: int, transform, precision: str, device: torch.device
) -> float:
    """A plain training loop on either pipeline: samples/s after warm-up (the same model, optimiser, precision),
    waiting for the device at the timed window's two ends only, as `_pipeline`."""
    from onn.training.optim import make_optimizer

    torch.manual_seed(config.seed)
    model = m.network(config.model, inputs).to(device).train()
    optimizer = make_optimizer(model.parameters(), config.optim)
    half = torch.bfloat16 if precision.startswith("bf16") else torch.float16 if precision.startswith("16") else None
    scaler = torch.amp.GradScaler(device.type, enabled=half is torch.float16)  # as Lightning's 16-mixed
    stamps: list[float] = []
    rows: list[int] = []
    for x, labels in epochs(loader, warmup + steps + 1):
        stamp(stamps, device, warmup, steps)
        if len(stamps) > warmup + steps:
            break
        rows.append(len(labels))
        x, labels = x.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        if transform is not None:
            with torch.no_grad():
                x = transform(x, train=True)
        with torch.autocast(device.type, dtype=half or torch.float32, enabled=half is not None):
            loss = F.cross_entropy(model(x), labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    return samples_per_s(stamps, rows, warmup, steps)
