"""The daemon's move wiring (capsulefs.move.mount_moves) without a kernel: the
mount's Mover called directly, against peers that are dead or silent."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

import pytest
import trio
import trio.testing

from capsulefs.core.move.cause import Cause
from capsulefs.core.view import errors as le
from capsulefs.core.errors import FormatError, NotFoundError
from capsulefs.core.store.holder import HolderBook, HolderState
from capsulefs.core.store.host_store import HostStore
from capsulefs.core.view.nodes import AgentState
from capsulefs.daemon.root import MountConfig, Mounted, compose
from capsulefs.peer.identity import load_or_create_identity
from capsulefs.move.host import record_new_agent
from capsulefs.peer.book import Peer, PeerBook
from helpers import make_agent


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def wired(store: HostStore, state_dir: Path, tmp_path: Path) -> tuple[Mounted, str]:
    agent = make_agent(store, "alice")
    record_new_agent(state_dir, agent.agent_id)
    other = load_or_create_identity(tmp_path / "other").host_id
    PeerBook(state_dir).add(Peer(name="dead", address=f"127.0.0.1:{closed_port()}", host_id=other))
    m = compose(MountConfig(state_dir=str(state_dir), mountpoint=str(tmp_path / "mnt"), run_agents=False,
                            retry_pause=0.01))
    # As if this daemon had created it (mkdir): held with evidence, although its one peer is dead
    # (an agent in doubt does not move: docs/move.md, "Checking before running").
    m.moves.standings.created(agent.agent_id)
    m.agents.show_all()
    return m, agent.agent_id


async def test_an_unknown_peer_is_a_format_error(wired: tuple[Mounted, str]) -> None:
    m, agent_id = wired
    mm = m.moves
    async with trio.open_nursery() as nursery:
        await nursery.start(mm.serve)
        with pytest.raises(FormatError, match="not a known peer.*peers: dead"):
            await mm.move(agent_id, "nobody")
        nursery.cancel_scope.cancel()


async def test_a_dead_peer_rolls_back_with_connection_refused(wired: tuple[Mounted, str], state_dir: Path) -> None:
    m, agent_id = wired
    mm = m.moves
    async with trio.open_nursery() as nursery:
        await nursery.start(mm.serve)
        with pytest.raises(le.MoveFailed, match="rolled_back") as failed:
            await mm.move(agent_id, "dead")
        assert failed.value.cause is Cause.CONNECTION_REFUSED
        nursery.cancel_scope.cancel()
    assert HolderBook(state_dir / "holders").get(agent_id).state is HolderState.HELD
    move = m.view.agent(agent_id).status()["move"]
    assert (move["outcome"], move["cause"]) == ("rolled_back", "connection-refused")
    assert m.view.state(agent_id).value == "active"  # resumed


async def test_a_move_long_after_start_runs_without_a_listener(wired: tuple[Mounted, str]) -> None:
    """The service's nursery stays open once the start-up resume is done, so a
    daemon mounted without --listen can still move agents out later."""
    m, agent_id = wired
    mm = m.moves
    assert mm.listen is None
    async with trio.open_nursery() as nursery:
        await nursery.start(mm.serve)
        await trio.testing.wait_all_tasks_blocked()  # the start-up resume has finished (the bug: so had the nursery)
        with pytest.raises(le.MoveFailed, match="rolled_back") as failed:
            await mm.move(agent_id, "dead")
        assert failed.value.cause is Cause.CONNECTION_REFUSED
        nursery.cancel_scope.cancel()


@pytest.fixture
async def silent(state_dir: Path, tmp_path: Path) -> AsyncIterator[None]:
    """A peer named "silent" that accepts connections (the kernel does) and never answers."""
    sock = trio.socket.socket()
    await sock.bind(("127.0.0.1", 0))
    sock.listen()
    PeerBook(state_dir).add(Peer(name="silent", address=f"127.0.0.1:{sock.getsockname()[1]}",
                                 host_id=load_or_create_identity(tmp_path / "silent").host_id))
    yield
    sock.close()


async def test_a_second_move_of_a_moving_agent_is_busy(wired: tuple[Mounted, str], silent: None) -> None:
    m, agent_id = wired
    mm = m.moves
    async with trio.open_nursery() as nursery:
        await nursery.start(mm.serve)
        nursery.start_soon(partial(mm.move, agent_id, "silent"))
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(le.MoveBusy, match="already moving to silent"):
            await mm.move(agent_id, "dead")
        assert m.view.agent(agent_id).status()["move"]["target"] == "silent"
        nursery.cancel_scope.cancel()


async def test_removing_a_moving_agent_is_busy_and_waits_for_nothing(wired: tuple[Mounted, str],
                                                                     silent: None) -> None:
    m, agent_id = wired
    mm = m.moves
    async with trio.open_nursery() as nursery:
        await nursery.start(mm.serve)
        nursery.start_soon(partial(mm.move, agent_id, "silent"))
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(le.MoveBusy, match="is moving to silent: removing it now could lose it on both hosts"):
            await m.agents.remove(agent_id)
        nursery.cancel_scope.cancel()
    assert agent_id in m.view.store.agent_ids()


async def test_removing_a_held_agent_forgets_it_everywhere(wired: tuple[Mounted, str], state_dir: Path) -> None:
    m, agent_id = wired
    mm = m.moves
    live = m.view
    live.snapshots.create(live.agent(agent_id).handle, "before")
    async with trio.open_nursery() as nursery:
        await nursery.start(mm.serve)
        await m.agents.remove(agent_id)
        nursery.cancel_scope.cancel()
    assert live.store.agent_ids() == [] and live.names() == {}
    assert live.snapshots.names(agent_id) == []
    with pytest.raises(NotFoundError, match="removed"):
        live.check_writable(agent_id)  # a handle still open on it writes nothing
    make_agent(live.store, "alice")  # the same id in the store again (an import): a new agent, shown,
    # as its record says: in doubt (another host may have imported the same export and taken it meanwhile)
    assert live.state(agent_id).value == "frozen" and live.names() == {"alice": agent_id}
    assert m.agents.record_status(agent_id)["state"] == "unknown"


async def test_an_agent_in_doubt_does_not_move(store: HostStore, state_dir: Path, tmp_path: Path) -> None:
    """Held here, but no peer has answered (its one peer is dead): moving it
    to a peer that never saw the holder's copy could fork it (docs/move.md)."""
    agent = make_agent(store, "alice")
    other = load_or_create_identity(tmp_path / "other").host_id
    PeerBook(state_dir).add(Peer(name="dead", address=f"127.0.0.1:{closed_port()}", host_id=other))
    m = compose(MountConfig(state_dir=str(state_dir), mountpoint=str(tmp_path / "mnt"), run_agents=False,
                            retry_pause=0.01))
    mm = m.moves
    assert m.agents.state(agent.agent_id) is AgentState.FROZEN  # read-only from the first request
    async with trio.open_nursery() as nursery:
        await nursery.start(mm.serve)
        with pytest.raises(le.MoveFailed, match="in doubt"):
            await mm.move(agent.agent_id, "dead")
        nursery.cancel_scope.cancel()
