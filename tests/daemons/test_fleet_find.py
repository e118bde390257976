"""Real daemons in the fleet mode find each other in a real etcd: no ``peer
add`` on either side, a move's target named by its host id (or a prefix),
its address and certificate pinned from the directory; a hostile record and
a host whose lease ended move nothing. Today's move protocol: the move's
commit in the directory is not assumed."""

from __future__ import annotations

import base64
import errno
import hashlib
import json
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from capsulefs.core.fleet import config
from capsulefs.core.fleet import directory as fd
from capsulefs.core.store.holder import HolderState
from capsulefs.fleet.etcd import open_etcd
from fleet_kit import EtcdServer
from helpers import HANG
from mount_kit import needs_fuse
from test_move_daemons import Host, make_agent, no_tracebacks, start_all, verify_on, wait_for, wait_holding, write_move

pytestmark = [pytest.mark.fuse, needs_fuse]


class Fleet:
    def __init__(self, etcd: EtcdServer, a: Host, b: Host, prefix: str) -> None:
        self.etcd, self.a, self.b = etcd, a, b
        self.layout = fd.Layout(prefix.encode())

    def host_kv(self, host_id: str):  # type: ignore[no-untyped-def]
        async def run():  # type: ignore[no-untyped-def]
            async with open_etcd(self.etcd.spec, timeout=HANG) as etcd:
                return await etcd.get(self.layout.host(host_id))

        return trio.run(run)

    def put_under_new_lease(self, key: bytes, value: bytes) -> None:
        async def run() -> None:
            async with open_etcd(self.etcd.spec, timeout=HANG) as etcd:
                lease = await etcd.grant(60)
                await etcd.put(key, value, lease=lease.id)

        trio.run(run)

    def revoke(self, lease_id: int) -> None:
        async def run() -> None:
            async with open_etcd(self.etcd.spec, timeout=HANG) as etcd:
                await etcd.revoke(lease_id)

        trio.run(run)


@pytest.fixture
def fleet(tmp_path: Path, etcd_server: EtcdServer) -> Iterator[Fleet]:
    a, b = Host.init_all(tmp_path, "a", "b")
    prefix = f"/capsulefs-find-{secrets.token_hex(4)}/"
    for h in (a, b):  # (what `mount --directory` saves: later mounts use it)
        config.save(str(h.state), config.make(etcd_server.spec, prefix))
    f = Fleet(etcd_server, a, b, prefix)
    try:
        start_all(a, b)
        for h in (a, b):  # each host's record, under its lease, with its --listen address
            wait_for(lambda h=h: f.host_kv(h.host_id), f"{h.name}'s record in the directory")
            record = fd.decode_host(f.host_kv(h.host_id).value)
            assert record.address == f"127.0.0.1:{h.port}"
        yield f
    finally:
        for h in (a, b):
            h.stop()
    no_tracebacks(a, b)
    assert not (a.state / "peers.json").exists() and not (b.state / "peers.json").exists()  # no `peer add`


def _writable(h: Host, name: str, text: str) -> None:
    with open(h.mnt / name / "memory" / "timeline_events.jsonl", "a") as f:
        f.write(json.dumps({"kind": "user_message", "text": text}) + "\n")


def test_two_fleet_daemons_find_each_other_and_move_agents(fleet: Fleet, tmp_path: Path) -> None:
    a, b = fleet.a, fleet.b
    walker = make_agent(a, "walker")
    wait_holding(a, "walker")
    assert write_move(a.mnt, "walker", f"{b.host_id}\n") == 0  # the host id, as `fleet hosts` shows it
    assert "walker" in (p.name for p in b.mnt.iterdir()) and not (a.mnt / "walker").exists()
    assert a.holder(walker) is HolderState.RETIRED and b.holder(walker) is HolderState.HELD
    verify_on(b, "walker", tmp_path, 5)

    runner = make_agent(a, "runner", events=3)
    wait_holding(a, "runner")
    out = a.cli("move", "runner", b.host_id[:10].lower()).stdout  # a prefix, through the daemon
    assert f"moved to {b.host_id}" in out, out
    assert a.holder(runner) is HolderState.RETIRED and b.holder(runner) is HolderState.HELD
    verify_on(b, "runner", tmp_path, 3)


def test_no_move_to_a_host_that_is_not_a_live_host_in_the_directory(fleet: Fleet, tmp_path: Path) -> None:
    a, b = fleet.a, fleet.b
    walker = make_agent(a, "walker")
    wait_holding(a, "walker")

    # not in the directory at all: one clear error, nothing happened
    digest = hashlib.sha256(b"a host that never joined").digest()
    stranger = base64.b32encode(digest).decode().rstrip("=")
    assert write_move(a.mnt, "walker", f"{stranger}\n") == errno.EINVAL
    result = a.cli("move", "walker", stranger, check=False)
    assert result.returncode == 1 and f"host {stranger} is not in the directory" in result.stderr, result.stderr

    # a hostile record: B's address under an id that is not B's certificate: refused, nothing moves
    fake = fd.HostEntry(host_id=stranger, address=f"127.0.0.1:{b.port}", cert_sha256=digest.hex())
    fleet.put_under_new_lease(fleet.layout.host(stranger), fake.encode())
    assert write_move(a.mnt, "walker", f"{stranger}\n") == errno.EPERM
    move = a.status("walker")["move"]
    assert move["outcome"] == "rolled_back" and move["cause"] == "refused", move
    assert f"not the pinned {stranger}" in move["detail"], move
    assert a.holder(walker) is HolderState.HELD and "walker" not in (p.name for p in b.mnt.iterdir())

    # B's lease ended (B killed, its lease over): B is no target any more
    kv = fleet.host_kv(b.host_id)
    assert b.proc is not None
    b.proc.kill()
    b.proc.wait(timeout=HANG)
    b.stop()
    fleet.revoke(kv.lease)  # (what its expiry does: etcd deletes the record)
    assert write_move(a.mnt, "walker", f"{b.host_id}\n") == errno.EINVAL
    assert a.holder(walker) is HolderState.HELD
    _writable(a, "walker", "hello 5")
    verify_on(a, "walker", tmp_path, 6)
