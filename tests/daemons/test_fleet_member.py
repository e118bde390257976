"""The daemon's fleet member (the composition root's daemon, capsulefs/daemon/root.py,
without a kernel) against a real etcd: the lease guards every write the daemon
acknowledges, and a new lease confirms the agents a batch at a time.

The guard's test runs on trio's mock clock (at the rate of time), so that a
jump of the clock is a pause of the whole daemon (a SIGSTOP, a paused VM)
after which no task has run yet; tests/mount/test_fleet_mount.py pauses a
real mounted daemon with SIGSTOP."""

from __future__ import annotations

import json
import os
import re
import secrets
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
import trio.testing

from capsulefs.core.capsule import format as fmt
from capsulefs.core.fleet.config import FleetConfig
from capsulefs.core.store.host_store import HostStore
from capsulefs.core.view.errors import ReadOnly
from capsulefs.core.view.nodes import ROOT, AgentState, Kind, Node
from capsulefs.core.fleet import directory as fd
from capsulefs.daemon.root import MountConfig, Mounted, compose
from capsulefs.fleet.authority import CONFIRM_BATCH
from capsulefs.fleet.directory import claim_agent
from capsulefs.fleet.etcd import open_etcd
from capsulefs.peer.identity import load_or_create_identity
from fleet_kit import KillableEtcd, killable_etcd
from helpers import HANG, make_agent


@pytest.fixture
def etcd_server() -> Iterator[KillableEtcd]:
    with killable_etcd() as server:
        yield server


def _note(text: str) -> bytes:
    return json.dumps({"kind": "note", "text": text}).encode() + b"\n"


def _fleet_daemon(state_dir: Path, tmp_path: Path, etcd: KillableEtcd) -> Mounted:
    prefix = f"/capsulefs-guard-{secrets.token_hex(4)}/"
    return compose(MountConfig(state_dir=str(state_dir), mountpoint=str(tmp_path / "mnt"), run_agents=False,
                               fleet=FleetConfig(directory=etcd.spec, prefix=prefix)))


async def _until(predicate: object, what: str) -> None:
    """Until ``predicate()`` holds; HANG bounds a hang."""
    assert callable(predicate)
    with trio.move_on_after(HANG):
        while not predicate():
            await trio.sleep(0.01)
    assert predicate(), what


async def test_a_write_after_a_pause_past_the_deadline_is_refused_before_the_keeper_runs(
        store: HostStore, state_dir: Path, tmp_path: Path, etcd_server: KillableEtcd,
        mock_clock: trio.testing.MockClock) -> None:
    mock_clock.rate = 1  # (trio's clock runs as time does, except for the jump below)
    agent_id = make_agent(store, "alice").agent_id
    m = _fleet_daemon(state_dir, tmp_path, etcd_server)
    assert m.fleet is not None
    keeper = m.fleet.keeper
    journal = Path(store.agents_dir) / agent_id / fmt.JOURNAL
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(m.fleet.serve)
            with trio.fail_after(HANG):
                await keeper.wait_alive()
            await _until(lambda: m.view.state(agent_id) is AgentState.ACTIVE, "the agent confirmed and writable")
            agent = m.view.agent(agent_id)
            agent.append_lines(_note("under the lease"))
            deadline = keeper.deadline
            assert deadline is not None and keeper.leases == 1

            mock_clock.jump(deadline - trio.current_time() + 0.001)  # a pause: no task ran meanwhile
            before = journal.read_bytes()
            with pytest.raises(ReadOnly, match="not renewed in time"):
                agent.append_lines(_note("after the pause"))
            assert journal.read_bytes() == before
            # refused by the check itself, the agent frozen at once: the keeper has not run yet
            assert keeper.deadline == deadline and keeper.leases == 1
            assert m.view.state(agent_id) is AgentState.FROZEN
            ok, why = m.agents.may_run(agent_id)
            assert not ok and why.startswith("fleet lease lost: "), why
            with pytest.raises(ReadOnly):  # every other write too: a new agent, a control command
                m.view.mkdir(ROOT, "bob")
            remove = m.view.open(Node(Kind.CONTROL_FILE, agent_id, "remove"), os.O_WRONLY, os.getuid())
            with pytest.raises(ReadOnly):
                await remove.write_async(0, agent_id.encode() + b"\n")
            assert agent_id in m.view.store.agent_ids()

            # the keeper runs: it stops the host, takes a new lease, the directory confirms the agent
            await _until(lambda: keeper.leases == 2 and m.view.state(agent_id) is AgentState.ACTIVE,
                         "a new lease and the agent writable again")
            agent.append_lines(_note("under the new lease"))
            assert b"after the pause" not in journal.read_bytes()
            nursery.cancel_scope.cancel()
    finally:
        m.view.close()


def _grpc_calls(etcd: KillableEtcd) -> Counter[str]:
    """etcd's own count of the gRPC calls it began, by method (its /metrics;
    the JSON gateway's requests are counted there too)."""
    with urllib.request.urlopen(etcd.url + "/metrics", timeout=HANG) as resp:
        text = resp.read().decode()
    out: Counter[str] = Counter()
    for line in text.splitlines():
        if line.startswith("grpc_server_started_total{"):
            labels, _, value = line.rpartition(" ")
            method = re.search(r'grpc_method="([^"]+)"', labels)
            assert method is not None, line
            out[method.group(1)] += int(float(value))
    return out


async def test_a_new_lease_confirms_many_agents_a_batch_at_a_time(
        store: HostStore, state_dir: Path, tmp_path: Path, etcd_server: KillableEtcd) -> None:
    """After a new lease the daemon asks the directory about every agent it
    holds in Txns of up to 128 reads, not one read each: 131 agents, 2 Txns
    (and a claim of each agent the directory has no entry for, then one more
    read of those). Each agent runs only as its entry says."""
    n = CONFIRM_BATCH + 3
    ids = [make_agent(store, f"agent{i:03d}", workspace={}).agent_id for i in range(n)]
    me = load_or_create_identity(str(state_dir)).host_id
    m = _fleet_daemon(state_dir, tmp_path, etcd_server)
    assert m.fleet is not None
    layout = m.fleet.config.layout
    missing, elsewhere = ids[:2], ids[-3:]  # (no entry yet: claimed; named another host: not run)
    async with open_etcd(etcd_server.spec) as etcd:
        async def write(agent_id: str, entry: fd.AgentEntry) -> None:
            assert await claim_agent(etcd, layout, agent_id, entry)

        async with trio.open_nursery() as nursery:
            for agent_id in ids[2:]:
                holder = "host-b" if agent_id in elsewhere else me
                nursery.start_soon(write, agent_id, fd.AgentEntry(host_id=holder, epoch=1))
    before = _grpc_calls(etcd_server)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(m.fleet.serve)
            with trio.fail_after(HANG):
                await m.fleet.keeper.wait_alive()
            calls = _grpc_calls(etcd_server) - before
            batches = -(-n // CONFIRM_BATCH)
            assert calls["Range"] == 0, calls
            assert calls["Txn"] == batches + len(missing) + 1, calls  # reads, claims, the claimed read again
            for agent_id in ids:
                want = AgentState.FROZEN if agent_id in elsewhere else AgentState.ACTIVE
                assert m.view.state(agent_id) is want, agent_id
            ok, why = m.agents.may_run(elsewhere[0])
            assert not ok and "does not name this host at epoch 1" in why, why
            nursery.cancel_scope.cancel()
    finally:
        m.view.close()
