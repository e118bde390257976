"""Errors of the live view (``host``, ``scratch``, ``snapshots``).

Each names one refusal a file system must be able to express; the FUSE
adapter maps each type to exactly one errno in ``capsulefs.mount.errors``
(given here in brackets for the reader).
"""

from __future__ import annotations

from ..errors import CapsuleError, IntegrityError
from ..move.cause import Cause


class NotPermitted(CapsuleError):
    """The capsule format forbids this change [EPERM]."""


class AccessDenied(CapsuleError):
    """Only the mounting user and root may do this [EACCES]."""


class ReadOnly(CapsuleError):
    """The agent is frozen, or the mount went read-only after an error [EROFS]."""


class NotEmpty(CapsuleError):
    """A directory that cannot be removed this way [ENOTEMPTY]."""


class NotSupported(CapsuleError):
    """Not available (yet) on this mount [EOPNOTSUPP]."""


class NoAttribute(CapsuleError):
    """No such extended attribute [ENODATA]."""


class IsADirectory(CapsuleError):
    """A file operation on a directory [EISDIR]."""


class NotADirectory(CapsuleError):
    """A directory operation on a file [ENOTDIR]."""


class TooLarge(CapsuleError):
    """A file would grow beyond what the capsule holds of it [EFBIG]."""


class BlobEvicted(IntegrityError):
    """A blob a capsule lists was evicted from the store (``gc --tier-cache``)
    and the blob tier holds it: the adapter fetches it back (``TierCache``)
    and opens again [EIO if it cannot]."""

    def __init__(self, sha256: str, size: int) -> None:
        super().__init__(f"blob {sha256} was evicted from the store (the blob tier holds it)")
        self.sha256 = sha256
        self.size = size


# -- how a move asked for through ``.control/move`` ended (see docs/move.md) ----------


class MoveBusy(CapsuleError):
    """A move of this agent is already under way here [EBUSY]."""


class MoveFailed(CapsuleError):
    """A move asked for through ``.control/move`` ended without moving the
    agent; ``cause`` says why (``mount/errors.py`` maps it to an errno)."""

    def __init__(self, cause: Cause, message: str) -> None:
        super().__init__(message)
        self.cause = cause
