"""`capsulefs import` beside a running daemon (real mounts): the imported
agent is shown and run as its holder record says from the first request
that sees it, not as a held agent until the daemon restarts."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from capsulefs.core.capsule import format as fmt
from capsulefs.core.store.holder import HolderBook, HolderState
from capsulefs.core.store.host_store import HostStore
from capsulefs.peer.identity import load_or_create_identity
from helpers import wait_until
from mount_kit import capsulefs, export_of, mounted, needs_fuse, status, write_errno

pytestmark = [pytest.mark.fuse, needs_fuse]

def test_an_agent_another_host_holds_imported_beside_the_daemon_is_read_only_and_not_run(
        state_dir: Path, tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    me = load_or_create_identity(state_dir).host_id
    foreign = export_of(tmp_path, "foreign", holder=None)
    mine = export_of(tmp_path, "mine", holder=me)
    capsulefs("--state", str(state_dir), "new", "bystander")
    with mounted(state_dir, mnt):
        wait_until(lambda: (state_dir / "mount" / "daemon.json").exists(), "the daemon's services")
        assert os.listdir(mnt) == ["bystander"]

        out = capsulefs("--state", str(state_dir), "import", str(foreign))
        assert "in-doubt" in out.stdout.splitlines()[1], out.stdout
        wait_until(lambda: "foreign" in os.listdir(mnt), "the imported agent in the mount")
        agent_id = HostStore.open(state_dir).find("foreign").agent_id
        assert HolderBook(state_dir / "holders").get(agent_id).state is HolderState.UNKNOWN

        # Read-only, as any agent this host does not hold: nothing reaches its files.
        before = (state_dir / "agents" / agent_id / fmt.WORKING_MEMORY).read_bytes()
        assert write_errno(mnt / "foreign" / fmt.WORKING_MEMORY, b"written on the wrong host\n", "ab") == errno.EROFS
        assert (state_dir / "agents" / agent_id / fmt.WORKING_MEMORY).read_bytes() == before
        st = status(mnt / "foreign")
        assert st["state"] == "frozen" and st["writable"] is False
        assert st["record"]["state"] == "unknown" and st["record"]["story"]["state"] == "in-doubt"

        # A held agent imported after it runs (so the runtime had its turns at the first one).
        out = capsulefs("--state", str(state_dir), "import", str(mine))
        assert "held" in out.stdout.splitlines()[1], out.stdout
        wait_until(lambda: "mine" in os.listdir(mnt), "the held import in the mount")
        wait_until(lambda: status(mnt / "mine")["run"]["state"] == "running", "the held import to run")
        st = status(mnt / "mine")
        assert st["state"] == "active" and st["writable"] is True and st["record"]["state"] == "held"
        assert write_errno(mnt / "mine" / fmt.WORKING_MEMORY, b"- a note\n", "ab") == 0
        assert (mnt / "mine" / fmt.WORKING_MEMORY).read_bytes().endswith(b"- a note\n")

        run = status(mnt / "foreign")["run"]
        assert run["state"] == "stopped" and "pid" not in run or run.get("pid") is None, run
        assert "in-doubt" in run["detail"], run

        # `capsulefs status` (through the daemon) tells the same story.
        rows = {r["name"]: r for r in json.loads(capsulefs("--state", str(state_dir), "status", "--json").stdout)}
        assert rows["foreign"]["source"] == "daemon" and rows["foreign"]["state"] == "frozen"
        assert rows["foreign"]["holder"]["state"] == "in-doubt" and rows["foreign"]["run"] == "stopped"
        assert rows["mine"]["state"] == "active" and rows["mine"]["run"] == "running"
        assert rows["bystander"]["state"] == "active"
