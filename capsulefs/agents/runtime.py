"""Running the agents a mount serves: the supervisor wired to the daemon.

Rules:
  * An agent runs here only while the lifecycle owner says it may
    (capsulefs/daemon/agents.py: the mount shows it active and this host's
    holder record and evidence say it may run). No record, a lost one,
    frozen, offered or retired: it does not run. The move protocol decides
    who holds; this module only obeys.
  * Freezing (start of a move) stops the process at a step boundary and
    commits the sandbox's changes as blobs, one ``workspace_update`` event
    and a new snapshot, before the mount starts refusing writes, so the offer
    carries them. Retiring discards the host-local sandbox; so does removing
    the agent (``capsulefs rm``), which stops its process the same way first.
  * The commit runs in the supervisor's worker thread (a workspace may hold
    gigabytes): the new blobs are read, checked against the scan's digests
    and stored there, with gc held off; then one step on the event loop,
    which no other request interleaves with, lists them, journals the event
    and writes the snapshot. A cancel stops it before that step, or not at all.
  * On a blob tier, the workspace's blobs that ``gc --tier-cache`` evicted
    are fetched back from the tier before the sandbox is built
    (:meth:`AgentRuntime.blobs_for_build`), and kept from gc until it is
    built; one that cannot be blocks the start like any unreadable blob,
    with the reason in ``run.detail``.
  * ``.control/status`` gains a "run" section: the process state, pid,
    restarts, last exit, in words why it does not run, whether it runs
    isolated ("isolation"), and why it does not answer ("last_error",
    capsulefs/agents/reports.py).
  * With isolation on (the daemon runs as root), the agent processes run as
    uids of their own and must reach their capsules through the mount: it
    is mounted ``allow_other``, its root is mode 0711 and each agent's
    directory 0700, owned by that agent's uid (see core/view/host.py).

Theory of operation: :class:`AgentRuntime` is both the agents' processes
for the lifecycle owner (capsulefs/daemon/agents.py: its ``on_*`` methods
run inside its freeze/resume/retire/activate/remove) and a daemon service
(:meth:`serve` owns the supervisor and a reconcile loop that starts agents
that became runnable: a new agent, a spec given an entrypoint, an agent
moved in). Whether an agent may run is the lifecycle owner's answer
(:class:`Lifecycle`); the runtime only starts and stops processes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager
from typing import Any, Protocol

import trio

from capsulefs.core.capsule import format as fmt
from capsulefs.core.errors import CapsuleError
from capsulefs.core.capsule import workspace
from capsulefs.core.journal.events import WorkspaceUpdate
from capsulefs.core.store.holder import HolderBook, HolderState
from capsulefs.core.view.control import TierCache
from capsulefs.core.view.host import LiveHost
from capsulefs.core.journal.projections import apply_workspace_changes
from capsulefs.move.host import holders_dir
from capsulefs.agents.isolation import Isolation
from capsulefs.agents.run_state import RunState
from capsulefs.agents.supervisor import Supervisor

log = logging.getLogger(__name__)

#: Seconds an agent's process has to exit on SIGTERM when the host lost its fleet lease (the
#: whole stop must fit STOP_WITHIN, 2 s: docs/fleet.md), before SIGKILL.
FENCE_GRACE = 0.8

RECONCILE_SECONDS = 1.0


class Lifecycle(Protocol):
    def may_run(self, agent_id: str) -> tuple[bool, str]:
        """Whether the agent's process may run here, and if not, why in words."""
        ...


class AgentRuntime:
    def __init__(self, view: LiveHost, *, state_dir: str, mountpoint: str, lifecycle: Lifecycle,
                 isolation: Isolation | None = None, grace: float = 5.0, tier_cache: TierCache | None = None) -> None:
        self.live = view
        self.store = view.store
        self.tier_cache = tier_cache  # blobs evicted here, fetched back before a sandbox build; None: no tier
        self.mountpoint = mountpoint
        self.lifecycle = lifecycle
        self.holders = HolderBook(holders_dir(state_dir))
        self.supervisor = Supervisor(state_dir, self, grace=grace, isolation=isolation)

    # -- the supervisor's hooks ---------------------------------------------------
    def spec(self, agent_id: str) -> Mapping[str, Any]:
        """The agent's spec as stored (FormatError if it is not JSON; the
        supervisor checks its rules before each start)."""
        spec: Mapping[str, Any] = fmt.load_json(self.store.agent(agent_id).read(fmt.SPEC), fmt.SPEC)
        return spec

    def snapshot(self, agent_id: str) -> Mapping[str, str]:
        return fmt.parse_snapshot(self.store.agent(agent_id).read(fmt.SNAPSHOT))

    def read_blob(self, sha256: str) -> Iterator[bytes]:
        if self.tier_cache is not None:
            self.store.touch_blob(sha256)  # (its last read, coarsely: gc --tier-cache keeps the hot ones)
        return self.store.iter_blob(sha256)

    @asynccontextmanager
    async def blobs_for_build(self, agent_id: str, snapshot: Mapping[str, str]) -> AsyncIterator[None]:
        if self.tier_cache is None:
            yield
            return
        manifest = await trio.to_thread.run_sync(lambda: self.store.agent(agent_id).manifest())
        with self.store.keeping(manifest, "sandbox"):  # (no gc evicts them again until it is built)
            sizes = manifest.blobs()
            await self.tier_cache.ensure_local({sha: sizes[sha] for sha in set(snapshot.values()) if sha in sizes})
            yield

    def capsule_dir(self, agent_id: str) -> str:
        return os.path.join(self.mountpoint, self.store.agent(agent_id).name)

    def commit_workspace(self, agent_id: str, scan: workspace.ScanResult) -> None:
        """New blobs, listed in the manifest, one workspace_update event, the
        new snapshot: in that order, so a crash between steps leaves at worst
        unreferenced blobs (gc's) or listed ones no event names, never an
        event naming blobs gc may take.

        Called in a worker thread (the supervisor's sync, under the agent's
        sandbox lock): the blobs are stored here, the rest on the event loop."""
        check = trio.from_thread.check_cancelled
        with self.store.writing():  # (gc takes none of the new blobs until the manifest lists them)
            for sha, path in scan.new_files.items():
                # (the sandbox may have changed since the scan: never through
                # a symlink or into a FIFO, and only the bytes the scan hashed)
                with workspace.open_regular(scan.root, path, check=check) as f:
                    self.store.put_blob_stream(f, expect=sha)  # type: ignore[arg-type]
            check()  # the last point a cancel stops the commit at
            trio.from_thread.run_sync(self._record_workspace, agent_id, scan)
        log.info("agent %s: workspace synced (%d change(s))", agent_id, len(scan.changes))

    def _record_workspace(self, agent_id: str, scan: workspace.ScanResult) -> None:
        """The commit's step on the event loop (no checkpoint: no FUSE request
        sees it half-done), its blobs stored: list them, journal, snapshot."""
        agent = self.store.agent(agent_id)
        snap = dict(self.snapshot(agent_id))
        agent.list_blobs(scan.new_files)  # before the journal names them (gc)
        self.live.agent(agent_id).append([WorkspaceUpdate(changes=scan.changes)])
        apply_workspace_changes(snap, scan.changes)
        agent.write_files({fmt.SNAPSHOT: fmt.snapshot_bytes(snap)}, add_blobs=set(scan.new_files))
        self.live.changed(agent_id, fmt.SNAPSHOT)

    # -- who may run ---------------------------------------------------------------------
    def runnable(self, agent_id: str) -> tuple[bool, str]:
        return self.lifecycle.may_run(agent_id)

    def run_status(self, agent_id: str) -> dict[str, Any]:
        st = self.supervisor.status(agent_id).as_json()
        st["isolation"] = self.supervisor.isolation.describe(agent_id)
        problem = self.supervisor.agent_problem(agent_id)
        if problem is not None:
            st["problem"] = problem
        failure = self.supervisor.last_error(agent_id)
        st["last_error"] = failure.as_json(agent_id) if failure is not None else None
        ok, why = self.runnable(agent_id)
        if not ok and st["state"] in ("stopped", "frozen"):
            st["detail"] = why
        return st

    def reconcile(self) -> None:
        for agent_id in self.store.agent_ids():
            ok, _why = self.runnable(agent_id)
            st = self.supervisor.status(agent_id).state
            if not ok or st not in (RunState.STOPPED, RunState.FROZEN):
                continue
            try:
                spec = self.spec(agent_id)
                wanted = not isinstance(spec, Mapping) or bool(spec.get("entrypoint"))
            except CapsuleError:
                wanted = True  # a spec that is not JSON (one moved in): the supervisor blocks it, saying why
            if wanted:  # (one that breaks the rules too: blocked with the reason, and the others still start)
                self.supervisor.want(agent_id)

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(self.supervisor.serve)
            task_status.started()
            while True:
                try:
                    self.reconcile()
                except Exception:  # never let one bad agent stop the others
                    log.exception("runtime: reconcile failed")
                await trio.sleep(RECONCILE_SECONDS)

    # -- the agents' processes, for the lifecycle owner (daemon/agents.AgentProcesses) -----------------------------------------------------
    async def on_freeze(self, agent_id: str) -> None:
        # An agent in doubt (holder record lost) is frozen because another
        # host may hold it: its sandbox's changes are not journaled here
        # (they stay in the sandbox until --learn settles who holds it).
        rec = self.holders.get(agent_id)
        await self.supervisor.freeze(agent_id, sync=rec is None or rec.state is not HolderState.UNKNOWN)

    async def on_fence(self, agent_id: str) -> None:
        """The host lost its fleet lease: stop the process at once (SIGTERM,
        then SIGKILL after ``FENCE_GRACE`` rather than the grace period, so the
        stop fits the lease's stop window); its sandbox's changes are not
        journaled (the capsule takes no write now: they stay in the sandbox)."""
        with trio.move_on_after(FENCE_GRACE):
            await self.supervisor.unwant(agent_id, sync=False)
            return
        log.warning("agent %s: not stopped within %.1fs of the lease's loss: killed", agent_id, FENCE_GRACE)
        self.supervisor.kill(agent_id)
        await self.supervisor.unwant(agent_id, sync=False)

    async def on_resume(self, agent_id: str) -> None:
        self.reconcile()

    async def on_retire(self, agent_id: str) -> None:
        await self.supervisor.unwant(agent_id, sync=False)
        await self.supervisor.discard_sandbox(agent_id)

    async def on_remove(self, agent_id: str) -> None:
        """The agent is being removed (already hidden): stop its process,
        without syncing its workspace. Its sandbox stays until the store has
        forgotten the agent (``removal.discard_leftovers``): if that fails, the
        agent runs again with its sandbox as it was."""
        await self.supervisor.unwant(agent_id, sync=False)

    async def on_shutdown(self) -> None:
        """The daemon is about to unmount: stop every agent first, at a step
        boundary, while the mount still serves it. Cut short (a second
        signal): kill them, so that nothing waits on the mount any more."""
        stopped = False
        try:
            await self.supervisor.stop_all()
            stopped = True
        finally:  # (a cancel arrives wrapped in stop_all's nursery's exception group)
            if not stopped:
                self.supervisor.kill_all()

    async def on_activate(self, agent_id: str) -> None:
        self.reconcile()
