"""Real daemons (tier: kernel + TLS): how a failed ``.control/move`` ends.

Two ``capsulefs mount`` processes on loopback (the ``hosts`` fixture of
test_move_daemons), one case per errno of docs/move.md that the driver and
kernel-less tiers cover but no real daemon did:

  * EIO: a blob rotted in the source's store; the target hashes it on
    arrival and refuses it. Rolled back: the agent runs on the source, which
    never serves the rotten blob as good, and the target never stores it.
  * EEXIST: a host wakes up from an old disk (holder record and files of an
    epoch it no longer holds) and offers the agent to the host that holds it
    now. The source must not run the agent (its record becomes UNKNOWN).
  * ETIMEDOUT: the link stalls in the middle of the blobs call (a TCP relay in
    this process stops forwarding); the source's call times out (the test-only
    ``CAPSULEFS_TEST_CALL_TIMEOUT``) and rolls back.

After each: the holder the protocol names (only one), no staging left on
either host, a capsule that verifies on the holder (tar of the mount and
``capsulefs verify``), a journal that lost nothing, and (the fixture) no
traceback in either daemon's log.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import socket
import threading
from pathlib import Path

import pytest

from capsulefs.core.store.holder import HolderBook, HolderState
from capsulefs.testing.seams import CALL_TIMEOUT_ENV
from helpers import bound
from mount_kit import needs_fuse
from test_move_daemons import Host, hosts, make_agent, start_all, verify_on, wait_for, wait_holding, write_move  # noqa: F401

pytestmark = [pytest.mark.fuse, needs_fuse]


def big_memory(h: Host, agent: str, size: int) -> tuple[bytes, str]:
    """Write ``size`` bytes of working memory through the mount (more than
    64 KiB is stored as a blob); return the bytes and the blob's path."""
    data = os.urandom(size // 2).hex().encode()
    (h.mnt / agent / "memory" / "working_memory.md").write_bytes(data)
    sha = hashlib.sha256(data).hexdigest()
    blob = h.state / "objects" / sha[:2] / sha
    assert blob.is_file(), f"the working memory is not a blob of {h.name}'s store"
    return data, str(blob)


def append_event(h: Host, agent: str, text: str) -> None:
    with open(h.mnt / agent / "memory" / "timeline_events.jsonl", "a") as f:
        f.write(json.dumps({"kind": "user_message", "text": text}) + "\n")


def record(h: Host, agent_id: str):  # type: ignore[no-untyped-def]
    return HolderBook(h.state / "holders").get(agent_id)


def test_a_blob_rotten_at_the_source_fails_with_eio_and_rolls_back(hosts: tuple[Host, Host], tmp_path: Path) -> None:
    a, b = hosts
    start_all(a, b)
    agent_id = make_agent(a)
    data, blob = big_memory(a, "walker", 200_000)
    sha = os.path.basename(blob)
    # edited again: the old memory is now only a blob (the journal names it), no capsule file shares its digest
    (a.mnt / "walker" / "memory" / "working_memory.md").write_bytes(b"# notes\n")
    assert f"artifacts/blobs/{sha}" in json.loads((a.mnt / "walker" / "manifest.json").read_bytes())["files"]
    rotten = bytearray(data)
    rotten[1000] ^= 0xFF
    with open(blob, "r+b") as f:  # bit rot: same size, same inode
        f.write(bytes(rotten))
        f.flush()
        os.fsync(f.fileno())

    assert write_move(a.mnt, "walker", "b\n") == errno.EIO
    move = a.status("walker")["move"]
    assert move["outcome"] == "rolled_back" and move["cause"] == "corrupt", move
    assert f"corrupt blob {blob}" in move["detail"], move  # re-hashed as read for the move, named by its path
    assert f"corrupt blob {blob}" in a.log.read_text()
    # one holder: the source at its old epoch; the target refused that epoch and kept nothing
    assert a.holder(agent_id) is HolderState.HELD and record(a, agent_id).held_epoch == 1
    assert b.holder(agent_id) is HolderState.REFUSED
    assert "walker" in os.listdir(a.mnt) and "walker" not in os.listdir(b.mnt)
    assert not (b.state / "objects" / sha[:2] / sha).exists(), "the target stored the rotten blob"
    assert a.staging() == [] and b.staging() == []
    # the source never serves the rotten blob as good
    with pytest.raises(OSError) as exc:
        (a.mnt / "walker" / "artifacts" / "blobs" / sha).read_bytes()
    assert exc.value.errno == errno.EIO
    # repaired (a new object file is judged anew), the agent is whole, runs and is writable here
    repair = blob + ".repair"
    Path(repair).write_bytes(data)
    os.chmod(repair, 0o444)
    os.replace(repair, blob)
    assert (a.mnt / "walker" / "artifacts" / "blobs" / sha).read_bytes() == data
    append_event(a, "walker", "hello 5")
    verify_on(a, "walker", tmp_path, 6)
    # and the next move goes through, at a fresh epoch
    assert write_move(a.mnt, "walker", "b\n") == 0
    assert b.holder(agent_id) is HolderState.HELD and b.status("walker")["epoch"] == 3
    verify_on(b, "walker", tmp_path, 6)
    a.stop()
    b.stop()


def test_a_host_waking_up_with_a_stale_record_learns_it_at_start_and_stops(hosts: tuple[Host, Host],
                                                                         tmp_path: Path) -> None:
    a, b = hosts
    start_all(a, b)
    agent_id = make_agent(a)
    assert write_move(a.mnt, "walker", "b\n") == 0  # epoch 2, on b
    b.stop()
    old_disk = tmp_path / "b-disk-at-epoch-2"
    shutil.copytree(b.state, old_disk, symlinks=True)  # b's disk as it is now: it holds walker at epoch 2
    b.start()
    wait_holding(b, "walker")  # (a has answered: it holds no higher epoch)
    append_event(b, "walker", "hello 5")
    assert write_move(b.mnt, "walker", "a\n") == 0  # back to a, epoch 3
    assert a.holder(agent_id) is HolderState.HELD and record(a, agent_id).held_epoch == 3
    b.stop()
    shutil.rmtree(b.state)
    shutil.copytree(old_disk, b.state, symlinks=True)  # b wakes up from the old disk
    b.start()
    # b asks its peers before it runs or takes writes for anything (docs/move.md, "Checking before
    # running"): a claims epoch 3, so b never runs it, records it unknown and says why
    wait_for(lambda: b.holder(agent_id) is HolderState.UNKNOWN, "b to learn that a holds a higher epoch")
    assert b.status("walker")["epoch"] == 2
    rec_b = record(b, agent_id)
    assert not rec_b.runnable and "peer a holds a higher epoch" in rec_b.note, rec_b
    status = b.status("walker")  # shown, frozen, read-only: its files are evidence, not a running agent
    assert status["state"] == "frozen" and status["writable"] is False, status
    assert "--learn" in status["record"]["detail"], status
    assert write_move(b.mnt, "walker", "a\n") == errno.EPERM  # not held here: it cannot move
    with pytest.raises(OSError):
        append_event(b, "walker", "written on the stale copy")
    # a still holds it, untouched: the only holder, at epoch 3
    rec_a = record(a, agent_id)
    assert rec_a.state is HolderState.HELD and rec_a.held_epoch == 3, rec_a
    assert a.status("walker")["epoch"] == 3
    assert a.staging() == [] and b.staging() == []
    verify_on(a, "walker", tmp_path, 6)
    append_event(a, "walker", "hello 6")  # writable on a
    verify_on(a, "walker", tmp_path, 7)
    a.stop()
    b.stop()


class StallingRelay:
    """A TCP relay on loopback to ``upstream``. On the first connection whose
    client has sent more than ``stall_after`` bytes, it stops forwarding both
    ways (keeps both sockets open, swallows what the client sends) until the
    client closes; then it closes the upstream side. Later connections pass."""

    def __init__(self, upstream: int, stall_after: int) -> None:
        self.upstream = upstream
        self.stall_after = stall_after
        self.stalled = threading.Event()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.socks: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            try:
                up = socket.create_connection(("127.0.0.1", self.upstream))
            except OSError:
                client.close()
                continue
            self.socks += [client, up]
            state = {"sent": 0, "stall": False}
            threading.Thread(target=self._pump, args=(client, up, state, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, client, state, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, state: dict, from_client: bool) -> None:
        try:
            while data := src.recv(65536):
                if from_client:
                    state["sent"] += len(data)
                    if not self.stalled.is_set() and state["sent"] > self.stall_after:
                        state["stall"] = True
                        self.stalled.set()
                if state["stall"]:
                    continue  # a black hole
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.server.close()
        for s in self.socks:
            try:
                s.close()
            except OSError:
                pass


def test_a_link_stalled_mid_transfer_fails_with_etimedout_and_rolls_back(
        hosts: tuple[Host, Host], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = hosts
    # Every call of the move has this long, not only the stalled one: 2 s
    # failed an offer or a prepare on a busy machine instead of the blobs.
    seconds = round(bound(10))
    monkeypatch.setenv(CALL_TIMEOUT_ENV, str(seconds))
    relay = StallingRelay(b.port, stall_after=1 << 20)
    try:
        a.cli("peer", "rm", "b")
        a.cli("peer", "add", "b", f"127.0.0.1:{relay.port}", b.host_id)  # a reaches b through the relay
        start_all(a, b)
        agent_id = make_agent(a)
        big_memory(a, "walker", 3 << 20)

        assert write_move(a.mnt, "walker", "b\n") == errno.ETIMEDOUT
        assert relay.stalled.is_set()
        move = a.status("walker")["move"]
        assert move["outcome"] == "rolled_back" and move["cause"] == "timeout", move
        assert f"blobs got no answer from b within {seconds}s" in move["detail"], move
        assert a.holder(agent_id) is HolderState.HELD and record(a, agent_id).held_epoch == 1
        # the abort went through on a fresh link: b refused epoch 2 and dropped its staging
        assert b.holder(agent_id) is HolderState.REFUSED
        assert "walker" in os.listdir(a.mnt) and "walker" not in os.listdir(b.mnt)
        assert a.staging() == [] and b.staging() == []
        append_event(a, "walker", "hello 5")  # writable on a
        verify_on(a, "walker", tmp_path, 6)
        a.stop()
        b.stop()
    finally:
        relay.close()
