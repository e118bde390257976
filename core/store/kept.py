"""Copies kept when this host gives up an agent it may know more of than its holder.

Rules:
  * Nothing acknowledged is ever deleted. Before a host drops the files of
    an agent it learned it does not hold (``capsulefs move AGENT --learn``
    finding a peer with a newer epoch), or of an agent in doubt that an
    operator removes (``rm`` of an UNKNOWN record), it keeps a whole copy:
    journal, working memory, snapshot, spec, every blob its manifest lists.
  * The copy is a capsule directory that verifies (``capsulefs verify``),
    under ``<state>/recovery/<agent_id>/`` beside the torn journal tails
    (:mod:`capsulefs.core.journal.recovery`), named
    ``kept-e<epoch>-<UTC time>`` (the epoch its files were held at).
    ``capsulefs merge`` takes it as one side (docs/move.md, "Merging what a
    host kept"); the journal merge is a set union, so the holder gains
    exactly the lines it lacked.
  * It is written whole or not at all: staged under a temporary name in the
    same directory, verified, renamed, the directory fsynced. If it cannot be
    kept (a full disk, a blob missing), the caller drops nothing.
  * Blobs are hard links to the store's objects (files never changed in
    place), copied where a link is not possible; ``gc`` never looks here.

Theory of operation: the agent's files are read as an export reads them
(``archive.snapshot_files``, under the agent's files lock), the manifest is
frozen over them, and the tree is written like a merge's output.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import time

from ..capsule import format as fmt
from ..errors import CapsuleError
from ..fsutil import TMP_PREFIX, atomic_write, fsync_dir, makedirs_durable, remove_tree
from ..journal.recovery import agent_recovery_dir
from .agent import AgentHandle

log = logging.getLogger(__name__)

#: The name of a kept copy starts with this (torn tails are ``<journal>.torn-<n>``).
KEPT_PREFIX = "kept-"

__all__ = ["KEPT_PREFIX", "KeepFailed", "keep_copy", "kept_copies"]


class KeepFailed(CapsuleError):
    """The copy could not be kept: nothing may be dropped."""


def kept_copies(store_root: str, agent_id: str) -> list[str]:
    """The kept copies of an agent, oldest first (paths)."""
    d = agent_recovery_dir(store_root, agent_id)
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return []
    return [os.path.join(d, n) for n in sorted(names) if n.startswith(KEPT_PREFIX)]


def keep_copy(agent: AgentHandle, *, now_ns: int | None = None) -> str:
    """Keep a whole copy of ``agent`` as a capsule directory under its
    recovery directory; return its path. KeepFailed if it could not."""
    from ..capsule.archive import frozen_manifest, snapshot_files, verify_capsule

    store = agent.store
    try:
        files = snapshot_files(agent)
        manifest = frozen_manifest(agent, files)
    except (CapsuleError, OSError) as exc:
        raise KeepFailed(f"agent {agent.agent_id}: its files could not be read to keep a copy: {exc}") from exc
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime((time.time_ns() if now_ns is None else now_ns) / 1e9))
    parent = agent_recovery_dir(store.root, agent.agent_id)
    base = f"{KEPT_PREFIX}e{manifest.holder.epoch}-{stamp}"
    makedirs_durable(parent)
    tree = os.path.join(parent, TMP_PREFIX + os.urandom(8).hex())
    try:
        os.mkdir(tree, 0o700)
        for rel, data in files.items():
            path = os.path.join(tree, rel)
            makedirs_durable(os.path.dirname(path))
            atomic_write(path, data)
        for sha in manifest.blobs():
            path = os.path.join(tree, fmt.blob_path(sha))
            makedirs_durable(os.path.dirname(path))
            _link_or_copy(store.blob_file(sha), path)
        atomic_write(os.path.join(tree, fmt.MANIFEST), manifest.to_bytes())
        _manifest, problems = verify_capsule(tree)
        if problems:
            raise KeepFailed(f"agent {agent.agent_id}: the copy to keep does not verify: "
                             + "; ".join(str(p) for p in problems[:3]))
        for n in range(1, 1000):
            dest = os.path.join(parent, base if n == 1 else f"{base}-{n}")
            if not os.path.lexists(dest):
                break
        os.rename(tree, dest)
        fsync_dir(parent)
    except OSError as exc:
        raise KeepFailed(f"agent {agent.agent_id}: a copy could not be kept in {parent}: {exc}") from exc
    finally:
        if os.path.isdir(tree):
            remove_tree(tree, ignore_errors=True)
    log.warning("agent %s: what this host had of it is kept in %s (a capsule; see docs/move.md)",
                agent.agent_id, dest)
    return dest


def _link_or_copy(src: str, dest: str) -> None:
    try:
        os.link(src, dest)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EACCES):
            raise
        shutil.copyfile(src, dest)
        with open(dest, "rb") as f:
            os.fsync(f.fileno())
    fsync_dir(os.path.dirname(dest))
