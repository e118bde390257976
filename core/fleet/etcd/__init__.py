"""etcd's v3 API over its JSON gateway, sans-IO: requests built, replies parsed.

Rules:
  * Paths: etcd 3.4 serves ``/v3/*`` (and still ``/v3beta/*``), 3.5 and later
    only ``/v3/*``, 3.3 and earlier only ``/v3beta`` or ``/v3alpha``. We speak
    ``/v3``: etcd 3.4 or later.
  * Keys and values are bytes; the gateway carries them in base64 (standard
    alphabet, padded). 64-bit integers travel as JSON strings
    (``"revision": "5"``), and proto3 leaves out every field at its default,
    so an absent field is 0, false or empty.
  * A reply is parsed strictly: duplicate JSON keys, a wrong type, bad base64,
    an integer out of range, a Txn answer that does not match the operations
    sent -> :class:`DirectoryProtocolError`. Unknown fields are ignored (newer
    etcd versions add some).
  * An error answer ``{"error"|"message": str, "code": int}`` maps by its gRPC
    code (:func:`decode_error`): 4 DEADLINE_EXCEEDED and 14 UNAVAILABLE ->
    :class:`DirectoryReplyLost` (etcd's "request timed out" may still apply),
    5 NOT_FOUND of a lease -> :class:`LeaseNotFound`, 11 OUT_OF_RANGE of a
    compacted revision -> :class:`RevisionCompacted`, anything else ->
    :class:`DirectoryRefused`.

Theory of operation: each operation has a builder in ``_ops`` returning a
:class:`Request` (path, JSON body, whether sending it twice is harmless) and
a decoder in ``_replies`` from the reply's bytes to a frozen result. The
client in ``capsulefs.fleet.etcd`` posts the one and feeds the other.
"""

from ._ops import (
    API,
    Compare,
    Delete,
    Op,
    Put,
    Range,
    Request,
    Result,
    Target,
    compaction_request,
    delete_request,
    lease_grant_request,
    lease_keepalive_request,
    lease_revoke_request,
    lease_ttl_request,
    parse_endpoints,
    prefix_end,
    put_request,
    range_request,
    txn_request,
    watch_request,
)
from ._replies import (
    MAX_LINE,
    DeleteResult,
    EventType,
    KeyValue,
    Lease,
    LeaseTTL,
    LineSplitter,
    OpResult,
    PutResult,
    RangeResult,
    TxnResult,
    WatchEvent,
    WatchResponse,
    decode_compaction,
    decode_delete,
    decode_error,
    decode_keepalive,
    decode_lease_grant,
    decode_lease_ttl,
    decode_put,
    decode_range,
    decode_revoke,
    decode_txn,
    decode_watch_line,
    error_from_status,
    load_json,
)

__all__ = [
    "API",
    "MAX_LINE",
    "Compare",
    "Delete",
    "DeleteResult",
    "EventType",
    "KeyValue",
    "Lease",
    "LeaseTTL",
    "LineSplitter",
    "Op",
    "OpResult",
    "Put",
    "PutResult",
    "Range",
    "RangeResult",
    "Request",
    "Result",
    "Target",
    "TxnResult",
    "WatchEvent",
    "WatchResponse",
    "compaction_request",
    "decode_compaction",
    "decode_delete",
    "decode_error",
    "decode_keepalive",
    "decode_lease_grant",
    "decode_lease_ttl",
    "decode_put",
    "decode_range",
    "decode_revoke",
    "decode_txn",
    "decode_watch_line",
    "delete_request",
    "error_from_status",
    "lease_grant_request",
    "lease_keepalive_request",
    "lease_revoke_request",
    "lease_ttl_request",
    "load_json",
    "parse_endpoints",
    "prefix_end",
    "put_request",
    "range_request",
    "txn_request",
    "watch_request",
]
