"""A move's staging area on the target, and what is done in it off the event loop.

Rules:
  * Every piece of a move lands in ``content/<sha256>`` of its staging area
    (a ``move-*`` directory of the store, owned by an :class:`Incoming`).
    A piece that does not hash to its name is dropped; the store only ever
    names a blob after hashing it.
  * Blobs are adopted into ``objects/`` as soon as they are durable
    (:func:`adopt`): content addressed, so safe before the move is decided.
    The staging area's manifest.json, written before any adoption, keeps
    them from gc until the move has ended.
  * Verify (:meth:`Incoming.check`) trusts a blob only if it hashed on
    arrival and is still in ``objects/``; a blob the target already had is
    checked for presence and size (and re-hashed with ``deep_verify``).
  * The capsule directory is assembled at prepare (:meth:`Incoming.build`),
    every file fsynced, its manifest naming this host at the move's epoch.
  * The functions here block (disk I/O): the move service runs them in
    worker threads.
"""

from __future__ import annotations

import logging
import os
import shutil
from contextlib import ExitStack
from dataclasses import dataclass, field

from capsulefs.core.capsule import format as fmt
from capsulefs.core.errors import CapsuleError
from capsulefs.core.fsutil import atomic_write, fsync_dir, makedirs_durable, remove_tree
from capsulefs.core.linuxfs import FileSystemSync
from capsulefs.core.store.host_store import HostStore
from capsulefs.move.intake import Intake
from capsulefs.move.pieces import Outcome

log = logging.getLogger(__name__)

__all__ = ["Incoming", "adopt", "missing"]


@dataclass
class Incoming:
    """One move being received: its staging area and what has arrived."""

    agent_id: str
    epoch: int
    source: str
    manifest: fmt.Manifest
    area: str
    stack: ExitStack
    last_activity: float
    intake: Intake  # where the pieces of its blobs calls go
    sent: set[str] = field(default_factory=set)  # arrived whole (whether or not they hash to their name)
    received: set[str] = field(default_factory=set)  # hashed to their name (durable and adopted once the intake settles)
    bad: set[str] = field(default_factory=set)  # arrived, but did not hash to their name

    def content(self, sha: str) -> str:
        return os.path.join(self.area, "content", sha)

    @property
    def capsule_dir(self) -> str:
        return os.path.join(self.area, "capsule")

    def record(self, outcomes: list[Outcome]) -> None:
        """A call's pieces are written: note what arrived and what hashed right."""
        for outcome in outcomes:
            if not outcome.written:
                continue
            self.sent.add(outcome.sha)
            if outcome.intact:
                self.received.add(outcome.sha)
                self.bad.discard(outcome.sha)
            else:
                log.warning("move of %s at epoch %d: a piece does not hash to %s", self.agent_id, self.epoch,
                            outcome.sha)
                self.bad.add(outcome.sha)

    def check(self, store: HostStore, deep_verify: bool) -> tuple[str, ...]:
        """Every digest of the manifest that is missing or corrupt here, once
        the intake has settled every piece that arrived."""
        fsync_dir(os.path.dirname(self.content("0" * 64)))
        blobs = self.manifest.blobs()
        bad: list[str] = sorted(self.bad)
        for sha, size in sorted(blobs.items()):
            if sha in self.received and store.has_blob(sha):
                continue  # hashed on arrival, durable in objects/ (unless a gc removed it since: then bad)
            try:
                if store.blob_size(sha) != size:
                    bad.append(sha)
                elif deep_verify:
                    store.verify_blob(sha)
            except CapsuleError:
                bad.append(sha)
        for path, entry in self.manifest.files.items():
            if fmt.blob_name(path) is None and entry.sha256 not in self.received:
                bad.append(entry.sha256)
        return tuple(dict.fromkeys(bad))

    def build(self, me: str) -> None:
        """Assemble the capsule directory from the staged files, held by ``me`` at the move's epoch."""
        root = self.capsule_dir
        m = self.manifest
        if os.path.isdir(root):
            remove_tree(root)
        for path, entry in sorted(m.files.items()):
            if fmt.blob_name(path) is not None:
                continue
            dest = os.path.join(root, *path.split("/"))
            makedirs_durable(os.path.dirname(dest))
            shutil.copyfile(self.content(entry.sha256), dest)
            with open(dest, "rb+") as f:
                os.fsync(f.fileno())
        makedirs_durable(root)
        held = m.with_holder(fmt.Holder(host=me, epoch=self.epoch))
        atomic_write(os.path.join(root, fmt.MANIFEST), held.to_bytes())


def adopt(store: HostStore, manifest: fmt.Manifest, sync: FileSystemSync, durable: dict[str, str]) -> None:
    """In the intake's worker thread: adopt the durable pieces that are
    blobs of the move into objects/ (content addressed: safe before the
    move is decided, and gc frees them if no agent lists them)."""
    blobs = manifest.blobs()
    adopting = []
    for sha, path in sorted(durable.items()):
        if sha in blobs:
            tmp = path + ".adopt"  # a second name: the content file may also be a capsule file
            os.link(path, tmp)
            adopting.append((tmp, sha))
    if adopting:
        store.adopt_blob_files(adopting, sync_dirs=sync.dirs)


def missing(store: HostStore, manifest: fmt.Manifest, have: frozenset[str]) -> tuple[str, ...]:
    """The digests the offer's manifest names that are neither sent already
    (``have``) nor, for blobs, in the store. A stat per blob: in a worker thread."""
    want: dict[str, None] = {}
    for path, entry in sorted(manifest.files.items()):
        sha = entry.sha256
        if sha in have:
            continue
        if fmt.blob_name(path) is not None and store.has_blob(sha):
            continue
        want[sha] = None
    return tuple(want)
