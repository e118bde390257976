"""Errors of the live view (``live``, ``scratch``, ``snapshots``).

Each names one refusal a file system must be able to express; the FUSE
adapter maps each type to exactly one errno in ``capsulefs.mount.errors``
(given here in brackets for the reader).
"""

from __future__ import annotations

from .errors import CapsuleError


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
