"""What the supervisor keeps per agent: its run's state (``RunState``, the
process-level states: starting, running, backing off...), what
``.control/status`` shows of it (``RunStatus``), and what the supervisor
needs of the daemon (``Hooks``). Whether an agent should run at all is not
here: the daemon's lifecycle owner decides it (capsulefs/daemon/agents.py).
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from capsulefs.agents.agent_log import AgentLog
from capsulefs.agents.process import Child
from capsulefs.agents.reports import Failure
from capsulefs.core.capsule import workspace


class RunState(enum.Enum):
    STOPPED = "stopped"
    BUILDING = "building"
    RUNNING = "running"
    BACKOFF = "backoff"
    BLOCKED = "blocked"  # cannot start: missing secret, bad spec...
    FINISHED = "finished"
    FROZEN = "frozen"


class Hooks(Protocol):
    """What the supervisor needs from the daemon, per agent id."""

    def spec(self, agent_id: str) -> Mapping[str, Any]: ...

    def snapshot(self, agent_id: str) -> Mapping[str, str]: ...

    def read_blob(self, sha256: str) -> Iterator[bytes]: ...

    def blobs_for_build(self, agent_id: str, snapshot: Mapping[str, str]) -> AbstractAsyncContextManager[None]:
        """Around the sandbox's build from ``snapshot``: on entry its blobs that
        ``gc --tier-cache`` evicted are back in the store (fetched from the
        blob tier), or a CapsuleError says which is not; until exit no gc
        evicts them again."""

    def capsule_dir(self, agent_id: str) -> str: ...

    def commit_workspace(self, agent_id: str, scan: workspace.ScanResult) -> None:
        """Store the scan's changes in the capsule. Called in a worker thread
        (under the agent's sandbox lock); what must happen on the event loop
        goes there through ``trio.from_thread``."""
        ...


@dataclass
class RunStatus:
    state: RunState = RunState.STOPPED
    pid: int | None = None
    restarts: int = 0
    last_exit: int | None = None
    detail: str = ""  # words for .control/status
    next_start_in: float | None = None
    failure: Failure | None = None  # the daemon's last failure of this agent (reports.py)
    spec_digest: str | None = None  # of the spec the run started from (steering.py)
    secrets: list[str] = field(default_factory=list)  # the secret names it was given

    def as_json(self) -> dict[str, Any]:
        return {
            "state": self.state.value,
            "pid": self.pid,
            "restarts": self.restarts,
            "last_exit": self.last_exit,
            "detail": self.detail,
            "spec": {"digest": self.spec_digest, "secrets": self.secrets} if self.spec_digest else None,
        }


@dataclass
class Runner:
    agent_id: str
    status: RunStatus = field(default_factory=RunStatus)
    # Made with the runner, entered by its task: a stop that comes before the
    # task has run at all still takes effect (trio keeps the cancel).
    cancel: trio.CancelScope = field(default_factory=trio.CancelScope)
    process: Child | None = None
    done: trio.Event = field(default_factory=trio.Event)
    log: AgentLog | None = None
    restart_why: str | None = None  # a restart was asked (restart()): why
