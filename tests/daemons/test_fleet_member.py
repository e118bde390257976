"""The daemon's fleet member (the composition root's daemon, capsulefs/daemon/root.py,
without a kernel) against a real etcd: the lease guards every write the daemon
acknowledges.

The guard's test runs on trio's mock clock (at the rate of time), so that a
jump of the clock is a pause of the whole daemon (a SIGSTOP, a paused VM)
after which no task has run yet; tests/mount/test_fleet_mount.py pauses a
real mounted daemon with SIGSTOP."""

from __future__ import annotations

import json
import os
import secrets
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
from capsulefs.daemon.root import MountConfig, Mounted, compose
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

