"""Files and folders as users hand them over, read safely: any modality's dataset reader starts here.

Users point data.source at whatever they have: a folder full of symbolic links, a download that is a zip or a
tar.gz, a pipe or a device by mistake. These functions walk, list and sniff such sources without hanging
(only regular files are ever opened, and sniffing reads a bounded head), without following a link loop,
and without trusting archive member names (an absolute or '..' path is reported, never used as a name).
"""

from __future__ import annotations

import csv
import errno
import functools
import hashlib
import io
import itertools
import json
import logging
import lzma
import os
import posixpath
import stat
import tarfile
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from onn.errors import UserError
from onn.json_values import strict_json

log = logging.getLogger("onn")
SKIP_DIRS = frozenset({"__MACOSX"})  # macOS zip resource forks: never data
csv.field_size_limit(2**31 - 1)  # a CSV field may hold a whole document; csv refuses one over 128 KB by default
ARCHIVE_KINDS = ("zip", "tar", "targz")
HASHED_BYTES = 16 * 2**20  # a file up to this size is keyed by all its bytes, a larger one by samples of them
SAMPLED_ENDS = 512 << 10  # a larger file's first and last bytes hashed (a zip's central directory, a tar's headers)
SAMPLED_BLOCKS = 14  # and this many blocks of SAMPLED_BLOCK spread evenly between them
SAMPLED_BLOCK = 32 << 10
# What a damaged archive raises while it is listed or read (gzip.BadGzipFile is an OSError); zipfile raises
# RuntimeError for an encrypted member and NotImplementedError for a compression method it lacks.
ARCHIVE_ERRORS = (
    *(tarfile.TarError, zipfile.BadZipFile, OSError, EOFError, zlib.error, lzma.LZMAError),
    *(RuntimeError, NotImplementedError),
)


class NotRegularFileError(OSError):
    """Raised instead of reading a FIFO, a device or a socket, which can block or never end."""


class UnsafeMemberNameError(ValueError):
    """An archive member name that is absolute or climbs out with '..' (see clean_member_name)."""


def describe_mode(mode: int) -> str:
    """What a stat mode is, in words for a message ("a FIFO (named pipe)", "a character device", ...)."""
    for test, words in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return words
    return "not a regular file"


def existing_source(source: str | os.PathLike[str], key: str, hint: str = "") -> Path:
    """The path of a data source that is a regular file or a folder, else one UserError sentence naming it.

    Checked before anything reads it: a FIFO blocks on open and /dev/zero never ends, and a link loop or a
    broken link would otherwise surface as a traceback or as a misleading "does not exist".
    """
    path = Path(source).expanduser()
    tail = f"; point it at a dataset file or folder{f' ({hint})' if hint else ''}."
    try:
        st = os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UserError(f"{key} {path} is a symbolic link loop{tail}") from e
        if os.path.islink(path):
            raise UserError(f"{key} {path} is a broken symbolic link to {os.readlink(path)}{tail}") from e
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            raise UserError(f"{key} {path} does not exist{tail}") from e
        raise UserError(f"{key} {path} cannot be read: {e.strerror or e}{tail}") from e
    if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
        raise UserError(f"{key} {path} is {describe_mode(st.st_mode)}, not a regular file or folder{tail}")
    return path


def same_path(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Whether two data paths name one file or folder, however written ("data/x", "./data/x/", "~/x", a link to it);
    False when either does not exist."""
    try:
        return os.path.samefile(os.path.expanduser(a), os.path.expanduser(b))
    except (OSError, ValueError):
        return False


def open_regular(path: str | os.PathLike[str]) -> IO[bytes]:
    """Open a file for binary reading if it is a regular file; NotRegularFileError otherwise.

    The check is made on the opened descriptor (no race with a swapped path), and the open itself does not
    block on a FIFO that has no writer.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFileError(errno.EINVAL, f"{describe_mode(mode)}, not a regular file", str(path))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_file(path: str | os.PathLike[str]) -> bytes:
    """All the bytes of a regular file (see open_regular)."""
    with open_regular(path) as f:
        return f.read()


def read_head(path: str | os.PathLike[str], n: int = 512) -> bytes:
    """At most the first n bytes of a regular file: enough to sniff magic bytes, never the whole file."""
    with open_regular(path) as f:
        return f.read(n)


def is_hidden(name: str) -> bool:
    """Whether a relative posix name has a hidden part (.git, .DS_Store, ._x) or sits under __MACOSX."""
    return any(p.startswith(".") or p in SKIP_DIRS for p in name.split("/"))


def first_names(folder: str | os.PathLike[str], limit: int) -> list[str]:
    """The relative names of at most `limit` files under a folder, for a sniffer (names only: nothing is read). An
    unreadable folder is not said here: the listing that follows the sniff says it."""
    return [rel for rel, _ in itertools.islice(walk_files(folder, unreadable=[]), limit)]


def walk_files(
    root: str | os.PathLike[str], max_depth: int | None = None, unreadable: list[str] | None = None
) -> Iterator[tuple[str, Path]]:
    """(relative posix name, path) of every regular file under root that is not hidden (see is_hidden).

    Links are followed, each directory at most once, so a link loop (a/loop -> a, b/x -> ..) ends: real
    folders are walked first, then the folders that links lead to and that were not walked yet, keyed by
    (st_dev, st_ino). Links to files are followed. FIFOs, devices, sockets and broken links are left out.
    max_depth=1 lists root's own files, 2 also those of its subfolders, and so on. Names come sorted within
    each folder; callers that need one order sort.

    A folder that cannot be listed (permissions, an NFS ACL) is passed over, and said: added to `unreadable` as
    "name/: why" for the caller to count with its refused items, or else in one warning naming it. It was passed
    over without a word, and a run trained on the other class folders as if it were the whole dataset.
    """
    root = Path(root)
    st = os.stat(root)
    seen = {(st.st_dev, st.st_ino)}
    pending: list[tuple[str, str]] = []  # (relative name, path) of linked folders, walked after the real ones

    def visit(folder: str, rel: str, depth: int) -> Iterator[tuple[str, Path]]:
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError as e:
            why = e.strerror or str(e)
            if unreadable is None:
                log.warning(
                    "The folder %s cannot be read (%s): its files are left out; fix its permissions.", folder, why
                )
            else:
                unreadable.append(f"{rel or './'}: a folder that cannot be read ({why})")
            return
        subdirs = []
        for e in entries:
            if e.name.startswith(".") or e.name in SKIP_DIRS:
                continue
            try:
                if e.is_file():
                    yield rel + e.name, Path(e.path)
                elif e.is_dir() and (max_depth is None or depth + 1 < max_depth):
                    subdirs.append(e)
            except OSError:  # a link loop among files (x -> y -> x): not a file
                continue
        for e in subdirs:
            if e.is_symlink():
                pending.append((f"{rel}{e.name}/", e.path))
                continue
            try:
                s = e.stat()
            except OSError:
                continue
            if (s.st_dev, s.st_ino) not in seen:  # a bind mount of an ancestor would loop too
                seen.add((s.st_dev, s.st_ino))
                yield from visit(e.path, f"{rel}{e.name}/", depth + 1)

    yield from visit(str(root), "", 0)
    while pending:
        rel, path = pending.pop(0)
        try:
            s = os.stat(path)
        except OSError:
            continue
        if (s.st_dev, s.st_ino) in seen:
            continue  # a loop, or a folder reached already
        seen.add((s.st_dev, s.st_ino))
        yield from visit(path, rel, rel.count("/"))


def archive_kind(path: str | os.PathLike[str]) -> str | None:
    """What kind of archive a file is, from its magic bytes: zip, tar (uncompressed: members can be read at
    their offsets), targz (a gzip, bzip2 or xz compressed tar: read front to back) or None. Only regular
    files are sniffed, so a FIFO or /dev/zero gives None at once."""
    try:
        head = read_head(path, 512)
    except OSError:
        return None
    if head[:4] in (b"PK\x03\x04", b"PK\x05\x06"):
        return "zip"
    if head[257:262] == b"ustar":
        return "tar"
    compressed = head[:2] == b"\x1f\x8b" or head[:3] == b"BZh" or head[:6] == b"\xfd7zXZ\x00"
    try:
        if tarfile.is_tarfile(path):  # a pre-POSIX tar, or one compressed: reads one header block
            return "targz" if compressed else "tar"
    except ARCHIVE_ERRORS:
        return None
    return None


def clean_member_name(name: str) -> str:
    """An archive member's name as a relative posix path ("./train/cat/1.png" -> "train/cat/1.png").

    UnsafeMemberNameError when the name cannot be used as one: absolute ("/x/1.png", "C:/x") or with a '..'
    part, which would point outside the archive; its message says which, for the caller's report.
    """
    name = name.replace("\\", "/")
    if name.startswith("/") or (len(name) > 1 and name[1] == ":" and name[0].isalpha()):
        raise UnsafeMemberNameError("an absolute path, not read")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise UnsafeMemberNameError("a '..' in its path, not read")
    return "/".join(parts)


@dataclass(frozen=True)
class Member:
    """One regular file inside an archive."""

    name: str | None  # clean_member_name of raw; None when that refused it, and problem says why
    problem: str | None  # e.g. "an absolute path, not read"
    raw: str  # the name as stored (what zipfile reads it by: a zip link's target's; what messages show)
    size: int
    offset: int | None  # where its bytes start in an uncompressed tar (random access), else None
    open: Callable[[], IO[bytes]] = field(repr=False, compare=False)  # valid until the next member is taken
    is_link: bool = False  # an archive's hard or symbolic link, read as the member it leads to (see tar_links)


def iter_members(path: str | os.PathLike[str], kind: str | None = None) -> Iterator[Member]:
    """The regular-file members of a zip or tar (of ARCHIVE_KINDS), in stored order, in one pass; then its links to
    such members, under the links' own names (see tar_links; a zip's symbolic links are zip -y's).

    A name stored twice is its last entry, as tar extracts it and as zipfile and tarfile.getmember read it. A
    compressed tar is streamed, so a member's open() works only until the iterator moves on; read what is needed
    right away. There an entry is yielded before a later one of its name is known: that one comes after it. Listing
    a damaged archive raises one of ARCHIVE_ERRORS.
    """
    kind = kind or archive_kind(path)
    if kind not in ARCHIVE_KINDS:
        raise ValueError(f"{path} is not a zip or tar archive")
    if kind == "zip":
        yield from _zip_members(path)
    else:
        yield from _tar_members(path, kind)


MAX_LINK_HOPS = 40  # links followed for one name, as Linux's limit on symbolic links in one path
MAX_LINK_TARGET = 4096  # bytes of a zip link's target read (Linux's PATH_MAX): a longer one leads nowhere it holds
ZIP_REPACK = "zip it without -y: what it leads to is stored"
TAR_REPACK = "pack it with tar -h: what it leads to is stored"
Linked = tuple[str, tarfile.TarInfo, Any]  # (the link's clean name, the link, the TarInfo or ZipInfo it leads to)


def _zip_members(path: str | os.PathLike[str]) -> Iterator[Member]:
    """A zip's members. Info-ZIP's `zip -y` stores a symbolic link as a member whose bytes are its target, marked
    S_IFLNK in the high bits of external_attr: read as bytes, it was a file holding a path, counted undecodable. A
    link is read as tar's are; a found one's raw is its target's stored name, what zipfile reads it by. A name
    stored twice is its last entry, a file or a link. A folder entry written on Windows ("cat\\", which zipfile's
    is_dir misses) is a folder too: it was listed as a file "cat" of an unknown type."""
    with open_regular(path) as f, zipfile.ZipFile(f) as zf:
        files: dict[str, zipfile.ZipInfo] = {}
        links: list[tarfile.TarInfo] = []
        entries = [info for info in zf.infolist() if not (info.is_dir() or info.filename.endswith("\\"))]
        last = {name: info for info in entries if (name := _checked(zip_name(info))[0]) is not None}
        for info in entries:
            if (name := _checked(zip_name(info))[0]) is not None and last[name] is not info:
                continue  # a later entry of its name stands
            if stat.S_ISLNK(info.external_attr >> 16):
                links.append(_zip_link(zf, info))
                continue
            name, problem = _checked(zip_name(info))
            if name is not None:
                files[name] = info
            yield Member(name, problem, info.filename, info.file_size, None, functools.partial(zf.open, info))
        found, refused = tar_links(links, files, {}, ZIP_REPACK)
        yield from refused
        for name, _, target in found:
            opener = functools.partial(zf.open, target)
            yield Member(name, None, target.filename, target.file_size, None, opener, is_link=True)


def _zip_link(zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> tarfile.TarInfo:
    """A zip's symbolic link as the tar link it would be (its bytes are the path it leads to)."""
    link = tarfile.TarInfo(zip_name(info))
    with zf.open(info) as f:
        link.type, link.linkname = tarfile.SYMTYPE, f.read(MAX_LINK_TARGET).decode("utf-8", "replace")
    return link


@dataclass
class _TarIndex:
    """A tar's entries by clean name as tar extracts them: the last entry of a name is the one. A hard link leads to
    the file its target named when the link was stored (as tarfile finds it): `tar cf x.tar d d` stores d/a twice,
    the second time as a hard link to d/a, which read as a link to itself, a loop."""

    files: dict[str, tarfile.TarInfo] = field(default_factory=dict)  # clean name -> regular member
    last_links: dict[str, tarfile.TarInfo] = field(default_factory=dict)  # clean name -> link
    links: list[tarfile.TarInfo] = field(default_factory=list)  # every link, in stored order
    hard_targets: dict[tarfile.TarInfo, tarfile.TarInfo] = field(default_factory=dict)  # hard link -> file then

    def add(self, m: tarfile.TarInfo) -> None:
        name = _checked(m.name)[0]
        if m.isfile() and name is not None:
            self.last_links.pop(name, None)
            self.files[name] = m
        elif m.islnk() or m.issym():
            self.links.append(m)
            target = self.files.get(_checked(m.linkname)[0] or "") if m.islnk() else None
            if target is not None:
                self.hard_targets[m] = target
            if name is not None:
                self.files.pop(name, None)
                self.last_links[name] = m

    def is_last(self, m: tarfile.TarInfo) -> bool:
        """Whether an entry is the last of its name (one whose name is refused is always listed, to be reported)."""
        name = _checked(m.name)[0]
        return name is None or (self.files.get(name) or self.last_links.get(name)) is m

    def final_links(self) -> list[tarfile.TarInfo]:
        return [m for m in self.links if self.is_last(m)]


def _tar_members(path: str | os.PathLike[str], kind: str) -> Iterator[Member]:
    """A tar's members (see iter_members). An uncompressed tar's headers are read first (random access, no member's
    bytes), so only the last entry of a name is yielded; a compressed one yields each as it streams by."""
    index = _TarIndex()
    with open_regular(path) as f, tarfile.open(fileobj=f, mode="r:" if kind == "tar" else "r|*") as tf:
        headers, damage = _headers(tf, index) if kind == "tar" else (tf, None)
        for m in headers:
            if kind == "targz":
                index.add(m)
            if m.isfile() and (kind == "targz" or index.is_last(m)):
                offset = m.offset_data if kind == "tar" else None
                yield Member(*_checked(m.name), m.name, m.size, offset, functools.partial(tf.extractfile, m))
        if damage is not None:
            raise damage
        found, refused = tar_links(index.final_links(), index.files, index.hard_targets, TAR_REPACK)
        yield from refused
        if kind == "tar":  # random access: a link reads its target's bytes where they are
            for name, link, target in found:
                opener = functools.partial(tf.extractfile, target)
                yield Member(name, None, link.name, target.size, target.offset_data, opener, is_link=True)
    if kind == "targz":  # a link to the file of its own name that went by (tar cf x.tgz d d) was read there
        again = [(name, link, target) for name, link, target in found if _checked(target.name)[0] != name]
        if again:
            yield from _streamed_links(path, again)


def _headers(tf: tarfile.TarFile, index: _TarIndex) -> tuple[list[tarfile.TarInfo], Exception | None]:
    """An uncompressed tar's headers, read ahead (no member's bytes), each added to index, and the error that ended
    them early if one did: the members before the damage are still listed, as a streamed tar's are."""
    headers: list[tarfile.TarInfo] = []
    try:
        for m in tf:
            index.add(m)
            headers.append(m)
    except ARCHIVE_ERRORS as e:
        return headers, e
    return headers, None


def tar_links(
    links: list[tarfile.TarInfo],
    files: dict[str, Any],
    hard_targets: dict[tarfile.TarInfo, tarfile.TarInfo],
    repack: str,
) -> tuple[list[Linked], list[Member]]:
    """Each hard or symbolic link of a tar (or zip) that leads to a regular member (through other links too), and a
    refused Member for each that leads outside the archive (an absolute target, or '..' past its top), into a loop,
    or to nothing it holds: as tarfile's data filter, never followed onto this machine's files. A link to a folder of
    the archive is passed over: that folder's files are listed under their own names, as walk_files lists a folder
    reached twice once; a hidden folder's are listed under the link's name (see _hidden_folders). `hard_targets`:
    hard links already bound to a file (see _TarIndex); `repack` is what the message of a link out of the archive
    tells the user to do."""
    if not links:
        return [], []
    bound = {name: hard_targets[link] for link in links if (name := _checked(link.name)[0]) and link in hard_targets}
    targets = {name: link for link in links if (name := _checked(link.name)[0]) is not None and name not in bound}
    readable = files | bound
    # a folder holding only links (a Hugging Face snapshot's files link into blobs/) is a folder of the archive too
    folders = {name.rsplit("/", k)[0] for name in (*readable, *targets) for k in range(1, name.count("/") + 1)} | {""}
    found: list[Linked] = []
    refused: list[Member] = []
    into_hidden: list[tuple[str, tarfile.TarInfo, str]] = []  # (link's name, link, the hidden folder it leads to)
    for link in links:
        name, problem = _checked(link.name)
        if name is not None:
            try:
                end = name if name in bound else _follow(name, targets)
            except UnsafeMemberNameError as e:
                problem = f"a link to {link.linkname}, which {e}, not read ({repack})"
            else:
                if end in readable:
                    found.append((name, link, readable[end]))
                    continue
                if end in folders:
                    if is_hidden(end) and not is_hidden(name):
                        into_hidden.append((name, link, end))
                    continue
                problem = f"a link to {link.linkname}, which the archive does not hold, not read"
        refused.append(Member(None, problem, link.name, 0, None, _unreadable, is_link=True))
    return found + _hidden_folders(into_hidden, readable, targets), refused


def _hidden_folders(
    into_hidden: list[tuple[str, tarfile.TarInfo, str]], readable: dict[str, Any], targets: dict[str, tarfile.TarInfo]
) -> list[Linked]:
    """The files of each hidden folder a visible link leads to, under the link's name ("cat" -> ".store/cat" lists
    .store/cat/1.png as cat/1.png). On disk walk_files reads them so, and never by their hidden names; the archive's
    listing passed them over, so a class folder linked into a .dvc or .cache store was read from a folder and lost
    from its tar. Each folder once, by the first link to it by name, as walk_files walks a folder reached twice."""
    found: list[Linked] = []
    taken: list[str] = []
    for name, link, end in sorted(into_hidden, key=lambda entry: entry[0]):
        if any(_within(end, other) or _within(other, end) for other in taken):
            continue
        taken.append(end)
        prefix = f"{end}/"
        for inner in sorted(n for n in (*readable, *targets) if n.startswith(prefix)):
            try:
                file = inner if inner in readable else _follow(inner, targets)
            except UnsafeMemberNameError:
                continue  # a link in it that leads out of the archive: not read, and hidden where it is stored
            if file in readable:
                found.append((f"{name}/{inner[len(prefix) :]}", link, readable[file]))
    return found


def _within(name: str, folder: str) -> bool:
    return name == folder or name.startswith(f"{folder}/")


def _follow(name: str, links: dict[str, tarfile.TarInfo]) -> str:
    """A clean name with every link along it replaced by where it leads (a link inside a linked folder too).
    UnsafeMemberNameError when that leads outside the archive or around a loop."""
    for _ in range(MAX_LINK_HOPS):
        parts = name.split("/")
        heads = ("/".join(parts[:i]) for i in range(len(parts), 0, -1))
        head = next((h for h in heads if h in links), None)
        if head is None:
            return name
        link = links[head]
        target = link.linkname.replace("\\", "/")
        if target.startswith("/") or (len(target) > 1 and target[1] == ":" and target[0].isalpha()):
            raise UnsafeMemberNameError("leads outside the archive")
        # a hard link names its target from the archive's top, a symbolic link from its own folder (as tarfile reads)
        base = "" if link.islnk() else posixpath.dirname(head)
        name = posixpath.normpath(posixpath.join(base, target, name[len(head) + 1 :]))
        if name == ".." or name.startswith("../"):
            raise UnsafeMemberNameError("leads outside the archive")
        name = "" if name == "." else name
    raise UnsafeMemberNameError("is a loop of links")


def _streamed_links(path: str | os.PathLike[str], found: list[Linked]) -> Iterator[Member]:
    """The links of a compressed tar, read in a second pass over it: their targets' bytes went by in the first. The
    pass ends at the last target: a gzip stream has no random access, so what comes before it is decompressed again."""
    wanted: dict[int, list[tuple[str, tarfile.TarInfo]]] = {}  # a target's header offset -> the links to it
    for name, link, target in found:
        wanted.setdefault(target.offset, []).append((name, link))
    last = max(wanted)
    with open_regular(path) as f, tarfile.open(fileobj=f, mode="r|*") as tf:
        for m in tf:
            if m.offset in wanted and m.isfile():
                data = tf.extractfile(m).read()
                for name, link in wanted[m.offset]:
                    yield Member(name, None, link.name, len(data), None, lambda d=data: io.BytesIO(d), is_link=True)
            if m.offset >= last:
                return


def _unreadable() -> IO[bytes]:
    raise OSError(errno.ENOENT, "a link that leads to no member of its archive")


def reported(member: Member, wanted: Callable[[str], bool]) -> bool:
    """Whether a refused member (name None) is one to report: a name `wanted` takes, or a link without an
    extension, which may be a folder of such files (a class folder packed as a link to outside the archive). A
    hidden one is not, as walk_files never looks at it on disk: a packed .venv's bin/python -> /usr/bin/python3
    was counted as an undecodable file of the dataset."""
    parts = member.raw.replace("\\", "/").split("/")
    if is_hidden("/".join(p for p in parts if p not in ("", ".", ".."))):
        return False
    return wanted(member.raw) or (member.is_link and not posixpath.splitext(member.raw.rstrip("/"))[1])


def wanted_members(
    path: str | os.PathLike[str], kind: str, wanted: Callable[[str], bool], refused: list[str]
) -> Iterator[tuple[str, bytes]]:
    """(clean name, bytes) of each archive member whose name `wanted` takes, hidden ones (a Mac zip's
    __MACOSX/._x copies, .DS_Store) left out. A wanted member whose name cannot be used (absolute, or with '..')
    is added to `refused` as "name: why", for the caller's report. Raises ARCHIVE_ERRORS as iter_members does.
    A compressed tar is read in one pass, so a name stored twice comes once per entry, the later last: a caller
    keeps the last one it is given, as tar extracts it, rather than this holding the archive's bytes."""
    for member in iter_members(path, kind):
        if member.name is None:
            if reported(member, wanted):
                refused.append(f"{member.raw}: {member.problem}")
        elif not is_hidden(member.name) and wanted(member.name):
            with member.open() as f:
                yield member.name, f.read()


def zip_name(info: zipfile.ZipInfo) -> str:
    """A zip member's name as its writer meant it. Without the UTF-8 flag (bit 11) zipfile decodes the name as
    cp437, but Info-ZIP's `zip` and macOS write UTF-8 names without setting it: "zéro" would read "z├⌐ro". Such
    a name is taken as UTF-8 when its bytes are valid UTF-8, as cp437 otherwise."""
    if info.flag_bits & 0x800:
        return info.filename
    try:
        return info.filename.encode("cp437").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        return info.filename


def _checked(raw: str) -> tuple[str | None, str | None]:
    try:
        return clean_member_name(raw), None
    except UnsafeMemberNameError as e:
        return None, str(e)


def update_hash(h: Any, path: str | os.PathLike[str]) -> None:
    """Feed a regular file's bytes to a hashlib object, 1 MB at a time."""
    with open_regular(path) as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)


def content_digest(path: str | os.PathLike[str]) -> str:
    """A sha256 hex digest that changes when the content does, to key caches of decoded data.

    A folder: over (relative name, size, mtime_ns) of every file walk_files lists, sorted, since reading every byte
    of 60,000 small files takes too long. A file of up to HASHED_BYTES (a metadata.csv, an IDX file): over its
    bytes, which takes milliseconds and sees a rewrite that kept its size within a coarse clock tick (FAT's 2 s,
    HFS+'s 1 s). A larger file (a zip or tar.gz of the dataset): over samples of its bytes and its stat
    (sampled_key), not all of them: hashing a 50 GB archive read it end to end before every run began. A file
    this process may not read is keyed as such (file_key): a chmod that makes it readable leaves its size and mtime.
    """
    h = hashlib.sha256()
    if os.path.isdir(path):
        for rel, full in sorted(walk_files(path)):  # an unreadable folder is said: a cached run lists nothing
            h.update(file_key(rel, full).encode())
        return h.hexdigest()
    st = os.stat(path)
    if stat.S_ISREG(st.st_mode) and st.st_size > HASHED_BYTES:
        sampled_key(h, path)
    else:
        update_hash(h, path)
    return h.hexdigest()


def sampled_key(h: Any, path: str | os.PathLike[str]) -> None:
    """Feed a large file's key to a hashlib object: its resolved path, size, mtime_ns and inode, and its first and
    last SAMPLED_ENDS bytes with SAMPLED_BLOCKS blocks spread between them (under 1.5 MiB read). Size and mtime alone
    reused a stale cache for an archive replaced by one of the same size with its mtime kept (cp -p, rsync -t, a
    release unpacked); the samples see a changed zip's central directory (every member's CRC) and most rewrites.
    Neither the change time nor the inode, which every copy sets: a dataset copied again to a job's scratch with
    its mtimes kept (cp -a, rsync -a) keeps its cache entry. A file this process may not read is keyed as such."""
    if not os.access(path, os.R_OK):
        h.update(file_key(os.path.realpath(path), path).encode())
        return
    with open_regular(path) as f:
        st = os.fstat(f.fileno())
        size = st.st_size
        h.update(f"file\0{os.path.realpath(path)}\0{size}\0{st.st_mtime_ns}\0".encode())
        step = max(0, size - 2 * SAMPLED_ENDS) // (SAMPLED_BLOCKS + 1)
        samples = [(0, SAMPLED_ENDS)]
        samples += [(SAMPLED_ENDS + k * step, SAMPLED_BLOCK) for k in range(1, SAMPLED_BLOCKS + 1)]
        samples.append((max(0, size - SAMPLED_ENDS), SAMPLED_ENDS))
        for offset, length in samples:
            f.seek(offset)
            h.update(f.read(length))


def file_key(name: str, path: str | os.PathLike[str]) -> str:
    """A file's line of a cache key: its name, size and mtime_ns, and a mark when this process may not read it. A
    file skipped as unreadable (permissions) was cached as skipped, and the chmod that fixed it changes neither size
    nor mtime: every later run read the cache and left it out. A readable file's line is as before (caches kept)."""
    st = os.stat(path)
    unreadable = "" if os.access(path, os.R_OK) else "\0unreadable"
    return f"{name}\0{st.st_size}\0{st.st_mtime_ns}{unreadable}\n"


def json_type(value: Any) -> str:
    """What a JSON value is, in the words a message uses."""
    names = {bool: "boolean", int: "number", float: "number", str: "string", list: "list", type(None): "null"}
    return names.get(type(value), "value")


def jsonl_objects(text: str, where: str, wanted: str = "an object with fields") -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) of each non-blank line of JSON lines; a line that is not JSON, or not a JSON
    object, is one sentence naming `where` and the line (`wanted`: what an object there holds)."""
    rows = []
    for number, line in enumerate(text.split("\n"), 1):  # "\n" only: U+2028 or NEL may sit inside a JSON string
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(
                f"{where} line {number} is not valid JSON ({e.msg} at column {e.colno}); fix that line."
            ) from None
        if not isinstance(row, dict):
            raise UserError(f"{where} line {number} is a JSON {json_type(row)}, not {wanted}.")
        rows.append((number, row))
    return rows


def csv_objects(text: str, where: str, whole: bool = True) -> list[tuple[int, dict[str, Any]]]:
    """(line number, row by the header's column names) of each row of a CSV with a header, numbered by the line the
    row starts on: csv's line_num is the line it ends on, and a quoted field over several lines named its last. Lines
    end in \\n, \\r\\n or a lone \\r (Excel for Mac's "CSV (Macintosh)"), as csv reads a file opened with newline="".
    A row with more fields than the header (a caption or label with an unquoted comma) is one sentence naming `where`
    and the line: the field before it would be cut at the comma. `whole` False: `text` is a file's head, cut at a
    line end, where a quoted field over several lines may be cut open."""
    reader = csv.reader(io.StringIO(text, newline=""))
    header: list[str] | None = None
    rows = []
    start = last = 1
    try:
        for row in reader:
            if row and header is None:
                header = row
            elif row:
                if len(row) > len(header):
                    raise UserError(
                        f"{where} line {start} has {len(row) - len(header)} more field(s) than its header's "
                        f"{len(header)} columns; put a field that holds a comma in double quotes "
                        '("a dog, running").'
                    )
                rows.append((start, dict(itertools.zip_longest(header, row))))
            last, start = start, reader.line_num + 1  # the next row starts on the line after this one's last
    except csv.Error as e:
        raise UserError(f"{where} line {start} is not valid CSV ({e}); fix that line.") from None
    if whole and rows and _quote_left_open(text, last):
        raise UserError(
            f"{where} line {last} opens a double quote that no later line closes, so every line after it was read as "
            'one field; close it, or write a quote inside a quoted field as two ("").'
        )
    return rows


def _quote_left_open(text: str, start: int) -> bool:
    """Whether the CSV row starting on line `start`, its last, runs to the end of `text` inside an open quote: csv
    reads an unclosed quote to the end of the file without a word, and the rows after it were lost in one field."""
    rest = "".join(io.StringIO(text, newline="").readlines()[start - 1 :])
    try:
        for _ in csv.reader(io.StringIO(rest, newline=""), strict=True):
            pass
    except csv.Error as e:
        return "unexpected end of data" in str(e)
    return False


def write_jsonl(rows: list[dict[str, Any]], path: str | os.PathLike) -> None:
    """One JSON object per line (predictions, completions), UTF-8, the folder made if needed. Written beside and
    renamed into place: a write that fails (a full disk, a stopped run) leaves an earlier file of that name whole. A
    file name that is not UTF-8 on disk (Python holds its bytes as lone surrogates) is written as the JSON escape
    \\udcXX, which reads back as that name: it stopped the write after a whole run's inference."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8", errors="backslashreplace") as f:
            for row in rows:
                f.write(json.dumps(strict_json(row), ensure_ascii=False) + "\n")
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
