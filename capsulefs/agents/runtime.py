"""Running the agents a mount serves: the supervisor wired to the daemon.

Rules:
  * An agent runs here only while the mount shows it active and this host's
    holder record says it may run (held at its epoch). No record, a lost one,
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
  * ``.control/status`` gains a "run" section: the process state, pid,
    restarts, last exit, in words why it does not run, whether it runs
    isolated ("isolation"), and why it does not answer ("last_error",
    capsulefs/agents/reports.py).
  * With isolation on (the daemon runs as root), the agent processes run as
    uids of their own and must reach their capsules through the mount: it
    is mounted ``allow_other``, its root is mode 0711 and each agent's
    directory 0700, owned by that agent's uid (see core/view/host.py).

Theory of operation: :class:`AgentRuntime` is both a daemon listener (its
``on_*`` methods run inside the daemon's freeze/resume/retire/activate) and
a daemon service (:meth:`serve` owns the supervisor and a reconcile loop that
starts agents that became runnable: a new agent, a spec given an entrypoint,
an agent moved in).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

import trio

from capsulefs.core.capsule import format as fmt
from capsulefs.core.errors import CapsuleError
from capsulefs.core.capsule import workspace
from capsulefs.core.journal.events import WorkspaceUpdate
from capsulefs.core.store.holder import HolderBook, HolderState, story
from capsulefs.core.view.nodes import AgentState
from capsulefs.core.journal.projections import apply_workspace_changes
from capsulefs.move.host import holders_dir
from capsulefs.agents.steering import Steering
from capsulefs.agents.supervisor import RunState, Supervisor

log = logging.getLogger(__name__)

RECONCILE_SECONDS = 1.0


class AgentRuntime:
    def __init__(self, daemon: Any, *, grace: float = 5.0) -> None:
        self.daemon = daemon
        self.live = daemon.live
        self.store = daemon.live.store
        self.holders = HolderBook(holders_dir(daemon.state_dir))
        self.supervisor = Supervisor(daemon.state_dir, self, grace=grace)
        self._paused: set[str] = set()  # frozen by a move: not restarted by reconcile

    @classmethod
    def attach(cls, daemon: Any, **kw: Any) -> "AgentRuntime":
        rt = cls(daemon, **kw)
        if rt.supervisor.isolation.enabled:
            daemon.allow_other = True  # (the mount is made later, in daemon.serve)
            daemon.live.agent_owner = rt.supervisor.isolation.owner_of
            rt.supervisor.isolation.on_new_owner = daemon.ops.owner_changed
        daemon.listeners.append(rt)
        daemon.services.append(rt.serve)
        daemon.services.append(Steering(rt, daemon.state_dir).serve)  # (spec and grant changes: restarts)
        daemon.live.status_sections["run"] = rt.run_status
        return rt

    # -- the supervisor's hooks ---------------------------------------------------
    def spec(self, agent_id: str) -> Mapping[str, Any]:
        """The agent's spec as stored (FormatError if it is not JSON; the
        supervisor checks its rules before each start)."""
        return fmt.load_json(self.store.agent(agent_id).read(fmt.SPEC), fmt.SPEC)

    def snapshot(self, agent_id: str) -> Mapping[str, str]:
        return fmt.parse_snapshot(self.store.agent(agent_id).read(fmt.SNAPSHOT))

    def read_blob(self, sha256: str) -> Iterator[bytes]:
        return self.store.iter_blob(sha256)

    def capsule_dir(self, agent_id: str) -> str:
        return os.path.join(self.daemon.mountpoint, self.store.agent(agent_id).name)

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
        rec = self.holders.get(agent_id)
        if rec is not None and rec.state is HolderState.UNKNOWN:  # (frozen as well: say the real reason)
            return False, story(rec, self.live.agent(agent_id).stored_manifest().name).line()
        lifecycle = getattr(self.daemon, "lifecycle", None)
        decision = lifecycle(agent_id) if lifecycle is not None else None
        if decision is not None and rec is not None and rec.state is HolderState.HELD and not decision.run:
            return False, (f"{decision.standing.value}: no peer has said yet that it holds no higher epoch "
                           f"(see the record section)")
        if agent_id in self._paused:
            return False, "frozen for a move"
        if self.live.state(agent_id) is not AgentState.ACTIVE:
            return False, f"the mount shows it {self.live.state(agent_id).value}"
        if rec is None:
            return False, "this host has no holder record for it: it runs only after a move or 'capsulefs move --force-hold' (the daemon stopped)"
        if not rec.runnable:
            return False, f"its holder record here says {rec.state.value} at epoch {rec.epoch}"
        return True, ""

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

    # -- the daemon's listener API ---------------------------------------------------------
    async def on_freeze(self, agent_id: str) -> None:
        self._paused.add(agent_id)
        # An agent in doubt (holder record lost) is frozen because another
        # host may hold it: its sandbox's changes are not journaled here
        # (they stay in the sandbox until --learn settles who holds it).
        rec = self.holders.get(agent_id)
        await self.supervisor.freeze(agent_id, sync=rec is None or rec.state is not HolderState.UNKNOWN)

    async def on_resume(self, agent_id: str) -> None:
        self._paused.discard(agent_id)
        self.reconcile()

    async def on_retire(self, agent_id: str) -> None:
        self._paused.discard(agent_id)
        await self.supervisor.unwant(agent_id, sync=False)
        await self.supervisor.discard_sandbox(agent_id)

    async def on_remove(self, agent_id: str) -> None:
        """The agent is being removed (already hidden): stop its process,
        without syncing its workspace. Its sandbox stays until the store has
        forgotten the agent (``removal.discard_leftovers``): if that fails, the
        agent runs again with its sandbox as it was."""
        self._paused.discard(agent_id)
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
        self._paused.discard(agent_id)
        self.reconcile()
