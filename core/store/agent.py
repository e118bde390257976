"""One agent held in a host store: its capsule files under ``agents/<agent_id>/``, its manifest.

Rules:
  * An agent's manifest.json is kept current by every call here that changes
    a file, under the store's shared lock (blobs are listed before any file
    that names them is written, so gc never takes them). The journal is
    appended outside the store (it is protected by its hash chain);
    :meth:`AgentHandle.current_manifest` re-digests files as they are now.
  * Only the capsule's own files (``fmt.REQUIRED_FILES``) are the agent's;
    anything else found in its directory is not.
  * Replacing the journal empties its write-ahead ring first, under the
    journal's flock (:func:`capsulefs.core.journal.recovery.replacing_journal`).
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable, Mapping
from contextlib import ExitStack
from typing import TYPE_CHECKING

from ..capsule import format as fmt
from ..errors import FormatError, NotFoundError, StoreError
from ..fsutil import TMP_PREFIX, atomic_write, makedirs_durable
from ..hashing import hash_file, parallel_map
from ..journal.recovery import agent_recovery_dir, journal_ring_path, recover_journal, replacing_journal

if TYPE_CHECKING:
    from .host_store import HostStore


class AgentHandle:
    """One agent held in a store. Cheap to make; reads the disk each call."""

    def __init__(self, store: HostStore, agent_id: str) -> None:
        self.store = store
        self.agent_id = agent_id
        self.dir = os.path.join(store.agents_dir, agent_id)

    def __repr__(self) -> str:
        return f"AgentHandle({self.agent_id})"

    def path(self, rel: str) -> str:
        """On-disk path of a (non-blob) capsule file."""
        fmt.check_relpath(rel)
        if fmt.blob_name(rel) is not None:
            return self.store.blob_file(fmt.blob_name(rel) or "")
        return os.path.join(self.dir, rel)

    def read(self, rel: str) -> bytes:
        with open(self.path(rel), "rb") as f:
            return f.read()

    @property
    def ring_path(self) -> str:
        """The journal's write-ahead ring (outside the capsule)."""
        return journal_ring_path(self.store.root, self.agent_id)

    @property
    def recovery_dir(self) -> str:
        """Where torn journal tails go (outside the capsule)."""
        return agent_recovery_dir(self.store.root, self.agent_id)

    def recover_journal(self) -> int:
        """Replay the write-ahead ring into the journal if a crash left it
        behind (RingMismatch if they disagree); bytes restored."""
        return recover_journal(self.path(fmt.JOURNAL), self.ring_path, self.recovery_dir)

    def manifest(self) -> fmt.Manifest:
        """The manifest as last written (its journal digest may lag appends)."""
        try:
            with open(os.path.join(self.dir, fmt.MANIFEST), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            raise NotFoundError(f"agent {self.agent_id} is not held here") from None
        try:
            return fmt.Manifest.from_bytes(data)
        except FormatError as exc:
            raise StoreError(f"agent {self.agent_id}: {exc}") from None

    @property
    def name(self) -> str:
        return self.manifest().name

    def local_files(self) -> list[str]:
        """Relative paths of the agent's non-blob files, as on disk: the
        capsule's own files only (``fmt.REQUIRED_FILES``; the tree is closed),
        so that nothing else found in its directory becomes part of the agent."""
        out = []
        for root, dirs, files in os.walk(self.dir):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            for name in files:
                if name.startswith(TMP_PREFIX) or name.startswith("."):
                    continue
                rel = os.path.relpath(os.path.join(root, name), self.dir).replace(os.sep, "/")
                if rel in fmt.REQUIRED_FILES:
                    out.append(rel)
        return sorted(out)

    def current_manifest(self) -> fmt.Manifest:
        """The manifest with every local file digested as it is now."""
        old = self.manifest()
        rels = self.local_files()

        def digest(rel: str) -> tuple[str, fmt.FileEntry]:
            sha, size = hash_file(os.path.join(self.dir, rel))
            return rel, fmt.FileEntry(sha256=sha, size=size)

        files = old.blob_entries()
        files.update(dict(parallel_map(digest, rels)))
        return old.with_files(files)

    def refresh_manifest(self) -> fmt.Manifest:
        with self.store.writing():
            m = self.current_manifest()
            atomic_write(os.path.join(self.dir, fmt.MANIFEST), m.to_bytes())
            return m

    def list_blobs(self, shas: Iterable[str]) -> fmt.Manifest:
        """List blobs (already in the store) in the manifest, if it does not
        list them yet. A writer calls this before any file of the agent (the
        journal, a projection) names them: a crash after that file is
        written but before the manifest lists them would otherwise leave
        them to gc, and the file naming bytes that are gone."""
        with self.store.writing():
            old = self.manifest()
            new = [sha for sha in dict.fromkeys(shas) if fmt.blob_path(sha) not in old.files]
            if not new:
                return old
            entries = dict(old.files)
            for sha in new:
                entries[fmt.blob_path(sha)] = fmt.FileEntry(sha256=sha, size=self.store.blob_size(sha))
            m = old.with_files(entries)
            atomic_write(os.path.join(self.dir, fmt.MANIFEST), m.to_bytes())
            return m

    def write_files(self, files: Mapping[str, bytes], add_blobs: Iterable[str] = ()) -> fmt.Manifest:
        """Atomically replace some capsule files and list extra blobs (which
        must already be in the store), then rewrite the manifest. The blobs
        are listed before any file is replaced (``list_blobs``)."""
        with self.store.writing(), ExitStack() as stack:
            if fmt.JOURNAL in files:  # appenders follow the new file; the ring never replays into it
                stack.enter_context(replacing_journal(self.path(fmt.JOURNAL), self.ring_path, self.recovery_dir))
            old = self.list_blobs(add_blobs)
            if not files:
                return old
            entries = dict(old.files)
            import hashlib

            for rel, data in files.items():
                fmt.check_relpath(rel)
                if rel in fmt.UNLISTED or fmt.blob_name(rel) is not None:
                    raise FormatError(f"{rel} cannot be written as a plain capsule file")
                p = os.path.join(self.dir, rel)
                makedirs_durable(os.path.dirname(p))
                atomic_write(p, data)
                entries[rel] = fmt.FileEntry(sha256=hashlib.sha256(data).hexdigest(), size=len(data))
            m = old.with_files(entries)
            atomic_write(os.path.join(self.dir, fmt.MANIFEST), m.to_bytes())
            return m

    def set_holder(self, host: str, epoch: int) -> fmt.Manifest:
        with self.store.writing():
            old = self.manifest()
            m = old.with_holder(fmt.Holder(host=host, epoch=epoch))
            atomic_write(os.path.join(self.dir, fmt.MANIFEST), m.to_bytes())
            return m

    def file_stat(self, rel: str) -> os.stat_result:
        st = os.stat(self.path(rel))
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", rel)
        return st
