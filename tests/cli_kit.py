"""The real ``capsulefs`` CLI, run in a subprocess from the repository (tests import it from here:
each tier has a conftest.py of its own, so ``from conftest import`` would find the tier's)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CAPSULEFS = [sys.executable, "-m", "capsulefs"]


def run_cli(*args: str, state: Path | None = None, check: bool = False, **kw) -> subprocess.CompletedProcess:
    """Run the real ``capsulefs`` CLI in a subprocess."""
    argv = list(CAPSULEFS)
    if state is not None:
        argv += ["--state", str(state)]
    argv += list(args)
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=120, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"capsulefs {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc
