"""An S3 client over httpx with our own SigV4 signing, and the blob tier on it.

Rules:
  * Errors are mapped at this boundary: httpx and OS errors become
    :class:`BlobTierUnavailable`, error answers the types of
    ``core.fleet.errors`` (:func:`core.fleet.s3_wire.error_for`); a blob
    whose bytes do not hash to its name is a :class:`CorruptBlobError`.
  * Every body read is capped: an object by the caller's limit, an error
    answer at 64 KiB, a list page at 16 MiB. Bodies are asked for without
    content encoding.
  * Conditional writes: ``put(if_none_match=True)`` sends ``If-None-Match: *``,
    ``put(if_match=etag)`` sends ``If-Match``. 412 is
    :class:`PreconditionFailed`; 409 ConditionalRequestConflict (AWS's answer
    to a write racing another conditional write) is
    :class:`ConditionalConflict`, which :class:`BlobTier` retries.
  * Credentials are parameters (the caller takes them from the host keychain
    or the environment, never from a capsule). Requests are signed with
    SigV4, the payload's sha256 included.

The blob tier stores a blob under ``PREFIX + "blobs/" + sha256``. A put sends
the digest as ``x-amz-content-sha256``, so a store that checks payloads (AWS
does; SeaweedFS 4.48 does not) refuses bytes that do not match their name;
every read is hashed again and refused if it does not match, whatever the
store checked.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from datetime import datetime, timezone

import httpx
import trio

from capsulefs.core.errors import CorruptBlobError
from capsulefs.core.fleet.errors import (
    BlobTierError,
    BlobTierProtocolError,
    BlobTierRefused,
    BlobTierUnavailable,
    ConditionalConflict,
    ObjectNotFound,
    PreconditionFailed,
)
from capsulefs.core.fleet.s3_wire import (
    ObjectInfo,
    TierURL,
    check_etag,
    error_for,
    object_path,
    parse_list_v2,
)
from capsulefs.fleet._http import BodyReader, read_capped
from capsulefs.core.fleet.sigv4 import EMPTY_SHA256, Credentials, amz_date, authorization, canonical_query

log = logging.getLogger(__name__)

__all__ = ["BlobTier", "S3Client", "open_s3"]

MAX_ERROR_BODY = 64 << 10
MAX_LIST_BODY = 16 << 20
CONFLICT_RETRIES = 6
_HEX = frozenset("0123456789abcdef")


def _utcnow() -> datetime:
    return datetime.now(timezone.utc)


@contextmanager
def _map_errors(what: str) -> Iterator[None]:
    try:
        yield
    except httpx.ConnectError as exc:
        raise BlobTierUnavailable(f"{what}: cannot connect: {exc or type(exc).__name__}") from exc
    except httpx.TimeoutException as exc:
        raise BlobTierUnavailable(f"{what}: timed out ({type(exc).__name__})") from exc
    except httpx.HTTPError as exc:
        raise BlobTierUnavailable(f"{what}: {type(exc).__name__}: {exc}") from exc
    except OSError as exc:
        raise BlobTierUnavailable(f"{what}: {exc.strerror or exc}") from exc


async def _read_capped(resp: httpx.Response, limit: int, what: str) -> bytes:
    declared = resp.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BlobTierProtocolError(f"{what}: the answer is {declared} bytes, more than the {limit} allowed")
    return await read_capped(
        resp, limit, lambda: BlobTierProtocolError(f"{what}: the answer is more than the {limit} bytes allowed"))


class S3Client:
    """Path-style S3 requests to one bucket of one endpoint."""

    def __init__(self, tier: TierURL, credentials: Credentials, http: httpx.AsyncClient, *,
                 region: str = "us-east-1", clock: Callable[[], datetime] = _utcnow) -> None:
        self.tier = tier
        self.credentials = credentials
        self.region = region
        self._http = http
        self._clock = clock

    def sign(self, method: str, key: str | None, query: Sequence[tuple[str, str]],
             headers: Sequence[tuple[str, str]], payload_hash: str) -> tuple[httpx.URL, list[tuple[str, str]]]:
        """The URL and the signed headers of a request (of the bucket if
        ``key`` is None) made now with these ``headers``."""
        path = object_path(self.tier.bucket, key)
        signed = [("host", self.tier.host_header), ("x-amz-date", amz_date(self._clock())),
                  ("x-amz-content-sha256", payload_hash), *headers]
        if self.credentials.session_token:
            signed.append(("x-amz-security-token", self.credentials.session_token))
        auth = authorization(method=method, path=path, query=query, headers=signed, payload_hash=payload_hash,
                             credentials=self.credentials, region=self.region, service="s3")
        qs = canonical_query(query)
        raw = (path + ("?" + qs if qs else "")).encode("ascii")
        return httpx.URL(self.tier.endpoint).copy_with(raw_path=raw), [*signed, ("authorization", auth)]

    @asynccontextmanager
    async def _open(self, method: str, key: str | None, what: str, *,
                    query: Sequence[tuple[str, str]] = (), headers: Sequence[tuple[str, str]] = (),
                    content: bytes | AsyncIterable[bytes] = b"", payload_hash: str = EMPTY_SHA256,
                    ok: Sequence[int] = (200,)) -> AsyncIterator[httpx.Response]:
        """A streamed answer with a status in ``ok``; any other is raised as
        its error. Transport errors inside the block are mapped too."""
        url, all_headers = self.sign(method, key, query, headers, payload_hash)
        with _map_errors(what):
            request = self._http.build_request(method, url, headers=all_headers, content=content)
            resp = await self._http.send(request, stream=True)
            try:
                if resp.status_code not in ok:
                    body = b"" if method == "HEAD" else await _read_capped(resp, MAX_ERROR_BODY, what)
                    raise error_for(resp.status_code, body, what)
                yield resp
            finally:
                await resp.aclose()

    def _what(self, verb: str, key: str | None) -> str:
        return f"{verb} {self.tier.endpoint}/{self.tier.bucket}" + (f"/{key}" if key is not None else "")

    async def create_bucket(self) -> bool:
        """Make the bucket; False if this account had it already."""
        try:
            async with self._open("PUT", None, self._what("create bucket", None)):
                return True
        except BlobTierRefused as exc:
            if exc.status == 409 and exc.code == "BucketAlreadyOwnedByYou":
                return False
            raise

    async def put(self, key: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None) -> str:
        """Store ``data`` under ``key``; the new object's ETag."""
        return await self._put(key, data, len(data), hashlib.sha256(data).hexdigest(), if_none_match, if_match)

    async def put_stream(self, key: str, chunks: AsyncIterable[bytes], *, size: int, sha256: str,
                         if_none_match: bool = False, if_match: str | None = None) -> str:
        """Store ``size`` bytes whose sha256 is ``sha256`` from ``chunks``
        (closed when done, if they can be)."""
        what = self._what("put", key)
        return await self._put(key, _Exactly(chunks, size, what), size, sha256, if_none_match, if_match)

    async def _put(self, key: str, content: bytes | AsyncIterable[bytes], size: int, sha256: str,
                   if_none_match: bool, if_match: str | None) -> str:
        if if_none_match and if_match is not None:
            raise ValueError("If-None-Match and If-Match together")
        headers = [("content-length", str(size))]
        if if_none_match:
            headers.append(("if-none-match", "*"))
        if if_match is not None:
            headers.append(("if-match", if_match))
        what = self._what("put", key)
        try:
            async with self._open("PUT", key, what, headers=headers, content=content, payload_hash=sha256) as resp:
                return check_etag(resp.headers.get("etag"), what)
        finally:
            if isinstance(content, _Exactly):
                await content.aclose()

    async def get(self, key: str, *, limit: int) -> bytes:
        """The object's bytes (at most ``limit``)."""
        what = self._what("get", key)
        async with self._open("GET", key, what) as resp:
            return await _read_capped(resp, limit, what)

    async def get_into(self, key: str, sink: Callable[[bytes], Awaitable[None]], *, limit: int) -> ObjectInfo:
        """Stream the object into ``sink``, at most ``limit`` bytes."""
        what = self._what("get", key)
        size = 0
        async with self._open("GET", key, what) as resp:
            etag = check_etag(resp.headers.get("etag"), what)
            body = BodyReader(resp)
            try:
                while (chunk := await body.next()) is not None:
                    size += len(chunk)
                    if size > limit:
                        raise BlobTierProtocolError(f"{what}: the object is more than the {limit} bytes allowed")
                    await sink(chunk)
            finally:
                await body.aclose()
        return ObjectInfo(key, size, etag)

    async def head(self, key: str) -> ObjectInfo | None:
        """The object's size and ETag, or None if there is none."""
        what = self._what("head", key)
        try:
            async with self._open("HEAD", key, what) as resp:
                length = resp.headers.get("content-length", "")
                if not (length.isascii() and length.isdigit() and len(length) <= 19):
                    raise BlobTierProtocolError(f"{what}: no usable Content-Length")
                return ObjectInfo(key, int(length), check_etag(resp.headers.get("etag"), what))
        except ObjectNotFound:
            return None

    async def delete(self, key: str) -> None:
        """Remove the object (no error if it is not there)."""
        async with self._open("DELETE", key, self._what("delete", key), ok=(200, 204)):
            pass

    async def list(self, prefix: str, *, page_size: int = 1000) -> AsyncIterator[ObjectInfo]:
        """Every object whose key starts with ``prefix``, page by page."""
        what = self._what("list", None)
        token: str | None = None
        seen: set[str] = set()
        while True:
            query = [("list-type", "2"), ("max-keys", str(page_size)), ("prefix", prefix)]
            if token is not None:
                query.append(("continuation-token", token))
            async with self._open("GET", None, what, query=query) as resp:
                page = parse_list_v2(await _read_capped(resp, MAX_LIST_BODY, what), prefix)
            for obj in page.objects:
                yield obj
            if page.next_token is None:
                return
            if page.next_token in seen:
                raise BlobTierProtocolError(f"{what}: the tier repeats a continuation token")
            seen.add(page.next_token)
            token = page.next_token


class _Exactly:
    """A request body of exactly ``size`` bytes from ``chunks``: more or
    fewer is a BlobTierError. A class, not an async generator, so an upload
    httpx abandons midway leaves nothing for trio to warn about."""

    def __init__(self, chunks: AsyncIterable[bytes], size: int, what: str) -> None:
        self._source = chunks.__aiter__()
        self._size = size
        self._sent = 0
        self._what = what

    def __aiter__(self) -> _Exactly:
        return self

    async def __anext__(self) -> bytes:
        try:
            chunk = await self._source.__anext__()
        except StopAsyncIteration:
            if self._sent != self._size:
                raise BlobTierError(
                    f"{self._what}: the body is {self._sent} bytes, not its declared {self._size}") from None
            raise
        self._sent += len(chunk)
        if self._sent > self._size:
            raise BlobTierError(f"{self._what}: the body is longer than its declared {self._size} bytes")
        return chunk

    async def aclose(self) -> None:
        close = getattr(self._source, "aclose", None)
        if close is not None:
            await close()


def _check_digest(digest: str) -> None:
    if len(digest) != 64 or not set(digest) <= _HEX:
        raise ValueError(f"not a sha256 hex digest: {digest[:80]!r}")


class BlobTier:
    """Blobs named by their sha256 in one S3 bucket, under a prefix."""

    def __init__(self, s3: S3Client) -> None:
        self.s3 = s3

    def key(self, digest: str) -> str:
        _check_digest(digest)
        return f"{self.s3.tier.prefix}blobs/{digest}"

    async def put(self, digest: str, data: bytes) -> bool:
        """Store a blob once: True if this call stored it, False if the tier
        had it already (an earlier call, or another host)."""
        if hashlib.sha256(data).hexdigest() != digest:
            raise ValueError(f"the bytes given for blob {digest} do not hash to it")
        return await self._put(digest, lambda: data, len(data))

    async def put_stream(self, digest: str, chunks: Callable[[], AsyncIterable[bytes]], *, size: int) -> bool:
        """Store a blob from a stream; ``chunks`` makes the stream afresh for
        each attempt (a retry after a 409, a repair of a torn copy)."""
        return await self._put(digest, chunks, size)

    async def _put(self, digest: str, body: Callable[[], bytes | AsyncIterable[bytes]], size: int) -> bool:
        """If-None-Match; on 412, the tier's copy is kept if its size is right,
        else replaced with If-Match on its ETag (a torn upload: SeaweedFS
        stores an empty object for a put cut before its body)."""
        key = self.key(digest)
        for attempt in range(CONFLICT_RETRIES):
            try:
                await self._write(key, body(), size, digest, None)
                return True
            except PreconditionFailed:
                pass
            except ConditionalConflict:
                log.debug("blob %s: conditional write conflict, retrying", digest)
                await trio.sleep(0.01 * 2**attempt)
                continue
            there = await self.s3.head(key)
            if there is None:
                continue  # removed since: create it again
            if there.size == size:
                return False
            log.warning("blob tier %s: %s is %d bytes, not %d: replacing the torn copy", self.s3.tier, key,
                        there.size, size)
            try:
                await self._write(key, body(), size, digest, there.etag)
                return True
            except (PreconditionFailed, ConditionalConflict):
                continue  # replaced by another writer since: look again
        raise BlobTierUnavailable(f"blob {digest}: no conditional write settled in {CONFLICT_RETRIES} attempts")

    async def _write(self, key: str, content: bytes | AsyncIterable[bytes], size: int, digest: str,
                     if_match: str | None) -> None:
        if isinstance(content, bytes):
            await self.s3.put(key, content, if_none_match=if_match is None, if_match=if_match)
        else:
            await self.s3.put_stream(key, content, size=size, sha256=digest, if_none_match=if_match is None,
                                     if_match=if_match)

    async def fetch(self, digest: str, sink: Callable[[bytes], Awaitable[None]], *, limit: int) -> int:
        """Stream a blob into ``sink`` and verify it; its size. ``sink`` sees
        the bytes before they are verified: treat what it wrote as
        unverified until this returns (it raises CorruptBlobError if the
        bytes do not hash to ``digest``)."""
        key = self.key(digest)
        h = hashlib.sha256()

        async def hashing(chunk: bytes) -> None:
            h.update(chunk)
            await sink(chunk)

        info = await self.s3.get_into(key, hashing, limit=limit)
        actual = h.hexdigest()
        if actual != digest:
            raise CorruptBlobError(f"{self.s3.tier}blobs/{digest}", actual,
                                   why="the tier's copy does not match its name")
        return info.size

    async def get(self, digest: str, *, limit: int) -> bytes:
        """A blob's bytes, verified."""
        parts: list[bytes] = []

        async def keep(chunk: bytes) -> None:
            parts.append(chunk)

        await self.fetch(digest, keep, limit=limit)
        return b"".join(parts)

    async def has(self, digest: str) -> bool:
        return await self.s3.head(self.key(digest)) is not None

    async def digests(self) -> AsyncIterator[str]:
        """The name of every blob the tier holds under this prefix."""
        start = f"{self.s3.tier.prefix}blobs/"
        async for obj in self.s3.list(start):
            name = obj.key[len(start):]
            if len(name) == 64 and set(name) <= _HEX:
                yield name
            else:
                log.warning("blob tier %s: ignoring %r, not named by a sha256", self.s3.tier, obj.key)


@asynccontextmanager
async def open_s3(tier: TierURL, credentials: Credentials, *, region: str = "us-east-1",
                  timeout: float = 30.0, connections: int = 16) -> AsyncIterator[S3Client]:
    """An :class:`S3Client` with its own connection pool, closed on exit."""
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False,
                                 headers={"accept-encoding": "identity"}) as http:
        yield S3Client(tier, credentials, http, region=region)
