"""The local store as a cache of the blob tier: which copies may go, and getting evicted ones back.

Rules:
  * :meth:`EvictionPolicy.may_evict` is the ONE rule of which local copies
    ``gc --tier-cache`` may delete (core/store/cache.py orders them): the
    fleet's rule, :func:`capsulefs.fleet.live.may_evict`, on the eviction
    record (``STATE/fleet-tier/<tier>.evictable``: blobs this host published
    as live and afterwards found in the tier with no tier gc's mark on them),
    read under the store's gc lock. The uploader's record of puts is not
    enough (docs/fleet.md, "The eviction rule").
  * A blob missing from the store that either record names was evicted
    (:meth:`TierCache.evicted`); one neither names is lost, and nothing
    fetches it.
  * :meth:`TierCache.ensure_local` gets the evicted blobs among those asked
    back from the tier before a reader reads them: each verified against
    its digest and size, stored through the store's durable path
    (``TierBlobs.fetch_into_store``). Blobs asked for at once by several
    readers are fetched once. The tier down, slow past its timeout, or
    wrong bytes: one :class:`BlobUnavailable` naming the blob and why, and
    nothing of it stored. Its readers: the mount's open (capsulefs/mount/ops.py),
    the sandbox build (capsulefs/agents/runtime.py), a move's source
    (capsulefs/move/source.py), ``capsulefs export``.
  * The fetches show in ``.control/metrics``: ``capsulefs_tier_cache_fetches_total{outcome}``
    and ``capsulefs_tier_cache_fetched_bytes_total``.

Theory of operation: the composition root (capsulefs/daemon/root.py), through
the fleet member, builds one :class:`TierCache` when the mount has a blob
tier and hands it to those readers (None without a tier); ``capsulefs
export`` builds its own for the command (:func:`host_tier_cache`).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager

import trio

from capsulefs.core import metrics
from capsulefs.core.errors import BlobUnavailable, CapsuleError
from capsulefs.core.store.host_store import HostStore
from capsulefs.fleet.tier import TierBlobs, TierFetchError
from capsulefs.fleet.tier_moves import KnownInTier
from capsulefs.fleet.live import EvictionRecord, may_evict
from capsulefs.fleet.uploader import TierRecord

log = logging.getLogger(__name__)

__all__ = ["EvictionPolicy", "TierCache", "open_tier_cache"]


class EvictionPolicy:
    """Which local copies of listed blobs ``gc --tier-cache`` may delete.

    THE one place of that rule (see the module's rules): a blob may be
    evicted only if the eviction record names it (:func:`may_evict` of
    capsulefs/fleet/live.py: this host published a live set naming it, then
    found it in the tier with no live mark); gc and everything else ask only
    this. The record is read at the first question, which
    ``HostStore.gc_tier_cache`` asks under the store's gc lock: the live set
    publisher shrinks the record under that lock, so the answers are those
    of one moment of the record, never of one read before a blob was
    dropped from it."""

    def __init__(self, record: EvictionRecord) -> None:
        self._record = record
        self._evictable: frozenset[str] | None = None

    def may_evict(self, sha256: str) -> bool:
        if self._evictable is None:
            self._evictable = self._record.load()
        return may_evict(self._evictable, sha256)


class TierCache:
    """The store's evicted blobs, got back from the tier for a reader (see the rules)."""

    def __init__(self, blobs: TierBlobs, store: HostStore, record: TierRecord, evictable: EvictionRecord, *,
                 known: KnownInTier | None = None) -> None:
        self._blobs = blobs
        self._store = store
        self._records: tuple[TierRecord | EvictionRecord, ...] = (record, evictable)
        self._known_to = known
        self._recorded: set[str] = set()
        self._recorded_at: tuple[tuple[int, int] | None, ...] = ()  # the records' files' (size, mtime) when read
        self._lock = threading.Lock()  # guards the two above (the view asks on the loop, readers in threads)
        self._fetching: dict[str, trio.Event] = {}
        self._failed: dict[str, str] = {}  # why the last fetch of a blob failed (for its waiters)

    # -- evicted or lost -------------------------------------------------------------
    def evicted(self, sha256: str) -> bool:
        """Missing here and named by the tier record (sync, quick: the record is
        re-read only when its file changed)."""
        return not self._store.has_blob(sha256) and sha256 in self._known()

    def _known(self) -> set[str]:
        """The records' digests (the uploader's and the eviction record), read
        again only if one of their files changed (any thread)."""
        with self._lock:
            at = tuple(_size_and_mtime(r.path) for r in self._records)
            if at != self._recorded_at:
                known: set[str] = set()
                for r in self._records:
                    known |= r.load()
                self._recorded, self._recorded_at = known, at
            return self._recorded

    # -- getting them back ----------------------------------------------------------------
    async def ensure_local(self, sizes: Mapping[str, int]) -> None:
        """Every blob of ``sizes`` (digest -> size, from a manifest) is in the
        store on return; the evicted ones were fetched from the tier.
        BlobUnavailable naming the first that is not (lost, or the tier
        could not give it)."""
        missing = await trio.to_thread.run_sync(self._missing, dict(sizes))
        if not missing:
            return
        known = await trio.to_thread.run_sync(self._known)
        lost = [sha for sha in missing if sha not in known]
        if lost:
            raise BlobUnavailable(f"blob {lost[0]} is not in the store, and the blob tier record does not name it "
                                  f"(lost, not evicted): nothing to fetch it from")
        mine = {sha: size for sha, size in missing.items() if sha not in self._fetching}
        theirs = [self._fetching[sha] for sha in missing if sha not in mine]
        if mine:
            await self._fetch(mine)
        for done in theirs:
            await done.wait()
        still = await trio.to_thread.run_sync(self._missing, missing)
        if still:
            sha = next(iter(still))
            why = self._failed.get(sha, "the blob tier did not give it")
            raise BlobUnavailable(f"blob {sha}: evicted here and not fetched from the blob tier: {why}")

    def _missing(self, sizes: dict[str, int]) -> dict[str, int]:
        return {sha: size for sha, size in sizes.items() if not self._store.has_blob(sha)}

    async def _fetch(self, sizes: dict[str, int]) -> None:
        events = {sha: trio.Event() for sha in sizes}
        self._fetching.update(events)
        try:
            log.info("blob tier: fetching %d evicted blob(s) back for a reader (%s%s)", len(sizes),
                     next(iter(sizes)), ", ..." if len(sizes) > 1 else "")
            if self._known_to is not None:
                self._known_to.known(sizes)  # (in the tier: the uploader never puts them back)
            try:
                report = await self._blobs.fetch_into_store(sizes)
            except TierFetchError as exc:
                report = exc.report
                self._fail(sizes, report.fetched, str(exc))
            except CapsuleError as exc:  # (the tier down, refusing)
                self._fail(sizes, [], str(exc))
                return
            for sha in report.fetched:
                self._failed.pop(sha, None)
            if report.fetched:
                metrics.TIER_CACHE_FETCHES.inc("fetched", by=len(report.fetched))
                metrics.TIER_CACHE_BYTES.inc(by=report.bytes)
                log.info("blob tier: %d evicted blob(s), %d bytes, fetched back into the store",
                         len(report.fetched), report.bytes)
        finally:
            for sha, event in events.items():
                del self._fetching[sha]
                event.set()

    def _fail(self, sizes: Iterable[str], fetched: list[str], why: str) -> None:
        failed = [sha for sha in sizes if sha not in fetched]
        metrics.TIER_CACHE_FETCHES.inc("failed", by=len(failed))
        for sha in failed:
            self._failed[sha] = why
            log.error("blob %s: evicted here and not fetched from the blob tier: %s", sha, why)


@asynccontextmanager
async def host_tier_cache(store: HostStore) -> AsyncIterator[TierCache | None]:
    """The tier cache of the host whose state directory ``store`` is, for one
    command (``capsulefs export``): None if its ``fleet.json`` names no tier."""
    from capsulefs.core.fleet import config as fleet_config

    cfg = fleet_config.load(store.root)
    if cfg is None or cfg.blobs is None:
        yield None
        return
    async with open_tier_cache(store, cfg.blobs) as cache:
        yield cache


@asynccontextmanager
async def open_tier_cache(store: HostStore, tier_url: str, *, timeout: float = 60.0) -> AsyncIterator[TierCache]:
    """A :class:`TierCache` for one command (``capsulefs export``), with its own
    connection pool, closed on exit. Credentials as ``fleet check-blobs`` takes them."""
    from capsulefs.core.fleet.s3_wire import parse_tier_url
    from capsulefs.fleet.credentials import tier_credentials, tier_region
    from capsulefs.fleet.s3 import BlobTier, open_s3

    tier = parse_tier_url(tier_url)
    creds = tier_credentials(store.root)
    async with open_s3(tier, creds, region=tier_region(), timeout=timeout) as s3:
        yield TierCache(TierBlobs(BlobTier(s3), store), store, TierRecord(store.root, str(tier)),
                        EvictionRecord(store.root, str(tier)))


def _size_and_mtime(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_size, st.st_mtime_ns)
