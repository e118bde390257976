"""The host store: every agent this host holds, and their blobs, stored once.

Layout (``LAYOUT`` = 1), under the state directory::

    store.json                 {"layout": 1}: refuses to open an unknown layout
    objects/<2hex>/<64hex>     blobs, named by the sha256 of their bytes, mode 0444
    agents/<agent_id>/         one capsule directory per agent, without
                               artifacts/blobs/ (its blobs live in objects/)
    staging/<label>-<rand>/    scratch areas for import and move; swept on open
    gc.lock                    flock: shared by writers, exclusive by gc
    mount/                     the FUSE mount's own area (see capsulefs.core.view.host):
      snapshots/<agent_id>/<name>/manifest.json
                               read-only snapshots; gc keeps the blobs they list
      scratch/, uploads/,      editors' temp files, blobs being uploaded (core.view.uploads),
      recovery/                torn journal tails
    recovery/<agent_id>/       torn journal tails (see capsulefs.core.journal.file), and copies
                               kept when this host gave the agent up (kept-e<epoch>-<time>/, core.store.kept)
    journal-wal/<agent_id>     the agent's write-ahead ring: appends are durable
                               there first (see capsulefs.core.journal.ring)
    journal-tip/<agent_id>     the journal's tip, derived and checked before use:
                               opening reads only what came after it
                               (see capsulefs.core.journal.tip)
    timeline/<agent_id>/       the timeline index (SQLite), derived and checked
                               before use (see capsulefs.core.journal.timeline)

Rules:
  * A blob is stored once per host however many agents use it; the agents'
    manifests list it as ``artifacts/blobs/<sha256>``.
  * Every write is atomic (``fsutil``): a crash leaves a file whole or absent.
    (Journals are appended and their rings overwritten in place; their own
    rules, checksums and recovery are in ``journal.file`` and ``journal.ring``.)
  * Blobs are re-hashed when read for export, verify or move
    (:meth:`HostStore.iter_blob`); a corrupt blob raises CorruptBlobError with
    its path and is never handed out as good.
  * Garbage collection deletes blobs no agent lists. Writers that add a blob
    and then a reference to it hold the shared lock across both steps
    (:meth:`HostStore.writing`); gc holds the exclusive lock, so it never
    sees a blob whose reference is still being written.
  * An agent's manifest.json is kept current by every store call that
    changes a file. The journal is appended outside the store (it is
    protected by its hash chain); :meth:`AgentHandle.current_manifest`
    re-digests files whose size or mtime changed since the manifest.
  * Opening the store replays every agent's write-ahead ring into its
    journal if a crash left the journal behind, before anything reads a
    journal file. Replacing a journal empties its ring first (under the
    journal's flock); installing or removing an agent removes its ring,
    its tip and its timeline index.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import stat
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import BinaryIO

from .. import metrics
from ..frozen import Frozen
from ..capsule import format as fmt
from ..errors import CorruptBlobError, ExistsError, FormatError, NotFoundError, StoreError
from ..fsutil import TMP_PREFIX, atomic_write, fsync_dir, makedirs_durable, remove_tree, sweep_temps
from ..linuxfs import fsync_each, path_identity
from ..hashing import CHUNK, hash_file, parallel_map
from ..journal.recovery import (
    RingMismatch,
    agent_recovery_dir,
    forget_ring,
    holding_journal,
    journal_ring_path,
    recover_journal,
    replacing_journal,
)
from ..capsule.spec import default_spec, spec_bytes

log = logging.getLogger(__name__)

LAYOUT = 1
STORE_FILE = "store.json"
SNAPSHOTS_DIR = os.path.join("mount", "snapshots")
#: Where blobs found damaged are kept, under objects/ (see ``quarantine_blob``).
QUARANTINE_DIR = ".corrupt"


def default_state_dir() -> str:
    if os.geteuid() == 0:
        return "/var/lib/capsulefs"
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(base, "capsulefs")


class GcReport(Frozen):
    """What ``gc`` did (a frozen value: core/frozen.py)."""

    __slots__ = ("removed", "freed", "kept")
    __match_args__ = ("removed", "freed", "kept")
    removed: int  # blobs deleted
    freed: int  # bytes freed
    kept: int  # blobs still referenced

    def __init__(self, removed: int, freed: int, kept: int) -> None:
        object.__setattr__(self, "removed", removed)
        object.__setattr__(self, "freed", freed)
        object.__setattr__(self, "kept", kept)


class HostStore:
    """A host's state directory. Safe to share between processes."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.objects_dir = os.path.join(self.root, "objects")
        self.agents_dir = os.path.join(self.root, "agents")
        self.staging_dir = os.path.join(self.root, "staging")
        self._lock_path = os.path.join(self.root, "gc.lock")
        self._tlock = threading.local()

    # -- opening -----------------------------------------------------------
    @classmethod
    def open(cls, root: str | os.PathLike[str], *, create: bool = True) -> "HostStore":
        root = os.fspath(root)
        meta = os.path.join(root, STORE_FILE)
        if not os.path.exists(meta):
            if not create:
                raise StoreError(f"{root} is not a capsulefs state directory (no {STORE_FILE})")
            makedirs_durable(root, 0o700)
            atomic_write(meta, json.dumps({"layout": LAYOUT}).encode() + b"\n")
        try:
            with open(meta, "rb") as f:
                layout = json.load(f).get("layout")
        except (OSError, ValueError, AttributeError) as exc:
            raise StoreError(f"{meta} is unreadable: {exc}") from None
        if layout != LAYOUT:
            raise StoreError(f"{root}: store layout {layout!r} is not supported (this capsulefs reads {LAYOUT})")
        store = cls(root)
        for d in (store.objects_dir, store.agents_dir, store.staging_dir):
            makedirs_durable(d)
        store._sweep_staging()
        store.recover_journals()
        return store

    def recover_journals(self) -> None:
        """Replay each agent's write-ahead ring into its journal where a crash
        left the journal behind. A journal that disagrees with its ring is
        logged (and refuses appends when opened), not touched."""
        for agent_id in self.agent_ids():
            try:
                self.agent(agent_id).recover_journal()
            except RingMismatch:
                continue  # logged with both paths; opening the journal to append refuses
            except NotFoundError:
                continue  # removed meanwhile
            except OSError as exc:  # e.g. a state directory this user may only read
                log.warning("agent %s: could not check its journal against its write-ahead ring: %s", agent_id, exc)

    def _sweep_staging(self) -> None:
        # Staging areas belong to an operation that a crash ended; nothing in
        # them was ever acknowledged. Only areas no live process holds are
        # removed: each holder keeps an flock on its area's lock file.
        for name in os.listdir(self.staging_dir):
            path = os.path.join(self.staging_dir, name)
            lock = path + ".lock" if not name.endswith(".lock") else path
            try:
                fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            try:
                # Whatever a crash or a hostile tar left there, however deep:
                # a store that cannot be swept must still open.
                if os.path.isdir(path):
                    remove_tree(path)
                if os.path.exists(lock):
                    os.unlink(lock)
            except OSError as exc:
                log.warning("could not remove the staging area %s (left there): %s", path, exc)
            finally:
                os.close(fd)

    # -- locking -----------------------------------------------------------
    @contextmanager
    def _flock(self, mode: int) -> Iterator[None]:
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, mode)
            yield
        finally:
            os.close(fd)

    @contextmanager
    def writing(self) -> Iterator[None]:
        """Hold off gc while adding blobs and the references to them. Re-entrant."""
        depth = getattr(self._tlock, "depth", 0)
        if depth:
            self._tlock.depth = depth + 1
            try:
                yield
            finally:
                self._tlock.depth -= 1
            return
        with self._flock(fcntl.LOCK_SH):
            self._tlock.depth = 1
            try:
                yield
            finally:
                self._tlock.depth = 0

    # -- blobs ---------------------------------------------------------------
    def blob_file(self, sha256: str) -> str:
        fmt.check_sha256(sha256, "blob name")
        return os.path.join(self.objects_dir, sha256[:2], sha256)

    def has_blob(self, sha256: str) -> bool:
        return os.path.exists(self.blob_file(sha256))

    def blob_size(self, sha256: str) -> int:
        try:
            return os.stat(self.blob_file(sha256)).st_size
        except FileNotFoundError:
            raise NotFoundError(f"blob {sha256} is not in the store") from None

    def put_blob_stream(self, f: BinaryIO, expect: str | None = None) -> tuple[str, int]:
        """Store everything left in ``f`` as a blob; return (sha256, size).

        With ``expect``, refuse bytes that do not hash to it (nothing lands).
        """
        import hashlib  # (where it hashes: hashlib loads OpenSSL, which a reader of the store need not)

        os.makedirs(self.objects_dir, exist_ok=True)
        tmp = os.path.join(self.objects_dir, TMP_PREFIX + os.urandom(8).hex())
        h = hashlib.sha256()
        size = 0
        with self.writing():
            try:
                with open(tmp, "wb") as out:
                    while chunk := f.read(CHUNK):
                        h.update(chunk)
                        out.write(chunk)
                        size += len(chunk)
                    out.flush()
                    os.fsync(out.fileno())
                sha = h.hexdigest()
                if expect is not None and sha != expect:
                    raise CorruptBlobError(f"incoming blob {expect}", sha)
                self._place(tmp, sha)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        return sha, size

    def put_blob(self, data: bytes, expect: str | None = None) -> str:
        import io

        return self.put_blob_stream(io.BytesIO(data), expect)[0]

    def adopt_blob_file(self, path: str, sha256: str) -> None:
        """Move an already written, fsynced and hashed file into objects/."""
        with self.writing():
            self._place(path, sha256)

    def adopt_blob_files(self, items: Iterable[tuple[str, str]], *,
                         sync_dirs: Callable[[Iterable[str]], None] | None = None) -> None:
        """Move many already written, fsynced and hashed files, given as
        (path, sha256), into objects/, making each directory durable once at
        the end rather than once per blob (the move service adopts a
        thousand at a time): with ``sync_dirs`` given the directories
        touched (the move service's syncs its whole file system at once),
        else an fsync of each, several at a time so that the file system
        can commit them together."""
        items = list(items)
        touched: set[str] = set()
        with self.writing():
            self.make_blob_dirs(sha for _, sha in items)
            for path, sha in items:
                dest = self.blob_file(sha)
                if self._holds_copy(dest, path):
                    os.unlink(path)
                    continue
                os.chmod(path, 0o444)
                os.replace(path, dest)
                touched.add(os.path.dirname(dest))
            if touched:
                if sync_dirs is not None:
                    sync_dirs(sorted(touched))
                else:
                    fsync_each(touched, fsync_dir)

    def make_blob_dirs(self, shas: Iterable[str]) -> None:
        """Create the directories (``objects/xx``) that these blobs will be
        placed in, before the blobs come: making a directory costs the file
        system far more than a rename into one that exists (measured on ext4
        here: 0.5 ms per mkdir against 20 us per rename), so the move service
        makes them while the blobs are still arriving. Durable: objects/ is
        fsynced when it changed. Names that are not digests are skipped."""
        made = False
        for prefix in sorted({sha[:2] for sha in shas if fmt.is_sha256(sha)}):
            try:
                os.mkdir(os.path.join(self.objects_dir, prefix))
            except FileExistsError:
                continue
            made = True
        if made:
            fsync_dir(self.objects_dir)

    def _place(self, tmp: str, sha: str) -> None:
        dest = self.blob_file(sha)
        if self._holds_copy(dest, tmp):
            os.unlink(tmp)  # deduplicated: the store has these bytes already
            return
        self.make_blob_dirs((sha,))
        os.chmod(tmp, 0o444)
        os.replace(tmp, dest)
        fsync_dir(os.path.dirname(dest))

    def _holds_copy(self, dest: str, new: str) -> bool:
        """Whether the object ``dest`` is there to deduplicate the new, hashed
        file ``new`` against. One of another size is damaged (a blob's size
        follows from its name): it is quarantined, and the new bytes take
        its place. (One of the right size is trusted, as reading it is the
        cost dedup saves: a rotten one is found when read, and quarantined.)
        Caller holds the store's shared lock."""
        try:
            size = os.stat(dest).st_size
        except FileNotFoundError:
            return False
        good = os.stat(new).st_size
        if size == good:
            return True
        self._quarantine(dest, f"{size} bytes where the good copy has {good}")
        return False

    def quarantine_blob(self, sha256: str, why: str, *, ino: int | None = None) -> None:
        """Move a blob found damaged out of ``objects/`` (to ``objects/.corrupt/``,
        kept for a person): the next put of its good bytes (an import of an
        export that has it, a move, a workspace commit) then places them
        instead of deduplicating against the damaged copy, which nothing
        could repair before. With ``ino`` (the file that was read), only if
        the name still holds that file: a good copy placed meanwhile stays.
        A store this user may not change keeps the blob (logged)."""
        path = self.blob_file(sha256)
        try:
            with self.writing():
                if ino is not None and path_identity(path)[0] != ino:
                    return  # replaced meanwhile (by a put of the good bytes)
                self._quarantine(path, why)
        except FileNotFoundError:
            return  # quarantined (or collected) meanwhile
        except OSError as exc:
            log.error("blob %s is damaged (%s) and could not be quarantined: %s", path, why, exc)

    def _quarantine(self, path: str, why: str) -> None:
        pen = os.path.join(self.objects_dir, QUARANTINE_DIR)
        makedirs_durable(pen, 0o700)
        dest = os.path.join(pen, f"{os.path.basename(path)}.{os.urandom(4).hex()}")
        try:
            os.rename(path, dest)
        except FileNotFoundError:
            return  # quarantined (or collected) meanwhile
        fsync_dir(os.path.dirname(path))
        fsync_dir(pen)
        metrics.BLOB_QUARANTINES.inc()
        log.error("blob %s is damaged (%s): moved to %s; putting its bytes again (importing an export that has "
                  "them, or moving an agent that has them here) repairs the store", path, why, dest)

    def iter_blob(self, sha256: str, chunk: int = CHUNK) -> Iterator[bytes]:
        """Yield a blob's bytes, re-hashing them; raise CorruptBlobError at the end
        if they do not match (callers that stream must discard what they got),
        after quarantining the blob (see :meth:`quarantine_blob`)."""
        import hashlib

        path = self.blob_file(sha256)
        h = hashlib.sha256()
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            raise self._missing(sha256) from None
        with f:
            ino = os.fstat(f.fileno()).st_ino
            while data := f.read(chunk):
                h.update(data)
                yield data
        if h.hexdigest() != sha256:
            self.quarantine_blob(sha256, f"its bytes hash to {h.hexdigest()}", ino=ino)
            raise CorruptBlobError(path, h.hexdigest())

    def read_blob(self, sha256: str) -> bytes:
        return b"".join(self.iter_blob(sha256))

    def why_missing(self, sha256: str) -> str:
        """Why a blob is not in objects/, and how to repair that if it was quarantined."""
        why = "not in the store"
        pen = os.path.join(self.objects_dir, QUARANTINE_DIR)
        if os.path.isdir(pen) and any(n.startswith(sha256 + ".") for n in os.listdir(pen)):
            why += (f": a damaged copy was quarantined in {pen}; putting its bytes again (importing an export "
                    f"that has them, or a move) repairs the store")
        return why

    def _missing(self, sha256: str) -> NotFoundError:
        return NotFoundError(f"blob {sha256} ({self.blob_file(sha256)}) is {self.why_missing(sha256)}")

    def verify_blob(self, sha256: str) -> None:
        try:
            ino = path_identity(self.blob_file(sha256))[0]  # (before: a copy placed later is not the one hashed)
            actual, _ = hash_file(self.blob_file(sha256))
        except FileNotFoundError:
            raise self._missing(sha256) from None
        if actual != sha256:
            self.quarantine_blob(sha256, f"its bytes hash to {actual}", ino=ino)
            raise CorruptBlobError(self.blob_file(sha256), actual)

    def all_blobs(self) -> Iterator[str]:
        for sub in os.listdir(self.objects_dir):
            d = os.path.join(self.objects_dir, sub)
            if len(sub) == 2 and os.path.isdir(d):
                for name in os.listdir(d):
                    if fmt.is_sha256(name):
                        yield name

    def gc(self) -> GcReport:
        """Delete blobs that no agent lists."""
        with self._flock(fcntl.LOCK_EX):
            referenced: set[str] = set()
            for agent in self.agents():
                referenced.update(agent.manifest().blobs())
            referenced.update(self._snapshot_blobs())
            referenced.update(self._staged_blobs())
            removed = freed = kept = 0
            for sha in list(self.all_blobs()):
                if sha in referenced:
                    kept += 1
                    continue
                path = self.blob_file(sha)
                freed += os.stat(path).st_size
                os.unlink(path)
                removed += 1
            sweep_temps(self.objects_dir)
            return GcReport(removed=removed, freed=freed, kept=kept)

    def _snapshot_blobs(self) -> set[str]:
        """Blobs listed by the mount's snapshots (mount/snapshots/*/*/manifest.json)."""
        out: set[str] = set()
        root = os.path.join(self.root, SNAPSHOTS_DIR)
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            if fmt.MANIFEST in filenames and os.path.relpath(dirpath, root).count(os.sep) == 1:
                with open(os.path.join(dirpath, fmt.MANIFEST), "rb") as f:
                    out.update(fmt.Manifest.from_bytes(f.read()).blobs())
        return out

    def _staged_blobs(self) -> set[str]:
        """Blobs named by the manifest of a staging area (staging/*/manifest.json):
        an incoming move adopts its blobs into objects/ before any agent here
        lists them, and needs them until it installs the agent or ends.

        A manifest that does not parse stops gc (StoreError naming it): its
        move may still need blobs nobody else lists."""
        out: set[str] = set()
        for name in os.listdir(self.staging_dir):
            path = os.path.join(self.staging_dir, name, fmt.MANIFEST)
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except (FileNotFoundError, NotADirectoryError):
                continue  # an area without one, a lock file, or an area removed meanwhile
            try:
                out.update(fmt.Manifest.from_bytes(data).blobs())
            except FormatError as exc:
                raise StoreError(f"gc: {path} is damaged ({exc}); nothing was collected. If no move or import "
                                 f"is under way, remove {os.path.dirname(path)} and run gc again") from None
        return out

    # -- agents ----------------------------------------------------------------
    def agent_ids(self) -> list[str]:
        return sorted(
            n for n in os.listdir(self.agents_dir)
            if not n.startswith(".") and os.path.isfile(os.path.join(self.agents_dir, n, fmt.MANIFEST))
        )

    def agents(self) -> list["AgentHandle"]:
        return [AgentHandle(self, a) for a in self.agent_ids()]

    def agent(self, agent_id: str) -> "AgentHandle":
        fmt.check_agent_id(agent_id)
        if not os.path.isfile(os.path.join(self.agents_dir, agent_id, fmt.MANIFEST)):
            raise NotFoundError(f"agent {agent_id} is not held here")
        return AgentHandle(self, agent_id)

    def find(self, name_or_id: str) -> "AgentHandle":
        """An agent by its id, or by its (unique) name."""
        for agent in self.agents():
            if agent.agent_id == name_or_id:
                return agent
        matches = [a for a in self.agents() if a.manifest().name == name_or_id]
        if not matches:
            raise NotFoundError(f"no agent named {name_or_id!r} is held in {self.root}")
        if len(matches) > 1:
            ids = ", ".join(a.agent_id for a in matches)
            raise StoreError(f"several agents are named {name_or_id!r} ({ids}); use the agent id")
        return matches[0]

    def name_taken(self, name: str) -> bool:
        return any(a.manifest().name == name for a in self.agents())

    def create_agent(
        self,
        name: str,
        *,
        host_id: str,
        agent_id: str,
        spec: Mapping | None = None,
        working_memory: str = "",
    ) -> "AgentHandle":
        """Create a new, empty agent held by ``host_id`` at epoch 1."""
        fmt.check_agent_name(name)
        fmt.check_agent_id(agent_id)
        if self.name_taken(name):
            raise ExistsError(f"an agent named {name!r} already exists here")
        files = {
            fmt.WORKING_MEMORY: working_memory.encode(),
            fmt.JOURNAL: b"",
            fmt.VECTOR_INDEX: fmt.empty_vector_index(),
            fmt.SNAPSHOT: fmt.snapshot_bytes({}),
            fmt.SPEC: spec_bytes(dict(spec) if spec is not None else default_spec()),
        }
        holder = fmt.Holder(host=host_id, epoch=1)
        import hashlib

        with self.staging("new") as area:
            for rel, data in files.items():
                p = os.path.join(area, rel)
                makedirs_durable(os.path.dirname(p))
                atomic_write(p, data)
            manifest = fmt.Manifest(
                agent_id=agent_id,
                name=name,
                holder=holder,
                files={rel: fmt.FileEntry(sha256=hashlib.sha256(d).hexdigest(), size=len(d)) for rel, d in files.items()},
            )
            atomic_write(os.path.join(area, fmt.MANIFEST), manifest.to_bytes())
            return self.install_agent(area)

    def install_agent(self, staged_dir: str) -> "AgentHandle":
        """Atomically move a staged capsule directory (no blobs inside; its
        blobs already in objects/) into agents/<agent_id>/."""
        with open(os.path.join(staged_dir, fmt.MANIFEST), "rb") as f:
            manifest = fmt.Manifest.from_bytes(f.read())
        missing = [sha for sha in manifest.blobs() if not self.has_blob(sha)]
        if missing:
            raise StoreError(f"cannot install agent {manifest.agent_id}: {len(missing)} blob(s) missing, e.g. {missing[0]}")
        dest = os.path.join(self.agents_dir, manifest.agent_id)
        if os.path.exists(dest):
            raise ExistsError(f"agent {manifest.agent_id} ({manifest.name}) is already held here")
        for a in self.agents():
            if a.manifest().name == manifest.name:
                raise ExistsError(f"an agent named {manifest.name!r} already exists here ({a.agent_id})")
        blobs_dir = os.path.join(staged_dir, fmt.BLOBS_DIR)
        if os.path.isdir(blobs_dir):
            remove_tree(blobs_dir)
        # A ring left by an earlier stay of this agent vouches for another
        # file (whose inode number the new journal might even reuse).
        forget_ring(journal_ring_path(self.root, manifest.agent_id))
        _forget_derived(self.root, manifest.agent_id)  # (they would not match: removed all the same)
        os.rename(staged_dir, dest)
        fsync_dir(self.agents_dir)
        fsync_dir(self.staging_dir)
        return AgentHandle(self, manifest.agent_id)

    def remove_agent(self, agent_id: str) -> None:
        agent = self.agent(agent_id)
        trash = os.path.join(self.staging_dir, f"rm-{agent_id}-{os.urandom(4).hex()}")
        with holding_journal(agent.path(fmt.JOURNAL)):  # no appender is between its checks and its write
            os.rename(agent.dir, trash)  # atomic: the agent is gone or still whole
            fsync_dir(self.agents_dir)
        forget_ring(journal_ring_path(self.root, agent_id))
        _forget_derived(self.root, agent_id)
        remove_tree(trash)

    # -- staging ---------------------------------------------------------------
    @contextmanager
    def staging(self, label: str) -> Iterator[str]:
        """A private scratch directory inside the store, removed on exit
        (unless it was consumed, e.g. renamed by install_agent)."""
        name = f"{label}-{os.urandom(6).hex()}"
        path = os.path.join(self.staging_dir, name)
        lock_fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        os.mkdir(path, 0o700)
        try:
            yield path
        finally:
            if os.path.isdir(path):
                remove_tree(path, ignore_errors=True)
            os.unlink(path + ".lock")
            os.close(lock_fd)


def _forget_derived(root: str, agent_id: str) -> None:
    """Remove what the host derived from an agent's journal: its tip and its timeline index."""
    from ..journal.tip import forget_tip, journal_tip_path  # (here: commands that only read start faster)
    from ..journal.timeline import forget_timeline

    forget_tip(journal_tip_path(root, agent_id))
    forget_timeline(root, agent_id)


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
