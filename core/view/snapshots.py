"""Point-in-time, read-only snapshots of an agent, for backup tools.

Layout, under ``<state>/mount/snapshots/``::

    <agent_id>/<name>/manifest.json     the snapshot's manifest (mode 0444)
    <agent_id>/<name>/<capsule path>    every non-blob file, as frozen (0444)
    <agent_id>/.tmp-*                   a snapshot being made; swept on open

Rules:
  * A snapshot is one consistent state: every non-blob file is read once
    (the journal up to its last whole line, see ``archive.snapshot_files``)
    and the manifest is computed from exactly those bytes, so a snapshot
    verifies however much the agent writes meanwhile.
  * Blobs are not copied: a snapshot lists them and they are served from
    the host store, like the live agent's; ``HostStore.gc`` keeps every
    blob a snapshot lists (the store knows this directory's layout).
  * A snapshot appears whole or not at all: it is written into a temporary
    directory and renamed into place; removing it renames it away first.
  * Snapshot names follow the agent-name rules (one path component, not
    hidden, no control characters).
  * Snapshots belong to the agent's stay on this host: they go when it is
    removed or moves away, and those of an agent the store no longer has
    (a removal cut short) go when the next mount starts (``core.view.host``).
"""

from __future__ import annotations

import os
import secrets

from ..capsule import format as fmt
from ..capsule.archive import frozen_manifest, snapshot_files
from ..errors import ExistsError, FormatError, NotFoundError
from ..fsutil import TMP_PREFIX, atomic_write, fsync_dir, makedirs_durable, remove_tree, subdirs
from ..store.agent import AgentHandle


#: The snapshots' directory under the mount's work directory (``<state>/mount``).
SUBDIR = "snapshots"


#: Seconds :meth:`Snapshots.create` waits for a `capsulefs append` to finish
#: with the agent's files. Short: it runs on the daemon's loop; the mount
#: waits for the lock off its loop first (``LiveHost.mkdir_lock``).
FILES_WAIT = 2.0


class Snapshots:
    def __init__(self, root: str) -> None:
        self.root = root

    @classmethod
    def under(cls, work_dir: str) -> "Snapshots":
        """The snapshots of the mount whose work directory is ``work_dir``."""
        return cls(os.path.join(work_dir, SUBDIR))

    def _agent_dir(self, agent_id: str) -> str:
        fmt.check_agent_id(agent_id)
        return os.path.join(self.root, agent_id)

    def dir(self, agent_id: str, name: str) -> str:
        fmt.check_agent_name(name)
        return os.path.join(self._agent_dir(agent_id), name)

    def agent_ids(self) -> list[str]:
        """The agents that have a snapshot directory here."""
        return subdirs(self.root, fmt.is_agent_id)

    def names(self, agent_id: str) -> list[str]:
        try:
            return sorted(
                n for n in os.listdir(self._agent_dir(agent_id))
                if not n.startswith(".") and os.path.isfile(os.path.join(self._agent_dir(agent_id), n, fmt.MANIFEST))
            )
        except FileNotFoundError:
            return []

    def exists(self, agent_id: str, name: str) -> bool:
        try:
            return os.path.isfile(os.path.join(self.dir(agent_id, name), fmt.MANIFEST))
        except FormatError:
            return False

    def create(self, agent: AgentHandle, name: str, *, wait: float = FILES_WAIT) -> fmt.Manifest:
        """Make snapshot ``name``: the agent's files as one `capsulefs append` from
        another process leaves them, before or after it (FilesBusy after ``wait``)."""
        dest = self.dir(agent.agent_id, name)
        if os.path.exists(dest):
            raise ExistsError(f"snapshot {name!r} of agent {agent.agent_id} already exists")
        parent = self._agent_dir(agent.agent_id)
        makedirs_durable(parent, 0o755)
        with agent.store.writing():  # gc must not take a blob the snapshot is about to list
            files = snapshot_files(agent, wait=wait)
            manifest = frozen_manifest(agent, files)
            tmp = os.path.join(parent, TMP_PREFIX + secrets.token_hex(8))
            os.mkdir(tmp, 0o755)
            try:
                for rel, data in files.items():
                    p = os.path.join(tmp, rel)
                    makedirs_durable(os.path.dirname(p))
                    atomic_write(p, data, mode=0o444)
                atomic_write(os.path.join(tmp, fmt.MANIFEST), manifest.to_bytes(), mode=0o444)
                os.rename(tmp, dest)
            except BaseException:
                remove_tree(tmp, ignore_errors=True)
                raise
        fsync_dir(parent)
        return manifest

    def remove(self, agent_id: str, name: str) -> None:
        d = self.dir(agent_id, name)
        if not os.path.isdir(d):
            raise NotFoundError(f"no snapshot {name!r} of agent {agent_id}")
        trash = os.path.join(self._agent_dir(agent_id), TMP_PREFIX + secrets.token_hex(8))
        os.rename(d, trash)
        fsync_dir(self._agent_dir(agent_id))
        remove_tree(trash)

    def sweep(self) -> None:
        """Remove half-made or half-removed snapshots (a crash left them)."""
        if not os.path.isdir(self.root):
            return
        for agent_id in os.listdir(self.root):
            d = os.path.join(self.root, agent_id)
            for n in os.listdir(d) if os.path.isdir(d) else ():
                if n.startswith(TMP_PREFIX):
                    remove_tree(os.path.join(d, n), ignore_errors=True)

    def manifest(self, agent_id: str, name: str) -> fmt.Manifest:
        try:
            with open(os.path.join(self.dir(agent_id, name), fmt.MANIFEST), "rb") as f:
                return fmt.Manifest.from_bytes(f.read())
        except FileNotFoundError:
            raise NotFoundError(f"no snapshot {name!r} of agent {agent_id}") from None

    def file_path(self, agent_id: str, name: str, rel: str) -> str:
        fmt.check_relpath(rel)
        return os.path.join(self.dir(agent_id, name), rel)

    def remove_agent(self, agent_id: str) -> None:
        """Remove every snapshot of an agent (it is being removed from the host)."""
        remove_tree(self._agent_dir(agent_id), ignore_errors=True)
