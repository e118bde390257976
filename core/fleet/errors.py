"""Errors of the fleet engines: the directory (etcd) and the blob tier (S3).

Every reply from either engine is hostile input. The clients in
``capsulefs.fleet`` map transport failures (httpx, OS errors) and the
engines' own error answers to these types at their one boundary, so no
httpx or OS exception leaks past them.

The directory's unavailability comes in two kinds, because a caller of a
write must know whether it may have been applied:
  * :class:`DirectoryUnreachable`: no connection could be made to any
    endpoint; the request was never sent, so it certainly did not apply.
  * :class:`DirectoryReplyLost`: the request may have reached etcd and its
    outcome is unknown (timeout, connection cut, etcd's own "request timed
    out" or "leader changed"); read the key again to learn what happened.
"""

from __future__ import annotations

from capsulefs.core.errors import CapsuleError


class FleetError(CapsuleError):
    """A fleet engine failed; the subclass says which and how."""


class FleetAddressError(FleetError):
    """An etcd or blob tier address given by a person is malformed."""


# -- the directory (etcd) ------------------------------------------------------


class DirectoryError(FleetError):
    """The directory (etcd) failed."""


class DirectoryUnavailable(DirectoryError):
    """No answer from the directory (see the two subclasses)."""


class DirectoryUnreachable(DirectoryUnavailable):
    """No endpoint accepted a connection: the request was not sent."""


class DirectoryReplyLost(DirectoryUnavailable):
    """The request may have been applied; its answer never arrived."""


class DirectoryProtocolError(DirectoryError):
    """The directory's answer is not what etcd's JSON gateway sends."""


class DirectoryRefused(DirectoryError):
    """etcd answered with an error; ``code`` is its gRPC status code."""

    def __init__(self, code: int, message: str) -> None:
        self.code = code
        self.message = message
        super().__init__(f"etcd refused the request (code {code}): {message}")


class LeaseNotFound(DirectoryRefused):
    """The lease does not exist (never granted, expired or revoked)."""


class RevisionCompacted(DirectoryRefused):
    """The revision asked for has been compacted away."""


# -- the blob tier (S3) --------------------------------------------------------


class BlobTierError(FleetError):
    """The blob tier (an S3-compatible store) failed."""


class BlobTierUnavailable(BlobTierError):
    """No usable answer: connection failure, timeout, or a 5xx answer."""


class BlobTierProtocolError(BlobTierError):
    """The tier's answer is not what an S3 API sends."""


class BlobTierRefused(BlobTierError):
    """The tier answered with an error (``status``, S3 error ``code``)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        self.status = status
        self.code = code
        self.message = message
        super().__init__(f"{message} (HTTP {status}{', ' + code if code else ''})")


class PreconditionFailed(BlobTierRefused):
    """412: an If-None-Match or If-Match condition did not hold."""


class ConditionalConflict(BlobTierRefused):
    """409 ConditionalRequestConflict: a concurrent conditional write to the
    same key was in progress; S3 asks the caller to retry."""


class ObjectNotFound(BlobTierRefused):
    """404 NoSuchKey: no object under that key."""


class BucketNotFound(BlobTierRefused):
    """404 NoSuchBucket: the bucket does not exist."""
