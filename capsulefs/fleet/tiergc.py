"""The fleet's gc of the blob tier (``capsulefs fleet gc``): delete only blobs no live set names.

Rules (the safety argument is docs/fleet.md's "The fleet's gc of the blob tier"):
  * One gc at a time, fleet-wide: the directory's gc key, created by a Txn
    only if absent, under a lease of this run; released (revoked) at the
    end, gone by etcd's TTL if the gc dies. The gc acts (writes a mark,
    deletes) only within its lease's run window (core/fleet/lease.py's
    rule, with the keepalives it sends), so a gc paused past its lease
    does nothing after.
  * Marks left by an earlier gc (which no longer holds the key) are removed
    first: that gc stopped acting, and its marks protect nothing.
  * Refused, in one line, if a host the directory names as an agent's holder
    has no live set, or one whose pointer and object disagree, or a host
    with a live lease whose set was last found current more than
    ``stale_after`` ago (its publisher is stuck: what it named since is
    not covered). A host whose lease is gone keeps its last set: it is the
    last word on what that host holds, and a takeover may need its blobs.
  * A candidate is a blob no live set names whose LastModified is older
    than ``grace``. For each batch of candidates: a mark (If-None-Match:
    a mark already there is another gc's, and the blob is skipped), then
    every live set read again, then the blob deleted only if still
    unnamed, then the mark removed.

Theory of operation: one trio task, plus the lease's keepalives in a
nursery; at most ``CONCURRENCY`` requests to the tier at once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from capsulefs.core.errors import CapsuleError
from capsulefs.core.fleet import directory as fd
from capsulefs.core.fleet import liveset as ls
from capsulefs.core.fleet.errors import DirectoryError, FleetError, LeaseNotFound, ObjectNotFound, PreconditionFailed
from capsulefs.core.fleet.etcd import Compare, Put, Range
from capsulefs.core.fleet.lease import DEFAULT_TIMING, LeaseTiming
from capsulefs.fleet.directory import read_agents, scan
from capsulefs.fleet.etcd import EtcdClient
from capsulefs.fleet.s3 import S3Client
from capsulefs.nursery import first_failure

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_GRACE", "GcRefused", "TierGcReport", "run_tier_gc"]

DEFAULT_GRACE = 24 * 3600.0  # seconds a blob must be in the tier before it may go: longer than any move
STALE_AFTER = 3600.0  # a live host's set last found current longer ago than this: the gc refuses
GC_TTL = 20  # seconds: the gc's lease
BATCH = 500  # candidates marked, then the sets read again, then deleted
CONCURRENCY = 8
MAX_SET = 1 << 31  # bytes of one live set read
PAUSE_WAIT = 60.0  # seconds the test seam waits at most


class GcRefused(FleetError):
    """The tier gc will not run (another runs, a host's live set is missing or stale)."""


@dataclass
class TierGcReport:
    listed: int = 0  # blobs in the tier
    named: int = 0  # named by a live set
    young: int = 0  # unnamed, but younger than the grace
    candidates: int = 0
    deleted: int = 0
    freed: int = 0  # bytes
    kept: int = 0  # candidates named again by the sets read after the mark, or marked by another gc
    stale_marks: int = 0  # an earlier gc's, removed
    sets: dict[str, int] = field(default_factory=dict)  # host -> generation read
    dry_run: bool = False


class _Lease:
    """The gc's lease: keepalives, and whether it may still act (the lease timing rule)."""

    def __init__(self, etcd: EtcdClient, lease_id: int, ttl: int, sent: float, timing: LeaseTiming) -> None:
        self._etcd, self.id, self._timing = etcd, lease_id, timing
        self.deadline = sent + timing.run_window(ttl)

    def check(self) -> None:
        if trio.current_time() >= self.deadline:
            raise GcRefused("the gc's lease in the directory was not renewed in time: stopped (run it again)")

    async def keep(self) -> None:
        while True:
            await trio.sleep(self._timing.renew_every)
            sent = trio.current_time()
            try:
                with trio.move_on_after(self._timing.renew_timeout):
                    ttl = await self._etcd.keepalive(self.id)
                    self.deadline = max(self.deadline, sent + self._timing.run_window(ttl))
            except LeaseNotFound:
                self.deadline = 0.0
                return
            except DirectoryError as exc:
                log.warning("tier gc: a keepalive failed: %s", exc)


async def run_tier_gc(etcd: EtcdClient, s3: S3Client, layout: fd.Layout, *, grace: float = DEFAULT_GRACE,
                      dry_run: bool = False, stale_after: float = STALE_AFTER, pause: str | None = None,
                      clock: Callable[[], float] = time.time, timing: LeaseTiming = DEFAULT_TIMING) -> TierGcReport:
    """Run one gc of the tier (see the rules); GcRefused saying why it will not."""
    gc_id = secrets.token_hex(16)
    entry = ls.GcEntry(gc_id=gc_id, by=f"{socket.gethostname()[:120]} pid {os.getpid()}", started=int(clock()))
    key = ls.gc_key(layout)
    sent = trio.current_time()
    grant = await etcd.grant(GC_TTL)
    lease = _Lease(etcd, grant.id, grant.ttl, sent, timing)
    try:
        got = await etcd.txn([Compare.create(key, 0)], [Put(key=key, value=entry.encode(), lease=grant.id)],
                             [Range(key=key)])
        if not got.succeeded:
            raise GcRefused(f"another tier gc runs: {_who(got)}")
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(lease.keep)
                report = await _Gc(etcd, s3, layout, gc_id, lease, clock).run(
                    grace=grace, dry_run=dry_run, stale_after=stale_after, pause=pause)
                nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            raise first_failure(group) from None
        return report
    finally:
        with trio.CancelScope(shield=True):
            try:
                await etcd.revoke(grant.id)  # (the gc key goes with it)
            except CapsuleError as exc:
                log.warning("tier gc: its lease not revoked (it ends by its TTL, %d s): %s", GC_TTL, exc)


def _who(got: object) -> str:
    for r in getattr(got, "responses", ()):
        for kv in getattr(r, "kvs", ()):
            try:
                e = ls.decode_gc(kv.value)
                return f"{e.by}, since {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(e.started))}"
            except ls.LiveSetError as exc:
                return f"(its key is not ours: {exc})"
    return "(gone since)"


class _Gc:
    def __init__(self, etcd: EtcdClient, s3: S3Client, layout: fd.Layout, gc_id: str, lease: _Lease,
                 clock: Callable[[], float]) -> None:
        self.etcd, self.s3, self.layout, self.gc_id, self.lease, self.clock = etcd, s3, layout, gc_id, lease, clock
        self.prefix = s3.tier.prefix
        self.limit = trio.CapacityLimiter(CONCURRENCY)

    async def run(self, *, grace: float, dry_run: bool, stale_after: float, pause: str | None) -> TierGcReport:
        report = TierGcReport(dry_run=dry_run)
        if not dry_run:
            report.stale_marks = await self._remove_stale_marks()
        sets = await self._read_sets(stale_after, report)
        named = ls.union(sets.values())
        cut = self.clock() - grace
        candidates: dict[str, int] = {}
        blobs = f"{self.prefix}blobs/"
        async for obj in self.s3.list(blobs):
            name = obj.key[len(blobs):]
            if not (len(name) == 64 and set(name) <= set("0123456789abcdef")):
                continue
            report.listed += 1
            if name in named:
                report.named += 1
            elif obj.modified is None or obj.modified >= cut:
                report.young += 1
            else:
                candidates[name] = obj.size
        report.candidates = len(candidates)
        if dry_run or not candidates:
            return report
        names = sorted(candidates)
        for start in range(0, len(names), BATCH):
            batch = names[start:start + BATCH]
            marked = await self._each(batch, self._mark)
            report.kept += len(batch) - len(marked)
            if pause is not None:
                await _paused(pause)
            named = ls.union((await self._read_sets(stale_after, None)).values())  # (after the marks)
            doomed = [sha for sha in marked if sha not in named]
            report.kept += len(marked) - len(doomed)
            self.lease.check()
            deleted = await self._each(doomed, self._delete)
            report.deleted += len(deleted)
            report.freed += sum(candidates[sha] for sha in deleted)
            await self._each(marked, self._unmark)
        return report

    async def _each(self, shas: list[str], fn: Callable[[str], object]) -> list[str]:
        """``fn`` of each (bounded); the digests for which it returned True."""
        done: list[str] = []

        async def one(sha: str) -> None:
            async with self.limit:
                if await fn(sha):  # type: ignore[misc]
                    done.append(sha)

        try:
            async with trio.open_nursery() as nursery:
                for sha in shas:
                    nursery.start_soon(one, sha)
        except BaseExceptionGroup as group:
            raise first_failure(group) from None
        return sorted(done)

    async def _mark(self, sha: str) -> bool:
        self.lease.check()
        try:
            await self.s3.put(ls.mark_key(self.prefix, sha), ls.encode_mark(self.gc_id), if_none_match=True)
            return True
        except PreconditionFailed:
            log.info("tier gc: blob %s carries another gc's mark: kept", sha)
            return False

    async def _delete(self, sha: str) -> bool:
        self.lease.check()
        await self.s3.delete(f"{self.prefix}blobs/{sha}")
        return True

    async def _unmark(self, sha: str) -> bool:
        try:
            await self.s3.delete(ls.mark_key(self.prefix, sha))
        except CapsuleError as exc:  # (left for the next gc, which removes it; hosts see it is stale)
            log.warning("tier gc: the mark on blob %s not removed: %s", sha, exc)
        return True

    async def _remove_stale_marks(self) -> int:
        start = ls.marks_prefix(self.prefix)
        stale = [obj.key[len(start):] async for obj in self.s3.list(start)]
        stale = [sha for sha in stale if len(sha) == 64 and set(sha) <= set("0123456789abcdef")]
        if stale:
            log.info("tier gc: %d mark(s) of an earlier gc that stopped: removed", len(stale))
        self.lease.check()
        await self._each(stale, self._unmark)
        return len(stale)

    async def _read_sets(self, stale_after: float, report: TierGcReport | None) -> dict[str, ls.LiveSet]:
        """Every host's live set; GcRefused if a holder has none, or it is not to be trusted."""
        rows = await read_agents(self.etcd, self.layout)
        bad = [r for r in rows if r.entry is None]
        if bad:
            raise GcRefused(f"{len(bad)} agent record(s) in the directory do not parse; the first: "
                            f"{bad[0].agent_id}: {bad[0].problem}")
        holders: dict[str, bool] = {}  # host -> its lease lives
        for r in rows:
            if r.entry is not None and r.entry.state is fd.EntryState.HELD:
                holders[r.entry.host_id] = r.holder_alive
        alive_hosts = {kv.key for kv in await scan(self.etcd, self.layout.hosts)}
        pointers: dict[str, ls.LivePointer] = {}
        for kv in await scan(self.etcd, ls.pointers_prefix(self.layout)):
            try:
                p = ls.decode_pointer(kv.value)
            except ls.LiveSetError as exc:
                raise GcRefused(f"the live set pointer {kv.key[:120]!r}: {exc}") from None
            if ls.pointer_key(self.layout, p.host_id) != kv.key:
                raise GcRefused(f"the live set pointer {kv.key[:120]!r} names host {p.host_id}")
            pointers[p.host_id] = p
        missing = sorted(h for h in holders if h not in pointers)
        if missing:
            n = sum(1 for r in rows if r.entry is not None and r.entry.host_id == missing[0])
            raise GcRefused(f"host {missing[0]} holds {n} agent(s) in the directory and has published no live set "
                            f"(a host on this tier publishes one while its daemon runs with --blobs)"
                            + (f"; {len(missing) - 1} more host(s) like it" if len(missing) > 1 else ""))
        now = self.clock()
        for host, p in sorted(pointers.items()):
            if self.layout.host(host) in alive_hosts and now - p.checked > stale_after:
                raise GcRefused(f"host {host}'s live set was last found current {int(now - p.checked)} s ago, more "
                                f"than {int(stale_after)} s, while its lease lives (is its daemon stuck?)")
        sets: dict[str, ls.LiveSet] = {}

        async def one(host: str, p: ls.LivePointer) -> None:
            async with self.limit:
                try:
                    data = await self.s3.get(ls.live_key(self.prefix, host), limit=min(MAX_SET, 4096 + 32 * p.count
                                                                                        + (1 << 20)))
                except ObjectNotFound:
                    raise GcRefused(f"host {host}'s live set (generation {p.generation}) is not in the tier") from None
            s = ls.parse_live_set(data, limit=MAX_SET)
            if s.host_id != host:
                raise GcRefused(f"host {host}'s live set names host {s.host_id}")
            if s.generation < p.generation or (s.generation == p.generation
                                               and hashlib.sha256(data).hexdigest() != p.sha256):
                raise GcRefused(f"host {host}'s live set in the tier (generation {s.generation}) is not the one its "
                                f"pointer names (generation {p.generation})")
            sets[host] = s  # (a newer generation than the pointer's: published since, and newer is what counts)

        try:
            async with trio.open_nursery() as nursery:
                for host, p in pointers.items():
                    nursery.start_soon(one, host, p)
        except BaseExceptionGroup as group:
            raise first_failure(group) from None
        if report is not None:
            report.sets = {h: s.generation for h, s in sorted(sets.items())}
        return sets


async def _paused(where: str) -> None:
    """The test seam CAPSULEFS_TEST_GC_PAUSE: say the marks are out, wait for the go."""
    with open(os.path.join(where, "marked"), "w"):
        pass
    with trio.move_on_after(PAUSE_WAIT):
        while not os.path.exists(os.path.join(where, "go")):
            await trio.sleep(0.05)
