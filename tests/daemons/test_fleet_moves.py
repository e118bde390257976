"""Moves between two fleet hosts go through the directory (issue 30;
docs/fleet.md, "A move through the directory"), with real daemons, a real
etcd and each agent a ticker process sampled on both hosts every few ms
(sampler_process.py): never two runners.

  * an agent made through the mount is claimed in the directory at once;
  * ``.control/move``: the directory names the target at the new epoch, the
    target runs the agent and the source does not; after a new lease on the
    target (its lease revoked) it still runs there;
  * the source killed with -9 right after each of its holder states: after
    the restart exactly one host runs it, and its journal lost nothing;
  * the target killed with -9 once its move is prepared (the restarted
    target keeps its staging area and asks the directory), and once it
    activated it;
  * a commit whose reply is lost (the test seam CAPSULEFS_TEST_LOSE_COMMIT:
    applied, or never sent): the source is in doubt, and its status question,
    the directory's settle, decides it (active; or fenced, then rolled back,
    and the target's gate refuses its prepared move);
  * the source killed with -9 once its commit applied (before its nudge):
    restarted, it settles the move, finds the target's address in the
    directory and nudges it, and the target activates on that nudge (its
    own gate is set 10 minutes off by CAPSULEFS_TEST_GATE_AFTER).
"""

from __future__ import annotations

import errno
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from capsulefs.core.fleet import config as fleet_config
from capsulefs.core.fleet import directory as fd
from capsulefs.core.store.holder import HolderBook, HolderState
from capsulefs.core.move import Outcome
from capsulefs.fleet.authority import DirectoryAuthority
from capsulefs.fleet.etcd import open_etcd
from capsulefs.testing.seams import GATE_AFTER_ENV, LOSE_COMMIT_ENV
from fleet_kit import EtcdServer, etcd_or_skip
from helpers import HANG
from test_move_daemons import (Host, add_messages, make_agent, new_ticker_agent, two_hosts, start_all, ticker_pids,
                               verify_on, wait_for, wait_holding, write_move)
from test_stale_run import Sampler

pytestmark = pytest.mark.fuse

PREFIX = "/capsulefs-moves-test/"
LAYOUT = fd.Layout(PREFIX.encode())


@pytest.fixture
def etcd() -> Iterator[EtcdServer]:
    with etcd_or_skip() as server:
        yield server


@pytest.fixture
def fleet_hosts(tmp_path: Path, etcd: EtcdServer) -> Iterator[tuple[Host, Host]]:
    """Two hosts in one fleet (STATE/fleet.json names the etcd); they find each other in the directory."""
    with two_hosts(tmp_path) as (a, b):
        for h in (a, b):
            fleet_config.save(str(h.state), fleet_config.make(etcd.spec, PREFIX))
        yield a, b


def entry(etcd: EtcdServer, agent_id: str) -> fd.AgentEntry | None:
    """The directory's entry of the agent, as etcd has it now."""
    async def run() -> fd.AgentEntry | None:
        async with open_etcd(etcd.spec, timeout=HANG) as client:
            kv = await client.get(LAYOUT.agent(agent_id))
            return None if kv is None else fd.decode_agent(kv.value)

    return trio.run(run)


def lease_of(etcd: EtcdServer, host: Host) -> int | None:
    async def run() -> int | None:
        async with open_etcd(etcd.spec, timeout=HANG) as client:
            kv = await client.get(LAYOUT.host(host.host_id))
            return None if kv is None else kv.lease

    return trio.run(run)


def revoke(etcd: EtcdServer, lease_id: int) -> None:
    async def run() -> None:
        async with open_etcd(etcd.spec, timeout=HANG) as client:
            await client.revoke(lease_id)

    trio.run(run)


def record(h: Host, agent_id: str) -> tuple[HolderState, int] | None:
    """The host's holder record: its state and epoch (the held epoch of a HELD one)."""
    rec = HolderBook(h.state / "holders").get(agent_id)
    if rec is None:
        return None
    return rec.state, rec.held_epoch if rec.state is HolderState.HELD and rec.held_epoch is not None else rec.epoch


def runs_only_on(script: Path, label: str) -> bool:
    return set(ticker_pids(script).values()) == {label}


def ticker_agent_running_on_a(a: Host, b: Host, tmp_path: Path, etcd: EtcdServer, *,
                              crash_at: str | None = None) -> tuple[str, Path, Path]:
    """The ticker agent made on A (claimed in the directory at A's first
    lease), both daemons started, the ticker running on A."""
    agent_id, script, shared = new_ticker_agent(a, tmp_path)
    a.spawn(crash_at, run=True)
    b.spawn(run=True)
    start_all(a, b)
    wait_holding(a, "walker")
    wait_for(lambda: runs_only_on(script, "mnt-a"), "the ticker running on a")
    assert entry(etcd, agent_id) == fd.AgentEntry(host_id=a.host_id, epoch=1)
    wait_for(lambda: lease_of(etcd, b) is not None, "b's record in the directory (a move's target is found there)")
    add_messages(a, "walker", 5)
    return agent_id, script, shared


def wait_running(script: Path, h: Host) -> None:
    """Until the ticker runs on ``h`` only (else the error says what ``h`` says of the agent)."""
    try:
        wait_for(lambda: runs_only_on(script, f"mnt-{h.name}"), f"the ticker running on {h.name} only")
    except AssertionError as exc:
        status = h.status("walker") if (h.mnt / "walker").exists() else "not shown"
        lines = [line for line in h.log.read_text(errors="replace").splitlines() if "DEBUG" not in line]
        raise AssertionError(f"{exc}\n{h.name}'s status of walker: {status}\n" + "\n".join(lines[-40:])) from None


def ends_held_by(a: Host, b: Host, etcd: EtcdServer, agent_id: str, script: Path, name: str, epoch: int) -> Host:
    """Until one host holds the agent: it must be ``name`` at ``epoch``, by its record and the directory's
    entry, run the ticker alone, and neither host keep a staging area. That host."""
    holder = settled_on(a, b, agent_id)
    assert holder is {"a": a, "b": b}[name]
    assert record(holder, agent_id) == (HolderState.HELD, epoch)
    assert entry(etcd, agent_id) == fd.AgentEntry(host_id=holder.host_id, epoch=epoch)
    wait_running(script, holder)
    wait_for(lambda: a.staging() == [] and b.staging() == [], "no staging left")
    return holder


def move_while_killed(a: Host, b: Host, dies: Host) -> int:
    """``echo B > a/walker/.control/move`` while ``dies`` is killed by its crash seam: the write's errno."""
    result: list[int] = []
    writer = threading.Thread(target=lambda: result.append(write_move(a.mnt, "walker", f"{b.host_id}\n")))
    writer.start()
    dies.wait_killed()
    writer.join(timeout=HANG)
    assert not writer.is_alive() and len(result) == 1, "the move's write did not return"
    return result[0]


def never_two(sampler: Sampler) -> None:
    sampler.stop()
    assert sampler.samples, "the sampler took no sample"
    both = [labels for _, labels in sampler.samples if len(labels) > 1]
    assert not both, f"two hosts ran the agent at once: {both[:3]}"


def settled_on(a: Host, b: Host, agent_id: str) -> Host:
    """Until exactly one host holds the agent and no move of it is pending anywhere; that host."""
    pending = {HolderState.FROZEN, HolderState.COMMITTING, HolderState.OFFERED, HolderState.VERIFIED,
               HolderState.PREPARED}

    def one() -> Host | None:
        ra, rb = record(a, agent_id), record(b, agent_id)
        states = [r[0] for r in (ra, rb) if r is not None]
        if states.count(HolderState.HELD) != 1 or pending & set(states):
            return None
        return a if ra is not None and ra[0] is HolderState.HELD else b

    return wait_for(one, "exactly one holder and no pending move")


def test_a_move_through_the_directory_and_a_new_lease_on_the_target(
        fleet_hosts: tuple[Host, Host], tmp_path: Path, etcd: EtcdServer) -> None:
    a, b = fleet_hosts
    agent_id, script, _shared = ticker_agent_running_on_a(a, b, tmp_path, etcd)
    sampler = Sampler(script)
    try:
        wait_for(lambda: sampler.running("mnt-a"), "the sampler to see the ticker on a")
        assert write_move(a.mnt, "walker", f"{b.host_id}\n") == 0
        # the directory names the target at the new epoch; the source retired it
        assert entry(etcd, agent_id) == fd.AgentEntry(host_id=b.host_id, epoch=2)
        assert record(a, agent_id) == (HolderState.RETIRED, 2) and record(b, agent_id) == (HolderState.HELD, 2)
        assert "walker" not in os.listdir(a.mnt)
        wait_for(lambda: runs_only_on(script, "mnt-b"), "the ticker running on b")
        first = set(ticker_pids(script))
        # a new lease on the target: it asks the directory again, which names it
        old = lease_of(etcd, b)
        assert old is not None
        revoke(etcd, old)
        wait_for(lambda: lease_of(etcd, b) not in (None, old), "b's new lease")
        wait_for(lambda: runs_only_on(script, "mnt-b") and set(ticker_pids(script)) != first,
                 "the ticker running on b again under its new lease")
        assert b.status("walker")["state"] == "active"
        assert a.staging() == [] and b.staging() == []
    finally:
        never_two(sampler)
    verify_on(b, "walker", tmp_path, 5)
    log = a.log.read_text()
    assert "commit to" in log and "active" in log, log[-3000:]


def test_an_agent_made_through_the_mount_is_claimed_at_once(fleet_hosts: tuple[Host, Host],
                                                             etcd: EtcdServer) -> None:
    a, _b = fleet_hosts
    a.start()
    wait_for(lambda: lease_of(etcd, a) is not None, "a's lease")
    agent_id = make_agent(a, "fresh", events=1)
    # (before: only at the host's next new lease)
    wait_for(lambda: entry(etcd, agent_id) == fd.AgentEntry(host_id=a.host_id, epoch=1), "the new agent claimed")


#: (the source's holder state after which it dies, the host that runs the agent in the end, its epoch there)
SOURCE_CRASHES = [
    ("frozen", "a", 1),  # before the directory was asked: rolled back
    ("committing", "a", 1),  # the commit never sent: the restart's settle fences it, rolled back
    ("retired", "b", 2),  # the commit applied and the target nudged: it runs there
]


@pytest.mark.parametrize(("state", "ends_on", "epoch"), SOURCE_CRASHES, ids=[s for s, _, _ in SOURCE_CRASHES])
def test_the_source_killed_at_each_phase(fleet_hosts: tuple[Host, Host], tmp_path: Path, etcd: EtcdServer,
                                         state: str, ends_on: str, epoch: int) -> None:
    a, b = fleet_hosts
    agent_id, script, _shared = ticker_agent_running_on_a(a, b, tmp_path, etcd, crash_at=f"source:{state}")
    sampler = Sampler(script)
    try:
        wait_for(lambda: sampler.running("mnt-a"), "the sampler to see the ticker on a")
        assert move_while_killed(a, b, a) != 0  # its daemon died under it
        a.start(run=True)
        holder = ends_held_by(a, b, etcd, agent_id, script, ends_on, epoch)
    finally:
        never_two(sampler)
    other = b if holder is a else a
    assert "walker" not in os.listdir(other.mnt)
    verify_on(holder, "walker", tmp_path, 5)


#: (the target's holder state after which it dies, the host that runs the agent in the end, its epoch there)
TARGET_CRASHES = [
    ("prepared", "a", 1),  # the prepare's answer lost: rolled back; the restarted target's gate refuses
    ("held", "b", 2),  # activated by the nudge (installed first), which is not answered: it runs there
]


@pytest.mark.parametrize(("state", "ends_on", "epoch"), TARGET_CRASHES, ids=[s for s, _, _ in TARGET_CRASHES])
def test_the_target_killed_at_a_prepared_move(fleet_hosts: tuple[Host, Host], tmp_path: Path, etcd: EtcdServer,
                                              state: str, ends_on: str, epoch: int) -> None:
    a, b = fleet_hosts
    agent_id, script, _shared = new_ticker_agent(a, tmp_path)
    a.spawn(run=True)
    b.spawn(f"target:{state}", run=True)
    start_all(a, b)
    wait_holding(a, "walker")
    wait_for(lambda: runs_only_on(script, "mnt-a"), "the ticker running on a")
    wait_for(lambda: lease_of(etcd, b) is not None, "b's record in the directory (a move's target is found there)")
    add_messages(a, "walker", 5)
    sampler = Sampler(script)
    try:
        wait_for(lambda: sampler.running("mnt-a"), "the sampler to see the ticker on a")
        got = move_while_killed(a, b, b)
        assert (got == 0) == (ends_on == "b"), got
        b.start(run=True)
        holder = ends_held_by(a, b, etcd, agent_id, script, ends_on, epoch)
    finally:
        never_two(sampler)
    verify_on(holder, "walker", tmp_path, 5)


@pytest.mark.parametrize("lost", ["applied", "unsent"])
def test_a_commit_whose_reply_is_lost_is_settled_by_the_directory(
        fleet_hosts: tuple[Host, Host], tmp_path: Path, etcd: EtcdServer, monkeypatch: pytest.MonkeyPatch,
        lost: str) -> None:
    a, b = fleet_hosts
    with monkeypatch.context() as m:
        m.setenv(LOSE_COMMIT_ENV, lost)  # (A's daemon only: B is spawned after)
        agent_id, script, _shared = ticker_agent_running_on_a(a, b, tmp_path, etcd)
    sampler = Sampler(script)
    try:
        wait_for(lambda: sampler.running("mnt-a"), "the sampler to see the ticker on a")
        got = write_move(a.mnt, "walker", f"{b.host_id}\n")
        move = a.status("walker")["move"] if lost == "unsent" else None
        if lost == "applied":
            assert got == 0
            holder, epoch = b, 2
        else:
            # fenced: no commit of the move can apply; rolled back, and the agent runs on A again
            assert got == errno.EPERM and move is not None
            assert move["outcome"] == "rolled_back" and move["cause"] == "refused", move
            holder, epoch = a, 1
        assert entry(etcd, agent_id) == fd.AgentEntry(host_id=holder.host_id, epoch=epoch)
        assert settled_on(a, b, agent_id) is holder
        wait_running(script, holder)
        if lost == "unsent":  # B's prepared move sat idle: the directory's gate refused it
            wait_for(lambda: record(b, agent_id) == (HolderState.REFUSED, 2), "b refusing its prepared move")
        wait_for(lambda: a.staging() == [] and b.staging() == [], "no staging left")
    finally:
        never_two(sampler)
    log = a.log.read_text()
    assert "test seam" in log and "settled" in log, log[-3000:]
    verify_on(holder, "walker", tmp_path, 5)
    json.dumps(move)  # (what status showed is plain JSON)


class _Alive:
    """A lease view that lets the test act as a host whose lease lives."""

    def may_run(self) -> bool:
        return True


def commit_as(etcd: EtcdServer, source: Host, agent_id: str, target: Host, epoch: int) -> Outcome:
    """The commit Txn ``source`` would have sent for its move of the agent to
    ``target`` at ``epoch`` (the directory's own code: begin, then commit)."""
    async def run() -> Outcome:
        async with open_etcd(etcd.spec, timeout=HANG) as client:
            authority = DirectoryAuthority(client, LAYOUT, source.host_id, _Alive())
            ticket = await authority.begin(agent_id, epoch - 1, target.host_id, epoch)
            return (await authority.commit(ticket)).outcome

    return trio.run(run)


def test_a_source_restarted_in_committing_nudges_its_target_found_in_the_directory(
        fleet_hosts: tuple[Host, Host], tmp_path: Path, etcd: EtcdServer, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = fleet_hosts
    with monkeypatch.context() as m:
        m.setenv(GATE_AFTER_ENV, "600")  # (the target's gate cannot activate it within the test: only the nudge)
        agent_id, script, _shared = ticker_agent_running_on_a(a, b, tmp_path, etcd, crash_at="source:committing")
    sampler = Sampler(script)
    try:
        wait_for(lambda: sampler.running("mnt-a"), "the sampler to see the ticker on a")
        assert move_while_killed(a, b, a) != 0  # A died once COMMITTING was durable, before its commit
        assert record(a, agent_id) == (HolderState.COMMITTING, 2) and record(b, agent_id) == (HolderState.PREPARED, 2)
        # the commit A had sent applies (its answer, and A's nudge, lost with A)
        assert commit_as(etcd, a, agent_id, b, 2) is Outcome.ACTIVE
        assert entry(etcd, agent_id) == fd.AgentEntry(host_id=b.host_id, epoch=2)
        # A has no pinned peers: it learns where B is from the directory
        assert not (a.state / "peers.json").exists()
        a.start(run=True)
        ends_held_by(a, b, etcd, agent_id, script, "b", 2)
    finally:
        never_two(sampler)
    assert f"on the nudge of {a.host_id}" in b.log.read_text(), b.log.read_text()[-3000:]
    assert f"its target {b.host_id} is at 127.0.0.1:{b.port}" in a.log.read_text(), a.log.read_text()[-3000:]
    verify_on(b, "walker", tmp_path, 5)
