"""Export an agent from the host store to a tar, import one back, verify any capsule.

Theory of operation:
  * Export freezes one consistent state: every non-blob file is read once
    (the journal up to its last whole line), the manifest is computed from
    exactly those bytes and opens the tar (with its signature), so a reader
    knows every size before it reads a byte of them; blobs are re-hashed
    from the store as they stream out. A corrupt blob aborts the export and
    leaves no file behind.
  * Import is all-or-nothing: the tar's manifest is read first and the
    import refused if what it lists does not fit on the store's disk; then
    the files are extracted into a private staging directory of the store,
    each judged from its header before it is written (tarball.scan_tar),
    the first problem ending it, and checked exactly as ``verify`` would;
    only then are its blobs adopted into objects/ and its directory renamed
    into agents/. A refused tar leaves the store as it was.
"""

from __future__ import annotations

import hashlib
import functools
import io
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext

from . import format as fmt
from .verify import Problem, check, scan_dir
from ..errors import CorruptBlobError, FormatError, ImportRefused, NotFoundError
from ..fsutil import atomic_write, fsync_dir
from ..store.holder import agent_files_lock
from ..store.layout import HOLDERS_DIR
from .signing import sign_manifest
from ..journal.recovery import agent_recovery_dir, journal_ring_path, read_journal_locked, recover_journal
from ..store.agent import AgentHandle
from ..store.host_store import HostStore
from ..store.layout import STORE_FILE
from .tarball import DEFAULT_MAX_MEMBER, DEFAULT_MAX_TOTAL, check_room, extract_into, scan_tar
from .tar_export import Member, write_tar

#: Seconds a reader of an agent's files (export, a move) waits for a
#: `capsulefs append` to let go of them: one suspended with ^Z would
#: otherwise hang it. Then FilesBusy.
FILES_WAIT = 30.0


def verify_capsule(path: str, *, pubkey: bytes | None = None) -> tuple[fmt.Manifest | None, list[Problem]]:
    """Verify a capsule directory or tar; returns (manifest, problems)."""
    if os.path.isdir(path):
        _recover_if_stored(path)
        listing = scan_dir(path)
    elif os.path.isfile(path):
        listing = scan_tar(path)
    else:
        raise NotFoundError(f"{path}: no such capsule directory or tar")
    return check(listing, pubkey=pubkey)


def _recover_if_stored(path: str) -> None:
    """A capsule directory that is an agent of a host store
    (``<state>/agents/<agent_id>``): replay its write-ahead ring first, so a
    crash that left the journal file behind its ring is not read as a loss."""
    path = os.path.abspath(path)
    agents_dir, agent_id = os.path.split(path)
    root, name = os.path.split(agents_dir)
    if name != "agents" or not os.path.isfile(os.path.join(root, STORE_FILE)):
        return
    try:
        fmt.check_agent_id(agent_id)
    except FormatError:
        return
    if os.path.isfile(os.path.join(path, fmt.JOURNAL)):
        recover_journal(os.path.join(path, fmt.JOURNAL), journal_ring_path(root, agent_id),
                        agent_recovery_dir(root, agent_id))


class _VerifiedBlob(io.RawIOBase):
    """Reads a blob file and raises CorruptBlobError at EOF if it does not hash to its name."""

    def __init__(self, path: str, sha256: str, size: int) -> None:
        self._f = open(path, "rb")
        self._h = hashlib.sha256()
        self._sha, self._path, self._left = sha256, path, size

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self._h.update(data)
        self._left -= len(data)
        if (not data or self._left <= 0) and self._h.hexdigest() != self._sha:
            raise CorruptBlobError(self._path, self._h.hexdigest())
        return data

    def close(self) -> None:
        self._f.close()
        super().close()


def snapshot_files(agent: AgentHandle, *, wait: float = FILES_WAIT) -> dict[str, bytes]:
    """Read every non-blob file of an agent once, the journal up to its last
    whole line (after replaying its write-ahead ring, if a crash left the
    journal file behind it), under the agent's files lock (shared): a
    `capsulefs append` from another process is in it whole, journal and
    projections, or not at all. Waits at most ``wait`` seconds for one
    (FilesBusy)."""
    with agent_files_lock(os.path.join(agent.store.root, HOLDERS_DIR), agent.agent_id, shared=True, wait=wait):
        return _read_files(agent)


def _read_files(agent: AgentHandle) -> dict[str, bytes]:
    agent.recover_journal()
    files: dict[str, bytes] = {}
    for rel in agent.local_files():
        # The journal under a shared flock: no append is half way through it.
        data = read_journal_locked(agent.path(rel), agent.ring_path) if rel == fmt.JOURNAL else agent.read(rel)
        if rel == fmt.JOURNAL and data and not data.endswith(b"\n"):
            data = data[: data.rfind(b"\n") + 1]
        files[rel] = data
    return files


def frozen_manifest(agent: AgentHandle, files: dict[str, bytes]) -> fmt.Manifest:
    old = agent.manifest()
    entries = old.blob_entries()
    for rel, data in files.items():
        entries[rel] = fmt.FileEntry(sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    return old.with_files(entries)


def export_members(agent: AgentHandle, *, sign_key: bytes | None = None) -> Iterator[Member]:
    files = snapshot_files(agent)
    manifest = frozen_manifest(agent, files)
    raw = manifest.to_bytes()
    yield Member(fmt.MANIFEST, len(raw), lambda: io.BytesIO(raw))
    if sign_key is not None:
        sig = sign_manifest(raw, sign_key)
        yield Member(fmt.SIGNATURE, len(sig), lambda: io.BytesIO(sig))
    for rel in sorted(files):
        data = files[rel]
        yield Member(rel, len(data), functools.partial(io.BytesIO, data))
    store = agent.store
    for sha, size in sorted(manifest.blobs().items()):
        path = store.blob_file(sha)
        if not os.path.exists(path):
            raise NotFoundError(f"blob {sha} of agent {agent.agent_id} is missing from the store ({path})")
        yield Member(fmt.blob_path(sha), size, functools.partial(_VerifiedBlob, path, sha, size))  # type: ignore[arg-type]  # read as a BinaryIO


def export_agent(agent: AgentHandle, dest: str, *, mtime: int, sign_key: bytes | None = None) -> None:
    write_tar(dest, export_members(agent, sign_key=sign_key), mtime=mtime)


def import_tar(
    store: HostStore,
    tar_path: str,
    *,
    max_member: int = DEFAULT_MAX_MEMBER,
    max_total: int = DEFAULT_MAX_TOTAL,
    installing: Callable[[fmt.Manifest], AbstractContextManager[object]] | None = None,
) -> AgentHandle:
    """Import a capsule tar into the store, or refuse it and change nothing.

    ``installing(manifest)``, once the tar verified, is entered before the
    agent's files go into the store and left once they are there (or their
    install failed): the caller records who holds the agent inside it,
    under the agent's files lock, so that nobody sees its files without that
    record (see ``capsulefs.move.host.new_agent_files``)."""
    if not os.path.isfile(tar_path):
        raise NotFoundError(f"{tar_path}: no such file")
    with store.staging("import") as area:
        tree = os.path.join(area, "capsule")
        os.mkdir(tree)
        listing = scan_tar(tar_path, extract_into(tree), max_member=max_member, max_total=max_total,
                           on_manifest=lambda m: check_room(tree, m, tar_path), first_problem_ends=True)
        manifest, problems = check(listing)
        if problems or manifest is None:
            shown = "; ".join(str(p) for p in problems[:5])
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            raise ImportRefused(f"{tar_path} does not verify, nothing imported: {shown}{more}")
        if os.path.isdir(os.path.join(store.agents_dir, manifest.agent_id)):
            raise ImportRefused(f"agent {manifest.agent_id} ({manifest.name}) is already held here; nothing imported")
        if store.name_taken(manifest.name):
            raise ImportRefused(f"an agent named {manifest.name!r} already exists here; nothing imported")
        # The files lock (``installing``) before the store's: the order of `capsulefs append`.
        with installing(manifest) if installing is not None else nullcontext(), store.writing():
            for sha in manifest.blobs():
                src = os.path.join(tree, fmt.blob_path(sha))
                store.adopt_blob_file(src, sha)
            sig = os.path.join(tree, fmt.SIGNATURE)
            if os.path.exists(sig):
                os.unlink(sig)  # a signature attests the export, not the held agent
            atomic_write(os.path.join(tree, fmt.MANIFEST), listing.contents[fmt.MANIFEST])
            fsync_dir(tree)
            return store.install_agent(tree)
