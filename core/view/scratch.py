"""The scratch area: where editors' temp, swap and backup files live.

Rules:
  * Editors create files beside the file they edit (``sed -i`` a temp file,
    vim a swap file and a ``4913`` probe, Python a ``.tmp``); those files
    are never part of a capsule. The mount keeps them here, outside every
    capsule, under ``<state>/mount/scratch/<agent_id>/<capsule dir>/``.
  * Only the capsule directories that hold an editable file may have
    scratch files (:data:`SCRATCH_DIRS`).
  * Scratch files are plain files: their bytes, mode and owner are the real
    file's, written in place by the editor that owns them (the one place
    capsulefs passes writes through rather than writing atomically). They survive a daemon restart (vim's swap files are for
    recovery), and are removed with their agent.
"""

from __future__ import annotations

import os

from ..capsule import format as fmt
from ..errors import NameTooLong, NotFoundError
from ..fsutil import atomic_write, makedirs_durable, remove_tree, subdirs
from .errors import NotPermitted

#: Capsule directories where editors may create scratch files (and where an
#: atomic writer of index.json puts its temp file).
SCRATCH_DIRS = frozenset({"memory", "environment", "memory/vector_index"})


def check_name(name: str) -> str:
    if not name or "/" in name or "\0" in name or name in (".", ".."):
        raise NotPermitted(f"{name!r} is not a valid file name")
    if len(name.encode("utf-8", "surrogateescape")) > fmt.MAX_NAME_BYTES:
        raise NameTooLong(f"{name[:20]!r}... is longer than {fmt.MAX_NAME_BYTES} bytes")
    return name


#: The scratch area's directory under the mount's work directory (``<state>/mount``).
SUBDIR = "scratch"


class ScratchArea:
    def __init__(self, root: str) -> None:
        self.root = root

    @classmethod
    def under(cls, work_dir: str) -> "ScratchArea":
        """The scratch area of the mount whose work directory is ``work_dir``."""
        return cls(os.path.join(work_dir, SUBDIR))

    def path(self, agent_id: str, reldir: str, name: str) -> str:
        if reldir not in SCRATCH_DIRS:
            raise NotPermitted(f"no files can be created in {reldir or 'the capsule top'}/ (only in {', '.join(sorted(SCRATCH_DIRS))}/)")
        return os.path.join(self.root, agent_id, reldir, check_name(name))

    def exists(self, agent_id: str, reldir: str, name: str) -> bool:
        if reldir not in SCRATCH_DIRS:
            return False
        try:
            return os.path.isfile(self.path(agent_id, reldir, name))
        except (NotPermitted, NameTooLong):
            return False

    def create(self, agent_id: str, reldir: str, name: str, mode: int, flags: int) -> int:
        """Create and open a new scratch file of exactly ``mode`` (the caller's
        umask is the kernel's business, already applied: the daemon's own
        umask must not be applied again); return its descriptor."""
        p = self.path(agent_id, reldir, name)
        makedirs_durable(os.path.dirname(p), 0o700)
        acc = flags & os.O_ACCMODE
        fd = os.open(p, acc | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, mode & 0o7777)
        except BaseException:
            os.close(fd)
            os.unlink(p)
            raise
        return fd

    def open(self, agent_id: str, reldir: str, name: str, flags: int) -> int:
        p = self.path(agent_id, reldir, name)
        keep = os.O_ACCMODE | os.O_APPEND | os.O_TRUNC
        try:
            return os.open(p, (flags & keep) | os.O_CLOEXEC)
        except FileNotFoundError:
            raise NotFoundError(f"{reldir}/{name}: no such file") from None

    def unlink(self, agent_id: str, reldir: str, name: str) -> None:
        try:
            os.unlink(self.path(agent_id, reldir, name))
        except FileNotFoundError:
            raise NotFoundError(f"{reldir}/{name}: no such file") from None

    def rename(self, agent_id: str, src: tuple[str, str], dst: tuple[str, str]) -> None:
        d = self.path(agent_id, *dst)
        makedirs_durable(os.path.dirname(d), 0o700)
        os.rename(self.path(agent_id, *src), d)

    def write(self, agent_id: str, reldir: str, name: str, data: bytes) -> None:
        """Make (or overwrite) a scratch file holding ``data``."""
        p = self.path(agent_id, reldir, name)
        makedirs_durable(os.path.dirname(p), 0o700)
        atomic_write(p, data)

    def read(self, agent_id: str, reldir: str, name: str) -> bytes:
        with open(self.path(agent_id, reldir, name), "rb") as f:
            return f.read()

    def names(self, agent_id: str, reldir: str) -> list[str]:
        if reldir not in SCRATCH_DIRS:
            return []
        try:
            return sorted(os.listdir(os.path.join(self.root, agent_id, reldir)))
        except FileNotFoundError:
            return []

    def dir_mtime_ns(self, agent_id: str, reldir: str) -> int:
        """When a scratch name in ``reldir`` last came or went (0: never)."""
        try:
            return os.stat(os.path.join(self.root, agent_id, reldir)).st_mtime_ns if reldir in SCRATCH_DIRS else 0
        except FileNotFoundError:
            return 0

    def stat(self, agent_id: str, reldir: str, name: str) -> os.stat_result:
        try:
            return os.stat(self.path(agent_id, reldir, name))
        except FileNotFoundError:
            raise NotFoundError(f"{reldir}/{name}: no such file") from None

    def agent_ids(self) -> list[str]:
        """The agents that have scratch files here."""
        return subdirs(self.root, fmt.is_agent_id)

    def remove_agent(self, agent_id: str) -> None:
        """Remove every scratch file of an agent (it is being removed from the host)."""
        remove_tree(os.path.join(self.root, fmt.check_agent_id(agent_id)), ignore_errors=True)
