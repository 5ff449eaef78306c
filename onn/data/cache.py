"""Decoded datasets cached as safetensors, keyed by the source's content and the decoding settings.

Decoding a folder of JPEGs, WAVs or meshes takes seconds to minutes; the tensors it gives take one
safetensors read. A cache file is written under a temporary name and renamed into place, so a
killed run never leaves half of one; a changed source (or setting) gets a new key. A disk that refuses the
write (full, read-only) leaves the data uncached, said in one warning: the run goes on with what it decoded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from onn.data.resident import Decoded
from onn.errors import disk_error, write_refused
from onn.hardware.locks import held

log = logging.getLogger("onn")


def cached_decode(
    kind: str,
    key: dict[str, Any],
    cache_dir: str | os.PathLike,
    decode: Callable[[], dict[str, Decoded]],
    source: str = "",
) -> dict[str, Decoded]:
    """{split: Decoded} from the cache under cache_dir/kind for `key`, or from `decode()` (then cached). One
    process decodes a source at a time: the ranks of a multi-process run and a sweep's parallel jobs on one
    dataset each decoded it whole at once (N times the work on the same cores); the others wait, then read what
    the first one cached."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
    cache = Path(cache_dir) / kind / f"{digest}.safetensors"
    cached = _read(cache, kind, source) if cache.is_file() else None
    if cached is not None:
        return cached
    with contextlib.ExitStack() as lock:
        waited = _take_decode_lock(lock, cache, kind, source)
        cached = _read(cache, kind, source) if cache.is_file() else None  # another process decoded it meanwhile
        if cached is not None:
            return cached
        uncached = cache.with_name(f".{cache.stem}.uncached")  # the disk refused a decoder's write of this entry
        if waited and uncached.exists():  # so the others decode beside each other, not in turn under the lock (one
            lock.close()  # that failed or was killed, its memory perhaps, leaves no mark: the next decodes alone)
        splits = decode()
        tensors, meta = {}, {"classes": None, "splits": {}}
        for name, s in splits.items():
            tensors[f"{name}.inputs"], tensors[f"{name}.labels"] = s.inputs.contiguous(), s.labels.contiguous()
            meta["classes"] = s.classes
            meta["splits"][name] = {"names": s.names, "skipped": s.skipped}
        written = _write(cache, tensors, {"onn": json.dumps(meta), "source": source}, kind)
        with contextlib.suppress(OSError):
            if written:
                uncached.unlink(missing_ok=True)
            else:
                uncached.touch()
    return splits


def _take_decode_lock(lock: contextlib.ExitStack, cache: Path, kind: str, source: str) -> bool:
    """Enter the lock of one cache entry (.DIGEST.lock beside it) into `lock`, waiting for a process that holds it;
    whether it waited. A cache folder the disk refuses (read-only, full) goes without: the run decodes, and
    _write says it is uncached."""
    waited = []

    def waiting() -> None:
        waited.append(True)
        log.info("%s: another process is decoding %s; waiting to read its cache", kind, source)

    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        lock.enter_context(held(cache.parent, waiting, name=f".{cache.stem}.lock"))
    except OSError as e:
        if disk_error(e) is None:
            raise
    return bool(waited)


def cached_tensors(
    kind: str, cache: Path, compute: Callable[[], dict[str, Any]], device: str = "cpu"
) -> dict[str, Any]:
    """Tensors from the cache file `cache`, or from `compute()` (then cached). A damaged file (truncated, emptied,
    overwritten) is computed again and replaced, where every later run would fail on it; a write the disk refuses
    leaves them uncached, said once (_write)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if cache.is_file():
        try:
            tensors = load_file(str(cache), device=device)
        except (SafetensorError, OSError) as e:
            log.warning("%s: the cache %s is damaged (%s); computing it again", kind, cache, e)
            cache.unlink(missing_ok=True)
        else:
            log.info("%s: from the cache %s", kind, cache)
            return tensors
    tensors = compute()
    _write(cache, {k: v.cpu().contiguous() for k, v in tensors.items()}, {}, kind)
    return tensors


def _write(cache: Path, tensors: dict[str, Any], metadata: dict[str, str], kind: str) -> bool:
    """The decoded tensors into the cache, whole or not at all; whether they were written. A write the disk
    refuses (full, read-only) leaves no part of the file and is said once: the run goes on with the data it
    decoded, only uncached."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    tmp = temporary_beside(cache)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(tmp), metadata=metadata)
        os.replace(tmp, cache)
        return True
    except (OSError, SafetensorError) as e:
        refused = disk_error(e)
        if refused is None:
            raise
        log.warning(
            "%s: the decoded data is not cached: %s",
            kind,
            write_refused(refused, cache, None, "the cache (paths.cache)"),
        )
        return False
    finally:
        with contextlib.suppress(OSError):  # its folder may be what could not be made
            tmp.unlink(missing_ok=True)


def temporary_beside(path: Path) -> Path:
    """A name for a file written beside `path` and then renamed onto it, used by no other writer: two threads of a
    process (Hydra's joblib launcher, two Trainers) and two machines sharing a cache folder over NFS, with the same
    pid, wrote one NAME.tmpPID at once, and one renamed it away from under the other or read it half-written."""
    return path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.{uuid.uuid4().hex}.tmp")


def _read(cache: Path, kind: str, source: str) -> dict[str, Decoded] | None:
    """The cached splits, or None when the file is damaged (truncated, emptied, overwritten): it is removed and
    the source decoded again, where every later run would otherwise fail on it."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    try:
        with safe_open(str(cache), "pt") as f:
            meta = json.loads(f.metadata()["onn"])
        tensors = load_file(str(cache))
        splits = {
            name: Decoded(
                tensors[f"{name}.inputs"], tensors[f"{name}.labels"], meta["classes"], s["names"], s["skipped"]
            )
            for name, s in meta["splits"].items()
        }
    except (SafetensorError, OSError, ValueError, KeyError, TypeError) as e:
        log.warning("%s: the decoded cache %s is damaged (%s); decoding %s again", kind, cache, e, source)
        cache.unlink(missing_ok=True)
        return None
    log.info("%s: %s from the decoded cache %s", kind, source, cache)
    skipped = [item for s in splits.values() for item in s.skipped]
    if skipped:  # the decoder named them when it read the source; say so again for this run
        log.warning(
            "%s: %d items of %s could not be decoded and are left out, e.g. %s",
            kind,
            len(skipped),
            source,
            "; ".join(skipped[:3]),
        )
    return splits
