"""A peer's ``fence`` call in the fleet mode (capsulefs/move/target.py): a
move prepared on this host is decided by the directory's gate, never by the
peer's word. The directory is a fake at the seam capsulefs/move/fleet.py
names (``MoveDirectory``); the move service, its store and its holder
records are real (and, for a move the directory names this host for, a
real move between two hosts stopped at prepared)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
from helpers import HANG

from capsulefs.core import move as mv
from capsulefs.core.fleet.errors import DirectoryUnreachable
from capsulefs.core.store.holder import HolderRecord, HolderState
from capsulefs.move.fleet import Fleet
from capsulefs.move.host import MoveHost
from capsulefs.move.target import MoveService
from capsulefs.peer.book import Peer
from capsulefs.peer.errors import CallFailed

from test_move_driver import Fault, Hooks, World
from test_move_driver import world as world  # (the fixture: a real move between two hosts)

AGENT = "ab" * 16


@dataclass
class Directory:
    """The gate's answer (an Outcome, or None: the directory does not answer); every question asked."""

    answer: mv.Outcome | None
    asked: list[tuple[str, int, str]] = field(default_factory=list)

    async def gate(self, agent_id: str, epoch: int, source: str) -> mv.Outcome:
        self.asked.append((agent_id, epoch, source))
        if self.answer is None:
            raise DirectoryUnreachable("connection refused (test)")
        return self.answer

    def __getattr__(self, name: str) -> Any:  # (a fence asks nothing else of the directory)
        raise AssertionError(f"the fence asked the directory's {name}")


class Lease:
    def may_run(self) -> bool:
        return True

    async def wait_alive(self) -> None:
        return None


def prepared_target(tmp_path: Path, directory: Directory | None) -> tuple[MoveService, MoveHost, str]:
    """A target with a move of AGENT at epoch 2 prepared from another host (the source's id)."""
    source = MoveHost.open(tmp_path / "a", Hooks("a")).me
    b = MoveHost.open(tmp_path / "b", Hooks("b"))
    b.holders.put(HolderRecord(agent_id=AGENT, state=HolderState.PREPARED, epoch=2, peer=source))
    fleet = None if directory is None else Fleet(directory, Lease())  # type: ignore[arg-type]
    return MoveService(b, fleet=fleet), b, source


async def fence(service: MoveService, asker: str) -> dict[str, Any]:
    result, _ = await service(Peer(name="c", address="127.0.0.1:1", host_id=asker), "fence",
                              {"agent_id": AGENT}, None)  # type: ignore[arg-type]  # (a fence reads no payload)
    return result


async def test_a_prepared_move_stays_prepared_while_the_directory_does_not_answer(tmp_path: Path) -> None:
    directory = Directory(answer=None)
    service, b, source = prepared_target(tmp_path, directory)
    with pytest.raises(CallFailed, match="directory has not decided it yet"):
        await fence(service, source)
    assert directory.asked == [(AGENT, 2, source)]
    rec = b.holders.get(AGENT)
    assert rec is not None and rec.state is HolderState.PREPARED and rec.epoch == 2


async def test_a_prepared_move_the_directory_refuses_is_refused_then_the_fence_answers(tmp_path: Path) -> None:
    directory = Directory(answer=mv.Outcome.NEVER)
    service, b, source = prepared_target(tmp_path, directory)
    result = await fence(service, source)
    assert directory.asked == [(AGENT, 2, source)]
    rec = b.holders.get(AGENT)
    assert rec is not None and rec.state is HolderState.REFUSED and rec.epoch == 2
    assert result["state"] == "refused" and result["epoch"] == 2 and result["host"] == b.me, result


async def test_peer_to_peer_the_fence_refuses_a_prepared_move_as_before(tmp_path: Path) -> None:
    service, b, source = prepared_target(tmp_path, None)
    await fence(service, source)
    rec = b.holders.get(AGENT)
    assert rec is not None and rec.state is HolderState.REFUSED


async def test_a_prepared_move_the_directory_names_this_host_for_is_activated_then_the_fence_answers(
        world: World) -> None:  # noqa: F811  (the fixture imported above)
    # A real move stops at prepared: every activate and status of the source is lost on its way.
    world.target.faults = [Fault("activate", "before", times=10**6), Fault("status", "before", times=10**6)]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(world.move, retry_pause=0.01))
        with trio.fail_after(HANG):
            while (rec := world.b.holders.get(world.agent_id)) is None or rec.state is not HolderState.PREPARED:
                await trio.sleep(0.01)
            while "status:before" not in world.target.fired:
                await trio.sleep(0.01)
        # (the target is in the fleet mode from now on; the directory names it at the move's epoch)
        directory = Directory(answer=mv.Outcome.ACTIVE)
        world.service_b.fleet = Fleet(directory, Lease())  # type: ignore[arg-type]
        result, _ = await world.service_b(Peer(name="c", address="127.0.0.1:1", host_id=world.a.me), "fence",
                                          {"agent_id": world.agent_id}, None)  # type: ignore[arg-type]
        nursery.cancel_scope.cancel()  # (the source, still asking)
    assert directory.asked == [(world.agent_id, 2, world.a.me)]
    assert result["state"] == "held" and result["held_epoch"] == 2, result
    assert world.agent_id in world.hooks_b.running
