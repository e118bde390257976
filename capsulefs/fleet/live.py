"""This host's live set, published for the fleet's gc of the blob tier; marks; the eviction rule.

Rules (the argument is docs/fleet.md's "The fleet's gc of the blob tier"):
  * :class:`LivePublisher` (a daemon service with ``--blobs``) computes the
    blobs every manifest here names (``HostStore.live_blobs``: what local gc
    keeps, under its lock) when the store placed a blob (batched) and at
    least every ``refresh`` seconds; a changed set is put to the tier as the
    next generation, then its pointer to the directory (no lease: a set
    outlives the host's lease); an unchanged one only gets a new ``checked``
    time in its pointer, at most every ``refresh``.
  * **The eviction rule.** A local copy may be evicted (tiercache's ``gc
    --tier-cache``) only if :func:`may_evict` says so: the blob is in
    :class:`EvictionRecord` (``STATE/fleet-tier/<tier>.evictable``). A blob
    enters it only after a set naming it was published (its pointer written)
    and afterwards a read found no live mark on it, then the blob in the
    tier (that order). The record is shrunk to the set while the store's gc
    lock is held, before that set is published: so every blob in the
    record is named by the host's latest published set, and no gc that
    marked it after the confirmation can delete it.
  * :class:`Marks` tells whether a gc's mark on a blob is live: a mark whose
    gc no longer holds the directory's gc key is stale (that gc stopped
    acting before its lease could end). The uploader's put path asks it
    after a 412 (the tier had the blob): a live mark means the blob may be
    about to go, so the put is retried later, not recorded.
  * A blob the confirmation finds absent from the tier (a gc took it: the
    put's record was a hint) is put again by the uploader.

Theory of operation: one trio task; the set's computation and the records'
writes run in worker threads; requests to the tier at most ``CONCURRENCY``
at once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet
from typing import Protocol

import trio

from capsulefs.core.errors import CapsuleError
from capsulefs.core.fleet import liveset as ls
from capsulefs.core.fleet.directory import Layout
from capsulefs.core.fleet.errors import DirectoryReplyLost, ObjectNotFound
from capsulefs.core.fleet.etcd import KeyValue
from capsulefs.core.fleet.etcd import PutResult
from capsulefs.core.fsutil import atomic_write
from capsulefs.fleet.s3 import BlobTier
from capsulefs.fleet.uploader import RECORD_DIR, append_digests, read_digests

log = logging.getLogger(__name__)

__all__ = ["EvictionRecord", "LivePublisher", "Marks", "may_evict"]

REFRESH = 300.0  # seconds: the set is recomputed, and its pointer's time renewed, at least this often
BATCH_DELAY = 10.0  # seconds after a blob was stored before the set is recomputed (a batch of writes, one set)
CONCURRENCY = 8
MAX_SET = 1 << 31  # bytes of a live set read back


class Directory(Protocol):
    """What this module needs of the directory (:class:`capsulefs.fleet.etcd.EtcdClient`)."""

    async def get(self, key: bytes) -> KeyValue | None: ...

    async def put(self, key: bytes, value: bytes, *, lease: int = 0, prev_kv: bool = False) -> PutResult: ...


class LiveStore(Protocol):
    def live_blobs(self, then: Callable[[frozenset[str]], None] | None = None) -> frozenset[str]: ...


class Reputter(Protocol):
    """The uploader (:class:`capsulefs.fleet.uploader.TierUploader`)."""

    def known_blobs(self) -> frozenset[str]: ...

    def put_again(self, sha256: str) -> None: ...


class Marks:
    """Whether a blob carries a live gc mark."""

    def __init__(self, tier: BlobTier, directory: Directory, layout: Layout) -> None:
        self._tier, self._dir, self._layout = tier, directory, layout

    async def live_mark(self, sha256: str) -> bool:
        try:
            data = await self._tier.s3.get(ls.mark_key(self._tier.s3.tier.prefix, sha256), limit=ls.MAX_RECORD)
        except ObjectNotFound:
            return False
        try:
            gc_id = ls.decode_mark(data)
        except ls.LiveSetError as exc:
            log.warning("blob %s: a gc mark that is not ours (%s): counted as live", sha256, exc)
            return True
        kv = await self._dir.get(ls.gc_key(self._layout))
        if kv is None:
            return False  # no gc runs: the mark's gc stopped before its lease could end
        try:
            return ls.decode_gc(kv.value).gc_id == gc_id
        except ls.LiveSetError as exc:
            log.warning("the directory's gc key is not ours (%s): blob %s's mark counted as live", exc, sha256)
            return True


class EvictionRecord:
    """``STATE/fleet-tier/<tier>.evictable``: the blobs this host may evict (the rules)."""

    def __init__(self, state_dir: str, tier_name: str) -> None:
        self.dir = os.path.join(state_dir, RECORD_DIR)
        self.path = os.path.join(self.dir, hashlib.sha256(tier_name.encode()).hexdigest()[:16] + ".evictable")

    def load(self) -> frozenset[str]:
        """The digests recorded (a torn last line is skipped)."""
        return frozenset(read_digests(self.path)[0])

    def keep_only(self, live: AbstractSet[str]) -> None:
        """Drop every blob ``live`` does not name (atomically; the store's gc lock held)."""
        have = self.load()
        if have <= live:
            return
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        atomic_write(self.path, "".join(f"{s}\n" for s in sorted(have & live)).encode())

    def add(self, shas: Iterable[str]) -> None:
        """Append these digests, durably (as the tier record does)."""
        append_digests(self.dir, self.path, shas)


def may_evict(evictable: AbstractSet[str], sha256: str) -> bool:
    """The eviction rule, in one place: a local copy of ``sha256`` may be
    deleted (the tier holds it for this host) only if the eviction record
    (``EvictionRecord(state, tier).load()``, read under the store's gc lock)
    names it: this host published a live set naming it and afterwards found
    it in the tier with no live mark. The uploader's record of puts
    (``TierRecord``) is a hint and not enough: a gc may have taken a blob
    whose put was answered 412 just before its mark."""
    return sha256 in evictable


class LivePublisher:
    """Publishes this host's live set and confirms what it may evict (a daemon service; see the rules)."""

    def __init__(self, store: LiveStore, tier: BlobTier, directory: Directory, layout: Layout, host_id: str,
                 record: EvictionRecord, uploader: Reputter, marks: Marks, *, refresh: float = REFRESH,
                 batch_delay: float = BATCH_DELAY, clock: Callable[[], float] = time.time) -> None:
        self._store, self._tier, self._dir, self._layout = store, tier, directory, layout
        self._host = host_id
        self._record, self._uploader, self._marks = record, uploader, marks
        self._refresh, self._delay, self._clock = refresh, batch_delay, clock
        self._token: trio.lowlevel.TrioToken | None = None
        self._wake = trio.Event()
        self.generation = 0  # the last published
        self.published: frozenset[str] | None = None
        self._checked = 0.0  # trio time of the last pointer write
        self.rounds = trio.Event()  # set after each round (tests)

    def nudge(self) -> None:
        """The store placed a blob (any thread): recompute the set soon."""
        token = self._token
        if token is not None:
            try:
                token.run_sync_soon(self._wake.set)
            except trio.RunFinishedError:
                pass

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._token = trio.lowlevel.current_trio_token()
        task_status.started()
        delay = 1.0
        while True:
            try:
                await self.round()
                delay = 1.0
            except (CapsuleError, OSError) as exc:  # (the tier or the directory down, a store it cannot read)
                log.warning("live set of host %s not published (again in %.0f s): %s", self._host, delay, exc)
                await trio.sleep(delay)
                delay = min(delay * 2, 60.0)
                continue
            with trio.move_on_after(self._refresh):
                await self._wake.wait()
                await trio.sleep(self._delay)  # (the blobs of one write, one set)

    async def round(self) -> None:
        """Compute the set; publish it if it changed (or renew its time); confirm what may be evicted."""
        self._wake = trio.Event()
        if self.generation == 0:
            await self._learn_generation()
        live = await trio.to_thread.run_sync(self._store.live_blobs, self._record.keep_only)
        now = trio.current_time()
        if live != self.published:
            body = ls.LiveSet(self._host, self.generation + 1, live).encode()
            await self._tier.s3.put(ls.live_key(self._tier.s3.tier.prefix, self._host), body)
            self.generation += 1  # (the object is out: never reuse the number)
            await self._point(len(live), hashlib.sha256(body).hexdigest())
            self.published = live
            log.info("live set of host %s: generation %d, %d blob(s)", self._host, self.generation, len(live))
        elif now - self._checked >= self._refresh:
            await self._point(len(live), self._pointer_sha)
        await self._confirm(live)
        self.rounds.set()
        self.rounds = trio.Event()

    _pointer_sha = ""

    async def _point(self, count: int, sha: str) -> None:
        ptr = ls.LivePointer(host_id=self._host, generation=self.generation, count=count, sha256=sha,
                             checked=int(self._clock()))
        try:
            await self._dir.put(ls.pointer_key(self._layout, self._host), ptr.encode())
        except DirectoryReplyLost:
            self.published = None  # (it may not be out: publish again, and confirm nothing meanwhile)
            raise
        self._pointer_sha = sha
        self._checked = trio.current_time()

    async def _learn_generation(self) -> None:
        """Start above any generation published before (the pointer's, and an object put after it)."""
        kv = await self._dir.get(ls.pointer_key(self._layout, self._host))
        gen = 0
        if kv is not None:
            try:
                gen = ls.decode_pointer(kv.value).generation
            except ls.LiveSetError as exc:
                log.warning("host %s's live set pointer is not ours (%s): publishing over it", self._host, exc)
        try:
            data = await self._tier.s3.get(ls.live_key(self._tier.s3.tier.prefix, self._host), limit=MAX_SET)
            gen = max(gen, ls.parse_live_set(data, limit=MAX_SET).generation)
        except ObjectNotFound:
            pass
        except ls.LiveSetError as exc:
            log.warning("host %s's live set in the tier is not ours (%s): publishing over it", self._host, exc)
        self.generation = gen

    async def _confirm(self, live: frozenset[str]) -> None:
        """After the set naming them is published: each blob put to the tier
        (the uploader's record) and not yet evictable, no live mark, then
        present in the tier -> evictable; absent -> put again."""
        evictable = await trio.to_thread.run_sync(self._record.load)
        todo = sorted((live & self._uploader.known_blobs()) - evictable)
        if not todo:
            return
        ok: list[str] = []
        limit = trio.CapacityLimiter(CONCURRENCY)

        async def one(sha: str) -> None:
            async with limit:
                try:
                    if await self._marks.live_mark(sha):
                        return  # (a gc is at it: ask again next round)
                    if await self._tier.has(sha):
                        ok.append(sha)
                    else:
                        log.warning("blob %s is not in the tier after all (a gc took it): putting it again", sha)
                        self._uploader.put_again(sha)
                except CapsuleError as exc:
                    log.info("blob %s not confirmed in the tier (next round): %s", sha, exc)

        async with trio.open_nursery() as nursery:
            for sha in todo:
                nursery.start_soon(one, sha)
        if ok:
            await trio.to_thread.run_sync(self._record.add, ok)
