"""Syncing a sandbox into its capsule through the runtime (no kernel mount):
the blobs, the workspace_update event and the snapshot agree, whatever the
agent left in its workspace."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from capsulefs.core import format as fmt
from capsulefs.core import workspace
from capsulefs.core.events import Record
from capsulefs.core.store import HostStore
from capsulefs.daemon import Daemon
from capsulefs.runtime import AgentRuntime

from helpers import make_agent


def _runtime(store: HostStore, state_dir: Path, tmp_path: Path) -> AgentRuntime:
    return AgentRuntime(Daemon(str(state_dir), str(tmp_path / "mnt")))


def _updates(store: HostStore, agent_id: str) -> list[dict]:
    lines = store.agent(agent_id).read(fmt.JOURNAL).splitlines()
    return [dict(r.event.changes) for r in map(Record.from_line, lines) if r.kind == "workspace_update"]


def test_a_name_that_is_not_utf8_is_skipped_not_a_failed_sync(store: HostStore, state_dir: Path, tmp_path: Path) -> None:
    """A file the agent named in another encoding (b'caf\\xe9.txt'): before,
    the sync stored the blobs, then failed journalling the event
    (UnicodeEncodeError), which no freeze handler expects, and the move
    service went down with the daemon. Now the name is skipped and reported;
    the rest syncs."""
    agent = make_agent(store, "alice")
    rt = _runtime(store, state_dir, tmp_path)
    try:
        sandbox = rt.supervisor.sandbox(agent.agent_id)
        workspace.materialize(rt.snapshot(agent.agent_id), rt.read_blob, sandbox)
        with open(os.path.join(os.fsencode(sandbox), b"caf\xe9.txt"), "wb") as f:
            f.write(b"latin-1 name\n")
        Path(sandbox, "plan.md").write_text("next steps\n")
        scan = rt.supervisor.sync_workspace(agent.agent_id)
        assert scan.skipped == ["caf\udce9.txt"]
        snap = rt.snapshot(agent.agent_id)
        assert set(snap) == {"src/main.py", "README", "plan.md"}
        assert _updates(store, agent.agent_id) == [{"plan.md": snap["plan.md"]}]
    finally:
        rt.daemon.live.close()


@pytest.mark.parametrize("refused", ["listing", "searching"])
def test_a_directory_the_scan_cannot_list_keeps_its_files(
        store: HostStore, state_dir: Path, tmp_path: Path, monkeypatch, refused: str) -> None:  # type: ignore[no-untyped-def]
    """A daemon not run as root cannot list a directory the agent made
    unreadable (chmod 000): the walk skipped it silently, so its files were
    journaled as deleted and left the snapshot. One it can list but not
    search (chmod 600) failed the whole scan, so the agent could not move.
    Now their files keep their entries, and the directory is reported.
    (Root may do anything: the refusal is injected at os.open, through
    which the walk opens each directory, or at os.stat of what is in it.)"""
    agent = make_agent(store, "alice", workspace={"src/main.py": b"print('hi')\n", "notes/a.md": b"a\n"})
    rt = _runtime(store, state_dir, tmp_path)
    try:
        sandbox = rt.supervisor.sandbox(agent.agent_id)
        workspace.materialize(rt.snapshot(agent.agent_id), rt.read_blob, sandbox)
        Path(sandbox, "plan.md").write_text("next steps\n")
        real_open, real_stat = os.open, os.stat

        def opening(path, flags, mode=0o777, *, dir_fd=None):  # type: ignore[no-untyped-def]
            if path == "src" and refused == "listing":  # the directory, opened relative to its parent
                raise PermissionError(13, "Permission denied", path)
            return real_open(path, flags, mode, dir_fd=dir_fd)

        def stating(path, *, dir_fd=None, follow_symlinks=True):  # type: ignore[no-untyped-def]
            if path == "main.py" and dir_fd is not None and refused == "searching":
                raise PermissionError(13, "Permission denied", path)
            return real_stat(path, dir_fd=dir_fd, follow_symlinks=follow_symlinks)

        monkeypatch.setattr(os, "open", opening)
        monkeypatch.setattr(os, "stat", stating)
        scan = rt.supervisor.sync_workspace(agent.agent_id)
        monkeypatch.undo()
        assert "src" in scan.skipped
        snap = rt.snapshot(agent.agent_id)
        assert set(snap) == {"src/main.py", "notes/a.md", "plan.md"}
        assert _updates(store, agent.agent_id) == [{"plan.md": snap["plan.md"]}]
    finally:
        rt.daemon.live.close()
