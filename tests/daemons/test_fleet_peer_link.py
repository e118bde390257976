"""The peer link in the fleet mode: hosts find each other in a real etcd
(capsulefs/fleet/peers.py) and authenticate by real mutual TLS, the host id
pinned from the directory; no ``peer add`` on either side."""

from __future__ import annotations

import base64
import hashlib
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio

from capsulefs.core.fleet import directory as fd
from capsulefs.fleet.directory import register_host
from capsulefs.fleet.etcd import EtcdClient, open_etcd
from capsulefs.fleet.peers import DirectoryPeers
from capsulefs.peer.client import open_peer
from capsulefs.peer.errors import PeerRefused
from capsulefs.peer.identity import Identity, load_or_create_identity
from capsulefs.peer.server import serve_peers
from fleet_kit import EtcdServer
from helpers import HANG

from test_peer_link import Recorder


def entry(ident: Identity, address: str) -> fd.HostEntry:
    return fd.HostEntry(host_id=ident.host_id, address=address, cert_sha256=hashlib.sha256(ident.cert_der).hexdigest())


@dataclass
class Fleet:
    etcd: EtcdClient
    layout: fd.Layout
    a: Identity
    b: Identity
    b_address: str
    handler: Recorder

    def finder(self, ident: Identity) -> DirectoryPeers:
        return DirectoryPeers(self.etcd, self.layout, me=ident.host_id)

    async def join(self, ident: Identity, address: str = "127.0.0.1:1") -> int:
        """The host's record under a lease of its own, as its keeper writes it; the lease id."""
        return (await register_host(self.etcd, self.layout, entry(ident, address), 30)).id


@pytest.fixture
async def fleet(tmp_path: Path, etcd_server: EtcdServer, nursery: trio.Nursery) -> AsyncIterator[Fleet]:
    a = load_or_create_identity(tmp_path / "a")
    b = load_or_create_identity(tmp_path / "b")
    layout = fd.Layout(b"/capsulefs-find/" + secrets.token_hex(4).encode() + b"/")
    async with open_etcd(etcd_server.spec, timeout=HANG) as etcd:
        handler = Recorder()
        # B's server asks the directory (no cache, so a lease that ends is seen at the next link)
        checks = DirectoryPeers(etcd, layout, me=b.host_id, cache_for=0)
        port = await nursery.start(lambda task_status: serve_peers(b, checks, handler, host="127.0.0.1",
                                                                   task_status=task_status))
        f = Fleet(etcd, layout, a, b, f"127.0.0.1:{port}", handler)
        await f.join(b, f.b_address)
        yield f


async def test_two_live_hosts_call_each_other_without_peer_add(fleet: Fleet) -> None:
    await fleet.join(fleet.a)
    peer = await fleet.finder(fleet.a).find(fleet.b.host_id[:10])
    assert (peer.host_id, peer.address) == (fleet.b.host_id, fleet.b_address)
    async with open_peer(fleet.a, peer, timeout=HANG) as conn:  # (introduces A: B learns its certificate)
        await conn.call("ping")
    async with open_peer(fleet.a, peer, timeout=HANG) as conn:
        await conn.call("ping")
    assert fleet.handler.calls == [(fleet.a.host_id, "ping")] * 2


async def test_a_host_not_in_the_directory_is_refused(fleet: Fleet, tmp_path: Path) -> None:
    stranger = load_or_create_identity(tmp_path / "c")  # has B's address and id, but no record
    peer = await fleet.finder(fleet.a).find(fleet.b.host_id)
    with pytest.raises(PeerRefused):
        async with open_peer(stranger, peer, timeout=HANG) as conn:
            await conn.call("ping")
    assert fleet.handler.calls == []


async def test_a_host_whose_lease_ended_is_refused(fleet: Fleet) -> None:
    lease = await fleet.join(fleet.a)
    peer = await fleet.finder(fleet.a).find(fleet.b.host_id)
    async with open_peer(fleet.a, peer, timeout=HANG) as conn:
        await conn.call("ping")
    await fleet.etcd.revoke(lease)  # (as its expiry: etcd deletes the record)
    with pytest.raises(PeerRefused, match="is not a peer of this host"):
        async with open_peer(fleet.a, peer, timeout=HANG) as conn:
            await conn.call("ping")
    assert fleet.handler.calls == [(fleet.a.host_id, "ping")]


async def test_a_record_that_pins_another_certificate_is_refused_by_the_client(fleet: Fleet) -> None:
    """A record at B's address whose host id (and fingerprint) is not B's
    certificate: the client connects, B presents its own certificate, and
    the client refuses it before any call."""
    await fleet.join(fleet.a)
    digest = hashlib.sha256(b"not B's certificate").digest()
    fake = base64.b32encode(digest).decode().rstrip("=")
    lease = await fleet.etcd.grant(30)
    record = fd.HostEntry(host_id=fake, address=fleet.b_address, cert_sha256=digest.hex())
    await fleet.etcd.put(fleet.layout.host(fake), record.encode(), lease=lease.id)
    peer = await fleet.finder(fleet.a).find(fake)
    with pytest.raises(PeerRefused, match=f"presented host id {fleet.b.host_id}, not the pinned {fake}"):
        async with open_peer(fleet.a, peer, timeout=HANG) as conn:
            await conn.call("ping")
    assert fleet.handler.calls == []
