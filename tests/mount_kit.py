"""Real mounts for tests (tier: kernel): the daemon as a real subprocess.

:func:`mounted` starts ``.venv/bin/capsulefs mount MNT --state S``, waits
(bounded) for the mount to appear, and whatever happens unmounts, waits for
the daemon and kills it if it does not exit.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from capsulefs.core.journal.events import line_hash
from capsulefs.core.journal.record import Record
from capsulefs.core.store.host_store import HostStore
from helpers import HANG, reference_agent_spec

CAPSULEFS = str(Path(sys.executable).with_name("capsulefs"))
MOUNT_WAIT = HANG  # seconds a daemon may take to mount (a bound on a hang: a busy machine is slow)
EXIT_WAIT = HANG

needs_fuse = pytest.mark.skipif(
    not (os.path.exists("/dev/fuse") and os.geteuid() == 0 and shutil.which("fusermount3")),
    reason="real mounts need /dev/fuse, root and fusermount3",
)


def capsulefs(*args: str, check: bool = True, **kw: object) -> subprocess.CompletedProcess:
    proc = subprocess.run([CAPSULEFS, *args], capture_output=True, text=True, timeout=120, **kw)  # type: ignore[call-overload]
    if check and proc.returncode != 0:
        raise AssertionError(f"capsulefs {' '.join(args)}: {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def daemon_pids(mnt: Path) -> list[int]:
    """The pids of the ``capsulefs mount`` processes serving ``mnt`` (by their command lines)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if os.fsencode(str(mnt)) in cmd and b"mount" in cmd:
            pids.append(int(pid))
    return pids


#: An agent's spec whose process only sleeps (an import's agent, for a test that only needs it to run).
SLEEPER = {"version": 1, "entrypoint": ["sh", "-c", "exec sleep 600"]}


def export_of(tmp_path: Path, name: str, *, holder: str | None, agent_id: str | None = None,
              spec: dict[str, object] = SLEEPER) -> Path:
    """A capsule tar of a new agent ``name`` (runs ``spec``), made in a state
    directory of its own, whose manifest names ``holder`` at epoch 1 (a copy
    of an agent that host holds, as an export from it carries it); None: that
    other state's own host, as ``capsulefs new`` there makes it. ``agent_id``:
    the agent's id (default: a new one)."""
    other = tmp_path / f"other-{name}"
    if holder is None:
        spec_file = tmp_path / f"spec-{name}.json"
        spec_file.write_text(json.dumps(spec))
        capsulefs("--state", str(other), "new", name, "--spec", str(spec_file))
    else:
        HostStore.open(other).create_agent(name, host_id=holder, agent_id=agent_id or os.urandom(16).hex(),
                                           spec=spec)
    tar = tmp_path / f"{name}.tar"
    capsulefs("--state", str(other), "export", name, "-o", str(tar))
    return tar


def new_reference_agent(tmp_path: Path, stub_url: str, name: str = "pilot") -> Path:
    """A state directory (``tmp_path/state``) holding ``name``, the reference
    agent against the stub provider at ``stub_url``, its keys in the keychain."""
    state = tmp_path / "state"
    spec = reference_agent_spec(tmp_path / "spec.json", stub_url)
    capsulefs("--state", str(state), "new", name, "--spec", str(spec))
    for key in ("ANTHROPIC_API_KEY", "OPENAI_API_KEY"):
        capsulefs("--state", str(state), "secret", "set", key, input="stub-key\n")
    return state


def wait_mounted(mnt: Path, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + MOUNT_WAIT
    while time.monotonic() < deadline:
        if os.path.ismount(mnt):
            return
        if proc.poll() is not None:
            raise AssertionError(f"the daemon exited with {proc.returncode}:\n{log.read_text()}")
        time.sleep(0.025)
    raise AssertionError(f"{mnt} was not mounted within {MOUNT_WAIT:.0f} s:\n{log.read_text()}")


def in_mount_table(mnt: Path) -> bool:
    """Is ``mnt`` mounted? Unlike ``os.path.ismount`` this also sees the mount
    of a daemon that died (stat fails there with ENOTCONN)."""
    path = os.path.abspath(mnt)
    with open("/proc/self/mounts") as f:
        return any(line.split()[1].replace("\\040", " ") == path for line in f if line.strip())


def force_unmount(mnt: Path) -> None:
    if in_mount_table(mnt):
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)
    if in_mount_table(mnt):
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@contextmanager
def mounted(state: Path, mnt: Path, *extra: str) -> Iterator[subprocess.Popen]:
    mnt.mkdir(parents=True, exist_ok=True)
    log = state.parent / f"daemon-{mnt.name}.log"
    with open(log, "ab") as logf:
        proc = subprocess.Popen([CAPSULEFS, "-v", "mount", str(mnt), "--state", str(state), *extra],
                                stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            wait_mounted(mnt, proc, log)
            yield proc
        finally:
            force_unmount(mnt)
            try:
                proc.wait(timeout=EXIT_WAIT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    text = log.read_text(errors="replace")
    assert "Traceback" not in text, text


def check_chains(data: bytes) -> list[Record]:
    """Parse a journal and check every machine's chain (seq 1.., prev = hash of the last line)."""
    recs = []
    last: dict[str, tuple[int, str]] = {}
    for line in data.splitlines():
        r = Record.from_line(line)
        seq, prev = last.get(r.machine, (0, None))
        assert r.seq == seq + 1, f"{r.machine}: seq {r.seq} after {seq}"
        assert r.prev == prev, f"{r.machine} seq {r.seq}: prev does not chain"
        last[r.machine] = (r.seq, line_hash(line))
        recs.append(r)
    clocks = [r.clock for r in recs]
    assert clocks == sorted(clocks)
    return recs


def status(agent: Path) -> dict:
    """An agent's ``.control/status`` on a mount."""
    return json.loads((agent / ".control" / "status").read_bytes())


def write_errno(path: Path, data: bytes, mode: str = "wb") -> int:
    """Write ``data`` to ``path`` (opened with ``mode``) through a mount: 0, or the errno it failed with."""
    try:
        with open(path, mode) as f:
            f.write(data)
    except OSError as exc:
        return exc.errno or 0
    return 0
