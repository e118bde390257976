"""Requests to etcd's JSON gateway: operations, compares, and their bodies.

Each builder returns a :class:`Request`: the path under ``/v3``, the JSON
body (keys and values in base64, 64-bit integers as strings) and whether a
copy sent again after a lost reply cannot change what the first did.
"""

from __future__ import annotations

import base64
import enum
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from capsulefs.core.fleet.errors import FleetAddressError

API = "/v3"
INT64_MAX = (1 << 63) - 1


class Target(enum.Enum):
    """What a :class:`Compare` looks at (etcd's Compare.CompareTarget)."""

    VERSION = "VERSION"
    CREATE = "CREATE"
    MOD = "MOD"
    VALUE = "VALUE"
    LEASE = "LEASE"


class Result(enum.Enum):
    """How a :class:`Compare` compares (etcd's Compare.CompareResult)."""

    EQUAL = "EQUAL"
    GREATER = "GREATER"
    LESS = "LESS"
    NOT_EQUAL = "NOT_EQUAL"


_TARGET_FIELD = {
    Target.VERSION: "version",
    Target.CREATE: "create_revision",
    Target.MOD: "mod_revision",
    Target.VALUE: "value",
    Target.LEASE: "lease",
}


def _check_key(key: bytes) -> None:
    if not isinstance(key, bytes) or not key:
        raise ValueError(f"an etcd key is non-empty bytes, not {key!r}")


def _check_int(value: int, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= INT64_MAX:
        raise ValueError(f"{what} must be an integer in 0..2^63-1, not {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Compare:
    """One condition of a Txn: ``target`` of ``key`` compared with ``value``.

    A key that does not exist has version, create and mod revision 0, so
    ``Compare.create(key, 0)`` asks "is the key absent?".
    """

    key: bytes
    target: Target
    value: int | bytes
    result: Result = Result.EQUAL

    def __post_init__(self) -> None:
        _check_key(self.key)
        if self.target is Target.VALUE:
            if not isinstance(self.value, bytes):
                raise ValueError("a VALUE compare takes bytes")
        else:
            _check_int(self.value, f"a {self.target.value} compare's value")  # type: ignore[arg-type]

    @classmethod
    def mod(cls, key: bytes, revision: int, result: Result = Result.EQUAL) -> Compare:
        return cls(key=key, target=Target.MOD, value=revision, result=result)

    @classmethod
    def version(cls, key: bytes, version: int, result: Result = Result.EQUAL) -> Compare:
        return cls(key=key, target=Target.VERSION, value=version, result=result)

    @classmethod
    def create(cls, key: bytes, revision: int, result: Result = Result.EQUAL) -> Compare:
        return cls(key=key, target=Target.CREATE, value=revision, result=result)

    @classmethod
    def value_is(cls, key: bytes, value: bytes, result: Result = Result.EQUAL) -> Compare:
        return cls(key=key, target=Target.VALUE, value=value, result=result)

    @classmethod
    def lease(cls, key: bytes, lease_id: int, result: Result = Result.EQUAL) -> Compare:
        return cls(key=key, target=Target.LEASE, value=lease_id, result=result)


@dataclass(frozen=True, slots=True, kw_only=True)
class Range:
    """Read ``key`` (or ``[key, range_end)``) at ``revision`` (0: now)."""

    key: bytes
    range_end: bytes = b""
    limit: int = 0
    revision: int = 0
    keys_only: bool = False
    count_only: bool = False

    def __post_init__(self) -> None:
        _check_key(self.key)
        _check_int(self.limit, "limit")
        _check_int(self.revision, "revision")


@dataclass(frozen=True, slots=True, kw_only=True)
class Put:
    """Write ``value`` under ``key``, attached to ``lease`` (0: none)."""

    key: bytes
    value: bytes
    lease: int = 0
    prev_kv: bool = False

    def __post_init__(self) -> None:
        _check_key(self.key)
        if not isinstance(self.value, bytes):
            raise ValueError("an etcd value is bytes")
        _check_int(self.lease, "lease")


@dataclass(frozen=True, slots=True, kw_only=True)
class Delete:
    """Delete ``key`` (or ``[key, range_end)``)."""

    key: bytes
    range_end: bytes = b""
    prev_kv: bool = False

    def __post_init__(self) -> None:
        _check_key(self.key)


Op = Range | Put | Delete


@dataclass(frozen=True, slots=True)
class Request:
    """One gateway call: POST ``body`` (JSON) to ``path``. ``idempotent``: a
    copy sent again after a lost reply cannot change what the first did."""

    path: str
    body: bytes
    idempotent: bool


def prefix_end(prefix: bytes) -> bytes:
    """The ``range_end`` that makes a range cover every key starting with
    ``prefix`` (etcd's clientv3.GetPrefixRangeEnd)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\x00"  # every key >= prefix


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _request(path: str, body: dict[str, Any], *, idempotent: bool) -> Request:
    return Request(API + path, json.dumps(body, separators=(",", ":")).encode(), idempotent)


def _encode_range(op: Range) -> dict[str, Any]:
    body: dict[str, Any] = {"key": _b64(op.key)}
    if op.range_end:
        body["range_end"] = _b64(op.range_end)
    if op.limit:
        body["limit"] = str(op.limit)
    if op.revision:
        body["revision"] = str(op.revision)
    if op.keys_only:
        body["keys_only"] = True
    if op.count_only:
        body["count_only"] = True
    return body


def _encode_put(op: Put) -> dict[str, Any]:
    body: dict[str, Any] = {"key": _b64(op.key), "value": _b64(op.value)}
    if op.lease:
        body["lease"] = str(op.lease)
    if op.prev_kv:
        body["prev_kv"] = True
    return body


def _encode_delete(op: Delete) -> dict[str, Any]:
    body: dict[str, Any] = {"key": _b64(op.key)}
    if op.range_end:
        body["range_end"] = _b64(op.range_end)
    if op.prev_kv:
        body["prev_kv"] = True
    return body


def _encode_op(op: Op) -> dict[str, Any]:
    match op:
        case Range():
            return {"request_range": _encode_range(op)}
        case Put():
            return {"request_put": _encode_put(op)}
        case Delete():
            return {"request_delete_range": _encode_delete(op)}
    raise TypeError(f"not an etcd operation: {op!r}")


def _encode_compare(c: Compare) -> dict[str, Any]:
    value = _b64(c.value) if isinstance(c.value, bytes) else str(c.value)
    return {"key": _b64(c.key), "target": c.target.value, "result": c.result.value, _TARGET_FIELD[c.target]: value}


def range_request(op: Range) -> Request:
    return _request("/kv/range", _encode_range(op), idempotent=True)


def put_request(op: Put) -> Request:
    return _request("/kv/put", _encode_put(op), idempotent=False)


def delete_request(op: Delete) -> Request:
    return _request("/kv/deleterange", _encode_delete(op), idempotent=False)


def txn_request(compare: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op]) -> Request:
    body = {
        "compare": [_encode_compare(c) for c in compare],
        "success": [_encode_op(op) for op in success],
        "failure": [_encode_op(op) for op in failure],
    }
    read_only = all(isinstance(op, Range) for op in (*success, *failure))
    return _request("/kv/txn", body, idempotent=read_only)


def compaction_request(revision: int) -> Request:
    """Forget the history before ``revision`` (sending it twice is harmless)."""
    _check_int(revision, "revision")
    return _request("/kv/compaction", {"revision": str(revision)}, idempotent=True)


def lease_grant_request(ttl: int, lease_id: int = 0) -> Request:
    _check_int(ttl, "a lease's TTL")
    _check_int(lease_id, "a lease id")
    body: dict[str, Any] = {"TTL": str(ttl)}
    if lease_id:
        body["ID"] = str(lease_id)
    return _request("/lease/grant", body, idempotent=False)


def lease_keepalive_request(lease_id: int) -> Request:
    _check_int(lease_id, "a lease id")
    return _request("/lease/keepalive", {"ID": str(lease_id)}, idempotent=True)


def lease_revoke_request(lease_id: int) -> Request:
    _check_int(lease_id, "a lease id")
    return _request("/lease/revoke", {"ID": str(lease_id)}, idempotent=False)


def lease_ttl_request(lease_id: int, *, keys: bool = False) -> Request:
    _check_int(lease_id, "a lease id")
    return _request("/lease/timetolive", {"ID": str(lease_id), "keys": keys}, idempotent=True)


def watch_request(op: Range, *, start_revision: int = 0, prev_kv: bool = False) -> Request:
    """A watch of ``op.key`` (or its range) from ``start_revision`` (0: now on)."""
    _check_int(start_revision, "start_revision")
    create: dict[str, Any] = {"key": _b64(op.key)}
    if op.range_end:
        create["range_end"] = _b64(op.range_end)
    if start_revision:
        create["start_revision"] = str(start_revision)
    if prev_kv:
        create["prev_kv"] = True
    return _request("/watch", {"create_request": create}, idempotent=True)


def parse_endpoints(spec: str) -> list[str]:
    """``etcd://HOST:PORT[,HOST:PORT...]`` -> the gateway base URLs
    (``http://HOST:PORT``). An IPv6 host is written in brackets."""
    scheme = "etcd://"
    if not spec.startswith(scheme):
        raise FleetAddressError(f"not an etcd address: {spec[:80]!r} (etcd://HOST:PORT[,HOST:PORT...])")
    out = []
    for part in spec[len(scheme):].split(","):
        host, sep, port = part.rpartition(":")
        bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        ok_host = bool(bare) and all(c.isalnum() or c in ".-:" for c in bare) and (":" not in bare or bare != host)
        if not sep or not ok_host or not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
            raise FleetAddressError(f"not HOST:PORT in the etcd address: {part[:80]!r}")
        out.append(f"http://{host}:{int(port)}")
    return out
