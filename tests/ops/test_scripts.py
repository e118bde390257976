"""scripts/test.sh: what it checks after a run.

It runs pytest on a one-test file made here (setup.sh first, which does
nothing on a machine already set up)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from cli_kit import REPO

LEAVES = """\
import os, pathlib, subprocess

def test_leaves_a_mount_or_not():
    d = pathlib.Path(os.environ["CAPSULEFS_TEST_ROOT"]) / "a mount"  # (the mount table escapes the space)
    d.mkdir()
    pathlib.Path({out!r}).write_text(str(d))
    if {leave!r}:
        subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(d)], check=True)
"""


def umount(path: Path) -> None:
    with open("/proc/self/mounts") as f:
        if any(line.split()[1].replace("\\040", " ") == str(path) for line in f):
            subprocess.run(["umount", "-l", str(path)], check=True)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("mount") is None, reason="mounts a tmpfs: needs root")
@pytest.mark.parametrize("leave", [True, False], ids=["a-mount-left", "nothing-left"])
def test_test_sh_fails_only_for_a_mount_left_under_its_own_run(tmp_path: Path, leave: bool) -> None:
    """A mount a test leaves under the run's directory fails the run and is
    named; an unrelated mount elsewhere (a user's sshfs, another run's
    mounts) does not, and is not named."""
    elsewhere, out = tmp_path / "elsewhere", tmp_path / "mount-point"
    elsewhere.mkdir()
    test = tmp_path / "test_one.py"
    test.write_text(LEAVES.format(out=str(out), leave=leave))
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(elsewhere)], check=True)
    try:
        proc = subprocess.run(["bash", str(REPO / "scripts" / "test.sh"), str(test)],
                              capture_output=True, text=True, timeout=600, cwd=tmp_path,
                              env={**os.environ, "CAPSULEFS_LINT": "0", "CAPSULEFS_TEST_WORKERS": "0"})
        mnt = Path(out.read_text())
        run_root = mnt.parent
        assert str(elsewhere) not in proc.stderr
        if leave:
            assert proc.returncode == 1, proc.stdout + proc.stderr
            assert f"mounts left behind under {run_root}" in proc.stderr and f"\n{mnt}\n" in proc.stderr
            assert mnt.is_dir()  # kept, never removed through the mount
        else:
            assert proc.returncode == 0, proc.stdout + proc.stderr
            assert not run_root.exists()  # the run's directory is removed
    finally:
        if out.exists():
            umount(Path(out.read_text()))
            shutil.rmtree(Path(out.read_text()).parent, ignore_errors=True)
        umount(elsewhere)
