"""Syncing a sandbox into its capsule through the runtime (no kernel mount):
the blobs, the workspace_update event and the snapshot agree, whatever the
agent left in its workspace."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import trio
import trio.testing

from capsulefs.core.capsule import format as fmt
from capsulefs.core.capsule import workspace
from capsulefs.core.journal.record import Record
from capsulefs.core.store.host_store import HostStore
from capsulefs.daemon.root import MountConfig, compose
from capsulefs.agents.runtime import AgentRuntime

from helpers import make_agent


def _runtime(store: HostStore, state_dir: Path, tmp_path: Path) -> AgentRuntime:
    rt = compose(MountConfig(state_dir=str(state_dir), mountpoint=str(tmp_path / "mnt"))).runtime
    assert rt is not None
    return rt


def _sandbox(rt: AgentRuntime, agent_id: str) -> str:
    """The agent's sandbox, built from its snapshot (as a start does)."""
    sandbox = rt.supervisor.sandbox(agent_id)
    workspace.materialize(rt.snapshot(agent_id), rt.read_blob, sandbox)
    return sandbox


def _updates(store: HostStore, agent_id: str) -> list[dict]:
    lines = store.agent(agent_id).read(fmt.JOURNAL).splitlines()
    return [dict(r.event.changes) for r in map(Record.from_line, lines) if r.kind == "workspace_update"]


async def test_a_name_that_is_not_utf8_is_skipped_not_a_failed_sync(store: HostStore, state_dir: Path, tmp_path: Path) -> None:
    """A file the agent named in another encoding (b'caf\\xe9.txt'): before,
    the sync stored the blobs, then failed journalling the event
    (UnicodeEncodeError), which no freeze handler expects, and the move
    service went down with the daemon. Now the name is skipped and reported;
    the rest syncs."""
    agent = make_agent(store, "alice")
    rt = _runtime(store, state_dir, tmp_path)
    try:
        sandbox = _sandbox(rt, agent.agent_id)
        with open(os.path.join(os.fsencode(sandbox), b"caf\xe9.txt"), "wb") as f:
            f.write(b"latin-1 name\n")
        Path(sandbox, "plan.md").write_text("next steps\n")
        scan = await rt.supervisor.sync_workspace(agent.agent_id)
        assert scan.skipped == ["caf\udce9.txt"]
        snap = rt.snapshot(agent.agent_id)
        assert set(snap) == {"src/main.py", "README", "plan.md"}
        assert _updates(store, agent.agent_id) == [{"plan.md": snap["plan.md"]}]
    finally:
        rt.live.close()


@pytest.mark.parametrize("refused", ["listing", "searching"])
async def test_a_directory_the_scan_cannot_list_keeps_its_files(
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
        sandbox = _sandbox(rt, agent.agent_id)
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
        scan = await rt.supervisor.sync_workspace(agent.agent_id)
        monkeypatch.undo()
        assert "src" in scan.skipped
        snap = rt.snapshot(agent.agent_id)
        assert set(snap) == {"src/main.py", "notes/a.md", "plan.md"}
        assert _updates(store, agent.agent_id) == [{"plan.md": snap["plan.md"]}]
    finally:
        rt.live.close()


async def test_two_syncs_at_once_commit_the_changes_once(
        store: HostStore, state_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scan runs in a worker thread, so a second freeze (or any second
    sync) of the same agent can come while the first scans. It waits for
    the first and then finds nothing new: one workspace_update, not two."""
    agent = make_agent(store, "alice")
    rt = _runtime(store, state_dir, tmp_path)
    try:
        sandbox = _sandbox(rt, agent.agent_id)
        Path(sandbox, "plan.md").write_text("next steps\n")
        release = threading.Event()
        hash_stream = workspace.hash_stream

        def held(f):  # type: ignore[no-untyped-def]
            release.wait(10)
            return hash_stream(f)

        monkeypatch.setattr(workspace, "hash_stream", held)
        scans: list[workspace.ScanResult | None] = []

        async def sync() -> None:
            scans.append(await rt.supervisor.sync_workspace(agent.agent_id))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sync)
            nursery.start_soon(sync)
            await trio.testing.wait_all_tasks_blocked()  # both asked: one scans (held), one waits
            release.set()
        assert sorted(len(s.changes) for s in scans if s is not None) == [0, 1]
        assert _updates(store, agent.agent_id) == [{"plan.md": rt.snapshot(agent.agent_id)["plan.md"]}]
    finally:
        rt.live.close()


async def test_a_cancelled_sync_stops_within_a_file_and_commits_nothing(
        store: HostStore, state_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sync cancelled while it hashes (the daemon shutting down, a second
    signal) stops at the next chunk, not at the end of a workspace of
    gigabytes, and journals nothing; the next sync finds the same changes."""
    agent = make_agent(store, "alice")
    rt = _runtime(store, state_dir, tmp_path)
    try:
        sandbox = _sandbox(rt, agent.agent_id)
        Path(sandbox, "plan.md").write_text("next steps\n")
        entered, release = threading.Event(), threading.Event()
        ended: list[str] = []
        hash_stream = workspace.hash_stream

        def held(f):  # type: ignore[no-untyped-def]
            entered.set()
            release.wait(10)
            try:
                return hash_stream(f)
            except trio.Cancelled:
                ended.append("cancelled before its first chunk")
                raise

        monkeypatch.setattr(workspace, "hash_stream", held)
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(rt.supervisor.sync_workspace, agent.agent_id)
                await trio.to_thread.run_sync(entered.wait, 10)
                scope.cancel()
                release.set()
        assert scope.cancelled_caught
        assert ended == ["cancelled before its first chunk"]
        assert _updates(store, agent.agent_id) == []
        monkeypatch.undo()
        scan = await rt.supervisor.sync_workspace(agent.agent_id)
        assert scan is not None and set(scan.changes) == {"plan.md"}
        assert len(_updates(store, agent.agent_id)) == 1
    finally:
        rt.live.close()


# A process the agent started that escaped its process group and outlived
# it: appends to a workspace file, forever.
APPENDER = r"""
import os, sys
with open(sys.argv[1], "ab", buffering=0) as f:
    print("ready", flush=True)
    n = 0
    while True:
        f.write(b"line %d\n" % n)
        n += 1
"""


async def test_a_file_written_during_the_sync_is_stored_as_listed_or_not_at_all(
        store: HostStore, state_dir: Path, tmp_path: Path) -> None:
    """The scan (in a worker thread) hashes the file, the commit reads it
    again for the store: the bytes stored are only ever those the scan
    hashed, so each sync either journals a digest whose blob holds exactly
    those bytes, or is refused (CorruptBlobError) and journals nothing."""
    import subprocess
    import sys

    from capsulefs.core.errors import CorruptBlobError

    agent = make_agent(store, "alice")
    rt = _runtime(store, state_dir, tmp_path)
    sandbox = _sandbox(rt, agent.agent_id)
    log_file = Path(sandbox, "tool.log")
    outcomes = []
    try:
        with subprocess.Popen([sys.executable, "-c", APPENDER, str(log_file)], stdout=subprocess.PIPE) as writer:
            try:
                assert writer.stdout is not None and writer.stdout.readline() == b"ready\n"
                for _ in range(20):
                    try:
                        scan = await rt.supervisor.sync_workspace(agent.agent_id)
                        outcomes.append("synced" if scan is not None and scan.changes else "unchanged")
                    except CorruptBlobError:
                        outcomes.append("refused")
            finally:
                writer.kill()
    finally:
        rt.live.close()
    updates = _updates(store, agent.agent_id)
    assert len(updates) == outcomes.count("synced")
    final = log_file.read_bytes()
    for changes in updates:
        data = store.read_blob(changes["tool.log"])  # (re-hashed as it is read)
        assert final.startswith(data)  # what the file held at one moment: it only grows
    snap = rt.snapshot(agent.agent_id)
    assert snap.get("tool.log") == (updates[-1]["tool.log"] if updates else None)
