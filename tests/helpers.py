"""Builders shared by tests: agents with content, exported and unpacked capsules."""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

from capsulefs.core.capsule import archive
from capsulefs.core.capsule import format as fmt
from capsulefs.core.store.agent import AgentHandle
from capsulefs.core.store.host_store import HostStore
from capsulefs.move.host import record_new_agent
from capsulefs.peer.identity import load_or_create_identity

HOST = "TESTHOSTAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"

#: A test waits for an event (a file, a status, a log line), never for a
#: time; its deadline only bounds a hang, so it is generous. On a machine
#: slower still, CAPSULEFS_TEST_TIME_FACTOR=N stretches every such deadline.
TIME_FACTOR = float(os.environ.get("CAPSULEFS_TEST_TIME_FACTOR") or 1)
HANG = 120.0 * TIME_FACTOR  # seconds: how long any one awaited event may take before the test fails


def bound(seconds: float) -> float:
    """A deadline that only bounds a hang, stretched by CAPSULEFS_TEST_TIME_FACTOR."""
    return seconds * TIME_FACTOR


def agent_id_for(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()[:32]


def make_agent(store: HostStore, name: str = "alice", workspace: dict[str, bytes] | None = None,
               memory: str = "# notes\nremember the milk\n", *, held: bool = True) -> AgentHandle:
    """An agent with working memory and a workspace whose files are blobs,
    held by this host (as ``capsulefs new`` records it, the manifest naming
    this host, whose identity it creates; ``held=False``: no holder record,
    as after one was lost, and a manifest naming HOST)."""
    # A held agent's manifest names this host, as `capsulefs new` makes it: a daemon runs an agent
    # whose manifest names another host only once that host, as a peer, says it let go (docs/move.md).
    host_id = load_or_create_identity(store.root).host_id if held else HOST
    agent = store.create_agent(name, host_id=host_id, agent_id=agent_id_for(name), working_memory=memory)
    if held:
        record_new_agent(store.root, agent.agent_id, agent.manifest().holder.epoch)
    workspace = {"src/main.py": b"print('hi')\n", "README": b"hello\n"} if workspace is None else workspace
    snap = {}
    with store.writing():
        for path, data in workspace.items():
            snap[path] = store.put_blob(data)
        agent.write_files({fmt.SNAPSHOT: fmt.snapshot_bytes(snap)}, add_blobs=set(snap.values()))
    return agent


def extract_all(tf: tarfile.TarFile, dest: Path) -> None:
    """Unpack a tar the test made: with the "data" filter where this Python
    has it (3.11.4 on; Debian 12's 3.11.2 has none: the tests' own tars only)."""
    if hasattr(tarfile, "data_filter"):
        tf.extractall(dest, filter="data")
    else:
        tf.extractall(dest)


def export_and_unpack(agent: AgentHandle, tmp: Path, name: str = "cap") -> tuple[Path, Path]:
    tar = tmp / f"{name}.tar"
    archive.export_agent(agent, str(tar), mtime=1_700_000_000)
    out = tmp / name
    out.mkdir()
    with tarfile.open(tar) as tf:
        extract_all(tf, out)
    return tar, out


def files_under(root: Path) -> dict[str, bytes]:
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            p = Path(dirpath) / f
            out[str(p.relative_to(root))] = p.read_bytes()
    return out


def wait_until(predicate: Callable[[], object], what: str, limit: float = HANG) -> None:
    """Poll ``predicate`` (for real processes) until true, or fail naming
    ``what`` after ``limit`` seconds (a bound on a hang, not a speed)."""
    deadline = time.monotonic() + limit
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def reference_agent_spec(path: Path, stub_url: str) -> Path:
    """Write a spec that runs the reference agent (``capsulefs agent``) against
    the stub provider at ``stub_url``, its keys fetched from the keychain."""
    path.write_text(json.dumps({
        "version": 1, "entrypoint": ["capsulefs", "agent"],
        "env": {"ANTHROPIC_BASE_URL": stub_url, "OPENAI_BASE_URL": stub_url + "/v1"},
        "secrets": ["ANTHROPIC_API_KEY", "OPENAI_API_KEY"],
    }))
    return path
