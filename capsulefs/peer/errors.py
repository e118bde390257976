"""The peer link's errors, and the one place library errors become them.

Rules:
  * Errors are mapped at this boundary (httpcore style): OSError, ssl and
    trio errors become :class:`PeerError` subclasses (:func:`map_errors`);
    a remote handler's failure arrives as :class:`RemoteError` with a code.
  * A handler raises :class:`CallFailed` to answer a call with a named code.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from contextlib import contextmanager

import trio

from capsulefs.core.errors import CapsuleError

__all__ = [
    "CallFailed",
    "PeerBroken",
    "PeerError",
    "PeerProtocolError",
    "PeerRefused",
    "PeerUnreachable",
    "RemoteError",
    "map_errors",
]


class PeerError(CapsuleError):
    """The peer link failed; the subclass says how."""


class PeerUnreachable(PeerError):
    """No TCP connection could be made to the peer's address."""


class PeerRefused(PeerError):
    """Authentication failed: the peer is unknown, or its id is not the pinned one."""


class PeerBroken(PeerError):
    """The link broke in the middle of a call (reset, EOF, TLS failure)."""


class PeerProtocolError(PeerError):
    """The other end sent something that is not a valid frame or message."""


class RemoteError(PeerError):
    """The remote end ran the call and reports a failure."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        self.message = message
        super().__init__(f"peer error {code}: {message}")


class CallFailed(CapsuleError):
    """Raised by a handler to send a named error code back to the caller."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        self.message = message
        super().__init__(message)



@contextmanager
def map_errors(what: str) -> Iterator[None]:
    try:
        yield
    except PeerError:
        raise
    except ssl.SSLError as exc:
        raise PeerBroken(f"{what}: TLS failure: {exc.reason or exc}") from exc
    except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        cause = exc.__cause__ or exc
        if isinstance(cause, ssl.SSLError):
            raise PeerBroken(f"{what}: TLS failure: {cause.reason or cause}") from exc
        raise PeerBroken(f"{what}: link broken: {cause}") from exc
    except OSError as exc:
        raise PeerBroken(f"{what}: {exc.strerror or exc}") from exc
