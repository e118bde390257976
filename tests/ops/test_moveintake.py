"""The target's intake of a move (capsulefs/move/intake.py): real files, real
worker threads; the batches stand in for a call's payload."""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import subprocess
import sys
import pytest
import trio
import trio.testing

from capsulefs.core import linuxfs
from capsulefs.core.linuxfs import FileSystemSync
from capsulefs.move.intake import Intake
from capsulefs.move.pieces import BUFFER, Outcome, Piece
from helpers import HANG


class Sink:
    """What the move service would do with the intake's reports."""

    def __init__(self) -> None:
        self.outcomes: list[Outcome] = []
        self.settled: dict[str, str] = {}
        self.settle_error: OSError | None = None

    def record(self, outcomes: list[Outcome]) -> None:
        self.outcomes.extend(outcomes)

    def settle(self, durable: dict[str, str]) -> None:
        if self.settle_error is not None:
            raise self.settle_error
        for sha, path in durable.items():
            with open(path, "rb") as f:  # durable means whole, under its name
                assert hashlib.sha256(f.read()).hexdigest() == sha
        self.settled.update(durable)


class CountingSync(FileSystemSync):
    """A FileSystemSync that records the paths of each ``files`` call."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.synced: list[list[str]] = []

    def files(self, paths) -> None:
        paths = sorted(paths)
        self.synced.append(paths)
        super().files(paths)


def piece(tmp_path, data: bytes, *, path: bool = True) -> Piece:
    sha = hashlib.sha256(data).hexdigest()
    return Piece(sha, len(data), str(tmp_path / sha) if path else None)


@pytest.fixture(params=["thread", "process"])
def writers(request) -> str:
    """Where the writers run: worker threads, or the helper process."""
    return request.param


class batches_of:
    """A call's payload as the intake takes it (what ``peerlink.Payload``
    gives): ``readinto`` fills the buffer it is given, ``size`` bytes per
    step, each step a checkpoint; it can fail after some steps (the link
    died) or wait at each step after the first until ``pause`` is set."""

    def __init__(self, data: bytes, size: int = 1000, *, fail_after: int | None = None,
                 pause: trio.Event | None = None) -> None:
        self.data, self.size, self.fail_after, self.pause = data, size, fail_after, pause
        self.at = self.sent = 0

    async def readinto(self, buffer: memoryview) -> None:
        assert len(buffer) <= len(self.data) - self.at, "read past the payload"
        got = 0
        while got < len(buffer):
            await trio.lowlevel.checkpoint()
            if self.fail_after is not None and self.sent >= self.fail_after:
                raise ConnectionResetError("the link died")
            if self.pause is not None and self.sent:
                await self.pause.wait()
            n = min(self.size, len(buffer) - got)
            buffer[got : got + n] = self.data[self.at : self.at + n]
            self.at += n
            got += n
            self.sent += 1


@pytest.mark.parametrize("whole", [False, True], ids=["fsync-each", "syncfs"])
async def test_calls_are_written_synced_and_settled_in_the_background(tmp_path, writers, whole) -> None:
    sink = Sink()
    sync = CountingSync(str(tmp_path), dirty=lambda: 0, magic=lambda path: 0xEF53) if whole else None
    intake = Intake(record=sink.record, settle=sink.settle, depth=1, writers=writers, sync=sync)
    blobs = [os.urandom(n) for n in (5000, 1, 0, 12345)]
    async with trio.open_nursery() as nursery:
        await nursery.start(intake.run)
        first = [piece(tmp_path, b) for b in blobs[:2]]
        await intake.take(batches_of(b"".join(blobs[:2])), first)
        second = [piece(tmp_path, b) for b in blobs[2:]]
        await intake.take(batches_of(b"".join(blobs[2:]), 777), second)
        await intake.settled()
        assert [o.sha for o in sink.outcomes] == [p.sha for p in first + second]
        assert all(o.written and o.intact for o in sink.outcomes)
        assert set(sink.settled) == {p.sha for p in first + second}
        assert intake.inflight == set()
        await intake.aclose()
    for p, data in zip(first + second, blobs):
        with open(p.path, "rb") as f:
            assert f.read() == data
    if sync is not None:  # one bulk sync per call, of that call's pieces
        sync.close()
        assert sync.synced == [sorted(p.path for p in first), sorted(p.path for p in second)]
        assert sync.whole is False  # closed


async def test_a_piece_that_does_not_hash_to_its_name_is_reported_not_settled(tmp_path, writers) -> None:
    sink = Sink()
    intake = Intake(record=sink.record, settle=sink.settle, writers=writers)
    good, bad = os.urandom(3000), os.urandom(3000)
    liar = Piece(hashlib.sha256(b"something else").hexdigest(), len(bad), str(tmp_path / "liar"))
    async with trio.open_nursery() as nursery:
        await nursery.start(intake.run)
        await intake.take(batches_of(good + bad), [piece(tmp_path, good), liar])
        await intake.settled()
        await intake.aclose()
    assert [(o.written, o.intact) for o in sink.outcomes] == [(True, True), (True, False)]
    assert list(sink.settled) == [hashlib.sha256(good).hexdigest()]
    assert not os.path.exists(liar.path)
    assert intake.inflight == set()


async def test_pieces_without_a_path_are_read_and_dropped(tmp_path, writers) -> None:
    sink = Sink()
    intake = Intake(record=sink.record, settle=sink.settle, writers=writers)
    data = os.urandom(4000)
    async with trio.open_nursery() as nursery:
        await nursery.start(intake.run)
        await intake.take(batches_of(data), [piece(tmp_path, data, path=False)])
        await intake.settled()
        await intake.aclose()
    assert [o.written for o in sink.outcomes] == [False]
    assert sink.settled == {} and os.listdir(tmp_path) == []


async def test_a_piece_in_the_intake_is_never_given_a_path_twice(tmp_path, writers) -> None:
    """Its file may be being synced or linked into the store: a second
    writer truncating it would change a stored blob under its name."""
    sink = Sink()
    intake = Intake(record=sink.record, settle=sink.settle, writers=writers)
    data = os.urandom(4000)
    pause, took = trio.Event(), trio.Event()

    async def call() -> None:
        await intake.take(batches_of(data, pause=pause), [piece(tmp_path, data)])
        took.set()

    async with trio.open_nursery() as nursery:
        await nursery.start(intake.run)
        nursery.start_soon(call)
        await trio.testing.wait_all_tasks_blocked()
        assert intake.inflight == {hashlib.sha256(data).hexdigest()}
        with pytest.raises(ValueError, match="path twice"):
            await intake.take(batches_of(data), [piece(tmp_path, data)])
        other = os.urandom(10)  # not in flight: only the duplicate within the call is wrong
        with pytest.raises(ValueError, match="path twice"):
            await intake.take(batches_of(other + other), [piece(tmp_path, other), piece(tmp_path, other)])
        pause.set()
        await took.wait()
        await intake.settled()
        assert intake.inflight == set()
        await intake.aclose()
    assert list(sink.settled) == [hashlib.sha256(data).hexdigest()]


async def test_a_write_failure_fails_every_later_call_and_verify(tmp_path, monkeypatch) -> None:
    """The writer's own error (not a closed channel's, not Cancelled) is
    what the call, every later call and verify report; nothing is left
    under a piece's name. Run many times: the stages race the caller."""
    from capsulefs.move import pieces as piecewriter

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(piecewriter.os, "write", full)
    for attempt in range(20):
        d = tmp_path / str(attempt)
        d.mkdir()
        sink = Sink()
        intake = Intake(record=sink.record, settle=sink.settle, depth=1)
        first, second = os.urandom(20_000), os.urandom(5000)
        async with trio.open_nursery() as nursery:
            await nursery.start(intake.run)
            try:
                await intake.take(batches_of(first + second, 500), [piece(d, first), piece(d, second)])
            except OSError as exc:  # the failure came while the call was still handing over
                assert exc.errno == errno.ENOSPC
            with pytest.raises(OSError) as failed:
                await intake.settled()
            assert failed.value.errno == errno.ENOSPC and "No space left" in str(failed.value)
            fine = os.urandom(100)
            with pytest.raises(OSError) as later:
                await intake.take(batches_of(fine), [piece(d, fine)])
            assert later.value.errno == errno.ENOSPC
            await intake.aclose()
        assert sink.outcomes == [] and sink.settled == {}
        assert os.listdir(d) == []  # neither the piece that failed nor the one made ahead of it
        assert intake.inflight == set()


async def test_a_failure_to_clean_up_fails_the_move_not_the_service(tmp_path, monkeypatch) -> None:
    """Removing a cut call's piece fails (say the file system went
    read-only): that move's intake fails and says why; the nursery that
    owns every move's intake does not see the error, and closing the
    intake still returns."""
    from capsulefs.move import pieces as piecewriter

    def read_only(path, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", path)

    sink = Sink()
    intake = Intake(record=sink.record, settle=sink.settle, depth=1)
    data = os.urandom(BUFFER + 10_000)  # cut in its second slab: the first is on disk
    async with trio.open_nursery() as nursery:  # stands for the service's: it must not fail
        await nursery.start(intake.run)
        monkeypatch.setattr(piecewriter.os, "unlink", read_only)
        with pytest.raises(ConnectionResetError):
            await intake.take(batches_of(data, 1 << 16, fail_after=BUFFER // (1 << 16)), [piece(tmp_path, data)])
        with pytest.raises(OSError) as failed:
            await intake.settled()
        assert failed.value.errno == errno.EROFS
        with trio.fail_after(HANG):
            await intake.aclose()


async def test_closing_with_a_call_ended_but_not_yet_written_removes_its_files(tmp_path, writers) -> None:
    """A call handed over its bytes and returned; the writer has not got
    to it when the intake is closed: its files (made ahead or begun) go."""
    sink = Sink()
    intake = Intake(record=sink.record, settle=sink.settle, depth=64, writers=writers)
    blobs = [os.urandom(3000) for _ in range(6)]
    gate = trio.Event()
    real_feed = Intake._write_stage

    async def slow_stage(self) -> None:
        await gate.wait()  # the writer stage is busy elsewhere
        await real_feed(self)

    intake._write_stage = slow_stage.__get__(intake)  # type: ignore[method-assign]
    async with trio.open_nursery() as nursery:
        await nursery.start(intake.run)
        await intake.take(batches_of(b"".join(blobs)), [piece(tmp_path, b) for b in blobs])
        with trio.fail_after(HANG):
            while len(os.listdir(tmp_path)) < len(blobs):  # made ahead of the writer
                await trio.sleep(0.01)
            await intake.aclose()
    assert os.listdir(tmp_path) == []
    assert sink.outcomes == [] and intake.inflight == set()


async def test_a_settle_failure_fails_verify(tmp_path, writers) -> None:
    sink = Sink()
    sink.settle_error = OSError(errno.ENOSPC, "No space left on device")
    intake = Intake(record=sink.record, settle=sink.settle, writers=writers)
    data = os.urandom(1000)
    async with trio.open_nursery() as nursery:
        await nursery.start(intake.run)
        await intake.take(batches_of(data), [piece(tmp_path, data)])
        with pytest.raises(OSError) as failed:
            await intake.settled()
        assert failed.value.errno == errno.ENOSPC
        await intake.aclose()


async def test_a_failed_sync_of_the_file_system_fails_verify_and_settles_nothing(tmp_path, monkeypatch) -> None:
    """syncfs reporting a write-back error: the pieces are not known to be
    durable, so none is settled and the move fails (the source rolls back)."""

    def fn(fd: int) -> int:
        ctypes.set_errno(errno.EIO)
        return -1

    monkeypatch.setattr(linuxfs, "_syncfs", (ctypes, fn))
    sink = Sink()
    with FileSystemSync(str(tmp_path), dirty=lambda: 0, magic=lambda path: 0xEF53) as sync:
        intake = Intake(record=sink.record, settle=sink.settle, sync=sync, writers="process")
        data, more = os.urandom(1000), os.urandom(1000)
        async with trio.open_nursery() as nursery:
            await nursery.start(intake.run)
            await intake.take(batches_of(data + more), [piece(tmp_path, data), piece(tmp_path, more)])
            with pytest.raises(OSError) as failed:
                await intake.settled()
            assert failed.value.errno == errno.EIO
            with pytest.raises(OSError):
                await intake.take(batches_of(data), [piece(tmp_path, data)])
            await intake.aclose()
    assert sink.settled == {}


async def test_a_call_cut_short_leaves_no_piece_and_the_piece_can_come_again(tmp_path, writers) -> None:
    sink = Sink()
    intake = Intake(record=sink.record, settle=sink.settle, depth=1, writers=writers)
    data = os.urandom(10_000)
    async with trio.open_nursery() as nursery:
        await nursery.start(intake.run)
        with pytest.raises(ConnectionResetError):
            await intake.take(batches_of(data, 1000, fail_after=4), [piece(tmp_path, data)])
        await intake.settled()  # the cut call is no failure of the intake
        assert sink.outcomes == [] and os.listdir(tmp_path) == [] and intake.inflight == set()
        await intake.take(batches_of(data), [piece(tmp_path, data)])
        await intake.settled()
        await intake.aclose()
    assert list(sink.settled) == [hashlib.sha256(data).hexdigest()]


async def test_closing_the_intake_under_a_call_stops_it_and_removes_its_piece(tmp_path, writers) -> None:
    sink = Sink()
    intake = Intake(record=sink.record, settle=sink.settle, depth=1, writers=writers)
    data = os.urandom(10_000)
    pause = trio.Event()
    failures: list[BaseException] = []

    async def call() -> None:
        try:
            await intake.take(batches_of(data, 1000, pause=pause), [piece(tmp_path, data)])
        except OSError as exc:
            failures.append(exc)

    async with trio.open_nursery() as nursery:
        await nursery.start(intake.run)
        nursery.start_soon(call)
        await trio.testing.wait_all_tasks_blocked()
        with trio.fail_after(HANG):
            await intake.aclose()
        pause.set()
    assert [f.errno for f in failures] == [errno.ECANCELED]
    assert os.listdir(tmp_path) == []
    with pytest.raises(OSError, match="closed"):
        await intake.settled()


async def test_a_caller_cancelled_mid_call_leaves_no_piece(tmp_path, writers) -> None:
    sink = Sink()
    intake = Intake(record=sink.record, settle=sink.settle, depth=1, writers=writers)
    data = os.urandom(10_000)
    pause = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(intake.run)
        with trio.move_on_after(0.2):
            await intake.take(batches_of(data, 1000, pause=pause), [piece(tmp_path, data)])
        await intake.settled()
        assert os.listdir(tmp_path) == [] and intake.inflight == set() and intake.failure is None
        await intake.aclose()


async def test_after_a_failed_slab_the_calls_later_pieces_are_not_written(tmp_path, writers) -> None:
    """The first piece's slab fails (its directory is missing): the pieces
    of the slabs after it are never written, with either kind of writer,
    and the call fails with that error."""
    sink = Sink()
    intake = Intake(record=sink.record, settle=sink.settle, depth=2, writers=writers)
    first, later = os.urandom(BUFFER), [os.urandom(BUFFER // 2) for _ in range(4)]
    pieces = [piece(tmp_path / "missing", first)] + [piece(tmp_path, b) for b in later]
    async with trio.open_nursery() as nursery:
        await nursery.start(intake.run)
        with pytest.raises(OSError) as failed:
            await intake.take(batches_of(first + b"".join(later), 1 << 20), pieces)
            await intake.settled()
        assert failed.value.errno == errno.ENOENT
        await intake.aclose()
    assert os.listdir(tmp_path) == [] and sink.settled == {} and sink.outcomes == []


SLOW_HELPER = """#!/bin/sh
# capsulefs.move.writer_process with each slab taking a second ("-I -m capsulefs.move.writer_process" dropped)
shift 3
exec {python} -c '
import sys, time
import capsulefs.move.pieces as pw
write_slab = pw.PieceWriter.write_slab
def slow(self, buffer):
    time.sleep(1.0)  # (pacing: each slab slow on purpose)
    return write_slab(self, buffer)
pw.PieceWriter.write_slab = slow
from capsulefs.move import writer_process
writer_process.serve(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
' "$@"
"""


async def test_a_buffer_the_helper_may_still_read_is_never_handed_to_a_call(tmp_path) -> None:
    """Closing the intake while the helper still works on a call's slabs,
    with the next call waiting for a buffer: that call must not get one
    of those buffers (it would decrypt into memory the helper is hashing
    and writing); it fails without reading a byte."""
    wrapper = tmp_path / "slow-helper"
    wrapper.write_text(SLOW_HELPER.format(python=sys.executable))
    wrapper.chmod(0o755)
    pieces_dir = tmp_path / "pieces"
    pieces_dir.mkdir()
    sink = Sink()
    intake = Intake(record=sink.record, settle=sink.settle, depth=0, writers="process")  # two buffers
    intake._writers._python = str(wrapper)
    first = os.urandom(2 * BUFFER)
    second = batches_of(os.urandom(1000))
    failures: list[BaseException] = []

    async def next_call() -> None:
        try:
            await intake.take(second, [piece(pieces_dir, second.data)])
        except OSError as exc:
            failures.append(exc)

    async with trio.open_nursery() as nursery:
        await nursery.start(intake.run)
        await intake.take(batches_of(first, 1 << 20), [piece(pieces_dir, first)])  # both buffers at the helper
        nursery.start_soon(next_call)
        await trio.testing.wait_all_tasks_blocked()
        with trio.fail_after(HANG):
            await intake.aclose()
    assert [f.errno for f in failures] == [errno.ECANCELED]
    assert second.at == 0  # it never got a buffer
    assert sink.settled == {}


async def test_a_writer_process_that_dies_fails_the_move_and_leaves_no_piece(tmp_path) -> None:
    """The helper process is killed while a call streams in: that call,
    every later one and verify fail with EIO; the files it had made for the
    call (begun or made ahead) are removed from the intake's side; closing
    returns."""
    sink = Sink()
    intake = Intake(record=sink.record, settle=sink.settle, depth=1, writers="process")
    blobs = [os.urandom(BUFFER // 2 + 1) for _ in range(6)]
    data = b"".join(blobs)
    pause = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(intake.run)

        async def killer() -> None:
            with trio.fail_after(HANG):
                while len(os.listdir(tmp_path)) < 2:  # it has begun the call's files
                    await trio.sleep(0.005)
            proc = intake._writers._proc  # started with the call's writer
            assert proc is not None and proc.poll() is None
            proc.kill()
            pause.set()

        nursery.start_soon(killer)
        with pytest.raises(OSError) as failed:
            await intake.take(batches_of(data, 1 << 20, pause=pause), [piece(tmp_path, b) for b in blobs])
            await intake.settled()  # if the call had handed everything over before the kill
        assert failed.value.errno == errno.EIO
        with pytest.raises(OSError) as later:
            await intake.take(batches_of(blobs[0]), [piece(tmp_path, blobs[0])])
        assert later.value.errno == errno.EIO
        with trio.fail_after(HANG):
            await intake.aclose()
    assert os.listdir(tmp_path) == []
    assert sink.settled == {} and intake.inflight == set()


async def test_a_full_disk_under_the_writer_process_fails_the_move_with_enospc(tmp_path) -> None:
    """A real ENOSPC, from a 1 MiB tmpfs, met by the helper process: the
    call or verify reports it as ENOSPC and no piece is left behind."""
    small = tmp_path / "small"
    small.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], check=True,
                       capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc}")
    try:
        sink = Sink()
        intake = Intake(record=sink.record, settle=sink.settle, depth=1, writers="process")
        data = os.urandom(3 << 20)
        async with trio.open_nursery() as nursery:
            await nursery.start(intake.run)
            with pytest.raises(OSError) as failed:
                await intake.take(batches_of(data, 1 << 20), [piece(small, data)])
                await intake.settled()
            assert failed.value.errno == errno.ENOSPC
            await intake.aclose()
        assert os.listdir(small) == [] and sink.settled == {}
    finally:
        subprocess.run(["umount", str(small)], check=True)
