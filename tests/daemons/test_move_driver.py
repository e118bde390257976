"""Real moves between two host stores over real TLS on loopback, with a
fault-injecting double around the target. After every scenario: one holder
(never two), no staging left, a capsule that verifies on the holder, and a
journal that lost nothing."""

from __future__ import annotations

import errno
import os
import threading
from contextlib import ExitStack, aclosing
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
from helpers import HANG, export_and_unpack, make_agent

from capsulefs.core.capsule import archive
from capsulefs.core.capsule import format as fmt
from capsulefs.core import move as mv
from capsulefs.core.journal.events import UserMessage
from capsulefs.core.journal.file import open_journal
from capsulefs.core.linuxfs import FileSystemSync
from capsulefs.core.store.holder import HolderState, new_held
from capsulefs.move import read_ahead, target as move_target
from capsulefs.move.doubt import abandon_move, learn_holder
from capsulefs.move.outcome import MoveControl
from capsulefs.move.source import move_agent, resume_moves
from capsulefs.move.host import MoveHost
from capsulefs.move.target import MoveService, serve_moves
from capsulefs.peer.client import open_peer
from capsulefs.peer.errors import PeerBroken
from capsulefs.peer.framing import Payload
from capsulefs.peer.book import Peer



@dataclass
class Hooks:
    """Tracks which agents run on a host, as the mount daemon would."""

    name: str
    running: set[str] = field(default_factory=set)
    log: list[str] = field(default_factory=list)
    fail_freeze: OSError | None = None  # freeze stops the agent, then fails with this (once)

    async def freeze(self, agent_id: str) -> None:
        self.running.discard(agent_id)
        self.log.append("freeze")
        if self.fail_freeze is not None:
            exc, self.fail_freeze = self.fail_freeze, None
            raise exc

    async def resume(self, agent_id: str) -> None:
        self.running.add(agent_id)
        self.log.append("resume")

    async def retire(self, agent_id: str) -> None:
        self.running.discard(agent_id)
        self.log.append("retire")

    async def prepare(self, agent_id: str, staged_dir: str) -> None:
        assert os.path.isfile(os.path.join(staged_dir, fmt.MANIFEST))
        self.log.append("prepare")

    async def activate(self, agent_id: str) -> None:
        self.running.add(agent_id)
        self.log.append("activate")


@dataclass
class Fault:
    call: str
    when: str  # "before": the request is lost; "after": it ran, the reply is lost
    times: int = 1


class FaultyTarget:
    """Wraps the target's service; fails named calls before or after they run."""

    def __init__(self, inner: MoveService, *faults: Fault) -> None:
        self.inner = inner
        self.faults = list(faults)
        self.corrupt_next_blob = False
        self.break_in_blob = False
        self.fired: list[str] = []
        self.on_crash: Any = None  # called for "crash-before"/"crash-after" faults

    async def __call__(self, peer: Peer, call: str, args: dict[str, Any], payload: Payload) -> tuple[dict, bytes]:
        if call == "blobs" and self.corrupt_next_blob:
            self.corrupt_next_blob = False
            payload = _Corrupt(payload)  # type: ignore[assignment]
        if call == "blobs" and self.break_in_blob and payload.size > 1000:
            self.break_in_blob = False
            async with aclosing(payload.chunks()) as chunks:
                async for _ in chunks:
                    break  # some bytes arrived, then the link dies
            self.fired.append("blob:mid")
            raise PeerBroken("injected: link died in the middle of a blob")
        for f in self.faults:
            if f.call == call and f.times > 0:
                f.times -= 1
                self.fired.append(f"{call}:{f.when}")
                if f.when in ("before", "crash-before"):
                    await payload.drain()
                    if f.when == "crash-before":
                        self.on_crash()
                        await trio.sleep_forever()  # the crash cancels us
                    raise PeerBroken(f"injected: {call} request lost")
                await self.inner(peer, call, args, payload)
                if f.when == "crash-after":
                    self.on_crash()
                    await trio.sleep_forever()
                raise PeerBroken(f"injected: {call} reply lost")
        return await self.inner(peer, call, args, payload)


class _Corrupt:
    """The call's payload with its first byte flipped on the way in."""

    def __init__(self, inner: Payload) -> None:
        self.inner = inner
        self.size = inner.size
        self.first = True

    async def readinto(self, buffer: memoryview) -> None:
        await self.inner.readinto(buffer)
        if self.first and len(buffer):
            buffer[0] ^= 0xFF
            self.first = False

    async def drain(self) -> None:
        await self.inner.drain()


@dataclass
class World:
    a: MoveHost
    b: MoveHost
    hooks_a: Hooks
    hooks_b: Hooks
    service_b: MoveService
    target: FaultyTarget
    peer_b: Peer
    agent_id: str
    journal: bytes  # the agent's journal before any move
    nursery: trio.Nursery
    b_root: Path
    b_scope: trio.CancelScope | None = None
    b_stopped: trio.Event | None = None
    restarts: int = 0
    restarted: trio.Event = field(default_factory=trio.Event)

    async def serve_b(self, port: int, *, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        self.b_stopped = trio.Event()

        def wrap(svc: MoveService) -> FaultyTarget:
            self.target = FaultyTarget(svc)
            self.target.on_crash = self.crash_b
            self.service_b = svc
            return self.target

        try:
            with trio.CancelScope() as self.b_scope:
                await serve_moves(self.b, listen_host="127.0.0.1", port=port, wrap=wrap, task_status=task_status)
        finally:
            self.b_stopped.set()

    def crash_b(self) -> None:
        """The target daemon dies (losing memory and staging), then restarts."""
        assert self.b_scope is not None
        self.b_scope.cancel()
        self.nursery.start_soon(self._restart_b)

    async def _restart_b(self) -> None:
        assert self.b_stopped is not None
        await self.b_stopped.wait()
        self.hooks_b.running.clear()
        self.b = MoveHost.open(self.b_root, self.hooks_b)  # reopening the store sweeps its staging
        self.restarts += 1
        await self.nursery.start(self.serve_b, int(self.peer_b.address.rsplit(":", 1)[1]))
        self.restarted.set()

    async def move(self, **kw: Any) -> Any:
        kw.setdefault("retry_pause", 0)
        return await move_agent(self.a, self.agent_id, self.peer_b, **kw)

    def holders(self) -> list[str]:
        out = []
        for name, host in (("a", self.a), ("b", self.b)):
            rec = host.holders.get(self.agent_id)
            if rec is not None and rec.state is HolderState.HELD:
                out.append(name)
        return out

    def check(self) -> str | None:
        """The invariants after a scenario; returns the holder's name (or None in doubt)."""
        holders = self.holders()
        assert len(holders) <= 1, f"two holders: {holders}"
        running = [h.name for h in (self.hooks_a, self.hooks_b) if self.agent_id in h.running]
        assert running == holders, f"running {running} but holding {holders}"
        for host in (self.a, self.b):
            assert os.listdir(host.store.staging_dir) == [], f"staging left: {os.listdir(host.store.staging_dir)}"
        if not holders:
            return None
        holder = self.a if holders == ["a"] else self.b
        agent = holder.store.agent(self.agent_id)
        assert agent.read(fmt.JOURNAL) == self.journal, "the journal lost something"
        rec = holder.holders.get(self.agent_id)
        assert agent.manifest().holder.epoch == rec.held_epoch
        return holders[0]


@pytest.fixture
async def world(tmp_path: Path, nursery: trio.Nursery) -> World:
    hooks_a, hooks_b = Hooks("a"), Hooks("b")
    a = MoveHost.open(tmp_path / "a", hooks_a)
    b = MoveHost.open(tmp_path / "b", hooks_b)
    agent = make_agent(a.store, "mover", workspace={f"f{i}": os.urandom(5000 + i) for i in range(12)})
    ids = iter(range(10**6))
    with open_journal(agent.path(fmt.JOURNAL), machine=a.me, now=lambda: 1.7e9, new_id=lambda: f"{next(ids):024x}",
                      recovery_dir=tmp_path / "recovery") as journal:
        journal.append_many([UserMessage(text=f"message {i}") for i in range(50)])
    agent.refresh_manifest()
    a.store.agent(agent.agent_id).set_holder(a.me, 1)
    a.holders.put(new_held(agent.agent_id, 1))
    hooks_a.running.add(agent.agent_id)
    # b already has a third of the blobs
    for sha in sorted(agent.manifest().blobs())[:4]:
        b.store.put_blob(a.store.read_blob(sha))
    b.peers.add(Peer(name="a", address="127.0.0.1:1", host_id=a.me))
    w = World(a, b, hooks_a, hooks_b, None, None, None, agent.agent_id, agent.read(fmt.JOURNAL),  # type: ignore[arg-type]
              nursery=nursery, b_root=tmp_path / "b")
    port = (await nursery.start(w.serve_b, 0)).port
    w.peer_b = Peer(name="b", address=f"127.0.0.1:{port}", host_id=b.me)
    a.peers.add(w.peer_b)
    return w


def verify_on(host: MoveHost, agent_id: str, tmp: Path) -> None:
    _tar, out = export_and_unpack(host.store.agent(agent_id), tmp, name=f"check-{os.urandom(3).hex()}")
    manifest, problems = archive.verify_capsule(str(out))
    assert problems == [] and manifest is not None and manifest.agent_id == agent_id


async def test_a_clean_move(world: World, tmp_path: Path) -> None:
    result = await world.move()
    assert result.moved and result.epoch == 2
    assert result.contents_sent == 8 + 5  # the blobs b lacked, and the capsule's files
    assert world.check() == "b"
    assert world.hooks_a.log == ["freeze", "retire"] and world.hooks_b.log == ["prepare", "activate"]
    assert world.agent_id not in world.a.store.agent_ids()
    verify_on(world.b, world.agent_id, tmp_path)
    assert world.b.store.agent(world.agent_id).manifest().holder == fmt.Holder(host=world.b.me, epoch=2)


async def test_gc_on_the_target_during_a_move_keeps_the_moves_blobs(
        world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The target adopts a move's blobs into its store before any agent
    there lists them, and some it had already belong to no agent of its
    own: a `capsulefs gc` on the target between verify and activate must
    keep them all (the staged manifest is a root), or the install after the
    source's commit finds them gone."""
    collected = []
    prepare = world.hooks_b.prepare

    async def prepare_then_gc(agent_id: str, staged_dir: str) -> None:
        await prepare(agent_id, staged_dir)
        collected.append(world.b.store.gc())

    monkeypatch.setattr(world.hooks_b, "prepare", prepare_then_gc)
    result = await world.move()
    assert result.moved, result
    assert collected and collected[0].removed == 0
    assert world.check() == "b"
    verify_on(world.b, world.agent_id, tmp_path)
    world.b.store.put_blob(b"nobody lists this")
    assert world.b.store.gc().removed == 1  # once the move has ended, gc is as before


async def test_the_target_syncs_each_calls_pieces_and_their_adoption_through_one_file_system_sync(
        world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """The move service opens a FileSystemSync on the staging area before
    any piece arrives (so a later write-back error reaches it), makes each
    call's pieces durable through it, then the objects/ directories their
    adoption renamed into, and closes it with the staging area."""
    made: list[Any] = []

    class Recording(FileSystemSync):
        def __init__(self, path: str, **kwargs: Any) -> None:
            super().__init__(path, dirty=lambda: 0, **kwargs)
            made.append(self)
            self.content_at_open = os.listdir(os.path.join(path, "content"))
            self.calls: list[tuple[str, list[str]]] = []

        def files(self, paths: Any) -> None:
            self.calls.append(("files", sorted(paths)))
            super().files(self.calls[-1][1])

        def dirs(self, paths: Any) -> None:
            self.calls.append(("dirs", sorted(paths)))
            super().dirs(self.calls[-1][1])

    monkeypatch.setattr(move_target, "FileSystemSync", Recording)
    result = await world.move()
    assert result.moved and world.check() == "b"
    [sync] = made
    assert sync.content_at_open == []
    files = [p for kind, paths in sync.calls if kind == "files" for p in paths]
    dirs = {p for kind, paths in sync.calls if kind == "dirs" for p in paths}
    assert len(files) == result.contents_sent and all(os.path.dirname(p).endswith("content") for p in files)
    sent_blobs = world.b.store.agent(world.agent_id).manifest().blobs()
    assert dirs and dirs <= {os.path.dirname(world.b.store.blob_file(sha)) for sha in sent_blobs}
    assert [kind for kind, _ in sync.calls].index("files") < [kind for kind, _ in sync.calls].index("dirs")
    assert not sync.whole  # closed with the staging area


async def test_empty_files_and_a_shared_digest_move(world: World, tmp_path: Path) -> None:
    agent = world.a.store.agent(world.agent_id)
    empty = world.a.store.put_blob(b"")  # an empty workspace file and empty working memory: one digest
    snap = {**fmt.parse_snapshot(agent.read(fmt.SNAPSHOT)), "empty.txt": empty}
    agent.write_files({fmt.WORKING_MEMORY: b"", fmt.SNAPSHOT: fmt.snapshot_bytes(snap)}, add_blobs=[empty])
    world.a.store.agent(world.agent_id).refresh_manifest()
    result = await world.move()
    assert result.moved and world.check() == "b"
    moved = world.b.store.agent(world.agent_id)
    assert moved.read(fmt.WORKING_MEMORY) == b"" and moved.read(fmt.blob_path(empty)) == b""
    verify_on(world.b, world.agent_id, tmp_path)


@pytest.mark.parametrize("call", ["offer", "blobs", "verify", "prepare", "activate"])
@pytest.mark.parametrize("when", ["before", "after"])
async def test_one_failed_call_at_every_phase(world: World, tmp_path: Path, call: str, when: str) -> None:
    world.target.faults = [Fault(call, when)]
    result = await world.move()
    assert world.target.fired == [f"{call}:{when}"]
    holder = world.check()
    if call == "activate" and when == "after":
        assert result.moved and holder == "b"  # in doubt, then status said active
        assert world.target.inner.served[-1] == "status"
    else:
        assert result.state is mv.SourceState.ROLLED_BACK and holder == "a"
        assert world.a.holders.get(world.agent_id).held_epoch == 1
        rec_b = world.b.holders.get(world.agent_id)
        assert rec_b is None or rec_b.state is HolderState.REFUSED
    verify_on(world.a if holder == "a" else world.b, world.agent_id, tmp_path)
    # whatever happened, the next move succeeds, at a fresh epoch
    if holder == "a":
        again = await world.move()
        assert again.moved and again.epoch == 3
        assert world.check() == "b"


@pytest.mark.parametrize("first", ["before", "after"])
@pytest.mark.parametrize("when", ["before", "after"])
async def test_status_failing_too_keeps_asking(world: World, first: str, when: str) -> None:
    world.target.faults = [Fault("activate", first), Fault("status", when, times=3)]
    result = await world.move()
    assert world.target.fired.count(f"status:{when}") == 3
    assert result.moved == (first == "after")
    world.check()


async def test_lost_abort_leaves_staging_until_the_target_expires_it(world: World) -> None:
    world.target.faults = [Fault("verify", "before"), Fault("abort", "before", times=3)]
    result = await world.move()
    assert result.state is mv.SourceState.ROLLED_BACK
    assert os.listdir(world.b.store.staging_dir) != []
    assert world.b.holders.get(world.agent_id).state is HolderState.OFFERED
    await world.service_b.expire_idle(ttl=0)
    assert world.b.holders.get(world.agent_id).state is HolderState.REFUSED
    assert world.check() == "a"


async def test_a_freeze_that_fails_rolls_the_move_back_and_resumes_the_agent(world: World) -> None:
    # Committing the workspace at freeze fails (a full disk): FROZEN is already
    # durable, so the move must roll back to HELD and resume the agent, not
    # leave it refused by everything until an operator abandons it.
    world.hooks_a.fail_freeze = OSError(errno.ENOSPC, "No space left on device")
    result = await world.move()
    assert result.state is mv.SourceState.ROLLED_BACK and "No space left on device" in result.reason
    assert world.check() == "a"
    rec = world.a.holders.get(world.agent_id)
    assert rec.state is HolderState.HELD and rec.runnable
    assert world.hooks_a.log == ["freeze", "resume"] and world.agent_id in world.hooks_a.running
    assert (await world.move()).moved  # nothing left in the way
    assert world.check() == "b"


async def test_corrupted_chunk_rolls_back(world: World) -> None:
    world.target.corrupt_next_blob = True
    result = await world.move()
    assert result.state is mv.SourceState.ROLLED_BACK
    assert world.check() == "a"
    assert world.target.inner.served[-1] == "abort"


async def test_a_piece_damaged_on_the_way_is_not_blamed_on_the_source(world: World, caplog: pytest.LogCaptureFixture) -> None:
    world.target.corrupt_next_blob = True
    result = await world.move()
    assert result.state is mv.SourceState.ROLLED_BACK and result.cause is mv.Cause.CORRUPT
    assert "corrupt blob" not in result.reason, "the source's copy is whole: the source must not be named"
    assert "the target refused it" not in caplog.text


def _a_blob_to_send(world: World) -> str:
    lacking = sorted(set(world.a.store.agent(world.agent_id).manifest().blobs()) - set(world.b.store.all_blobs()))
    return world.a.store.blob_file(lacking[0])


@pytest.mark.expect_error_log
@pytest.mark.capsule_left_broken("a blob rots at the source on purpose (and is quarantined)")
async def test_a_blob_rotten_at_the_source_is_named_by_its_path(world: World, caplog: pytest.LogCaptureFixture) -> None:
    """The source does not hash what it sends (the target does): when the
    target reports the piece bad, the source re-hashes it and names its path."""
    path = _a_blob_to_send(world)
    data = bytearray(Path(path).read_bytes())
    data[7] ^= 0x01
    os.chmod(path, 0o644)
    Path(path).write_bytes(bytes(data))  # bit rot: same size
    result = await world.move()
    assert result.state is mv.SourceState.ROLLED_BACK and result.cause is mv.Cause.CORRUPT
    assert "corrupt blob" in result.reason  # the record's note is cut short: the log names the path
    assert f"corrupt blob {path}" in caplog.text
    assert world.check() == "a"
    assert not os.path.exists(world.b.store.blob_file(os.path.basename(path))), "the target kept the rotten piece"


@pytest.mark.parametrize("change", ["truncated", "grown", "missing"])
@pytest.mark.capsule_left_broken("a blob at the source is truncated, grown or removed on purpose")
async def test_a_blob_whose_size_changed_at_the_source_fails_before_its_bytes_go(
        world: World, change: str, caplog: pytest.LogCaptureFixture) -> None:
    path = _a_blob_to_send(world)
    data = Path(path).read_bytes()
    os.chmod(path, 0o644)
    if change == "missing":
        os.unlink(path)
        why = "unreadable (No such file or directory)"
    else:
        Path(path).write_bytes(data[:-10] if change == "truncated" else data + b"extra")
        why = f"{len(data) - 10 if change == 'truncated' else len(data) + 5} bytes, the manifest says {len(data)}"
    result = await world.move()
    assert result.state is mv.SourceState.ROLLED_BACK and result.cause is mv.Cause.CORRUPT
    assert "corrupt blob" in result.reason  # the record's note is cut short: the log names the path
    assert f"corrupt blob {path}: {why}" in caplog.text
    assert world.check() == "a"
    assert world.b.holders.get(world.agent_id).state is HolderState.REFUSED


@pytest.mark.parametrize("nowait", [True, False])
async def test_blobs_not_in_the_page_cache_are_read_in_a_worker_thread(
        world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nowait: bool) -> None:
    """A chunk the page cache holds is read on the event loop; one it does
    not hold (RWF_NOWAIT answers EAGAIN), or every chunk where the file
    system refuses RWF_NOWAIT (EOPNOTSUPP), is read in a worker thread,
    never on the loop, where waiting for the disk would stall the daemon.

    The kernel's answer is the seam: which chunks the page cache holds is
    not the test's to decide (evicting the blobs did not do it: the first
    RWF_NOWAIT miss starts the kernel's readahead, which on a busy machine
    often completed before the same call looked at the page again)."""
    monkeypatch.setattr(read_ahead.BlobReader, "nowait", True)
    objects = os.path.realpath(world.a.store.blob_file("0" * 64)).rsplit("/", 2)[0]
    loop = threading.get_ident()
    real = os.preadv
    asked = 0
    reads: list[tuple[bool, bool]] = []  # (on the loop, with RWF_NOWAIT) of each blob chunk read here

    def preadv(fd: int, buffers: Any, offset: int, flags: int = 0) -> int:
        nonlocal asked
        if not os.readlink(f"/proc/self/fd/{fd}").startswith(objects + "/"):
            return real(fd, buffers, offset, flags)
        if flags:
            assert flags == os.RWF_NOWAIT
            asked += 1
            if not nowait:
                raise OSError(errno.EOPNOTSUPP, "Operation not supported")
            if asked % 2:
                raise OSError(errno.EAGAIN, "Resource temporarily unavailable")  # not in the page cache
        n = real(fd, buffers, offset, flags)
        reads.append((threading.get_ident() == loop, bool(flags)))
        return n

    monkeypatch.setattr(read_ahead.os, "preadv", preadv)
    result = await world.move()
    assert result.moved and world.check() == "b"
    sent = result.contents_sent - 5  # (the capsule's own files are sent from memory)
    assert len(reads) == sent == 8
    assert (True, False) not in reads, "a chunk not in the page cache was read on the event loop"
    assert (False, True) not in reads
    if nowait:
        assert reads.count((True, True)) == reads.count((False, False)) == sent // 2
    else:
        assert asked == 1 and reads == [(False, False)] * sent  # asked once: the reader stops asking
    verify_on(world.b, world.agent_id, tmp_path)


async def test_a_target_whose_disk_fills_mid_transfer_says_so_and_rolls_back(
        world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC while the target writes a piece: the source hears why (not a
    broken link), the move rolls back, and nothing is left staged."""
    from capsulefs.move import pieces as piecewriter, target as move_target

    def full(fd: int, data: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    # The disk error is injected in this process, so the writers run here
    # (test_moveintake fills a real file system under the writer process).
    monkeypatch.setattr(move_target, "INTAKE_WRITERS", "thread")
    monkeypatch.setattr(piecewriter.os, "write", full)
    result = await world.move()
    assert result.state is mv.SourceState.ROLLED_BACK and result.cause is mv.Cause.REFUSED
    assert "No space left on device" in result.reason
    assert world.check() == "a"


async def test_a_blob_removed_from_the_targets_store_before_verify_is_reported(
        world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """The intake adopts blobs into objects/ while the move runs; a gc
    (which knows no agent listing them yet) may remove one. Verify must
    see that it is gone, not trust that it arrived: the move rolls back."""
    real = world.service_b._check

    async def check(agent_id: str, epoch: int) -> tuple[str, ...]:
        await world.service_b._incoming[(agent_id, epoch)].intake.settled()
        gone = sorted(world.service_b._incoming[(agent_id, epoch)].received
                      & set(world.service_b._incoming[(agent_id, epoch)].manifest.blobs()))[0]
        os.unlink(world.b.store.blob_file(gone))  # what gc would do
        removed.append(gone)
        return await real(agent_id, epoch)

    removed: list[str] = []
    monkeypatch.setattr(world.service_b, "_check", check)
    result = await world.move()
    assert removed
    assert result.state is mv.SourceState.ROLLED_BACK and result.cause is mv.Cause.CORRUPT  # at verify, not later
    assert "missing or corrupt" in result.reason
    assert world.check() == "a"


async def test_a_target_that_asks_for_a_digest_the_agent_lacks_gets_a_rollback(
        world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """A misbehaving target: the source cannot send what it does not have,
    and rolls back rather than stay frozen."""
    real = world.service_b._missing
    monkeypatch.setattr(world.service_b, "_missing", lambda manifest, inc: real(manifest, inc) + ("ab" * 32,))
    result = await world.move()
    assert result.state is mv.SourceState.ROLLED_BACK
    assert world.check() == "a"


async def test_a_read_error_on_the_page_cache_path_is_read_again_and_reported(
        world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.preadv

    def preadv(fd: int, buffers: Any, offset: int, flags: int = 0) -> int:
        if flags:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, buffers, offset)

    monkeypatch.setattr(read_ahead.os, "preadv", preadv)
    result = await world.move()
    assert result.moved and world.check() == "b"  # the plain read succeeded


async def test_dead_link_mid_transfer_rolls_back(world: World) -> None:
    world.target.break_in_blob = True
    result = await world.move()
    assert world.target.fired == ["blob:mid"] and result.state is mv.SourceState.ROLLED_BACK
    assert "blob" in result.reason
    assert world.check() == "a"


async def test_delayed_and_duplicated_activate_after_resolve_is_refused(world: World) -> None:
    world.target.faults = [Fault("activate", "before")]
    result = await world.move()
    assert result.state is mv.SourceState.ROLLED_BACK
    async with open_peer(world.a.identity, world.peer_b) as conn:
        for _ in range(2):
            r, _ = await conn.call("activate", {"agent_id": world.agent_id, "epoch": 2})
            assert r == {"outcome": "never"}
    assert world.check() == "a"


async def test_a_stale_offer_replayed_later_is_refused(world: World) -> None:
    assert (await world.move()).moved
    async with open_peer(world.a.identity, world.peer_b) as conn:
        m = world.b.store.agent(world.agent_id).manifest()
        r, _ = await conn.call("offer", {"agent_id": world.agent_id, "epoch": 2, "manifest": m.to_bytes().decode()})
    assert r["accepted"] is False and r["held_there"] is True and r["highest"] == 2
    assert world.check() == "b"


async def test_a_partitioned_host_waking_up_with_a_stale_record_stops(world: World) -> None:
    saved = world.a.holders.get(world.agent_id)
    files = {rel: world.a.store.agent(world.agent_id).read(rel) for rel in world.a.store.agent(world.agent_id).local_files()}
    assert (await world.move()).moved
    # a wakes up from an old snapshot of its disk: it believes it holds epoch 1
    world.a.holders.put(saved)
    with world.a.store.staging("restore") as area:
        for rel, data in files.items():
            os.makedirs(os.path.dirname(os.path.join(area, rel)), exist_ok=True)
            Path(area, rel).write_bytes(data)
        m = world.b.store.agent(world.agent_id).manifest()
        Path(area, fmt.MANIFEST).write_bytes(
            fmt.Manifest(agent_id=m.agent_id, name=m.name, holder=fmt.Holder(host=world.a.me, epoch=1),
                         files=m.files).to_bytes())
        world.a.store.install_agent(area)
    result = await world.move()
    assert result.state is mv.SourceState.STALE
    rec = world.a.holders.get(world.agent_id)
    assert rec.state is HolderState.UNKNOWN and "holds the agent itself" in rec.note
    assert world.agent_id not in world.hooks_a.running
    assert world.check() == "b"
    # learning from the peers retires the stale copy
    learned = await learn_holder(world.a, world.agent_id)
    assert learned.state is HolderState.RETIRED and world.agent_id not in world.a.store.agent_ids()


async def test_crash_losing_the_holder_record_then_learning(world: World) -> None:
    assert (await world.move()).moved
    os.unlink(os.path.join(world.b.holders.directory, f"{world.agent_id}.json"))
    world.hooks_b.running.clear()  # the daemon restarts
    await MoveService(world.b).recover()
    assert world.b.holders.get(world.agent_id).state is HolderState.UNKNOWN
    assert world.holders() == [] and world.check() is None  # nobody runs it while in doubt
    # b asks a (its only peer): a retired it and activated only epoch 1, so b holds epoch 2
    assert [p.name for p in world.b.peers.peers()] == ["a"]
    async with trio.open_nursery() as n:
        serving = await n.start(partial(serve_moves, world.a, listen_host="127.0.0.1", port=0))
        world.b.peers.remove("a")
        world.b.peers.add(Peer(name="a", address=f"127.0.0.1:{serving.port}", host_id=world.a.me))
        learned = await learn_holder(world.b, world.agent_id)
        n.cancel_scope.cancel()
    assert learned.state is HolderState.HELD and learned.held_epoch == 2
    assert world.check() == "b"


async def test_source_crash_in_doubt_resumes_from_its_record(world: World) -> None:
    world.target.faults = [Fault("activate", "after")]
    world.target.faults.append(Fault("status", "before", times=1000))

    async def crash_when_in_doubt(result: list) -> None:
        await world.move()  # never returns: status keeps failing
        result.append("returned")

    done: list = []
    async with trio.open_nursery() as n:
        n.start_soon(crash_when_in_doubt, done)
        while world.target.fired.count("status:before") < 3:
            await trio.sleep(0.001)
        n.cancel_scope.cancel()  # the source process dies here
    assert done == [] and world.a.holders.get(world.agent_id).state is HolderState.COMMITTING
    world.hooks_a.running.clear()
    world.target.faults = []
    (result,) = await resume_moves(world.a, retry_pause=0)
    assert result.moved and world.check() == "b"


async def _leave_in_doubt(world: World) -> None:
    """A move the target activated, but whose source never learned it (the
    target's status answers fail): the source's record is COMMITTING."""
    world.target.faults = [Fault("activate", "after")]
    world.target.faults.append(Fault("status", "before", times=1000))
    async with trio.open_nursery() as n:
        n.start_soon(world.move)
        while world.target.fired.count("status:before") < 2:
            await trio.sleep(0.001)
        n.cancel_scope.cancel()


async def test_resume_limited_to_named_agents_leaves_others_alone(world: World) -> None:
    """The daemon resumes only the moves it found in doubt at start (a move
    begun since then has its own driver and control)."""
    await _leave_in_doubt(world)
    assert world.a.holders.get(world.agent_id).state is HolderState.COMMITTING
    world.target.faults = []
    assert await resume_moves(world.a, retry_pause=0, agent_ids=[]) == []
    assert world.a.holders.get(world.agent_id).state is HolderState.COMMITTING  # untouched
    world.hooks_a.running.clear()
    (result,) = await resume_moves(world.a, retry_pause=0, agent_ids=[world.agent_id])
    assert result.moved and world.check() == "b"


async def test_operator_abandon_while_in_doubt(world: World, caplog: pytest.LogCaptureFixture) -> None:
    world.target.faults = [Fault("activate", "before"), Fault("status", "before", times=10**6)]
    control = MoveControl()
    async with trio.open_nursery() as n:
        async def abandon_soon() -> None:
            while world.target.fired.count("status:before") < 5:
                await trio.sleep(0.001)
            control.abandon("target machine is gone for good")
        n.start_soon(abandon_soon)
        result = await world.move(control=control)
    assert result.state is mv.SourceState.ABANDONED and "operator abandoned" in result.reason
    assert "two hosts now run the agent" in caplog.text
    await world.service_b.expire_idle(ttl=0)
    assert world.check() == "a"


async def test_an_abandon_before_the_point_of_no_return_rolls_back_and_is_not_kept_for_later(world: World) -> None:
    """An operator abandon written while the move is still transferring
    (not in doubt) rolls it back there, safely (activate never goes out). It
    must not lie in wait and, once activate's reply is lost, resume the agent
    here without asking the target even once: the target did activate, and
    two hosts would run it."""
    world.target.faults = [Fault("activate", "after")]  # activated on b, the reply lost
    control = MoveControl()

    def on_progress(phase: str, *_: int) -> None:
        if phase == "transferring":
            control.abandon("looked stuck")

    control.on_progress = on_progress
    result = await world.move(control=control)
    assert world.check() is not None  # one holder, never two
    assert result.state is mv.SourceState.ROLLED_BACK and result.cause is mv.Cause.ABANDONED
    assert "activate" not in world.target.inner.served
    assert world.check() == "a"


def test_offline_abandon(tmp_path: Path) -> None:
    from capsulefs.core.store.holder import HolderBook, HolderRecord

    book = HolderBook(tmp_path)
    aid = "c" * 32
    book.put(HolderRecord(agent_id=aid, state=HolderState.COMMITTING, epoch=2, held_epoch=1, peer="B" * 52,
                          activated=(1,)))
    rec = abandon_move(book, aid, me="A" * 52, why="disk of B melted")
    assert rec.state is HolderState.HELD and rec.held_epoch == 1 and rec.epoch == 2
    with pytest.raises(mv.MoveError, match="no move in progress"):
        abandon_move(book, aid, me="A" * 52, why="again")


async def test_same_agent_id_on_both_sides(world: World, tmp_path: Path) -> None:
    assert (await world.move()).moved
    # back to a (b's service is the target only; serve a to move back)
    async with trio.open_nursery() as n:
        serving = await n.start(partial(serve_moves, world.a, listen_host="127.0.0.1", port=0))
        world.b.peers.remove("a")
        world.b.peers.add(Peer(name="a", address=f"127.0.0.1:{serving.port}", host_id=world.a.me))
        back = await move_agent(world.b, world.agent_id, world.b.peers.find("a"), retry_pause=0)
        n.cancel_scope.cancel()
    assert back.moved and back.epoch == 3 and world.check() == "a"
    assert world.b.holders.get(world.agent_id).state is HolderState.RETIRED
    # and to b again: b's retired record for the same agent_id is replaced
    again = await world.move()
    assert again.moved and again.epoch == 4 and world.check() == "b"
    verify_on(world.b, world.agent_id, tmp_path)


async def test_another_agent_with_the_same_name_on_the_target_refuses_at_prepare(world: World) -> None:
    world.b.store.create_agent("mover", host_id=world.b.me, agent_id="d" * 32)  # same name, another agent_id
    world.b.holders.put(new_held("d" * 32, 1))
    result = await world.move()
    assert result.state is mv.SourceState.ROLLED_BACK and "named 'mover'" in result.reason
    assert world.check() == "a"


async def test_the_same_agent_id_with_files_but_no_record_on_the_target_is_refused(world: World) -> None:
    make_agent(world.b.store, "mover", held=False)  # the same agent_id: a copy nobody recorded as held
    result = await world.move()
    assert result.state is mv.SourceState.ROLLED_BACK and "lost its record" in result.reason
    assert world.b.holders.get(world.agent_id).state is HolderState.UNKNOWN
    assert world.holders() == ["a"] and world.hooks_a.running == {world.agent_id}


PHASES = ["offer", "blobs", "verify", "prepare", "activate"]


@pytest.mark.parametrize("call", PHASES)
@pytest.mark.parametrize("when", ["crash-before", "crash-after"])
async def test_target_daemon_dies_at_every_phase_and_restarts(world: World, tmp_path: Path, call: str,
                                                              when: str) -> None:
    world.target.faults = [Fault(call, when)]
    result = await world.move()
    await world.restarted.wait()  # a move that rolled back may be done before the target is back
    assert world.restarts == 1, result
    holder = world.check()
    # a restarted target refuses whatever was pending; only a finished activate survives
    assert holder == ("b" if (call, when) == ("activate", "crash-after") else "a")
    assert result.moved == (holder == "b")
    verify_on(world.a if holder == "a" else world.b, world.agent_id, tmp_path)


@pytest.mark.parametrize("call", PHASES)
async def test_source_daemon_dies_at_every_phase_and_resumes(world: World, tmp_path: Path, call: str) -> None:
    with trio.CancelScope() as move_scope:
        world.target.faults = [Fault(call, "crash-after")]
        world.target.on_crash = move_scope.cancel  # the source dies once the target ran the call
        await world.move()
    assert move_scope.cancelled_caught
    state = world.a.holders.get(world.agent_id).state
    assert state is (HolderState.COMMITTING if call == "activate" else HolderState.FROZEN)
    world.hooks_a.running.clear()  # the source daemon restarts: nothing runs until the records say so
    (result,) = await resume_moves(world.a, retry_pause=0)
    holder = world.check()
    assert holder == ("b" if call == "activate" else "a") and result.moved == (holder == "b")
    verify_on(world.a if holder == "a" else world.b, world.agent_id, tmp_path)


async def test_a_move_of_many_large_cached_blobs_arrives_byte_for_byte(world: World, tmp_path: Path) -> None:
    """Every blob in the page cache, each larger than a read chunk: the
    source's reader runs far ahead of the sender on the event loop, and
    reuses its read buffers; each byte must still arrive as read (a buffer
    reused too early shows up as pieces that do not hash to their names)."""
    big = make_agent(world.a.store, "big", workspace={f"w{i}": os.urandom((1 << 20) + 4096 * i + 7) for i in range(24)})
    big.set_holder(world.a.me, 1)
    world.a.holders.put(new_held(big.agent_id, 1))
    world.hooks_a.running.add(big.agent_id)
    for sha in big.manifest().blobs():
        with open(world.a.store.blob_file(sha), "rb") as f:
            f.read()  # in the page cache: every chunk is read on the event loop
    result = await move_agent(world.a, big.agent_id, world.peer_b, retry_pause=0)
    assert result.moved, result
    verify_on(world.b, big.agent_id, tmp_path)


async def test_the_target_keeps_a_writer_process_started_for_the_next_move(world: World) -> None:
    """The target starts its next move's writer process ahead (a helper
    takes 10-45 ms of Python to start): the move uses that process, a new
    spare is started once the move's intake has ended, and the service's
    end ends the unused spare (no process left behind)."""
    spare = world.service_b.spare
    assert spare is not None and spare.started == 1
    first = spare._spare
    assert first is not None and first.proc.poll() is None
    assert (await world.move()).moved
    with trio.fail_after(HANG):
        while spare.started < 2:  # (the intake ends in activate, as the capsule is installed)
            await trio.sleep(0.01)
    assert first.proc.poll() is not None  # used by the move, and ended with its intake
    second = spare._spare
    assert second is not None and second.proc.pid != first.proc.pid and second.proc.poll() is None
    assert world.b_scope is not None and world.b_stopped is not None
    world.b_scope.cancel()
    await world.b_stopped.wait()
    assert second.proc.poll() is not None  # ended with the service, not left behind
    assert world.check() == "b"


async def test_an_append_from_outside_the_daemon_is_whole_in_the_move_or_refused(world: World) -> None:
    """`capsulefs append` writes an agent's files from another process: it
    holds the agent's files lock, checks the holder record under it, then
    appends and updates the projections. The source persists FROZEN before
    it freezes and reads the agent, and reads it under the same lock: an
    append already under way finishes first and moves with the agent; one
    that starts later finds FROZEN (or the agent gone) and is refused."""
    from capsulefs.cli.journal_cmds import _refuse_unless_held
    from capsulefs.core.errors import CapsuleError
    from capsulefs.core.journal.events import Note

    holders, agent_id = world.a.holders, world.agent_id
    results: list[Any] = []

    async def move() -> None:
        results.append(await world.move())

    append = ExitStack()
    append.enter_context(holders.files_lock(agent_id, shared=False))  # an append under way: it found HELD
    try:
        _refuse_unless_held(holders, agent_id, "mover")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(move)
            with trio.fail_after(HANG):
                while holders.get(agent_id).state is not HolderState.FROZEN:
                    await trio.sleep(0.005)
            # kept: a window in which nothing may be offered (the snapshot polls the lock from a thread:
            # an absence has no event to wait for)
            await trio.sleep(0.2)  # the snapshot waits for the lock: nothing was offered yet
            assert results == [] and world.hooks_b.log == []
            with pytest.raises(CapsuleError, match="is in a move"):  # an append starting now
                _refuse_unless_held(holders, agent_id, "mover")
            agent = world.a.store.agent(agent_id)
            with open_journal(agent.path(fmt.JOURNAL), machine=world.a.me, now=lambda: 1.7e9,
                              new_id=lambda: "f" * 24, recovery_dir=world.b_root / "unused") as journal:
                line = journal.append(Note(text="appended while the move waited")).line + b"\n"
            append.close()  # the append is done: the snapshot reads the agent now
    finally:
        append.close()
    assert results and results[0].moved
    world.journal += line
    assert world.check() == "b"  # the target's journal holds it, whole
    with pytest.raises(CapsuleError, match="no longer holds"):
        _refuse_unless_held(holders, agent_id, "mover")


async def test_an_append_that_never_lets_go_rolls_the_move_back(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """A `capsulefs append` suspended (^Z) while it holds the agent's files
    would hang the move in its snapshot: after FILES_WAIT the move rolls
    back, says why, and the agent runs here again."""
    import capsulefs.move.source as move_source

    monkeypatch.setattr(move_source, "FILES_WAIT", 0.3)
    with world.a.holders.files_lock(world.agent_id, shared=False):
        with trio.fail_after(HANG):
            result = await world.move()
    assert result.state is mv.SourceState.ROLLED_BACK
    assert "a writer outside the daemon (capsulefs append) has held its files" in result.reason
    assert world.check() == "a" and world.a.holders.get(world.agent_id).state is HolderState.HELD
    assert world.hooks_a.log == ["freeze", "resume"] and world.hooks_b.log == []
    assert (await world.move()).moved  # once it lets go


@pytest.mark.expect_error_log
async def test_resume_skips_a_record_naming_no_possible_peer(world: World,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """A record in doubt whose peer is no host id a peer can have (a damaged
    record) is left in doubt, logged, for an operator: the resume of the
    other agents, and the daemon running it, go on."""
    await _leave_in_doubt(world)
    rec = world.a.holders.get(world.agent_id)
    assert rec.state is HolderState.COMMITTING
    world.a.holders.put(rec.with_(peer="not-a-peer-id"))
    assert await resume_moves(world.a, retry_pause=0) == []
    assert world.a.holders.get(world.agent_id).state is HolderState.COMMITTING
    assert "cannot resume the move of" in caplog.text and "until an operator abandons it" in caplog.text
