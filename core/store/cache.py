"""The local store as a cache of the fleet's blob tier: which listed blobs ``gc --tier-cache`` deletes.

Rules:
  * Only blobs that a manifest here lists (an agent's, a snapshot's) are
    candidates, and only those the eviction rule (:class:`Evictable`, given
    by the caller: capsulefs/fleet/cache.py ``EvictionPolicy``) says the tier
    holds. A blob a staging area names (a move or an offer in flight, an
    export reading it) is never a candidate; nor is anything not in
    ``objects/`` (the journal and the memory files live in ``agents/``).
  * Coldest first: a blob's coldness is its object's access time
    (``st_atime``), which :meth:`BlobStore.touch_blob` sets on a read at
    most once a day (``TOUCH_EVERY``) whatever the file system's atime
    option; ties are broken by name, so the order is total.
  * Candidates are deleted until the listed blobs kept locally fit the
    limit; if the blobs that may not go are larger than the limit alone,
    every candidate goes and the report says the cache is over its limit.
  * A blob missing from ``objects/`` that the tier record names was
    evicted (a reader fetches it back: capsulefs/fleet/cache.py); one the
    record does not name is lost.

Theory of operation: :func:`choose_evictions` is the pure order;
``HostStore.gc_tier_cache`` gathers the sizes and atimes under gc's
exclusive lock and deletes what it returns.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Protocol

from ..errors import CapsuleError
from ..frozen import Frozen

__all__ = ["CacheReport", "Evictable", "SizeError", "choose_evictions", "parse_size"]

#: Seconds between two touches of a blob's access time by its readers (coarse on purpose: one
#: ``utime`` a day at most, so a read stays a read and not a metadata write).
TOUCH_EVERY = 24 * 3600

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"([0-9]{1,15})([KMGT]?)(?:I?B)?", re.ASCII)
MAX_SIZE = 1 << 60  # bytes: anything larger is a typo


class SizeError(CapsuleError):
    """A size given on the command line does not parse."""


def parse_size(text: str) -> int:
    """``10G``, ``500M``, ``64K``, ``1T``, ``123`` (bytes), each unit a power of
    1024; an optional ``B``/``iB`` after the unit, upper or lower case. One
    :class:`SizeError` line otherwise."""
    shown = text[:16] + ("..." if len(text) > 16 else "")
    m = _SIZE.fullmatch(text.strip().upper()) if len(text) <= 40 else None
    if m is None:
        raise SizeError(f"size {shown!r} is not a number of bytes with an optional unit K, M, G or T (like 10G)")
    size = int(m.group(1)) * _UNITS[m.group(2)]
    if size > MAX_SIZE:
        raise SizeError(f"size {shown!r} is larger than {MAX_SIZE} bytes")
    return size


class Evictable(Protocol):
    """The one rule of which local copies may go (capsulefs/fleet/cache.py ``EvictionPolicy``)."""

    def may_evict(self, sha256: str) -> bool: ...


class CacheReport(Frozen):
    """What ``gc --tier-cache`` evicted, and what the cache holds after it."""

    __slots__ = ("evicted", "evicted_bytes", "cached_bytes", "limit")
    evicted: int  # listed blobs whose local copy was deleted (the tier holds them)
    evicted_bytes: int
    cached_bytes: int  # bytes of listed blobs kept locally after gc
    limit: int  # the SIZE asked for

    def __init__(self, *, evicted: int, evicted_bytes: int, cached_bytes: int, limit: int) -> None:
        object.__setattr__(self, "evicted", evicted)
        object.__setattr__(self, "evicted_bytes", evicted_bytes)
        object.__setattr__(self, "cached_bytes", cached_bytes)
        object.__setattr__(self, "limit", limit)

    @property
    def over(self) -> bool:
        """The blobs that may not go are more than the limit alone."""
        return self.cached_bytes > self.limit


def choose_evictions(sizes: Mapping[str, int], atimes: Mapping[str, int], candidates: set[str],
                     limit: int) -> list[str]:
    """Which of ``candidates`` to delete, coldest first, so that the blobs of
    ``sizes`` (every listed blob kept locally) fit ``limit`` bytes. ``atimes``:
    each candidate's last read (ns)."""
    total = sum(sizes.values())
    chosen: list[str] = []
    for sha in sorted(candidates, key=lambda s: (atimes[s], s)):
        if total <= limit:
            break
        chosen.append(sha)
        total -= sizes[sha]
    return chosen
