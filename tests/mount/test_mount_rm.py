"""`capsulefs rm` beside a running daemon (real mounts, real daemon processes):
the daemon removes the agent through its ``.control/remove``; and without one."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest

from capsulefs.core.capsule import format as fmt
from capsulefs.core.store.holder import HolderBook, HolderRecord, HolderState
from capsulefs.core.store.host_store import HostStore
from capsulefs.move.host import record_new_agent
from helpers import HOST, make_agent, wait_until
from mount_kit import capsulefs, mounted, needs_fuse, status, write_errno

pytestmark = [pytest.mark.fuse, needs_fuse]


@pytest.fixture
def mnt(tmp_path: Path) -> Path:
    return tmp_path / "mnt"


def _rm(state: Path, *args: str) -> subprocess.CompletedProcess:
    return capsulefs("--state", str(state), "rm", *args, check=False)


def _ls(state: Path) -> list[str]:
    return [r["name"] for r in json.loads(capsulefs("--state", str(state), "ls", "--json").stdout)]



def _settled(state: Path, agent_dir: Path) -> None:
    """Wait until the daemon's start-up work is done: its services started (the
    runtime file) and its own look at the holder records behind it (a few
    requests served), so a record written now is read only by what we ask."""
    wait_until(lambda: (state / "mount" / "daemon.json").exists(), "the daemon's runtime file")
    for _ in range(5):
        status(agent_dir)


def _agent_processes(agent_id: str) -> list[int]:
    """Every process on this host started for the agent (its CAPSULE_AGENT_ID)."""
    mark = f"CAPSULE_AGENT_ID={agent_id}".encode()
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark in f.read().split(b"\0"):
                    out.append(int(pid))
        except OSError:
            pass
    return out


@pytest.mark.parametrize("keep_blobs", [False, True])
def test_rm_through_the_daemon(store: HostStore, state_dir: Path, mnt: Path, keep_blobs: bool) -> None:
    shared = b"shared by both\n"
    doomed = make_agent(store, "doomed", workspace={"shared.txt": shared, "own.bin": os.urandom(4096)})
    keeper = make_agent(store, "keeper", workspace={"shared.txt": shared, "mine.txt": b"keeper's own\n"})
    own_blobs = set(doomed.manifest().blobs()) - set(keeper.manifest().blobs())
    assert len(own_blobs) == 1
    with mounted(state_dir, mnt) as proc:
        os.mkdir(mnt / "doomed" / ".snapshots" / "before-rm")
        (mnt / "doomed" / "memory" / ".notes.swp").write_bytes(b"an editor's swap file\n")  # scratch area
        tar = state_dir.parent / "doomed.tar"
        capsulefs("--state", str(state_dir), "export", "doomed", "-o", str(tar))
        held = open(mnt / "doomed" / fmt.WORKING_MEMORY, "rb")  # open across the removal
        editing = open(mnt / "doomed" / fmt.WORKING_MEMORY, "r+b", buffering=0)
        try:
            out = _rm(state_dir, *(["doomed", "--keep-blobs"] if keep_blobs else ["doomed"]))
            assert out.returncode == 0, out.stderr
            lines = out.stdout.splitlines()
            assert lines[0] == f"removed agent doomed ({doomed.agent_id})"
            if keep_blobs:
                assert len(lines) == 1
            else:
                assert lines[1:] == ["freed 1 unreferenced blob(s), 4096 bytes"]

            assert os.listdir(mnt) == ["keeper"]
            assert not (mnt / "doomed").exists()
            assert _ls(state_dir) == ["keeper"]
            held.seek(0)
            try:
                held.read()  # served from what the handle kept, or refused: never a crash
            except OSError as exc:
                assert exc.errno in (errno.ENOENT, errno.ESTALE, errno.EIO)
            with pytest.raises(FileNotFoundError):  # a writer still open on it writes nothing
                editing.write(b"too late\n")
        finally:
            held.close()
            editing.close()
        assert not (state_dir / "mount" / "snapshots" / doomed.agent_id).exists()
        assert not (state_dir / "mount" / "scratch" / doomed.agent_id).exists()
        assert not (state_dir / "agents" / doomed.agent_id).exists()
        assert own_blobs <= set(store.all_blobs()) if keep_blobs else not own_blobs & set(store.all_blobs())

        # The other agent is untouched and the mount stays up and writable.
        assert os.path.ismount(mnt) and proc.poll() is None
        mine = hashlib.sha256(b"keeper's own\n").hexdigest()
        assert (mnt / "keeper" / fmt.blob_path(mine)).read_bytes() == b"keeper's own\n"
        assert capsulefs("verify", str(mnt / "keeper")).stdout.startswith("OK:")
        with open(mnt / "keeper" / fmt.JOURNAL, "a") as f:
            f.write('{"kind": "note", "text": "still here"}\n')
        assert b"still here" in (mnt / "keeper" / fmt.JOURNAL).read_bytes()
        assert status(mnt / "keeper")["mount"] == "read-write"

        # Imported again (same id) while the daemon runs: shown as a new agent.
        capsulefs("--state", str(state_dir), "import", str(tar))
        wait_until(lambda: sorted(os.listdir(mnt)) == ["doomed", "keeper"], "the re-imported agent")
        assert capsulefs("verify", str(mnt / "doomed")).stdout.startswith("OK:")


def test_rm_stops_the_running_entrypoint(state_dir: Path, mnt: Path, tmp_path: Path) -> None:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"version": 1, "entrypoint": ["sh", "-c", "sleep 600 & exec sleep 601"]}))
    capsulefs("--state", str(state_dir), "new", "runner", "--spec", str(spec))
    capsulefs("--state", str(state_dir), "new", "bystander", "--spec", str(spec))
    ids = {r["name"]: r["agent_id"] for r in json.loads(capsulefs("--state", str(state_dir), "ls", "--json").stdout)}
    with mounted(state_dir, mnt):
        def run(name: str) -> dict:
            return status(mnt / name)["run"]

        wait_until(lambda: run("runner")["state"] == "running" and run("bystander")["state"] == "running",
                   "both agents' processes to run")
        pid = run("runner")["pid"]
        wait_until(lambda: len(_agent_processes(ids["runner"])) == 2, "the entrypoint and its child")
        assert (state_dir / "sandboxes" / ids["runner"] / "workspace").is_dir()
        assert (state_dir / "logs" / ids["runner"] / "agent.log").is_file()

        out = _rm(state_dir, "runner")
        assert out.returncode == 0, out.stderr
        assert out.stdout.splitlines()[0] == f"removed agent runner ({ids['runner']})"
        with pytest.raises(ProcessLookupError):  # stopped and reaped before rm returned
            os.kill(pid, 0)
        assert _agent_processes(ids["runner"]) == []  # its child too: the whole group
        assert not (state_dir / "sandboxes" / ids["runner"]).exists()
        assert not (state_dir / "logs" / ids["runner"]).exists()  # its log goes with it
        assert os.listdir(mnt) == ["bystander"] and _ls(state_dir) == ["bystander"]
        assert run("bystander")["state"] == "running"


@pytest.mark.parametrize("state", [HolderState.FROZEN, HolderState.COMMITTING, HolderState.OFFERED])
def test_rm_is_refused_while_the_agent_is_in_a_move(store: HostStore, state_dir: Path, mnt: Path,
                                                     state: HolderState) -> None:
    agent = make_agent(store, "mover")
    record_new_agent(state_dir, agent.agent_id)
    holders = HolderBook(state_dir / "holders")
    moving = HolderRecord(agent_id=agent.agent_id, state=state, epoch=2, peer=HOST,
                          held_epoch=1 if state is not HolderState.OFFERED else None)
    words = {HolderState.FROZEN: f"frozen, moving to {HOST} at epoch 2",
             HolderState.COMMITTING: f"committing, moving to {HOST} at epoch 2 (in doubt",
             HolderState.OFFERED: f"offered, moving in from {HOST} at epoch 2"}[state]
    files_before = sorted(p.name for p in (state_dir / "agents" / agent.agent_id).rglob("*"))
    with mounted(state_dir, mnt):
        _settled(state_dir, mnt / "mover")
        holders.put(moving)  # as the move driver or service writes it mid-move
        out = _rm(state_dir, "mover")
        assert out.returncode == 1 and out.stdout == ""
        assert out.stderr.count("\n") == 1 and out.stderr.startswith(
            f"capsulefs: error: agent mover ({agent.agent_id}) is in a move ({words}")
        assert "removing it now could lose it on both hosts" in out.stderr and "--abandon" in out.stderr
        # The daemon refuses on its own too (not only the CLI's check).
        remove = mnt / "mover" / ".control" / "remove"
        assert write_errno(remove, agent.agent_id.encode() + b"\n") == errno.EBUSY
        assert os.listdir(mnt) == ["mover"] and _ls(state_dir) == ["mover"]
        assert capsulefs("verify", str(mnt / "mover")).stdout.startswith("OK:")
    assert sorted(p.name for p in (state_dir / "agents" / agent.agent_id).rglob("*")) == files_before
    # Without a daemon the same words.
    offline = _rm(state_dir, "mover")
    assert offline.returncode == 1 and words in offline.stderr
    assert _ls(state_dir) == ["mover"]


def test_a_bad_token_is_einval_and_removes_nothing(store: HostStore, state_dir: Path, mnt: Path) -> None:
    agent = make_agent(store, "alice")
    with mounted(state_dir, mnt):
        remove = mnt / "alice" / ".control" / "remove"
        for data in (b"\n", b"yes\n", b"alice\n", agent.agent_id.upper().encode() + b"\n", b"x" * 4000):
            assert write_errno(remove, data) == errno.EINVAL, data
        stray = subprocess.run(["bash", "-c", f"echo > {remove}"], capture_output=True, text=True)
        assert stray.returncode != 0 and "Invalid argument" in stray.stderr
        assert os.listdir(mnt) == ["alice"] and _ls(state_dir) == ["alice"]
        assert capsulefs("verify", str(mnt / "alice")).stdout.startswith("OK:")


def test_offline_rm_removes_the_agent_its_snapshots_and_sandbox(store: HostStore, state_dir: Path,
                                                                mnt: Path) -> None:
    agent = make_agent(store, "doomed")
    make_agent(store, "keeper", workspace={"x": b"keeper\n"})
    sandbox = state_dir / "sandboxes" / agent.agent_id / "workspace"
    sandbox.mkdir(parents=True)
    with mounted(state_dir, mnt):
        os.mkdir(mnt / "doomed" / ".snapshots" / "before-rm")
        (mnt / "doomed" / "memory" / ".notes.swp").write_bytes(b"swap\n")
    out = _rm(state_dir, "doomed")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == f"removed agent doomed ({agent.agent_id})"
    assert out.stdout.splitlines()[1].startswith("freed 2 unreferenced blob(s)")
    assert not (state_dir / "mount" / "snapshots" / agent.agent_id).exists()
    assert not (state_dir / "mount" / "scratch" / agent.agent_id).exists()
    assert not sandbox.parent.exists()
    assert _ls(state_dir) == ["keeper"]
    assert len(list(store.all_blobs())) == 1  # the snapshot no longer keeps doomed's blobs alive


def test_a_removed_agent_is_no_longer_held_and_a_daemon_restarts_cleanly(store: HostStore, state_dir: Path,
                                                                         mnt: Path, tmp_path: Path) -> None:
    """After rm the holder record no longer says HELD (peers must not hear that
    this host holds it, and a daemon that serves moves re-activates only held
    agents): the daemon with a listener comes up. Importing the agent again
    shows it, in doubt rather than held: another host may have imported the
    same export and taken it meanwhile (see test_move_cli)."""
    capsulefs("--state", str(state_dir), "new", "doomed")  # held by this host, as its export will say
    agent = store.find("doomed")
    tar = tmp_path / "doomed.tar"
    capsulefs("--state", str(state_dir), "export", "doomed", "-o", str(tar))
    assert _rm(state_dir, "doomed").returncode == 0
    rec = HolderBook(state_dir / "holders").get(agent.agent_id)
    assert rec is not None and not rec.holding and rec.removed_here and rec.epoch == 1
    with mounted(state_dir, mnt, "--listen", "127.0.0.1:0") as proc:
        wait_until(lambda: (state_dir / "mount" / "daemon.json").exists(), "the daemon's services")
        assert os.listdir(mnt) == [] and proc.poll() is None
        capsulefs("--state", str(state_dir), "import", str(tar))
        wait_until(lambda: os.listdir(mnt) == ["doomed"], "the re-imported agent")
        assert capsulefs("verify", str(mnt / "doomed")).stdout.startswith("OK:")
    assert HolderBook(state_dir / "holders").get(agent.agent_id).state is HolderState.UNKNOWN


def test_one_daemon_per_state_directory_and_no_offline_rm_beside_one(store: HostStore, state_dir: Path,
                                                                     mnt: Path, tmp_path: Path) -> None:
    """A second daemon on the same state would run every agent twice on this
    host: it is refused with one line naming the first, which stays up. An
    offline rm while a daemon holds the state (e.g. still starting, before
    its runtime file exists) is refused too, and removes nothing."""
    import fcntl

    from capsulefs.daemon.daemon import LOCK_FILE
    from capsulefs.core.store.layout import WORK_DIR

    make_agent(store, "alice")
    other = tmp_path / "mnt2"
    other.mkdir()
    with mounted(state_dir, mnt) as proc:
        second = capsulefs("mount", str(other), "--state", str(state_dir), check=False)
        assert second.returncode == 1 and second.stderr.count("\n") == 1, second.stderr
        assert f"mounted on {mnt}" in second.stderr and "refused" in second.stderr
        assert not os.path.ismount(other) and proc.poll() is None and os.listdir(mnt) == ["alice"]
    # A holder that has not written its runtime file yet (a daemon starting).
    with open(state_dir / WORK_DIR / LOCK_FILE, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        out = _rm(state_dir, "alice")
    assert out.returncode == 1 and "another capsulefs daemon or command already holds" in out.stderr
    assert _ls(state_dir) == ["alice"]
    assert _rm(state_dir, "alice").returncode == 0
