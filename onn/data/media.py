"""Listed media files (onn.data.labelled) decoded into tensors: all at once for the resident store, or one
at a time for streaming. The modality brings the decoder: `load(source) -> (tensor, seconds)`, raising its
`bad` exception type for a file it cannot use; such files are skipped, counted and named."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

import numpy as np
import torch

from onn.config.data import LabelledFiles
from onn.data.cache import cached_decode
from onn.data.files import archive_kind, content_digest, existing_source
from onn.data.labelled import (
    Listing,
    MediaFile,
    check_bad,
    kept_class_folder,
    list_labelled,
    report_left_out,
    same_text,
)
from onn.data.resident import ClassificationData, Decoded, Undecodable
from onn.errors import UserError
from onn.hardware.disk import write_text_atomically

log = logging.getLogger("onn")

Loader = Callable[[object], tuple[torch.Tensor, float]]


class BadFile(Exception):
    """A media file that cannot be used; the message says why, in a few words. Readers skip and count it."""


def nonempty(source: str | IO[bytes]) -> str | bytes:
    """A path as given, or a file object's bytes: what a decoder opens. An empty file is a BadFile before any
    decoder sees it (decoders say odd things about zero bytes)."""
    if isinstance(source, str):
        if os.path.getsize(source) == 0:
            raise BadFile("an empty file (0 bytes)")
        return source
    data = source.read()
    if not data:
        raise BadFile("an empty file (0 bytes)")
    return data


def decoder_complaint(e: BaseException) -> str:
    """A decoder's complaint in a few words (FFmpeg's strerror, not the path it adds)."""
    text = getattr(e, "error_string", None) or getattr(e, "strerror", None) or str(e).strip() or type(e).__name__
    return str(text).splitlines()[0].rstrip(".")[:100]


def _as_given(source: str, data_cfg: LabelledFiles, cache_dir) -> str:
    return os.path.expanduser(str(source))


@dataclass(frozen=True)
class MediaReader:
    """A media modality's decoding, which its datasets, inference and task=bench_media use: listing a source's
    files, decoding them all (no cache), or through the decoded-tensor cache, or one split item by item."""

    kind: str  # "audio", "video": the messages' word and the cache's name
    suffixes: tuple[str, ...]  # the files it reads
    load: Callable  # (file source, fit) -> (stored tensor, seconds): one file
    settings: Callable  # data config (AudioData, VideoData) -> the decoding settings (Fit)
    fit: Callable  # inputs -> the decoding settings a checkpoint's inputs hold
    bad: type[Exception]  # what `load` raises for a file it cannot use
    dtype: torch.dtype  # the stored dtype
    hint: str  # what data.source should be, for the message when it is missing
    resolve: Callable = _as_given  # (source, data_cfg, cache_dir) -> its path (a generated dataset is made here)
    version: int = 1  # raised when `load` gives other tensors for the same file: caches of before are not read

    def listing(
        self, source: str, data_cfg: LabelledFiles, key: str, allow_unlabelled: bool = False, known: Sequence[str] = ()
    ) -> Listing:
        """The files of `source`; `known`: a checkpoint's classes, which with data.classes tell a folder of one
        class folder from an archive's wrapper folder (list_labelled)."""
        return list_labelled(
            source,
            self.suffixes,
            label_from=data_cfg.label_from,
            label_column=data_cfg.label_column,
            kind=self.kind,
            key=key,
            allow_unlabelled=allow_unlabelled,
            known=[*known, *(data_cfg.classes or [])],
        )

    def read(
        self,
        source: str,
        data_cfg: LabelledFiles,
        fit,
        key: str = "data.source",
        allow_unlabelled: bool = False,
        workers: int = 1,
        known: Sequence[str] = (),
    ) -> tuple[dict[str, Decoded], float]:
        """{split: Decoded} of a source and the seconds of media decoded, from the files (no cache)."""
        found = self.listing(source, data_cfg, key, allow_unlabelled, known)
        return decode_listing(
            found,
            functools.partial(self.load, fit=fit),
            self.bad,
            dtype=self.dtype,
            max_bad_fraction=float(data_cfg.max_bad_fraction),
            path=source,
            key=key,
            kind=self.kind,
            workers=workers,
        )

    def read_cached(
        self,
        source: str,
        data_cfg: LabelledFiles,
        cache_dir,
        key: str = "data.source",
        fit=None,
        known: Sequence[str] = (),
    ) -> dict[str, Decoded]:
        """{split: Decoded} for a source, decoded once and then read from the safetensors cache. `fit`: the
        decoding settings (a checkpoint's), in place of the data config's."""
        path = self.resolve(source, data_cfg, cache_dir)
        existing_source(path, key, self.hint)
        fit = fit or self.settings(data_cfg)
        settings = {
            **({"reader": self.version} if self.version > 1 else {}),  # (version 1 kept the keys of before)
            "fit": asdict(fit),
            "label_from": data_cfg.label_from,
            "label_column": data_cfg.label_column,
            "max_bad_fraction": data_cfg.max_bad_fraction,
        }
        digest = content_digest(path)
        # known classes change the listing only where a lone top folder is one of them: then it is a class
        kept = self.kept_folder(path, digest, [*known, *(data_cfg.classes or [])], cache_dir)
        if kept is not None:
            settings["class_folder"] = same_text(kept)
        workers = int(data_cfg.num_workers) or 1
        return cached_decode(
            self.kind,
            {"digest": digest, **settings},
            cache_dir,
            lambda: self.read(path, data_cfg, fit, key, workers=workers, known=known)[0],
            path,
        )

    def kept_folder(self, path: str, digest: str, known: Sequence[str], cache_dir) -> str | None:
        """kept_class_folder, for an archive remembered beside the decoded cache by its content digest: it lists the
        members, which decompresses a tar.gz whole, and every run that knows its classes (an eval of a checkpoint)
        needs it for the cache key, cached data or not. A folder's walk is what content_digest already paid."""
        names = sorted({same_text(str(c)) for c in known})
        if not names or archive_kind(path) is None:
            return kept_class_folder(path, frozenset(self.suffixes), known)
        key = json.dumps({"digest": digest, "suffixes": sorted(self.suffixes), "known": names})
        memo = Path(cache_dir) / self.kind / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.kept.json"
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            return json.loads(memo.read_text())["kept"]
        kept = kept_class_folder(path, frozenset(self.suffixes), known)
        with contextlib.suppress(OSError, UserError):  # a cache folder the disk refuses: listed again next time
            write_text_atomically(memo, json.dumps({"kept": kept}))
        return kept

    def items(
        self, source: str, data_cfg: LabelledFiles, cache_dir, fit=None, known: Sequence[str] = ()
    ) -> dict[str, ListedItems]:
        """Each split, decoded item by item (the streamed fallback); the files the listing refused go with the
        first, so they are counted with the undecodable ones as a resident read counts them. A compressed tar is
        refused (so data.resident=auto decodes it whole, through the cache): listing one read every member into
        memory, before every run (its decoded cache there or not), and then streamed from those bytes in memory."""
        path = self.resolve(source, data_cfg, cache_dir)
        if archive_kind(path) == "targz":
            raise UserError(
                f"data.source {path} is a compressed tar, which has no random access: streaming needs an uncompressed "
                ".tar, a .zip or a folder; unpack it or recompress it as .tar, or set data.resident=true."
            )
        found = self.listing(path, data_cfg, "data.source", known=known)
        loader = functools.partial(self.load, fit=fit or self.settings(data_cfg))
        return {
            split: ListedItems(files, found.classes, loader, self.bad, self.dtype, found.refused if k == 0 else [])
            for k, (split, files) in enumerate(found.splits.items())
        }


def decode_listing(
    listing: Listing,
    load: Loader,
    bad: type[Exception],
    *,
    dtype: torch.dtype,
    max_bad_fraction: float,
    path: str,
    key: str,
    kind: str,
    workers: int = 1,
) -> tuple[dict[str, Decoded], float]:
    """{split: Decoded} of every listed file, and the seconds of media decoded. The decoders release the
    GIL (libsndfile, FFmpeg), so `workers` threads decode side by side."""
    report_left_out(listing, path, key, kind)
    index = {c: i for i, c in enumerate(listing.classes)}
    files = [f for split in listing.splits.values() for f in split]

    def one(f: MediaFile):
        try:
            x, seconds = load(f.source.open())
            return stored(x, dtype, bad), seconds, None
        except bad as e:
            return None, 0.0, f"{f.name}: {e}"
        except OSError as e:  # unreadable (permissions, a file that vanished)
            return None, 0.0, f"{f.name}: cannot be read ({e.strerror or e})"

    with ThreadPoolExecutor(max(1, workers)) as pool:
        results = dict(zip((id(f) for f in files), pool.map(one, files)))
    skipped = list(listing.refused) + [r[2] for r in results.values() if r[2]]
    check_bad(skipped, len(files) + len(listing.refused), max_bad_fraction, path, key, f"{kind} files")
    out, seconds = {}, 0.0
    carried = list(listing.refused)  # each skip is counted once, by the first split that decodes
    for split, members in listing.splits.items():
        good = [(f, results[id(f)]) for f in members if results[id(f)][0] is not None]
        carried += [results[id(f)][2] for f in members if results[id(f)][2]]
        if not good:
            continue  # a split of which nothing decoded: its skips go with the next one
        seconds += sum(r[1] for _, r in good)
        labels = np.array([index[f.label] if f.label is not None else -1 for f, _ in good], np.int64)
        out[split] = Decoded(
            torch.stack([r[0] for _, r in good]),
            torch.from_numpy(labels),
            list(listing.classes),
            [f.name for f, _ in good],
            carried,
        )
        carried = []
    if carried and out:
        next(reversed(out.values())).skipped.extend(carried)  # the last splits' skips, after their decoded ones
    return out, seconds


def stored(x: torch.Tensor, dtype: torch.dtype, bad: type[Exception]) -> torch.Tensor:
    """A decoded item in the stored dtype; `bad` where a value that was finite is not after the cast (beyond float16's
    range): it would make every loss it enters NaN."""
    out = x.to(dtype)
    if out.is_floating_point() and x.is_floating_point() and not torch.isfinite(out).all():
        raise bad(f"values beyond what {str(dtype).removeprefix('torch.')} holds (largest {torch.finfo(dtype).max:g})")
    return out


class ListedItems:
    """One split of a listing, decoded item by item (the streamed fallback: DataLoader workers call load)."""

    def __init__(
        self,
        files: list[MediaFile],
        classes: list[str],
        load: Loader,
        bad: type[Exception],
        dtype: torch.dtype,
        refused: list[str] | None = None,
    ):
        self.files, self.classes, self._load, self._bad, self._dtype = files, classes, load, bad, dtype
        self.refused = list(refused or [])  # "name: why" of files the listing refused (Items.refused)
        index = {c: i for i, c in enumerate(classes)}
        self.labels = np.array([index[f.label] if f.label is not None else -1 for f in files], np.int64)
        self.names = [f.name for f in files]

    def __len__(self) -> int:
        return len(self.files)

    def load(self, i: int) -> torch.Tensor | None:
        """Item i decoded, or None when it does not decode (check(i) says why)."""
        found = self._decode(i)
        return None if isinstance(found, Undecodable) else found

    def check(self, i: int) -> bool | Undecodable:
        """True when item i decodes, else why not: for the pass over every streamed item up front
        (ClassificationData._decodable), which names the skipped items in one warning, not one line each."""
        found = self._decode(i)
        return found if isinstance(found, Undecodable) else True

    def _decode(self, i: int) -> torch.Tensor | Undecodable:
        try:
            return stored(self._load(self.files[i].source.open())[0], self._dtype, self._bad)
        except self._bad as e:
            return Undecodable(str(e))
        except OSError as e:  # unreadable (permissions, a file that vanished), as decode_listing says it
            return Undecodable(f"cannot be read ({e.strerror or e})")


class MediaDataModule(ClassificationData):
    """A media modality's train / val / test splits, resident on the device or streamed, read through its
    MediaReader (`reader`)."""

    reader: MediaReader
    fit = None  # the decoding settings of a checkpoint's model (its modality's datamodule), in place of the config's
    known_classes: tuple[str, ...] = ()  # a checkpoint's classes (task=eval): a lone top folder named so is a class

    @property
    def item_kind(self) -> str:
        return f"{self.reader.kind} files"

    def read(self, source: str, key: str) -> dict[str, Decoded]:
        return self.reader.read_cached(source, self.cfg, self.cache_dir, key, fit=self.fit, known=self.known_classes)

    def list_items(self, source: str):
        return self.reader.items(source, self.cfg, self.cache_dir, fit=self.fit, known=self.known_classes)


def trained_fit(reader: MediaReader, data_cfg: LabelledFiles, saved: dict | None, ckpt: str | None):
    """The decoding settings of the checkpoint whose saved run config is `saved` (None without one: then None), said
    where the data config's differ: a model decodes its data as it was trained, whatever `data=NAME` brings."""
    if saved is None:
        return None
    trained, given = reader.fit(saved["inputs"]), reader.settings(data_cfg)
    if trained != given:
        log.warning(
            "ckpt %s: decoding the %s as its model was trained (%s), not as the data config says (%s)",
            ckpt,
            reader.kind,
            _described(trained),
            _described(given),
        )
    return trained


def _described(fit) -> str:
    return ", ".join(f"{k} {list(v) if isinstance(v, tuple) else v}" for k, v in asdict(fit).items())
