"""Image datasets for Lightning: decoded once into a uint8 cache, held on the compute device.

A small dataset (the usual case: CIFAR, MNIST, SVHN, Flowers) is decoded once into uint8 tensors,
saved as safetensors under paths.cache keyed by the source's content and the decoding settings,
and moved to the compute device whole. A batch is then one `index_select` by a shuffled index:
no per-sample Dataset, collate or worker. Augmentation and normalisation run on the batch, on the
device (onn.data.augment, applied by the LightningModule). A dataset whose decoded size is over
the budget (data.resident_max_mb) is streamed instead: a DataLoader decodes files per sample in
workers, and the same batch augmentation runs on the device afterwards.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch

from onn.errors import UserError

log = logging.getLogger("onn")
MB = 1024**2
# What the decoded pixels depend on besides the source's bytes.
DECODE_KEYS = ("format", "channels", "image_size", "resize", "max_bad_fraction", "num_classes")


@dataclass
class Split:
    """One split held in memory: uint8 images [N, C, H, W] and int64 labels, on one device."""

    images: torch.Tensor
    labels: torch.Tensor
    names: list[str]

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def subset(self, index: torch.Tensor) -> Split:
        return Split(self.images[index], self.labels[index], [self.names[i] for i in index.tolist()])


class ResidentBatches:
    """Batches sliced from device-resident tensors by a seeded shuffled index, one epoch per iteration.

    The permutation of epoch e is drawn from seed + e, so a resumed run sees the same order."""

    def __init__(self, split: Split, batch_size: int, shuffle: bool, seed: int = 0, drop_last: bool = False):
        self.split, self.batch_size, self.shuffle, self.seed = split, batch_size, shuffle, seed
        self.drop_last = drop_last and len(split) >= batch_size
        self.epoch = 0

    def __len__(self) -> int:
        n = len(self.split)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        images, labels = self.split.images, self.split.labels
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(self.split), generator=generator).to(images.device)
            self.epoch += 1
        else:
            order = None
        for i in range(len(self)):
            if order is None:
                yield (
                    images[i * self.batch_size : (i + 1) * self.batch_size],
                    labels[i * self.batch_size : (i + 1) * self.batch_size],
                )
            else:
                index = order[i * self.batch_size : (i + 1) * self.batch_size]
                yield images.index_select(0, index), labels.index_select(0, index)


class _StreamedItems(torch.utils.data.Dataset):
    """Per-sample decoding for datasets too big to hold decoded (the fallback, not the fast path)."""

    def __init__(self, items, index: list[int]):
        self.items, self.index = items, index

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int):
        for step in range(
            len(self)
        ):  # a corrupt item: the next good one stands in, so batches keep their size
            j = self.index[(i + step) % len(self)]
            image = self.items.load(j)
            if image is not None:
                return image, self.items.labels[j]
        raise UserError("data.source: no image in this split could be decoded.")


def decode_settings(data_cfg: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of image_formats.read_splits that the data config sets."""
    size = data_cfg.get("image_size")
    return {
        "channels": data_cfg.get("channels", "auto") or "auto",
        "image_size": [int(size), int(size)] if isinstance(size, int) else (list(size) if size else None),
        "resize": data_cfg.get("resize", "error"),
        "max_bad_fraction": float(data_cfg.get("max_bad_fraction", 0.01)),
        "num_classes": data_cfg.get("num_classes") if isinstance(data_cfg.get("num_classes"), int) else None,
    }


def read_cached(
    source: str, data_cfg: dict[str, Any], cache_dir: str | os.PathLike, key: str = "data.source"
):
    """{split: ImageSet} for a source, decoded once and then read from the safetensors cache."""
    from safetensors.torch import load_file, save_file

    from onn.data.image_formats import ImageSet, read_splits, source_digest

    path = Path(os.path.expanduser(source))
    if not path.exists():
        raise UserError(
            f"{key}={source} does not exist; point it at your copy of the dataset (see the data config's comment)."
        )
    settings = decode_settings(data_cfg)
    fmt = data_cfg.get("format", "auto") or "auto"
    wanted = json.dumps({"digest": source_digest(path), "format": fmt, **settings}, sort_keys=True)
    cache = Path(cache_dir) / "images" / f"{hashlib.sha256(wanted.encode()).hexdigest()[:20]}.safetensors"
    if cache.is_file():
        from safetensors import safe_open

        with safe_open(str(cache), "pt") as f:
            meta = json.loads(f.metadata()["onn"])
        tensors = load_file(str(cache))
        log.info("images: %s from the decoded cache %s", source, cache)
        skipped = [item for s in meta["splits"].values() for item in s["skipped"]]
        if skipped:  # the decoder named them when it read the source; say so again for this run
            log.warning("images: %d of %s could not be decoded and are left out, e.g. %s", len(skipped), source,
                        "; ".join(skipped[:3]))  # fmt: skip
        return {
            name: ImageSet(tensors[f"{name}.images"], tensors[f"{name}.labels"], meta["classes"], s["names"], s["skipped"])
            for name, s in meta["splits"].items()
        }  # fmt: skip
    splits = read_splits(path, fmt, key=key, **settings)
    tensors, meta = {}, {"classes": None, "splits": {}}
    for name, s in splits.items():
        tensors[f"{name}.images"], tensors[f"{name}.labels"] = s.images.contiguous(), s.labels.contiguous()
        meta["classes"] = s.classes
        meta["splits"][name] = {"names": s.names, "skipped": s.skipped}
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".tmp{os.getpid()}")
    save_file(tensors, str(tmp), metadata={"onn": json.dumps(meta), "source": str(path)})
    tmp.replace(cache)  # whole or not at all: a killed run leaves no half-written cache
    return splits


class ImageDataModule(L.LightningDataModule):
    """train / val / test splits of an image dataset, resident on `device` or streamed."""

    def __init__(self, data_cfg: dict[str, Any], cache_dir: str | os.PathLike, device: str | torch.device = "cpu",
                 seed: int = 0):  # fmt: skip
        super().__init__()
        self.cfg, self.cache_dir, self.seed = data_cfg, cache_dir, seed
        self.device = torch.device(device)
        self.batch_size = int(data_cfg.get("batch_size", 128))
        self.eval_batch_size = int(data_cfg.get("eval_batch_size") or 2 * self.batch_size)
        self.splits: dict[str, Split] = {}
        self.classes: list[str] = []
        self.streamed = None  # {split: (ItemList, indices)} when the dataset is streamed
        self.skipped: list[str] = []

    # -- what the model needs to know -------------------------------------------------------------
    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        if self.streamed:
            items, index = self.streamed["train"]
            return tuple(items.load(index[0]).shape)
        return tuple(self.splits["train"].images.shape[1:])

    def setup(self, stage: str | None = None) -> None:
        if self.splits or self.streamed:
            return
        source = self.cfg.get("source")
        if not source:
            raise UserError(
                "data.source is not set: point it at your copy of the dataset (the data config's comment shows the layouts)."
            )
        source = str(source)
        if self._too_big(source):
            self._setup_streamed(source)
        else:
            self._setup_resident(source)

    def _too_big(self, source: str) -> bool:
        """Whether the decoded dataset would exceed data.resident_max_mb (resident: auto)."""
        resident = self.cfg.get("resident", "auto")
        if resident in (True, "true"):
            return False
        if resident in (False, "false"):
            return True
        from onn.data.image_formats import list_items

        budget = self.cfg.get("resident_max_mb", "auto")
        if budget in (None, "auto"):
            budget = _memory_budget_mb(self.device)
        try:
            items = list_items(source, self.cfg.get("format", "auto") or "auto")
        except UserError:
            return False  # no random access (e.g. .tar.gz): decoded whole
        count = sum(len(v) for v in items.values())
        if not count:
            return False
        first = next(v for v in items.values() if len(v))
        first.configure(
            **{
                k: v
                for k, v in decode_settings(self.cfg).items()
                if k in ("channels", "image_size", "resize")
            }
        )
        sample = first.load(0)
        decoded_mb = count * (sample.numel() if sample is not None else 0) / MB
        if decoded_mb > float(budget):
            log.info(
                "images: %.0f MB decoded is over the %.0f MB budget: streaming from %s",
                decoded_mb,
                float(budget),
                source,
            )
            return True
        return False

    def _setup_resident(self, source: str) -> None:
        sets = read_cached(source, self.cfg, self.cache_dir)
        for split in ("val", "test"):
            if self.cfg.get(f"{split}_source"):
                found = read_cached(
                    str(self.cfg[f"{split}_source"]), self.cfg, self.cache_dir, key=f"data.{split}_source"
                )
                sets[split] = found.get("all") or found.get(split) or next(iter(found.values()))
        train = sets.get("train") or sets.get("all")
        if train is None:
            raise UserError(f"data.source={source} has no training images (found splits: {', '.join(sets)}).")
        self.classes = self._class_names(train.classes)
        for split in ("val", "test"):
            if self.cfg.get(f"{split}_source"):
                sets[split] = _relabel(sets[split], self.classes, f"data.{split}_source")
        self._check_labels(sets)
        self.skipped = [s for v in sets.values() for s in v.skipped]
        splits = {
            k: Split(v.images, v.labels, v.names)
            for k, v in sets.items()
            if k in ("train", "val", "test", "all")
        }
        if "train" not in splits:
            splits["train"] = splits.pop("all")
        if "val" not in splits:
            splits["train"], splits["val"] = self._hold_out(splits["train"])
        shapes = {k: tuple(v.images.shape[1:]) for k, v in splits.items()}
        if len(set(shapes.values())) > 1:
            raise UserError(
                f"data.source={source}: splits have different image shapes {shapes}; set data.image_size=[H,W]."
            )
        self.splits = {
            k: Split(v.images.to(self.device), v.labels.to(self.device), v.names) for k, v in splits.items()
        }
        sizes = ", ".join(f"{k} {len(v)}" for k, v in self.splits.items())
        mb = sum(v.images.numel() for v in self.splits.values()) / MB
        log.info("images: %s, %s, %d classes, %.0f MB uint8 on %s", sizes, "x".join(map(str, shapes["train"])),
                 self.num_classes, mb, self.device)  # fmt: skip

    def _setup_streamed(self, source: str) -> None:
        from onn.data.image_formats import list_items

        if self.cfg.get("val_source") or self.cfg.get("test_source"):
            raise UserError("a streamed dataset takes its splits from data.source: unset data.val_source/test_source, "
                            "or set data.resident=true.")  # fmt: skip

        items = list_items(source, self.cfg.get("format", "auto") or "auto")
        settings = {
            k: v for k, v in decode_settings(self.cfg).items() if k in ("channels", "image_size", "resize")
        }
        for v in items.values():
            v.configure(**settings)
        train = items.get("train") or items.get("all")
        self.classes = self._class_names(train.classes)
        index = list(range(len(train)))
        self.streamed = {}
        if "val" in items:
            self.streamed["val"] = (items["val"], list(range(len(items["val"]))))
        else:
            order = torch.randperm(len(train), generator=torch.Generator().manual_seed(self.seed)).tolist()
            n_val = self._val_count(len(train))
            self.streamed["val"], index = (train, order[:n_val]), order[n_val:]
        self.streamed["train"] = (train, index)
        if "test" in items:
            self.streamed["test"] = (items["test"], list(range(len(items["test"]))))

    def _class_names(self, found: list[str]) -> list[str]:
        names = self.cfg.get("classes")
        n = self.cfg.get("num_classes")
        if names:
            return [str(c) for c in names]
        if isinstance(n, int) and len(found) < n:
            return found + [str(i) for i in range(len(found), n)]  # classes absent from this copy of the data
        return list(found)

    def _check_labels(self, sets) -> None:
        n = len(self.classes)
        for name, s in sets.items():
            bad = ((s.labels < 0) | (s.labels >= n)).nonzero()
            if len(bad):
                i = int(bad[0])
                raise UserError(
                    f"{s.names[i]} in data.source ({name} split) has label {int(s.labels[i])}, outside the {n} classes; "
                    "fix the label or set data.num_classes."
                )

    def _val_count(self, n: int) -> int:
        fraction = float(self.cfg.get("val_split", 0.1))
        if not 0 < fraction < 1:
            raise UserError(
                f"data.val_split must be between 0 and 1 (got {fraction}) when the data has no val split."
            )
        n_val = max(1, round(n * fraction))
        if n_val >= n:
            raise UserError(f"data.source has {n} training images: too few to hold out a validation split.")
        return n_val

    def _hold_out(self, train: Split) -> tuple[Split, Split]:
        """A seeded validation split taken from train (the same images for every run with this seed)."""
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(self.seed))
        n_val = self._val_count(len(train))
        return train.subset(order[n_val:]), train.subset(order[:n_val])

    # -- loaders ----------------------------------------------------------------------------------
    def train_dataloader(self):
        if self.streamed:
            return self._loader("train", shuffle=True)
        loader = ResidentBatches(
            self.splits["train"], self.batch_size, shuffle=True, seed=self.seed, drop_last=True
        )
        if self.trainer is not None:
            loader.epoch = self.trainer.current_epoch  # resumed runs continue the epoch sequence
        return loader

    def val_dataloader(self):
        if self.streamed:
            return self._loader("val", shuffle=False)
        return ResidentBatches(self.splits["val"], self.eval_batch_size, shuffle=False)

    def test_dataloader(self):
        if self.streamed:
            return self._loader("test", shuffle=False) if "test" in self.streamed else []
        return (
            ResidentBatches(self.splits["test"], self.eval_batch_size, shuffle=False)
            if "test" in self.splits
            else []
        )

    def has_test(self) -> bool:
        return "test" in (self.streamed or self.splits)

    def _loader(self, split: str, shuffle: bool):
        items, index = self.streamed[split]
        workers = int(self.cfg.get("num_workers", 2))
        return torch.utils.data.DataLoader(
            _StreamedItems(items, index), batch_size=self.batch_size if shuffle else self.eval_batch_size,
            shuffle=shuffle, drop_last=shuffle, num_workers=workers, persistent_workers=workers > 0,
            pin_memory=self.device.type == "cuda", generator=torch.Generator().manual_seed(self.seed),
        )  # fmt: skip


def _relabel(images, classes: list[str], key: str):
    """Labels of a separate val/test source, by class name, in the training set's class order."""
    missing = [c for c in images.classes if c not in classes]
    if missing:
        raise UserError(
            f"{key} has classes the training data does not: {missing[:5]}; use the same class names."
        )
    table = torch.tensor([classes.index(c) for c in images.classes] or [0], dtype=torch.long)
    labels = torch.where(images.labels >= 0, table[images.labels.clamp_min(0)], images.labels)
    return type(images)(images.images, labels, list(classes), images.names, images.skipped)


def _memory_budget_mb(device: torch.device) -> float:
    """Half of the free device memory, or a third of the available host memory."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free / MB / 2
    import psutil

    return psutil.virtual_memory().available / MB / 3
