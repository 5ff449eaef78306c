"""The streamed text dataset and its loader (see streaming.py): a seeded buffer shuffle over a reader, and
torchdata's StatefulDataLoader, whose state Lightning keeps in every checkpoint."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from onn.errors import UserError
from onn.modalities.text.streaming import Ref, file_signature


class ShuffledStream(IterableDataset):
    """torch IterableDataset over a reader from `start`: `rows` records, a seeded buffer shuffle, each
    record encoded when drawn. `keep`: whether a record is trained on (one whose answer is empty, or held out, is
    not); `rows` counts the kept records only, and workers take every n-th kept record, so each worker's share, and
    so the epoch's length, is exact. `epoch` is set by StreamLoader. `signature`: the file's size and time when the run
    began, which a checkpoint's position into it is only valid for. `holds_out`: `keep` leaves out a held-out split
    drawn by each record's content (a checkpoint of an earlier ONN, which held out the file's first records, cannot
    resume it)."""

    def __init__(
        self,
        reader,
        start: Ref,
        rows: int,
        buffer: int,
        seed: int,
        encode: Callable[[dict, str], Any],
        keep: Callable[[dict, str], bool],
        holds_out: bool = False,
    ):
        self.reader, self.start, self.rows, self.buffer = reader, list(start), rows, max(1, int(buffer))
        self.seed, self.encode, self.keep, self.epoch = seed, encode, keep, 0
        self.holds_out = holds_out  # whether `keep` leaves out the records drawn into the held-out split
        self.signature = file_signature(reader.path)

    def __iter__(self) -> _Stream:
        info = get_worker_info()
        return _Stream(self, self.epoch, *((info.id, info.num_workers) if info else (0, 1)))


class _Stream:
    def __init__(self, ds: ShuffledStream, epoch: int, worker: int, workers: int):
        self.ds, self.epoch, self.worker, self.workers = ds, epoch, worker, workers
        self.rng = np.random.Generator(np.random.PCG64([ds.seed, epoch, worker]))
        self.at, self.index = list(ds.start), 0  # the next record's position, kept records read so far
        self.buffer: list[tuple[Ref, dict[str, Any], str]] = []
        self.draining = False
        self._records: Iterator | None = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "worker": self.worker,
            "workers": self.workers,
            "at": self.at,
            "index": self.index,
            "buffer": [ref for ref, _, _ in self.buffer],
            "draining": self.draining,
            "rng": self.rng.bit_generator.state,
            "counts": "kept",  # `index` counts kept records; a state without this counted every record read
            "held": "drawn",  # held-out records drawn by content (a state without this held out the first ones)
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["worker"], state["workers"]) != (self.worker, self.workers):
            raise UserError(
                f"the checkpoint's data stream ran with data.num_workers={state['workers']}; "
                "resume with the same data.num_workers."
            )
        if "held" not in state and self.ds.holds_out:  # its epoch counted the records this one holds out
            raise UserError(
                f"this checkpoint's data stream was saved by an earlier ONN, which held out the first records of "
                f"{self.ds.reader.path}; this one holds out records drawn by their content, so it would train on "
                "records it now validates on: train from the start without ckpt=, or give data.val_source."
            )
        if "counts" not in state and self.workers > 1 and self.ds.reader.count(self.ds.start) != self.ds.rows:
            raise UserError(
                f"this checkpoint's data stream was saved before ONN left out records with an empty answer in "
                f"{self.ds.reader.path}, so its workers would split the rest of the epoch differently; resume with "
                "data.num_workers=0 or 1, or train from the start without ckpt=."
            )
        self.epoch, self.at, self.index = state["epoch"], list(state["at"]), state["index"]
        self.draining = state["draining"]
        self.rng.bit_generator.state = state["rng"]
        refs = [list(r) for r in state["buffer"]]
        self.buffer = [(ref, record, where) for ref, (record, where) in zip(refs, self.ds.reader.fetch(refs))]
        self._records = None

    def _next_record(self) -> tuple[Ref, dict[str, Any], str] | None:
        if self._records is None:
            self._records = self.ds.reader.records(self.at)
        for ref, after, record, where in self._records:
            self.at = after
            if not self.ds.keep(record, where):  # skipped by every worker alike: counted out of `rows` at setup
                continue
            mine = self.index % self.workers == self.worker
            self.index += 1
            if mine:
                return ref, record, where
        return None

    def __iter__(self) -> _Stream:
        return self

    def __next__(self):
        if not self.draining:
            while (item := self._next_record()) is not None:
                if len(self.buffer) < self.ds.buffer:
                    self.buffer.append(item)
                    continue
                slot = int(self.rng.integers(self.ds.buffer))
                out, self.buffer[slot] = self.buffer[slot], item
                return self.ds.encode(out[1], out[2])
            self.draining = True
            self.rng.shuffle(self.buffer)
        if self.buffer:
            _, record, where = self.buffer.pop()
            return self.ds.encode(record, where)
        raise StopIteration


def batches_per_epoch(rows: int, batch_size: int, num_workers: int) -> int:
    """Each worker batches its own records (every n-th), so the last batch of each may be short."""
    workers = max(1, num_workers)
    return sum(math.ceil(len(range(w, rows, workers)) / batch_size) for w in range(workers))


def check_resume(state: dict[str, Any], dataset: ShuffledStream, num_workers: int) -> None:
    """A checkpoint's loader state (StreamLoader.state_dict) fits this run's stream: the same data.num_workers, and
    the same file, unchanged (its positions are byte offsets and row numbers: an edited file would be read from
    the wrong places, as records the first run never had or as "not valid JSON"). A checkpoint written before ONN
    saved the file's signature is not checked for it."""
    workers = state.get("onn_workers")
    if workers != num_workers:
        raise UserError(
            f"the checkpoint's data stream ran with data.num_workers={workers}; resume with the same "
            f"data.num_workers (not {num_workers})."
        )
    saved = state.get("onn_source")
    if saved is not None and list(saved) != dataset.signature:
        raise UserError(
            f"data.source {dataset.reader.path} changed since the checkpoint was written (its size or modification "
            "time is not the streamed file's; a copy keeps them with cp -p or rsync -a): restore that file, or train "
            "from the start without ckpt=."
        )


def own_generator(seed: int) -> torch.Generator:
    """A loader's own generator: each iterator a DataLoader starts draws its workers' base seed from it, and without
    one from torch's global generator, which dropout draws from too. A resumed run starts an iterator the unbroken
    run did not (and a run validating where the other did not, another), so its dropout masks came out otherwise."""
    return torch.Generator().manual_seed(int(seed))


def stream_loader(dataset: ShuffledStream, batch_size: int, collate_fn, num_workers: int, pin_memory: bool):
    """A StatefulDataLoader with an exact length (so Lightning does not fetch a batch ahead, which would
    put the saved position one batch past the last trained one) and an epoch counter in its state."""

    class StreamLoader(StatefulDataLoader):
        def __init__(self):
            super().__init__(
                dataset,
                batch_size=batch_size,
                collate_fn=collate_fn,
                num_workers=num_workers,
                pin_memory=pin_memory,
                generator=own_generator(dataset.seed),
            )
            self.next_epoch = 0

        def __len__(self) -> int:
            return batches_per_epoch(dataset.rows, batch_size, num_workers)

        def __iter__(self):
            dataset.epoch, self.next_epoch = self.next_epoch, self.next_epoch + 1
            return super().__iter__()

        def state_dict(self) -> dict[str, Any]:
            own = {"onn_epoch": dataset.epoch, "onn_workers": num_workers, "onn_source": dataset.signature}
            return {**super().state_dict(), **own}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            check_resume(state, dataset, num_workers)
            self.next_epoch = state["onn_epoch"]
            super().load_state_dict(
                {k: v for k, v in state.items() if k not in ("onn_epoch", "onn_workers", "onn_source")}
            )

    return StreamLoader()
