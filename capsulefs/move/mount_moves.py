"""Moves in the mount daemon: ``.control/move``, ``.control/abandon``, serving peers.

Rules:
  * One :class:`MountMoves` per daemon; it is the daemon's only move driver
    for its state directory (``capsulefs move`` goes through the mount while
    the daemon runs, see ``cli/move_cmds.py``), so two drivers never share
    holder records.
  * Every move runs as a task in this service's nursery (owned by the
    daemon's nursery). A ``.control/move`` write only waits for its outcome:
    it blocks its writer, never the FUSE loop.
  * A move of an agent that is already moving (by a write, or resumed after
    a restart) is refused with MoveBusy; it never queues.
  * A failed move raises ``core.view.errors.MoveFailed`` carrying its
    :class:`~capsulefs.core.move.cause.Cause`; ``mount/errors.py`` maps the
    cause to an errno (MOVE_ERRNO), in one table.
  * ``.control/status`` "move" shows phase, blobs and bytes while a move runs,
    and its outcome in words once it ended.
  * It is the daemon's move guard: removing an agent (``daemon.agents.Agents.remove``)
    holds the agent's move lock and is refused at once while this service
    runs a move of it, so a removal and a move never overlap.

In the fleet mode (a :class:`~capsulefs.move.fleet.Fleet` in the constructor)
the moves go through the directory (capsulefs/move/fleet.py) and an agent made
through the mount is claimed in it at once.

Its test seams (a crash at a chosen holder state, a shorter call timeout) are
in capsulefs/testing/seams.py; the composition root installs them.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import trio

from capsulefs.core import metrics
from capsulefs.core.move.cause import Cause
from capsulefs.core.view import errors as le
from capsulefs.core.errors import CapsuleError, FormatError, NotFoundError
from capsulefs.core.store.holder import HolderState
from capsulefs.core.store.story import story
from capsulefs.move.doubt import abandon_move, learn_holder
from capsulefs.move.fleet import Fleet
from capsulefs.move.outcome import MoveControl, MoveResult
from capsulefs.move.source import move_agent, resume_moves
from capsulefs.move.host import AgentHooks, MoveHost, record_new_agent
from capsulefs.core.view.control import TierCache
from capsulefs.core.view.nodes import AgentState
from capsulefs.core.store.lifecycle import Standing
from capsulefs.move.standing import Standings
from capsulefs.move.target import FLEET_GATE_AFTER, MoveService, serve_moves
from capsulefs.move.warm import TierFetch
from capsulefs.peer.errors import PeerError
from capsulefs.peer.book import Peer
from capsulefs.peer.finder import PeerLookupFailed, UnknownPeer

log = logging.getLogger(__name__)

__all__ = ["MountMoves"]

@dataclass
class _Running:
    control: MoveControl
    target: str


class MoveAgents(AgentHooks, Protocol):
    """What the mount's moves need of the daemon's agents (capsulefs/daemon/agents.py)."""

    def set_move_progress(self, agent_id: str, progress: dict[str, object] | None) -> None: ...

    def state(self, agent_id: str) -> AgentState: ...


class MountMoves:
    """The daemon's move wiring: a service (``serve``), the mount's Mover,
    the daemon's move guard (``still``), and who records an agent made
    through the mount (``created``)."""

    def __init__(self, host: MoveHost, agents: MoveAgents, *, listen: tuple[str, int] | None = None,
                 call_timeout: float = 120.0, retry_pause: float = 1.0, fleet: Fleet | None = None,
                 tier: TierFetch | None = None, tier_cache: TierCache | None = None,
                 gate_after: float = FLEET_GATE_AFTER) -> None:
        self.agents = agents
        self.tier_cache = tier_cache  # blobs evicted here, fetched back for a move's source; None: no tier
        self.gate_after = gate_after  # fleet mode: a prepared move idle this long asks the directory
        self.fleet = fleet  # None: peer-to-peer
        self.tier = tier  # a blob tier's fetch for the offers this host receives (fleet mode); None: peer-to-peer
        self.host = host
        self.listen = listen
        self.call_timeout = call_timeout
        self.retry_pause = retry_pause
        self.port: int | None = None  # bound, once serving
        #: Who else holds what: checked before an agent runs, and while it runs.
        self.standings = Standings(self.host, agents)
        self._running: dict[str, _Running] = {}
        self._timers: dict[str, metrics.PhaseTimer] = {}  # each move's phases, for the metrics
        self._nursery: trio.Nursery | None = None

    def created(self, agent_id: str, epoch: int) -> None:
        """An agent was made through the mount (mkdir): this host holds it."""
        record_new_agent(self.host.store.root, agent_id, epoch)
        self.standings.created(agent_id)
        if self.fleet is not None and self._nursery is not None:
            self._nursery.start_soon(self._claim, agent_id, epoch)

    async def _claim(self, agent_id: str, epoch: int) -> None:
        """Fleet mode: a new agent is named in the directory now, not at the next new lease."""
        assert self.fleet is not None
        try:
            claimed = await self.fleet.directory.claim(agent_id, epoch)
        except CapsuleError as exc:  # (the next new lease claims it: Agents.lease_regained)
            log.warning("agent %s: could not claim it in the directory: %s", agent_id, exc)
            return
        log.info("agent %s: %s in the directory at epoch %d", agent_id,
                 "claimed" if claimed else "already named", epoch)

    def runtime_info(self) -> dict[str, object]:
        """For the daemon's runtime file: the port peers' moves reach (None: none)."""
        return {"move_port": self.port}

    # -- the service -----------------------------------------------------------------
    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            if self.listen is not None:
                serving = await nursery.start(partial(serve_moves, self.host, listen_host=self.listen[0],
                                                      port=self.listen[1], wrap=self.standings.around,
                                                      fleet=self.fleet, tier=self.tier,
                                                      gate_after=self.gate_after))
                self.port = serving.port
                log.info("serving moves on %s:%d as %s", self.listen[0], self.port, self.host.me)
            else:
                # refuse pending moves a crash left, as serve_moves does
                await MoveService(self.host, fleet=self.fleet).recover()
            # The moves in doubt are registered before any new move may start
            # (move() refuses until _nursery is set), so none can take their place.
            pending = self._in_doubt()
            self._nursery = nursery
            nursery.start_soon(self._resume, pending)
            task_status.started()
            # Moves started later (.control/move) run in this nursery: keep it
            # open until the daemon cancels it, with or without a listener.
            await trio.sleep_forever()

    def _in_doubt(self) -> dict[str, "_Running"]:
        """Register every move a crash left (FROZEN or COMMITTING here)."""
        pending = {}
        for agent_id in self.host.holders.agent_ids():
            rec = self.host.holders.get(agent_id)
            if rec is None or rec.state not in (HolderState.FROZEN, HolderState.COMMITTING):
                continue
            # (fleet mode: the target is named by its host id; peers.json is not read)
            peer = self.host.peers.by_id(rec.peer) if rec.peer and self.fleet is None else None
            name = peer.name if peer else rec.peer or "?"
            pending[agent_id] = self._running[agent_id] = _Running(self._control(agent_id, name), name)
        return pending

    async def _resume(self, pending: dict[str, "_Running"]) -> None:
        try:
            # Only the moves in doubt at start: one begun since has its own driver.
            results = await resume_moves(self.host, call_timeout=self.call_timeout, retry_pause=self.retry_pause,
                                         control_for=lambda a: pending[a].control, agent_ids=list(pending),
                                         fleet=self.fleet)
        finally:
            for agent_id, running in pending.items():
                if self._running.get(agent_id) is running:
                    del self._running[agent_id]
        for r in results:
            log.info("resumed move of %s: %s (%s)", r.agent_id, r.state.value, r.reason)
            self._report(r.agent_id, r)

    # -- progress ----------------------------------------------------------------------
    def _set(self, agent_id: str, progress: dict[str, object]) -> None:
        try:
            self.agents.set_move_progress(agent_id, progress)
        except NotFoundError:
            pass  # retired meanwhile

    def _control(self, agent_id: str, target: str = "", *, phase: str | None = None) -> MoveControl:
        timer = self._timers[agent_id] = metrics.PhaseTimer(metrics.MOVE_PHASE_SECONDS)
        if phase is not None:
            timer.enter(phase)

        def on_progress(phase: str, done: int, total: int, nbytes: int) -> None:
            timer.enter(phase.replace(" ", "_"))
            self._set(agent_id, {"available": True, "phase": phase, "target": target, "blobs_sent": done,
                                 "blobs_total": total, "bytes_sent": nbytes, "outcome": None})

        return MoveControl(on_progress=on_progress)

    def _report(self, agent_id: str, r: MoveResult) -> None:
        self._ended(agent_id, r.state.value, r.cause.value)
        metrics.MOVE_BYTES.inc("sent", by=r.bytes_sent)
        self._set(agent_id, {"available": True, "phase": "idle", "target": r.target, "blobs_sent": r.contents_sent,
                             "bytes_sent": r.bytes_sent, "outcome": r.state.value, "cause": r.cause.value,
                             "epoch": r.epoch, "detail": r.reason})

    def _ended(self, agent_id: str, outcome: str, cause: str) -> None:
        timer = self._timers.pop(agent_id, None)
        if timer is not None:
            timer.end()
        metrics.MOVES.inc(outcome, cause)

    # -- the daemon's move guard ------------------------------------------------------
    @asynccontextmanager
    async def still(self, agent_id: str) -> AsyncIterator[None]:
        """Hold the agent's move lock: no move of it starts meanwhile. MoveBusy
        at once if this service runs one (it holds the lock for the whole move)."""
        self._refuse_running(agent_id)
        async with self.host.lock(agent_id):
            self._refuse_running(agent_id)
            yield

    def _refuse_running(self, agent_id: str) -> None:
        running = self._running.get(agent_id)
        if running is not None:
            raise le.MoveBusy(f"agent {agent_id} is moving to {running.target}: removing it now could lose it "
                              f"on both hosts; let the move end, or abandon it, then remove it")

    # -- the mount's Mover ------------------------------------------------------------
    async def _peer(self, target: str) -> Peer:
        """The target named (a pinned peer, or a live host in the directory: the host's finder)."""
        try:
            return await self.host.peer_finder.find(target)
        except UnknownPeer as exc:
            raise FormatError(f".control/move: {exc}") from None
        except PeerLookupFailed as exc:
            raise le.MoveFailed(Cause.UNREACHABLE, f".control/move: {target!r}: {exc}") from None

    async def move(self, agent_id: str, target: str) -> None:
        peer = await self._peer(target)
        if agent_id in self._running:
            raise le.MoveBusy(f"agent {agent_id} is already moving to {self._running[agent_id].target}")
        if self._nursery is None:
            raise le.MoveBusy("the move service is not started yet")
        rec = self.host.holders.get(agent_id)
        if rec is None or not rec.runnable:
            state = "no holder record" if rec is None else f"{rec.state.value} at epoch {rec.epoch}"
            raise le.MoveFailed(Cause.REFUSED, f"agent {agent_id} is not held here ({state}): it cannot move")
        standing = self.standings.decision(agent_id).standing
        if standing is not Standing.HOLDING:
            # (moving a copy in doubt could fork it: the peer it goes to may never have seen the holder's)
            raise le.MoveFailed(Cause.REFUSED, f"agent {agent_id} is {standing.value} here: it cannot move until a "
                                f"peer has said that no host holds a higher epoch (see its .control/status)")
        control = self._control(agent_id, peer.name, phase="freezing")
        self._running[agent_id] = _Running(control, peer.name)
        self._set(agent_id, {"available": True, "phase": "freezing", "target": peer.name, "blobs_sent": 0,
                             "bytes_sent": 0, "outcome": None})
        done = trio.Event()
        box: list[MoveResult | BaseException] = []

        async def run() -> None:
            try:
                box.append(await move_agent(self.host, agent_id, peer, call_timeout=self.call_timeout,
                                            retry_pause=self.retry_pause, control=control, fleet=self.fleet,
                                            warm=self.tier is not None, tier_cache=self.tier_cache))
            except (PeerError, CapsuleError, OSError) as exc:  # could not start, or failed outside the machine
                log.warning("move of %s to %s failed: %s", agent_id, peer.name, exc)
                box.append(exc)
            finally:
                self._running.pop(agent_id, None)
                done.set()

        log.info("moving %s to %s (%s)", agent_id, peer.name, peer.host_id)
        self._nursery.start_soon(run)
        await done.wait()
        outcome = box[0]
        if isinstance(outcome, BaseException):
            self._ended(agent_id, "failed", Cause.REFUSED.value)
            self._set(agent_id, {"available": True, "phase": "idle", "target": peer.name, "outcome": "failed",
                                 "detail": str(outcome)})
            raise le.MoveFailed(Cause.REFUSED, f"the move of {agent_id} to {peer.name} did not start: {outcome}")
        self._report(agent_id, outcome)
        if outcome.moved:
            log.info("moved %s to %s at epoch %d", agent_id, peer.name, outcome.epoch)
            return
        raise le.MoveFailed(outcome.cause, f"the move of {agent_id} to {peer.name} ended {outcome.state.value} "
                                           f"({outcome.cause.value}: {outcome.cause.meaning}): {outcome.reason}")

    async def learn(self, agent_id: str) -> None:
        """``.control/learn`` (and ``capsulefs move AGENT --learn`` beside a
        daemon): ask every peer who holds an agent in doubt here. Returns once
        this host holds it (resumed) or gave it up (its copy kept under
        recovery/, then retired and removed, as ``learn_holder`` does);
        PeerUnreachable if not every peer answered (still in doubt)."""
        if agent_id in self._running:
            raise le.MoveBusy(f"agent {agent_id} is moving to {self._running[agent_id].target}")
        rec = self.host.holders.get(agent_id)
        name = self.host.store.agent(agent_id).name
        if rec is None or rec.state is not HolderState.UNKNOWN:
            state = "no holder record" if rec is None else rec.state.value
            raise le.NotPermitted(f"agent {name} is not in doubt here ({state}): nothing to learn")
        try:
            new = await learn_holder(self.host, agent_id, call_timeout=self.call_timeout)
        except (PeerError, OSError) as exc:
            raise le.MoveFailed(Cause.UNREACHABLE, f"learning who holds {name} failed: {exc}") from exc
        except CapsuleError as exc:  # (a copy that could not be kept: nothing was dropped)
            raise le.MoveFailed(Cause.REFUSED, f"learning who holds {name} stopped: {exc}") from exc
        log.warning("agent %s (%s): learned: %s", name, agent_id, story(new, name).line())
        if new.state is HolderState.UNKNOWN:
            raise le.MoveFailed(Cause.UNREACHABLE, f"agent {name}: not every peer answered: {story(new, name).line()}")

    async def abandon(self, agent_id: str, why: str) -> None:
        running = self._running.get(agent_id)
        risk = "if the target did activate it, two hosts now run it: check the target"
        if running is not None:
            log.warning("agent %s: the operator abandons the move to %s (%s); %s", agent_id, running.target, why, risk)
            running.control.abandon(why)
            return
        rec = self.host.holders.get(agent_id)
        if rec is None or rec.state not in (HolderState.FROZEN, HolderState.COMMITTING):
            raise le.NotPermitted(f"agent {agent_id} has no move in progress here: nothing to abandon")
        async with self.host.lock(agent_id):
            new = abandon_move(self.host.holders, agent_id, me=self.host.me, why=why)
        log.warning("agent %s: move abandoned by the operator (%s), held again at epoch %d; %s",
                    agent_id, why, new.held_epoch, risk)
        if self.fleet is not None and not await self._named(agent_id, new.held_epoch or 0):
            return
        await self.agents.resume(agent_id)

    async def _named(self, agent_id: str, epoch: int) -> bool:
        """Fleet mode: may the agent run here again (the directory names this host at ``epoch``)?"""
        assert self.fleet is not None
        try:
            if await self.fleet.directory.confirm(agent_id, epoch):
                return True
            why = f"the directory does not name this host at epoch {epoch}"
        except CapsuleError as exc:
            why = f"the directory did not answer: {exc}"
        log.warning("agent %s: %s: it stays frozen here (until the next new lease asks again)", agent_id, why)
        return False
