"""The shared data layer (onn/data) as a second review found it: the decoded cache written through one temporary
name per process (two threads of one process took each other's file), a dataset archive read end to end to key its
cache before every run, and the "classes the model never learns" warning given at task=eval, which trains nothing."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import MODALITY_HARDWARE, compose
from test_data_review import AUDIO, wav_bytes

UNTRAINED = "the model never learns them"


def test_threads_writing_one_decoded_cache_at_once_each_keep_it(tmp_path, caplog):
    """Two Trainers in one process (Hydra's joblib launcher runs jobs as threads) decoding one dataset wrote one
    NAME.tmpPID: one renamed it away from under the other, which said "the decoded data is not cached: ... No such
    file or directory; write the cache elsewhere" (or read it half-written). Each writer has a name of its own.
    (cached_decode lets one process decode at a time where the cache folder has file locks; writers still meet
    where it has none, as on NFS mounted nolock, or on two machines sharing it: their writes are what is tested.)"""
    from onn.data.cache import _write

    inputs = torch.randint(0, 256, (4, 1 << 20), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    rounds, threads, failures = 20, 4, []
    cache = tmp_path / "images" / "entry.safetensors"
    meta = {"classes": None, "splits": {"all": {"names": ["w", "x", "y", "z"], "skipped": []}}}

    def clear() -> None:  # between rounds: each round, every thread writes
        for path in (tmp_path / "images").glob("*"):
            path.unlink()

    start = threading.Barrier(threads, action=clear, timeout=60)

    def work() -> None:
        try:
            for _ in range(rounds):
                start.wait()
                tensors = {"all.inputs": inputs, "all.labels": torch.tensor([0, 1, 0, 1])}
                _write(cache, tensors, {"onn": json.dumps(meta), "source": "src"}, "images")
                assert safe_open_names(cache) == {"all.inputs", "all.labels"}
        except Exception as e:  # the test's thread says what went wrong
            failures.append(repr(e))

    with caplog.at_level(logging.WARNING, logger="onn"):
        workers = [threading.Thread(target=work) for _ in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    assert failures == []
    assert [
        r.getMessage() for r in caplog.records if "not cached" in r.getMessage() or "damaged" in r.getMessage()
    ] == []
    assert list((tmp_path / "images").iterdir()) == [cache]  # the cache, and no temporary file left beside it


def safe_open_names(path: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return set(f.keys())


class Waiting(logging.Handler):
    """Counts the processes (here threads) cached_decode said are waiting for another's decode."""

    def __init__(self) -> None:
        super().__init__()
        self.count, self.changed = 0, threading.Condition()

    def __enter__(self) -> Waiting:
        """Listening to the "onn" logger at INFO for the block."""
        self.logger, self.level = logging.getLogger("onn"), logging.getLogger("onn").level
        self.logger.addHandler(self)
        self.logger.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level)

    def emit(self, record: logging.LogRecord) -> None:
        if "waiting to read its cache" in record.getMessage():
            with self.changed:
                self.count += 1
                self.changed.notify_all()


def test_one_of_the_runs_decoding_one_dataset_at_once_decodes_it(tmp_path):
    """The ranks of a multi-process run and a sweep's parallel jobs each decoded the same dataset whole at once: one
    decodes now, the others wait for its cache and read it. The first decode here lasts until the other three are
    waiting (or 30 s, where nothing waits: each then decodes too, which the count says)."""
    from onn.data.cache import cached_decode
    from onn.data.resident import Decoded

    threads, calls, results, waiting = 4, [], [], Waiting()

    def decode() -> dict[str, Decoded]:
        calls.append(threading.get_ident())
        with waiting.changed:
            waiting.changed.wait_for(lambda: waiting.count >= threads - 1, timeout=30)
        return {"all": Decoded(torch.arange(8).view(4, 2), torch.tensor([0, 1, 0, 1]), ["a", "b"], list("wxyz"))}

    def work() -> None:
        results.append(cached_decode("images", {"k": 1}, tmp_path, decode, "src")["all"].names)

    with waiting:
        workers = [threading.Thread(target=work) for _ in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    assert len(calls) == 1 and waiting.count == threads - 1
    assert results == [list("wxyz")] * threads


def bytes_read() -> int:
    """The bytes this process has read through read(2) so far (Linux's /proc/self/io rchar)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


@pytest.mark.skipif(not Path("/proc/self/io").is_file(), reason="counts reads with Linux's /proc/self/io")
def test_a_large_dataset_archive_is_keyed_without_reading_it_through(tmp_path):
    """The decoded cache's key of a zip or tar.gz data source was the sha256 of all its bytes: a 50 GB archive was
    read end to end before every run, its decoded cache found or not. A large file is keyed as a folder's files are,
    by size and mtime (and its path); a small one (a metadata.csv) still by its bytes."""
    from onn.data.files import HASHED_BYTES, content_digest
    from onn.modalities.image.formats import source_digest

    archive = tmp_path / "photos.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("cat/0.raw", os.urandom(HASHED_BYTES + (1 << 20)))
    before = bytes_read()
    digest = content_digest(archive)
    assert source_digest(archive) == digest  # the image reader's key goes through it
    assert bytes_read() - before < HASHED_BYTES // 4  # the archive's bytes were read, twice
    assert content_digest(archive) == digest and len(digest) == 64
    st = archive.stat()
    os.utime(archive, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a new download of it: decoded again
    assert content_digest(archive) != digest
    with archive.open("ab") as f:
        f.write(b"\0")
    os.utime(archive, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert content_digest(archive) != digest
    small = tmp_path / "metadata.csv"
    small.write_text("file_name,label\na.wav,0\n")
    first = content_digest(small)
    st = small.stat()
    small.write_text("file_name,label\na.wav,1\n")  # same size, and the mtime put back: its bytes tell
    os.utime(small, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert content_digest(small) != first


def split_folders(root: Path) -> Path:
    """train/ of the classes low and high, test/ of low, high and mid: mid is never trained on."""
    for split, classes in (("train", ("low", "high")), ("test", ("low", "high", "mid"))):
        for c, freq in (("low", 300), ("high", 900), ("mid", 600)):
            if c in classes:
                (root / split / c).mkdir(parents=True)
                for i in range(4):
                    (root / split / c / f"{i}.wav").write_bytes(wav_bytes(freq + 10 * i))
    return root


def untrained_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if UNTRAINED in r.getMessage()]


def test_eval_does_not_warn_of_classes_the_model_never_learns(tmp_path, caplog):
    """task=eval of a source whose test/ holds a class its train/ does not said "the training data has no item of
    the class(es) mid, which val hold(s): the model never learns them": eval trains nothing (a checkpoint's model
    learned from its own data). The warning is given when training starts, once, resident or streamed."""
    from onn.app import execute, given_keys
    from onn.modalities import classification, get

    source = split_folders(tmp_path / "sounds")
    common = (*AUDIO, MODALITY_HARDWARE, "tracking=none", "trainer.enable_progress_bar=false")
    common += (f"paths.outputs={tmp_path / 'outputs'}", f"paths.cache={tmp_path / 'cache'}")
    given = ["task=eval", "data=audio", f"data.source={source}"]
    (tmp_path / "eval").mkdir()
    with caplog.at_level(logging.WARNING, logger="onn"):
        assert "val/acc" in execute(compose(*common, *given, root=tmp_path), tmp_path / "eval", given_keys(given))
    assert untrained_warnings(caplog) == []

    for resident in ("true", "false"):
        caplog.clear()
        config = compose(*common, f"data.source={source}", f"data.resident={resident}", root=tmp_path)
        with caplog.at_level(logging.WARNING, logger="onn"):
            data = classification.setup_data(get("audio"), config, "cpu")
            assert untrained_warnings(caplog) == []  # set up, nothing trained yet
            data.train_dataloader()
            data.train_dataloader()  # the train task sizes its epoch with it, then Lightning's fit asks again
        assert untrained_warnings(caplog) == [
            "data: the training data has no item of the class(es) mid, which test hold(s): the model never learns "
            "them; add training items of them"
        ], resident


@pytest.mark.skipif(not Path("/proc/self/io").is_file(), reason="counts reads with Linux's /proc/self/io")
def test_a_compressed_tar_of_sounds_is_not_read_whole_to_size_it_at_every_run(tmp_path):
    """data.resident=auto listed a .tar.gz of audio to size its decoded data: every member read into memory, at every
    run, its decoded cache there or not; over the budget, it was then "streamed" from those bytes in memory. A
    compressed tar, which has no random access, is decoded whole through the cache (as images' are), and streaming
    one is one sentence."""
    import io
    import tarfile

    import numpy as np
    import soundfile as sf

    from onn.data.files import HASHED_BYTES
    from onn.errors import UserError
    from onn.modalities import classification, get

    archive, noise = tmp_path / "sounds.tar.gz", np.random.default_rng(0)
    with tarfile.open(archive, "w:gz", compresslevel=1) as tf:
        for i in range(100):
            wav = io.BytesIO()
            sf.write(wav, noise.uniform(-0.5, 0.5, 8000 * 12).astype(np.float32), 8000, format="WAV")
            info = tarfile.TarInfo(f"{'ab'[i % 2]}/{i}.wav")
            info.size = len(wav.getvalue())
            tf.addfile(info, io.BytesIO(wav.getvalue()))
    assert archive.stat().st_size > HASHED_BYTES  # the premise: keyed by its size and mtime, not its bytes

    def setup(*overrides: str):
        config = compose(*AUDIO, f"data.source={archive}", f"paths.cache={tmp_path / 'cache'}", *overrides)
        return classification.setup_data(get("audio"), config, "cpu")

    first = setup().splits  # decoded, and cached
    every = sorted(f"{'ab'[i % 2]}/{i}.wav" for i in range(100))
    assert sorted(first["train"].names + first["val"].names) == every  # each member in train or val exactly once
    before = bytes_read()
    again = setup()
    assert bytes_read() - before < archive.stat().st_size // 4  # from the cache: the archive was read whole
    assert again.streamed is None and again.splits["train"].names == first["train"].names
    with pytest.raises(UserError, match=r"^data\.source .*sounds\.tar\.gz is a compressed tar, which has no random"):
        setup("data.resident=false")


def test_a_run_that_waited_for_a_decode_that_left_no_cache_decodes_without_the_lock(tmp_path):
    """A decode whose cache the disk refused leaves the others nothing to read: each then decoded in turn under the
    lock, the ranks of a run one after another (N times the wall time, past a process group's timeout). A run that
    waited and finds no cache decodes beside the others, the lock let go."""
    import fcntl

    from test_faults import files_limited_to

    from onn.data.cache import cached_decode
    from onn.data.resident import Decoded

    calls, lock_free, waiting = [], [], Waiting()

    def decode() -> dict[str, Decoded]:
        calls.append(threading.get_ident())
        if len(calls) == 1:  # the first: until the second waits for it
            with waiting.changed:
                waiting.changed.wait_for(lambda: waiting.count >= 1, timeout=30)
        else:  # the second: is the entry's lock free while it decodes?
            (lock,) = (tmp_path / "images").glob(".*.lock")
            with open(lock, "a") as f:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    lock_free.append(True)
                except BlockingIOError:
                    lock_free.append(False)
        return {"all": Decoded(torch.zeros(4, 65536), torch.tensor([0, 1, 0, 1]), ["a", "b"], list("wxyz"))}

    with waiting, files_limited_to(64 * 1024):  # the cache (1 MB) is refused: the first leaves none
        workers = [threading.Thread(target=cached_decode, args=("images", {"k": 1}, tmp_path, decode, "src"))]
        workers[0].start()
        while not calls:
            time.sleep(0.01)
        workers.append(threading.Thread(target=cached_decode, args=("images", {"k": 1}, tmp_path, decode, "src")))
        workers[1].start()
        for worker in workers:
            worker.join()
    assert len(calls) == 2 and waiting.count == 1 and lock_free == [True]


def test_a_child_forked_while_a_lock_is_held_does_not_keep_it(tmp_path):
    """A flock lock lasts while any descriptor of it is open, and a forked child (a DataLoader worker of another
    job's thread) shares its parent's: a decode's lock stayed held until the child ended. The child closes its copy."""
    import fcntl

    from onn.hardware.locks import held

    go_on_read, go_on_write = os.pipe()
    ready_read, ready_write = os.pipe()
    with held(tmp_path, name=".entry.lock"):
        child = os.fork()
        if child == 0:  # the child: running (its fork handlers done), alive until the parent has tried the lock
            try:
                os.write(ready_write, b"r")
                os.read(go_on_read, 1)
            finally:
                os._exit(0)
    os.read(ready_read, 1)
    try:
        with open(tmp_path / ".entry.lock", "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                free = True
            except BlockingIOError:
                free = False
    finally:
        os.write(go_on_write, b"x")
        os.waitpid(child, 0)
    assert free


def test_a_forked_child_closes_no_descriptor_that_is_not_a_lock_any_more(tmp_path):
    """A holder may close try_hold's descriptor itself, and its number then names another file: here the pipe a
    forked child writes its figure to (as the profile's cpu_share does). The child closed it as a lock, failed, and
    ran on in the parent's code (a test run hung in ci134)."""
    from onn.hardware.locks import try_hold

    fd = try_hold(tmp_path)
    os.close(fd)  # as tests/chaos/test_concurrent_runs.py does
    r, w = os.pipe()
    if r == fd:  # the write end takes the lock's old number
        r, old = os.dup(r), r
        os.close(old)
    if w != fd:
        os.dup2(w, fd)
        os.close(w)
        w = fd
    child = os.fork()
    if child == 0:
        try:
            os.write(w, b"ok")
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        said = f.read()
    os.waitpid(child, 0)
    assert said == b"ok"


def test_a_child_forked_while_a_thread_waits_for_a_lock_does_not_keep_it(tmp_path):
    """A thread waiting in held() has its lock file open before it holds the lock: a child forked then (another
    job's DataLoader worker) shares that descriptor, and closing it in the parent left the lock held while the
    child lived. held() unlocks before it closes, which releases every copy."""
    import fcntl

    from onn.hardware.locks import held

    lock = tmp_path / ".entry.lock"
    holder = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX)
    waiting = threading.Event()

    def wait_for_it() -> None:
        with held(tmp_path, waiting.set, name=".entry.lock"):
            pass

    thread = threading.Thread(target=wait_for_it)
    thread.start()
    waiting.wait(30)
    time.sleep(0.2)  # the thread opens the file and waits in flock
    go_on_read, go_on_write = os.pipe()
    child = os.fork()
    if child == 0:  # alive until the parent has tried the lock
        try:
            os.read(go_on_read, 1)
        finally:
            os._exit(0)
    try:
        fcntl.flock(holder, fcntl.LOCK_UN)  # the first holder ends (the child's copy of it too): the thread takes
        os.close(holder)  # the lock, and leaves its block
        thread.join(30)
        with open(lock, "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                free = True
            except BlockingIOError:
                free = False
    finally:
        os.write(go_on_write, b"x")
        os.waitpid(child, 0)
    assert not thread.is_alive() and free


def test_a_run_that_waited_for_a_decode_that_failed_decodes_alone(tmp_path):
    """A first decode that failed (killed, out of memory perhaps) leaves no mark, unlike one whose write the disk
    refused: the next decodes under the lock, the others waiting again, not all of them at once."""
    import fcntl

    from onn.data.cache import cached_decode
    from onn.data.resident import Decoded

    calls, lock_free, waiting = [], [], Waiting()

    def decode() -> dict[str, Decoded]:
        calls.append(threading.get_ident())
        if len(calls) == 1:  # the first: until the second waits for it, then it fails
            with waiting.changed:
                waiting.changed.wait_for(lambda: waiting.count >= 1, timeout=30)
            raise MemoryError("the first decode ran out of memory")
        (lock,) = (tmp_path / "images").glob(".*.lock")
        with open(lock, "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                lock_free.append(True)
            except BlockingIOError:
                lock_free.append(False)
        return {"all": Decoded(torch.zeros(4, 2), torch.tensor([0, 1, 0, 1]), ["a", "b"], list("wxyz"))}

    def first() -> None:
        with contextlib.suppress(MemoryError):
            cached_decode("images", {"k": 1}, tmp_path, decode, "src")

    with waiting:
        workers = [threading.Thread(target=first)]
        workers[0].start()
        while not calls:
            time.sleep(0.01)
        workers.append(threading.Thread(target=cached_decode, args=("images", {"k": 1}, tmp_path, decode, "src")))
        workers[1].start()
        for worker in workers:
            worker.join()
    assert len(calls) == 2 and lock_free == [False]
