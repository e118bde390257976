"""The directory as the fleet's peer finder (capsulefs/fleet/peers.py): a
move's target by host id or prefix, the server's check of a link with its
cache, hostile host records refused. The seam is the finder's HostReader
(here a dict of etcd's KeyValues; tests/daemons/test_fleet_peer_link.py runs
it against a real etcd and real TLS)."""

from __future__ import annotations

import base64
import hashlib
import json

import pytest

from capsulefs.core.errors import CapsuleError
from capsulefs.core.fleet import directory as fd
from capsulefs.core.fleet.errors import DirectoryUnreachable
from capsulefs.core.fleet.etcd import KeyValue, RangeResult
from capsulefs.fleet.peers import DirectoryPeers, peer_of
from capsulefs.peer.finder import PeerLookupFailed, UnknownPeer
from capsulefs.peer.identity import load_or_create_identity

L = fd.Layout(b"/t/")


def host_id_of(seed: str) -> tuple[str, str]:
    """A host id and its certificate fingerprint (as a daemon's: base32 of the sha256)."""
    digest = hashlib.sha256(seed.encode()).digest()
    return base64.b32encode(digest).decode().rstrip("="), digest.hex()


ME, ME_SHA = host_id_of("me")
B, B_SHA = host_id_of("b")
C, C_SHA = host_id_of("c")


class Directory:
    """The HostReader seam: keys and values as etcd's range returns them."""

    def __init__(self) -> None:
        self.kvs: dict[bytes, KeyValue] = {}
        self.down = False
        self.reads = 0

    def put(self, key: bytes, value: bytes, lease: int = 7) -> None:
        self.kvs[key] = KeyValue(key=key, value=value, create_revision=1, mod_revision=1, version=1, lease=lease)

    def host(self, host_id: str, sha: str, address: str = "10.0.0.2:7714", lease: int = 7) -> None:
        self.put(L.host(host_id), fd.HostEntry(host_id=host_id, address=address, cert_sha256=sha).encode(), lease)

    async def get(self, key: bytes) -> KeyValue | None:
        self._read()
        return self.kvs.get(key)

    async def range(self, key: bytes, *, prefix: bool = False, range_end: bytes = b"", limit: int = 0,
                    revision: int = 0, keys_only: bool = False) -> RangeResult:
        self._read()
        assert prefix
        kvs = sorted((kv for k, kv in self.kvs.items() if k.startswith(key)), key=lambda kv: kv.key)
        shown = kvs[:limit] if limit else kvs
        return RangeResult(revision=1, kvs=tuple(shown), count=len(kvs), more=len(shown) < len(kvs))

    def _read(self) -> None:
        self.reads += 1
        if self.down:
            raise DirectoryUnreachable("no etcd endpoint answered")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def finder(d: Directory, clock: Clock | None = None, cache_for: float = 5.0) -> DirectoryPeers:
    return DirectoryPeers(d, L, me=ME, cache_for=cache_for, clock=clock or Clock())


async def test_a_target_by_its_host_id_is_the_live_record_pinned() -> None:
    d = Directory()
    d.host(B, B_SHA, "10.0.0.2:7714")
    peer = await finder(d).find(B)
    assert (peer.host_id, peer.address) == (B, "10.0.0.2:7714")
    assert (await finder(d).find(B.lower() + "\n")).host_id == B  # as `echo` writes it, in either case


async def test_a_target_by_an_unambiguous_prefix() -> None:
    d = Directory()
    d.host(B, B_SHA)
    d.host(C, C_SHA)
    assert (await finder(d).find(B[:8])).host_id == B
    with pytest.raises(UnknownPeer, match="at least its first 8"):
        await finder(d).find(B[:7])
    twin = B[:8] + ("A" if B[8] != "A" else "B") * 44  # (the ambiguity is in the keys, before any record is read)
    d.put(L.host(twin), b"{}")
    with pytest.raises(UnknownPeer, match=f"names more than one host in the directory .*{twin}"):
        await finder(d).find(B[:8])
    assert (await finder(d).find(B[:9])).host_id == B


async def test_a_host_not_in_the_directory_is_no_target() -> None:
    d = Directory()
    with pytest.raises(UnknownPeer, match=f"host {B} is not in the directory"):
        await finder(d).find(B)
    with pytest.raises(UnknownPeer, match="not in the directory"):
        await finder(d).find(B[:10])
    with pytest.raises(UnknownPeer, match="is not a host id"):
        await finder(d).find("laptop")
    with pytest.raises(UnknownPeer, match="is this host"):
        await finder(d).find(ME)


async def test_each_find_reads_the_directory_afresh() -> None:
    d = Directory()
    d.host(B, B_SHA)
    f = finder(d)
    await f.find(B)
    del d.kvs[L.host(B)]  # its lease ended: etcd deleted the key
    with pytest.raises(UnknownPeer, match="not in the directory"):
        await f.find(B)


def _raw(host_id: str, address: str, sha: str | None) -> bytes:
    body = {"format": fd.HOST_FORMAT, "host_id": host_id, "address": address}
    if sha is not None:
        body["cert_sha256"] = sha
    return json.dumps(body).encode()


HOSTILE = [
    ("another host's key", L.host(B), _raw(C, "10.0.0.2:7714", C_SHA), 7, "its key is"),
    ("an id that is not its certificate's", L.host(B), _raw(B, "10.0.0.2:7714", C_SHA), 7, "not the certificate"),
    ("no certificate", L.host(B), _raw(B, "10.0.0.2:7714", None), 7, "no certificate fingerprint"),
    ("no lease", L.host(B), _raw(B, "10.0.0.2:7714", B_SHA), 0, "under no lease"),
    ("accepts no moves", L.host(B), _raw(B, "-", B_SHA), 7, "accepts no moves"),
    ("a bad address", L.host(B), _raw(B, "10.0.0.2:99999", B_SHA), 7, "out of range"),
    ("not a host record", L.host(B), b'{"format":"fleet-agent/1"}', 7, "format"),
    ("not JSON", L.host(B), b"\xff" * 40, 7, ""),
]


@pytest.mark.parametrize(("what", "key", "value", "lease", "why"), HOSTILE, ids=[h[0] for h in HOSTILE])
async def test_a_hostile_record_is_refused_both_ways(what: str, key: bytes, value: bytes, lease: int,
                                                     why: str) -> None:
    d = Directory()
    d.put(key, value, lease)
    with pytest.raises(UnknownPeer, match=f"record of host {B} is refused: .*{why}"):
        await finder(d).find(B)
    assert await finder(d).by_id(B) is None
    with pytest.raises(CapsuleError):
        peer_of(L, d.kvs[key])


async def test_an_unreadable_directory_is_a_lookup_failure_not_an_unknown_host() -> None:
    d = Directory()
    d.host(B, B_SHA)
    d.down = True
    with pytest.raises(PeerLookupFailed, match="cannot be read"):
        await finder(d).find(B)
    with pytest.raises(PeerLookupFailed):
        await finder(d).by_id(B)


async def test_the_servers_check_is_cached_no_longer_than_asked() -> None:
    d, clock = Directory(), Clock()
    d.host(B, B_SHA)
    f = finder(d, clock, cache_for=5.0)
    assert (await f.by_id(B)) is not None and d.reads == 1
    clock.now += 4
    assert (await f.by_id(B)) is not None and d.reads == 1  # cached
    del d.kvs[L.host(B)]  # its lease ended
    assert (await f.by_id(B)) is not None  # (still cached: at most cache_for after)
    clock.now += 1
    assert await f.by_id(B) is None and d.reads == 2  # expired: read again, gone
    assert await f.by_id(B) is None and d.reads == 3  # a miss is not cached...
    d.host(B, B_SHA)
    assert await f.by_id(B) is not None and d.reads == 4  # ...so a host that (re)joins is let in at once


async def test_the_cache_is_bounded_by_the_lease() -> None:
    with pytest.raises(ValueError, match="lease's TTL"):
        DirectoryPeers(Directory(), L, me=ME, cache_for=11.0, lease_ttl=10)


async def test_ids_that_are_no_certificate_or_this_host_are_never_read() -> None:
    d = Directory()
    f = finder(d)
    assert await f.by_id("laptop") is None and await f.by_id(ME) is None and await f.by_id(B[:51]) is None
    assert d.reads == 0


async def test_a_certificate_is_learned_only_for_a_live_host(tmp_path) -> None:  # type: ignore[no-untyped-def]
    ident = load_or_create_identity(tmp_path / "b")
    d, clock = Directory(), Clock()
    f = finder(d, clock)
    with pytest.raises(CapsuleError, match="not a live host"):
        await f.learn_cert(ident.cert_pem)
    with pytest.raises(CapsuleError, match="not a PEM certificate"):
        await f.learn_cert(b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    assert f.trusted_pems() == []
    d.host(ident.host_id, hashlib.sha256(ident.cert_der).hexdigest())
    assert await f.learn_cert(ident.cert_pem) == ident.host_id
    assert f.trusted_pems() == [ident.cert_pem]
    del d.kvs[L.host(ident.host_id)]
    clock.now += 10
    assert await f.by_id(ident.host_id) is None
    assert f.trusted_pems() == []  # forgotten with the host
