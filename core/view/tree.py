"""The view's tree: which agents it shows and in which state, and what each
name in it stands for (``LiveHost``'s first part; its rules are in ``host``).

:class:`Tree` holds the view's state: the agents shown (and the states of
those not active), the areas beside them (scratch, uploads, snapshots), the
failsafe, and the components it calls up to, given to its constructor
(capsulefs/daemon/root.py builds them). ``attributes``, ``changes`` and
``host`` add to it, in that order.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from .. import metrics
from ..capsule import format as fmt
from ..errors import NotFoundError, StoreError
from ..fsutil import thread_start
from ..store.host_store import HostStore
from .agent import LiveAgent
from .blobcheck import BlobChecks
from .control import Arrivals, Mover, NewAgents, Owners, Remover, TierCache, WriteGuard
from .errors import NotADirectory, ReadOnly
from .nodes import CONTROL, CONTROL_FILES, HOST_CONTROL_FILES, SNAPSHOTS, AgentState, Kind, Node, build_tree
from .scratch import ScratchArea
from .snapshots import Snapshots
from .uploads import UploadArea

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _SnapCache:
    manifest: fmt.Manifest
    tree: dict[str, dict[str, Node]] = field(default_factory=dict)


class Tree:
    """Every agent of one host store, as the mount shows them: the tree and its states."""

    def __init__(
        self,
        store: HostStore,
        *,
        host_id: str,
        work_dir: str,
        new_agent_id: Callable[[], str],
        new_event_id: Callable[[], str],
        now_ns: Callable[[], int],
        owner_uid: int = 0,
        owners: Owners | None = None,
        status_sections: Mapping[str, Callable[[str], object]] | None = None,
        new_agents: NewAgents | None = None,
        mover: Mover | None = None,
        remover: Remover | None = None,
        write_guard: WriteGuard | None = None,
        arrivals: Arrivals | None = None,
        tier_cache: TierCache | None = None,
    ) -> None:
        self.store = store
        self.host_id = fmt.check_host_id(host_id)
        self.new_agent_id = new_agent_id
        self.new_event_id = new_event_id
        self.now_ns = now_ns
        self.owner_uid = owner_uid  # the mounting user; with root, may write .control
        #: With sandbox isolation (agents run as uids of their own): who
        #: says the uid an agent's processes run as. Given, the root is mode
        #: 0711, each agent's directory 0700, and the agent's directory,
        #: files and folders (not .control) are its uid's, so that its
        #: process, and no other agent's, can use them.
        self.owners = owners
        self.work_dir = work_dir
        self.scratch = ScratchArea.under(work_dir)
        self.uploads = UploadArea.under(work_dir)  # (leftovers of an earlier daemon removed)
        self.snapshots = Snapshots.under(work_dir)
        self.snapshots.sweep()
        self._drop_leftovers(set(store.agent_ids()))
        self.blobs = BlobChecks()
        self.failsafe: str | None = None  # why the view went read-only, if it did
        self.last_error: str | None = None
        self._agents: dict[str, LiveAgent] = {}
        self._states: dict[str, AgentState] = {}
        self._snaps: dict[tuple[str, str], _SnapCache] = {}
        self._names: tuple[object, dict[str, str]] | None = None
        #: Called with (agent_id, capsule path) after a change made through
        #: this view, so that the adapter can tell the kernel (attributes
        #: of that file, the manifest and the status change).
        self.on_change: Callable[[str, str], None] = lambda agent_id, rel: None
        #: Extra sections of ``.control/status`` from other components, by
        #: key (e.g. "run": the agent process's state from the supervisor).
        self.status_sections: Mapping[str, Callable[[str], object]] = dict(status_sections or {})
        #: Told right after ``mkdir`` created an agent (None: nobody).
        self.new_agents = new_agents
        #: Carries out writes to ``.control/move`` and ``.control/abandon``
        #: (the daemon's move wiring); None: they fail with EOPNOTSUPP.
        self.mover = mover
        #: Carries out writes to ``.control/remove`` (the daemon); None: they
        #: fail with EOPNOTSUPP.
        self.remover = remover
        #: Asked before every write is acknowledged (the fleet mode's lease:
        #: :meth:`check_lease`); None: writes depend on nothing outside the view.
        self.write_guard = write_guard
        #: Decides how an agent the view was not told about is shown (None:
        #: active, as without a daemon's lifecycle; tests of the view alone).
        self.arrivals = arrivals
        #: The store as a cache of the blob tier (``mount --blobs``): a listed
        #: blob missing here that it says was evicted is BlobEvicted, which the
        #: adapter fetches back; None (no tier): a missing blob is lost (EIO).
        self.tier_cache = tier_cache
        #: Agents whose state the view was told (``set_state``): any other is
        #: an arrival, decided once, the first time a request sees it.
        self._told: set[str] = set()
        #: Retired agents: their manifest's identity then (None: none), so that files put back since are seen.
        self._retired_files: dict[str, tuple[int, int] | None] = {}

    def state(self, agent_id: str) -> AgentState:
        st = self._states.get(agent_id)
        if st is AgentState.REMOVED and os.path.isfile(os.path.join(self.store.agents_dir, agent_id, fmt.MANIFEST)):
            del self._states[agent_id]  # an agent of that id is in the store again (an import): a new one
            self._told.discard(agent_id)
            st = None
        elif st is AgentState.RETIRED and self.arrivals is not None and \
                self._manifest_id(agent_id) not in (None, self._retired_files.get(agent_id)):
            st = self._back(agent_id)  # (files put in the store since it was retired: an import)
        if st is not None:
            return st
        if agent_id in self._told or self.arrivals is None:
            return AgentState.ACTIVE
        return self._arrived(agent_id)

    def _arrived(self, agent_id: str) -> AgentState:
        """An agent the view was not told about: shown as the lifecycle decides
        (once: from then on the lifecycle's hooks change it), read-only while
        it cannot decide yet (no holder record)."""
        assert self.arrivals is not None
        shown = self.arrivals.arrived(agent_id)
        if shown is None:
            return AgentState.FROZEN
        log.info("agent %s appeared in the store", agent_id)
        self.set_state(agent_id, shown)
        return shown

    def _manifest_id(self, agent_id: str) -> tuple[int, int] | None:
        try:
            st = os.stat(os.path.join(self.store.agents_dir, agent_id, fmt.MANIFEST))
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns

    def _back(self, agent_id: str) -> AgentState:
        """An agent retired here (moved away) whose files are in the store:
        still retired while the lifecycle says so from its holder record (a
        move's files not removed yet, a crash's leftovers, an import whose
        record is not written yet); else it is back (an import of an agent
        this host let go), an arrival shown as the lifecycle decides."""
        assert self.arrivals is not None
        shown = self.arrivals.arrived(agent_id)
        if shown is None or shown is AgentState.RETIRED:
            return AgentState.RETIRED
        log.info("agent %s is in the store again after it moved away", agent_id)
        self.set_state(agent_id, shown)
        return shown

    def set_state(self, agent_id: str, state: AgentState) -> None:
        fmt.check_agent_id(agent_id)
        self._told.add(agent_id)
        if state is AgentState.ACTIVE:
            self._states.pop(agent_id, None)
        else:
            self._states[agent_id] = state
        log.info("agent %s is now %s", agent_id, state.value)

    def enter_failsafe(self, reason: str) -> None:
        self.last_error = reason
        if self.failsafe is None:
            self.failsafe = reason
            metrics.FAILSAFE_ENTERED.inc()
            log.error("the mount is now read-only (failsafe) after an internal error: %s", reason)

    def metrics_bytes(self) -> bytes:
        """``MNT/.control/metrics``: the process's series (``core.metrics``),
        with the gauges of this view set as of now."""
        shown: dict[str, float] = {s.value: 0 for s in (AgentState.ACTIVE, AgentState.FROZEN)}
        processes: dict[tuple[str, ...], float] = {}
        run = self.status_sections.get("run")
        for agent_id in self.names(strict=False).values():
            state = self.state(agent_id).value
            shown[state] = shown.get(state, 0) + 1
            try:
                section = run(agent_id) if run is not None else None
            except Exception:  # (a read of the metrics must never fail, nor flip the mount to failsafe)
                log.exception("agent %s: its run status could not be read for the metrics", agent_id)
                section = None
            if isinstance(section, dict) and isinstance(section.get("state"), str):
                key = (section["state"],)
                processes[key] = processes.get(key, 0) + 1
        metrics.AGENTS.replace({(state,): n for state, n in shown.items()})
        metrics.AGENT_PROCESSES.replace(processes)
        metrics.FAILSAFE.set(1 if self.failsafe is not None else 0)
        return metrics.REGISTRY.render()

    def changed(self, agent_id: str, rel: str) -> None:
        self.on_change(agent_id, rel)

    def check_writable(self, agent_id: str) -> None:
        if self.failsafe is not None:
            raise ReadOnly(f"the mount went read-only after an internal error: {self.failsafe}")
        if self.state(agent_id) is AgentState.REMOVED:
            raise NotFoundError(f"agent {agent_id} was removed from this host")
        if self.state(agent_id) is not AgentState.ACTIVE:
            raise ReadOnly(f"agent {agent_id} is {self.state(agent_id).value} (a move is under way); no writes")
        if self.write_guard is not None:
            self.check_lease()

    def check_lease(self) -> None:
        """ReadOnly if the host may not acknowledge a write now: in the fleet
        mode, once its lease's deadline passed (a daemon paused past it, a
        paused VM), even before the lease keeper's task has run to stop the agents."""
        if self.write_guard is not None:
            why = self.write_guard.refuses_writes()
            if why is not None:
                raise ReadOnly(why)

    def agent(self, agent_id: str) -> LiveAgent:
        a = self._agents.get(agent_id)
        if a is None:
            if self.state(agent_id) in (AgentState.RETIRED, AgentState.REMOVED):
                raise NotFoundError(f"agent {agent_id} was {self.state(agent_id).value} from this host")
            a = self._agents[agent_id] = LiveAgent(self, agent_id)
        return a

    def names(self, *, strict: bool = True) -> dict[str, str]:
        """name -> agent_id of every agent shown.

        A listing (``strict``) reads every agent's manifest and raises
        StoreError if one is unreadable: the root never silently shows fewer
        agents. A lookup (not strict) uses the last answer while the agents
        directory and the retired set are unchanged, and skips unreadable
        agents so that the others stay reachable.
        """
        key = (os.stat(self.store.agents_dir).st_mtime_ns, frozenset(self._states.items()))
        if not strict and self._names is not None and self._names[0] == key:
            return self._names[1]
        out = {}
        ids = set(self.store.agent_ids())
        for gone in set(self._agents) - ids:
            self._agents.pop(gone).close()
        broken: StoreError | None = None
        for aid in sorted(ids):
            if self.state(aid) is AgentState.RETIRED:
                continue
            try:
                out[self.agent(aid).stored_manifest().name] = aid
            except NotFoundError:
                continue  # removed meanwhile
            except StoreError as exc:
                broken = broken or exc
        if broken is not None and strict:
            raise broken
        self._names = (key, out) if broken is None else None
        return out

    def _snap(self, agent_id: str, name: str) -> _SnapCache:
        key = (agent_id, name)
        c = self._snaps.get(key)
        if c is None or not self.snapshots.exists(agent_id, name):
            if not self.snapshots.exists(agent_id, name):
                self._snaps.pop(key, None)
                raise NotFoundError(f"no snapshot {name!r}")
            m = self.snapshots.manifest(agent_id, name)
            files = sorted(m.files) + [fmt.MANIFEST]
            tree = build_tree(files, [fmt.BLOBS_DIR], lambda r: Node(Kind.SNAP_FILE, agent_id, r, name),
                         lambda d: Node(Kind.SNAP_DIR, agent_id, d, name))
            c = self._snaps[key] = _SnapCache(m, tree)
        return c

    def _children(self, node: Node, *, strict: bool = True) -> dict[str, Node]:
        match node.kind:
            case Kind.ROOT:
                return {name: Node(Kind.AGENT, aid) for name, aid in self.names(strict=strict).items()}
            case Kind.AGENT:
                return self.agent(node.agent).tree()[""]
            case Kind.DIR:
                return self.agent(node.agent).tree().get(node.rel, {})
            case Kind.CONTROL:
                return {n: Node(Kind.CONTROL_FILE, node.agent, n) for n in CONTROL_FILES}
            case Kind.HOST_CONTROL:
                return {n: Node(Kind.HOST_CONTROL_FILE, "", n) for n in HOST_CONTROL_FILES}
            case Kind.SNAPSHOTS:
                return {n: Node(Kind.SNAPSHOT, node.agent, "", n) for n in self.snapshots.names(node.agent)}
            case Kind.SNAPSHOT | Kind.SNAP_DIR:
                return self._snap(node.agent, node.snap).tree.get(node.rel, {})
        raise NotADirectory(f"{node.rel or node.kind.value} is not a directory")

    def listdir(self, node: Node) -> list[tuple[str, Node]]:
        """Entries of a directory, hidden directories and scratch files left out."""
        return sorted(self._children(node).items())

    def lookup(self, parent: Node, name: str, pid: int | None = None) -> Node:
        """The node ``name`` in ``parent`` names, as thread ``pid`` sees it
        (an editable file it unlinked is gone for it; None: for no one)."""
        if parent.kind is Kind.ROOT and name == CONTROL:
            return Node(Kind.HOST_CONTROL)
        if parent.kind is Kind.AGENT and name in (CONTROL, SNAPSHOTS):
            self.agent(parent.agent).stored_manifest()  # the agent still exists
            return Node(Kind.CONTROL if name == CONTROL else Kind.SNAPSHOTS, parent.agent)
        child = self._children(parent, strict=False).get(name)
        if child is not None:
            if pid is not None and child.kind is Kind.FILE and self.unlinked_by(child, pid):
                raise NotFoundError(f"{child.rel}: unlinked by this process, not created again yet")
            return child
        if parent.kind is Kind.DIR and self.scratch.exists(parent.agent, parent.rel, name):
            return Node(Kind.SCRATCH, parent.agent, f"{parent.rel}/{name}")
        raise NotFoundError(f"{name}: no such file or directory")

    def unlinked_by(self, node: Node, pid: int) -> bool:
        """Whether thread ``pid`` unlinked editable file ``node`` and has not
        created it again. The thread is named by its id and its start time:
        once it is gone, a later thread given the same id is another one, and
        sees the file (the entry is dropped)."""
        agent = self.agent(node.agent)
        entry = agent.unlinked.get(node.rel)
        if entry is None or entry[0] != pid:
            return False
        if thread_start(pid) != entry[1]:
            del agent.unlinked[node.rel]
            return False
        return True

    def close(self) -> None:
        """Close every agent's open journal (at unmount)."""
        for a in self._agents.values():
            a.close()

    def _drop_leftovers(self, held: set[str]) -> None:
        """Remove the snapshots and scratch files of agents the store no longer
        has: a crash between the steps of a removal left them, and the blobs
        the snapshots list would never be freed."""
        for area in (self.snapshots, self.scratch):
            for agent_id in area.agent_ids():
                if agent_id not in held:
                    log.info("removing leftover %s of agent %s (no longer in the store)",
                             os.path.basename(area.root), agent_id)
                    area.remove_agent(agent_id)

    def _drop_open(self, agent_id: str) -> None:
        """Close what the view keeps open or cached of an agent gone from it
        (its journal, its snapshots' caches)."""
        if agent_id in self._agents:
            self._agents.pop(agent_id).close()
        for key in [k for k in self._snaps if k[0] == agent_id]:
            del self._snaps[key]

    def freeze(self, agent_id: str) -> None:
        self.agent(agent_id).stored_manifest()
        self.set_state(agent_id, AgentState.FROZEN)

    def resume(self, agent_id: str) -> None:
        self.agent(agent_id).stored_manifest()
        self.set_state(agent_id, AgentState.ACTIVE)

    def retire(self, agent_id: str) -> str | None:
        """Hide an agent (moved away); return the name it was shown under."""
        name = None
        a = self._agents.get(agent_id)
        try:
            name = (a or LiveAgent(self, agent_id)).stored_manifest().name
        except (NotFoundError, FileNotFoundError):
            pass  # already gone from the store
        self._retired_files[agent_id] = self._manifest_id(agent_id)
        self.set_state(agent_id, AgentState.RETIRED)
        self._drop_open(agent_id)
        # It runs elsewhere now: snapshots kept here would only pin its blobs.
        self.snapshots.remove_agent(agent_id)
        self.scratch.remove_agent(agent_id)
        return name

    def forget(self, agent_id: str) -> None:
        """The agent was removed from the store: drop what the view kept of it
        (open journal, snapshot caches) and mark it REMOVED, so that handles
        still open on it write nothing (ENOENT), until an agent of that id is
        in the store again (an import), which is shown as a new one."""
        self._drop_open(agent_id)
        self.set_state(agent_id, AgentState.REMOVED)

    def activate(self, agent_id: str) -> str:
        """Show an agent again (or for the first time, after a move in): active."""
        self.set_state(agent_id, AgentState.ACTIVE)
        return self.agent(agent_id).stored_manifest().name
