"""Writing a capsule tar (export).

Writing: manifest.json and manifest.sig first, then the other files, then
blobs; directories as needed; owner 0:0, modes 0755/0644, one mtime. The
manifest is computed before the tar is written, and a member whose bytes
are not the ones it lists (a blob that rotted) aborts the export.
"""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import BinaryIO

from ..errors import CapsuleError, FormatError
from ..fsutil import atomic_writer


@dataclass(frozen=True, slots=True)
class Member:
    """One file to export: its capsule path, size, and a way to open it."""

    path: str
    size: int
    open: Callable[[], BinaryIO]


#: The names export and merge write a tar to, by their ending (any case), and
#: the compression each ending says. Any other name is refused (a .zip named
#: file that holds a tar would mislead whoever opens it).
TAR_SUFFIXES = {".tar": "plain", ".tar.gz": "gzip", ".tgz": "gzip", ".tar.zst": "zstd", ".tar.zstd": "zstd"}


def tar_kind(path: str) -> str | None:
    """The compression a tar named ``path`` is written with, or None if the
    name is no tar name of :data:`TAR_SUFFIXES`."""
    lower = os.path.basename(path).lower()
    for suffix, kind in TAR_SUFFIXES.items():
        if lower.endswith(suffix):
            return kind
    return None


def _compressor_for(path: str) -> str:
    kind = tar_kind(path)
    if kind is None:
        raise CapsuleError(f"{path}: not a tar name; name it FILE.tar, FILE.tar.gz (or .tgz) or FILE.tar.zst")
    return kind


def write_tar(dest: str, members: Iterable[Member], *, mtime: int) -> None:
    """Atomically write a capsule tar at ``dest`` from ``members`` (in order).

    Directories are emitted as needed. If reading any member fails (e.g. a
    corrupt blob), nothing is left at ``dest``. The compression is the one
    its name says (:data:`TAR_SUFFIXES`); another name is refused before
    anything is written.
    """
    kind = _compressor_for(dest)
    with atomic_writer(dest) as out, ExitStack() as stack:
        if kind == "zstd":
            import zstandard

            sink: BinaryIO = stack.enter_context(zstandard.ZstdCompressor(level=3, threads=-1, write_checksum=True).stream_writer(out, closefd=False))
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
