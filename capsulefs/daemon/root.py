"""The composition root: every component of a mount's daemon, built through
its constructor, in one function (:func:`compose`).

Rules:
  * Each component takes its collaborators in its constructor, typed by a
    small ``typing.Protocol`` of what it uses; nothing is assigned onto a
    component from outside after it was built.
  * Components are built in the order of what they need: the view first
    (everything else takes it), then the adapter, the agents' lifecycle
    owner, the agent runtime, the moves, the daemon.
  * A call that goes the other way (the view carrying out a
    ``.control/move`` write, the lifecycle owner asking where an agent
    stands) happens only when a request comes, never while building: it goes
    through :class:`_Upcalls`, which reaches the component built later by
    name. Those are the construction cycles, all of them, in one place.
  * The fleet components (capsulefs/fleet/member.py) are built here when
    the mount has a directory: the host lease keeper is a service of the
    daemon, its listener the agents' lifecycle owner (through
    :class:`_Upcalls`: the keeper is built after it), and the view asks it
    before every write it acknowledges (the view's write guard); the
    directory authority and the lease are given to the moves (a
    ``capsulefs.move.fleet.Fleet``; None in peer-to-peer mode).
    The move host's peer finder is chosen here: the directory's live hosts
    (capsulefs/fleet/peers.py) in the fleet mode, else the pinned peers.
    With a blob tier, the uploader (and beside it the live set's publisher,
    for the fleet's tier gc) is another service, told of each blob by the
    store (through :class:`_Upcalls`: the store is built first), the moves
    get the tier's fetch for the offers they receive, and the readers of
    blobs (the view and its adapter, the runtime's sandbox build, a move's
    source) the tier cache, which fetches back what ``gc --tier-cache``
    evicted (so the fleet member is built before the view).
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from capsulefs.agents import grants
from capsulefs.agents.isolation import Isolation
from capsulefs.agents.runtime import AgentRuntime
from capsulefs.agents.steering import Steering
from capsulefs.core.fleet.lease import DEFAULT_TIMING
from capsulefs.core.store.holder import HolderBook
from capsulefs.core.store.host_store import HostStore
from capsulefs.core.store.lifecycle import Decision
from capsulefs.core.view.host import LiveHost
from capsulefs.core.view.nodes import AgentState
from capsulefs.daemon.agents import Agents
from capsulefs.daemon.daemon import Daemon, KernelEntries, Service, Stopping, sd_notify, work_dir
from capsulefs.daemon.metrics_file import MetricsFile
from capsulefs.mount.ops import Operations
from capsulefs.move.fleet import Fleet
from capsulefs.move.host import MoveHost, holders_dir
from capsulefs.move.mount_moves import MountMoves
from capsulefs.move.target import FLEET_GATE_AFTER
from capsulefs.testing import seams
from capsulefs.peer.finder import PeerFinder
from capsulefs.peer.identity import load_or_create_identity

if TYPE_CHECKING:
    from capsulefs.core.fleet.config import FleetConfig
    from capsulefs.fleet.member import FleetMember

__all__ = ["MountConfig", "Mounted", "compose"]


@dataclass(frozen=True, kw_only=True)
class MountConfig:
    """What ``capsulefs mount`` was asked (cli/mount_cmds.py), or a test."""

    state_dir: str
    mountpoint: str
    allow_other: bool = False
    options: tuple[str, ...] = ()
    run_agents: bool = True  # False: `--no-run`, serve the files only
    listen: tuple[str, int] | None = None  # answer peers' moves there
    metrics_file: str | None = None
    metrics_interval: float = 15.0
    notify: Callable[[str], bool] = sd_notify
    grace: float = 5.0  # seconds an agent has to stop at a step boundary
    retry_pause: float = 1.0  # between a move's retries
    call_timeout: float = 120.0  # seconds a move's call may take before it is a timeout
    #: The fleet's directory (``mount --directory``); None: peer-to-peer.
    fleet: FleetConfig | None = None
    #: The address published in the directory for other hosts to reach ``listen`` (``mount --advertise``);
    #: None: ``listen``'s.
    advertise: str | None = None
    #: More services started after the daemon's own (tests).
    services: tuple[Service, ...] = ()
    #: More components told before the unmount, after the runtime (tests).
    stopping: tuple[Stopping, ...] = ()


@dataclass(frozen=True)
class Mounted:
    """Every component :func:`compose` built; ``daemon.serve`` serves them."""

    daemon: Daemon
    view: LiveHost
    ops: Operations
    agents: Agents
    moves: MountMoves
    runtime: AgentRuntime | None  # None: `--no-run`
    isolation: Isolation | None  # None: `--no-run`
    fleet: FleetMember | None = None  # None: peer-to-peer


def compose(cfg: MountConfig) -> Mounted:
    """Build a mount's daemon and everything it serves (see the module's rules)."""
    state_dir = os.path.abspath(cfg.state_dir)
    mountpoint = os.path.abspath(cfg.mountpoint)  # (CAPSULE_DIR is under it: never relative)
    fleet: FleetMember | None = None
    up = _Upcalls(agents=lambda: agents, moves=lambda: moves, runtime=lambda: runtime, ops=lambda: ops,
                  fleet=lambda: fleet)
    # The blob tier's uploader is told of every blob the store places (the fleet is built right after).
    store = HostStore.open(state_dir, on_blob=up.blob_stored if cfg.fleet and cfg.fleet.blobs else None)
    grants.ensure(state_dir, store)  # (before a move brings an agent in: see grants)
    identity = load_or_create_identity(state_dir)
    host_id = identity.host_id

    if cfg.fleet is not None:  # (imported only here: a peer-to-peer mount never loads httpx)
        from capsulefs.fleet.member import FleetMember

        address = cfg.advertise or _address(cfg.listen)
        fleet = FleetMember(cfg.fleet, host_id=host_id, address=address, cert_der=identity.cert_der, listener=up,
                            timing=seams.lease_timing_seam(os.environ.get(seams.LEASE_TIMING_ENV)) or DEFAULT_TIMING,
                            store=store, **_live_refresh())
    tier_cache = fleet.tier_cache if fleet is not None else None  # (evicted blobs, fetched back for their readers)

    isolation = Isolation.detect(state_dir, on_new_owner=up.owner_changed) if cfg.run_agents else None
    isolated = isolation is not None and isolation.enabled
    sections: dict[str, Callable[[str], object]] = {"record": up.record_status}
    if cfg.run_agents:
        sections["run"] = up.run_status
    view = LiveHost(
        store,
        host_id=host_id,
        work_dir=work_dir(state_dir),
        new_agent_id=lambda: secrets.token_hex(16),
        new_event_id=lambda: secrets.token_hex(12),
        now_ns=time.time_ns,
        owner_uid=os.getuid(),
        owners=isolation if isolated else None,
        status_sections=sections,
        new_agents=up,
        mover=up,
        remover=up,
        write_guard=up if cfg.fleet is not None else None,  # (the fleet lease, before every write)
        arrivals=up,
        tier_cache=tier_cache,
    )
    ops = Operations(view)
    entries = KernelEntries(ops)
    agents = Agents(view, HolderBook(holders_dir(state_dir)), state_dir=state_dir, work_dir=work_dir(state_dir),
                    standing=up, guard=up, entries=entries, processes=up if cfg.run_agents else None)
    runtime = None
    services: list[Service] = []
    stopping: list[Stopping] = []
    if cfg.run_agents:
        runtime = AgentRuntime(view, state_dir=state_dir, mountpoint=mountpoint, lifecycle=agents,
                               isolation=isolation, grace=cfg.grace, tier_cache=tier_cache)
        services += [runtime.serve, Steering(runtime, state_dir).serve]  # (steering: spec and grant changes)
        stopping.append(runtime)
    finder: PeerFinder | None = None  # who a move's target is, and who calls: the pinned peers (the default)...
    if fleet is not None:
        from capsulefs.fleet.peers import DirectoryPeers

        agents.lease_pending("fleet: waiting for a lease from the directory")
        finder = DirectoryPeers(fleet.client, fleet.config.layout, me=host_id)  # ...or the directory's live hosts
    # After the runtime: moves may activate agents, which the runtime then starts.
    move_host = MoveHost.open(state_dir, hooks=agents, finder=finder, store=store)
    # Test seams (capsulefs/testing/seams.py), selected by a test's environment only.
    seams.crash_seam(move_host, os.environ.get(seams.CRASH_ENV))
    moves_fleet = None if fleet is None else Fleet(
        seams.lose_commit_seam(fleet.authority, os.environ.get(seams.LOSE_COMMIT_ENV)), fleet.keeper)
    seams.stop_seam(move_host, os.environ.get(seams.STOP_ENV))
    moves = MountMoves(move_host, agents, listen=cfg.listen, retry_pause=cfg.retry_pause,
                       call_timeout=seams.call_timeout_seam(os.environ.get(seams.CALL_TIMEOUT_ENV)) or cfg.call_timeout,
                       fleet=moves_fleet, tier=fleet.tier_offers if fleet is not None else None,
                       tier_cache=tier_cache,
                       gate_after=seams.gate_after_seam(os.environ.get(seams.GATE_AFTER_ENV)) or FLEET_GATE_AFTER)
    services += [moves.serve, moves.standings.serve]
    if cfg.metrics_file:
        services.append(MetricsFile(view, cfg.metrics_file, cfg.metrics_interval).serve)
    if fleet is not None:
        services.append(fleet.serve)
        services.append(partial(agents.confirm_arrivals, fleet.authority, fleet.keeper))
        if fleet.uploader is not None:
            services.append(fleet.serve_tier)
    services += cfg.services
    stopping += cfg.stopping
    agents.show_all()  # (before the mount serves: as the holder records and the evidence so far say)
    daemon = Daemon(state_dir, mountpoint, view=view, ops=ops, entries=entries, services=services,
                    stopping=stopping, runtime_info=[moves], allow_other=cfg.allow_other or isolated,
                    options=cfg.options, notify=cfg.notify)
    return Mounted(daemon=daemon, view=view, ops=ops, agents=agents, moves=moves, runtime=runtime,
                   isolation=isolation, fleet=fleet)


def _live_refresh() -> dict[str, float]:
    """The live set publisher's refresh, if a test's seam sets it (capsulefs/fleet/live.py)."""
    refresh = seams.live_refresh_seam(os.environ.get(seams.LIVE_REFRESH_ENV))
    return {} if refresh is None else {"live_refresh": refresh}


def _address(listen: tuple[str, int] | None) -> str:
    """``HOST:PORT`` (``[v6]:PORT``) of the listen address; ``-`` when the host accepts no moves."""
    if listen is None:
        return "-"
    host, port = listen
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _Upcalls:
    """The calls that go against the order of construction, each at request
    time only, to the component built later that carries it out: the view's
    control files, its new agents, its arrivals and status sections; the lifecycle
    owner's standing, move guard and processes; isolation's new owners; the
    fleet lease keeper's listener and the view's write guard."""

    def __init__(self, *, agents: Callable[[], Agents], moves: Callable[[], MountMoves],
                 runtime: Callable[[], AgentRuntime | None], ops: Callable[[], Operations],
                 fleet: Callable[[], FleetMember | None]) -> None:
        self._agents, self._moves, self._runtime, self._ops = agents, moves, runtime, ops
        self._fleet = fleet

    def _run(self) -> AgentRuntime:
        runtime = self._runtime()
        assert runtime is not None  # (given as the processes or a section only when agents run)
        return runtime

    # the view's (core/view/control.py: Mover, Remover, NewAgents; status sections)
    async def move(self, agent_id: str, target: str) -> None:
        await self._moves().move(agent_id, target)

    async def abandon(self, agent_id: str, why: str) -> None:
        await self._moves().abandon(agent_id, why)

    async def learn(self, agent_id: str) -> None:
        await self._moves().learn(agent_id)

    async def remove(self, agent_id: str) -> None:
        await self._agents().remove(agent_id)

    def created(self, agent_id: str, epoch: int) -> None:
        self._agents().made(agent_id)
        self._moves().created(agent_id, epoch)

    def arrived(self, agent_id: str) -> AgentState | None:
        return self._agents().arrived(agent_id)

    def record_status(self, agent_id: str) -> dict[str, object]:
        return self._agents().record_status(agent_id)

    def run_status(self, agent_id: str) -> dict[str, object]:
        return self._run().run_status(agent_id)

    # the lifecycle owner's (capsulefs/daemon/agents.py: Standing, MoveGuard, AgentProcesses)
    def decision(self, agent_id: str) -> Decision:
        return self._moves().standings.decision(agent_id)

    def detail(self, agent_id: str, name: str) -> str | None:
        return self._moves().standings.detail(agent_id, name)

    def still(self, agent_id: str) -> AbstractAsyncContextManager[None]:
        return self._moves().still(agent_id)

    async def on_freeze(self, agent_id: str) -> None:
        await self._run().on_freeze(agent_id)

    async def on_resume(self, agent_id: str) -> None:
        await self._run().on_resume(agent_id)

    async def on_retire(self, agent_id: str) -> None:
        await self._run().on_retire(agent_id)

    async def on_activate(self, agent_id: str) -> None:
        await self._run().on_activate(agent_id)

    async def on_remove(self, agent_id: str) -> None:
        await self._run().on_remove(agent_id)

    async def on_fence(self, agent_id: str) -> None:
        await self._run().on_fence(agent_id)

    # the view's write guard (core/view/control.py: WriteGuard), in the fleet mode only
    def refuses_writes(self) -> str | None:
        fleet = self._fleet()
        assert fleet is not None  # (the guard of a fleet mount only)
        if fleet.keeper.may_run():
            return None
        return self._agents().lease_lapsed(fleet.keeper.why_not())

    # the host store's (core/store/blobs.py: on_blob; any thread)
    def blob_stored(self, sha256: str) -> None:
        fleet = self._fleet()
        if fleet is not None:
            fleet.blob_stored(sha256)

    # the fleet lease keeper's (capsulefs/fleet/keeper.py: LeaseListener)
    async def stop(self, why: str) -> None:
        await self._agents().lease_lost(why)

    async def regained(self, lease_id: int) -> None:
        fleet = self._fleet()
        assert fleet is not None  # (the listener of its keeper only)
        await self._agents().lease_regained(fleet.authority, fleet.keeper)

    # isolation's (capsulefs/agents/isolation.py): an agent got its own uid
    def owner_changed(self, agent_id: str) -> None:
        self._ops().owner_changed(agent_id)

