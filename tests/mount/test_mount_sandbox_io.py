"""A sandbox's bulk I/O never stalls the mount (a real mount served in this process).

Freezing an agent scans and hashes its whole workspace and stores what
changed; starting one builds its workspace from the snapshot. A workspace
may hold gigabytes, and the daemon's event loop serves every agent's files:
that work runs in a worker thread. Here the scan (or the build) is held at
its first file until another agent's file has been answered through the
mount; before, the held work blocked the loop, so the answer came only once
the hold gave up (GATE_LIMIT), and the test fails.

The FUSE loop runs in this test's trio loop, so every access to the mount
goes through a worker thread.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from capsulefs.core.capsule import format as fmt
from capsulefs.core.capsule import workspace
from capsulefs.core.journal.events import Note
from capsulefs.core.journal.record import Record
from capsulefs.core.view.journal_tail import open_appender
from capsulefs.core.capsule.spec import default_spec, spec_bytes
from capsulefs.core.store.agent import AgentHandle
from capsulefs.core.store.host_store import HostStore
from capsulefs.daemon.root import MountConfig, Mounted, compose
from capsulefs.agents.runtime import AgentRuntime
from helpers import HANG, make_agent
from mount_kit import force_unmount, needs_fuse

pytestmark = [pytest.mark.fuse, needs_fuse]

GATE_LIMIT = HANG  # seconds a held scan or build waits for the probe before it gives up (the test then fails)


class Gate:
    """Holds the first call of a function (in whatever thread runs it) until
    :meth:`release`, or GATE_LIMIT; records whether the release came first."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self._release = threading.Event()
        self.released_in_time: list[bool] = []

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def held(*args: Any, **kw: Any) -> Any:
            if not self.entered.is_set():
                self.entered.set()
                self.released_in_time.append(self._release.wait(GATE_LIMIT))
            return fn(*args, **kw)

        return held

    def release(self) -> None:
        self._release.set()


def _warm_journal(tmp_path: Path) -> None:
    # The journal may run a helper process on its first append (to find
    # libc); a process must not fork while its own threads hold files open
    # on a mount it serves itself. Make that first append before mounting.
    warm = tmp_path / "warm.jsonl"
    warm.write_bytes(b"")
    open_appender(str(warm), machine="WARM", new_id=lambda: "0" * 24, now_ns=lambda: 1,
                  recovery_dir=str(tmp_path / "rec")).append(Note(text="warm"))


def _daemon(state_dir: Path, tmp_path: Path) -> tuple[Mounted, AgentRuntime, Path]:
    """A daemon with its runtime, to be served in this process at ``tmp_path/mnt``."""
    _warm_journal(tmp_path)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    m = compose(MountConfig(state_dir=str(state_dir), mountpoint=str(mnt), notify=lambda m: True))
    assert m.runtime is not None
    return m, m.runtime, mnt


def _agent(store: HostStore, name: str, entrypoint: list[str] | None = None) -> AgentHandle:
    agent = make_agent(store, name)
    agent.write_files({fmt.SPEC: spec_bytes(default_spec(entrypoint))})
    return agent


def _kinds(store: HostStore, agent_id: str) -> list[Record]:
    return [Record.from_line(line) for line in store.agent(agent_id).read(fmt.JOURNAL).splitlines()]


def _probe(gate: Gate, mnt: Path, other: str, busy: str) -> dict[str, Any]:
    """While the gate holds the busy agent's work: read another agent's
    status and working memory, and append to the busy agent's own journal,
    through the mount; then release the gate."""
    try:
        if not gate.entered.wait(GATE_LIMIT):
            raise AssertionError("the scan or build never began")
        status = json.loads((mnt / other / ".control" / "status").read_bytes())
        memory = (mnt / other / fmt.WORKING_MEMORY).read_text()
        try:
            with open(mnt / busy / fmt.JOURNAL, "a") as f:
                f.write(json.dumps({"kind": "note", "text": "written during the scan"}) + "\n")
            appended = 0
        except OSError as exc:  # (EROFS: it came only after the freeze)
            appended = exc.errno or -1
        return {"status": status, "memory": memory, "appended": appended}
    finally:
        gate.release()


async def test_a_freeze_scanning_a_workspace_leaves_every_other_agent_served(
        store: HostStore, state_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    busy = _agent(store, "busy")
    _agent(store, "other")
    daemon, rt, mnt = _daemon(state_dir, tmp_path)
    sandbox = rt.supervisor.sandbox(busy.agent_id)
    workspace.materialize(rt.snapshot(busy.agent_id), rt.read_blob, sandbox)
    Path(sandbox, "plan.md").write_text("next steps\n")
    gate = Gate()
    monkeypatch.setattr(workspace, "hash_stream", gate.wrap(workspace.hash_stream))
    seen: list[dict[str, Any]] = []
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(daemon.daemon.serve)

            async def probe() -> None:
                seen.append(await trio.to_thread.run_sync(_probe, gate, mnt, "other", "busy"))

            nursery.start_soon(probe)
            await daemon.agents.freeze(busy.agent_id)
            with trio.fail_after(GATE_LIMIT * 2):
                while not seen:
                    await trio.sleep(0.01)
            daemon.daemon.stop()
    finally:
        force_unmount(mnt)
    assert gate.released_in_time == [True], "the mount did not answer while the scan ran"
    assert seen[0]["status"]["state"] == "active" and "milk" in seen[0]["memory"]
    assert seen[0]["appended"] == 0
    records = _kinds(store, busy.agent_id)
    # The write that came during the scan is kept, and so is the sync, once.
    assert [r.event.text for r in records if r.kind == "note"] == ["written during the scan"]
    assert [dict(r.event.changes) for r in records if r.kind == "workspace_update"] == [
        {"plan.md": rt.snapshot(busy.agent_id)["plan.md"]}]
    assert store.read_blob(rt.snapshot(busy.agent_id)["plan.md"]) == b"next steps\n"


async def test_building_a_sandbox_leaves_every_other_agent_served(
        store: HostStore, state_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent starting (after a move in, or a restart of the daemon) has
    its workspace written from the snapshot's blobs first."""
    busy = _agent(store, "busy", [sys.executable, "-c", "import time; time.sleep(600)"])
    _agent(store, "other")
    daemon, rt, mnt = _daemon(state_dir, tmp_path)
    gate = Gate()
    monkeypatch.setattr(workspace, "atomic_write_at", gate.wrap(workspace.atomic_write_at))
    seen: list[dict[str, Any]] = []
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(daemon.daemon.serve)
            seen.append(await trio.to_thread.run_sync(_probe, gate, mnt, "other", "busy"))
            with trio.fail_after(GATE_LIMIT * 2):
                while rt.supervisor.status(busy.agent_id).pid is None:
                    await trio.sleep(0.01)
            daemon.daemon.stop()
    finally:
        force_unmount(mnt)
    assert gate.released_in_time == [True], "the mount did not answer while the sandbox was built"
    assert seen[0]["status"]["state"] == "active" and "milk" in seen[0]["memory"]
    assert seen[0]["appended"] == 0
    assert sorted(os.listdir(rt.supervisor.sandbox(busy.agent_id))) == ["README", "src"]
