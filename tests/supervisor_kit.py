"""Helpers shared by test modules (moved from test_supervisor.py)."""

from __future__ import annotations

import contextlib
import json
import os
import time
import trio
import trio.testing
from capsulefs.agents import grants
from capsulefs.core.capsule import format as fmt
from capsulefs.core.capsule import workspace
from capsulefs.core.journal.projections import apply_workspace_changes
from capsulefs.core.capsule.spec import spec_bytes
from capsulefs.core.store.agent import AgentHandle
from capsulefs.core.store.host_store import HostStore
from helpers import HANG, make_agent


class StoreHooks:
    def __init__(self, store: HostStore, capsule_root: str) -> None:
        self.store, self.capsule_root = store, capsule_root
        self.commits: list[workspace.ScanResult] = []

    def agent(self, agent_id: str) -> AgentHandle:
        return self.store.agent(agent_id)

    def spec(self, agent_id: str):
        return json.loads(self.agent(agent_id).read(fmt.SPEC))

    def snapshot(self, agent_id: str):
        return fmt.parse_snapshot(self.agent(agent_id).read(fmt.SNAPSHOT))

    def read_blob(self, sha: str):
        return self.store.iter_blob(sha)

    def blobs_for_build(self, agent_id: str, snapshot):
        return contextlib.nullcontext()  # (no blob tier)

    def capsule_dir(self, agent_id: str) -> str:
        return os.path.join(self.capsule_root, self.agent(agent_id).name)

    def commit_workspace(self, agent_id: str, scan: workspace.ScanResult) -> None:
        self.commits.append(scan)
        snap = dict(self.snapshot(agent_id))
        with self.store.writing():
            for sha, path in scan.new_files.items():
                with workspace.open_regular(scan.root, path) as f:
                    self.store.put_blob_stream(f, expect=sha)
            apply_workspace_changes(snap, scan.changes)
            self.agent(agent_id).write_files({fmt.SNAPSHOT: fmt.snapshot_bytes(snap)}, add_blobs=set(scan.new_files))


def agent_with_spec(store: HostStore, spec: dict, *, granted: bool = True) -> AgentHandle:
    """An agent with ``spec``, granted the secrets it asks for (as by
    'capsulefs new --spec') unless ``granted`` is false."""
    agent = make_agent(store, "runner", workspace={"notes/todo.txt": b"write tests\n"})
    agent.write_files({fmt.SPEC: spec_bytes(spec)})
    if granted and spec.get("secrets"):
        grants.grant(store.root, agent.agent_id, spec["secrets"])
    return agent


async def wait_for(predicate, what: str, limit: float = HANG) -> None:
    """Poll ``predicate`` until true, or fail after ``limit`` real seconds
    (a bound on a hang: what is awaited is often a real process, which
    trio's clock, virtual under MockClock, knows nothing of).

    The supervisor builds and syncs sandboxes in worker threads; while one
    works, no deadline of this wait is pending, so the autojump clock does
    not run ahead of it (a thread's real milliseconds are not virtual minutes)."""
    deadline = time.monotonic() + limit
    while not predicate():
        if trio.testing.active_thread_count():
            await trio.testing.wait_all_threads_completed()
            continue
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await trio.sleep(0.01)
