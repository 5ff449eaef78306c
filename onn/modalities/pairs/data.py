"""Paired datasets for Lightning: both sides decoded once, cached, held on the device, split seeded.

The pairs found in data.source (detect.find_pairs) are decoded by their sides (sides.build_side):
files through their modality's own reader, captions through the text side. A pair whose either half
cannot be decoded is dropped and named; the run fails when more than data.max_bad_fraction of the
complete pairs are. The decoded tensors are cached as safetensors (onn.data.cache: one "split" per
side, the pair's index as its label), and a seeded data.val_split of the pairs is held out: the
retrieval metrics are measured on those (task=eval of a data.source given on the command line: on all of them).
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
from collections import Counter
from pathlib import Path

import lightning as L
import torch

from onn.config import ONNConfig, as_dict
from onn.config.data import PairsData, eval_batch
from onn.data.cache import cached_decode
from onn.data.files import content_digest, file_key, iter_members, read_file
from onn.data.resident import Decoded, ResidentBatches, Split, held_out_share
from onn.errors import UserError
from onn.modalities.base import PairSide
from onn.modalities.pairs.detect import Entry, Listing, find_pairs
from onn.modalities.pairs.sides import TEXT
from onn.modalities.registry import get as modality
from onn.training.trainer import processes

log = logging.getLogger("onn")
MIN_PAIRS = 4  # two to train on, two to hold out


def materialize(entries: list[Entry], stage: Path) -> list[Path | str]:
    """What a side reads: files as they are, captions as their text, tar members written under stage (a caption
    member from the bytes the listing read, which key the cache: a later rewrite of the shard is not decoded)."""
    out: list[Path | str] = []
    wanted: dict[Path, dict[str, int]] = {}
    for i, entry in enumerate(entries):
        out.append(entry.path if entry.path is not None else entry.text if entry.text is not None else Path())
        if entry.data is not None:
            caption = stage / f"{i:07d}{Path(entry.member or '').suffix.lower()}"
            caption.write_bytes(entry.data)
            out[i] = caption
        elif entry.shard is not None:
            wanted.setdefault(entry.shard, {})[entry.member] = i
    for shard, members in wanted.items():
        for member in iter_members(shard):  # one pass per shard, in stored order
            i = members.get(member.raw)
            if i is None:
                continue
            target = stage / f"{i:07d}{Path(member.raw).suffix.lower()}"
            with member.open() as f:
                target.write_bytes(f.read())
            out[i] = target
    return out


def decode_pairs(
    listing: Listing, sides: dict[str, PairSide], max_bad_fraction: float, source: str
) -> dict[str, Decoded]:
    """{side: Decoded} of the complete pairs both sides could read, aligned; labels are the pairs' indices."""
    n = listing.complete
    kept = set(range(n))
    stored, skipped = {}, []
    with tempfile.TemporaryDirectory(prefix="onn-pairs-") as stage:
        for name, side in sides.items():
            (Path(stage) / name).mkdir()
            items = materialize(listing.entries[name], Path(stage) / name)
            tensor, index, bad = side.read(items)
            stored[name] = (tensor, index)
            kept &= set(index)
            skipped += [f"{listing.entries[name][i].name}: {reason}" for i, reason in bad]
    if n - len(kept) > max_bad_fraction * n or not kept:
        raise UserError(
            f"data.source {source}: {n - len(kept)} of {n} pairs cannot be read (first: {'; '.join(skipped[:3])}); "
            f"fix or remove them, or set data.max_bad_fraction (now {max_bad_fraction}) to accept more."
        )
    if skipped:
        log.warning(
            "pairs: %d of %d pairs left out, a half could not be read: %s%s",
            n - len(kept),
            n,
            "; ".join(skipped[:3]),
            " ..." if len(skipped) > 3 else "",
        )
    order = sorted(kept)
    out = {}
    for name, (tensor, index) in stored.items():
        row = {pair: r for r, pair in enumerate(index)}
        out[name] = Decoded(
            tensor[[row[i] for i in order]],
            torch.tensor(order, dtype=torch.long),
            list(sides),
            [listing.keys[i] for i in order],
            skipped if not out else [],
        )
    return out


def named_files_digest(listing: Listing) -> str:
    """A digest of the files a listing's entries name, by file_key as content_digest keys a folder:
    a replaced image changes it where the metadata file naming it does not change. A shard's caption by its bytes:
    a shard rewritten with a caption changed keeps its size (tar pads members to 512 bytes), and often its mtime."""
    h = hashlib.sha256()
    for entries in listing.entries.values():
        for entry in entries:
            if entry.path is not None:
                h.update(file_key(entry.name, entry.path).encode())
            elif entry.data is not None:
                h.update(f"{entry.name}\0{len(entry.data)}\0".encode() + entry.data)
            elif entry.digest is not None:  # a long text member, by the sha256 its listing streamed
                h.update(f"{entry.name}\0sha256:{entry.digest}\0".encode())
    return h.hexdigest()


def side_keys(listing: Listing, pairs: list[int]) -> list[list[int]]:
    """Per pair (listing indices `pairs`), a number per side: its file's, shared by the pairs that name that file,
    or its text's, shared by the pairs whose caption or .txt file reads the same (as the text side reads it: space
    runs as one). Retrieval counts right for each other the pairs that share a side's number (an image's several
    captions, a picture's several meshes, two photos both captioned "a dog": the query cannot tell them apart, and
    its twin retrieved was counted a miss), never further: a-x, b-x, b-y leave a's right answer x, not b's y."""
    numbers: dict[tuple[str, str, str], int] = {}
    keys = []
    for i in pairs:
        entries = [(m, listing.entries[m][i]) for m in listing.modalities]
        keys.append([numbers.setdefault((m, *identity(m, e)), len(numbers)) for m, e in entries])
    return keys


def identity(modality: str, entry: Entry) -> tuple[str, str]:
    """What makes two items of a side one answer: a text's words (a caption, a .txt file's or shard member's), else
    the file."""
    text = entry.text
    if text is None and modality == TEXT and (entry.path is not None or entry.data is not None):
        try:
            text = (entry.data if entry.data is not None else read_file(entry.path)).decode("utf-8-sig")
        except (OSError, UnicodeDecodeError):  # left out of the pairs when decoded: its name will do
            text = None
    if text is None and entry.digest is not None:  # a long shard text member: the same bytes, the same answer
        return ("sha256", entry.digest)
    return ("text", " ".join(text.split())) if text is not None else ("file", entry.name)


def joined_groups(listing: Listing, pairs: list[int]) -> list[int]:
    """Per pair, a number shared by the pairs a file joins, however far (a-x, b-x, b-y: one group): held out
    together, as pairs that share one file of two were split apart and the held-out picture trained on; -1 for a pair
    whose files no other pair names. Not retrieval's right answers (side_keys)."""
    import numpy as np
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    files: dict[str, int] = {}  # a file's node, after the pairs' nodes
    edges = [
        (position, len(pairs) + files.setdefault(entry.name, len(files)))
        for position, i in enumerate(pairs)
        for entry in (listing.entries[m][i] for m in listing.modalities)
        if entry.text is None
    ]
    nodes = len(pairs) + len(files)
    rows, columns = (np.array(side, dtype=np.int64) for side in zip(*edges)) if edges else ([], [])
    graph = coo_matrix((np.ones(len(edges)), (rows, columns)), shape=(nodes, nodes))
    component = connected_components(graph, directed=False)[1][: len(pairs)].tolist()
    sizes = Counter(component)
    numbers = {c: n for n, c in enumerate(dict.fromkeys(c for c in component if sizes[c] > 1))}
    return [numbers.get(c, -1) for c in component]


def pair_names(listing: Listing, pairs: list[int]) -> list[str]:
    """Per pair (listing indices `pairs`), the name its held-out draw hashes: the least name of its files (a shard's
    member: shard.tar/member), which pairs added or removed elsewhere leave alone; not its listing key, which for a
    metadata row is its line number (a row added above moves it). Its key only where neither half is a file."""
    names = []
    for i in pairs:
        files = sorted(e.name for e in (listing.entries[m][i] for m in listing.modalities) if e.text is None)
        names.append(files[0] if files else listing.keys[i])
    return names


class PairData(L.LightningDataModule):
    """The held-out split and the training pairs of a paired source, resident on `device`.

    A batch is (side A's items, side B's items), row i of one the partner of row i of the other; the
    partner side rides in ResidentBatches' second tensor, which is index-selected like the first."""

    def __init__(
        self, config: ONNConfig, sides: dict[str, PairSide], device: str | torch.device = "cpu", whole: bool = False
    ):
        super().__init__()
        self.whole = whole  # every pair is held out (task=eval of a data.source): no training split
        self.cfg: PairsData = config.data
        self.sides = sides
        self.cache_dir, self.seed = config.paths.cache, config.seed
        self.device = torch.device(device)
        self.batch_size = self.cfg.batch_size
        self.eval_batch_size = eval_batch(self.cfg)
        self.listing: Listing | None = None
        self.splits: dict[str, Split] = {}
        self.skipped: list[str] = []
        self.val_groups: torch.Tensor | None = None  # [held-out pairs, 2]: per side, its file's number (side_keys)
        self.planned_world = processes(config)  # the processes the trainer will run (Lightning's world size)

    @property
    def names(self) -> list[str]:
        return list(self.sides)

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        source = self.cfg.source
        if not source:
            raise UserError("data.source is not set: point it at a folder of paired files (see conf/data/pairs.yaml).")
        listing = find_pairs(source, self.names, self.cfg.text_column)
        self.listing = listing
        (log.warning if listing.orphan_count else log.info)("pairs: %s", listing.summary())
        least = 2 if self.whole else MIN_PAIRS  # retrieval among one pair measures nothing
        if listing.complete < least:
            raise UserError(f"data.source {source}: {listing.summary()}; at least {least} complete pairs are needed.")
        path = Path(str(source)).expanduser()
        key = {
            "digest": content_digest(path),
            "how": listing.how,  # the metadata's columns: another data.text_column read the cached captions
            "keys": listing.keys,
            "sides": {n: as_dict(s.config.data) for n, s in self.sides.items()},
            # each side's reader: a decode that changed (EXIF orientation, transparency) is not read from before it
            "readers": {n: modality(s.name).reader_version() for n, s in self.sides.items()},
            # the files themselves: a metadata file's sit beside it, outside its own digest, or in a hidden folder
            # (.images/) that a folder's digest passes over, and a replaced image was read from the cache
            "named": named_files_digest(listing),
        }
        bad = self.cfg.max_bad_fraction
        decoded = cached_decode(
            "pairs",
            key,
            self.cache_dir,
            lambda: decode_pairs(listing, self.sides, bad, str(source)),
            str(source),
        )
        self.skipped = [s for d in decoded.values() for s in d.skipped]
        a, b = (decoded[n] for n in self.names)
        order = a.labels.tolist()
        splits = self._split(
            Split(a.inputs, b.inputs, a.names),
            joined_groups(listing, order),
            side_keys(listing, order),
            pair_names(listing, order),
        )
        self.splits = {k: Split(v.inputs.to(self.device), v.labels.to(self.device), v.names) for k, v in splits.items()}
        log.info(
            "pairs: %d training and %d held-out %s pairs on %s",
            len(self.splits["train"]),
            len(self.splits["val"]),
            "-".join(self.names),
            self.device,
        )

    def _split(self, pairs: Split, groups: list[int], keys: list[list[int]], names: list[str]) -> dict[str, Split]:
        """{train, val}: a seeded data.val_split of the pairs held out, or all of them (whole). Pairs that share a file
        (`groups`: an image on five metadata rows, one a caption) are held out together: split apart, the held-out
        figures would be on images the model trained on. Each group, and each pair of its own files, is held out when
        the held_out_share of its name (`names`: pair_names; a group's, its members' least) is under data.val_split,
        so one seed holds out the same pairs however many others are added or removed (a seeded shuffle of positions
        re-drew the whole split then: a resumed run or task=eval validated on pairs it had trained on). The held-out
        pairs' val_groups are their `keys` (side_keys): what retrieval counts right for each other."""
        if self.whole:
            self.val_groups = torch.tensor(keys)
            return {"train": pairs.subset(torch.zeros(0, dtype=torch.long)), "val": pairs}
        fraction = self.cfg.val_split
        if not 0 < fraction < 1:
            raise UserError(
                f"data.val_split must be between 0 and 1 (got {fraction}): the held-out pairs measure retrieval."
            )
        group_name: dict[int, str] = {}  # a group's name: its members' least, whichever pair is added to it
        for name, group in zip(names, groups):
            if group >= 0:
                group_name[group] = min(name, group_name.get(group, name))
        units: dict[str, list[int]] = {}  # a group's or a lone pair's name: its pairs
        for i, group in enumerate(groups):
            units.setdefault(group_name[group] if group >= 0 else names[i], []).append(i)
        share = {name: held_out_share(self.seed, name) for name in units}
        order = sorted(units, key=share.__getitem__)
        sizes = [len(units[name]) for name in order]
        held = sum(share[name] < fraction for name in order)
        while held < len(order) and sum(sizes[:held]) < 2:  # two held out at least: the lowest-drawn go
            held += 1
        while held > 1 and sum(sizes[held:]) < 2 and sum(sizes[: held - 1]) >= 2:  # two trained on: the highest stay
            held -= 1
        val = sorted(i for name in order[:held] for i in units[name])
        train = sorted(i for name in order[held:] for i in units[name])
        if len(train) < 2:
            raise UserError(
                f"data.source {self.cfg.source}: its {len(pairs)} pairs share so few files that holding out "
                f"data.val_split={fraction} of them leaves {len(train)} to train on; add pairs or lower data.val_split."
            )
        self.val_groups = torch.tensor([keys[i] for i in val])
        return {
            "train": pairs.subset(torch.tensor(train, dtype=torch.long)),
            "val": pairs.subset(torch.tensor(val, dtype=torch.long)),
        }

    def train_dataloader(self):
        rank, world = self._ranks()
        # a contrastive batch of one pair teaches nothing
        drop_last = -(-len(self.splits["train"]) // world) > self.batch_size
        loader = ResidentBatches(
            self.splits["train"],
            self.batch_size,
            shuffle=True,
            seed=self.seed,
            drop_last=drop_last,
            rank=rank,
            world=world,
        )
        if self.trainer is not None:
            loader.epoch = self.trainer.current_epoch  # resumed runs continue the epoch sequence
        return loader

    def val_dataloader(self):
        # whole on every process, not shared out: recall@k ranks each held-out query against the whole held-out
        # gallery, so each process embeds every held-out pair and logs the one-process figures
        return ResidentBatches(self.splits["val"], self.eval_batch_size, shuffle=False)

    def _ranks(self) -> tuple[int, int]:
        """(this process's rank, the processes): resident batches are no DataLoader, so Lightning gives them no
        DistributedSampler and the training pairs share themselves out. Before the trainer exists, rank 0 of the
        processes the config starts: the training batches counted then (the val_check_interval cap, the
        schedule's length) are one process's share, as every process's is."""
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, self.planned_world)
