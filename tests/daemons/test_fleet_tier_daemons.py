"""Real daemons on a real blob tier (``mount --directory etcd://... --blobs http://...``):
a real etcd and a real SeaweedFS (``weed mini``) started by the fixtures, two
``capsulefs mount`` processes on loopback.

  * A blob written through the mount is put to the tier by the daemon.
  * A blob stored while the tier was down (a TCP forwarder in front of the
    tier, stopped: connections refused) is put once the tier is back, at the
    next start (the reconcile); the write itself never waited. A start with
    nothing new puts nothing (the record of what the tier holds).
  * A move between two hosts on the tier sends host to host only what the
    tier lacks (the link's byte counters in both hosts' metrics); the target
    fetches the rest from the tier, before the source freezes the agent (the
    warm-up), and the agent verifies there.
  * A blob whose copy in the tier has the wrong bytes is refused on fetch,
    the source sends it, and the move completes with the right bytes.
"""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio

from capsulefs.core.capsule import format as fmt
from capsulefs.core.fleet.s3_wire import parse_tier_url
from capsulefs.core.fleet.sigv4 import Credentials
from capsulefs.core.store.holder import HolderBook, HolderState, new_held
from capsulefs.core.store.host_store import HostStore
from capsulefs.fleet.s3 import BlobTier, open_s3
from capsulefs.fleet.uploader import RECORD_DIR
from fleet_kit import EtcdServer, WeedServer, etcd_or_skip, free_ports, weed_or_skip
from helpers import HANG
from mount_kit import needs_fuse
from prom_kit import parse, value
from test_move_daemons import Host, no_tracebacks, two_hosts, verify_on, wait_for, write_move

pytestmark = [pytest.mark.fuse, needs_fuse]

BLOB = 256 * 1024  # bytes of each blob of the moved agent


@pytest.fixture(scope="module")
def weed() -> Iterator[WeedServer]:
    with weed_or_skip() as server:
        yield server


@pytest.fixture(scope="module")
def etcd() -> Iterator[EtcdServer]:
    with etcd_or_skip() as server:
        yield server


@dataclass
class Tier:
    """One bucket of the real tier, and calls on it from the test (not through capsulefs's daemons)."""

    weed: WeedServer
    bucket: str

    @property
    def url(self) -> str:
        return self.weed.tier_url(self.bucket, "eu")

    def _run(self, fn):  # type: ignore[no-untyped-def]
        async def run():  # type: ignore[no-untyped-def]
            creds = Credentials(self.weed.access_key, self.weed.secret_key)
            async with open_s3(parse_tier_url(self.url), creds, timeout=HANG) as s3:
                return await fn(BlobTier(s3))

        return trio.run(run)

    def has(self, sha: str) -> bool:
        return bool(self._run(lambda t: t.has(sha)))

    def has_all(self, shas: list[str]) -> bool:
        async def every(t: BlobTier) -> bool:
            return all([await t.has(sha) for sha in shas])

        return bool(self._run(every))

    def delete(self, sha: str) -> None:
        self._run(lambda t: t.s3.delete(t.key(sha)))

    def overwrite(self, sha: str, data: bytes) -> None:
        """Put other bytes under a blob's name, unconditionally (a damaged tier)."""
        self._run(lambda t: t.s3.put(t.key(sha), data))


@pytest.fixture
def tier(weed: WeedServer, monkeypatch: pytest.MonkeyPatch) -> Tier:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", weed.access_key)  # (the daemons inherit them)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", weed.secret_key)
    t = Tier(weed, "fleet-" + secrets.token_hex(4))
    assert t._run(lambda bt: bt.s3.create_bucket()) is True
    return t


def fleet_flags(etcd: EtcdServer, tier_url: str) -> tuple[str, ...]:
    return ("--directory", etcd.spec, "--directory-prefix", f"/tier-{secrets.token_hex(4)}/", "--blobs", tier_url)


@pytest.fixture
def hosts(tmp_path: Path, etcd: EtcdServer, tier: Tier) -> Iterator[tuple[Host, Host]]:
    with two_hosts(tmp_path) as (a, b):
        a.extra = b.extra = fleet_flags(etcd, tier.url)
        yield a, b


def metrics(h: Host) -> dict:
    return parse((h.mnt / ".control" / "metrics").read_bytes())


def agent_with_blobs(h: Host, name: str, count: int) -> tuple[str, list[str]]:
    """An agent held by ``h`` whose workspace lists ``count`` blobs, made in
    its store before its daemon starts (as an import does)."""
    store = HostStore.open(h.state)
    with store.writing():
        shas = [store.put_blob(os.urandom(BLOB)) for _ in range(count)]
    agent = store.create_agent(name, host_id=h.host_id, agent_id=secrets.token_hex(16))
    snap = {f"data/{i:04d}": sha for i, sha in enumerate(shas)}
    agent.write_files({fmt.SNAPSHOT: fmt.snapshot_bytes(snap)}, add_blobs=set(shas))
    HolderBook(h.state / "holders").put(new_held(agent.agent_id, 1))
    return agent.agent_id, shas


def put_through_mount(h: Host, agent: str, data: bytes) -> str:
    sha = hashlib.sha256(data).hexdigest()
    (h.mnt / agent / "artifacts" / "blobs" / sha).write_bytes(data)
    return sha


def recorded(h: Host) -> set[str]:
    d = h.state / RECORD_DIR
    return {line for p in d.iterdir() for line in p.read_text().split()} if d.exists() else set()


def active(h: Host, name: str) -> bool:
    try:
        return h.status(name)["state"] == "active"
    except (FileNotFoundError, KeyError):
        return False


class Forwarder:
    """A TCP forwarder on a fixed port of 127.0.0.1 to the tier: while it is
    stopped nothing listens there (connections are refused: the tier is down)."""

    def __init__(self, upstream: str) -> None:
        self.port = free_ports(1)[0]
        host, _, port = upstream.removeprefix("http://").partition(":")
        self.upstream = (host, int(port))
        self._sock: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        sock.listen(16)
        self._sock = sock
        self._spawn(self._accept, sock)

    def _spawn(self, fn, *args) -> None:  # type: ignore[no-untyped-def]
        t = threading.Thread(target=fn, args=args, daemon=True)
        self._threads.append(t)
        t.start()

    def _accept(self, sock: socket.socket) -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            up = socket.create_connection(self.upstream)
            self._conns += [conn, up]
            self._spawn(self._pump, conn, up)
            self._spawn(self._pump, up, conn)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def stop(self) -> None:
        if self._sock is not None:
            self._sock.shutdown(socket.SHUT_RDWR)  # (wakes the accept)
            self._sock.close()
            self._sock = None
        for c in self._conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()
        for t in self._threads:
            t.join(HANG)
        self._conns, self._threads = [], []


@pytest.fixture
def forwarder(weed: WeedServer) -> Iterator[Forwarder]:
    f = Forwarder(weed.endpoint)
    try:
        yield f
    finally:
        f.stop()


def test_a_blob_written_through_the_mount_is_put_to_the_tier(hosts: tuple[Host, Host], tier: Tier) -> None:
    a, _b = hosts
    a.start()
    wait_for(lambda: made_agent(a, "writer"), "a new agent taken (EROFS until the host's first lease)")
    wait_for(lambda: active(a, "writer"), "the new agent active under the host's lease")
    sha = put_through_mount(a, "writer", os.urandom(100_000))
    wait_for(lambda: tier.has(sha), "the blob in the tier")
    wait_for(lambda: sha in recorded(a), "the blob in the record of what the tier holds")
    # (the gauge is set once the batch is settled, just after the record is appended: waited for, not read once)
    wait_for(lambda: value(metrics(a), "capsulefs_tier_pending_blobs") == 0, "nothing left to put to the tier")
    assert value(metrics(a), "capsulefs_tier_puts_total", outcome="stored") >= 1


def test_blobs_stored_while_the_tier_was_down_are_put_at_the_next_start(
        tmp_path: Path, etcd: EtcdServer, tier: Tier, forwarder: Forwarder) -> None:
    (a,) = Host.init_all(tmp_path, "a")
    a.extra = fleet_flags(etcd, f"http://127.0.0.1:{forwarder.port}/{tier.bucket}/eu")  # (nothing listens yet)
    try:
        a.start()
        wait_for(lambda: made_agent(a, "writer"), "a new agent taken (EROFS until the host's first lease)")
        wait_for(lambda: active(a, "writer"), "the new agent active under the host's lease")
        sha = put_through_mount(a, "writer", os.urandom(50_000))  # (taken at once: the tier is down)
        wait_for(lambda: value(metrics(a), "capsulefs_tier_puts_total", outcome="failed") >= 1,
                 "a failed put to the tier that is down")
        assert value(metrics(a), "capsulefs_tier_pending_blobs") == 1
        a.stop()
        assert not tier.has(sha) and sha not in recorded(a)

        forwarder.start()  # the tier is back
        a.extra = ()  # (the saved fleet.json names the directory and the tier)
        a.start()
        wait_for(lambda: tier.has(sha), "the blob put by the reconcile at start")
        wait_for(lambda: sha in recorded(a), "the blob in the record")
        a.stop()

        a.start()  # nothing new: the record says the tier has every blob, so nothing is put (nor asked)
        wait_for(lambda: active(a, "writer"), "the agent active again")
        m = metrics(a)
        assert value(m, "capsulefs_tier_pending_blobs") == 0
        assert sum(value(m, "capsulefs_tier_puts_total", outcome=o) for o in ("stored", "present", "failed")) == 0
    finally:
        a.stop()
    no_tracebacks(a)


def made_agent(h: Host, name: str) -> bool:
    """mkdir of a new agent in the mount; False while the fleet mount refuses writes (no lease yet)."""
    try:
        (h.mnt / name).mkdir()
    except OSError as exc:
        if exc.errno != errno.EROFS:
            raise
        return False
    return True


def _moved(before: dict, after: dict, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def test_a_move_sends_host_to_host_only_what_the_tier_lacks(hosts: tuple[Host, Host], tier: Tier,
                                                            tmp_path: Path) -> None:
    a, b = hosts
    agent_id, shas = agent_with_blobs(a, "carrier", 12)
    a.start()
    wait_for(lambda: tier.has_all(shas), "every blob put to the tier by the reconcile at start")
    lacking = shas[3]
    tier.delete(lacking)  # (a blob the tier lost: the record still says it has it, so A does not put it again)
    b.start()
    wait_for(lambda: active(a, "carrier"), "the agent active under A's lease")
    before_a, before_b = metrics(a), metrics(b)
    wait_for(lambda: b.host_id in a.cli("fleet", "hosts").stdout, "b in the directory (a move's target is found there)")
    assert write_move(a.mnt, "carrier", f"{b.host_id}\n") == 0
    after_a, after_b = metrics(a), metrics(b)

    assert a.holder(agent_id) is HolderState.RETIRED and b.holder(agent_id) is HolderState.HELD
    verify_on(b, "carrier", tmp_path, 0)
    sent = _moved(before_a, after_a, "capsulefs_move_bytes_total", direction="sent")
    received = _moved(before_b, after_b, "capsulefs_move_bytes_total", direction="received")
    fetched = _moved(before_b, after_b, "capsulefs_tier_bytes_total", direction="fetched")
    assert fetched == BLOB * (len(shas) - 1), fetched
    assert BLOB <= received < BLOB + 64 * 1024, received  # the lacking blob and the capsule's small files
    assert BLOB <= sent < BLOB + 128 * 1024, sent  # (the manifest, the calls' framing)
    wait_for(lambda: tier.has(lacking), "the blob the tier lacked, put there by B once it had it")
    assert b.staging() == []
    # The target fetched from the tier before the freeze (the warm-up), not while the agent was frozen.
    assert _moved(before_a, after_a, "capsulefs_move_phase_seconds_count", phase="warming") == 1
    assert f"warm-up of {agent_id} on {b.host_id}: fetched from the tier" in a.log.read_text()


def test_a_tier_blob_with_wrong_bytes_is_refused_and_the_source_sends_it(hosts: tuple[Host, Host], tier: Tier,
                                                                       tmp_path: Path) -> None:
    a, b = hosts
    agent_id, shas = agent_with_blobs(a, "carrier", 6)
    a.start()
    wait_for(lambda: tier.has_all(shas), "every blob put to the tier")
    bad = shas[2]
    tier.overwrite(bad, os.urandom(BLOB))  # same size, other bytes
    b.start()
    wait_for(lambda: active(a, "carrier"), "the agent active under A's lease")
    before_b = metrics(b)
    wait_for(lambda: b.host_id in a.cli("fleet", "hosts").stdout, "b in the directory (a move's target is found there)")
    assert write_move(a.mnt, "carrier", f"{b.host_id}\n") == 0
    after_b = metrics(b)
    assert b.holder(agent_id) is HolderState.HELD
    assert _moved(before_b, after_b, "capsulefs_tier_bytes_total", direction="fetched") == BLOB * (len(shas) - 1)
    received = _moved(before_b, after_b, "capsulefs_move_bytes_total", direction="received")
    assert BLOB <= received < BLOB + 64 * 1024, received
    verify_on(b, "carrier", tmp_path, 0)
    with open(HostStore.open(b.state, create=False).blob_file(bad), "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == bad
    assert "does not match its name" in b.log.read_text()
