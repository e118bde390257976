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
  * Every write is atomic (``fsutil``): a crash leaves a file whole or absent.
    (Journals are appended and their rings overwritten in place; their own
    rules, checksums and recovery are in ``journal.file`` and ``journal.ring``.)
  * Blobs (objects/, stored once, re-hashed when read, quarantined when
    damaged) have their rules in :mod:`capsulefs.core.store.blobs`; one
    agent's files and manifest in :mod:`capsulefs.core.store.agent`.
  * Garbage collection deletes blobs no agent, snapshot or staged move lists.
    It holds the exclusive ``gc.lock``; writers that add a blob and then a
    reference to it hold it shared (:meth:`BlobStore.writing`), so gc never
    sees a blob whose reference is still being written. On a host with a
    blob tier, ``gc --tier-cache`` also deletes local copies of listed
    blobs the tier holds, coldest first (:mod:`capsulefs.core.store.cache`).
  * Opening the store replays every agent's write-ahead ring into its
    journal if a crash left the journal behind, before anything reads a
    journal file. Installing or removing an agent removes its ring,
    its tip and its timeline index.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from ..capsule import format as fmt
from ..capsule.spec import default_spec, spec_bytes
from ..errors import ExistsError, FormatError, NotFoundError, StoreError
from ..fsutil import atomic_write, fsync_dir, makedirs_durable, remove_tree, sweep_temps
from ..journal.recovery import RingMismatch, forget_ring, holding_journal, journal_ring_path
from ..frozen import Frozen
from .agent import AgentHandle
from .blobs import BlobStore
from .cache import CacheReport, Evictable, choose_evictions
from .layout import AGENTS_DIR, STAGING_DIR, STORE_FILE

#: A file in a staging area that makes it survive a restart (the sweep spares
#: it): a move prepared in the fleet mode, which the directory may name already.
STAGING_KEEP = "keep"

log = logging.getLogger(__name__)

LAYOUT = 1
SNAPSHOTS_DIR = os.path.join("mount", "snapshots")


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


class HostStore(BlobStore):
    """A host's state directory: its blobs (:class:`BlobStore`), agents and
    staging areas. Safe to share between processes."""

    def __init__(self, root: str, *, on_blob: Callable[[str], None] | None = None) -> None:
        super().__init__(root, on_blob=on_blob)
        self.agents_dir = os.path.join(self.root, AGENTS_DIR)
        self.staging_dir = os.path.join(self.root, STAGING_DIR)

    # -- opening -----------------------------------------------------------
    @classmethod
    def open(cls, root: str | os.PathLike[str], *, create: bool = True,
             on_blob: Callable[[str], None] | None = None) -> "HostStore":
        """The store at ``root`` (made if ``create``); ``on_blob``: see :class:`BlobStore`."""
        root = os.fspath(root)
        meta = os.path.join(root, STORE_FILE)
        if not os.path.exists(meta):
            if not create:
                raise StoreError(f"{root} is not a capsulefs state directory (no {STORE_FILE})")
            makedirs_durable(root, 0o700)
            atomic_write(meta, json.dumps({"layout": LAYOUT}).encode() + b"\n")
        try:
            with open(meta, "rb") as f:
                data = f.read(1 << 16)
        except OSError as exc:
            raise StoreError(f"{meta} is unreadable: {exc.strerror or exc}") from None
        layout = fmt.load_json_object(data, meta, error=StoreError).get("layout")
        if type(layout) is not int or layout != LAYOUT:
            raise StoreError(f"{meta}: store layout {layout!r} is not supported (this capsulefs reads {LAYOUT})")
        store = cls(root, on_blob=on_blob)
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
        # removed: each holder keeps an flock on its area's lock file. An
        # area holding STAGING_KEEP (a prepared move the fleet's directory may
        # name already) is spared: its owner takes it back or removes it.
        for name in os.listdir(self.staging_dir):
            path = os.path.join(self.staging_dir, name)
            lock = path + ".lock" if not name.endswith(".lock") else path
            if os.path.exists(os.path.join(lock[:-len(".lock")], STAGING_KEEP)):
                continue
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

    # -- gc --------------------------------------------------------------------
    def gc(self) -> GcReport:
        """Delete blobs that no agent lists."""
        with self._flock(fcntl.LOCK_EX):
            return self._collect(self._referenced())

    def gc_tier_cache(self, limit: int, rule: Evictable) -> tuple[GcReport, CacheReport]:
        """What :meth:`gc` does, then, as a cache of the blob tier
        (core/store/cache.py): delete the local copies of listed blobs that
        ``rule`` lets go, coldest first, until the listed blobs kept here
        fit ``limit`` bytes. Never a blob a staging area names."""
        with self._flock(fcntl.LOCK_EX):
            listed, staged = self._listed_blobs(), self._staged_blobs()
            report = self._collect(listed | staged)
            sizes: dict[str, int] = {}
            atimes: dict[str, int] = {}
            for sha in listed:
                try:
                    st = os.stat(self.blob_file(sha))
                except FileNotFoundError:
                    continue  # evicted before, or lost
                sizes[sha], atimes[sha] = st.st_size, st.st_atime_ns
            candidates = {sha for sha in sizes if sha not in staged and rule.may_evict(sha)}
            evicted = choose_evictions(sizes, atimes, candidates, limit)
            for sha in evicted:
                os.unlink(self.blob_file(sha))
            gone = sum(sizes[sha] for sha in evicted)
            if evicted:
                log.info("gc: evicted %d blob(s), %d bytes, held by the blob tier", len(evicted), gone)
            return report, CacheReport(evicted=len(evicted), evicted_bytes=gone,
                                       cached_bytes=sum(sizes.values()) - gone, limit=limit)

    def _listed_blobs(self) -> set[str]:
        """Blobs an agent's or a snapshot's manifest lists. Caller holds gc's lock."""
        listed: set[str] = set()
        for agent in self.agents():
            listed.update(agent.manifest().blobs())
        listed.update(self._snapshot_blobs())
        return listed

    def _collect(self, referenced: set[str]) -> GcReport:
        """Delete every blob not in ``referenced``. Caller holds gc's exclusive lock."""
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

    def _referenced(self) -> set[str]:
        """Every blob a manifest here names: an agent's, a snapshot's, a staging area's (caller holds the lock)."""
        return self._listed_blobs() | self._staged_blobs()

    def live_blobs(self, then: Callable[[frozenset[str]], None] | None = None) -> frozenset[str]:
        """The blobs gc keeps (every manifest's: agents, snapshots, staging
        areas), computed under gc's exclusive lock, as gc does: a writer's
        blob and its reference are both in, or neither. ``then`` is called
        with the set while the lock is still held (the fleet's live set
        publisher shrinks its record of evictable blobs there, before any
        eviction can see the set; capsulefs/fleet/live.py)."""
        with self._flock(fcntl.LOCK_EX):
            live = frozenset(self._referenced())
            if then is not None:
                then(live)
            return live

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

    def agents(self) -> list[AgentHandle]:
        return [AgentHandle(self, a) for a in self.agent_ids()]

    def agent(self, agent_id: str) -> AgentHandle:
        fmt.check_agent_id(agent_id)
        if not os.path.isfile(os.path.join(self.agents_dir, agent_id, fmt.MANIFEST)):
            raise NotFoundError(f"agent {agent_id} is not held here")
        return AgentHandle(self, agent_id)

    def find(self, name_or_id: str) -> AgentHandle:
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
        spec: Mapping[str, Any] | None = None,
        working_memory: str = "",
    ) -> AgentHandle:
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
        import hashlib  # (where it hashes: hashlib loads OpenSSL, which a reader of the store need not)

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

    def install_agent(self, staged_dir: str) -> AgentHandle:
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
    def kept_staging(self) -> list[str]:
        """The staging areas a restart spared (they hold STAGING_KEEP), by path."""
        return sorted(os.path.join(self.staging_dir, n) for n in os.listdir(self.staging_dir)
                      if not n.endswith(".lock") and os.path.exists(os.path.join(self.staging_dir, n, STAGING_KEEP)))

    def remove_kept(self, area: str) -> None:
        """Remove a staging area a restart spared (its owner is done with it)."""
        if os.path.dirname(os.path.abspath(area)) != os.path.abspath(self.staging_dir):
            raise StoreError(f"{area} is not a staging area of {self.root}")
        with contextlib.suppress(FileNotFoundError):  # (first: from here on a sweep may remove the rest)
            os.unlink(os.path.join(area, STAGING_KEEP))
        remove_tree(area, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(area + ".lock")
        fsync_dir(self.staging_dir)

    @contextmanager
    def keeping(self, manifest: fmt.Manifest, label: str) -> Iterator[str]:
        """A staging area holding ``manifest``: no gc deletes or evicts the
        blobs it lists until the block ends (a reader of them: a move's
        source, a sandbox build, an export). Yields the area."""
        with self.staging(label) as area:
            with self.writing():
                atomic_write(os.path.join(area, fmt.MANIFEST), manifest.to_bytes())
            yield area

    @contextmanager
    def staging(self, label: str) -> Iterator[str]:
        """A private scratch directory inside the store, removed on exit
        (unless it was consumed, e.g. renamed by install_agent, or its owner
        marked it kept with STAGING_KEEP: then :meth:`remove_kept` removes it)."""
        name = f"{label}-{os.urandom(6).hex()}"
        path = os.path.join(self.staging_dir, name)
        lock_fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        os.mkdir(path, 0o700)
        try:
            yield path
        finally:
            if os.path.isdir(path) and not os.path.exists(os.path.join(path, STAGING_KEEP)):
                remove_tree(path, ignore_errors=True)
            os.unlink(path + ".lock")
            os.close(lock_fd)


def _forget_derived(root: str, agent_id: str) -> None:
    """Remove what the host derived from an agent's journal: its tip and its timeline index."""
    from ..journal.tip import forget_tip, journal_tip_path  # (here: commands that only read start faster)
    from ..journal.timeline import forget_timeline

    forget_tip(journal_tip_path(root, agent_id))
    forget_timeline(root, agent_id)
