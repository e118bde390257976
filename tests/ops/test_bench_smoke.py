"""Every benchmark in bench/ runs to its end at tiny sizes (``--smoke``), on
the venv scripts/setup.sh makes, so that none rots unnoticed. The figures
of a smoke run mean nothing: only that the script works is checked here."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cli_kit import REPO

BENCHES = sorted(p.name for p in (REPO / "bench").glob("bench_*.py"))
NEEDS_MOUNT = {"bench_mount.py", "bench_fleet_move.py"}
NEEDS_ENGINES = {"bench_fleet_move.py"}  # etcd and weed, as the fleet tests start them


def test_every_benchmark_is_here() -> None:
    assert len(BENCHES) >= 9, BENCHES  # (a glob that finds nothing would test nothing)


@pytest.mark.parametrize("bench", [pytest.param(b, marks=pytest.mark.fuse) if b in NEEDS_MOUNT else b for b in BENCHES])
def test_a_benchmark_runs_at_tiny_sizes(bench: str, tmp_path: Path) -> None:
    argv = [sys.executable, str(REPO / "bench" / bench), "--smoke"]
    if bench in NEEDS_MOUNT:
        if not (os.geteuid() == 0 and os.path.exists("/dev/fuse") and shutil.which("fusermount3")):
            pytest.skip(f"{bench} needs root, /dev/fuse and fusermount3")
        argv += ["--dir", str(tmp_path)]  # (its mounts under the test run's directory)
    if bench in NEEDS_ENGINES:
        from fleet_kit import ETCD, WEED

        if ETCD is None or WEED is None:
            pytest.skip(f"{bench} needs etcd and weed (scripts/setup.sh installs them)")
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=600, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"{bench} --smoke exited with {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    assert proc.stdout.strip(), f"{bench} --smoke printed nothing"
    assert "Traceback" not in proc.stderr, proc.stderr
