"""The etcd client against a real etcd (Debian's etcd-server, 3.4) on loopback.

Each test works under a key prefix of its own, so the module shares one
etcd. Transport failures are made with tiny TCP servers in the test (the
seam the client maps errors at); everything else is the real engine.
"""

from __future__ import annotations

import secrets
from functools import partial
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import trio

from capsulefs.core.fleet.errors import (
    DirectoryProtocolError,
    DirectoryRefused,
    DirectoryReplyLost,
    DirectoryUnreachable,
    LeaseNotFound,
    RevisionCompacted,
)
from capsulefs.core.fleet.etcd import Compare, Delete, EventType, Put, Range, Result
from capsulefs.fleet.etcd import EtcdClient, open_etcd
from fleet_kit import EtcdServer, free_ports
from helpers import HANG

DEADLINE = HANG  # seconds: bounds a hang, never paces a test


@pytest.fixture
def prefix() -> bytes:
    return b"/capsulefs-test/" + secrets.token_hex(4).encode() + b"/"


@pytest.fixture
async def etcd(etcd_server: EtcdServer) -> AsyncIterator[EtcdClient]:
    async with open_etcd(etcd_server.spec) as client:
        yield client


async def test_version_is_the_one_checked(etcd: EtcdClient) -> None:
    version = await etcd.version()
    assert version["etcdserver"].startswith("3."), version
    assert tuple(int(x) for x in version["etcdserver"].split(".")[:2]) >= (3, 4)


async def test_put_get_range_delete_with_binary_keys(etcd: EtcdClient, prefix: bytes) -> None:
    key = prefix + b"\xff\x00agent"
    assert await etcd.get(key) is None
    first = await etcd.put(key, b"\x00\x01value")
    kv = await etcd.get(key)
    assert kv is not None
    assert (kv.key, kv.value, kv.version) == (key, b"\x00\x01value", 1)
    assert kv.mod_revision == kv.create_revision == first.revision
    second = await etcd.put(key, b"v2", prev_kv=True)
    assert second.prev_kv is not None and second.prev_kv.value == b"\x00\x01value"
    assert second.revision > first.revision
    await etcd.put(prefix + b"other", b"x")
    listed = await etcd.range(prefix, prefix=True)
    assert [k.key for k in listed.kvs] == sorted([key, prefix + b"other"]) and listed.count == 2
    keys = await etcd.range(prefix, prefix=True, keys_only=True, limit=1)
    assert len(keys.kvs) == 1 and keys.kvs[0].value == b"" and keys.more and keys.count == 2
    old = await etcd.range(key, revision=first.revision)
    assert old.kvs[0].value == b"\x00\x01value"
    gone = await etcd.delete(prefix, prefix=True, prev_kv=True)
    assert gone.deleted == 2 and {k.key for k in gone.prev_kvs} == {key, prefix + b"other"}
    assert await etcd.get(key) is None


async def test_txn_compare_and_swap_on_mod_revision(etcd: EtcdClient, prefix: bytes) -> None:
    """The directory's point of no return is one Txn comparing mod_revision:
    the first writer wins, a stale revision loses and sees the current value."""
    key = prefix + b"holder"
    create = await etcd.txn([Compare.create(key, 0)], [Put(key=key, value=b"host-a:1")], [Range(key=key)])
    assert create.succeeded
    again = await etcd.txn([Compare.create(key, 0)], [Put(key=key, value=b"host-b:1")], [Range(key=key)])
    assert not again.succeeded and again.responses[0].kvs[0].value == b"host-a:1"  # type: ignore[union-attr]
    current = await etcd.get(key)
    assert current is not None
    won = await etcd.txn([Compare.mod(key, current.mod_revision)], [Put(key=key, value=b"host-b:2")])
    assert won.succeeded and won.revision > current.mod_revision
    stale = await etcd.txn([Compare.mod(key, current.mod_revision)], [Put(key=key, value=b"host-c:2")],
                           [Range(key=key)])
    assert not stale.succeeded and stale.responses[0].kvs[0].value == b"host-b:2"  # type: ignore[union-attr]
    assert (await etcd.txn([Compare.version(key, 2)], [Range(key=key)])).succeeded
    assert (await etcd.txn([Compare.version(key, 2, Result.GREATER)])).succeeded is False
    assert (await etcd.txn([Compare.value_is(key, b"host-b:2")])).succeeded
    assert (await etcd.txn([Compare.value_is(key, b"host-b:2", Result.NOT_EQUAL)])).succeeded is False
    both = await etcd.txn([Compare.mod(key, won.revision)],
                          [Delete(key=key, prev_kv=True), Put(key=prefix + b"log", value=b"moved")])
    assert both.succeeded and both.responses[0].deleted == 1  # type: ignore[union-attr]
    assert await etcd.get(key) is None and await etcd.get(prefix + b"log") is not None


async def test_racing_txns_have_exactly_one_winner(etcd: EtcdClient, prefix: bytes) -> None:
    key = prefix + b"race"
    wins: list[int] = []

    async def contend(i: int) -> None:
        result = await etcd.txn([Compare.create(key, 0)], [Put(key=key, value=b"%d" % i)])
        if result.succeeded:
            wins.append(i)

    with trio.fail_after(DEADLINE):
        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(contend, i)
    assert len(wins) == 1
    kv = await etcd.get(key)
    assert kv is not None and kv.value == b"%d" % wins[0]


async def test_lease_grant_keepalive_ttl_revoke(etcd: EtcdClient, prefix: bytes) -> None:
    lease = await etcd.grant(30)
    assert lease.ttl == 30
    await etcd.put(prefix + b"host", b"alive", lease=lease.id)
    ttl = await etcd.time_to_live(lease.id, keys=True)
    assert ttl is not None and ttl.granted_ttl == 30 and 0 < ttl.ttl <= 30 and ttl.keys == (prefix + b"host",)
    assert await etcd.keepalive(lease.id) == 30
    assert (await etcd.get(prefix + b"host")).lease == lease.id  # type: ignore[union-attr]
    await etcd.revoke(lease.id)
    assert await etcd.get(prefix + b"host") is None
    assert await etcd.time_to_live(lease.id) is None
    with pytest.raises(LeaseNotFound):
        await etcd.keepalive(lease.id)
    with pytest.raises(LeaseNotFound):
        await etcd.revoke(lease.id)
    with pytest.raises(LeaseNotFound):
        await etcd.put(prefix + b"host", b"late", lease=lease.id)


async def test_an_expired_lease_deletes_its_keys_and_a_watch_sees_it(etcd: EtcdClient, prefix: bytes) -> None:
    """Host liveness: a key under a lease nobody renews goes away by itself;
    the watch is how others learn it (no polling, no sleeping)."""
    lease = await etcd.grant(2)
    key = prefix + b"hosts/a"
    put = await etcd.put(key, b"10.0.0.1:7714", lease=lease.id)
    with trio.fail_after(DEADLINE):
        async with etcd.watch(prefix + b"hosts/", prefix=True, start_revision=put.revision, prev_kv=True) as stream:
            created = await stream.__anext__()
            assert created.created
            seen = []
            async for response in stream:
                seen += response.events
                if any(e.type is EventType.DELETE for e in seen):
                    break
    assert [e.type for e in seen] == [EventType.PUT, EventType.DELETE]
    assert seen[1].kv.key == key and seen[1].prev_kv is not None and seen[1].prev_kv.value == b"10.0.0.1:7714"
    assert await etcd.time_to_live(lease.id) is None


async def test_watch_of_a_compacted_revision_is_canceled(etcd: EtcdClient, prefix: bytes) -> None:
    first = await etcd.put(prefix + b"w", b"1")
    second = await etcd.put(prefix + b"w", b"2")
    await etcd.compact(second.revision)
    with pytest.raises(RevisionCompacted):
        await etcd.range(prefix + b"w", revision=first.revision)
    with trio.fail_after(DEADLINE):
        async with etcd.watch(prefix + b"w", start_revision=first.revision) as stream:
            responses = [r async for r in stream]
    assert responses[-1].canceled and responses[-1].compact_revision >= second.revision


async def test_etcd_refusals_are_our_errors(etcd: EtcdClient, prefix: bytes) -> None:
    with pytest.raises(DirectoryRefused, match="duplicate key"):
        await etcd.txn([], [Put(key=prefix + b"d", value=b"1"), Put(key=prefix + b"d", value=b"2")])


# -- transport failures, at the seam the client maps them -----------------------


async def _serve(nursery: trio.Nursery, handler: Callable[[trio.SocketStream], Awaitable[None]]) -> str:
    listeners = await nursery.start(partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
    return "http://127.0.0.1:%d" % listeners[0].socket.getsockname()[1]


async def _read_request(stream: trio.SocketStream) -> None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = await stream.receive_some(65536)
        if not chunk:
            return
        data += chunk


async def _cut(stream: trio.SocketStream) -> None:
    """Read the request, then close the connection without an answer."""
    await _read_request(stream)
    await stream.aclose()


def _answer(status: str, body: bytes) -> Callable[[trio.SocketStream], Awaitable[None]]:
    async def handler(stream: trio.SocketStream) -> None:
        await _read_request(stream)
        head = f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        await stream.send_all(head + body)
        await stream.aclose()
    return handler


async def test_nothing_listening_is_unreachable() -> None:
    dead = free_ports(1)[0]
    async with open_etcd(f"etcd://127.0.0.1:{dead}") as client:
        with pytest.raises(DirectoryUnreachable, match=str(dead)):
            await client.put(b"k", b"v")


async def test_a_dead_endpoint_is_skipped(etcd_server: EtcdServer, prefix: bytes) -> None:
    dead = free_ports(1)[0]
    async with open_etcd([f"http://127.0.0.1:{dead}", etcd_server.url]) as client:
        await client.put(prefix + b"k", b"v")
        assert (await client.get(prefix + b"k")).value == b"v"  # type: ignore[union-attr]


async def test_a_cut_write_is_reply_lost_and_never_sent_again(etcd_server: EtcdServer, prefix: bytes) -> None:
    """A write whose connection broke after sending may have applied: the
    client says so and does not repeat it on the next endpoint; a read
    goes on to the next endpoint."""
    async with trio.open_nursery() as nursery:
        cut = await _serve(nursery, _cut)
        async with open_etcd([cut, etcd_server.url]) as client:
            with pytest.raises(DirectoryReplyLost, match="may have been applied"):
                await client.put(prefix + b"k", b"v")
            async with open_etcd([etcd_server.url]) as direct:
                assert await direct.get(prefix + b"k") is None  # not sent to the live endpoint
            assert await client.get(prefix + b"k") is None  # a read moves on
        nursery.cancel_scope.cancel()


async def test_a_member_without_a_leader_is_skipped_for_reads_only(etcd_server: EtcdServer, prefix: bytes) -> None:
    no_leader = _answer("503 Service Unavailable", b'{"error":"etcdserver: no leader","code":14}')
    async with trio.open_nursery() as nursery:
        sick = await _serve(nursery, no_leader)
        async with open_etcd([sick, etcd_server.url]) as client:
            assert await client.get(prefix + b"k") is None  # answered by the second member
        async with open_etcd([sick, etcd_server.url]) as client:
            with pytest.raises(DirectoryReplyLost, match="no leader"):
                await client.put(prefix + b"k", b"v")
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(("status", "body", "error", "match"), [
    ("200 OK", b"<html>not json</html>", DirectoryProtocolError, "not JSON"),
    ("200 OK", b'{"header":{"revision":"-3"}}', DirectoryProtocolError, "out of range"),
    ("200 OK", b'{"header":{"revision":"2"},"kvs":[{"key":"!!"}],"count":"1"}', DirectoryProtocolError, "base64"),
    ("404 Not Found", b"404 page not found", DirectoryProtocolError, "3.4 or later"),
    ("503 Service Unavailable", b'{"error":"etcdserver: request timed out","code":14}', DirectoryReplyLost,
     "timed out"),
    ("400 Bad Request", b'{"message":"etcdserver: too many operations in txn request","code":3}',
     DirectoryRefused, "too many"),
])
async def test_hostile_answers_are_our_errors(status: str, body: bytes, error: type[Exception], match: str) -> None:
    async with trio.open_nursery() as nursery:
        url = await _serve(nursery, _answer(status, body))
        async with open_etcd([url]) as client:
            with pytest.raises(error, match=match):
                await client.range(b"k")
        nursery.cancel_scope.cancel()


async def test_a_reply_over_the_cap_is_refused(etcd_server: EtcdServer, prefix: bytes) -> None:
    async with open_etcd([etcd_server.url]) as client:
        await client.put(prefix + b"big", b"x" * 10_000)
        client.max_reply = 4096
        with pytest.raises(DirectoryProtocolError, match="more than 4096"):
            await client.get(prefix + b"big")
