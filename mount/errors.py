"""Domain errors to errno: the one place the FUSE adapter maps them.

Rules:
  * Every ``Operations`` method is wrapped by :func:`fuse_op`, so the only
    exception that reaches pyfuse3 is ``FUSEError(errno)``.
  * A domain error (``CapsuleError``) becomes the errno of its type in
    :data:`ERRNO` (the most specific base wins) and is logged once, at
    debug level for the everyday ENOENT/ENODATA/EEXIST, else as a warning
    that says why.
  * An ``OSError`` from the underlying file system keeps its errno.
  * Anything else is a bug or a broken store: it is logged with its
    traceback, the mount goes read-only (failsafe, as in S3QL) and the
    request fails with EIO. The mount never unmounts itself: a mount that
    suddenly looks empty makes mirror and backup tools delete data.
"""

from __future__ import annotations

import errno
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import pyfuse3

from capsulefs.core.errors import (
    CapsuleError,
    ExistsError,
    FilesBusy,
    FormatError,
    IntegrityError,
    NameTooLong,
    NotFoundError,
    StoreError,
)
from capsulefs.core.move.cause import Cause
from capsulefs.core.view.errors import (
    AccessDenied,
    IsADirectory,
    MoveBusy,
    MoveFailed,
    NoAttribute,
    NotADirectory,
    NotEmpty,
    NotPermitted,
    NotSupported,
    ReadOnly,
    TooLarge,
)

log = logging.getLogger(__name__)

#: Domain error type -> errno. StoreError is absent on purpose: a store that
#: cannot be read is an internal error (failsafe).
ERRNO: dict[type[CapsuleError], int] = {
    NotFoundError: errno.ENOENT,
    ExistsError: errno.EEXIST,
    FormatError: errno.EINVAL,  # includes SpecError, UnsafePathError
    NameTooLong: errno.ENAMETOOLONG,  # a FormatError too (the CLI says it as one)
    IntegrityError: errno.EIO,  # includes CorruptBlobError: that file only
    NotPermitted: errno.EPERM,
    AccessDenied: errno.EACCES,
    ReadOnly: errno.EROFS,
    NotEmpty: errno.ENOTEMPTY,
    NotSupported: errno.EOPNOTSUPP,
    NoAttribute: errno.ENODATA,
    IsADirectory: errno.EISDIR,
    NotADirectory: errno.ENOTDIR,
    TooLarge: errno.EFBIG,
    FilesBusy: errno.EBUSY,  # a snapshot while a `capsulefs append` holds the agent's files
    # How a move asked for through .control/move ended (docs/move.md):
    MoveBusy: errno.EBUSY,
}
#: A failed move's cause -> errno (docs/move.md, "Errors of .control/move").
MOVE_ERRNO: dict[Cause, int] = {
    Cause.REFUSED: errno.EPERM,
    Cause.STALE: errno.EEXIST,
    Cause.CORRUPT: errno.EIO,
    Cause.UNREACHABLE: errno.EHOSTUNREACH,
    Cause.CONNECTION_REFUSED: errno.ECONNREFUSED,
    Cause.TIMEOUT: errno.ETIMEDOUT,
    Cause.ABANDONED: errno.ECANCELED,
    Cause.NOT_HOLDER: errno.EPERM,
}
QUIET = frozenset({errno.ENOENT, errno.ENODATA, errno.EEXIST})
#: Refusals that editors and copy tools provoke as a matter of course (vim
#: copies extended attributes on every save): logged at debug level too.
QUIET_OPS = frozenset({("setxattr", errno.EOPNOTSUPP), ("removexattr", errno.EOPNOTSUPP)})


def errno_for(exc: BaseException) -> int | None:
    """The errno of a domain error, or None if it is an internal error."""
    if isinstance(exc, StoreError):
        return None
    if isinstance(exc, MoveFailed):
        return MOVE_ERRNO.get(exc.cause, errno.EPERM)
    for cls in type(exc).__mro__:
        if cls in ERRNO:
            return ERRNO[cls]
    return None


class Failsafe(Protocol):
    def enter_failsafe(self, reason: str) -> None: ...


class HasFailsafe(Protocol):
    live: Failsafe


F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


def fuse_op(fn: F) -> F:
    """Wrap an ``Operations`` method: map errors, log, go failsafe on bugs."""
    name = fn.__name__

    @functools.wraps(fn)
    async def wrapper(self: HasFailsafe, *args: Any) -> Any:
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s%r", name, tuple(a for a in args if not isinstance(a, (bytes, memoryview)) or len(a) < 256))
        try:
            return await fn(self, *args)
        except pyfuse3.FUSEError:
            raise
        except CapsuleError as exc:
            code = errno_for(exc)
            if code is None:
                log.exception("%s: internal error: %s", name, exc)
                self.live.enter_failsafe(f"{name}: {type(exc).__name__}: {exc}")
                raise pyfuse3.FUSEError(errno.EIO) from None
            quiet = code in QUIET or (name, code) in QUIET_OPS
            log.log(logging.DEBUG if quiet else logging.WARNING, "%s: %s [%s]",
                    name, exc, errno.errorcode.get(code, code))
            raise pyfuse3.FUSEError(code) from None
        except OSError as exc:
            code = exc.errno or errno.EIO
            log.log(logging.DEBUG if code in QUIET else logging.WARNING, "%s: %s", name, exc)
            raise pyfuse3.FUSEError(code) from None
        except Exception as exc:
            log.exception("%s: internal error", name)
            self.live.enter_failsafe(f"{name}: {type(exc).__name__}: {exc}")
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapper  # type: ignore[return-value]
