"""The workspace scan against a hostile sandbox: files the agent process made
(and an escaped child of it still changes) are never followed out of it."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import time
from pathlib import Path

import pytest

from capsulefs.core.capsule import workspace
from capsulefs.core.errors import UnsafePathError

# An agent's child that escaped its process group: swaps a workspace file
# between a regular file and a symlink (or a FIFO) to a host file, forever.
SWAPPER = r"""
import os, sys
ws, target, kind = sys.argv[1], sys.argv[2], sys.argv[3]
f = os.path.join(ws, "f")
r, s = (os.path.join(os.path.dirname(ws), n) for n in (".r", ".s"))
while True:
    with open(r, "w") as g:
        g.write("mine\n")
    if kind == "symlink":
        os.symlink(target, s)
    else:
        os.mkfifo(s)
    os.rename(s, f)
    os.rename(r, f)
"""


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_a_file_swapped_during_the_scan_is_never_followed(tmp_path: Path, kind: str, caplog) -> None:
    host_file = tmp_path / "host-secret"
    host_file.write_text("HOST-SECRET\n")
    leaked = hashlib.sha256(b"HOST-SECRET\n").hexdigest()
    ws = tmp_path / "ws"
    ws.mkdir()
    swapper = subprocess.Popen([sys.executable, "-c", SWAPPER, str(ws), str(host_file), kind])
    try:
        scans = 0
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            # (a FIFO opened for reading would block the daemon here for good)
            result = workspace.scan(str(ws), {})
            scans += 1
            assert leaked not in result.new_files, f"scan {scans} read the host file through the workspace"
            for path in result.new_files.values():  # what the commit reads: the same file, or a refusal
                try:
                    with workspace.open_regular(result.root, path) as f:
                        assert f.read() in (b"mine\n", b"")
                except UnsafePathError:
                    pass
    finally:
        swapper.kill()
        swapper.wait()
    assert scans > 10
