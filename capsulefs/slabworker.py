"""Where a move's target hashes and writes its pieces: in this process's
worker threads, or in a helper process of its own.

Rules:
  * Both run :class:`~capsulefs.piecewriter.PieceWriter` s, one per
    ``blobs`` call, the same way: open (the call's files are created ahead
    in a thread), one slab at a time from a buffer of the slab pool, then
    close (the outcomes) or abandon. The intake (``moveintake.Intake``)
    drives either through the same calls and does not know which it has.
  * :class:`ThreadWriters`: the pool is private memory and each step runs
    in a trio worker thread.
  * :class:`ProcessWriters`: the pool is one shared memory file (memfd);
    the event loop decrypts a slab into it and a helper process
    (``python -m capsulefs.slabhelper``) hashes and writes it from the same
    pages. Why: in one process the worker threads keep retaking the GIL
    from the event loop, which gives it up on every TLS record it decrypts;
    measured on the 2-core VM of docs/move.md, a move's transfer ran at
    268-276 MB/s with the writer in threads and 354-376 MB/s with it in a
    process, the raw stream at 350-510 MB/s.
  * The helper is the intake's: started by :meth:`ProcessWriters.start`,
    ended by :meth:`ProcessWriters.aclose` (its stdin closes; it is killed
    if it does not exit); it also ends when the daemon dies, which closes
    its stdin, after abandoning what it was writing. It takes
    one request at a time and answers each, in order, on its stdout: a JSON
    line each way. A request that fails there (a disk error) is raised here
    as the same OSError; if the helper dies, every request raises
    OSError(EIO) and the files of writers still open are removed from here.
  * Paths come from the intake (the move's staging area), never from a peer.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import trio

from capsulefs.piecewriter import BUFFER, Outcome, Piece, PieceWriter, Segment, layout, remove_files

__all__ = ["ProcessWriters", "ThreadWriters", "WriterHandle"]


@dataclass(eq=False)
class WriterHandle:
    """One call's writer, as the intake holds it."""

    id: int
    pieces: list[Piece]
    slabs: list[list[Segment]]
    local: PieceWriter | None = None  # ThreadWriters only


class ThreadWriters:
    """The writers run in this process, each step in a trio worker thread."""

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

    async def write_slab(self, handle: WriterHandle, buffer: int) -> None:
        assert handle.local is not None
        await trio.to_thread.run_sync(handle.local.write_slab, self.buffers[buffer])

    async def close(self, handle: WriterHandle) -> list[Outcome]:
        assert handle.local is not None
        return await trio.to_thread.run_sync(handle.local.close)

    async def abandon(self, handle: WriterHandle) -> None:
        assert handle.local is not None
        handle.local.abandon()
        await trio.lowlevel.checkpoint()

    def stop_precreate(self, handle: WriterHandle) -> None:
        assert handle.local is not None
        handle.local.stop_precreate()

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()


class ProcessWriters:
    """The writers run in a helper process, fed through shared memory."""

    def __init__(self, buffers: int, *, python: str | None = None) -> None:
        self.buffers: list[memoryview] = []  # made by start
        self._fd = -1
        self._map: mmap.mmap | None = None
        self._count = buffers
        self._python = python or sys.executable
        self._proc: subprocess.Popen[bytes] | None = None
        self._send: trio.lowlevel.FdStream | None = None
        self._receive: trio.lowlevel.FdStream | None = None
        self._replies = bytearray()
        self._lock = trio.Lock()  # one request in flight
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
        self._fd = os.memfd_create("capsulefs-slabs", os.MFD_CLOEXEC)
        os.ftruncate(self._fd, self._count * BUFFER)
        self._map = mmap.mmap(self._fd, self._count * BUFFER)
        whole = memoryview(self._map)
        self.buffers = [whole[i * BUFFER : (i + 1) * BUFFER] for i in range(self._count)]
        whole.release()
        # The helper finds capsulefs where this process did; it ends when its
        # stdin does, which this process's death closes too.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self._proc = subprocess.Popen(
            [self._python, "-m", "capsulefs.slabhelper", str(self._fd), str(self._count), str(BUFFER)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=[self._fd], env=env)
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._send = trio.lowlevel.FdStream(os.dup(self._proc.stdin.fileno()))
        self._receive = trio.lowlevel.FdStream(os.dup(self._proc.stdout.fileno()))
        self._proc.stdin.close()
        self._proc.stdout.close()

    async def _ask(self, request: dict[str, Any]) -> Any:
        async with self._lock:
            if self._dead is not None:
                raise OSError(errno.EIO, f"the move's writer process {self._dead}")
            assert self._send is not None and self._receive is not None
            try:
                with trio.CancelScope(shield=True):  # a request half sent or half answered would desync the pipe
                    await self._send.send_all(json.dumps(request).encode() + b"\n")
                    while b"\n" not in self._replies:
                        data = await self._receive.receive_some(65536)
                        if not data:
                            raise EOFError
                        self._replies += data
            except (OSError, EOFError, trio.BrokenResourceError, trio.ClosedResourceError):
                self._dead = "died"
                raise OSError(errno.EIO, "the move's writer process died") from None
            line, _, rest = bytes(self._replies).partition(b"\n")
            self._replies = bytearray(rest)
        reply = json.loads(line)
        if reply.get("ok"):
            return reply.get("result")
        if reply.get("type") == "ValueError":
            raise ValueError(reply["message"])
        raise OSError(reply.get("errno") or errno.EIO, reply["message"])

    async def open(self, pieces: list[Piece]) -> WriterHandle:
        self._ids += 1
        handle = WriterHandle(self._ids, pieces, layout(pieces))
        self._open[handle.id] = handle
        await self._ask({"op": "open", "w": handle.id, "pieces": [[p.sha, p.size, p.path] for p in pieces]})
        return handle

    async def write_slab(self, handle: WriterHandle, buffer: int) -> None:
        await self._ask({"op": "slab", "w": handle.id, "buffer": buffer})

    async def close(self, handle: WriterHandle) -> list[Outcome]:
        try:
            result = await self._ask({"op": "close", "w": handle.id})
        except OSError:
            await self.abandon(handle)
            raise
        self._open.pop(handle.id, None)
        return [Outcome(sha, written=written, intact=intact) for sha, written, intact in result]

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
