"""Real mounts: what `ls`, `cat`, `tar`, `getfattr` and signals see."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest
import xattr

from capsulefs.core.capsule import format as fmt
from capsulefs.core.store.host_store import HostStore
from helpers import HANG, make_agent
from mount_kit import capsulefs, mounted, needs_fuse, status

pytestmark = [pytest.mark.fuse, needs_fuse]


@pytest.fixture
def mnt(tmp_path: Path) -> Path:
    return tmp_path / "mnt"


def test_ls_cat_find_tar_verify(store: HostStore, state_dir: Path, mnt: Path, tmp_path: Path) -> None:
    make_agent(store, "alice")
    make_agent(store, "bob", workspace={"big.bin": os.urandom(3 << 20)})
    with mounted(state_dir, mnt):
        assert sorted(os.listdir(mnt)) == ["alice", "bob"]
        assert (mnt / "alice" / fmt.WORKING_MEMORY).read_text() == "# notes\nremember the milk\n"
        found = subprocess.run(["find", "."], cwd=mnt / "alice", capture_output=True, text=True, check=True).stdout
        assert "./memory/timeline_events.jsonl" in found and ".control" not in found
        for name in ("alice", "bob"):
            tar = tmp_path / f"{name}.tar"
            subprocess.run(["tar", "-C", str(mnt / name), "-cf", str(tar), "."], check=True)
            out = capsulefs("verify", str(tar)).stdout
            assert out.startswith("OK:"), out
        assert capsulefs("verify", str(mnt / "bob")).stdout.startswith("OK:")


def test_hidden_dirs_absent_from_readdir(store: HostStore, state_dir: Path, mnt: Path) -> None:
    make_agent(store, "alice")
    with mounted(state_dir, mnt):
        agent = mnt / "alice"
        ls = subprocess.run(["ls", "-a", str(agent)], capture_output=True, text=True, check=True).stdout.split()
        assert ".control" not in ls and ".snapshots" not in ls
        assert ".control" not in os.listdir(agent)
        assert (agent / ".control").is_dir() and (agent / ".snapshots").is_dir()
        shown = status(agent)
        assert shown["state"] == "active" and shown["name"] == "alice"


def test_ls_la_shows_dot_and_dotdot_with_their_inodes(store: HostStore, state_dir: Path, mnt: Path) -> None:
    make_agent(store, "alice")
    with mounted(state_dir, mnt):
        for d in (mnt / "alice", mnt / "alice" / "memory", mnt / "alice" / ".control"):
            la = subprocess.run(["ls", "-la", str(d)], capture_output=True, text=True, check=True).stdout
            names = [line.split()[-1] for line in la.splitlines()[1:]]
            assert names[:2] == [".", ".."], la
            ai = subprocess.run(["ls", "-ai1", str(d)], capture_output=True, text=True, check=True).stdout
            inos = {name: int(ino) for ino, name in (line.split() for line in ai.splitlines())}
            assert inos["."] == os.stat(d).st_ino and inos[".."] == os.stat(d.parent).st_ino, (d, ai)


def test_xattrs_with_getfattr_and_the_xattr_package(store: HostStore, state_dir: Path, mnt: Path) -> None:
    agent = make_agent(store, "alice")
    with mounted(state_dir, mnt):
        manifest = json.loads((mnt / "alice" / "manifest.json").read_bytes())
        for rel, entry in manifest["files"].items():
            got = subprocess.run(["getfattr", "--only-values", "-n", "user.capsule.sha256", str(mnt / "alice" / rel)],
                                 capture_output=True, text=True, check=True).stdout
            assert got == entry["sha256"]
        x = xattr.xattr(str(mnt / "alice"))
        assert x.get("user.capsule.agent_id").decode() == agent.agent_id
        assert x.get("user.capsule.epoch") == b"1"
        assert set(x.list()) == {"user.capsule.agent_id", "user.capsule.epoch"}
        assert len(xattr.getxattr(str(mnt / "alice" / "manifest.json"), "user.capsule.sha256")) == 64


def test_mkdir_makes_an_agent_rmdir_refuses(store: HostStore, state_dir: Path, mnt: Path) -> None:
    with mounted(state_dir, mnt):
        os.mkdir(mnt / "carol")
        assert os.listdir(mnt) == ["carol"]
        with pytest.raises(OSError) as exc:
            os.rmdir(mnt / "carol")
        assert exc.value.errno == errno.ENOTEMPTY
    assert store.find("carol").manifest().name == "carol"


def test_a_name_that_is_not_utf8_is_einval_and_the_mount_stays_writable(store: HostStore, state_dir: Path,
                                                                        mnt: Path) -> None:
    make_agent(store, "alice")
    with mounted(state_dir, mnt):
        root = os.fsencode(mnt)
        for path in (root + b"/\xff", root + b"/alice/.snapshots/\xff", root + b"/alice/.snapshots/a\xffb"):
            with pytest.raises(OSError) as exc:
                os.mkdir(path)
            assert exc.value.errno == errno.EINVAL, path
        assert status(mnt / "alice")["mount"] == "read-write"
        os.mkdir(mnt / "alice" / ".snapshots" / "after")  # not failsafe: writes still work
        assert os.listdir(mnt) == ["alice"]


def test_a_name_longer_than_255_bytes_is_enametoolong(store: HostStore, state_dir: Path, mnt: Path) -> None:
    # `touch memory/<256 bytes>` said "Operation not permitted", `mkdir <256 bytes>` "Invalid argument"
    make_agent(store, "alice")
    long = "n" * 256
    with mounted(state_dir, mnt):
        agent = mnt / "alice"
        for make in (lambda: (agent / "memory" / long).touch(), lambda: os.mkdir(mnt / long),
                     lambda: os.mkdir(agent / ".snapshots" / long)):
            with pytest.raises(OSError) as exc:
                make()
            assert exc.value.errno == errno.ENAMETOOLONG
        (agent / "memory" / ("n" * 255)).touch()  # 255 is fine
        os.mkdir(agent / ".snapshots" / ("n" * 255))
        assert status(agent)["mount"] == "read-write"


@pytest.mark.expect_error_log
@pytest.mark.capsule_left_broken("a blob is corrupted (and quarantined) on purpose")
def test_corrupt_blob_gives_eio_and_the_mount_stays(store: HostStore, state_dir: Path, mnt: Path) -> None:
    agent = make_agent(store, "alice", workspace={"a": b"A" * 300_000, "b": b"B" * 10})
    bad = next(sha for sha, size in agent.manifest().blobs().items() if size == 300_000)
    obj = Path(store.blob_file(bad))
    obj.chmod(0o644)
    data = bytearray(obj.read_bytes())
    data[-1] ^= 1
    obj.write_bytes(bytes(data))
    with mounted(state_dir, mnt):
        path = mnt / "alice" / fmt.blob_path(bad)
        cat = subprocess.run(["cat", str(path)], capture_output=True)
        assert cat.returncode != 0 and b"Input/output error" in cat.stderr
        with pytest.raises(OSError) as exc:
            path.read_bytes()
        assert exc.value.errno == errno.EIO
        assert os.listdir(mnt) == ["alice"]
        assert (mnt / "alice" / fmt.WORKING_MEMORY).read_bytes()
    log = (state_dir.parent / "daemon-mnt.log").read_text()
    assert "corrupt blob" in log


def test_sigterm_unmounts_cleanly(store: HostStore, state_dir: Path, mnt: Path) -> None:
    make_agent(store, "alice")
    with mounted(state_dir, mnt) as proc:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=HANG) == 0
        assert not os.path.ismount(mnt)


def test_sigint_unmounts_cleanly(store: HostStore, state_dir: Path, mnt: Path) -> None:
    with mounted(state_dir, mnt) as proc:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=HANG) == 0
        assert not os.path.ismount(mnt)


def test_capsulefs_umount(store: HostStore, state_dir: Path, mnt: Path) -> None:
    with mounted(state_dir, mnt) as proc:
        capsulefs("umount", str(mnt))
        assert not os.path.ismount(mnt)
        assert proc.wait(timeout=HANG) == 0
    assert capsulefs("umount", str(mnt), check=False).returncode == 1


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
def test_only_the_mounting_user_and_root_write_control_files(store: HostStore, state_dir: Path,
                                                             _reachable_root: Path) -> None:
    make_agent(store, "alice")
    mnt = Path(tempfile.mkdtemp(prefix="capsulefs-mnt-", dir=_reachable_root))  # traversable by other users
    mnt.chmod(0o755)
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "sh", "-c"]
    try:
        # (--no-run: with agents run isolated, as root, the mount keeps every
        # agent's directory to its own uid; tests/mount/test_sandbox.py checks that)
        with mounted(state_dir, mnt, "--allow-other", "--no-run"):
            ctl = mnt / "alice" / ".control"
            read = subprocess.run([*nobody, f"cat {ctl / 'status'}"], capture_output=True, text=True)
            assert read.returncode == 0 and json.loads(read.stdout)["name"] == "alice"
            for target in (ctl / "model", mnt / "alice" / fmt.WORKING_MEMORY):
                write = subprocess.run([*nobody, f"echo openai:gpt-5 > {target}"], capture_output=True, text=True)
                assert write.returncode != 0 and "Permission denied" in write.stderr
            (ctl / "model").write_text("openai:gpt-5\n")  # root may
            assert (ctl / "model").read_text() == "openai-responses:gpt-5\n"
    finally:
        mnt.rmdir()
