"""An agent's sandbox folder on this host, ``STATE/sandboxes/<agent_id>/``:
its workspace, built from the snapshot, and what lives beside it.

Rules:
  * The sandbox is host-local: ``workspace/`` is materialised from the
    agent's snapshot (never half: a failed or cancelled build removes what
    it wrote); ``setup.log`` holds the output of the last build's setup
    steps; ``pid`` the running process's group (capsulefs/agents/process.py).
  * Building, syncing and discarding run in worker threads (a workspace may
    hold gigabytes), under the supervisor's per-agent sandbox lock.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping

import trio

from capsulefs.core.capsule import format as fmt
from capsulefs.core.capsule import workspace
from capsulefs.core.errors import CapsuleError
from capsulefs.core.fsutil import remove_tree
from capsulefs.core.store.layout import SANDBOXES_DIR

#: The host-local sandboxes, under the state dir: ``sandboxes/<agent_id>/``
#: holds ``workspace/``, the running process's ``pid`` file and ``setup.log``.
SETUP_LOG = "setup.log"  # beside workspace/: the output of the last build's setup steps
WORKSPACE_DIR = "workspace"


def sandbox_root(state_dir: str) -> str:
    return os.path.join(state_dir, SANDBOXES_DIR)


def workspace_dir(sandbox_root: str, agent_id: str) -> str:
    return os.path.join(sandbox_root, agent_id, WORKSPACE_DIR)


def discard_sandbox(state_dir: str, agent_id: str) -> None:
    """Remove an agent's sandbox (its process must not run: stop it first)."""
    fmt.check_agent_id(agent_id)
    remove_tree(os.path.join(sandbox_root(state_dir), agent_id), ignore_errors=True)


def remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class SandboxBuildError(CapsuleError):
    """The sandbox could not be made from the snapshot (a full disk, a
    snapshot whose paths collide)."""


def last_line(path: str, start: int) -> str:
    """The last non-blank line written to ``path`` after offset ``start``."""
    with open(path, "rb") as f:
        f.seek(max(start, os.path.getsize(path) - 64 * 1024))
        lines = f.read().decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else ""


def build_sandbox(snapshot: Mapping[str, str], read_blob: Callable[[str], Iterator[bytes]], cwd: str) -> None:
    """Materialise the sandbox from the snapshot unless it exists (in a
    worker thread)."""
    if os.path.isdir(cwd):
        return
    try:
        workspace.materialize(snapshot, read_blob, cwd, check=trio.from_thread.check_cancelled)
    except BaseException as exc:
        # Never leave half a workspace (also not when cancelled): the next
        # try would run the agent in it, and the next sync would delete
        # what is missing.
        remove_tree(cwd, ignore_errors=True)
        if isinstance(exc, (CapsuleError, OSError)):
            raise SandboxBuildError(f"its sandbox could not be built from the snapshot: {exc}") from None
        raise
