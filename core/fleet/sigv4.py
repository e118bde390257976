"""AWS Signature Version 4 (header form), with hashlib and hmac only.

Rules:
  * The caller gives the request as it will be sent: the path already
    URI-encoded exactly as on the wire (S3 encodes each key segment once,
    :func:`uri_encode` with ``keep_slash``), the query as (name, value)
    pairs, every header to sign (``host`` and ``x-amz-date`` among them) and
    the payload's sha256 in hex. The time is a parameter; nothing here reads
    a clock.
  * A header's canonical value is trimmed and its runs of spaces squeezed;
    repeated names join with commas in the order given; names sort in lower
    case. Query names and values are encoded (RFC 3986 unreserved kept,
    everything else %XX upper case) and sorted.
  * :class:`Credentials` never shows its secret in a repr.

Checked against AWS's published vectors (tests/unit/test_fleet_sigv4.py): the
SigV4 test suite's get-vanilla cases and the S3 API reference's examples.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone

ALGORITHM = "AWS4-HMAC-SHA256"
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"
_UNRESERVED = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.~")


@dataclass(frozen=True, slots=True)
class Credentials:
    access_key: str
    secret_key: str = field(repr=False)
    session_token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not _printable(self.access_key) or "/" in self.access_key:
            raise ValueError("an S3 access key is printable ASCII without spaces or '/'")
        if not _printable(self.secret_key):
            raise ValueError("an S3 secret key is printable ASCII without spaces")


def _printable(text: str) -> bool:
    return bool(text) and text.isascii() and text.isprintable() and " " not in text


def uri_encode(text: str, *, keep_slash: bool) -> str:
    """RFC 3986 percent-encoding as SigV4 wants it (UTF-8, upper-case hex)."""
    out = []
    for byte in text.encode("utf-8"):
        if byte in _UNRESERVED or (keep_slash and byte == 0x2F):
            out.append(chr(byte))
        else:
            out.append(f"%{byte:02X}")
    return "".join(out)


def amz_date(when: datetime) -> str:
    """``YYYYMMDDTHHMMSSZ`` in UTC, as x-amz-date takes it."""
    if when.tzinfo is None:
        raise ValueError("a signing time must be timezone-aware")
    return when.astimezone(timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def canonical_query(query: Sequence[tuple[str, str]]) -> str:
    pairs = sorted((uri_encode(k, keep_slash=False), uri_encode(v, keep_slash=False)) for k, v in query)
    return "&".join(f"{k}={v}" for k, v in pairs)


def canonical_headers(headers: Sequence[tuple[str, str]]) -> tuple[str, str]:
    """(canonical header block, signed header names)."""
    merged: dict[str, list[str]] = {}
    for name, value in headers:
        merged.setdefault(name.strip().lower(), []).append(" ".join(value.split()))
    names = sorted(merged)
    block = "".join(f"{n}:{','.join(merged[n])}\n" for n in names)
    return block, ";".join(names)


def canonical_request(
    method: str, path: str, query: Sequence[tuple[str, str]], headers: Sequence[tuple[str, str]], payload_hash: str
) -> tuple[str, str]:
    """(the canonical request, the signed header names)."""
    block, signed = canonical_headers(headers)
    return "\n".join([method.upper(), path, canonical_query(query), block, signed, payload_hash]), signed


def signing_key(secret_key: str, date: str, region: str, service: str) -> bytes:
    key = ("AWS4" + secret_key).encode()
    for part in (date, region, service, "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    return key


def authorization(
    *,
    method: str,
    path: str,
    query: Sequence[tuple[str, str]],
    headers: Sequence[tuple[str, str]],
    payload_hash: str,
    credentials: Credentials,
    region: str,
    service: str,
) -> str:
    """The Authorization header's value for a request whose ``headers``
    (all signed) include ``host`` and ``x-amz-date``."""
    stamp = next((v.strip() for n, v in headers if n.lower() == "x-amz-date"), None)
    if stamp is None or len(stamp) != 16:
        raise ValueError("a request to sign needs an x-amz-date header (YYYYMMDDTHHMMSSZ)")
    if not any(n.lower() == "host" for n, _ in headers):
        raise ValueError("a request to sign needs a host header")
    creq, signed = canonical_request(method, path, query, headers, payload_hash)
    scope = f"{stamp[:8]}/{region}/{service}/aws4_request"
    to_sign = "\n".join([ALGORITHM, stamp, scope, hashlib.sha256(creq.encode()).hexdigest()])
    key = signing_key(credentials.secret_key, stamp[:8], region, service)
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    return f"{ALGORITHM} Credential={credentials.access_key}/{scope}, SignedHeaders={signed}, Signature={signature}"
