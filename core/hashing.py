"""Hashing files and streams: sha256 with large buffers, in parallel.

Theory of operation: hashlib releases the GIL while hashing large buffers,
so hashing several files on a small thread pool uses every core; one file is
read with ``readinto`` into a reused 1 MiB buffer so no bytes are copied.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from typing import BinaryIO, TypeVar

CHUNK = 1 << 20
T = TypeVar("T")
R = TypeVar("R")


def hash_stream(f: BinaryIO) -> tuple[str, int]:
    """(sha256 hex, size) of everything left in ``f``."""
    import hashlib  # (here, not at import: it loads OpenSSL, which a command that hashes nothing need not)

    h = hashlib.sha256()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    size = 0
    while True:
        n = f.readinto(buf)  # type: ignore[attr-defined]
        if not n:
            break
        h.update(view[:n])
        size += n
    return h.hexdigest(), size


def hash_file(path: str | os.PathLike[str]) -> tuple[str, int]:
    with open(path, "rb", buffering=0) as f:
        return hash_stream(f)


def hash_fd(fd: int) -> tuple[str, int]:
    """(sha256 hex, size) of the whole file open as ``fd`` (read with pread:
    the descriptor's offset is left as it was)."""
    import hashlib

    h = hashlib.sha256()
    size = 0
    while data := os.pread(fd, CHUNK, size):
        h.update(data)
        size += len(data)
    return h.hexdigest(), size


def parallel_map(fn: Callable[[T], R], items: Iterable[T], workers: int | None = None) -> Iterator[R]:
    """``map`` over a small thread pool, results in input order."""
    items = list(items)
    workers = workers or min(4, (os.cpu_count() or 1) + 1)
    if len(items) < 2 or workers < 2:
        yield from map(fn, items)
        return
    from concurrent.futures import ThreadPoolExecutor  # (only where a pool is used: commands start faster)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        yield from pool.map(fn, items)
