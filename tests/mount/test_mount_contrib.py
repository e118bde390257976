"""contrib/: the mount(8) helper and the systemd unit."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from capsulefs.core.capsule import format as fmt
from capsulefs.core.capsule.spec import default_spec, spec_bytes
from capsulefs.core.store.host_store import HostStore
from helpers import HANG, make_agent, wait_until
from mount_kit import CAPSULEFS, capsulefs, daemon_pids, force_unmount, needs_fuse

REPO = Path(__file__).resolve().parents[2]
HELPER = REPO / "contrib" / "mount.fuse.capsulefs"
UMOUNT_HELPER = REPO / "contrib" / "umount.fuse.capsulefs"
UNIT = REPO / "contrib" / "systemd" / "capsulefs.service"


@pytest.mark.fuse
@needs_fuse
def test_mount_helper_mounts_in_the_background(store: HostStore, state_dir: Path, tmp_path: Path) -> None:
    make_agent(store, "alice")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    env = dict(os.environ, CAPSULEFS=CAPSULEFS)
    try:
        proc = subprocess.run([str(HELPER), str(state_dir), str(mnt), "-o", "rw,_netdev,nofail"],
                              capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert os.path.ismount(mnt)  # mounted before the helper returned
        assert os.listdir(mnt) == ["alice"]
        assert (mnt / "alice" / fmt.WORKING_MEMORY).read_bytes()
        assert "fuse.capsulefs" in Path("/proc/mounts").read_text()
        capsulefs("umount", str(mnt))
        wait_until(lambda: not daemon_pids(mnt), "the daemon to exit")
        assert (state_dir / "mount" / "daemon.log").exists()
    finally:
        force_unmount(mnt)
        for pid in daemon_pids(mnt):
            os.kill(pid, 9)


@pytest.mark.fuse
@needs_fuse
@pytest.mark.parametrize("flags", [[], ["-l"], ["-N", "/proc/self/ns/mnt"]])
def test_umount_helper_asks_the_daemon_or_unmounts_now(store: HostStore, state_dir: Path, tmp_path: Path,
                                                     flags: list[str]) -> None:
    """umount(8) runs the helper as umount.fuse.capsulefs MNT [-flnrv] [-t TYPE]:
    without -l/-f it goes through `capsulefs umount` (the daemon stops its
    agents, then unmounts, and says so in its log); with -l it unmounts
    from outside at once, and so with -N (a copy in another mount namespace,
    which capsulefs umount cannot see; here our own). The agent runs nothing:
    a running agent keeps files of the mount open, and an unmount that is not
    lazy (-N alone) is then refused as busy, rightly (umount(8) does so too);
    on a busy machine the reference agent was still starting when it came."""
    agent = make_agent(store, "alice")
    agent.write_files({fmt.SPEC: spec_bytes(default_spec(None))})  # (no entrypoint: nothing runs)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    env = dict(os.environ, CAPSULEFS=CAPSULEFS)
    try:
        subprocess.run([str(HELPER), str(state_dir), str(mnt)], check=True, env=env, timeout=120)
        assert os.path.ismount(mnt)
        flags = [f"/proc/{os.getpid()}/ns/mnt" if f == "/proc/self/ns/mnt" else f for f in flags]
        proc = subprocess.run([str(UMOUNT_HELPER), str(mnt), *flags, "-n", "-t", "fuse.capsulefs"],
                              capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert not os.path.ismount(mnt)
        wait_until(lambda: not daemon_pids(mnt), "the daemon to exit")
        log = (state_dir / "mount" / "daemon.log").read_text()
        assert ("got SIGTERM: stopping the agents" in log) == (flags == [])
    finally:
        force_unmount(mnt)
        for pid in daemon_pids(mnt):
            os.kill(pid, 9)


@pytest.mark.fuse
@needs_fuse
def test_mount_helper_reports_a_failed_mount(state_dir: Path, tmp_path: Path) -> None:
    env = dict(os.environ, CAPSULEFS=CAPSULEFS)
    proc = subprocess.run([str(HELPER), str(state_dir), str(tmp_path / "missing")], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode != 0
    assert "not a directory" in proc.stderr


@pytest.mark.fuse
@needs_fuse
def test_systemd_mode_notifies_ready(store: HostStore, state_dir: Path, tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    sock_path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(sock_path)
        sock.settimeout(HANG)
        env = dict(os.environ, NOTIFY_SOCKET=sock_path)
        proc = subprocess.Popen([CAPSULEFS, "mount", str(mnt), "--state", str(state_dir), "--systemd"], env=env,
                                stderr=subprocess.DEVNULL)
        try:
            assert sock.recv(256) == b"READY=1"
            assert os.path.ismount(mnt)
            proc.terminate()
            assert sock.recv(256) == b"STOPPING=1"
            assert proc.wait(timeout=30) == 0
        finally:
            force_unmount(mnt)
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_systemd_unit_is_type_notify() -> None:
    text = UNIT.read_text()
    assert "Type=notify" in text and "--systemd" in text and "ExecStart=" in text


def test_umount_signals_only_a_process_of_the_mounts_owner_in_our_pid_namespace(tmp_path, monkeypatch) -> None:
    """The pid comes from whoever serves the mount: a process of another
    uid than the mount's owner is never signalled (umount then unmounts
    from outside), nor one counted in another pid namespace (a daemon in a
    container), nor a pid that is not a positive number."""
    from capsulefs.cli import mount_cmds

    ns = os.stat("/proc/self/ns/pid").st_ino

    def answer(text: str) -> None:  # what the mount's root says, through the child that asks
        monkeypatch.setattr(mount_cmds, "_ASK", f"import sys; sys.stdout.write({text!r})")

    answer(f"{os.getpid()} {ns}")
    monkeypatch.setattr(mount_cmds, "_mount_owner", lambda mnt: os.getuid())
    pidfd = mount_cmds._daemon_pid(str(tmp_path))
    assert pidfd is not None
    os.close(pidfd)
    monkeypatch.setattr(mount_cmds, "_mount_owner", lambda mnt: os.getuid() + 4242)
    assert mount_cmds._daemon_pid(str(tmp_path)) is None
    monkeypatch.setattr(mount_cmds, "_mount_owner", lambda mnt: os.getuid())
    for bad in (f"1 {ns + 1}", f"0 {ns}", f"-1 {ns}", f"{os.getpid()}", "pid ns", "", f"999999999 {ns}"):
        answer(bad)
        assert mount_cmds._daemon_pid(str(tmp_path)) is None, bad
    # A mount that never answers: the child that asks is killed, nothing hangs.
    monkeypatch.setattr(mount_cmds, "_ASK", "import time; time.sleep(3600)")
    monkeypatch.setattr(mount_cmds, "ASK_WAIT", 0.5)
    t0 = time.monotonic()
    assert mount_cmds._daemon_pid(str(tmp_path)) is None
    assert time.monotonic() - t0 < HANG  # (a hang: the child that asks is never given its hour)
