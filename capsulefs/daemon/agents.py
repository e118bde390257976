"""The one owner of an agent's lifecycle on this host, in the daemon.

Rules:
  * What the mount shows of an agent and whether it may run are derived
    here, from one place: core/store/lifecycle.py's table (its holder record
    and what this host learned of who else holds it: ``Standing.decision``)
    and one fact of this daemon's own, that a move or a doubt holds the agent
    still (:meth:`Agents.freeze` until resume, retire, activate or remove).
    docs/mount.md, "An agent's lifecycle in the daemon", is the table.
  * The move driver (capsulefs/move) and the standings call the hooks
    (``freeze``, ``resume``, ``retire``, ``prepare``, ``activate``); the
    mount calls :meth:`Agents.remove` (``.control/remove``). Each hook
    changes the view, then tells the agents' processes (the runtime) to
    follow, except ``freeze``, which stops the process first: its last
    work is committed while the mount still takes its writes.
  * The runtime runs an agent only when :meth:`Agents.may_run` says so; it
    keeps its process-level states (starting, running, backing off) itself.
  * In the fleet mode (``mount --directory``) this is the host lease
    keeper's listener too (through root.py's upcalls): while the host has no
    live lease every agent is held still (read-only, not run; the view's
    write guard asks the keeper before every write, so a daemon paused past
    its lease's deadline takes no write once it resumes), and after a
    new lease each runs again only once the directory names this host at
    the epoch it holds (:meth:`Agents.lease_regained`); an agent this host
    holds that arrives while the host has a lease (``capsulefs import``) runs
    only once the directory names this host too (claimed first if it has no
    entry: :meth:`Agents.confirm_arrivals`), asked again with a doubling
    pause while the directory does not answer, and never again once it named
    another holder; ``.control/status`` shows where each stands ("record",
    "directory"). docs/fleet.md.

Theory of operation: one object, built by the composition root
(capsulefs/daemon/root.py) with its collaborators typed by the Protocols
below; all of it runs on the daemon's trio loop.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager
from typing import Protocol

import trio

from capsulefs.agents.removal import discard_leftovers, giving_up, refuse_if_moving
from capsulefs.core import metrics
from capsulefs.core.errors import CapsuleError
from capsulefs.core.fleet.directory import AgentEntry, EntryState
from capsulefs.core.store.holder import HolderBook, HolderState
from capsulefs.daemon.arrivals import ARRIVAL_QUESTIONS, ARRIVAL_RETRY_FIRST, ARRIVAL_RETRY_MAX, Arrival, one_line
from capsulefs.core.store.story import story
from capsulefs.core.store.lifecycle import Decision, runs, shown
from capsulefs.core.view.errors import ReadOnly
from capsulefs.core.view.host import LiveHost
from capsulefs.core.view.nodes import AgentState

log = logging.getLogger(__name__)

__all__ = ["AgentProcesses", "Agents", "Directory", "LeaseView", "MoveGuard", "RootEntries", "Standing"]


class Standing(Protocol):
    """Where each agent stands (capsulefs/move/standing.py's Standings)."""

    def decision(self, agent_id: str) -> Decision: ...

    def detail(self, agent_id: str, name: str) -> str | None: ...


class AgentProcesses(Protocol):
    """The agents' processes (capsulefs/agents/runtime.py), told to follow
    each change: ``on_freeze`` runs before the mount refuses writes (so the
    agent's last work can be committed); the others after the mount changed
    (``on_remove``: once the agent is hidden, before its files go)."""

    async def on_freeze(self, agent_id: str) -> None: ...

    async def on_resume(self, agent_id: str) -> None: ...

    async def on_retire(self, agent_id: str) -> None: ...

    async def on_activate(self, agent_id: str) -> None: ...

    async def on_remove(self, agent_id: str) -> None: ...

    async def on_fence(self, agent_id: str) -> None:
        """Stop the agent's process now, without committing its workspace
        (the host lost its fleet lease: its capsule takes no write), well
        within the lease's stop window."""


class Directory(Protocol):
    """The fleet's holder authority (capsulefs/fleet/authority.py's DirectoryAuthority)."""

    @property
    def batch(self) -> int:
        """The most agents one :meth:`confirm_batch` reads."""
        ...

    async def claim(self, agent_id: str, epoch: int) -> bool: ...

    async def confirm_batch(self, held: Mapping[str, int]) -> dict[str, bool | None]:
        """For each agent (id -> epoch held): named at it (True), not (False),
        no entry (None); one round trip, under a live lease."""
        ...

    async def entry(self, agent_id: str) -> AgentEntry | None:
        """The agent's entry as the directory has it (a read that lets nothing run: to say who it names)."""
        ...


class LeaseView(Protocol):
    """Whether the host's lease lets it run agents now (the lease keeper)."""

    def may_run(self) -> bool: ...

    async def renew_if_due(self) -> None:
        """A keepalive now if one is due (a long task in the keeper's loop
        holds its keepalives up otherwise); may stop the host."""


class MoveGuard(Protocol):
    def still(self, agent_id: str) -> AbstractAsyncContextManager[None]:
        """An async context in which no move of the agent runs or starts;
        MoveBusy at once if one runs (capsulefs/move/mount_moves.py)."""
        ...


class RootEntries(Protocol):
    def changed(self, name: str) -> None:
        """The root's entry ``name`` appeared or vanished (the kernel may cache it)."""


class Agents:
    """Every agent's lifecycle on this host (see the module's rules)."""

    def __init__(self, view: LiveHost, holders: HolderBook, *, state_dir: str, work_dir: str, standing: Standing,
                 guard: MoveGuard, entries: RootEntries, processes: AgentProcesses | None) -> None:
        self.view = view
        self.holders = holders
        self.state_dir = state_dir
        self.work_dir = work_dir
        self.standing = standing
        self.guard = guard
        self.entries = entries
        self.processes = processes  # None: `mount --no-run`
        #: Agents a move (or a doubt found while it ran) holds still: read-only, not run.
        self._still: set[str] = set()
        #: Fleet mode: why no agent may run (the host has no live lease), None while it has one.
        self._lease_why: str | None = None
        #: Fleet mode: agents the directory did not confirm after the last new lease, and why.
        self._unconfirmed: dict[str, str] = {}
        #: Fleet mode (from :meth:`lease_pending`): the held agents that arrived, for :meth:`confirm_arrivals`.
        self._arrivals: trio.MemorySendChannel[tuple[str, Arrival]] | None = None
        self._arrivals_in: trio.MemoryReceiveChannel[tuple[str, Arrival]] | None = None
        #: Fleet mode: the arrivals asked about since the last new lease, and where each stands.
        self._arriving: dict[str, Arrival] = {}
        #: Fleet mode: held agents that arrived while the host had no lease (the next new lease asks about them).
        self._arrived_unleased: set[str] = set()
        #: Agents made through the mount not yet shown (claimed at creation: capsulefs/move/mount_moves.py).
        self._made: set[str] = set()

    def _held(self, agent_id: str) -> bool:
        """Held still: by a move, by the host's lost lease, or by the directory."""
        return agent_id in self._still or self._lease_why is not None or agent_id in self._unconfirmed

    # -- deriving ------------------------------------------------------------------
    def decision(self, agent_id: str) -> Decision:
        return self.standing.decision(agent_id)

    def show_all(self) -> None:
        """Before the mount serves: show each agent of the store as the
        lifecycle decides (an agent a crash left retired here is not shown;
        one left in a move, in doubt, or without a record, is read-only
        until settled)."""
        for agent_id in self.view.store.agent_ids():
            self.view.set_state(agent_id, shown(self.decision(agent_id), still=self._held(agent_id)))

    def arrived(self, agent_id: str) -> AgentState | None:
        """How to show an agent that appeared in the store while the mount
        serves (``capsulefs import``; core/view/control.py's Arrivals): as
        :meth:`show_all` would, from its holder record now; None while it
        has none yet (an import writes it right after the files)."""
        rec = self.holders.get(agent_id)
        if rec is None:
            return None
        if agent_id in self._made:  # (made through the mount, not arrived: claimed at creation)
            self._made.discard(agent_id)
        elif rec.state is HolderState.HELD and self._lease_why is None:
            self._await_directory(agent_id, rec.held_epoch if rec.held_epoch is not None else rec.epoch)
        elif rec.state is HolderState.HELD and self._arrivals is not None:
            self._arrived_unleased.add(agent_id)  # (the next new lease asks about it with the others)
        return shown(self.decision(agent_id), still=self._held(agent_id))

    def made(self, agent_id: str) -> None:
        """An agent was made through the mount (``mkdir``): not an arrival
        (the moves claim it in the directory at creation)."""
        self._made.add(agent_id)

    def _await_directory(self, agent_id: str, epoch: int) -> None:
        """Fleet mode: a held agent that arrived under a live lease is held
        still until the directory names this host at ``epoch`` (asked by
        :meth:`confirm_arrivals`)."""
        if self._arrivals is None or agent_id in self._unconfirmed:
            return
        self._unconfirmed[agent_id] = (f"fleet: waiting for the directory to name this host at epoch {epoch} "
                                       f"(the agent arrived while the daemon served)")
        arrival = self._arriving[agent_id] = Arrival(epoch)
        self._count_arrivals()
        self._arrivals.send_nowait((agent_id, arrival))

    async def confirm_arrivals(self, directory: Directory, lease: LeaseView, *,
                               retry_pause: float = ARRIVAL_RETRY_FIRST, max_retry_pause: float = ARRIVAL_RETRY_MAX,
                               task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Fleet mode, a service of the daemon: each held agent that arrived
        while the host has a lease is claimed at its epoch if the directory
        has no entry for it, then runs only once the directory names this host
        at that epoch (as :meth:`lease_regained` does for the agents present
        at a new lease); until then it is read-only and stopped. A directory
        that does not answer is asked again after ``retry_pause`` seconds,
        doubled after each unanswered question up to ``max_retry_pause``;
        an answer that names another holder (or epoch) is final: it stays
        read-only and stopped, saying who the directory names. Each arrival
        is asked about in a task of its own (one that waits holds up none),
        at most ARRIVAL_QUESTIONS questions at once."""
        assert self._arrivals_in is not None  # (lease_pending made it: the fleet mode)
        task_status.started()
        limit = trio.CapacityLimiter(ARRIVAL_QUESTIONS)
        async with trio.open_nursery() as nursery, self._arrivals_in:
            async for agent_id, arrival in self._arrivals_in:
                nursery.start_soon(self._confirm_arrival, directory, lease, agent_id, arrival, retry_pause,
                                   max_retry_pause, limit)

    def _asking(self, agent_id: str, arrival: Arrival) -> bool:
        """Does this question still count? Not once a new lease asked about
        every agent (it decided this one too, or asks it again), nor while
        the host has no lease (the next lease's confirmation decides)."""
        if self._arriving.get(agent_id) is arrival and self._lease_why is None:
            return True
        if self._arriving.get(agent_id) is arrival:
            del self._arriving[agent_id]
            self._count_arrivals()
        return False

    async def _confirm_arrival(self, directory: Directory, lease: LeaseView, agent_id: str, arrival: Arrival,
                               retry_pause: float, max_retry_pause: float, limit: trio.CapacityLimiter) -> None:
        epoch, pause = arrival.epoch, retry_pause
        while True:
            if not self._asking(agent_id, arrival):
                return
            if agent_id not in self.view.store.agent_ids():  # (removed meanwhile: nothing to ask about)
                self._unconfirmed.pop(agent_id, None)
                del self._arriving[agent_id]
                self._count_arrivals()
                return
            arrival.tries += 1
            try:
                async with limit:
                    named = (await directory.confirm_batch({agent_id: epoch})).get(agent_id)
                    if named is None and await directory.claim(agent_id, epoch):
                        named = (await directory.confirm_batch({agent_id: epoch})).get(agent_id)
            except CapsuleError as exc:
                if not self._asking(agent_id, arrival):
                    return
                arrival.state, arrival.last_error, arrival.pause = "retrying", one_line(exc), pause
                arrival.retry_at = time.monotonic() + pause
                self._unconfirmed[agent_id] = (f"fleet: the directory did not answer about it ({arrival.tries} "
                                               f"tries; asking again in {pause:g}s): {arrival.last_error}")
                self._count_arrivals()
                log.warning("agent %s (arrived) waits: %s", agent_id, self._unconfirmed[agent_id])
                await trio.sleep(pause)
                pause = min(max_retry_pause, pause * 2)
                continue
            break
        if not self._asking(agent_id, arrival) or not lease.may_run():
            return  # (the answer no longer counts)
        if not named:
            why = await self._refused(directory, agent_id, epoch)
            if not self._asking(agent_id, arrival):
                return
            arrival.state, arrival.pause, arrival.retry_at = "refused", None, None
            self._unconfirmed[agent_id] = why
            self._count_arrivals()
            log.warning("agent %s (arrived) stays stopped: %s", agent_id, why)
            return
        del self._unconfirmed[agent_id], self._arriving[agent_id]
        self._count_arrivals()
        log.info("agent %s (arrived): the directory names this host at epoch %d", agent_id, epoch)
        if agent_id in self.view.store.agent_ids() and self.view.state(agent_id) is AgentState.FROZEN and \
                shown(self.decision(agent_id), still=self._held(agent_id)) is AgentState.ACTIVE:
            self.view.resume(agent_id)
            if self.processes is not None:
                await self.processes.on_resume(agent_id)

    @staticmethod
    async def _refused(directory: Directory, agent_id: str, epoch: int) -> str:
        """Why an arrival the directory does not name stays stopped, one line
        (naming whom it names, if a read of its entry says)."""
        why = f"fleet: the directory does not name this host at epoch {epoch}"
        try:
            entry = await directory.entry(agent_id)
        except CapsuleError as exc:
            log.info("agent %s: its directory entry could not be read to say who holds it: %s", agent_id, exc)
            return why
        if entry is None:
            return why
        removed = " as removed" if entry.state is EntryState.REMOVED else ""
        return f"{why}: it names host {entry.host_id} at epoch {entry.epoch}{removed}; it stays stopped here"

    def _count_arrivals(self) -> None:
        """The arrivals' gauge (core/metrics.py: FLEET_ARRIVALS), by where each stands."""
        counts: dict[tuple[str, ...], float] = {("asking",): 0, ("retrying",): 0, ("refused",): 0}
        for arrival in self._arriving.values():
            counts[(arrival.state,)] = counts.get((arrival.state,), 0) + 1
        metrics.FLEET_ARRIVALS.replace(counts)

    def _as_decided(self, agent_id: str) -> None:
        """After the mount showed an agent writable (a resume, an activate):
        read-only again if the lifecycle says so (in doubt)."""
        if shown(self.decision(agent_id), still=self._held(agent_id)) is AgentState.FROZEN:
            self.view.freeze(agent_id)

    def may_run(self, agent_id: str) -> tuple[bool, str]:
        """Whether the agent's process may run here (the lifecycle's
        decision, while the mount shows it active), and if not, why in words."""
        decision = self.decision(agent_id)
        if runs(decision, still=self._held(agent_id)) and self.view.state(agent_id) is AgentState.ACTIVE:
            return True, ""
        if self._lease_why is not None:
            return False, self._lease_why
        if agent_id in self._unconfirmed:
            return False, self._unconfirmed[agent_id]
        rec = self.holders.get(agent_id)
        if rec is not None and rec.state is HolderState.UNKNOWN:  # (frozen as well: say the real reason)
            return False, story(rec, self.view.agent(agent_id).stored_manifest().name).line()
        if rec is not None and rec.state is HolderState.HELD and not decision.run:
            return False, (f"{decision.standing.value}: no peer has said yet that it holds no higher epoch "
                           f"(see the record section)")
        if agent_id in self._still:
            return False, "frozen for a move"
        if self.view.state(agent_id) is not AgentState.ACTIVE:
            return False, f"the mount shows it {self.view.state(agent_id).value}"
        if rec is None:
            return False, ("this host has no holder record for it: it runs only after a move or "
                           "'capsulefs move --force-hold' (the daemon stopped)")
        return False, f"its holder record here says {rec.state.value} at epoch {rec.epoch}"

    def record_status(self, agent_id: str) -> dict[str, object]:
        """The ``record`` section of ``.control/status``: what this host's
        holder record says (state, epoch) and the agent's one story
        (``story.story``: the words import, ls and the log use too)."""
        record = self.holders.get(agent_id)
        name = self.view.agent(agent_id).stored_manifest().name
        told = story(record, name)
        out: dict[str, object] = {"state": None if record is None else record.state.value,
                                  "epoch": None if record is None else record.epoch,
                                  "story": told.as_json(), "detail": told.line()}
        if record is not None and record.state is HolderState.HELD:
            out["standing"] = self.decision(agent_id).standing.value
            detail = self.standing.detail(agent_id, name)
            if detail is not None:
                out["detail"] = detail
        arrival = self._arriving.get(agent_id)
        if arrival is not None:  # (fleet mode: an arrival the directory has not confirmed)
            out["directory"] = arrival.status(self._unconfirmed.get(agent_id, ""))
        return out

    # -- the fleet's host lease (capsulefs.fleet.keeper.LeaseListener, through root.py) ------
    def lease_pending(self, why: str) -> None:
        """Before the mount serves, in the fleet mode: nothing runs until the first lease."""
        self._lease_why = why
        self._arrivals, self._arrivals_in = trio.open_memory_channel[tuple[str, Arrival]](math.inf)

    def lease_lapsed(self, why: str) -> str:
        """The view's write guard found the lease's deadline passed before
        the keeper stopped the host (the daemon was paused past it): every
        shown agent read-only now, synchronously, so no write is acknowledged
        (the keeper's task, runnable since its deadline passed, stops the
        processes next: :meth:`lease_lost`). Returns why no write is taken."""
        if self._lease_why is None:
            self._lease_why = f"fleet lease lost: {why}"
            self._freeze_all()
            log.warning("write refused, every agent read-only: %s", self._lease_why)
        return self._lease_why

    def _freeze_all(self) -> None:
        for agent_id in self.view.store.agent_ids():
            if self.view.state(agent_id) is AgentState.ACTIVE:
                self.view.freeze(agent_id)

    async def lease_lost(self, why: str) -> None:
        """The host may no longer run agents: every shown agent read-only at
        once (a write fails with EROFS), then every process stopped, all at
        once, without a workspace commit. The keeper gives this its stop
        window (docs/fleet.md, the lease timing argument)."""
        self._lease_why = f"fleet lease lost: {why}"
        self._freeze_all()
        log.warning("every agent read-only and stopping: %s", self._lease_why)
        if self.processes is not None:
            processes = self.processes
            async with trio.open_nursery() as nursery:
                for agent_id in self.view.store.agent_ids():
                    nursery.start_soon(processes.on_fence, agent_id)

    async def lease_regained(self, directory: Directory, lease: LeaseView) -> None:
        """A new lease: each agent this host holds runs again only if the
        directory names this host at its epoch (an agent with no entry yet is
        claimed at it first); the others stay read-only and stopped, saying
        why. The agents are read a batch at a time (``directory.batch`` a
        round trip), and the lease is kept alive between requests (this runs
        in the keeper's loop), so thousands of agents never outlast it."""
        held: dict[str, int] = {}
        for agent_id in self.view.store.agent_ids():
            rec = self.holders.get(agent_id)
            if rec is not None and rec.state is HolderState.HELD:  # (else the lifecycle holds it still)
                # (the epoch it holds: after a rolled-back move the record's epoch is the fence above it)
                held[agent_id] = rec.held_epoch if rec.held_epoch is not None else rec.epoch
        ids = list(held)
        unconfirmed: dict[str, str] = {}
        for start in range(0, len(ids), directory.batch):
            batch = {agent_id: held[agent_id] for agent_id in ids[start: start + directory.batch]}
            await lease.renew_if_due()
            if not lease.may_run():
                return  # (the lease ended meanwhile: the keeper stops again and asks for a new one)
            try:
                named = await directory.confirm_batch(batch)
                claimed: dict[str, int] = {}
                for agent_id, ok in named.items():
                    if ok is None:  # no entry yet: claim it at its epoch, then read it again
                        await lease.renew_if_due()
                        if await directory.claim(agent_id, batch[agent_id]):
                            claimed[agent_id] = batch[agent_id]
                if claimed:
                    await lease.renew_if_due()
                    named.update(await directory.confirm_batch(claimed))
            except CapsuleError as exc:
                named, why = {}, f"fleet: the directory did not answer about it: {exc}"
            else:
                why = ""
            for agent_id, epoch in batch.items():
                if not named.get(agent_id):
                    unconfirmed[agent_id] = why or f"fleet: the directory does not name this host at epoch {epoch}"
                    log.warning("agent %s stays stopped: %s", agent_id, unconfirmed[agent_id])
        if not lease.may_run():
            return  # (the lease ended meanwhile: the keeper stops again and asks for a new one)
        self._unconfirmed = unconfirmed
        self._lease_why = None
        self._arriving = {}  # (every arrival's question is superseded: asked above, or asked again below)
        self._count_arrivals()
        arrived, self._arrived_unleased = self._arrived_unleased, set()
        for agent_id in sorted(arrived - held.keys()):  # (arrived during the questions: asked about next)
            rec = self.holders.get(agent_id)
            if rec is not None and rec.state is HolderState.HELD:
                self._await_directory(agent_id, rec.held_epoch if rec.held_epoch is not None else rec.epoch)
        for agent_id in self.view.store.agent_ids():
            if self.view.state(agent_id) is AgentState.FROZEN and \
                    shown(self.decision(agent_id), still=self._held(agent_id)) is AgentState.ACTIVE:
                self.view.resume(agent_id)
                if self.processes is not None:
                    await self.processes.on_resume(agent_id)
        log.info("fleet lease held: %d agent(s) not confirmed by the directory", len(unconfirmed))

    # -- the move driver's hooks (capsulefs.move.host.AgentHooks) ----------------------
    async def freeze(self, agent_id: str) -> None:
        """Every write to the agent fails with EROFS from now on. Requests run
        one at a time on this loop, so none is half-done when this returns:
        a move may copy the files. (An in-place edit still open is refused
        at its close.) The process is stopped and its workspace committed
        first; that scan runs in a worker thread, and the mount serves every
        agent meanwhile, this one's writes included (they are in what a move
        then copies)."""
        self._still.add(agent_id)
        if self.processes is not None:
            await self.processes.on_freeze(agent_id)
        self.view.freeze(agent_id)

    async def resume(self, agent_id: str) -> None:
        """Writes to the agent work again (the move was rolled back, or the
        agent in doubt got its evidence), unless the lifecycle says it is in doubt."""
        self._still.discard(agent_id)
        self.view.resume(agent_id)
        self._as_decided(agent_id)
        if self.processes is not None:
            await self.processes.on_resume(agent_id)

    async def retire(self, agent_id: str) -> None:
        """The agent is active elsewhere: it disappears from the root."""
        self._still.discard(agent_id)
        self._hide(agent_id)
        if self.processes is not None:
            await self.processes.on_retire(agent_id)

    def _hide(self, agent_id: str) -> None:
        name = self.view.retire(agent_id)
        if name is not None:
            self.entries.changed(name)

    async def prepare(self, agent_id: str, staged_dir: str) -> None:
        """Target side, before activate: nothing for the mount to build."""

    async def activate(self, agent_id: str) -> None:
        """The agent (moved in, or resumed after a retire) is shown and writable."""
        self._still.discard(agent_id)
        name = self.view.activate(agent_id)
        self._as_decided(agent_id)
        self.entries.changed(name)
        if self.processes is not None:
            await self.processes.on_activate(agent_id)

    def set_move_progress(self, agent_id: str, progress: dict[str, object] | None) -> None:
        """What ``.control/status`` shows under "move" (None: the default)."""
        self.view.agent(agent_id).move_progress = progress

    def state(self, agent_id: str) -> AgentState:
        return self.view.state(agent_id)

    # -- the mount's remover (.control/remove; capsulefs.core.view.control.Remover) --------
    async def remove(self, agent_id: str) -> None:
        """Remove the agent from this host; return once it is gone.

        Refused with MoveBusy while a move of it is under way (its holder
        record, or a move this daemon runs), with ReadOnly in failsafe. The
        agent first disappears from the root as a retired one does (so no
        write reaches it and the runtime does not restart it), then its
        process stops (its sandbox stays until the store forgot it), then the
        store forgets it, then its snapshots, scratch files and sandbox go.
        If the store could not remove it, it is shown and run again. Blobs
        stay for gc."""
        if self.view.failsafe is not None:
            raise ReadOnly(f"the mount went read-only after an internal error: {self.view.failsafe}")
        name = self.view.agent(agent_id).stored_manifest().name  # NotFoundError if gone meanwhile
        async with self.guard.still(agent_id):
            refuse_if_moving(self.holders, agent_id, name)
            self._hide(agent_id)
            self._still.discard(agent_id)
            try:
                with giving_up(self.state_dir, self.view.store, agent_id):
                    if self.processes is not None:
                        await self.processes.on_remove(agent_id)
                    await trio.to_thread.run_sync(self.view.store.remove_agent, agent_id)
            except Exception:
                if agent_id in self.view.store.agent_ids():
                    log.warning("agent %s (%s) could not be removed: shown and run again", name, agent_id)
                    await self.activate(agent_id)
                raise
            self.view.forget(agent_id)
            self._unconfirmed.pop(agent_id, None)  # (an agent of that id imported again is asked about anew)
            if self._arriving.pop(agent_id, None) is not None:
                self._count_arrivals()
            # (a sandbox may hold gigabytes: off the loop that serves the mount)
            await trio.to_thread.run_sync(discard_leftovers, self.state_dir, self.work_dir, agent_id)
        log.info("removed agent %s (%s)", name, agent_id)

