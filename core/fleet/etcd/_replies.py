"""Replies of etcd's JSON gateway, parsed strictly into frozen results.

Rules: see the package's docstring. Every decoder takes the reply's bytes
and returns a result or raises a :class:`DirectoryError`; nothing else
escapes (tests/fuzz/targets_fleet.py).
"""

from __future__ import annotations

import base64
import binascii
import enum
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from capsulefs.core.fleet.errors import (
    DirectoryError,
    DirectoryProtocolError,
    DirectoryRefused,
    DirectoryReplyLost,
    LeaseNotFound,
    RevisionCompacted,
)

from ._ops import API, INT64_MAX, Delete, Op, Put, Range

MAX_LINE = 4 << 20  # one line of a watch or keepalive stream


@dataclass(frozen=True, slots=True, kw_only=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RangeResult:
    revision: int  # the store's revision when the read was served
    kvs: tuple[KeyValue, ...]
    count: int  # keys in the range (more than len(kvs) with a limit)
    more: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class PutResult:
    revision: int  # the revision this write made
    prev_kv: KeyValue | None


@dataclass(frozen=True, slots=True, kw_only=True)
class DeleteResult:
    revision: int
    deleted: int
    prev_kvs: tuple[KeyValue, ...]


OpResult = RangeResult | PutResult | DeleteResult


@dataclass(frozen=True, slots=True, kw_only=True)
class TxnResult:
    revision: int
    succeeded: bool  # the compares held: ``responses`` answer the success branch
    responses: tuple[OpResult, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Lease:
    id: int
    ttl: int  # seconds, as granted (etcd may raise a small TTL to its minimum)


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaseTTL:
    id: int
    ttl: int  # seconds left
    granted_ttl: int
    keys: tuple[bytes, ...]


class EventType(enum.Enum):
    PUT = "PUT"
    DELETE = "DELETE"


@dataclass(frozen=True, slots=True, kw_only=True)
class WatchEvent:
    type: EventType
    kv: KeyValue
    prev_kv: KeyValue | None


@dataclass(frozen=True, slots=True, kw_only=True)
class WatchResponse:
    revision: int
    watch_id: int
    created: bool
    canceled: bool
    compact_revision: int  # when canceled because start_revision was compacted
    cancel_reason: str
    events: tuple[WatchEvent, ...] = field(default=())


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise DirectoryProtocolError(f"etcd reply repeats the field {k!r}")
        out[k] = v
    return out


def load_json(body: bytes, what: str) -> dict[str, Any]:
    """One JSON object from the gateway; anything else is a protocol error."""
    try:
        doc = json.loads(body.decode("utf-8"), object_pairs_hook=_reject_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise DirectoryProtocolError(f"{what}: not JSON ({type(exc).__name__}: {str(exc)[:80]})") from None
    if not isinstance(doc, dict):
        raise DirectoryProtocolError(f"{what}: not a JSON object")
    return doc


def _obj(doc: dict[str, Any], name: str, what: str) -> dict[str, Any]:
    value = doc.get(name, {})
    if not isinstance(value, dict):
        raise DirectoryProtocolError(f"{what}: {name} is not an object")
    return value


def _int(doc: dict[str, Any], name: str, what: str, *, minimum: int = 0) -> int:
    value = doc.get(name, 0)
    if isinstance(value, str):
        digits = value[1:] if value.startswith("-") else value
        if not (digits.isascii() and digits.isdigit() and len(digits) <= 19):
            raise DirectoryProtocolError(f"{what}: {name} is not an integer: {value[:40]!r}")
        value = int(value)
    elif isinstance(value, bool) or not isinstance(value, int):
        raise DirectoryProtocolError(f"{what}: {name} is not an integer")
    if not minimum <= value <= INT64_MAX:
        raise DirectoryProtocolError(f"{what}: {name} is out of range: {value}")
    return value


def _bool(doc: dict[str, Any], name: str, what: str) -> bool:
    value = doc.get(name, False)
    if not isinstance(value, bool):
        raise DirectoryProtocolError(f"{what}: {name} is not a boolean")
    return value


def _str(doc: dict[str, Any], name: str, what: str) -> str:
    value = doc.get(name, "")
    if not isinstance(value, str):
        raise DirectoryProtocolError(f"{what}: {name} is not a string")
    return value


def _bytes(doc: dict[str, Any], name: str, what: str) -> bytes:
    value = _str(doc, name, what)
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise DirectoryProtocolError(f"{what}: {name} is not base64") from None


def _list(doc: dict[str, Any], name: str, what: str) -> list[Any]:
    value = doc.get(name, [])
    if not isinstance(value, list):
        raise DirectoryProtocolError(f"{what}: {name} is not a list")
    return value


def _revision(doc: dict[str, Any], what: str) -> int:
    return _int(_obj(doc, "header", what), "revision", what + " header")


def _kv(value: Any, what: str) -> KeyValue:
    if not isinstance(value, dict):
        raise DirectoryProtocolError(f"{what}: a key-value is not an object")
    kv = KeyValue(
        key=_bytes(value, "key", what),
        value=_bytes(value, "value", what),
        create_revision=_int(value, "create_revision", what),
        mod_revision=_int(value, "mod_revision", what),
        version=_int(value, "version", what),
        lease=_int(value, "lease", what),
    )
    if not kv.key:
        raise DirectoryProtocolError(f"{what}: a key-value has an empty key")
    return kv


def _kvs(doc: dict[str, Any], name: str, what: str) -> tuple[KeyValue, ...]:
    return tuple(_kv(v, what) for v in _list(doc, name, what))


def _range_result(doc: dict[str, Any], what: str) -> RangeResult:
    result = RangeResult(
        revision=_revision(doc, what),
        kvs=_kvs(doc, "kvs", what),
        count=_int(doc, "count", what),
        more=_bool(doc, "more", what),
    )
    if result.count < len(result.kvs):
        raise DirectoryProtocolError(f"{what}: count {result.count} is less than the {len(result.kvs)} keys sent")
    return result


def _put_result(doc: dict[str, Any], what: str) -> PutResult:
    prev = doc.get("prev_kv")
    return PutResult(revision=_revision(doc, what), prev_kv=None if prev is None else _kv(prev, what))


def _delete_result(doc: dict[str, Any], what: str) -> DeleteResult:
    return DeleteResult(
        revision=_revision(doc, what), deleted=_int(doc, "deleted", what), prev_kvs=_kvs(doc, "prev_kvs", what)
    )


def decode_range(body: bytes) -> RangeResult:
    return _range_result(load_json(body, "etcd range"), "etcd range")


def decode_put(body: bytes) -> PutResult:
    return _put_result(load_json(body, "etcd put"), "etcd put")


def decode_delete(body: bytes) -> DeleteResult:
    return _delete_result(load_json(body, "etcd delete"), "etcd delete")


_RESPONSE_OF = {Range: "response_range", Put: "response_put", Delete: "response_delete_range"}


def decode_txn(body: bytes, success: Sequence[Op], failure: Sequence[Op]) -> TxnResult:
    """A Txn's answer, checked against the operations sent: one response per
    operation of the branch taken, each of the matching kind."""
    what = "etcd txn"
    doc = load_json(body, what)
    succeeded = _bool(doc, "succeeded", what)
    ops = success if succeeded else failure
    raw = _list(doc, "responses", what)
    if len(raw) != len(ops):
        raise DirectoryProtocolError(f"{what}: {len(raw)} responses for {len(ops)} operations")
    responses: list[OpResult] = []
    for op, item in zip(ops, raw, strict=True):
        name = _RESPONSE_OF[type(op)]
        if not isinstance(item, dict) or set(item) != {name} or not isinstance(item[name], dict):
            raise DirectoryProtocolError(f"{what}: a response is not the {name} its operation asks for")
        inner = item[name]
        match op:
            case Range():
                responses.append(_range_result(inner, what))
            case Put():
                responses.append(_put_result(inner, what))
            case Delete():
                responses.append(_delete_result(inner, what))
    return TxnResult(revision=_revision(doc, what), succeeded=succeeded, responses=tuple(responses))


def decode_lease_grant(body: bytes) -> Lease:
    what = "etcd lease grant"
    doc = load_json(body, what)
    if error := _str(doc, "error", what):
        raise DirectoryRefused(0, error)
    lease = Lease(id=_int(doc, "ID", what), ttl=_int(doc, "TTL", what))
    if lease.id == 0 or lease.ttl == 0:
        raise DirectoryProtocolError(f"{what}: no lease id or TTL in the answer")
    return lease


def _stream_message(line: bytes, what: str) -> dict[str, Any]:
    """One line of a gateway stream: ``{"result": {...}}`` or ``{"error": {...}}``."""
    doc = load_json(line, what)
    if "error" in doc:
        error = doc["error"]
        if not isinstance(error, dict):
            raise DirectoryProtocolError(f"{what}: error is not an object")
        code = error.get("grpc_code", error.get("code", 2))
        raise error_from_status(code if isinstance(code, int) and not isinstance(code, bool) else 2,
                                _str(error, "message", what) or "stream error")
    if "result" not in doc:
        raise DirectoryProtocolError(f"{what}: neither result nor error")
    return _obj(doc, "result", what)


def decode_keepalive(body: bytes, lease_id: int) -> int:
    """The TTL a keepalive renewed ``lease_id`` for; :class:`LeaseNotFound` if
    etcd no longer has the lease (it answers with no TTL)."""
    what = "etcd lease keepalive"
    lines = [line for line in body.split(b"\n") if line.strip()]
    if len(lines) != 1:
        raise DirectoryProtocolError(f"{what}: {len(lines)} answers to one keepalive")
    result = _stream_message(lines[0], what)
    if _int(result, "ID", what) != lease_id:
        raise DirectoryProtocolError(f"{what}: the answer is about another lease")
    ttl = _int(result, "TTL", what)
    if ttl == 0:
        raise LeaseNotFound(5, f"lease {lease_id:x} not found (expired or revoked)")
    return ttl


def decode_lease_ttl(body: bytes, lease_id: int) -> LeaseTTL | None:
    """A lease's time left, or None if etcd does not have it (TTL -1)."""
    what = "etcd lease timetolive"
    doc = load_json(body, what)
    if _int(doc, "ID", what) != lease_id:
        raise DirectoryProtocolError(f"{what}: the answer is about another lease")
    ttl = _int(doc, "TTL", what, minimum=-1)
    if ttl == -1:
        return None
    keys = tuple(_bytes({"k": k}, "k", what) for k in _list(doc, "keys", what))
    return LeaseTTL(id=lease_id, ttl=ttl, granted_ttl=_int(doc, "grantedTTL", what), keys=keys)


def decode_compaction(body: bytes) -> int:
    return _revision(load_json(body, "etcd compaction"), "etcd compaction")


def decode_revoke(body: bytes) -> int:
    return _revision(load_json(body, "etcd lease revoke"), "etcd lease revoke")


def decode_watch_line(line: bytes) -> WatchResponse:
    what = "etcd watch"
    result = _stream_message(line, what)
    events = []
    for raw in _list(result, "events", what):
        if not isinstance(raw, dict):
            raise DirectoryProtocolError(f"{what}: an event is not an object")
        kind = _str(raw, "type", what) or "PUT"
        if kind not in EventType.__members__:
            raise DirectoryProtocolError(f"{what}: unknown event type {kind[:20]!r}")
        prev = raw.get("prev_kv")
        events.append(WatchEvent(type=EventType[kind], kv=_kv(raw.get("kv"), what),
                                 prev_kv=None if prev is None else _kv(prev, what)))
    return WatchResponse(
        revision=_revision(result, what),
        watch_id=_int(result, "watch_id", what),
        created=_bool(result, "created", what),
        canceled=_bool(result, "canceled", what),
        compact_revision=_int(result, "compact_revision", what),
        cancel_reason=_str(result, "cancel_reason", what),
        events=tuple(events),
    )


class LineSplitter:
    """Cuts a stream's bytes into lines of at most ``limit`` bytes."""

    def __init__(self, limit: int = MAX_LINE) -> None:
        self.limit = limit
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        lines = []
        while (end := self._buf.find(b"\n")) >= 0:
            line = bytes(self._buf[:end])
            del self._buf[: end + 1]
            if line.strip():
                lines.append(line)
        if len(self._buf) > self.limit or any(len(line) > self.limit for line in lines):
            raise DirectoryProtocolError(f"etcd stream: a line longer than {self.limit} bytes")
        return lines


# -- errors --------------------------------------------------------------------

GRPC_DEADLINE_EXCEEDED = 4
GRPC_NOT_FOUND = 5
GRPC_OUT_OF_RANGE = 11
GRPC_UNAVAILABLE = 14


def error_from_status(code: int, message: str) -> DirectoryError:
    """Our error for etcd's gRPC status ``code`` and ``message``."""
    message = message[:300]
    if code in (GRPC_DEADLINE_EXCEEDED, GRPC_UNAVAILABLE):
        return DirectoryReplyLost(f"etcd could not answer (code {code}): {message}")
    if code == GRPC_NOT_FOUND and "lease" in message:
        return LeaseNotFound(code, message)
    if code == GRPC_OUT_OF_RANGE and "compacted" in message:
        return RevisionCompacted(code, message)
    return DirectoryRefused(code, message)


def decode_error(status: int, body: bytes) -> DirectoryError:
    """The error an HTTP answer other than 200 stands for."""
    try:
        doc = load_json(body, "etcd error")
    except DirectoryProtocolError:
        if status == 404:
            return DirectoryProtocolError(
                f"the endpoint does not serve etcd's {API} JSON gateway (HTTP 404): is it etcd 3.4 or later?"
            )
        return DirectoryProtocolError(f"etcd answered HTTP {status} without an etcd error")
    code = doc.get("code")
    message = doc.get("message") or doc.get("error")
    if isinstance(code, bool) or not isinstance(code, int) or not isinstance(message, str):
        return DirectoryProtocolError(f"etcd answered HTTP {status} without an etcd error")
    return error_from_status(code, message)
