"""Real mounts: copying capsules out with the tools people use, as a user
other than the mount's owner (``-o allow_other``), who owns the copies."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from capsulefs.core.store.host_store import HostStore
from helpers import make_agent
from mount_kit import capsulefs, mounted, needs_fuse

pytestmark = [pytest.mark.fuse, needs_fuse,
              pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")]

NOBODY = 65534


@pytest.fixture
def public(_reachable_root: Path) -> Iterator[Path]:
    """A directory every user may enter (pytest's tmp_path is private to
    root), under the test run's own directory (scripts/test.sh checks that
    no mount is left there)."""
    d = Path(tempfile.mkdtemp(prefix="capsulefs-copy-", dir=_reachable_root))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def as_nobody(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv],
                          capture_output=True, text=True, timeout=120)


def test_a_user_copies_a_snapshot_syncs_it_again_and_deletes_the_copy(store: HostStore, state_dir: Path,
                                                                         public: Path) -> None:
    # Snapshot directories were 0555 and copies keep modes: `rm -rf` of a
    # backup made with `cp -a` or `rsync -a` failed with EACCES for its
    # owner (anyone but root). They are 0755 now, like the agent's own
    # directories (and ZFS's .zfs snapshots); writing to them is still EROFS.
    make_agent(store, "alice")
    mnt, backup = public / "mnt", public / "backup"
    backup.mkdir()
    os.chown(backup, NOBODY, NOBODY)
    # (--no-run: as root a running agent's directory is its own uid's, 0700, closed to other users)
    with mounted(state_dir, mnt, "-o", "allow_other", "--no-run"):
        snap = mnt / "alice" / ".snapshots" / "nightly"
        snap.mkdir()
        runs = [["cp", "-a", str(snap), str(backup / "copied")]]
        if shutil.which("rsync"):
            runs += [["rsync", "-a", f"{snap}/", str(backup / "synced")]] * 2  # the second into the first
        for argv in runs:
            done = as_nobody(*argv)
            assert (done.returncode, done.stderr) == (0, ""), done.stderr
        assert capsulefs("verify", str(backup / "copied")).stdout.startswith("OK:")
        done = as_nobody("rm", "-rf", str(backup / "copied"), str(backup / "synced"))
        assert (done.returncode, done.stderr) == (0, ""), done.stderr
        assert os.listdir(backup) == []
        with pytest.raises(OSError) as exc:
            (snap / "memory" / "x").write_text("no")
        assert exc.value.errno == errno.EROFS
