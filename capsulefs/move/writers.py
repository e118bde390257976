"""Where a move's target hashes and writes its pieces: in this process's
worker threads, or in a helper process of its own.

Rules:
  * Both run :class:`~capsulefs.move.pieces.PieceWriter` s, one per
    ``blobs`` call, the same way: open (the call's files are created ahead
    in a thread), one slab at a time from a buffer of the slab pool, then
    close (the outcomes) or abandon. The intake (``intake.Intake``)
    drives either through the same calls and does not know which it has.
  * A slab written and a writer closed are answered by a :class:`Ticket`,
    awaited apart from the request: the intake sends the next requests
    while earlier ones are still being served, and takes the answers in
    the order it asked. ThreadWriters answers before it returns the
    ticket; ProcessWriters pipelines.
  * :class:`ThreadWriters`: the pool is private memory and each step runs
    in a trio worker thread.
  * :class:`ProcessWriters`: the pool is one shared memory file (memfd);
    the event loop decrypts a slab into it and a helper process
    (``python -I -m capsulefs.move.writer_process``) hashes and writes it from the same
    pages. Why: in one process the worker threads keep retaking the GIL
    from the event loop, which gives it up on every TLS record it decrypts;
    measured on the 2-core VM of docs/move.md, a move's transfer ran at
    268-276 MB/s with the writer in threads and 354-376 MB/s with it in a
    process, the raw stream at 350-510 MB/s.
  * The helper runs in a session of its own. Linux's autogroup shares the
    CPU between sessions first: in the daemon's session, every second of
    hashing and writing there would come out of the event loop's share on
    a busy machine, so the move's transfer would slow down by as much as
    the helper works (docs/move.md: move / raw 0.35-0.49x in the daemon's
    session against 0.70-0.79x in its own, alternating pairs at load 11-16).
    It has no terminal either: a Ctrl-C there never reaches it.
  * The helper is the intake's: started by :meth:`ProcessWriters.start`,
    ended by :meth:`ProcessWriters.aclose` (its stdin closes; it is killed
    if it does not exit); it also ends when the daemon dies, which closes
    its stdin, after abandoning what it was writing. Requests queue in its
    stdin; it serves them one at a time and answers each, in order, on its
    stdout: a JSON line each way. A request that fails there (a disk error)
    is raised here as the same OSError, and so is every later slab and the
    close of that writer (the helper refuses them: nothing counts as
    written past a failed write); if the helper dies, every ticket waiting
    and every later request raises OSError(EIO) and the files of writers
    still open are removed from here.
  * Paths come from the intake (the move's staging area), never from a peer.
"""

from __future__ import annotations

import errno
import json
import logging
import mmap
import os
import subprocess
import sys
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio

from capsulefs.move.pieces import BUFFER, Outcome, Piece, PieceWriter, Segment, layout, remove_files

log = logging.getLogger(__name__)

__all__ = ["ProcessWriters", "ThreadWriters", "WriterHandle"]


@dataclass(eq=False)
class WriterHandle:
    """One call's writer, as the intake holds it."""

    id: int
    pieces: list[Piece]
    slabs: list[list[Segment]]
    local: PieceWriter | None = None  # ThreadWriters only


class Ticket:
    """A request made of the writers, whose answer may come later: a slab
    written, or a writer closed. :meth:`result` waits for it (and raises
    its failure)."""

    __slots__ = ("done", "_value", "_error", "_convert", "_wait")

    def __init__(self, convert: Callable[[Any], Any] | None = None,
                 wait: "Callable[[Ticket], Awaitable[None]] | None" = None) -> None:
        self.done = False
        self._value: Any = None
        self._error: tuple[int | None, str] | None = None  # (errno or None for ValueError, message)
        self._convert = convert
        self._wait = wait  # reads answers until this one has come (ProcessWriters)

    @classmethod
    def answered(cls, value: Any = None, error: BaseException | None = None) -> "Ticket":
        ticket = cls()
        if isinstance(error, OSError):
            ticket._fail(error.errno or errno.EIO, str(error))
        elif error is not None:
            ticket._fail(None, str(error))
        else:
            ticket._set(value)
        return ticket

    def _set(self, value: Any) -> None:
        self._value, self.done = value, True

    def _fail(self, code: int | None, message: str) -> None:
        self._error, self.done = (code, message), True

    def failure(self) -> OSError | ValueError | None:
        """An answered ticket's failure, without waiting (None if it has
        none, or no answer yet)."""
        if not self.done or self._error is None:
            return None
        code, message = self._error
        return ValueError(message) if code is None else OSError(code, message)

    async def result(self) -> Any:
        if not self.done:
            assert self._wait is not None
            await self._wait(self)
        else:
            await trio.lowlevel.checkpoint()
        failure = self.failure()
        if failure is not None:
            raise failure
        return self._convert(self._value) if self._convert is not None else self._value


def _outcomes(result: Any) -> list[Outcome]:
    return [Outcome(sha, written=written, intact=intact) for sha, written, intact in result]


class ThreadWriters:
    """The writers run in this process, each step in a trio worker thread
    (so a ticket is answered by the time it is handed out)."""

    def __init__(self, buffers: int) -> None:
        self.buffers = [mmap.mmap(-1, BUFFER) for _ in range(buffers)]
        self._ids = 0

    async def start(self, helpers: trio.Nursery) -> None:
        self._helpers = helpers

    async def open(self, pieces: list[Piece]) -> WriterHandle:
        writer = PieceWriter(pieces)
        self._ids += 1
        handle = WriterHandle(self._ids, pieces, writer.slabs, writer)
        if any(p.path is not None for p in pieces):
            # The pieces' files, made ahead of the writer on the other core
            # (a bounded job: it stops when the writer is closed or abandoned).
            try:
                self._helpers.start_soon(trio.to_thread.run_sync, writer.precreate)
            except RuntimeError:
                pass  # the intake is stopping: the writer creates its own files, if it ever runs
        await trio.lowlevel.checkpoint()
        return handle

    async def write_slab(self, handle: WriterHandle, buffer: int) -> Ticket:
        assert handle.local is not None
        try:
            await trio.to_thread.run_sync(handle.local.write_slab, self.buffers[buffer])
        except (OSError, ValueError) as exc:
            return Ticket.answered(error=exc)
        return Ticket.answered()

    async def close(self, handle: WriterHandle) -> Ticket:
        assert handle.local is not None
        try:
            return Ticket.answered(await trio.to_thread.run_sync(handle.local.close))
        except (OSError, ValueError) as exc:
            return Ticket.answered(error=exc)

    async def abandon(self, handle: WriterHandle) -> None:
        assert handle.local is not None
        handle.local.abandon()
        await trio.lowlevel.checkpoint()

    def stop_precreate(self, handle: WriterHandle) -> None:
        assert handle.local is not None
        handle.local.stop_precreate()

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()


@dataclass
class _Started:
    """A helper process and its shared buffers, started and not yet used."""

    fd: int  # the memfd of the buffers
    count: int  # buffers in it
    python: str  # the interpreter it runs
    map: mmap.mmap
    proc: "subprocess.Popen[bytes]"
    to_helper: int  # its stdin (ours to write)
    from_helper: int  # its stdout (ours to read)

    def end(self) -> None:
        """Close our ends: the helper then exits (its stdin ends); wait for it."""
        for fd in (self.to_helper, self.from_helper):
            os.close(fd)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # pragma: no cover - it exits when its stdin ends
            self.proc.kill()
            self.proc.wait()
        self.map.close()
        os.close(self.fd)


def _start_helper(count: int, python: str) -> _Started:
    """Start a helper process with ``count`` shared buffers."""
    fd = os.memfd_create("capsulefs-slabs", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, count * BUFFER)
        shared = mmap.mmap(fd, count * BUFFER)
    except BaseException:
        os.close(fd)
        raise
    try:
        # Isolated (-I), in "/": it imports the installed capsulefs and the
        # standard library only, never a module planted in the directory the
        # daemon was started from (``-m`` alone puts it first on sys.path,
        # and the helper runs as root), nor what PYTHON* variables name. It
        # ends when its stdin does, which this process's death closes too.
        # In a session of its own: see the module's rules (the CPU share).
        proc = subprocess.Popen(
            [python, "-I", "-m", "capsulefs.move.writer_process", str(fd), str(count), str(BUFFER)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=[fd], cwd="/", start_new_session=True)
    except BaseException:
        shared.close()
        os.close(fd)
        raise
    assert proc.stdin is not None and proc.stdout is not None
    to_helper, from_helper = os.dup(proc.stdin.fileno()), os.dup(proc.stdout.fileno())
    proc.stdin.close()
    proc.stdout.close()
    return _Started(fd, count, python, shared, proc, to_helper, from_helper)


class SpareHelper:
    """One helper process started ahead of the move that will use it.

    A helper takes 10-45 ms of Python to start. ``ProcessWriters.start``
    overlaps that with the offer's round trip, but a move whose blobs are
    all present sends only its capsule's few small files, and then waits
    for the helper in verify: most of its freeze-to-activate time. The move
    service keeps one spare started: a move takes it (:meth:`take`) and the
    service starts the next one as that move's intake ends (:meth:`fill`:
    a fork and exec, some 0.5 ms on the event loop; the start-up runs in
    the new process). A spare that died meanwhile, or that was started
    with another interpreter or number of buffers, is ended and not used.
    :meth:`close` ends an unused spare; ending one waits for its process
    (at most 5 s, on the event loop: it exits as soon as its stdin ends).
    Event-loop thread only."""

    def __init__(self, buffers: int, *, python: str | None = None) -> None:
        self.buffers = buffers
        self._python = python or sys.executable
        self._spare: _Started | None = None
        self._closed = False
        self.started = 0  # helpers started here (tests and logs)

    def fill(self) -> None:
        """Start a spare if there is none (an OSError is logged: moves then
        start their own helper, as without a spare)."""
        if self._closed or self._spare is not None:
            return
        try:
            self._spare = _start_helper(self.buffers, self._python)
            self.started += 1
        except OSError as exc:
            log.warning("cannot start a spare writer process for moves: %s", exc)

    def take(self, count: int, python: str | None = None) -> _Started | None:
        """The spare, if one with ``count`` buffers, run by ``python`` (by
        default this interpreter), is alive; it is then the caller's."""
        spare, self._spare = self._spare, None
        if spare is None:
            return None
        if spare.count != count or spare.python != (python or sys.executable) or spare.proc.poll() is not None:
            spare.end()
            return None
        return spare

    def close(self) -> None:
        self._closed = True
        spare, self._spare = self._spare, None
        if spare is not None:
            spare.end()


class ProcessWriters:
    """The writers run in a helper process, fed through shared memory.

    Requests are pipelined: each is written to the helper's stdin as it
    comes (one at a time, never half), and the helper answers them in
    order. Whoever waits for an answer reads the helper's stdout and hands
    out every answer that comes before its own, to the tickets waiting
    for them. So the helper has the next slab queued while it writes one,
    and the event loop never waits for it to start a call. A request that
    does not fit in the pipe is sent while reading answers: the helper
    stops reading requests while nobody reads its answers."""

    def __init__(self, buffers: int, *, python: str | None = None, spare: SpareHelper | None = None) -> None:
        self.buffers: list[memoryview] = []  # made by start
        self._spare = spare  # where a helper started ahead may be waiting
        self.pid: int | None = None  # the helper's (tests and logs)
        self._fd = -1
        self._map: mmap.mmap | None = None
        self._count = buffers
        self._python = python or sys.executable
        self._proc: subprocess.Popen[bytes] | None = None
        self._send: trio.lowlevel.FdStream | None = None
        self._receive: trio.lowlevel.FdStream | None = None
        self._replies = bytearray()
        self._sending = trio.Lock()  # one request written at a time
        self._reading = trio.Lock()  # one reader of the answers at a time
        self._asked: deque[Ticket] = deque()  # sent, not yet answered: in the helper's order
        self._dead: str | None = None  # why the helper can no longer be asked
        self._open: dict[int, WriterHandle] = {}
        self._ids = 0

    async def start(self, helpers: trio.Nursery) -> None:
        """Start the helper now, while the offer is answered: every move
        sends at least its capsule's small files, and the helper's start-up
        (some 50 ms of python) then overlaps the offer's round trip."""
        self._spawn()
        await trio.lowlevel.checkpoint()

    def _spawn(self) -> None:
        started = self._spare.take(self._count, self._python) if self._spare is not None else None
        if started is None:
            started = _start_helper(self._count, self._python)
        self._fd, self._map, self._proc, self.pid = started.fd, started.map, started.proc, started.proc.pid
        whole = memoryview(self._map)
        self.buffers = [whole[i * BUFFER : (i + 1) * BUFFER] for i in range(self._count)]
        whole.release()
        self._send = trio.lowlevel.FdStream(started.to_helper)
        self._receive = trio.lowlevel.FdStream(started.from_helper)

    def _died(self, why: str) -> None:
        """The helper can no longer answer: every ticket still waiting fails."""
        self._dead = self._dead or why
        while self._asked:
            self._asked.popleft()._fail(errno.EIO, f"the move's writer process {self._dead}")

    async def _request(self, request: dict[str, Any], convert: Callable[[Any], Any] | None = None) -> Ticket:
        """Send one request; its ticket is answered in the helper's order."""
        ticket = Ticket(convert, self._await)
        async with self._sending:
            if self._dead is not None:
                ticket._fail(errno.EIO, f"the move's writer process {self._dead}")
                return ticket
            assert self._send is not None
            self._asked.append(ticket)  # before the bytes go: an answer can come as soon as they are out
            line = json.dumps(request).encode() + b"\n"
            try:
                with trio.CancelScope(shield=True):  # a request half sent would desync the pipe
                    try:
                        sent = os.write(self._send.fileno(), line)  # the pipe is non-blocking: what fits now
                    except BlockingIOError:
                        sent = 0
                    if sent < len(line):
                        await self._send_draining(memoryview(line)[sent:])
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                self._died("died")
        return ticket

    async def _send_draining(self, rest: memoryview) -> None:
        """Send the rest of a request while reading answers: the helper
        stops reading its stdin while its stdout is full, and a request
        (an ``open`` of many pieces) can be larger than the pipe."""
        assert self._send is not None
        failure: BaseException | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._drain)
            try:
                await self._send.send_all(rest)
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                failure = exc  # raised as itself below, not inside the nursery's ExceptionGroup
            nursery.cancel_scope.cancel()
        if failure is not None:
            raise failure

    async def _drain(self) -> None:
        """Hand out answers as they come, until cancelled."""
        async with self._reading:
            while await self._read_answer():
                pass

    async def _await(self, ticket: Ticket) -> None:
        """Read answers, in order, until ``ticket``'s has come. Cancelling
        this loses nothing: bytes read stay in the buffer for the next reader."""
        while not ticket.done:
            async with self._reading:
                while not ticket.done and await self._read_answer():
                    pass

    async def _read_answer(self) -> bool:
        """Read the next answer and hand it to the oldest ticket waiting;
        False once the helper can no longer answer. Caller holds ``_reading``."""
        while (end := self._replies.find(b"\n")) < 0:
            if self._dead is not None and not self._asked:
                return False
            assert self._receive is not None
            try:
                data = await self._receive.receive_some(65536)
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            if not data:
                self._died("died")
                return False
            self._replies += data
        line = bytes(self._replies[:end])
        del self._replies[: end + 1]
        if not self._asked:  # an answer nobody asked for: the pipe cannot be trusted any more
            self._died("answered out of turn")
            return False
        answered = self._asked.popleft()
        reply = json.loads(line)
        if reply.get("ok"):
            answered._set(reply.get("result"))
        elif reply.get("type") == "ValueError":
            answered._fail(None, reply["message"])
        else:
            answered._fail(reply.get("errno") or errno.EIO, reply["message"])
        return True

    async def _ask(self, request: dict[str, Any]) -> Any:
        return await (await self._request(request)).result()

    async def open(self, pieces: list[Piece]) -> WriterHandle:
        """A writer for one call. Not waited for: the helper opens it before
        any of its slabs, and a failure there fails the writer's slabs."""
        self._ids += 1
        handle = WriterHandle(self._ids, pieces, layout(pieces))
        self._open[handle.id] = handle
        await self._request({"op": "open", "w": handle.id, "pieces": [[p.sha, p.size, p.path] for p in pieces]})
        return handle

    async def write_slab(self, handle: WriterHandle, buffer: int) -> Ticket:
        return await self._request({"op": "slab", "w": handle.id, "buffer": buffer})

    async def close(self, handle: WriterHandle) -> Ticket:
        def closed(result: Any) -> list[Outcome]:
            self._open.pop(handle.id, None)  # refused, it stays open: the caller abandons it
            return _outcomes(result)

        return await self._request({"op": "close", "w": handle.id}, closed)

    async def abandon(self, handle: WriterHandle) -> None:
        if handle.id not in self._open:
            await trio.lowlevel.checkpoint()
            return
        with trio.CancelScope(shield=True):  # clean-up: a cancelled caller must not leave the files
            try:
                await self._ask({"op": "abandon", "w": handle.id})
            except OSError:
                if self._dead is None:
                    raise  # the helper could not remove them (say the disk went read-only): the caller's failure
                # It died with them open: remove them from here.
                remove_files(p.path for p in handle.pieces if p.path is not None)
            finally:
                self._open.pop(handle.id, None)

    def stop_precreate(self, handle: WriterHandle) -> None:
        pass  # the helper's precreate stops at abandon or close, which come next

    async def aclose(self) -> None:
        """Abandon what is still open, then end the helper."""
        with trio.CancelScope(shield=True):
            for handle in list(self._open.values()):
                try:
                    await self.abandon(handle)
                except OSError:
                    pass
            if self._send is not None:
                await self._send.aclose()
            if self._receive is not None:
                await self._receive.aclose()
            proc = self._proc
            if proc is not None:
                with trio.move_on_after(5):
                    while proc.poll() is None:
                        await trio.sleep(0.005)
                if proc.poll() is None:
                    proc.kill()
                    await trio.to_thread.run_sync(proc.wait)
            self._dead = self._dead or "was closed"
            for buf in self.buffers:
                try:
                    buf.release()
                except BufferError:
                    pass
            if self._map is not None:
                try:
                    self._map.close()
                except BufferError:
                    pass  # a view of a buffer is still out (a cancelled read): unmapped when it goes
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
