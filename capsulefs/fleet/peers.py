"""The fleet's peers: the live host records of the directory, as a :class:`~capsulefs.peer.finder.PeerFinder`.

Rules:
  * A host is a peer while its record ``PREFIX/hosts/<host_id>`` exists:
    its keeper writes it under the host's lease and etcd deletes it when the
    lease ends, so a record read is a live lease. A record under no lease is
    not one a keeper writes and is refused.
  * Every record is hostile: :func:`peer_of` parses it strictly
    (``decode_host``) and refuses one whose key names another host, that
    publishes no certificate fingerprint, whose host id is not base32 of
    that fingerprint (so the id pinned is the certificate's digest), or
    whose address is not ``HOST:PORT`` (``-``: the host accepts no moves).
  * :meth:`DirectoryPeers.find` (a move's target) reads the directory each
    time: a full host id is one read of its key; an unambiguous prefix of at
    least ``MIN_PREFIX`` characters one read of at most two keys.
  * :meth:`DirectoryPeers.by_id` (the server's check of each link) caches a
    host found for ``cache_for`` seconds, which may not exceed the lease's
    TTL: a host whose lease ended is accepted for at most that long after.
    A host not found is not cached (one that just joined is let in at
    once). At most ``concurrency`` directory reads run at once, so links
    from unknown certificates cannot flood etcd.
  * Certificates learned from introductions are kept in memory only (at
    most ``MAX_LEARNED``; a peer introduces itself again after a restart),
    and only for a live host's id; one is dropped once the host is gone.

Theory of operation: the TLS trust anchors are only a way to let a
self-signed client certificate through OpenSSL; who may call is decided
after the handshake by ``by_id`` on the certificate's digest, and who a
client talks to by the host id pinned from the record (capsulefs/peer/).
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

import trio

from capsulefs.core.errors import CapsuleError, NotFoundError
from capsulefs.core.fleet import directory as fd
from capsulefs.core.fleet.errors import DirectoryError
from capsulefs.core.fleet.etcd import KeyValue, RangeResult
from capsulefs.core.fleet.lease import LEASE_TTL
from capsulefs.peer.book import Peer, parse_address
from capsulefs.peer.finder import PeerLookupFailed, UnknownPeer
from capsulefs.peer.identity import HOST_ID_LENGTH, cert_from_pem

log = logging.getLogger(__name__)

__all__ = ["CACHE_FOR", "DirectoryPeers", "HostReader", "MIN_PREFIX", "peer_of"]

MIN_PREFIX = 8  # characters of a host id that may name it, if no other live host's starts so
CACHE_FOR = 5.0  # seconds a host found stays accepted by the server without another read
MAX_CACHE = 4096  # hosts remembered at most (the oldest go first)
MAX_LEARNED = 4096  # learned certificates kept at most
CONCURRENCY = 4  # directory reads at once
_T = TypeVar("_T")
_ID_RE = re.compile(rf"[A-Z2-7]{{{HOST_ID_LENGTH}}}")
_PREFIX_RE = re.compile(rf"[A-Z2-7]{{{MIN_PREFIX},{HOST_ID_LENGTH}}}")


class HostReader(Protocol):
    """What the finder needs of the directory (:class:`capsulefs.fleet.etcd.EtcdClient` has it)."""

    async def get(self, key: bytes) -> KeyValue | None: ...

    async def range(self, key: bytes, *, prefix: bool = False, range_end: bytes = b"", limit: int = 0,
                    revision: int = 0, keys_only: bool = False) -> RangeResult: ...


def peer_of(layout: fd.Layout, kv: KeyValue) -> Peer:
    """The peer a host record names, or DirectoryRecordError / PeerBookError saying why it is refused."""
    entry = fd.decode_host(kv.value)
    if kv.key != layout.host(entry.host_id):
        raise fd.DirectoryRecordError(f"the record names host {entry.host_id}, its key is {kv.key[:120]!r}")
    if not kv.lease:
        raise fd.DirectoryRecordError(f"host {entry.host_id}: the record is under no lease")
    if not _ID_RE.fullmatch(entry.host_id):
        raise fd.DirectoryRecordError(f"host {entry.host_id} is not a certificate's id "
                                      f"({HOST_ID_LENGTH} base32 characters)")
    if not entry.cert_sha256:  # (HostEntry checked that a fingerprint given is the id's)
        raise fd.DirectoryRecordError(f"host {entry.host_id} publishes no certificate fingerprint")
    if entry.address == "-":
        raise fd.DirectoryRecordError(f"host {entry.host_id} accepts no moves (mounted without --listen)")
    parse_address(entry.address)
    return Peer(name=entry.host_id, address=entry.address, host_id=entry.host_id)


class DirectoryPeers:
    """The live hosts of the directory under ``layout``, seen by host ``me``."""

    def __init__(self, reader: HostReader, layout: fd.Layout, *, me: str, cache_for: float = CACHE_FOR,
                 lease_ttl: float = LEASE_TTL, concurrency: int = CONCURRENCY,
                 clock: Callable[[], float] = trio.current_time) -> None:
        if not 0 <= cache_for <= lease_ttl:
            raise ValueError(f"a host may be cached for 0 to {lease_ttl}s (the lease's TTL), not {cache_for}")
        self._reader = reader
        self._layout = layout
        self._me = me
        self._cache_for = cache_for
        self._clock = clock
        self._limit = trio.CapacityLimiter(concurrency)
        self._cache: OrderedDict[str, tuple[float, Peer]] = OrderedDict()  # host id -> (valid until, peer)
        self._learned: OrderedDict[str, bytes] = OrderedDict()  # host id -> its certificate, PEM
        self.reads = 0  # directory reads made (the cost of the checks)

    # -- a move's target --------------------------------------------------------------
    async def find(self, target: str) -> Peer:
        name = target.strip().upper()
        if not _PREFIX_RE.fullmatch(name):
            raise UnknownPeer(f"{target[:80]!r} is not a host id in the fleet ({HOST_ID_LENGTH} base32 "
                              f"characters, or at least its first {MIN_PREFIX}); see 'capsulefs fleet hosts'")
        if self._me.startswith(name):
            raise UnknownPeer(f"{target!r} is this host ({self._me})")
        if len(name) == HOST_ID_LENGTH:
            kv = await self._read(lambda: self._reader.get(self._layout.host(name)))
            kvs: tuple[KeyValue, ...] = () if kv is None else (kv,)
        else:
            found = await self._read(lambda: self._reader.range(self._layout.hosts + name.encode(), prefix=True,
                                                                limit=2))
            kvs = found.kvs
            if len(kvs) > 1 or found.more:
                ids = ", ".join(kv.key[len(self._layout.hosts):].decode("ascii", "replace") for kv in kvs)
                raise UnknownPeer(f"{target!r} names more than one host in the directory ({ids}, ...): "
                                  f"give more of the host id")
        if not kvs:
            raise UnknownPeer(f"host {name} is not in the directory: no live host there has that id "
                              f"(its lease ended, or it never joined); see 'capsulefs fleet hosts'")
        try:
            return peer_of(self._layout, kvs[0])
        except (CapsuleError, ValueError) as exc:
            raise UnknownPeer(f"the directory's record of host {name} is refused: {exc}") from None

    # -- the server's check of a link -------------------------------------------------
    async def by_id(self, host_id: str) -> Peer | None:
        if not _ID_RE.fullmatch(host_id) or host_id == self._me:
            return None
        hit = self._cache.get(host_id)
        if hit is not None and self._clock() < hit[0]:
            return hit[1]
        kv = await self._read(lambda: self._reader.get(self._layout.host(host_id)))
        peer = None
        if kv is not None:
            try:
                peer = peer_of(self._layout, kv)
            except (CapsuleError, ValueError) as exc:
                log.warning("the directory's record of host %s is refused: %s", host_id, exc)
        if peer is None:
            self._cache.pop(host_id, None)
            self._learned.pop(host_id, None)
            return None
        self._cache[host_id] = (self._clock() + self._cache_for, peer)
        self._cache.move_to_end(host_id)
        while len(self._cache) > MAX_CACHE:
            self._cache.popitem(last=False)
        return peer

    async def learn_cert(self, cert_pem: bytes) -> str:
        host_id, pem = cert_from_pem(cert_pem)
        if await self.by_id(host_id) is None:
            raise NotFoundError(f"host {host_id} is not a live host in the directory")
        self._learned[host_id] = pem
        self._learned.move_to_end(host_id)
        while len(self._learned) > MAX_LEARNED:
            self._learned.popitem(last=False)
        return host_id

    def trusted_pems(self) -> list[bytes]:
        return list(self._learned.values())

    # -- reading --------------------------------------------------------------------
    async def _read(self, call: Callable[[], Awaitable[_T]]) -> _T:
        async with self._limit:
            self.reads += 1
            try:
                return await call()
            except DirectoryError as exc:
                raise PeerLookupFailed(f"the directory cannot be read: {exc}") from exc
