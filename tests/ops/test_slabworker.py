"""The writer process of a move's target (capsulefs/move/writers.py and
capsulefs/move/writer_process.py): a real helper process, real files. Requests are
pipelined, so these tests send several before reading any answer."""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from capsulefs.move.pieces import BUFFER, Piece
from capsulefs.move.writers import ProcessWriters, SpareHelper, WriterHandle
from helpers import HANG


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@asynccontextmanager
async def helper(buffers: int) -> AsyncIterator[ProcessWriters]:
    """A started ProcessWriters, ended (helper and all) however the test goes."""
    writers = ProcessWriters(buffers)
    async with trio.open_nursery() as nursery:
        await writers.start(nursery)
        try:
            yield writers
        finally:
            await writers.aclose()


def fill(writers: ProcessWriters, handle: WriterHandle, slab: int, buffer: int, payload: bytes) -> None:
    """Put slab ``slab`` of ``payload`` (the pieces back to back) into the
    pool's ``buffer`` at its segments' offsets, as the intake does."""
    at = sum(seg.size for s in handle.slabs[:slab] for seg in s)
    for seg in handle.slabs[slab]:
        writers.buffers[buffer][seg.offset : seg.offset + seg.size] = payload[at : at + seg.size]
        at += seg.size


async def test_pipelined_requests_of_two_writers_are_answered_to_their_own_tickets(tmp_path) -> None:
    """Two calls' writers, their slabs interleaved, every request sent
    before any answer is read: each ticket gets its own answer, and every
    piece is written whole under its name."""
    one = [os.urandom(BUFFER // 2 + 7), os.urandom(3000)]
    two = [os.urandom(BUFFER - 5), os.urandom(BUFFER // 3)]
    async with helper(4) as writers:
        h1 = await writers.open([Piece(sha(b), len(b), str(tmp_path / sha(b))) for b in one])
        h2 = await writers.open([Piece(sha(b), len(b), str(tmp_path / sha(b))) for b in two])
        assert len(h1.slabs) == 1 and len(h2.slabs) == 2
        fill(writers, h1, 0, 0, b"".join(one))
        fill(writers, h2, 0, 1, b"".join(two))
        fill(writers, h2, 1, 2, b"".join(two))
        tickets = [await writers.write_slab(h2, 1), await writers.write_slab(h1, 0),
                   await writers.write_slab(h2, 2)]
        closed2, closed1 = await writers.close(h2), await writers.close(h1)
        assert not any(t.done for t in (*tickets, closed1, closed2))  # nothing read yet: all in flight
        outcomes1 = await closed1.result()  # reads every answer before its own, for the others
        assert all(t.done for t in (*tickets, closed2))
        for t in tickets:
            assert await t.result() is None
        outcomes2 = await closed2.result()
    assert [(o.sha, o.written, o.intact) for o in outcomes1] == [(sha(b), True, True) for b in one]
    assert [(o.sha, o.written, o.intact) for o in outcomes2] == [(sha(b), True, True) for b in two]
    for b in one + two:
        assert (tmp_path / sha(b)).read_bytes() == b


async def test_after_a_failed_slab_the_writers_later_requests_fail_the_same_way(tmp_path) -> None:
    """A slab fails (its piece's directory is missing) while the next slab
    and the close are already queued behind it: both fail with the same
    error, so the piece of the next slab is never reported written past
    the failure, and abandon leaves no file."""
    first, second = os.urandom(BUFFER), os.urandom(5000)
    pieces = [Piece(sha(first), len(first), str(tmp_path / "missing" / sha(first))),
              Piece(sha(second), len(second), str(tmp_path / sha(second)))]
    async with helper(3) as writers:
        handle = await writers.open(pieces)
        assert len(handle.slabs) == 2
        fill(writers, handle, 0, 0, first + second)
        fill(writers, handle, 1, 1, first + second)
        tickets = [await writers.write_slab(handle, 0), await writers.write_slab(handle, 1),
                   await writers.close(handle)]
        for ticket in tickets:
            with pytest.raises(OSError) as failed:
                await ticket.result()
            assert failed.value.errno == errno.ENOENT
            assert "missing" in str(failed.value)
        await writers.abandon(handle)
        # The helper still answers, in order, for a writer of its own.
        ok = os.urandom(100)
        other = await writers.open([Piece(sha(ok), len(ok), str(tmp_path / sha(ok)))])
        fill(writers, other, 0, 2, ok)
        await (await writers.write_slab(other, 2)).result()
        assert [o.intact for o in await (await writers.close(other)).result()] == [True]
    assert sorted(os.listdir(tmp_path)) == [sha(ok)]


async def test_a_dead_helper_fails_every_ticket_in_flight_with_eio(tmp_path) -> None:
    """The helper dies with requests queued: each of their tickets, and
    every later request, fails with EIO; abandon removes the files from
    this side."""
    data = os.urandom(BUFFER + 10)
    async with helper(3) as writers:
        handle = await writers.open([Piece(sha(data), len(data), str(tmp_path / sha(data)))])
        fill(writers, handle, 0, 0, data)
        assert writers._proc is not None
        writers._proc.kill()
        await trio.to_thread.run_sync(writers._proc.wait)
        tickets = [await writers.write_slab(handle, 0), await writers.close(handle)]
        for ticket in tickets:
            with pytest.raises(OSError) as failed:
                await ticket.result()
            assert failed.value.errno == errno.EIO
        with pytest.raises(OSError) as later:
            await (await writers.write_slab(handle, 1)).result()
        assert later.value.errno == errno.EIO
        await writers.abandon(handle)
    assert os.listdir(tmp_path) == []


async def test_a_request_larger_than_the_pipe_goes_out_while_answers_wait_to_be_read(tmp_path) -> None:
    """The helper answers a close of 3,000 pieces (some 250 KB: more than
    its stdout pipe holds, so it waits for us to read) while the next
    call's open (as large) is being sent (more than its stdin pipe holds):
    the send reads answers as it goes, so neither side waits for the
    other forever."""
    empty = sha(b"")
    many = [Piece(empty, 0, None) for _ in range(3000)]
    async with helper(2) as writers:
        with trio.fail_after(HANG):
            first = await writers.open(many)
            closed = await writers.close(first)  # its answer fills the helper's stdout
            second = await writers.open(many)  # about 250 KB into its stdin
            assert [o.sha for o in await closed.result()] == [empty] * 3000
            assert len(await (await writers.close(second)).result()) == 3000


async def test_a_helper_that_dies_while_a_large_request_is_sent_fails_it_with_eio(tmp_path) -> None:
    """The helper stops reading (stopped, then killed) while an open larger
    than the pipe is being sent: the send fails as the helper's death, EIO
    for this writer and every later request, not as an error of the send."""
    async with helper(2) as writers:
        proc = writers._proc
        assert proc is not None
        os.kill(proc.pid, signal.SIGSTOP)  # from here it reads nothing

        async def kill_once_the_send_waits() -> None:
            await trio.testing.wait_all_tasks_blocked()
            os.kill(proc.pid, signal.SIGKILL)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(kill_once_the_send_waits)
            handle = await writers.open([Piece(sha(b""), 0, None) for _ in range(5000)])  # about 400 KB
        with pytest.raises(OSError) as failed:
            await (await writers.close(handle)).result()
        assert failed.value.errno == errno.EIO


async def _write_one(writers: ProcessWriters, where, data: bytes) -> None:
    """One call of one piece through ``writers``: it must come out whole."""
    handle = await writers.open([Piece(sha(data), len(data), str(where / sha(data)))])
    fill(writers, handle, 0, 0, data)
    await writers.write_slab(handle, 0)
    outcomes = await (await writers.close(handle)).result()
    assert [(o.written, o.intact) for o in outcomes] == [(True, True)]
    assert (where / sha(data)).read_bytes() == data


async def test_a_spare_helper_is_taken_by_the_next_writers_and_ended_on_close(tmp_path) -> None:
    """The move service keeps one helper started ahead: the next intake's
    writers use that very process; fill() starts another; close() ends the
    unused one."""
    spare = SpareHelper(4)
    try:
        spare.fill()
        started = spare._spare
        assert started is not None and started.proc.poll() is None
        writers = ProcessWriters(4, spare=spare)
        async with trio.open_nursery() as nursery:
            await writers.start(nursery)
            try:
                assert writers.pid == started.proc.pid  # no new process
                assert spare._spare is None
                await _write_one(writers, tmp_path, os.urandom(10_000))
            finally:
                await writers.aclose()
        assert started.proc.poll() is not None  # the used helper ended with its writers
        spare.fill()
        second = spare._spare
        assert second is not None and second.proc.pid != started.proc.pid and spare.started == 2
    finally:
        spare.close()
    assert second.proc.poll() is not None  # close ended the unused spare, and waited for it
    spare.fill()
    assert spare._spare is None  # closed: no more spares


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("how", ["dead", "other size", "other python"])
async def test_a_spare_that_died_or_does_not_fit_is_not_used(tmp_path, how: str) -> None:
    before = _open_fds()
    spare = SpareHelper(3 if how == "other size" else 4)
    try:
        spare.fill()
        started = spare._spare
        assert started is not None
        if how == "dead":
            started.proc.kill()
            started.proc.wait()
        python = None
        if how == "other python":  # the same program under another name, for the test (beside its pyvenv.cfg)
            python = os.path.join(os.path.dirname(sys.executable), ".", os.path.basename(sys.executable))
        writers = ProcessWriters(4, spare=spare, python=python)
        async with trio.open_nursery() as nursery:
            await writers.start(nursery)
            try:
                assert writers.pid != started.proc.pid  # a fresh helper instead
                await _write_one(writers, tmp_path, os.urandom(5000))
            finally:
                await writers.aclose()
        assert started.proc.poll() is not None  # the unfit spare was ended, not leaked
        assert started.map.closed
        # Its memfd and both pipe ends were closed too (the fresh helper's,
        # ended with the writers, as well): no descriptor is left behind.
        assert _open_fds() == before
    finally:
        spare.close()


async def test_a_helper_ignores_the_terminals_ctrl_c_and_ends_with_its_stdin() -> None:
    """A Ctrl-C at a foreground daemon's terminal reaches the spare helper
    too: it neither dies with a traceback nor stays behind; it ends when
    the daemon closes its stdin."""
    spare = SpareHelper(2)
    try:
        spare.fill()
        started = spare._spare
        assert started is not None
        # Wait until it has started (and set its signals): it answers an abandon.
        os.write(started.to_helper, b'{"op": "abandon", "w": 1}\n')
        with trio.fail_after(HANG):
            while not os.read(started.from_helper, 4096).endswith(b"\n"):
                pass  # pragma: no cover - one read gets the short answer
        started.proc.send_signal(signal.SIGINT)
        # It answers a request sent after the signal: the signal was delivered before it read
        # the request (a pending signal is handled on the way back from the kernel), and ignored.
        os.write(started.to_helper, b'{"op": "abandon", "w": 2}\n')
        answer = b""
        while not answer.endswith(b"\n"):  # (a blocking read: the helper's answer, or EOF if it died)
            piece = os.read(started.from_helper, 4096)
            assert piece, "the helper died of the SIGINT"
            answer += piece
        assert started.proc.poll() is None
    finally:
        spare.close()
    assert started.proc.returncode == 0


async def test_a_helper_runs_in_a_session_of_its_own_and_still_ends_with_its_stdin(tmp_path) -> None:
    """Linux shares the CPU between sessions first (autogroup): a helper in
    the daemon's session would take its hashing and writing out of the
    event loop's share on a busy machine. It runs in a session of its own,
    with no terminal, and still ends once the daemon lets go of it."""
    async with helper(2) as writers:
        assert writers.pid is not None
        assert os.getsid(writers.pid) == writers.pid != os.getsid(0)
        proc = writers._proc
        assert proc is not None
        data = b"x" * 5000
        handle = await writers.open([Piece(sha(data), len(data), str(tmp_path / "piece"))])
        fill(writers, handle, 0, 0, data)
        await (await writers.write_slab(handle, 0)).result()
        assert [o.intact for o in await (await writers.close(handle)).result()] == [True]
    assert proc.returncode == 0  # (aclose waited for it: it ended with its stdin)
    assert (tmp_path / "piece").read_bytes() == data
