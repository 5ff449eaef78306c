"""Classification datasets held decoded on the compute device, or streamed when they are too big.

Small datasets (the usual case: CIFAR, MNIST, spoken digits, short clips, point clouds) are decoded
once into tensors [N, ...] and moved to the device whole; a batch is one `index_select` by a seeded
shuffled index: no per-sample Dataset, collate or worker. A dataset whose decoded size is over
`data.resident_max_mb` is streamed instead: a DataLoader decodes items in workers.

A modality gives `ClassificationData` its readers (`read` a whole source decoded, `list_items` for
streaming); the splits, the class names and their order, the held-out validation split and the
loaders are the same for every modality.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import lightning as L
import numpy as np
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from onn.config.data import LabelledFiles, SplitData, eval_batch
from onn.config.task import READS_CHECKPOINT
from onn.data.files import same_path
from onn.data.labelled import check_bad, same_text
from onn.errors import UserError

log = logging.getLogger("onn")
MB = 1024**2
SIZED_TRIES = 32  # items tried for one that decodes, to size a dataset by (ClassificationData.item_mb)


def epoch_generator(seed: int, epoch: int) -> torch.Generator:
    """The generator of one epoch's shuffle: (seed, epoch) mixed by numpy's SeedSequence, so that no two pairs share
    an order (a generator seeded with seed + epoch gave seed 1's first epoch seed 0's second, and a sweep over
    seeds trained its runs on shifted copies of one sequence of orders)."""
    return torch.Generator().manual_seed(int(np.random.SeedSequence([int(seed), int(epoch)]).generate_state(1)[0]))


@dataclass
class Decoded:
    """One split of a source as its reader decoded it."""

    inputs: torch.Tensor  # [N, ...], the modality's stored form (uint8 pixels, float16 samples, ...)
    labels: torch.Tensor  # int64 [N]; -1 where the label is unknown (unlabelled inputs for inference)
    classes: list[str]  # class names, index = label
    names: list[str]  # where each item came from, e.g. "train/cat/0001.jpg"
    skipped: list[str] = field(default_factory=list)  # items that could not be decoded, each "name: reason"


@dataclass
class Split:
    """One split held in memory: inputs [N, ...] and int64 labels, on one device."""

    inputs: torch.Tensor
    labels: torch.Tensor
    names: list[str]

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def subset(self, index: torch.Tensor) -> Split:
        return Split(self.inputs[index], self.labels[index], [self.names[i] for i in index.tolist()])


class Items(Protocol):
    """A source listed item by item, decoded on demand (the streamed fallback). It may also hold `refused`, the
    listed items its reader refused ("name: why"), counted with those that do not decode."""

    labels: Any
    classes: list[str]
    names: list[str]  # where each item came from, as Decoded.names

    def __len__(self) -> int: ...

    def load(self, i: int) -> torch.Tensor | None: ...


class ResidentBatches:
    """Batches sliced from device-resident tensors by a seeded shuffled index, one epoch per iteration.

    The permutation of epoch e is drawn from (seed, e) by epoch_generator, so a resumed run sees the same order.
    `groups`: the group of each sample (e.g. its speaker); each training batch then holds samples of one group only, and
    drop_last drops the remainder of a group that filled a batch (a smaller group is one short batch: dropped,
    it would never be trained on).

    Under DDP (`world` processes, this one `rank`) the data is shared out as Lightning's DistributedSampler shares a
    DataLoader's (the streamed path): in training each process takes every world-th sample of the epoch's order,
    padded to equal shares so that every process runs as many steps (each step is a collective), in batches of
    batch_size (grouped: every world-th batch); an evaluation split (shuffle false) is cut into contiguous shares,
    each sample scored by one process (EvaluatedOnceDDP), a split smaller than the processes padded so each has one."""

    def __init__(
        self,
        split: Split,
        batch_size: int,
        shuffle: bool,
        seed: int = 0,
        drop_last: bool = False,
        groups: list[str] | None = None,
        epoch_of: Callable[[], int] | None = None,
        rank: int = 0,
        world: int = 1,
    ):
        self.split, self.batch_size, self.shuffle, self.seed = split, batch_size, shuffle, seed
        self.rank, self.world = rank, world
        self.epoch_of = epoch_of  # the trainer's epoch, read when an epoch starts (a resumed run's is restored late)
        self.groups = groups
        # a split (or this process's share of it) smaller than a batch is one short batch
        self.drop_last = drop_last and (len(split) if groups is not None else self._share_size()) >= batch_size
        self.epoch = 0  # the next iteration's epoch
        self._current, self._taken, self._skip = 0, 0, 0  # the epoch being iterated, its batches given, to skip
        self._skip_epoch = 0  # the epoch that _skip belongs to

    def __len__(self) -> int:
        if self.groups is not None:
            return -(-len(self._batches(torch.arange(len(self.split)))) // self.world)
        n = self._share_size()
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _share_size(self) -> int:
        """This process's samples of the split (without groups): an equal share in training, else its own."""
        if self.shuffle:
            return -(-len(self.split) // self.world)
        start, end = self._evaluated_share()
        return end - start

    def _evaluated_share(self) -> tuple[int, int]:
        """[start, end) of this process's contiguous share of an evaluation split, each sample in one share only."""
        n = len(self.split)
        if n and n < self.world:  # every process needs a batch: DDP's first evaluation forward syncs its buffers
            return self.rank % n, self.rank % n + 1
        return self.rank * n // self.world, (self.rank + 1) * n // self.world

    def _trained_share(self, order: torch.Tensor) -> torch.Tensor:
        """This process's samples of an epoch's `order`: every world-th, the order padded by its first samples to
        equal shares (DistributedSampler's)."""
        if self.world == 1 or not len(order):
            return order
        total = -(-len(order) // self.world) * self.world
        padded = order.repeat(-(-total // len(order)))[:total]
        return padded[self.rank :: self.world]

    def _batches(self, order: torch.Tensor) -> list[torch.Tensor]:
        """`order` cut into batches: this process's share in turn, or every process's within each group (in order
        of first appearance; _shared picks this process's)."""
        if self.groups is None:
            return list(self._trained_share(order)[: len(self) * self.batch_size].split(self.batch_size))
        members: dict[str, list[int]] = {}
        for i in order.tolist():
            members.setdefault(self.groups[i], []).append(i)
        out = []
        for index in members.values():
            drop = self.drop_last and len(index) >= self.batch_size
            full = len(index) // self.batch_size if drop else -(-len(index) // self.batch_size)
            out += [torch.tensor(index[b * self.batch_size : (b + 1) * self.batch_size]) for b in range(full)]
        return out

    def _shared(self, batches: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every world-th of all processes' grouped `batches`, the list padded by its first batches to equal shares."""
        if self.world == 1 or not batches:
            return batches
        count = -(-len(batches) // self.world)
        return [batches[(i * self.world + self.rank) % len(batches)] for i in range(count)]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        inputs, labels = self.split.inputs, self.split.labels
        if self.epoch_of is not None:
            self.epoch = self.epoch_of()
        # a restored place holds for the epoch it was saved in only (a later epoch starts at its first batch)
        skip = self._skip if self.epoch == self._skip_epoch else 0
        self._current, self._taken, self._skip = self.epoch, skip, 0
        if not self.shuffle:
            start, end = self._evaluated_share()
            for i in range(self._taken, len(self)):
                window = slice(start + i * self.batch_size, min(start + (i + 1) * self.batch_size, end))
                self._taken += 1
                yield inputs[window], labels[window]
            return
        generator = epoch_generator(self.seed, self.epoch)
        batches = self._batches(torch.randperm(len(self.split), generator=generator))
        if self.groups is not None:  # the groups' batches interleaved at random, then shared out
            batches = self._shared([batches[b] for b in torch.randperm(len(batches), generator=generator).tolist()])
        self.epoch += 1
        batches = batches[self._taken :]  # a run resumed mid-epoch goes on from its next batch
        # the epoch's order goes to the device in one copy: a copy per batch would make the host wait for the
        # GPU at every batch (a blocking copy into device memory waits for the work queued before it)
        sizes = [len(index) for index in batches]
        on_device = torch.cat(batches).to(inputs.device) if batches else torch.empty(0, dtype=torch.long)
        for index in on_device.split(sizes):
            self._taken += 1
            yield inputs.index_select(0, index), labels.index_select(0, index)

    def state_dict(self) -> dict[str, int]:
        """Where the epoch being iterated stands; Lightning keeps it in checkpoints, so a run killed mid-epoch
        resumes with the same order from the batch after the last one it trained on. An epoch given whole is the
        next epoch's start: a run resumed from its end (with more trainer.max_epochs) trains that next epoch whole. A
        restored place not yet gone on from (a resumed run with nothing left to train) is saved as it was restored."""
        if self._skip:
            return {"epoch": self._skip_epoch, "taken": self._skip}
        if self._taken >= len(self):
            return {"epoch": self._current + 1, "taken": 0}
        return {"epoch": self._current, "taken": self._taken}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self._skip = int(state["epoch"]), int(state["taken"])
        self._skip_epoch = self.epoch


def batch_groups(names: list[str], pattern: str | None) -> list[str] | None:
    """Each name's group by data.batch_groups (a regex whose first group names it), or None when unset."""
    if not pattern:
        return None
    try:
        regex = re.compile(pattern)
    except re.error as e:
        raise UserError(f"data.batch_groups={pattern!r} is not a regular expression: {e}.") from None
    groups = []
    for name in names:
        found = regex.search(name)
        if found is None or not found.groups():
            raise UserError(
                f"data.batch_groups={pattern!r} finds no group in the training file name {name!r}: give a regex "
                "with one (group) that every training file name has, e.g. '_([a-z]+)_' for FSDD's speaker."
            )
        groups.append(found.group(1))
    return groups


class WorkerError(UserError):
    """A UserError raised in a DataLoader worker. torch raises it again in the main process as
    WorkerError("Caught WorkerError in DataLoader worker process N. Original Traceback ...: SENTENCE"): the one
    sentence is kept (the console's line, metrics.json's error), the worker's traceback dropped."""

    def __init__(self, message: str):
        said = f"{type(self).__module__}.{type(self).__qualname__}: "
        if message.startswith("Caught ") and said in message:
            message = message.rsplit(said, 1)[1].strip()
        super().__init__(message)


@contextmanager
def one_sentence() -> Iterator[None]:
    """Around work a DataLoader worker may do: its UserError reaches the user as the sentence it is (WorkerError)."""
    try:
        yield
    except WorkerError:
        raise
    except UserError as e:
        raise WorkerError(str(e)) from None


class StreamedItems(torch.utils.data.Dataset):
    """Per-item decoding for datasets too big to hold decoded (the fallback, not the fast path)."""

    def __init__(self, items: Items, index: list[int]):
        self.items, self.index = items, index

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int):
        j = self.index[i]  # an item that decoded when the data was set up (ClassificationData._decodable)
        with one_sentence():
            item = self.items.load(j)
        if item is None:
            raise WorkerError(
                f"data.source item {self.items.names[j]} decoded when the run began and no longer does; "
                "restore or remove it and run again."
            )
        return item, int(self.items.labels[j])


class EpochShuffle(torch.utils.data.Sampler[int]):
    """The streamed training order: epoch e is a permutation of range(size) drawn from (seed, e), as ResidentBatches'
    is, so a resumed run sees the unbroken run's order with any data.num_workers (a loader's own shuffle drew from one
    generator that each new iterator also drew from, and a resumed run, starting other iterators, shuffled
    otherwise). The epoch is the trainer's, `epoch_of()` read when an iteration starts: Lightning starts a run's first
    iterator before it calls set_epoch, and a loader with workers draws its first batches' indices then (a resumed run
    took epoch 0's order for its first epoch). Without a trainer (epoch_of None) each iteration is the next epoch, as
    a DataLoader's shuffle is and as ResidentBatches' is. StatefulDataLoader keeps state_dict
    (the epoch and the samples given of it) in the loader's, which Lightning keeps in checkpoints. Under DDP Lightning
    wraps it (DistributedSamplerWrapper): every process draws the same order and takes every world-th sample of it."""

    def __init__(self, size: int, seed: int, epoch_of: Callable[[], int] | None = None):
        self.size, self.seed, self.epoch_of = size, seed, epoch_of
        self.epoch = 0  # the trainer's epoch (set_epoch, or epoch_of)
        self._current, self._given = 0, 0  # the epoch being iterated, its samples given
        self._skip_epoch, self._skip = 0, 0  # a restored place: the samples of that epoch already trained on

    def __len__(self) -> int:
        return self.size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        if self.epoch_of is not None:
            self.epoch = self.epoch_of()
        # a restored place holds for the epoch it was saved in only (a later epoch starts at its first sample)
        skip = self._skip if self.epoch == self._skip_epoch else 0
        self._current, self._given, self._skip = self.epoch, skip, 0
        order = torch.randperm(self.size, generator=epoch_generator(self.seed, self._current))
        if self.epoch_of is None:
            self.epoch += 1
        for i in order[skip:].tolist():
            self._given += 1
            yield i

    def state_dict(self) -> dict[str, int]:
        """Where the epoch being iterated stands; a restored place not yet gone on from (a resumed run with nothing
        left to train) as it was restored, so that the run's final checkpoint keeps it."""
        if self._skip:
            return {"epoch": self._skip_epoch, "given": self._skip}
        return {"epoch": self._current, "given": self._given}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """The place to go on from; the epoch itself is the trainer's (epoch_of, set_epoch), which this place may not
        be in: a run saved at the end of its epoch goes on with the next one whole."""
        self._skip_epoch, self._skip = int(state["epoch"]), int(state["given"])


def trainer_ranks(trainer) -> tuple[int, int]:
    """(this process's rank, the processes): data held in memory is no DataLoader, so Lightning gives it no
    DistributedSampler and it shares itself out (ResidentBatches and its kin). (0, 1) before a trainer exists."""
    return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)


def evaluated_ranks(trainer, split: str) -> tuple[int, int]:
    """trainer_ranks for a held-out split, each sample scored by one process as EvaluatedOnceDDP gives a loader's;
    (0, 1) under a fraction of the batches (trainer.limit_val_batches=0.4): Lightning keeps int(batches x fraction)
    on each process, and shares a batch apart could keep 1 and 0 (one process raising while the others wait)."""
    rank, world = trainer_ranks(trainer)
    limit = getattr(trainer, f"limit_{split}_batches") if world > 1 else None
    return (0, 1) if isinstance(limit, float) and 0 < limit < 1 else (rank, world)


class StreamedLoader(StatefulDataLoader):
    """The streamed training loader: torchdata's StatefulDataLoader, whose place Lightning keeps in checkpoints,
    refusing in one sentence a place it cannot restore. torchdata asserted with no message when a checkpoint's loader
    ran with another data.num_workers, or kept the place of the shuffle before EpochShuffle (an earlier ONN's)."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        snapshot = state_dict.get("_snapshot")  # present where the loader had workers
        main = snapshot["_main_snapshot"] if snapshot else state_dict
        workers = int(main["_num_workers"]) if snapshot else 0
        if state_dict and workers != self.num_workers:
            raise UserError(
                f"the checkpoint's streamed data ran with data.num_workers={workers}; resume with the same "
                f"data.num_workers (not {self.num_workers})."
            )
        place = (main.get("_sampler_iter_state") or {}).get("sampler_iter_state") or {}
        if "generator" in place:  # torchdata's RandomSampler: an order EpochShuffle does not draw
            log.warning(
                "resume: the checkpoint's place in the streamed data was kept by an earlier ONN, whose shuffle this "
                "one does not draw; the epoch it was saved in trains from its first batch again"
            )
            return
        super().load_state_dict(state_dict)


class JoinedItems:
    """Several splits' items as one Items (those of each that decode): task=eval streams all of a data.source the
    command line gives as its val split, as every_split joins a resident read's."""

    def __init__(self, parts: list[tuple[Items, list[int]]]):
        self.where = [(items, i) for items, index in parts for i in index]
        self.labels = torch.as_tensor([int(items.labels[i]) for items, i in self.where], dtype=torch.long)
        self.classes = list(parts[0][0].classes) if parts else []
        self.names = [items.names[i] for items, i in self.where]

    def __len__(self) -> int:
        return len(self.where)

    def load(self, j: int) -> torch.Tensor | None:
        items, i = self.where[j]
        return items.load(i)


@dataclass(frozen=True)
class Undecodable:
    """What an item's check gives when it does not decode: why, for the one warning that names the skipped items."""

    why: str


def decoded(found: Any) -> bool:
    """Whether a check's result (Decodes) is of an item that decodes."""
    return found is not None and not isinstance(found, Undecodable)


class Decodes(torch.utils.data.Dataset):
    """What each (split, index) item decodes to, None when it does not: one pass over streamed data in the loader's
    workers, so a corrupt item is skipped and counted up front as a resident read does, not met in an epoch. Items
    with a `check(i)` say what it found (an image's channels) or, for one that does not decode, None or why
    (Undecodable); the others, True or None."""

    def __init__(self, items: dict[str, Items], pairs: list[tuple[str, int]]):
        self.items, self.pairs = items, pairs

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> Any:
        split, j = self.pairs[i]
        items = self.items[split]
        check = getattr(items, "check", None)
        with one_sentence():
            if check is not None:
                return check(j)
            return True if items.load(j) is not None else None


def split_of(found: dict[str, Any], split: str, fallback: bool = True) -> Any:
    """A source's `split` (train, val, test) from the splits reading it found: that split, or the whole source
    ("all": it had no split folders); with `fallback`, else its one split (a val source laid out as test/)."""
    for name in (split, "all") if split == "train" else ("all", split):
        if found.get(name):
            return found[name]
    return next(iter(found.values())) if fallback and found else None


def every_split(found: dict[str, Decoded]) -> Decoded:
    """Every split of a source as one: task=eval scores all of a data.source the command line gives (it sets
    data.val_source to it: onn.app.score_all_given), its train/ and test/ folders alike, as text eval does."""
    parts = list(found.values())
    if len(parts) == 1:
        return parts[0]
    return Decoded(
        torch.cat([p.inputs for p in parts]),
        torch.cat([p.labels for p in parts]),
        parts[0].classes,
        [n for p in parts for n in p.names],
        [],  # counted with the source's own splits
    )


def class_order(found: list[str], data_cfg: SplitData) -> list[str]:
    """The class names in label order: data.classes when given (the data's names must all be in it,
    in any order), else the data's own, padded to data.num_classes when that is larger (refused when smaller)."""
    names, n = data_cfg.classes, data_cfg.num_classes
    if names:
        names = [str(c) for c in names]
        if by_position(found, names):  # the data has label numbers: data.classes names them, in that order
            if len(found) > len(names):
                raise UserError(
                    f"data.classes names {len(names)} classes but data.source has {len(found)}; name them all."
                )
            return names
        unknown = [c for c in found if c not in names]
        if unknown:
            raise UserError(
                f"data.classes {names} does not name the classes {unknown[:5]} found in data.source; "
                "list every class (in the label order you want), or leave data.classes unset."
            )
        return names
    if isinstance(n, int) and len(found) > n:  # a label at or above data.num_classes
        raise UserError(
            f"data.num_classes={n} but data.source has {len(found)} classes ({', '.join(found[:5])}"
            f"{', ...' if len(found) > 5 else ''}); set data.num_classes={len(found)} or more, or auto."
        )
    if isinstance(n, int) and len(found) < n:
        return found + [str(i) for i in range(len(found), n)]  # classes absent from this copy of the data
    return list(found)


def numbered(classes: list[str]) -> bool:
    """Whether a source's classes are bare label numbers 0..n-1 (IDX, CIFAR binary, integer CSV labels)."""
    return classes == [str(i) for i in range(len(classes))]


def by_position(found: list[str], classes: list[str]) -> bool:
    """Whether labels indexing `found` keep their numbers as indices into `classes`: `found` is label numbers
    0..n-1 (IDX, CIFAR binary, integer CSV labels), which data.classes (or a checkpoint's names) name in their
    order, digits too (data.classes=[1,2,0]: label 0 is the digit 1). Except where `classes` are digit names in
    text order (0, 1, 10, 11, 2, ...): class folders sorted as text before they sorted as numbers, whose
    checkpoints' val folder of 0, 1, 2 scored folder 2 as 10; those map by name. Folders sorted as numbers
    (0, 1, 2, ..., 10, 11) give the same labels either way."""
    folders_as_text = set(found) <= set(classes) and classes == sorted(classes) and not numbered(classes)
    return numbered(found) and not folders_as_text


def relabel(decoded: Decoded, classes: list[str], key: str) -> Decoded:
    """A decoded split's labels by class name, in `classes` order (see relabelled)."""
    labels = relabelled(decoded.labels, decoded.classes, classes, key)
    return Decoded(decoded.inputs, labels, list(classes), decoded.names, decoded.skipped)


def relabelled(labels: torch.Tensor, found: list[str], classes: list[str], key: str) -> torch.Tensor:
    """Labels that index `found` (the data's own class names), as indices into `classes` by name (a separate
    val/test source, or data.classes given in another order than the data's own); label numbers that `classes`
    names otherwise keep their numbers (by_position), and -1 (unknown) stays."""
    if found == classes or by_position(found, classes):
        return labels
    missing = [c for c in found if c not in classes]
    if missing:
        raise UserError(f"{key} has classes the training data does not: {missing[:5]}; use the same class names.")
    table = torch.tensor([classes.index(c) for c in found] or [0], dtype=torch.long)
    return torch.where(labels >= 0, table[labels.clamp_min(0)], labels)


def held_out_by_name(sets: dict[str, Decoded], split: str, pattern: str) -> dict[str, Decoded]:
    """The items of the training data whose names match `pattern` (data.val_pattern / data.test_pattern, a
    regex searched in each name) moved to their own split: e.g. every recording of one speaker held out as
    the test set, so the model is tested on a voice it never heard."""
    key = f"data.{split}_pattern"
    try:
        regex = re.compile(pattern)
    except re.error as e:
        raise UserError(f"{key}={pattern!r} is not a valid regular expression: {e}.") from e
    if split in sets:
        raise UserError(
            f"{key} is set but the data already has a {split} split (data.source or data.{split}_source); "
            "use one of them."
        )
    name = "train" if "train" in sets else "all"
    source = sets[name]
    mask = torch.tensor([bool(regex.search(n)) for n in source.names], dtype=torch.bool)
    if not mask.any() or mask.all():
        raise UserError(
            f"{key}={pattern!r} matches {'no' if not mask.any() else 'every'} item of the training data "
            f"(names look like {source.names[0]}); give a pattern that picks some of them."
        )

    def take(keep: torch.Tensor, skipped: list[str]) -> Decoded:
        index = keep.nonzero().flatten()
        return Decoded(
            source.inputs[index],
            source.labels[index],
            source.classes,
            [source.names[i] for i in index.tolist()],
            skipped,
        )

    return {**sets, name: take(~mask, source.skipped), split: take(mask, [])}


def untrained_classes(classes: list[str], labels: dict[str, torch.Tensor]) -> str | None:
    """The warning naming the classes that val or test hold and training does not (a class folder only under test/,
    or a val_source's): the model never learns them, and every one of their items is scored wrong. None when there
    are none. `labels`: each split's labels, train's among them."""
    trained = set(labels["train"].tolist())
    scored = {int(c): k for k, v in labels.items() if k != "train" for c in v.unique().tolist()}
    missing = sorted(set(scored) - trained)
    if not missing:
        return None
    return (
        f"data: the training data has no item of the class(es) {', '.join(classes[c] for c in missing[:10])}, which "
        f"{' and '.join(sorted({scored[c] for c in missing}))} hold(s): the model never learns them; add training "
        "items of them"
    )


def val_fraction(value: float) -> float:
    """data.val_split checked as the fraction it is, in the one sentence the data module says where it draws a split
    (strictly between 0 and 1: a split of none or all leaves nothing to validate or to train on)."""
    if isinstance(value, bool) or not 0 < float(value) < 1:
        raise UserError(
            f"data.val_split must be between 0 and 1 (got {value}): it is the fraction of data.source held out for "
            "validation when the data has no val split."
        )
    return float(value)


def planned_val_split(config) -> None:
    """A training plan's data.val_split that is no fraction at all (below 0, above 1, not a number), refused before
    any data is read (it was said once every file was decoded). 0 and 1 wait for the data module, which refuses them
    only where it draws a split: a run with a val/ folder of its own may set 0. Tasks that only read a checkpoint are
    not checked: its saved value trained (a resumed training run is, as the command line may give it)."""
    value = config.data.val_split
    if config.task.name in READS_CHECKPOINT:
        return
    if isinstance(value, bool) or not 0 <= float(value) <= 1:
        val_fraction(value)


def held_out_share(seed: int, name: str) -> float:
    """Where an item falls in [0, 1), drawn by a hash of (seed, its name): below data.val_split it is held out for
    validation. Its name alone decides, never its position among the others (see ClassificationData._held_out): its
    last folder and file name (cat/06.png, whatever folders hold them: the folder pets/ and the zip pets.zip, whose
    members are pets/cat/06.png, hold out the same files; which folders are an archive's wrapper depends on the
    other names, and a draw that looked at them moved items when files were added), in NFC (same_text), so a copy
    macOS wrote with decomposed names holds out the same files too. Two items of one name share their draw."""
    tail = "/".join(same_text(name).split("/")[-2:])
    digest = hashlib.blake2b(f"{seed}\0{tail}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def held_out_indices(labels: list[int], share: list[float], fraction: float) -> tuple[list[int], list[int]]:
    """(train, val) indices of items of these class numbers and held_out_share draws (ClassificationData._held_out
    says why): under `fraction` held out, but a class drawn into val whole keeps its highest-drawn item, and at least
    one item is held out (the lowest-drawn of a class that keeps another; where none does, the lowest-drawn)."""
    val = [i for i, s in enumerate(share) if s < fraction]
    kept = [i for i, s in enumerate(share) if s >= fraction]
    counts = Counter(labels[i] for i in kept)
    for i in sorted(val, key=share.__getitem__, reverse=True):
        if not counts[labels[i]]:
            val.remove(i)
            kept.append(i)
            counts[labels[i]] += 1
    if not val:
        spare = min([j for j in kept if counts[labels[j]] > 1] or kept, key=share.__getitem__)
        kept.remove(spare)
        val.append(spare)
    return sorted(kept), sorted(val)


# how today's ONN draws a held-out split (held_out_share: per item, by its name or content), saved into every
# checkpoint beside the seed the split is drawn from; a checkpoint without it was written by an earlier ONN, which
# drew the split by a seeded shuffle of positions
HELD_OUT_RULE = "by name"


def drawn_by_name(saved: dict[str, Any], ckpt: Any, draws: bool = True) -> bool:
    """Whether `saved` (what a checkpoint keeps beside its seed) says its held-out split was drawn by HELD_OUT_RULE.
    Where it was not and this run `draws` that split again from the seed by that rule (no data.val_source, no val/
    folder of the data's own, not a node-level graph's masks, whose draw did not change), one warning: most
    items held out today were trained on under the earlier split, and val/ figures would silently measure memorising.
    Never refused: an earlier ONN's checkpoint still loads, evaluates and resumes."""
    if saved.get("held_out_rule") == HELD_OUT_RULE:
        return True
    if draws:
        log.warning(
            "ckpt %s: its validation split was drawn by an earlier ONN (by position), this one draws it by name, so "
            "its val/ figures may include items it trained on; retrain it, or give a data.val_source",
            ckpt,
        )
    return False


def memory_budget_mb(device: torch.device) -> float:
    """Half of the free device memory, or a third of the available host memory."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free / MB / 2
    import psutil

    return psutil.virtual_memory().available / MB / 3


class ClassificationData(L.LightningDataModule):
    """train / val / test splits of a classification dataset, resident on `device` or streamed.

    Subclasses read their modality's sources: `read(source, key)` -> {split: Decoded} (splits named
    train / val / test / all), and for streaming `list_items(source)` -> {split: Items} and
    `item_mb(items)`, the decoded size of one item."""

    item_kind = "items"  # what the messages call its items ("audio files", ...)
    # a classifier learns two classes or more; 1 where a checkpoint's classes are known (task=eval of a folder of
    # some of them)
    min_classes = 2
    # whether setup drew the val split from the seed by HELD_OUT_RULE (not a val/ folder, pattern or val_source):
    # only then is an earlier ONN's checkpoint validated on another split than its own (drawn_by_name)
    held_out_by_name = False

    def __init__(self, data_cfg: SplitData, cache_dir: str, device: str | torch.device = "cpu", seed: int = 0):
        super().__init__()
        self.cfg, self.cache_dir, self.seed = data_cfg, cache_dir, seed
        self.device = torch.device(device)
        self.batch_size = int(data_cfg.batch_size)
        self.eval_batch_size = eval_batch(data_cfg)
        self.splits: dict[str, Split] = {}
        self.classes: list[str] = []
        self.streamed: dict[str, tuple[Items, list[int]]] | None = None
        self.skipped: list[str] = []
        self.untrained: str | None = None  # said when training starts (train_dataloader): eval trains nothing
        self.scored_on_training: list[str] = []  # data.val_source/test_source whose split is the training data

    # -- what a modality supplies ---------------------------------------------------------------
    def read(self, source: str, key: str) -> dict[str, Decoded]:
        raise NotImplementedError

    def list_items(self, source: str) -> dict[str, Items]:
        raise UserError(f"data.source {source}: this data cannot be streamed; set data.resident=true.")

    def item_mb(self, items: Items) -> float:
        """The decoded size of one item: the first of the first few that decode. An undecodable first item sized the
        whole dataset as 0 MB, and a folder far over data.resident_max_mb was decoded into memory whole."""
        for i in range(min(len(items), SIZED_TRIES)):
            sample = items.load(i)
            if sample is not None:
                return sample.numel() * sample.element_size() / MB
        return 0.0

    # -- what the model needs to know -------------------------------------------------------------
    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def input_shape(self) -> tuple[int, ...]:
        if self.streamed:
            items, index = self.streamed["train"]
            return tuple(items.load(index[0]).shape)
        return tuple(self.splits["train"].inputs.shape[1:])

    def setup(self, stage: str | None = None) -> None:
        if self.splits or self.streamed:
            return
        source = self.cfg.source
        if not source:
            raise UserError(
                "data.source is not set: point it at your copy of the dataset (the data config's comment shows "
                "the layouts)."
            )
        source = str(source)
        if self._too_big(source):
            self._setup_streamed(source)
        else:
            self._setup_resident(source)
        if self.num_classes < self.min_classes:
            raise UserError(
                f"data.source {source} has {self.num_classes} class ({', '.join(self.classes) or 'none'}): "
                "a classifier needs two or more; add the other classes' folders (or files)."
            )

    def _too_big(self, source: str) -> bool:
        """Whether the decoded dataset would exceed data.resident_max_mb (resident: auto)."""
        resident = self.cfg.resident
        if resident in (True, "true"):
            return False
        if resident in (False, "false"):
            return True
        budget = self.cfg.resident_max_mb
        if budget in (None, "auto"):
            budget = memory_budget_mb(self.device)
        try:
            items = self.list_items(source)
        except UserError:
            return False  # no random access (e.g. .tar.gz): decoded whole
        count = sum(len(v) for v in items.values())
        if not count:
            return False
        decoded_mb = count * self.item_mb(next(v for v in items.values() if len(v)))
        if decoded_mb > float(budget):
            log.info(
                "data: %.0f MB decoded is over the %.0f MB budget: streaming from %s",
                decoded_mb,
                float(budget),
                source,
            )
            return True
        return False

    def _setup_resident(self, source: str) -> None:
        sets = self.read(source, "data.source")
        for split, other in (("val", self.cfg.val_source), ("test", self.cfg.test_source)):
            if other:
                found = self.read(str(other), f"data.{split}_source")
                scores_all = split == "val" and str(other) == source  # task=eval of a given data.source
                sets[split] = every_split(found) if scores_all else split_of(found, split)
                trained = split_of(found, "train", fallback=False)  # the very items trained on, when other is source
                if same_path(str(other), source) and (scores_all or sets[split] is trained):
                    self.scored_on_training.append(f"data.{split}_source")
        for split, pattern in self._patterns().items():
            sets = held_out_by_name(sets, split, pattern)
        train = split_of(sets, "train", fallback=False)
        if train is None and str(self.cfg.val_source or "") == source:  # task=eval of a folder of test/ alone
            train = sets["train"] = sets["val"]  # (its classes and shape, as a source without split folders gives)
        if train is None:
            raise UserError(f"data.source={source} has no training data (found splits: {', '.join(sets)}).")
        self.classes = class_order(train.classes, self.cfg)
        sets = {
            k: relabel(v, self.classes, "data.source" if k in ("train", "all") else f"data.{k}_source")
            for k, v in sets.items()
        }
        self._check_labels(sets)
        self.skipped = [s for v in sets.values() for s in v.skipped]
        splits = {
            k: Split(v.inputs, v.labels, v.names) for k, v in sets.items() if k in ("train", "val", "test", "all")
        }
        if "train" not in splits:
            splits["train"] = splits.pop("all")
        if "val" not in splits:
            splits["train"], splits["val"] = self._hold_out(splits["train"])
        self.untrained = untrained_classes(self.classes, {k: v.labels for k, v in splits.items()})
        shapes = {k: tuple(v.inputs.shape[1:]) for k, v in splits.items()}
        if len(set(shapes.values())) > 1:
            raise UserError(f"data.source={source}: splits have different shapes {shapes}; {self.same_shape_hint}.")
        self.splits = {k: Split(v.inputs.to(self.device), v.labels.to(self.device), v.names) for k, v in splits.items()}
        sizes = ", ".join(f"{k} {len(v)}" for k, v in self.splits.items())
        mb = sum(v.inputs.numel() * v.inputs.element_size() for v in self.splits.values()) / MB
        log.info(
            "data: %s, %s, %d classes, %.0f MB on %s",
            sizes,
            "x".join(map(str, shapes["train"])),
            self.num_classes,
            mb,
            self.device,
        )

    same_shape_hint = "bring every item to one shape (see the data config)"

    def _patterns(self) -> dict[str, str]:
        """data.val_pattern / data.test_pattern where set (labelled files: audio, video)."""
        if not isinstance(self.cfg, LabelledFiles):
            return {}
        given = {"val": self.cfg.val_pattern, "test": self.cfg.test_pattern}
        return {split: str(pattern) for split, pattern in given.items() if pattern}

    def _setup_streamed(self, source: str) -> None:
        scores_all = str(self.cfg.val_source or "") == source  # task=eval of a given data.source: all of it is val
        if (self.cfg.val_source and not scores_all) or self.cfg.test_source or self._patterns():
            raise UserError(
                "a streamed dataset takes its splits from data.source: unset data.val_source/test_source "
                "and data.val_pattern/test_pattern, or set data.resident=true."
            )
        items = self.list_items(source)
        good = self._decodable(items, source)
        name = next((n for n in ("train", "all") if good.get(n)), None)
        if name is None and scores_all:  # task=eval of a folder of test/ alone: all of it is val
            name = next(iter(good), None)
        if name is None:
            raise UserError(f"data.source={source} has no training data (found splits: {', '.join(items)}).")
        train = items[name]
        self.classes = class_order(train.classes, self.cfg)
        for split in items.values():  # by class name, as the resident path labels them (relabel)
            split.labels = relabelled(torch.as_tensor(split.labels), split.classes, self.classes, "data.source")
            split.classes = list(self.classes)
        index = good[name]
        self.streamed = {}
        if scores_all:  # every split of it, its train/ and test/ folders alike, as the resident path's every_split
            self.scored_on_training.append("data.val_source")
            joined = JoinedItems([(items[k], good[k]) for k in good])
            self.streamed["val"] = (joined, list(range(len(joined))))
        elif "val" in good:
            self.streamed["val"] = (items["val"], good["val"])
        else:  # held out of the items that decode, as the resident path holds out of those it decoded
            kept, val = self._held_out(torch.as_tensor(train.labels)[index], [train.names[i] for i in index])
            index, self.streamed["val"] = [index[i] for i in kept], (train, [index[i] for i in val])
        self.streamed["train"] = (train, index)
        if "test" in good:
            self.streamed["test"] = (items["test"], good["test"])
        self.untrained = untrained_classes(
            self.classes, {k: torch.as_tensor(v.labels)[kept] for k, (v, kept) in self.streamed.items()}
        )

    def _decodable(self, items: dict[str, Items], source: str) -> dict[str, list[int]]:
        """{split: the indices of its items that decode}, splits of which none does left out. Each item is decoded
        once (in data.num_workers workers): the others are skipped, counted and named as a resident read's are, and
        more than data.max_bad_fraction of them refuse the run; no item stands in for another (val and test would
        count it twice)."""
        pairs = [(split, i) for split, listed in items.items() for i in range(len(listed))]
        log.info("data: checking that the %d streamed items of %s decode", len(pairs), source)
        loader = torch.utils.data.DataLoader(
            Decodes(items, pairs), batch_size=64, num_workers=int(self.cfg.num_workers), collate_fn=list
        )
        decodes = [found for batch in loader for found in batch]
        self.checked(items, [found for found in decodes if decoded(found)])
        refused = [s for listed in items.values() for s in getattr(listed, "refused", [])]
        failed = [(items[split].names[i], found) for (split, i), found in zip(pairs, decodes) if not decoded(found)]
        said = [name + (f": {found.why}" if isinstance(found, Undecodable) else "") for name, found in failed]
        total = len(refused) + len(pairs)
        check_bad(refused + said, total, float(self.cfg.max_bad_fraction), source, "data.source", self.item_kind)
        self.skipped = refused + [name for name, _ in failed]
        good: dict[str, list[int]] = {}
        for (split, i), found in zip(pairs, decodes):
            if decoded(found):
                good.setdefault(split, []).append(i)
        return good

    def checked(self, items: dict[str, Items], found: list[Any]) -> None:
        """What the pass over every streamed item found of those that decode (Decodes); a modality may settle its
        items' settings by it (images: colour anywhere makes every item colour)."""

    def _check_labels(self, sets: dict[str, Decoded]) -> None:
        n = len(self.classes)
        for name, s in sets.items():
            bad = ((s.labels < 0) | (s.labels >= n)).nonzero()
            if len(bad):
                i = int(bad[0])
                raise UserError(
                    f"{s.names[i]} in data.source ({name} split) has label {int(s.labels[i])}, "
                    f"outside the {n} classes; fix the label or set data.num_classes."
                )

    def _check_val_split(self, n: int) -> None:
        """Refuse a data.val_split that is no fraction, or one that leaves n items nothing to train on."""
        fraction = val_fraction(self.cfg.val_split)
        if max(1, round(n * fraction)) >= n:
            raise UserError(f"data.source has {n} training items: too few to hold out a validation split.")

    def _hold_out(self, train: Split) -> tuple[Split, Split]:
        kept, val = self._held_out(train.labels, train.names)
        return train.subset(torch.tensor(kept, dtype=torch.long)), train.subset(torch.tensor(val, dtype=torch.long))

    def _held_out(self, labels: torch.Tensor, names: list[str]) -> tuple[list[int], list[int]]:
        """(train, val) indices: each item is held out when its held_out_share (a hash of the seed and its name) is
        under data.val_split, so one seed holds out the same items however many others are added, removed or fail to
        decode (a seeded shuffle of positions re-drew the split then: a resumed run or task=eval validated on items
        it had trained on). The model trains on every class it is validated on: a class drawn into val whole keeps
        its highest-drawn item (a class folder of one file was, for some seeds, validated on only). At least one item
        is held out: when none drew under val_split, the lowest-drawn of a class that keeps another; where every
        class has one item, none can be held out without its class, and the lowest-drawn goes (said as untrained)."""
        self._check_val_split(len(labels))
        share = [held_out_share(self.seed, name) for name in names]
        self.held_out_by_name = True
        return held_out_indices(labels.tolist(), share, float(self.cfg.val_split))

    # -- loaders ----------------------------------------------------------------------------------
    def train_dataloader(self):
        if self.untrained:  # said once, by the task that trains (task=eval scores a model trained elsewhere)
            log.warning(self.untrained)
            self.untrained = None
        if self.scored_on_training:  # task=eval of a given data.source sets data.val_source to it, and trains nothing
            log.warning(
                "%s is data.source itself (%s): the model is scored on the items it trains on, so those figures "
                "measure memorising, not held-out accuracy; unset it to hold out data.val_split of data.source, "
                "or point it at other data",
                " and ".join(self.scored_on_training),
                self.cfg.source,
            )
            self.scored_on_training = []
        if self.streamed:
            if self.cfg.batch_groups:
                raise UserError(
                    "data.batch_groups draws batches from data held in memory, "
                    "and this data is streamed (too big to hold): "
                    "set data.batch_groups=null, or raise data.resident_max_mb."
                )
            return self._loader("train", shuffle=True)
        train = self.splits["train"]
        rank, world = self._ranks()
        return ResidentBatches(
            train,
            self.batch_size,
            shuffle=True,
            seed=self.seed,
            drop_last=True,
            groups=batch_groups(train.names, self.cfg.batch_groups),
            # resumed runs continue the epoch sequence: the trainer's epoch is restored after this is called
            epoch_of=(lambda: self.trainer.current_epoch) if self.trainer is not None else None,
            rank=rank,
            world=world,
        )

    def val_dataloader(self):
        if self.streamed:
            return self._loader("val", shuffle=False)
        return self._evaluated("val")

    def test_dataloader(self):
        if self.streamed:
            return self._loader("test", shuffle=False) if "test" in self.streamed else []
        return self._evaluated("test") if "test" in self.splits else []

    def _evaluated(self, split: str) -> ResidentBatches:
        """A held-out split's batches: under DDP this process's share of them (evaluated_ranks)."""
        rank, world = evaluated_ranks(self.trainer, split)
        return ResidentBatches(self.splits[split], self.eval_batch_size, shuffle=False, rank=rank, world=world)

    def _ranks(self) -> tuple[int, int]:
        return trainer_ranks(self.trainer)

    def _fit_epoch(self) -> int:
        """The epoch training is in or about to start, as Lightning gives a sampler's set_epoch (its fit loop's count of
        epochs processed): trainer.current_epoch counts completed ones, and a run restored at an epoch's end is still in
        it by that count."""
        return self.trainer.fit_loop.epoch_progress.current.processed

    def has_test(self) -> bool:
        return "test" in (self.streamed or self.splits)

    def _loader(self, split: str, shuffle: bool):
        items, index = self.streamed[split]
        workers = int(self.cfg.num_workers)
        share = -(-len(index) // self._ranks()[1])  # this process's samples under Lightning's DistributedSampler
        # training: stateful, so Lightning keeps the shuffle's place in the checkpoint and a resumed run goes on
        # where it stopped, in the unbroken run's order (EpochShuffle)
        loader = StreamedLoader if shuffle else torch.utils.data.DataLoader
        epoch_of = self._fit_epoch if self.trainer is not None else None  # without one, each pass is the next epoch
        return loader(
            StreamedItems(items, index),
            batch_size=self.batch_size if shuffle else self.eval_batch_size,
            sampler=EpochShuffle(len(index), self.seed, epoch_of) if shuffle else None,
            drop_last=shuffle and share >= self.batch_size,  # a share smaller than a batch is one batch
            num_workers=workers,
            persistent_workers=workers > 0,
            pin_memory=self.device.type == "cuda",
            generator=torch.Generator().manual_seed(self.seed),
        )
