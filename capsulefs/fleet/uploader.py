"""Every blob this host stores, put to the fleet's blob tier too: a daemon service.

Rules:
  * The store tells the uploader the name of each blob it placed in
    ``objects/`` (``HostStore.open(on_blob=...)``, through the composition
    root); :meth:`TierUploader.notice` only queues the name (it is called in
    whichever thread stored the blob) and wakes the service.
  * The service puts each queued blob with :meth:`TierBlobs.put`
    (``If-None-Match: *``; a 412 means the tier has it: fine; the local copy
    is hashed as it is read and a rotten one never reaches the tier whole).
    A put that fails because the tier is down or refuses is retried with
    backoff (1 s doubling to 60 s); a local write or a move never waits for
    the tier. A blob gone from the store (gc) or found rotten there (the
    store quarantined it) is dropped from the queue.
  * A durable record, ``STATE/fleet-tier/<tier>.known`` (one sha256 a line,
    appended and fsynced after each batch of puts), says which blobs are
    known to be in the tier. At its start the service lists ``objects/``
    (no request to the tier) and queues every blob the record does not name:
    what an earlier run stored but could not put, or what another process
    stored. The record is a cache: a line lost (a torn tail, a crash before
    the fsync) costs one put that the tier answers 412; it is never read
    as "the tier lacks it". A tier emptied behind capsulefs's back is not
    noticed here: remove the record to put every blob again.
  * A put answered 412 (the tier had the blob) while a tier gc's live mark
    is on it does not count: the gc may be deleting it. It stays pending and
    is put again after the backoff (``marks``; capsulefs/fleet/live.py).
    Even so the record is a hint: the eviction rule is live.py's.
  * Blobs fetched from the tier (a move's target) are marked known before
    they land (:meth:`TierUploader.known`), so they are not put back.
  * The state shows in ``.control/metrics``: blobs waiting, blobs put or
    found present, bytes put, failed attempts.

Theory of operation: one trio task (:meth:`TierUploader.serve`) drains the
queue in batches; each batch runs its puts in one nursery (TierBlobs bounds
them); the record's append runs in a worker thread.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Protocol

import trio

from capsulefs.core import metrics
from capsulefs.core.capsule import format as fmt
from capsulefs.core.errors import CapsuleError, CorruptBlobError, NotFoundError
from capsulefs.core.fsutil import fsync_dir

log = logging.getLogger(__name__)

__all__ = ["BACKOFF_FIRST", "BACKOFF_MOST", "BlobLister", "MarkCheck", "TierPutter", "TierRecord", "TierUploader", "RECORD_DIR"]

RECORD_DIR = "fleet-tier"  # under the state dir: the records of what each tier is known to hold
BACKOFF_FIRST = 1.0  # seconds before the first retry of a failed batch
BACKOFF_MOST = 60.0  # the longest wait between retries
BATCH = 256  # blobs put per batch (and per append to the record)

class TierPutter(Protocol):
    """What the uploader needs of the tier (:class:`capsulefs.fleet.tier.TierBlobs`)."""

    async def put(self, sha256: str) -> bool: ...


class MarkCheck(Protocol):
    """Whether a gc's live mark is on a blob (:class:`capsulefs.fleet.live.Marks`)."""

    async def live_mark(self, sha256: str) -> bool: ...


class BlobLister(Protocol):
    """What the uploader needs of the store (:class:`capsulefs.core.store.host_store.HostStore`)."""

    def all_blobs(self) -> Iterator[str]: ...

    def blob_size(self, sha256: str) -> int: ...


class TierRecord:
    """The durable record of the blobs known to be in one tier (see the rules)."""

    def __init__(self, state_dir: str, tier_name: str) -> None:
        import hashlib

        self.dir = os.path.join(state_dir, RECORD_DIR)
        self.path = os.path.join(self.dir, hashlib.sha256(tier_name.encode()).hexdigest()[:16] + ".known")
        self.tier_name = tier_name

    def load(self) -> set[str]:
        """The digests recorded; lines that are not one (a torn tail) are skipped."""
        known, skipped = read_digests(self.path)
        if skipped:
            log.warning("blob tier record %s: %d line(s) not a blob name, ignored (those blobs are put again)",
                        self.path, skipped)
        return known

    def add(self, shas: Iterable[str]) -> None:
        """Append these digests, durably (one write and one fsync)."""
        append_digests(self.dir, self.path, shas)


def read_digests(path: str) -> tuple[set[str], int]:
    """The digests of a record of one digest a line (none if it is missing),
    and how many non-empty lines were not one (a torn tail) and skipped.
    (The tier record here and the eviction record, capsulefs/fleet/live.py.)"""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return set(), 0
    digests = set()
    skipped = 0
    for line in data.split(b"\n"):
        name = line.decode("ascii", "replace")
        if fmt.is_sha256(name):
            digests.add(name)
        elif line:
            skipped += 1
    return digests, skipped


def append_digests(directory: str, path: str, shas: Iterable[str]) -> None:
    """Append digests to a record of one digest a line (``path`` in
    ``directory``, made 0700 if missing), durably: one write, one fsync, and
    the directory's fsync when the file is new. A torn earlier append (a
    last line without its newline, skipped by the readers) gets its newline
    first, so the new lines start afresh. (The tier record here and the
    eviction record, capsulefs/fleet/live.py.)"""
    data = "".join(f"{sha}\n" for sha in shas).encode()
    if not data:
        return
    new = not os.path.exists(path)
    if new:
        os.makedirs(directory, mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        if not new and os.fstat(fd).st_size and not _ends_with_newline(path):
            data = b"\n" + data
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    if new:
        fsync_dir(directory)


def _ends_with_newline(path: str) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


class TierUploader:
    """Puts every blob the store tells it of to the tier (a daemon service; see the rules)."""

    def __init__(self, tier: TierPutter, store: BlobLister, record: TierRecord, *, marks: MarkCheck | None = None,
                 backoff_first: float = BACKOFF_FIRST, backoff_most: float = BACKOFF_MOST) -> None:
        self._tier = tier
        self._marks = marks
        self._store = store
        self._record = record
        self._first, self._most = backoff_first, backoff_most
        self._queue: deque[str] = deque()  # noticed, not yet looked at (appended from any thread)
        self._mutex = threading.Lock()  # guards _known (the move's fetch marks blobs from the trio thread)
        self._known: set[str] = set()
        self._pending: dict[str, None] = {}  # to put, in order
        self._token: trio.lowlevel.TrioToken | None = None
        self._wake = trio.Event()
        self._idle = trio.Event()
        self.state = "starting"  # starting, idle, putting, retrying (and why: self.problem)
        self.problem: str | None = None

    # -- told by the store and the moves (any thread) ----------------------------------
    def notice(self, sha256: str) -> None:
        """The store placed this blob: queue it (quick; any thread)."""
        self._queue.append(sha256)
        token = self._token
        if token is not None:
            try:
                token.run_sync_soon(self._woken)
            except trio.RunFinishedError:
                pass

    def known(self, shas: Iterable[str]) -> None:
        """These blobs are in the tier (a move is fetching them from it): never put them."""
        with self._mutex:
            self._known.update(shas)

    def known_blobs(self) -> frozenset[str]:
        """The blobs put (or found there with no live gc mark): a hint, not the eviction rule (fleet/live.py)."""
        with self._mutex:
            return frozenset(self._known)

    def put_again(self, sha256: str) -> None:
        """The tier lacks this blob after all (a gc took it): put it again (trio thread)."""
        with self._mutex:
            self._known.discard(sha256)
        self.notice(sha256)

    def _woken(self) -> None:
        self._wake.set()

    # -- the service -----------------------------------------------------------------------
    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._token = trio.lowlevel.current_trio_token()
        task_status.started()
        recorded = await trio.to_thread.run_sync(self._record.load)
        with self._mutex:
            self._known |= recorded
        # What an earlier run stored and could not put, or another process stored.
        stored = await trio.to_thread.run_sync(lambda: list(self._store.all_blobs()))
        with self._mutex:
            unput = [sha for sha in stored if sha not in self._known]
        if unput:
            log.info("blob tier %s: %d blob(s) stored here are not known to be there: putting them",
                     self._record.tier_name, len(unput))
        self._pending.update(dict.fromkeys(unput))
        delay = self._first
        while True:
            self._take_queue()
            metrics.TIER_PENDING.set(len(self._pending))
            if not self._pending:
                self.state, self.problem = "idle", None
                self._idle.set()
                self._wake = trio.Event()
                if self._queue:  # (noticed between the take and the new event)
                    continue
                await self._wake.wait()
                continue
            self._idle = trio.Event() if self._idle.is_set() else self._idle
            self.state = "putting"
            batch = list(self._pending)[:BATCH]
            failed = await self._put_batch(batch)
            if failed is None:
                delay = self._first
                continue
            self.state, self.problem = "retrying", failed
            log.warning("blob tier %s: %d blob(s) waiting, retrying in %.0f s: %s", self._record.tier_name,
                        len(self._pending), delay, failed)
            await trio.sleep(delay)
            delay = min(delay * 2, self._most)

    def _take_queue(self) -> None:
        with self._mutex:
            while self._queue:
                sha = self._queue.popleft()
                if sha not in self._known:
                    self._pending[sha] = None

    async def _put_batch(self, batch: list[str]) -> str | None:
        """Put these blobs; None if every one settled, else the first failure."""
        done: list[str] = []
        failures: list[str] = []

        async def one(sha: str) -> None:
            with self._mutex:
                if sha in self._known:
                    done.append(sha)
                    return
            try:
                stored = await self._tier.put(sha)
            except (NotFoundError, FileNotFoundError):
                log.info("blob %s left the store before it was put to the tier", sha)
                self._pending.pop(sha, None)
                return
            except CorruptBlobError as exc:
                log.warning("blob %s not put to the tier: %s", sha, exc)  # (the store quarantined it)
                self._pending.pop(sha, None)
                return
            except CapsuleError as exc:
                metrics.TIER_PUTS.inc("failed")
                failures.append(f"blob {sha}: {exc}")
                return
            if not stored and await self._marked(sha, failures):
                return
            metrics.TIER_PUTS.inc("stored" if stored else "present")
            if stored:
                try:
                    metrics.TIER_BYTES.inc("put", by=self._store.blob_size(sha))
                except CapsuleError:
                    pass
            done.append(sha)

        async with trio.open_nursery() as nursery:
            for sha in batch:
                nursery.start_soon(one, sha)
        if done:
            await trio.to_thread.run_sync(self._record.add, done)
            with self._mutex:
                self._known.update(done)
            for sha in done:
                self._pending.pop(sha, None)
        return failures[0] if failures else None

    async def _marked(self, sha: str, failures: list[str]) -> bool:
        """After a 412: a live gc mark on the blob means the gc may delete it
        now, so the put does not count: it is put again after a backoff."""
        if self._marks is None:
            return False
        try:
            marked = await self._marks.live_mark(sha)
        except CapsuleError as exc:
            failures.append(f"blob {sha}: its gc mark could not be read: {exc}")
            return True
        if marked:
            metrics.TIER_PUTS.inc("marked")
            failures.append(f"blob {sha}: the tier had it, under a tier gc's mark (put again once the mark goes)")
        return marked

    # -- what it says ----------------------------------------------------------------------
    @property
    def pending(self) -> int:
        return len(self._pending) + len(self._queue)

    async def wait_idle(self) -> None:
        """Until nothing waits to be put (tests, the bench)."""
        while True:
            await self._idle.wait()
            if not self._queue and not self._pending:
                return
            await trio.sleep(0)
