"""Capsule tars: safe reading (for verify and import) and writing (export).

Rules for reading, which distrusts every member:
  * Names are relative, without ``..``; a leading ``./`` is allowed (tar -C
    DIR -cf x.tar . writes it). Absolute names, ``..``, links (symbolic or
    hard), devices and fifos are problems, as are duplicate members and
    members over ``max_member`` bytes (or a total over ``max_total``).
  * Nothing outside the destination is ever written: import writes only
    into a fresh staging directory of the store, with O_EXCL|O_NOFOLLOW,
    and only members that passed the checks.
  * Compression is recognised by magic bytes: zstd, gzip, or plain.

Writing: members in a fixed order (directories, files, blobs, then
manifest.json and manifest.sig last, so the manifest digests exactly the
bytes written before it), owner 0:0, modes 0755/0644, one mtime.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import BinaryIO

from . import format as fmt
from .capsule import KEEP_BYTES, KEEP_LIMIT, Entry, Listing, Problem
from .errors import FormatError, ImportRefused, UnsafePathError
from .fsutil import atomic_writer, makedirs_durable

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
GZIP_MAGIC = b"\x1f\x8b"
DEFAULT_MAX_MEMBER = 64 << 30
DEFAULT_MAX_TOTAL = 256 << 30
COPY_CHUNK = 1 << 20
#: Bytes an extraction leaves free on the file system it writes to.
FREE_MARGIN = 64 << 20


@contextmanager
def open_tar_stream(path: str) -> Iterator[tarfile.TarFile]:
    """Open a capsule tar for one streaming pass, whatever its compression."""
    with ExitStack() as stack:
        raw = stack.enter_context(open(path, "rb"))
        magic = raw.read(4)
        raw.seek(0)
        if magic.startswith(ZSTD_MAGIC):
            import zstandard

            stream: BinaryIO = stack.enter_context(zstandard.ZstdDecompressor().stream_reader(raw))  # type: ignore[assignment]
            mode = "r|"
        elif magic.startswith(GZIP_MAGIC):
            stream, mode = raw, "r|gz"
        else:
            stream, mode = raw, "r|"
        try:
            tf = stack.enter_context(tarfile.open(fileobj=stream, mode=mode))  # type: ignore[call-overload]
        except tarfile.TarError as exc:
            raise FormatError(f"{path} is not a readable tar: {exc}") from None
        yield tf


def member_path(name: str) -> str | None:
    """The capsule path of a tar member name, None for the root ('.' or './')."""
    while name.startswith("./"):
        name = name[2:]
    name = name.rstrip("/")
    if name in ("", "."):
        return None
    return fmt.check_relpath(name, "tar member")


#: A sink receives each accepted regular file: (capsule path, size, stream)
#: and returns its sha256 after consuming exactly ``size`` bytes.
Sink = Callable[[str, int, BinaryIO], str]


def _hash_only(_path: str, _size: int, f: BinaryIO) -> str:
    h = hashlib.sha256()
    while chunk := f.read(COPY_CHUNK):
        h.update(chunk)
    return h.hexdigest()


def scan_tar(
    path: str,
    sink: Sink = _hash_only,
    *,
    max_member: int = DEFAULT_MAX_MEMBER,
    max_total: int = DEFAULT_MAX_TOTAL,
) -> Listing:
    """Walk a capsule tar once, judging each member; hand good files to ``sink``."""
    listing = Listing()
    total = 0
    try:
        with open_tar_stream(path) as tf:
            for m in tf:
                try:
                    rel = member_path(m.name)
                except UnsafePathError as exc:
                    listing.problems.append(Problem(m.name, "unsafe", f"unsafe path: {exc}"))
                    continue
                if rel is None:
                    continue
                if rel in listing.entries:
                    listing.problems.append(Problem(rel, "duplicate", "appears more than once in the tar"))
                    continue
                if m.isdir():
                    listing.entries[rel] = Entry("dir")
                    continue
                if m.issym() or m.islnk():
                    listing.problems.append(Problem(rel, "type", f"is a {'symbolic' if m.issym() else 'hard'} link to {m.linkname!r}; links are not allowed"))
                    continue
                if not m.isreg():
                    listing.problems.append(Problem(rel, "type", "is a device, fifo or other special entry; not allowed"))
                    continue
                if m.size > max_member:
                    listing.problems.append(Problem(rel, "size", f"is {m.size} bytes, over the limit of {max_member}"))
                    continue
                total += m.size
                if total > max_total:
                    listing.problems.append(Problem(rel, "size", f"the tar holds more than {max_total} bytes in all"))
                    break
                parent = rel.rsplit("/", 1)[0] if "/" in rel else None
                if parent is not None and listing.entries.get(parent, Entry("dir")).kind == "file":
                    listing.problems.append(Problem(rel, "unsafe", f"its parent {parent} is a file"))
                    continue
                f = tf.extractfile(m)
                assert f is not None
                keep = (rel in KEEP_BYTES or rel == fmt.MANIFEST) and m.size <= KEEP_LIMIT
                if keep:
                    data = f.read()
                    listing.contents[rel] = data
                    sha = sink(rel, m.size, io.BytesIO(data))
                else:
                    sha = sink(rel, m.size, f)  # type: ignore[arg-type]
                listing.entries[rel] = Entry("file", m.size, sha)
    except (tarfile.TarError, EOFError) as exc:
        listing.problems.append(Problem("", "tar", f"the tar is damaged or truncated: {exc}"))
    except OSError as exc:
        if exc.filename is None and isinstance(exc, (FileNotFoundError, PermissionError)):
            raise
        listing.problems.append(Problem("", "tar", f"cannot read the tar: {exc}"))
    return listing


# -- writing -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Member:
    """One file to export: its capsule path, size, and a way to open it."""

    path: str
    size: int
    open: Callable[[], BinaryIO]


def _compressor_for(path: str) -> str:
    lower = path.lower()
    if lower.endswith((".zst", ".zstd")):
        return "zstd"
    if lower.endswith((".gz", ".tgz")):
        return "gzip"
    return "plain"


def write_tar(dest: str, members: Iterable[Member], *, mtime: int) -> None:
    """Atomically write a capsule tar at ``dest`` from ``members`` (in order).

    Directories are emitted as needed. If reading any member fails (e.g. a
    corrupt blob), nothing is left at ``dest``.
    """
    kind = _compressor_for(dest)
    with atomic_writer(dest) as out, ExitStack() as stack:
        if kind == "zstd":
            import zstandard

            sink: BinaryIO = stack.enter_context(zstandard.ZstdCompressor(level=3, threads=-1).stream_writer(out, closefd=False))  # type: ignore[assignment]
            mode = "w|"
        elif kind == "gzip":
            sink, mode = out, "w|gz"
        else:
            sink, mode = out, "w|"
        tf = stack.enter_context(tarfile.open(fileobj=sink, mode=mode, format=tarfile.PAX_FORMAT))  # type: ignore[call-overload]
        seen_dirs: set[str] = set()
        for m in members:
            parts = m.path.split("/")[:-1]
            for i in range(1, len(parts) + 1):
                d = "/".join(parts[:i])
                if d not in seen_dirs:
                    seen_dirs.add(d)
                    ti = tarfile.TarInfo(d)
                    ti.type, ti.mode, ti.mtime = tarfile.DIRTYPE, 0o755, mtime
                    tf.addfile(ti)
            ti = tarfile.TarInfo(m.path)
            ti.size, ti.mode, ti.mtime = m.size, 0o644, mtime
            with m.open() as f:
                tf.addfile(ti, _Exact(f, m.size, m.path))


class _Exact(io.RawIOBase):
    """Read exactly ``size`` bytes of ``f``; a short file is an error, not zero padding."""

    def __init__(self, f: BinaryIO, size: int, path: str) -> None:
        self._f, self._left, self._path = f, size, path

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        if n < 0 or n > self._left:
            n = self._left
        data = self._f.read(n)
        if len(data) < n:
            raise FormatError(f"{self._path} shrank while it was exported")
        self._left -= len(data)
        return data


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still use on the file system of ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def extract_into(root: str, *, free: Callable[[str], int] = free_bytes) -> Sink:
    """A sink that writes each file under ``root`` (a fresh, private directory).

    A file that would leave less than ``FREE_MARGIN`` bytes free on the file
    system is refused (ImportRefused) from its size, before any byte of it is
    written: a compressed tar expands without bound (a tar bomb), and the
    state directory's disk is the one every agent's journal appends to."""

    def sink(rel: str, size: int, f: BinaryIO) -> str:
        left = free(root)
        if size > left - FREE_MARGIN:
            raise ImportRefused(f"{rel} is {size} bytes, but only {max(left, 0)} bytes are free in {root} "
                                f"(and {FREE_MARGIN} are kept free); nothing was kept")
        dest = os.path.join(root, rel)
        makedirs_durable(os.path.dirname(dest))
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            while chunk := f.read(COPY_CHUNK):
                h.update(chunk)
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        return h.hexdigest()

    return sink
