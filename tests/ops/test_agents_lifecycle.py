"""The daemon's one owner of an agent's lifecycle (capsulefs/daemon/agents.py),
built by the composition root (capsulefs/daemon/root.py), without a kernel:
what the mount shows of an agent and whether it may run come from the
lifecycle table and the moves that hold it still, and never disagree."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest


from capsulefs.core.store.host_store import HostStore
from capsulefs.core.view.errors import ReadOnly
from capsulefs.core.view.nodes import AgentState
from capsulefs.daemon.root import MountConfig, Mounted, compose
from capsulefs.peer.book import Peer, PeerBook
from capsulefs.peer.identity import load_or_create_identity
from capsulefs.core.errors import ImportRefused
from capsulefs.core.store.holder import HolderBook, HolderRecord, HolderState
from capsulefs.move.host import holders_dir, record_imported, record_new_agent, refuse_stale_copy
from helpers import HOST, make_agent


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _mounted(state_dir: Path, tmp_path: Path) -> Mounted:
    return compose(MountConfig(state_dir=str(state_dir), mountpoint=str(tmp_path / "mnt"), run_agents=False))


async def test_a_held_agent_is_shown_and_runs_until_a_move_holds_it_still(store: HostStore, state_dir: Path,
                                                                         tmp_path: Path) -> None:
    agent_id = make_agent(store, "alice").agent_id  # held here, its manifest names this host, no peers: holding
    m = _mounted(state_dir, tmp_path)
    assert (m.view.state(agent_id), m.agents.may_run(agent_id)) == (AgentState.ACTIVE, (True, ""))
    await m.agents.freeze(agent_id)  # a move starts: before its record says frozen
    assert (m.view.state(agent_id), m.agents.may_run(agent_id)) == (AgentState.FROZEN, (False, "frozen for a move"))
    await m.agents.resume(agent_id)  # rolled back
    assert (m.view.state(agent_id), m.agents.may_run(agent_id)) == (AgentState.ACTIVE, (True, ""))
    m.view.close()


async def test_an_agent_in_doubt_is_read_only_and_does_not_run_even_when_resumed(store: HostStore, state_dir: Path,
                                                                                 tmp_path: Path) -> None:
    """Held, but its one peer has not answered (it is dead): in doubt. A
    resume (a move rolled back) does not make it writable or run it."""
    agent_id = make_agent(store, "alice").agent_id
    other = load_or_create_identity(tmp_path / "other").host_id
    PeerBook(state_dir).add(Peer(name="dead", address=f"127.0.0.1:{closed_port()}", host_id=other))
    m = _mounted(state_dir, tmp_path)
    assert m.view.state(agent_id) is AgentState.FROZEN
    await m.agents.resume(agent_id)
    assert m.view.state(agent_id) is AgentState.FROZEN
    ok, why = m.agents.may_run(agent_id)
    assert not ok and why.startswith("in doubt")
    m.view.close()


async def test_an_agent_without_a_record_is_read_only_from_the_first_request(store: HostStore, state_dir: Path,
                                                                             tmp_path: Path) -> None:
    """Files here without a holder record (it was lost): another host may
    hold the agent now, so the mount takes no write for it from the start,
    before the move recovery has recorded it UNKNOWN (docs/move.md's table:
    no record is 'unknown', read-only)."""
    agent_id = make_agent(store, "alice", held=False).agent_id
    m = _mounted(state_dir, tmp_path)
    assert m.view.state(agent_id) is AgentState.FROZEN
    with pytest.raises(ReadOnly):
        m.view.check_writable(agent_id)
    assert m.agents.may_run(agent_id)[0] is False
    m.view.close()


async def test_an_agent_that_appears_while_the_mount_serves_is_shown_as_its_record_says(
        store: HostStore, state_dir: Path, tmp_path: Path) -> None:
    """``capsulefs import`` beside the daemon installs the files, then the
    holder record: read-only in between (no record: another host may hold
    it), then as the record says from the next request on: held here,
    writable and runs; a copy another host holds (UNKNOWN), read-only."""
    m = _mounted(state_dir, tmp_path)
    foreign = make_agent(store, "alice", held=False)  # files (naming another host), no record yet
    assert m.view.state(foreign.agent_id) is AgentState.FROZEN
    with pytest.raises(ReadOnly):
        m.view.check_writable(foreign.agent_id)
    assert m.agents.may_run(foreign.agent_id)[0] is False
    me = load_or_create_identity(state_dir).host_id
    mine = store.create_agent("mine", host_id=me, agent_id="b" * 32)
    assert m.view.state(mine.agent_id) is AgentState.FROZEN
    record_new_agent(state_dir, mine.agent_id, mine.manifest().holder.epoch)
    assert (m.view.state(mine.agent_id), m.agents.may_run(mine.agent_id)) == (AgentState.ACTIVE, (True, ""))
    m.view.check_writable(mine.agent_id)
    record_imported(state_dir, foreign.agent_id, HOST, 1)  # the manifest names another host: in doubt
    assert m.view.state(foreign.agent_id) is AgentState.FROZEN
    ok, why = m.agents.may_run(foreign.agent_id)
    assert not ok and why.startswith("in-doubt"), why
    m.view.close()


async def test_an_agent_that_appears_while_the_fleet_lease_is_lost_is_read_only(
        store: HostStore, state_dir: Path, tmp_path: Path) -> None:
    m = _mounted(state_dir, tmp_path)
    await m.agents.lease_lost("the directory did not answer")
    agent_id = make_agent(store, "alice").agent_id  # held here, as `capsulefs new` makes it
    assert m.view.state(agent_id) is AgentState.FROZEN
    assert m.agents.may_run(agent_id) == (False, "fleet lease lost: the directory did not answer")
    m.view.close()


async def test_an_agent_retired_here_whose_files_come_back_is_shown_once_its_record_says_so(
        store: HostStore, state_dir: Path, tmp_path: Path) -> None:
    """An agent moved away (retired, its files removed) whose files are in the
    store again: hidden while its record still says retired (a move's files
    not removed yet, an import not recorded yet), then, once an import wrote
    its record, an arrival shown as the lifecycle decides, without a restart."""
    agent_id = make_agent(store, "alice").agent_id
    other = load_or_create_identity(tmp_path / "other").host_id
    m = _mounted(state_dir, tmp_path)
    await m.agents.retire(agent_id)  # (a move away: the view first, then the record and the files)
    HolderBook(holders_dir(state_dir)).put(HolderRecord(agent_id=agent_id, state=HolderState.RETIRED, epoch=2,
                                                        peer=other))
    store.remove_agent(agent_id)
    assert m.view.state(agent_id) is AgentState.RETIRED
    store.create_agent("alice", host_id=other, agent_id=agent_id)  # an import of the holder's export: files first
    assert m.view.state(agent_id) is AgentState.RETIRED and "alice" not in m.view.names()
    record_imported(state_dir, agent_id, other, 2)  # then its record: in doubt
    assert m.view.state(agent_id) is AgentState.FROZEN and m.view.names() == {"alice": agent_id}
    ok, why = m.agents.may_run(agent_id)
    assert not ok and why.startswith("in-doubt"), why
    m.view.close()


def test_an_import_of_an_agent_let_go_here_is_held_only_at_a_newer_epoch(state_dir: Path, tmp_path: Path) -> None:
    """A copy naming this host at an epoch not above the one it handed the
    agent on at is refused before anything is installed; at a newer one it
    is held at that epoch; a copy naming another host is not refused (in doubt)."""
    me = load_or_create_identity(state_dir).host_id
    other = load_or_create_identity(tmp_path / "other").host_id
    book = HolderBook(holders_dir(state_dir))
    agent_id = "c" * 32
    book.put(HolderRecord(agent_id=agent_id, state=HolderState.RETIRED, epoch=2, peer=other))
    for epoch in (1, 2):
        with pytest.raises(ImportRefused, match=f"handed it to host {other} at epoch 2.*from epoch {epoch}"):
            refuse_stale_copy(state_dir, agent_id, "alice", me, epoch, me)
    refuse_stale_copy(state_dir, agent_id, "alice", other, 2, me)  # the holder's export: imported, in doubt
    refuse_stale_copy(state_dir, agent_id, "alice", me, 3, me)
    rec = record_new_agent(state_dir, agent_id, 3)
    assert (rec.state, rec.held_epoch) == (HolderState.HELD, 3) and book.get(agent_id) == rec


def test_the_agents_capsule_dir_is_absolute_whatever_the_mount_point_was_given_as(
        store: HostStore, state_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``capsulefs mount mnt`` (relative): an agent's CAPSULE_DIR still names its directory from anywhere."""
    agent_id = make_agent(store, "alice").agent_id
    monkeypatch.chdir(tmp_path)
    m = compose(MountConfig(state_dir=str(state_dir), mountpoint="mnt"))
    assert m.runtime is not None
    assert m.runtime.capsule_dir(agent_id) == str(tmp_path / "mnt" / "alice")
    m.view.close()
