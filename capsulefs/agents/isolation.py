"""Isolation of agent processes: a uid of their own, a locked state dir, a cgroup.

Rules:
  * Isolation is on when the daemon runs as root. Every process of an agent
    (its setup steps and its entrypoint) then runs as that agent's own uid,
    with a gid of the same number, no supplementary groups and
    ``no_new_privs`` (a setuid program cannot raise it back). No
    /etc/passwd entry is needed.
  * The uid is taken from a range (``CAPSULEFS_AGENT_UIDS``, default
    200000-265535, uids of real accounts skipped) and recorded per agent in
    ``sandboxes/<agent_id>/uid`` (root's, mode 0600): the next one above
    every uid ever given here (``sandboxes/.uid-high``). A record, not a
    hash of the agent id, so two agents never share a uid; host-local,
    never part of a capsule (a moved agent gets a uid on its new host). It
    goes with the sandbox (retire, remove), and its uid is never given
    again: a new agent gets nothing an earlier one left in /tmp, shared
    memory or IPC.
  * What the agent's uid may reach: the state directory is mode 0711 (it
    can pass through, not list) and every entry in it but ``sandboxes/``
    is stripped of group and other bits (0700 directories, 0600 files), so
    the keychain (``secrets.json``), ``tls/host.pem``, the store and the
    holder records are out of its reach. ``sandboxes/`` is 0711;
    ``sandboxes/<agent_id>/`` is root's with the agent's group and mode
    0710 (no other agent passes); in it ``workspace/`` and ``home/`` (its
    ``HOME``) are the agent's own, mode 0700. Every directory above the
    state directory and above the mount must be searchable by others: if
    one is not, the agent does not start and its status says which.
  * Containment: with a writable cgroup v2 hierarchy, each agent's
    processes run in a cgroup of their own,
    ``<daemon's cgroup>/capsulefs-<state dir hash>/<agent_id>``, joined
    before exec; a run ends with ``cgroup.kill``, so a process that left
    the process group (``setsid``) dies with its agent. Without one, the
    process group is all there is, as before, and the log says so once.
  * Not root: none of this; the agents run as the daemon's user, and the
    log (once) and every agent's status say that isolation is off.

Theory of operation: :class:`Isolation` is made once per supervisor; the
supervisor asks it for an agent's ids before each start (which also gives
the sandbox to that uid) and hands its :meth:`preexec` to the child, which
runs as root in the forked child: join the cgroup, drop groups, gid and
uid, in that order (the cgroup move needs root; so does every step after
the first).
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import logging
import os
import pwd
import stat
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from capsulefs.core.capsule import workspace
from capsulefs.core.errors import CapsuleError
from capsulefs.core.fsutil import atomic_write, fsync_dir
from capsulefs.core.walk import walk_tree
from capsulefs.core.store.layout import SANDBOXES_DIR

log = logging.getLogger(__name__)

UIDS_ENV = "CAPSULEFS_AGENT_UIDS"
DEFAULT_UIDS = range(200_000, 265_536)
UID_FILE = "uid"  # in sandboxes/<agent_id>/
HIGH_FILE = ".uid-high"  # in sandboxes/: the highest agent uid ever given here
HOME_DIR = "home"  # in sandboxes/<agent_id>/: the agent's HOME when isolated
PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38


class SandboxError(CapsuleError):
    """An agent cannot be started inside its sandbox (no uid left, a path it
    cannot reach)."""


def parse_uids(text: str) -> range:
    """``FIRST-LAST`` (inclusive) as a range of uids, above the system's."""
    try:
        first, last = (int(x) for x in text.split("-"))
    except ValueError:
        raise SandboxError(f"{UIDS_ENV}={text!r}: expected FIRST-LAST, e.g. 200000-265535") from None
    if not 1000 <= first <= last < 2**32 - 1:
        raise SandboxError(f"{UIDS_ENV}={text!r}: expected 1000 <= FIRST <= LAST < 4294967295")
    return range(first, last + 1)


# -- cgroups --------------------------------------------------------------------------


def _cgroup2_mount(mountinfo: str) -> str | None:
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        if right.split(" ", 1)[0] == "cgroup2":
            return left.split()[4].replace("\\040", " ")
    return None


def _own_cgroup(proc_cgroup: str) -> str | None:
    for line in proc_cgroup.splitlines():
        if line.startswith("0::"):
            return line[3:].strip()
    return None


class Cgroups:
    """One cgroup v2 directory per agent, under one directory per state dir."""

    def __init__(self, parent: str) -> None:
        self.parent = parent

    @classmethod
    def find(cls, state_dir: str) -> tuple["Cgroups | None", str]:
        """The agents' cgroups of this state dir, or None and why not."""
        try:
            with open("/proc/self/mountinfo") as f:
                mount = _cgroup2_mount(f.read())
            with open("/proc/self/cgroup") as f:
                own = _own_cgroup(f.read())
        except OSError as exc:
            return None, f"cannot read /proc: {exc.strerror}"
        if mount is None or own is None:
            return None, "no cgroup v2 hierarchy is mounted"
        tag = hashlib.sha256(os.path.realpath(state_dir).encode()).hexdigest()[:12]
        parent = os.path.join(mount, own.lstrip("/"), f"capsulefs-{tag}")
        made = not os.path.isdir(parent)
        try:  # (a probe: made only to see that it can be, and what it holds)
            os.makedirs(parent, exist_ok=True)
        except OSError as exc:
            return None, f"cannot make a cgroup in {os.path.dirname(parent)}: {exc.strerror}"
        killable = os.path.exists(os.path.join(parent, "cgroup.kill"))
        if made:
            cls(parent).close()
        if not killable:
            return None, "the kernel's cgroup v2 has no cgroup.kill (Linux 5.14 or later)"
        return cls(parent), ""

    def path(self, agent_id: str) -> str:
        return os.path.join(self.parent, agent_id)

    def make(self, agent_id: str) -> str:
        """The agent's cgroup (made if missing): its ``cgroup.procs`` path."""
        os.makedirs(self.path(agent_id), exist_ok=True)  # (and the state dir's, if missing)
        return os.path.join(self.path(agent_id), "cgroup.procs")

    def kill(self, agent_id: str) -> None:
        """SIGKILL every process in the agent's cgroup (if it has one)."""
        try:
            with open(os.path.join(self.path(agent_id), "cgroup.kill"), "w") as f:
                f.write("1")
        except FileNotFoundError:
            pass

    def populated(self, agent_id: str) -> bool:
        try:
            with open(os.path.join(self.path(agent_id), "cgroup.events")) as f:
                return "populated 1" in f.read()
        except FileNotFoundError:
            return False

    def remove(self, agent_id: str) -> bool:
        """Remove the agent's (empty) cgroup; False if it still holds processes."""
        try:
            os.rmdir(self.path(agent_id))
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno == errno.EBUSY:
                return False
            raise
        return True

    def leftovers(self) -> list[str]:
        try:
            return sorted(n for n in os.listdir(self.parent) if os.path.isdir(os.path.join(self.parent, n)))
        except FileNotFoundError:
            return []

    def close(self) -> None:
        """Remove the state dir's cgroup directory if no agent's is left in it."""
        try:
            os.rmdir(self.parent)
        except OSError:
            pass


# -- ids and the sandbox's files ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ids:
    uid: int
    gid: int


def _read_uid(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _has_account(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


def _chown_tree(top: str, ids: Ids) -> int:
    """Give ``top`` and everything in it to ``ids``, walking by file
    descriptor without recursion and never following a symlink
    (``walk.walk_tree``: the tree may be a hostile earlier run's, as deep
    as it liked). A file with more links than the tree holds is left as
    it is: its other name is outside (an earlier agent hard-linked a file of
    its uid, or a world-readable one of root's, into its workspace), and
    giving the inode away would give the outside file with it. So is what
    lies deeper than ``workspace.MAX_DEPTH`` levels (no snapshot makes it;
    an earlier uid's run did) or was moved during the walk: it keeps the
    earlier owner, which this agent's uid cannot change it as. Returns how
    many files with links were left."""
    names: dict[tuple[int, int], int] = {}  # (dev, ino) of a file with links -> its names in the tree
    kept: set[tuple[int, int]] = set()  # those with a name outside it too
    missed: list[str] = []  # the first directory not walked, then one "" for each other

    def walk(give: Callable[[os.stat_result], bool]) -> None:
        for d in walk_tree(top, max_depth=workspace.MAX_DEPTH,
                           onerror=lambda rel, _exc: missed.append("" if missed else rel)):
            for name, st in d.entries:
                if give(st):
                    try:
                        os.chown(name, ids.uid, ids.gid, dir_fd=d.fd, follow_symlinks=False)
                    except FileNotFoundError:
                        pass

    def count(st: os.stat_result) -> bool:  # all but files with links; count those's names
        if stat.S_ISDIR(st.st_mode) or st.st_nlink == 1:
            return True
        names[(st.st_dev, st.st_ino)] = names.get((st.st_dev, st.st_ino), 0) + 1
        return False

    def linked(st: os.stat_result) -> bool:  # files with links, if every name is in the tree
        key = (st.st_dev, st.st_ino)
        if stat.S_ISDIR(st.st_mode) or key not in names:
            return False
        if st.st_nlink > names[key]:
            kept.add(key)
            return False
        return True

    os.chown(top, ids.uid, ids.gid, follow_symlinks=False)
    walk(count)
    if names:
        walk(linked)
    if kept:
        log.warning("sandbox %s: %d file(s) with hard links outside it keep their owner", top, len(kept))
    if missed:
        log.warning("sandbox %s: %d directories were not given to uid %d (deeper than %d levels, unreadable or "
                    "moved meanwhile), e.g. %.200s", top, len(missed), ids.uid, workspace.MAX_DEPTH, missed[0])
    return len(kept)


def _unreachable(path: str, ids: Ids) -> str | None:
    """The first directory above ``path`` (``path`` excluded) that ``ids``
    cannot pass through, if any: mode bits only, as root sees them."""
    chain = [os.path.dirname(os.path.abspath(path))]
    while chain[-1] != os.sep:
        chain.append(os.path.dirname(chain[-1]))
    for d in reversed(chain):
        try:
            st = os.stat(d)
        except FileNotFoundError:
            return None  # (nothing below exists yet: nothing to reach)
        if st.st_uid == ids.uid:
            ok = st.st_mode & stat.S_IXUSR
        elif st.st_gid == ids.gid:
            ok = st.st_mode & stat.S_IXGRP
        else:
            ok = st.st_mode & stat.S_IXOTH
        if not ok:
            return f"{d} (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


#: Looked up here, in the parent: a forked child must not enter the dynamic
#: loader (a worker thread may have held its lock at the fork).
_prctl = ctypes.CDLL(None, use_errno=True).prctl


def _enter(procs: str | None, ids: Ids) -> None:
    """In the forked child, as root, before exec: join the agent's cgroup,
    drop every group and become the agent's uid, for good."""
    if procs is not None:
        with open(procs, "w") as f:
            f.write("0")
    os.setgroups([])
    os.setresgid(ids.gid, ids.gid, ids.gid)
    os.setresuid(ids.uid, ids.uid, ids.uid)
    if _prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    # After the uid change, which clears it: die with the daemon (see process.Child).
    _prctl(PR_SET_PDEATHSIG, 9)


class Isolation:
    """How this host's agents are kept from the daemon's files and each other."""

    def __init__(self, state_dir: str, *, uids: range | None, cgroups: Cgroups | None = None,
                 why_off: str = "", why_no_cgroup: str = "",
                 on_new_owner: Callable[[str], None] = lambda agent_id: None) -> None:
        self.state_dir = os.path.abspath(state_dir)
        self.sandbox_root = os.path.join(self.state_dir, SANDBOXES_DIR)
        self.uids = uids  # None: isolation is off
        self.cgroups = cgroups
        self.why_off = why_off
        self.why_no_cgroup = why_no_cgroup
        self._ids: dict[str, Ids] = {}
        #: Called with an agent's id once it was given its uid (the mount
        #: drops the kernel's cached owner of the agent's files).
        self.on_new_owner = on_new_owner
        if uids is not None and os.path.isdir(self.sandbox_root):
            for agent_id in os.listdir(self.sandbox_root):
                uid = _read_uid(os.path.join(self.sandbox_root, agent_id, UID_FILE))
                if uid is not None:
                    self._ids[agent_id] = Ids(uid, uid)

    @classmethod
    def detect(cls, state_dir: str, environ: Mapping[str, str] | None = None,
               euid: Callable[[], int] = os.geteuid,
               on_new_owner: Callable[[str], None] = lambda agent_id: None) -> "Isolation":
        environ = os.environ if environ is None else environ
        if euid() != 0:
            return cls(state_dir, uids=None, why_off="the daemon does not run as root", on_new_owner=on_new_owner)
        uids = parse_uids(environ[UIDS_ENV]) if environ.get(UIDS_ENV) else DEFAULT_UIDS
        cgroups, why = Cgroups.find(state_dir)
        return cls(state_dir, uids=uids, cgroups=cgroups, why_no_cgroup=why, on_new_owner=on_new_owner)

    @property
    def enabled(self) -> bool:
        return self.uids is not None

    def describe(self, agent_id: str) -> str:
        """One line for the agent's status."""
        if not self.enabled:
            return f"off: {self.why_off}; the agent runs as the daemon's user and can read its state directory"
        ids = self._ids.get(agent_id)
        who = f"uid {ids.uid}" if ids else "its own uid"
        where = "its own cgroup" if self.cgroups else f"its process group only ({self.why_no_cgroup})"
        return f"on: {who}, contained by {where}; no network isolation"

    def announce(self) -> None:
        """Say once, in the log, what isolation this daemon gives its agents."""
        if self.uids is None:  # (not enabled)
            log.warning("sandbox isolation is off (%s): agent processes run as uid %d and can read %s, "
                        "its keychain and TLS key included", self.why_off, os.getuid(), self.state_dir)
            return
        log.info("sandbox isolation is on: each agent runs as a uid of its own (%d-%d)",
                 self.uids.start, self.uids.stop - 1)
        if self.cgroups is None:
            log.warning("no cgroup for agents (%s): a process that leaves its agent's process group "
                        "(setsid) can outlive its agent's stop", self.why_no_cgroup)

    def owner_of(self, agent_id: str) -> int | None:
        """The uid the agent's processes run as, if it has one (for the mount)."""
        ids = self._ids.get(agent_id)
        return ids.uid if ids else None

    def forget(self, agent_id: str) -> None:
        """The agent's sandbox (and its uid record) was discarded."""
        self._ids.pop(agent_id, None)

    # -- the state directory --------------------------------------------------------------
    def harden_state_dir(self) -> list[str]:
        """Make the state directory passable, not readable, by agents (see the
        rules); the paths whose modes were changed."""
        changed = []

        def ensure(path: str, mode: int) -> None:
            st = os.stat(path, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode) or stat.S_IMODE(st.st_mode) == mode:
                return
            os.chmod(path, mode)
            changed.append(path)

        os.makedirs(self.sandbox_root, mode=0o711, exist_ok=True)
        ensure(self.state_dir, 0o711)
        for name in os.listdir(self.state_dir):
            path = os.path.join(self.state_dir, name)
            if name == SANDBOXES_DIR:
                ensure(path, 0o711)
                # Each agent's own: closed to the others now, not at its next
                # start (a stopped or blocked agent's may never start here).
                for agent_id in os.listdir(path):
                    agent_root = os.path.join(path, agent_id)
                    st = os.stat(agent_root, follow_symlinks=False)
                    if not stat.S_ISDIR(st.st_mode):
                        continue
                    ids = self._ids.get(agent_id)
                    if ids is not None:
                        os.chown(agent_root, 0, ids.gid, follow_symlinks=False)
                        ensure(agent_root, 0o710)
                    else:
                        os.chown(agent_root, 0, 0, follow_symlinks=False)
                        ensure(agent_root, 0o700)
                continue
            try:
                mode = stat.S_IMODE(os.stat(path, follow_symlinks=False).st_mode)
            except FileNotFoundError:
                continue
            ensure(path, mode & 0o700)
        for path in changed:
            log.info("sandbox: mode of %s set so that agents cannot read it", path)
        return changed

    # -- one agent ---------------------------------------------------------------------
    def ids_for(self, agent_id: str) -> Ids:
        """The agent's ids, allocated and recorded on first use."""
        ids = self._ids.get(agent_id)
        if ids is not None:
            return ids
        assert self.uids is not None
        # Never a uid given before, to an agent gone since: what it left in
        # /tmp, /dev/shm or IPC, or a process of it that survived, would be
        # the new agent's. The highest uid ever given is kept (HIGH_FILE).
        high = _read_uid(os.path.join(self.sandbox_root, HIGH_FILE))
        taken = {i.uid for i in self._ids.values()}
        floor = max([high if high is not None else -1, *taken]) + 1
        uid = next((u for u in self.uids if u >= floor and not _has_account(u)), None)
        if uid is None:
            raise SandboxError(f"no agent uid never given before is left in {self.uids.start}-{self.uids.stop - 1} "
                               f"({UIDS_ENV}; {os.path.join(self.sandbox_root, HIGH_FILE)} holds the highest given)")
        agent_root = os.path.join(self.sandbox_root, agent_id)
        os.makedirs(agent_root, exist_ok=True)
        atomic_write(os.path.join(self.sandbox_root, HIGH_FILE), f"{uid}\n".encode(), mode=0o600)
        atomic_write(os.path.join(agent_root, UID_FILE), f"{uid}\n".encode(), mode=0o600)
        self._ids[agent_id] = ids = Ids(uid, uid)
        log.info("agent %s: runs as uid %d", agent_id, uid)
        self.on_new_owner(agent_id)
        return ids

    def home(self, agent_id: str) -> str:
        return os.path.join(self.sandbox_root, agent_id, HOME_DIR)

    def prepare(self, agent_id: str, workspace: str, reach: Iterable[str]) -> Ids:
        """Give the agent's sandbox to its uid and check it can reach what it
        is given (the paths in ``reach``); its ids. No process of the agent
        may run meanwhile."""
        ids = self.ids_for(agent_id)
        agent_root = os.path.dirname(workspace)
        os.chown(agent_root, 0, ids.gid)
        os.chmod(agent_root, 0o710)
        home = self.home(agent_id)
        if not os.path.isdir(home):
            os.mkdir(home, 0o700)
            fsync_dir(agent_root)
        for d in (workspace, home):
            st = os.stat(d, follow_symlinks=False)
            if (st.st_uid, st.st_gid) != (ids.uid, ids.gid):
                _chown_tree(d, ids)  # (new, or an earlier uid's)
            os.chmod(d, 0o700, follow_symlinks=False)
        for path in reach:
            self.check_reachable(agent_id, path)
        return ids

    def check_reachable(self, agent_id: str, path: str) -> None:
        """Raise SandboxError if the agent's uid cannot pass through every
        directory above ``path``."""
        ids = self.ids_for(agent_id)
        blocked = _unreachable(path, ids)
        if blocked is not None:
            raise SandboxError(f"its uid {ids.uid} cannot reach {path}: {blocked} is not searchable by others "
                               f"(every directory above the state directory, the mount and its programs must be)")

    def preexec(self, agent_id: str) -> Callable[[], None]:
        """What the forked child runs before exec: enter the agent's sandbox."""
        ids = self.ids_for(agent_id)
        procs = self.cgroups.make(agent_id) if self.cgroups is not None else None
        return lambda: _enter(procs, ids)
