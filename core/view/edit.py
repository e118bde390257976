"""An edit of an editable file (working memory, the spec): the bytes its
writers share until a commit, like an inode's pages (the rules are in ``host``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import CapsuleError
from .errors import TooLarge

#: Largest working_memory.md or spec.json a write or truncate may make: the
#: file being edited is held in the daemon's memory until it is committed.
MAX_EDIT_SIZE = 64 << 20


@dataclass(slots=True)
class Edit:
    """An editable file being written: its bytes as writers see them.

    ``dirty``: changed since the last commit; ``written``: by a write (not
    only a truncate). ``detached``: the file was replaced (renamed over)
    while open; like writers of an unlinked inode, its writers go on
    writing bytes that nobody will see and nothing commits. ``fresh``: a
    file created anew after an unlink, not committed yet; it takes the
    capsule's mode at its commit, so mode changes until then are accepted
    (``install`` copies under mode 0600, ``mv`` sets the source's mode).
    ``failed``: a write to it failed (too large, read-only...); the bytes
    are not what any writer meant, so the edit is detached and poisoned:
    its writes, truncates and fsyncs fail with that error, nothing of it is
    committed, and the file stays as it was (the next open starts anew);
    a close fails too if bytes written before the failure were dropped
    (``dropped``)."""

    data: bytearray
    dirty: bool = False
    written: bool = False
    writers: int = 0
    detached: bool = False
    fresh: bool = False
    failed: CapsuleError | None = None
    dropped: bool = False
    times: tuple[int, int] | None = None  # (atime, mtime) set after the last write: applied at its commit


def check_edit_size(rel: str, size: int, now: int = 0) -> None:
    """TooLarge if ``rel`` would grow from ``now`` bytes to ``size``, beyond MAX_EDIT_SIZE."""
    if size > max(now, MAX_EDIT_SIZE):
        raise TooLarge(f"{rel} may not grow beyond {MAX_EDIT_SIZE >> 20} MiB")


def resize(buf: bytearray, size: int, rel: str) -> None:
    """Cut or zero-extend ``buf`` (the edit of ``rel``) to ``size`` bytes, like ftruncate."""
    check_edit_size(rel, size, len(buf))
    if size < len(buf):
        del buf[size:]
    else:
        buf.extend(b"\0" * (size - len(buf)))
