"""A change of an agent's spec or of its secret grants reaches its running process.

Rules:
  * A run starts from one spec and one set of granted secrets; the status
    shows them as ``run.spec`` (``digest``: the sha256 of the spec's
    canonical JSON (:func:`spec_digest`), ``secrets``: the names given).
  * Once a second (:data:`CHECK_SECONDS`), for each running agent, the spec
    as stored and this host's grants are compared with those of its run.
    A different spec (an edit through the mount, a `capsulefs` command), or
    a secret the spec names that is no longer granted (a revoke), restarts
    the agent at its next step boundary; a grant alone changes nothing of a
    running agent (it had every secret its spec names, or it would not run):
    it starts a blocked agent within seconds, as before.
  * A step boundary, for any agent program: the process gets SIGTERM, then
    the supervisor's grace period, then SIGKILL (as at a move's freeze).
    The reference agent stops at its next step boundary on SIGTERM (the
    step under way ends in the journal; calls not yet run are answered as
    interrupted on resume), so its restart loses nothing. The new run starts
    at once, with no backoff, and is not a crash.
  * Each such restart is journaled first, as a ``note`` naming both spec
    digests and what changed, and its reason is in the agent's log.
  * Changed secret values (``capsulefs secret set`` of a granted name) do
    not restart an agent: they reach it at its next start.

Theory of operation: :class:`Steering` is one of the daemon's services, a
loop beside the runtime's reconcile; the restart itself is the supervisor's
(:meth:`capsulefs.agents.supervisor.Supervisor.restart`). Spec files and the
grants file are re-read only when their stat changed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Mapping
from typing import Any, Protocol

import trio

from capsulefs.agents import grants
from capsulefs.core.capsule import format as fmt
from capsulefs.core.errors import CapsuleError
from capsulefs.core.journal.events import Note
from capsulefs.core.store.host_store import HostStore
from capsulefs.core.view.host import LiveHost
from capsulefs.core.store import layout

log = logging.getLogger(__name__)

CHECK_SECONDS = 1.0


def spec_digest(spec: Mapping[str, Any]) -> str:
    """``sha256:<hex>`` of the spec's canonical JSON (sorted keys, no spaces)."""
    data = json.dumps(spec, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    return "sha256:" + hashlib.sha256(data).hexdigest()


class Runs(Protocol):
    """What steering uses of the supervisor (capsulefs/agents/supervisor.py)."""

    def running_specs(self) -> list[tuple[str, str, list[str]]]: ...

    def restart(self, agent_id: str, why: str) -> bool: ...


class Runtime(Protocol):
    """What steering uses of the agent runtime (capsulefs/agents/runtime.py)."""

    @property
    def supervisor(self) -> Runs: ...

    @property
    def store(self) -> HostStore: ...

    @property
    def live(self) -> LiveHost: ...

    def spec(self, agent_id: str) -> Mapping[str, Any]: ...


def _stat_key(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


class Steering:
    def __init__(self, runtime: Runtime, state_dir: str) -> None:
        self.runtime = runtime
        self.state_dir = state_dir
        self._seen: dict[str, tuple[object, ...]] = {}  # agent id -> what was checked last, unchanged since

    def why_restart(self, agent_id: str, digest: str, secrets: list[str]) -> tuple[str, str] | None:
        """(what changed, the new spec digest) if the agent's run is out of
        date with its spec or grants, else None."""
        spec_path = self.runtime.store.agent(agent_id).path(fmt.SPEC)
        key = (digest, _stat_key(spec_path), _stat_key(os.path.join(self.state_dir, layout.GRANTS_FILE)))
        if self._seen.get(agent_id) == key:
            return None
        try:
            spec = self.runtime.spec(agent_id)
            new = spec_digest(spec)
            asked = spec.get("secrets", []) if isinstance(spec, Mapping) else []
            given = grants.granted(self.state_dir, agent_id)
        except (CapsuleError, OSError):
            new, asked, given = "unreadable", [], set()  # (the restart blocks it, saying why)
        self._seen[agent_id] = key
        if new != digest:
            return "its spec changed", new
        if isinstance(asked, list):
            lost = sorted(n for n in secrets if n in asked and n not in given)
            if lost:
                return f"secret(s) {', '.join(lost)} no longer granted", new
        return None

    def check(self) -> None:
        sup = self.runtime.supervisor
        for agent_id, digest, secrets in sup.running_specs():
            why = self.why_restart(agent_id, digest, secrets)
            if why is None:
                continue
            what, new = why
            text = f"restarting the agent at its next step boundary: {what} (spec {digest} -> {new})"
            try:
                self.runtime.live.agent(agent_id).append([Note(text=text)])
            except (CapsuleError, OSError) as exc:
                log.warning("agent %s: cannot journal its restart: %s", agent_id, exc)
            log.info("agent %s: %s", agent_id, text)
            sup.restart(agent_id, what)
            self._seen.pop(agent_id, None)

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            try:
                self.check()
            except Exception:  # never let one bad agent stop the others
                log.exception("steering: check failed")
            await trio.sleep(CHECK_SECONDS)
