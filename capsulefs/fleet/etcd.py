"""An etcd v3 client over etcd's JSON gateway with httpx (trio through anyio).

Rules:
  * Errors are mapped at this boundary: no httpx or OS exception leaves it.
    A connection that could not be made is :class:`DirectoryUnreachable`
    (the request was not sent); a failure after sending is
    :class:`DirectoryReplyLost` (a write may have been applied: read again
    to learn); etcd's own error answers map as ``core.fleet.etcd`` says.
  * Several endpoints: a request goes to the one that answered last. On a
    connection failure it goes to the next; a request that may have reached
    etcd is sent again elsewhere only if it is idempotent (reads,
    keepalives), never a write, so a lost reply is never doubled into two
    writes.
  * Replies are read with a cap (``max_reply``); watch and keepalive
    streams are cut into lines of at most ``core.fleet.etcd.MAX_LINE``.

Theory of operation: the codecs in ``core.fleet.etcd`` build each request
and parse each reply; this module only posts bytes and picks endpoints.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager

import httpx

from capsulefs.core.fleet import etcd as wire
from capsulefs.core.fleet.errors import (
    DirectoryProtocolError,
    DirectoryReplyLost,
    DirectoryUnavailable,
    DirectoryUnreachable,
)
from capsulefs.core.fleet.etcd import (
    Compare,
    DeleteResult,
    KeyValue,
    Lease,
    LeaseTTL,
    Op,
    PutResult,
    RangeResult,
    TxnResult,
    WatchResponse,
)
from capsulefs.fleet._http import BodyReader, read_capped

log = logging.getLogger(__name__)

__all__ = ["EtcdClient", "WatchStream", "open_etcd"]

MAX_REPLY = 64 << 20
_JSON = {"content-type": "application/json"}
# Failures before a byte of the request could have reached etcd.
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


def _reason(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


async def _read_capped(resp: httpx.Response, limit: int, what: str) -> bytes:
    return await read_capped(resp, limit, lambda: DirectoryProtocolError(f"{what}: a reply of more than {limit} bytes"))


class EtcdClient:
    """Calls to an etcd cluster through its JSON gateway."""

    def __init__(self, endpoints: Sequence[str], http: httpx.AsyncClient, *, max_reply: int = MAX_REPLY) -> None:
        if not endpoints:
            raise ValueError("no etcd endpoint")
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.max_reply = max_reply
        self._http = http
        self._current = 0

    def _order(self) -> list[str]:
        n = len(self.endpoints)
        return [self.endpoints[(self._current + i) % n] for i in range(n)]

    async def _call(self, req: wire.Request) -> bytes:
        """POST one request; the body of etcd's 200 answer."""
        failures: list[str] = []
        sent = False
        for base in self._order():
            what = f"etcd {base}{req.path}"
            try:
                async with self._http.stream("POST", base + req.path, content=req.body, headers=_JSON) as resp:
                    body = await _read_capped(resp, self.max_reply, what)
            except _NOT_SENT as exc:
                failures.append(f"{base}: {_reason(exc)}")
                continue
            except (httpx.HTTPError, OSError) as exc:
                if not req.idempotent:
                    raise DirectoryReplyLost(f"{what}: {_reason(exc)}; the request may have been applied") from exc
                sent = True
                failures.append(f"{base}: {_reason(exc)}")
                continue
            if resp.status_code != 200:
                error = wire.decode_error(resp.status_code, body)
                if isinstance(error, DirectoryReplyLost) and req.idempotent:
                    sent = True  # this member cannot answer now (no leader, timed out): ask the next
                    failures.append(f"{base}: {error}")
                    continue
                raise error
            self._current = self.endpoints.index(base)
            return body
        cls = DirectoryReplyLost if sent else DirectoryUnreachable
        raise cls(f"no etcd endpoint answered {req.path}: {'; '.join(failures)}")

    # -- key-value -------------------------------------------------------------

    async def range(self, key: bytes, *, prefix: bool = False, range_end: bytes = b"", limit: int = 0,
                    revision: int = 0, keys_only: bool = False) -> RangeResult:
        """Keys ``key`` (with ``prefix``: every key starting with it, or the
        range up to ``range_end``) at ``revision`` (0: now)."""
        end = wire.prefix_end(key) if prefix else range_end
        op = wire.Range(key=key, range_end=end, limit=limit, revision=revision, keys_only=keys_only)
        return wire.decode_range(await self._call(wire.range_request(op)))

    async def get(self, key: bytes) -> KeyValue | None:
        result = await self.range(key)
        if len(result.kvs) > 1 or (result.kvs and result.kvs[0].key != key):
            raise DirectoryProtocolError(f"etcd range: asked for one key, got {[kv.key for kv in result.kvs]!r}"[:200])
        return result.kvs[0] if result.kvs else None

    async def put(self, key: bytes, value: bytes, *, lease: int = 0, prev_kv: bool = False) -> PutResult:
        op = wire.Put(key=key, value=value, lease=lease, prev_kv=prev_kv)
        return wire.decode_put(await self._call(wire.put_request(op)))

    async def delete(self, key: bytes, *, prefix: bool = False, prev_kv: bool = False) -> DeleteResult:
        op = wire.Delete(key=key, range_end=wire.prefix_end(key) if prefix else b"", prev_kv=prev_kv)
        return wire.decode_delete(await self._call(wire.delete_request(op)))

    async def txn(self, compare: Sequence[Compare], success: Sequence[Op] = (),
                  failure: Sequence[Op] = ()) -> TxnResult:
        """If every compare holds, apply ``success``, else ``failure``: atomically."""
        body = await self._call(wire.txn_request(compare, success, failure))
        return wire.decode_txn(body, success, failure)

    async def compact(self, revision: int) -> None:
        """Forget the key-value history before ``revision``."""
        wire.decode_compaction(await self._call(wire.compaction_request(revision)))

    # -- leases ----------------------------------------------------------------

    async def grant(self, ttl: int, lease_id: int = 0) -> Lease:
        """A new lease of ``ttl`` seconds (etcd picks the id unless given)."""
        return wire.decode_lease_grant(await self._call(wire.lease_grant_request(ttl, lease_id)))

    async def keepalive(self, lease_id: int) -> int:
        """Renew a lease; the TTL it now has. LeaseNotFound if it is gone."""
        return wire.decode_keepalive(await self._call(wire.lease_keepalive_request(lease_id)), lease_id)

    async def revoke(self, lease_id: int) -> None:
        """End a lease now, deleting the keys attached to it."""
        wire.decode_revoke(await self._call(wire.lease_revoke_request(lease_id)))

    async def time_to_live(self, lease_id: int, *, keys: bool = False) -> LeaseTTL | None:
        """A lease's remaining TTL (and its keys), or None if it is gone."""
        return wire.decode_lease_ttl(await self._call(wire.lease_ttl_request(lease_id, keys=keys)), lease_id)

    # -- watch -----------------------------------------------------------------

    @asynccontextmanager
    async def watch(self, key: bytes, *, prefix: bool = False, start_revision: int = 0,
                    prev_kv: bool = False) -> AsyncIterator[WatchStream]:
        """Changes of ``key`` (or every key under it) from ``start_revision``
        (0: from now), as a stream of :class:`WatchResponse`. The first one
        has ``created``; one with ``canceled`` ends the stream (e.g. the start
        revision was compacted: ``compact_revision``)."""
        op = wire.Range(key=key, range_end=wire.prefix_end(key) if prefix else b"")
        req = wire.watch_request(op, start_revision=start_revision, prev_kv=prev_kv)
        timeout = httpx.Timeout(self._http.timeout.connect, read=None)  # events may be far apart
        failures = []
        for base in self._order():
            async with AsyncExitStack() as stack:
                try:
                    resp = await stack.enter_async_context(
                        self._http.stream("POST", base + req.path, content=req.body, headers=_JSON, timeout=timeout))
                except _NOT_SENT as exc:
                    failures.append(f"{base}: {_reason(exc)}")
                    continue
                except (httpx.HTTPError, OSError) as exc:
                    raise DirectoryUnavailable(f"etcd {base} watch: {_reason(exc)}") from exc
                if resp.status_code != 200:
                    raise wire.decode_error(resp.status_code, await _read_capped(resp, wire.MAX_LINE, "etcd watch"))
                stream = WatchStream(resp, f"etcd {base} watch")
                stack.push_async_callback(stream.aclose)
                yield stream
                return
        raise DirectoryUnreachable(f"no etcd endpoint answered the watch: {'; '.join(failures)}")

    async def version(self) -> dict[str, str]:
        """etcd's ``/version`` answer (``etcdserver``, ``etcdcluster``)."""
        for base in self._order():
            try:
                async with self._http.stream("GET", base + "/version") as resp:
                    body = await _read_capped(resp, 4096, "etcd version")
            except _NOT_SENT:
                continue
            except (httpx.HTTPError, OSError) as exc:
                raise DirectoryUnavailable(f"etcd {base}/version: {_reason(exc)}") from exc
            if resp.status_code != 200:
                raise wire.decode_error(resp.status_code, body)
            doc = wire.load_json(body, "etcd version")
            return {k: v for k, v in doc.items() if isinstance(k, str) and isinstance(v, str)}
        raise DirectoryUnreachable(f"no etcd endpoint answered /version: {', '.join(self.endpoints)}")


class WatchStream:
    """The responses of one watch, in order (an async iterator)."""

    def __init__(self, resp: httpx.Response, what: str) -> None:
        self._body = BodyReader(resp)
        self._lines = wire.LineSplitter()
        self._pending: list[bytes] = []
        self._what = what
        self._ended = False

    def __aiter__(self) -> WatchStream:
        return self

    async def aclose(self) -> None:
        self._ended = True
        await self._body.aclose()

    async def __anext__(self) -> WatchResponse:
        if self._ended:
            raise StopAsyncIteration
        while not self._pending:
            try:
                chunk = await self._body.next()
            except (httpx.HTTPError, OSError) as exc:
                raise DirectoryUnavailable(f"{self._what}: {_reason(exc)}") from exc
            if chunk is None:
                raise DirectoryUnavailable(f"{self._what}: etcd ended the stream")
            self._pending = self._lines.feed(chunk)
        response = wire.decode_watch_line(self._pending.pop(0))
        self._ended = response.canceled
        return response


@asynccontextmanager
async def open_etcd(endpoints: str | Sequence[str], *, timeout: float = 5.0) -> AsyncIterator[EtcdClient]:
    """An :class:`EtcdClient` for ``etcd://HOST:PORT[,...]`` (or a list of
    ``http://HOST:PORT`` base URLs) with its own connection pool."""
    urls = wire.parse_endpoints(endpoints) if isinstance(endpoints, str) else list(endpoints)
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as http:
        yield EtcdClient(urls, http)
