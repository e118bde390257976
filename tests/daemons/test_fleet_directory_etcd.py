"""The directory on a real etcd (Debian's etcd-server): the move's Txns behave
as the simulated etcd of the unit tests and the simulation evaluates them
(one scenario run against both), and `capsulefs fleet ls` / `fleet hosts`
show records written by the helpers in capsulefs.fleet.directory."""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import trio

from capsulefs.core.fleet import directory as fd
from capsulefs.core.fleet.etcd import KeyValue, TxnResult
from capsulefs.core.move import Outcome
from capsulefs.fleet.directory import claim_agent, register_host
from capsulefs.fleet.etcd import EtcdClient, open_etcd
from capsulefs.testing.sim_etcd import SimEtcd
from cli_kit import run_cli
from fleet_kit import EtcdServer

A1, A2, A3 = "a1" * 16, "b2" * 16, "c3" * 16


@pytest.fixture
def layout() -> fd.Layout:
    return fd.Layout(b"/capsulefs-test/" + secrets.token_hex(4).encode() + b"/")


@pytest.fixture
async def etcd(etcd_server: EtcdServer) -> AsyncIterator[EtcdClient]:
    async with open_etcd(etcd_server.spec) as client:
        yield client


Txn = Callable[[fd.DirTxn], Awaitable[TxnResult]]
Get = Callable[[bytes], Awaitable[KeyValue | None]]


async def _scenario(layout: fd.Layout, txn: Txn, get: Get, register: Callable[[str], Awaitable[None]]) -> list[object]:
    """A move's Txns in the orders that matter; what each answered, judged."""
    out: list[object] = []
    move = fd.Move(source="src", held_epoch=3, target="tgt", epoch=4)
    out.append((await txn(fd.claim_txn(layout, A1, fd.AgentEntry(host_id="src", epoch=3)))).succeeded)
    out.append((await txn(fd.claim_txn(layout, A1, fd.AgentEntry(host_id="x", epoch=9)))).succeeded)  # taken
    seen = await get(layout.agent(A1))
    assert seen is not None
    commit = fd.commit_txn(layout, A1, seen, "tgt", 4)
    out.append(fd.judge(commit, "commit", move, await txn(commit))[0])  # the target has no lease: never
    await register("tgt")
    # a fence made after the commit was sent, before it arrives: the late commit can never apply
    fence = fd.fence_txn(layout, A1, seen)
    out.append(fd.judge(fence, "fence", move, await txn(fence))[0])
    out.append(fd.judge(commit, "commit", move, await txn(commit))[0])
    # a fresh move: the commit applies, a duplicate of it and a fence both say active
    seen = await get(layout.agent(A1))
    assert seen is not None
    commit = fd.commit_txn(layout, A1, seen, "tgt", 4)
    out.append(fd.judge(commit, "commit", move, await txn(commit))[0])
    out.append(fd.judge(commit, "commit", move, await txn(commit))[0])
    now = await get(layout.agent(A1))
    assert now is not None
    fence = fd.fence_txn(layout, A1, now)
    out.append(fd.judge(fence, "fence", move, await txn(fence))[0])
    out.append(fd.decode_agent(now.value))
    return out


EXPECTED = [True, False, Outcome.NEVER, Outcome.NEVER, Outcome.NEVER, Outcome.ACTIVE, Outcome.ACTIVE, Outcome.ACTIVE,
            fd.AgentEntry(host_id="tgt", epoch=4)]


async def test_the_moves_txns_on_etcd_answer_as_the_simulated_etcd(etcd: EtcdClient, layout: fd.Layout) -> None:
    async def txn(t: fd.DirTxn) -> TxnResult:
        return await etcd.txn(t.compare, t.success, t.failure)

    async def register(host: str) -> None:
        await register_host(etcd, layout, fd.HostEntry(host_id=host, address=f"{host}:7000"), 30)

    with trio.fail_after(60):
        real = await _scenario(layout, txn, etcd.get, register)

    sim = SimEtcd()

    async def sim_txn(t: fd.DirTxn) -> TxnResult:
        return sim.txn(t, 0.0)

    async def sim_get(key: bytes) -> KeyValue | None:
        return sim.get(key)

    async def sim_register(host: str) -> None:
        sim.txn(fd.DirTxn((), (fd.register_ops(layout, fd.HostEntry(host_id=host, address="x:1"),
                                               sim.grant(30, 0.0)),), ()), 0.0)

    simulated = await _scenario(layout, sim_txn, sim_get, sim_register)
    assert real == simulated == EXPECTED


async def test_a_takeover_waits_for_the_holders_lease(etcd: EtcdClient, layout: fd.Layout) -> None:
    with trio.fail_after(60):
        lease = await register_host(etcd, layout, fd.HostEntry(host_id="old", address="o:1"), 30)
        assert await claim_agent(etcd, layout, A1, fd.AgentEntry(host_id="old", epoch=2))
        seen = await etcd.get(layout.agent(A1))
        assert seen is not None
        t = fd.takeover_txn(layout, A1, seen, "new", 3)
        assert not (await etcd.txn(t.compare, t.success, t.failure)).succeeded
        await etcd.revoke(lease.id)  # as an expiry would: the host's key goes with its lease
        assert await etcd.get(layout.host("old")) is None
        assert (await etcd.txn(t.compare, t.success, t.failure)).succeeded
        kv = await etcd.get(layout.agent(A1))
        assert kv is not None and fd.decode_agent(kv.value).names("new", 3)


def _spec(server: EtcdServer) -> list[str]:
    return ["--directory", server.spec]


async def _fleet(etcd: EtcdClient, layout: fd.Layout) -> None:
    await register_host(etcd, layout, fd.HostEntry(host_id="h1", address="10.0.0.1:7000"), 60)
    gone = await register_host(etcd, layout, fd.HostEntry(host_id="h2", address="10.0.0.2:7000"), 60)
    await etcd.revoke(gone.id)
    assert await claim_agent(etcd, layout, A1, fd.AgentEntry(host_id="h1", epoch=3))
    assert await claim_agent(etcd, layout, A2, fd.AgentEntry(host_id="h2", epoch=1))
    assert await claim_agent(etcd, layout, A3, fd.AgentEntry(host_id="h1", epoch=5, state=fd.EntryState.REMOVED))


async def test_fleet_ls_and_hosts(etcd_server: EtcdServer, etcd: EtcdClient, layout: fd.Layout) -> None:
    with trio.fail_after(60):
        await _fleet(etcd, layout)
    prefix = ["--prefix", layout.prefix.decode()]
    ls = await trio.to_thread.run_sync(lambda: run_cli("fleet", "ls", *_spec(etcd_server), *prefix, check=True))
    lines = [line.split() for line in ls.stdout.splitlines()]
    assert lines[0] == ["AGENT", "HOLDER", "EPOCH", "STATE", "HOLDER'S", "LEASE"]
    assert lines[1:] == [[A1, "h1", "3", "held", "alive"], [A2, "h2", "1", "held", "gone"],
                         [A3, "h1", "5", "removed", "alive"]]
    js = await trio.to_thread.run_sync(
        lambda: run_cli("fleet", "ls", *_spec(etcd_server), *prefix, "--json", check=True))
    assert [json.loads(line) for line in js.stdout.splitlines()][1] == {
        "agent_id": A2, "holder": "h2", "epoch": 1, "state": "held", "holder_alive": False, "problem": ""}
    hosts = await trio.to_thread.run_sync(
        lambda: run_cli("fleet", "hosts", *_spec(etcd_server), *prefix, "--json", check=True))
    (h1,) = [json.loads(line) for line in hosts.stdout.splitlines()]
    assert h1["host_id"] == "h1" and h1["address"] == "10.0.0.1:7000" and h1["agents"] == 1
    assert 0 < h1["lease_ttl"] <= 60
    table = await trio.to_thread.run_sync(lambda: run_cli("fleet", "hosts", *_spec(etcd_server), *prefix, check=True))
    assert table.stdout.splitlines()[1].split()[:2] == ["h1", "10.0.0.1:7000"]


async def test_a_record_that_does_not_parse_is_listed_and_fails_the_command(
        etcd_server: EtcdServer, etcd: EtcdClient, layout: fd.Layout) -> None:
    with trio.fail_after(60):
        await _fleet(etcd, layout)
        await etcd.put(layout.agent(A2), b'{"format":"fleet-agent/1","host_id":"h2","epoch":-1,"state":"held"}')
    proc = await trio.to_thread.run_sync(
        lambda: run_cli("fleet", "ls", *_spec(etcd_server), "--prefix", layout.prefix.decode()))
    assert proc.returncode == 1
    assert [line.split()[:4] for line in proc.stdout.splitlines()[1:]][1] == [A2, "-", "-", "unreadable"]
    (err,) = proc.stderr.splitlines()
    assert err.startswith("capsulefs: error: 1 record(s) in the directory do not parse") and "epoch" in err


def test_an_unreachable_directory_is_one_line() -> None:
    from fleet_kit import free_ports

    (port,) = free_ports(1)
    proc = run_cli("fleet", "hosts", "--directory", f"etcd://127.0.0.1:{port}")
    assert proc.returncode == 1 and proc.stdout == ""
    (err,) = proc.stderr.splitlines()
    assert err.startswith("capsulefs: error: no etcd endpoint answered"), err
