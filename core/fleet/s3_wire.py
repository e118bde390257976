"""The S3 API's addresses and replies, sans-IO.

Rules:
  * A blob tier is named by a URL, ``http[s]://HOST[:PORT]/BUCKET[/PREFIX]``,
    path-style (the bucket is the first path segment, which every
    S3-compatible store serves). Credentials never appear in it: a URL with
    a user or password is refused, as are a query and a fragment.
  * Keys are UTF-8 without control characters, at most 1024 bytes, with no
    empty, ``.`` or ``..`` segment (a proxy could rewrite those). On the wire
    each segment is URI-encoded once (:func:`object_path`), as SigV4 signs it.
  * Replies are hostile. XML is parsed only without a DTD (a document that
    declares one is refused before parsing, so no entity can expand), every
    field used is checked, and an error answer maps by HTTP status and S3
    error code to one :mod:`.errors` type (:func:`error_for`).
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from datetime import datetime
from urllib.parse import urlsplit

from capsulefs.core.fleet.errors import (
    BlobTierError,
    BlobTierProtocolError,
    BlobTierRefused,
    BlobTierUnavailable,
    BucketNotFound,
    ConditionalConflict,
    FleetAddressError,
    ObjectNotFound,
    PreconditionFailed,
)
from capsulefs.core.fleet.sigv4 import uri_encode

MAX_KEY_BYTES = 1024
MAX_ETAG = 256
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_HOST = re.compile(r"[A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\]")
_DEFAULT_PORT = {"http": 80, "https": 443}


@dataclass(frozen=True, slots=True)
class TierURL:
    scheme: str  # http or https
    host: str  # a name, an IPv4 address, or [IPv6]
    port: int
    bucket: str
    prefix: str  # "" or ending in "/"

    @property
    def endpoint(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    @property
    def host_header(self) -> str:
        return self.host if _DEFAULT_PORT[self.scheme] == self.port else f"{self.host}:{self.port}"

    def __str__(self) -> str:
        return f"{self.endpoint}/{self.bucket}/{self.prefix}"


def parse_tier_url(url: str) -> TierURL:
    """The blob tier a person named; :class:`FleetAddressError` says what is wrong."""
    shown = url[:120]
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise FleetAddressError(f"not a blob tier URL: {shown!r} ({exc})") from None
    if parts.scheme not in _DEFAULT_PORT:
        raise FleetAddressError(f"a blob tier URL is http://HOST[:PORT]/BUCKET[/PREFIX] (or https), not {shown!r}")
    if parts.username is not None or parts.password is not None:
        raise FleetAddressError("a blob tier URL carries no credentials (they come from the keychain or environment)")
    if parts.query or parts.fragment or "?" in url or "#" in url:
        raise FleetAddressError(f"a blob tier URL has no query or fragment: {shown!r}")
    host = parts.netloc.rsplit("@", 1)[-1]
    host = host[: host.rindex(":")] if port is not None else host
    if not _HOST.fullmatch(host):
        raise FleetAddressError(f"not a host name in the blob tier URL: {host[:80]!r}")
    bucket, _, prefix = parts.path.lstrip("/").partition("/")
    if not _BUCKET.fullmatch(bucket) or ".." in bucket:
        raise FleetAddressError(
            f"not an S3 bucket name: {bucket[:80]!r} (3-63 of a-z, 0-9, '.', '-'; the URL's first path segment)"
        )
    if prefix:
        prefix = prefix.rstrip("/") + "/"
        check_key(prefix + "x")
    return TierURL(parts.scheme, host, port or _DEFAULT_PORT[parts.scheme], bucket, prefix)


def check_key(key: str) -> None:
    """Refuse a key the tier could misread (see the rules)."""
    data = key.encode("utf-8", "surrogatepass")
    if not key or len(data) > MAX_KEY_BYTES:
        raise FleetAddressError(f"an object key is 1 to {MAX_KEY_BYTES} bytes: {key[:80]!r}")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in key) or any(0xD800 <= ord(c) <= 0xDFFF for c in key):
        raise FleetAddressError(f"an object key has no control characters: {key[:80]!r}")
    if any(seg in ("", ".", "..") for seg in key.split("/")):
        raise FleetAddressError(f"an object key has no empty, '.' or '..' segment: {key[:80]!r}")


def object_path(bucket: str, key: str | None) -> str:
    """The request path of ``key`` in ``bucket`` (of the bucket if None)."""
    if key is None:
        return f"/{bucket}"
    check_key(key)
    return f"/{bucket}/{uri_encode(key, keep_slash=True)}"


def check_etag(value: str | None, what: str) -> str:
    """An ETag header as sent (quotes kept: If-Match wants it back as is)."""
    if not value or len(value) > MAX_ETAG or not value.isascii() or not value.isprintable():
        raise BlobTierProtocolError(f"{what}: no usable ETag in the answer")
    return value


# -- XML -----------------------------------------------------------------------


def _xml(body: bytes, what: str) -> ET.Element:
    lowered = body.lower()
    if b"<!doctype" in lowered or b"<!entity" in lowered:
        raise BlobTierProtocolError(f"{what}: an XML answer with a DTD is refused")
    try:
        return ET.fromstring(body)
    except (ET.ParseError, ValueError, LookupError, RecursionError) as exc:  # (LookupError: an unknown encoding= in the declaration)
        raise BlobTierProtocolError(f"{what}: not XML ({str(exc)[:80]})") from None


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def _children(elem: ET.Element, name: str) -> list[ET.Element]:
    return [c for c in elem if _local(c.tag) == name]


def _text(elem: ET.Element, name: str, what: str, *, required: bool = True) -> str | None:
    found = _children(elem, name)
    if len(found) > 1:
        raise BlobTierProtocolError(f"{what}: {name} appears {len(found)} times")
    if not found:
        if required:
            raise BlobTierProtocolError(f"{what}: no {name}")
        return None
    if len(found[0]):
        raise BlobTierProtocolError(f"{what}: {name} is not text")
    return found[0].text or ""


def error_code(body: bytes) -> tuple[str, str]:
    """(S3 error Code, Message) of an error answer; ("", "") if it has none
    that parses (a HEAD has no body; a proxy may send HTML)."""
    try:
        root = _xml(body, "S3 error")
        if _local(root.tag) != "Error":
            return "", ""
        code = _text(root, "Code", "S3 error", required=False) or ""
        message = _text(root, "Message", "S3 error", required=False) or ""
    except BlobTierProtocolError:
        return "", ""
    clean = "".join(c if c.isprintable() else "?" for c in message)[:200]
    return (code if code.isascii() and code.isalnum() and len(code) <= 64 else ""), clean


def error_for(status: int, body: bytes, what: str) -> BlobTierError:
    """Our error for an answer with HTTP ``status`` other than 2xx."""
    code, message = error_code(body)
    text = f"{what}: {message or 'refused'}"
    if status == 412:
        return PreconditionFailed(status, code, f"{what}: precondition failed")
    if status == 409 and code == "ConditionalRequestConflict":
        return ConditionalConflict(status, code, f"{what}: a concurrent conditional write is in progress")
    if status == 404 and code == "NoSuchBucket":
        return BucketNotFound(status, code, f"{what}: no such bucket")
    if status == 404:
        return ObjectNotFound(status, code, f"{what}: no such object")
    if status >= 500:
        return BlobTierUnavailable(f"{text} (HTTP {status}{', ' + code if code else ''})")
    return BlobTierRefused(status, code, text)


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str
    size: int
    etag: str
    modified: float | None = None  # LastModified, Unix seconds (a listing's; None where not given)


@dataclass(frozen=True, slots=True)
class ListPage:
    objects: tuple[ObjectInfo, ...]
    next_token: str | None  # None: this was the last page


def _timestamp(text: str, what: str) -> float:
    """An S3 LastModified (ISO 8601 in UTC, ``2026-12-07T16:38:15.000Z``) as Unix seconds."""
    text = text.strip()
    if not (text.isascii() and 20 <= len(text) <= 35 and text.endswith("Z")):
        raise BlobTierProtocolError(f"{what}: LastModified {text[:40]!r} is not an ISO 8601 UTC time")
    try:
        when = datetime.fromisoformat(text[:-1] + "+00:00")
    except ValueError:
        raise BlobTierProtocolError(f"{what}: LastModified {text[:40]!r} is not an ISO 8601 UTC time") from None
    return when.timestamp()


def parse_list_v2(body: bytes, prefix: str) -> ListPage:
    """A ListObjectsV2 answer (``ListBucketResult``) for keys under ``prefix``."""
    what = "S3 list"
    root = _xml(body, what)
    if _local(root.tag) != "ListBucketResult":
        raise BlobTierProtocolError(f"{what}: not a ListBucketResult")
    truncated = (_text(root, "IsTruncated", what, required=False) or "false").strip()
    if truncated not in ("true", "false"):
        raise BlobTierProtocolError(f"{what}: IsTruncated is {truncated[:20]!r}")
    token = _text(root, "NextContinuationToken", what, required=False)
    if truncated == "true" and not token:
        raise BlobTierProtocolError(f"{what}: truncated without a continuation token")
    objects = []
    for item in _children(root, "Contents"):
        key = _text(item, "Key", what) or ""
        size_text = (_text(item, "Size", what) or "").strip()
        if not (size_text.isascii() and size_text.isdigit() and len(size_text) <= 19):
            raise BlobTierProtocolError(f"{what}: Size is not a byte count: {size_text[:20]!r}")
        if not key.startswith(prefix):
            raise BlobTierProtocolError(f"{what}: key {key[:80]!r} is not under the prefix asked for")
        try:
            check_key(key)
        except FleetAddressError as exc:
            raise BlobTierProtocolError(f"{what}: {exc}") from None
        etag = _text(item, "ETag", what, required=False) or ""
        modified = _text(item, "LastModified", what, required=False)
        objects.append(ObjectInfo(key, int(size_text), etag[:MAX_ETAG],
                                  None if modified is None else _timestamp(modified, what)))
    return ListPage(tuple(objects), token if truncated == "true" else None)
