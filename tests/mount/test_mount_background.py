"""``mount --background``: a daemon that cannot mount says why, in one line."""

from __future__ import annotations

import os
from pathlib import Path

from capsulefs.core.store.host_store import HostStore
from helpers import make_agent, wait_until
from mount_kit import capsulefs, daemon_pids, force_unmount, needs_fuse


@needs_fuse
def test_a_second_background_mount_of_one_state_says_why_in_one_line(store: HostStore, state_dir: Path,
                                                                     tmp_path: Path) -> None:
    """The second daemon is refused (the state directory is held): the
    command exits non-zero with one line that gives the reason and names the
    log it wrote to, and no traceback, neither on stderr nor in the log."""
    make_agent(store, "alice")
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    log = state_dir / "mount" / "daemon.log"
    try:
        up = capsulefs("mount", str(first), "--state", str(state_dir), "--background", "--no-run")
        assert up.stderr == ""
        assert os.path.ismount(first)
        proc = capsulefs("mount", str(second), "--state", str(state_dir), "--background", check=False)
        assert proc.returncode == 1
        lines = proc.stderr.splitlines()
        assert len(lines) == 1, proc.stderr
        assert "Traceback" not in proc.stderr
        assert f"already holds {state_dir}" in lines[0]  # the reason
        assert str(log) in lines[0]  # the log, by its path
        assert not os.path.ismount(second)
        text = log.read_text()
        assert "already holds" in text and "Traceback" not in text
        assert os.path.ismount(first)  # the first daemon still serves
        capsulefs("umount", str(first))
        wait_until(lambda: not daemon_pids(first), "the first daemon to exit")
    finally:
        for mnt in (first, second):
            force_unmount(mnt)
            for pid in daemon_pids(mnt):
                os.kill(pid, 9)


@needs_fuse
def test_a_background_mount_that_cannot_log_says_why(store: HostStore, state_dir: Path, tmp_path: Path) -> None:
    """A log file that cannot be opened is a reason too: one line naming it."""
    make_agent(store, "alice")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    bad = tmp_path / "a-file"
    bad.write_text("")
    try:
        proc = capsulefs("mount", str(mnt), "--state", str(state_dir), "--background",
                         "--log-file", str(bad / "daemon.log"), check=False)
        assert proc.returncode == 1
        assert len(proc.stderr.splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert str(bad / "daemon.log") in proc.stderr
        assert not os.path.ismount(mnt)
    finally:
        force_unmount(mnt)
        for pid in daemon_pids(mnt):
            os.kill(pid, 9)
