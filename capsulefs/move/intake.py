"""The target's intake of one move: where the pieces of its ``blobs`` calls
go after they have been received.

Rules:
  * Two stages, in order: the *writer* hashes and writes the pieces of
    each call (:class:`~capsulefs.move.pieces.PieceWriter`, one slab at a
    time, with another thread creating the call's files ahead of it, in
    the writers of ``capsulefs.move.writers``). One task sends it each slab
    and each call's close as they come; another (the *reaper*) takes the
    answers in that order, gives each slab's buffer back and passes each
    closed call on. Then the *settler* makes the pieces that hashed to their names durable (with
    ``sync``, a :class:`~capsulefs.core.linuxfs.FileSystemSync`, one syncfs
    of their file system per call; else an fsync each) and passes them to
    ``settle`` (the move service adopts the blobs among them into
    ``objects/``).
  * :meth:`Intake.take` reads a call's payload slab by slab straight into
    the intake's buffers (``depth + 2`` of them: one being filled, one
    being written, ``depth`` waiting), at the offsets of the writer's
    layout, and returns once the last slab is handed to the writer.
    So a call's reply says its pieces *arrived*; the writer finishes them
    while the next call's bytes come in, and the settler syncs them
    meanwhile. Nothing counts as received on that basis: verify first
    waits (:meth:`Intake.settled`) until both stages have passed every
    piece handed over before it, and judges only then.
  * A piece whose bytes are still in the intake (:attr:`Intake.inflight`)
    must not be given a path a second time: its file may be in the middle
    of being synced or linked into the store. The caller reads such a
    duplicate and drops it.
  * The first failure of either stage (a disk error) is kept. Every later
    slab is dropped, every writer still open is abandoned, and every later
    :meth:`take` and :meth:`settled` raises it (as OSError): the move then
    fails and the source rolls back. A failure is never taken back.
  * :meth:`aclose` stops both stages and waits for them; the piece being
    written is removed (``PieceWriter.abandon``). The staging area around
    them is the caller's.
  * The intake's tasks run in a nursery the caller owns (:meth:`run`).
"""

from __future__ import annotations

import errno
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import trio

from capsulefs.core.linuxfs import FileSystemSync, fsync_each
from capsulefs.move.pieces import Outcome, Piece, remove_files
from capsulefs.move.writers import ProcessWriters, SpareHelper, ThreadWriters, Ticket, WriterHandle

log = logging.getLogger(__name__)

__all__ = ["Intake"]


class Source(Protocol):
    """Where a call's payload comes from (``capsulefs.peer.framing.Payload``)."""

    async def readinto(self, buffer: memoryview) -> None: ...


@dataclass(frozen=True, slots=True)
class _Feed:
    writer: WriterHandle
    buffer: int  # the pool's buffer holding the writer's next slab; back to the pool once written (or dropped)


@dataclass(frozen=True, slots=True)
class _End:
    writer: WriterHandle
    paths: dict[str, str]  # sha -> file, the pieces it was given paths for (in flight until settled)
    complete: bool  # every byte of the call was handed over (else: abandon it)


@dataclass(frozen=True, slots=True)
class _Settle:
    paths: dict[str, str]  # sha -> file, the pieces that hashed to their names
    shas: frozenset[str]  # leave the in-flight set once settled (or dropped)


@dataclass(frozen=True, slots=True)
class _Barrier:
    done: trio.Event


class Intake:
    """The writer and settler of one move. ``record`` is called on the event
    loop with each call's outcomes once its pieces are written (before they
    are durable); ``settle`` is called in a worker thread with the
    {sha: path} of pieces that hashed to their names, once they are durable."""

    def __init__(self, *, record: Callable[[list[Outcome]], None], settle: Callable[[dict[str, str]], None],
                 depth: int = 2, sync_workers: int = 8, writers: str = "thread",
                 sync: FileSystemSync | None = None, spare: SpareHelper | None = None) -> None:
        if writers not in ("thread", "process"):
            raise ValueError(f"writers must be 'thread' or 'process', not {writers!r}")
        self._record = record
        self._settle = settle
        self._sync_workers = sync_workers
        self._sync = sync  # None: an fsync per piece
        self._jobs_in, self._jobs = trio.open_memory_channel[_Feed | _End | _Barrier](depth)
        # The slab buffers: one being filled, one being written, ``depth`` waiting.
        self._writers: ThreadWriters | ProcessWriters = (
            ThreadWriters(depth + 2) if writers == "thread" else ProcessWriters(depth + 2, spare=spare))
        self._pool_in, self._pool = trio.open_memory_channel[int](math.inf)
        for index in range(depth + 2):
            self._pool_in.send_nowait(index)
        # Unbounded, but at most one entry per buffer of the pool, per call and per barrier.
        self._reaps_in, self._reaps = trio.open_memory_channel[tuple[_Feed | _End, Ticket] | _Barrier](math.inf)
        # Unbounded, but only one entry per call and per barrier: the writer never waits on the settler.
        self._settles_in, self._settles = trio.open_memory_channel[_Settle | _Barrier](math.inf)
        self.inflight: set[str] = set()
        self.failure: BaseException | None = None
        self._open: set[WriterHandle] = set()  # handed to the intake, not yet closed or abandoned
        self._barriers: set[trio.Event] = set()
        self._scope = trio.CancelScope()
        self._stopped = trio.Event()

    # -- the tasks -----------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run both stages until :meth:`aclose` (or the caller's nursery) stops them."""
        try:
            with self._scope:
                async with trio.open_nursery() as nursery:
                    try:
                        await self._writers.start(nursery)
                    except OSError as exc:  # no helper process: every call of this move fails, saying why
                        self._fail(exc)
                    nursery.start_soon(self._write_stage)
                    nursery.start_soon(self._reap_stage)
                    nursery.start_soon(self._settle_stage)
                    task_status.started()
        finally:
            try:
                with trio.CancelScope(shield=True):
                    for writer in list(self._open):
                        await self._abandon(writer)
                    await self._writers.aclose()
            finally:
                self._pool_in.close()  # a call waiting for a buffer then stops (the failure below says why)
                self._open.clear()
                self.inflight.clear()  # nothing is written or settled any more
                if self.failure is None:
                    self.failure = OSError(errno.ECANCELED, "the move's intake was closed")
                for done in self._barriers:
                    done.set()
                self._stopped.set()

    async def aclose(self) -> None:
        """Stop both stages; return once they have stopped (a worker thread
        busy with a slab finishes it first)."""
        for writer in self._open:
            self._writers.stop_precreate(writer)  # its thread ends at the next file
        self._scope.cancel()
        await self._stopped.wait()

    async def _abandon(self, writer: WriterHandle) -> None:
        """Abandon a writer; a failure to remove its files fails the intake
        (never the stage, which would take the service's other moves down)."""
        try:
            await self._writers.abandon(writer)
        except Exception as exc:
            log.warning("a move's intake could not clean up a piece: %s", exc)
            self._fail(exc)

    async def _drop(self, writer: WriterHandle, paths: dict[str, str]) -> None:
        """A call that will not be settled: abandon its writer (its files go)
        and take its pieces out of the in-flight set."""
        await self._abandon(writer)
        self.inflight.difference_update(paths)

    async def _write_stage(self) -> None:
        # Closing the channels on the way out: a sender blocked on a full
        # queue then fails instead of waiting forever, and the next stages end.
        with self._jobs, self._reaps_in:
            async for job in self._jobs:
                try:
                    if isinstance(job, _Barrier):
                        self._reaps_in.send_nowait(job)
                    elif isinstance(job, _Feed):
                        ticket = None
                        try:
                            if self.failure is None and job.writer in self._open:
                                ticket = await self._writers.write_slab(job.writer, job.buffer)
                                self._noticed(ticket)
                        finally:
                            if ticket is None:
                                self._give_back(job.buffer)  # never sent
                            elif not self._reap(job, ticket) and ticket.done:
                                self._give_back(job.buffer)  # else the helper may still read it: it stays out
                    else:
                        await self._end(job)
                except Exception as exc:  # a disk error, or a bug: this move fails, the stage goes on
                    self._fail(exc)

    async def _end(self, job: _End) -> None:
        writer = job.writer
        self._open.discard(writer)
        if self.failure is not None or not job.complete:
            await self._drop(writer, job.paths)
            return
        try:
            ticket = await self._writers.close(writer)
        except Exception as exc:
            ticket = None
            self._fail(exc)
        if ticket is None or not self._reap(job, ticket):
            await self._drop(writer, job.paths)

    def _noticed(self, ticket: Ticket) -> None:
        """A slab already answered (in-process writers, or a dead helper)
        fails the intake at once: the next slabs are then dropped rather
        than written after it."""
        failure = ticket.failure()
        if failure is not None:
            self._fail(failure)

    def _reap(self, job: _Feed | _End, ticket: Ticket) -> bool:
        """Hand a request's ticket to the reaper; False if it has stopped
        (the intake is being closed: the caller cleans up)."""
        try:
            self._reaps_in.send_nowait((job, ticket))
        except trio.BrokenResourceError:
            return False
        return True

    async def _reap_stage(self) -> None:
        """Take the writers' answers in the order the requests went: give
        each slab's buffer back, and pass each closed call's pieces on."""
        with self._reaps, self._settles_in:
            async for item in self._reaps:
                try:
                    if isinstance(item, _Barrier):
                        self._to_settler(item)
                    else:
                        job, ticket = item
                        if isinstance(job, _Feed):
                            try:
                                await ticket.result()
                            finally:
                                if ticket.done:  # cancelled before the answer: the helper may still read it
                                    self._give_back(job.buffer)
                        else:
                            await self._closed(job, ticket)
                except Exception as exc:  # a disk error, or a bug: this move fails, the stage goes on
                    self._fail(exc)

    async def _closed(self, job: _End, ticket: Ticket) -> None:
        """A call's writer was closed: record its outcomes and settle its
        intact pieces, unless the intake failed meanwhile."""
        try:
            outcomes = await ticket.result()
        except Exception as exc:
            self._fail(exc)
            await self._drop(job.writer, job.paths)
            return
        if self.failure is not None:  # a slab or a call failed after this close was asked for
            try:
                await trio.to_thread.run_sync(remove_files, list(job.paths.values()))
            except OSError as exc:  # the staging area goes with the move anyway
                log.warning("a move's intake could not remove the pieces of a call it dropped: %s", exc)
            finally:
                self.inflight.difference_update(job.paths)
            return
        self._record(outcomes)
        intact = {o.sha: job.paths[o.sha] for o in outcomes if o.intact and o.sha in job.paths}
        self._to_settler(_Settle(intact, frozenset(job.paths)))

    def _give_back(self, buffer: int) -> None:
        try:
            self._pool_in.send_nowait(buffer)
        except trio.ClosedResourceError:
            pass  # the intake has stopped: nobody needs it any more

    def _to_settler(self, job: _Settle | _Barrier) -> None:
        try:
            self._settles_in.send_nowait(job)
        except trio.BrokenResourceError:
            pass  # the settler stopped: the intake is being closed (run's end settles the barriers)

    async def _settle_stage(self) -> None:
        with self._settles:
            async for job in self._settles:
                if isinstance(job, _Barrier):
                    self._barriers.discard(job.done)
                    job.done.set()
                    continue
                try:
                    if self.failure is None and job.paths:
                        await trio.to_thread.run_sync(self._sync_and_settle, job.paths)
                except Exception as exc:
                    self._fail(exc)
                finally:
                    self.inflight.difference_update(job.shas)

    def _sync_and_settle(self, paths: dict[str, str]) -> None:
        if self._sync is not None:
            self._sync.files(paths.values())
        else:
            fsync_each(paths.values(), workers=self._sync_workers)
        self._settle(paths)

    def _fail(self, exc: BaseException) -> None:
        if self.failure is None:
            if not isinstance(exc, OSError):
                log.error("a move's intake failed", exc_info=exc)
            self.failure = exc

    def _raise(self) -> None:
        exc = self.failure
        if exc is None:
            return
        code = exc.errno if isinstance(exc, OSError) and exc.errno else errno.EIO
        raise OSError(code, f"writing the move's pieces failed: {exc}") from exc

    # -- the callers' side --------------------------------------------------------------------
    async def take(self, payload: Source, pieces: Iterable[Piece]) -> None:
        """Receive one call's payload (its pieces back to back) and hand it
        to the writer: each slab is read from ``payload`` straight into a
        buffer of the pool, at the offsets the writer's layout gives. A
        piece with a path must not be in :attr:`inflight`. Raises the
        intake's failure, if it has one."""
        self._raise()
        pieces = list(pieces)
        paths = {p.sha: p.path for p in pieces if p.path is not None}
        clash = self.inflight.intersection(paths)
        if clash or len(paths) != sum(p.path is not None for p in pieces):
            raise ValueError(f"a piece was given a path twice, or while it is in the intake: {sorted(clash)[:3]}")
        self.inflight.update(paths)
        try:
            writer = await self._writers.open(pieces)
        except OSError as exc:
            self.inflight.difference_update(paths)
            self._fail(exc)
            self._raise()
            raise
        self._open.add(writer)
        complete = False
        try:
            for slab in writer.slabs:
                self._raise()
                buffer = await self._pool.receive()
                try:
                    with memoryview(self._writers.buffers[buffer]) as view:
                        for seg in slab:
                            if seg.size:
                                await payload.readinto(view[seg.offset : seg.offset + seg.size])
                    await self._jobs_in.send(_Feed(writer, buffer))
                except BaseException:
                    self._give_back(buffer)  # not handed over: still ours
                    raise
            complete = True
        except (trio.BrokenResourceError, trio.EndOfChannel, trio.ClosedResourceError):
            pass  # the intake stopped; its failure says why (raised below)
        finally:
            # The writer's end goes in even if this task was cancelled (a
            # bounded wait: the writer stage takes a job per slab, and
            # fails the send if it has stopped), so that it is abandoned
            # and its pieces leave the in-flight set.
            with trio.CancelScope(shield=True):
                try:
                    await self._jobs_in.send(_End(writer, paths, complete))
                except trio.BrokenResourceError:  # the intake stopped (run's end abandoned it too)
                    self._open.discard(writer)
                    await self._drop(writer, paths)
                    if self.failure is None:
                        self.failure = OSError(errno.ECANCELED, "the move's intake was closed")
        self._raise()

    async def settled(self) -> None:
        """Return once both stages have passed everything handed over before
        this call; raise the intake's failure, if it has one."""
        self._raise()
        done = trio.Event()
        self._barriers.add(done)
        try:
            await self._jobs_in.send(_Barrier(done))
        except trio.BrokenResourceError:
            pass
        await done.wait()
        self._raise()
