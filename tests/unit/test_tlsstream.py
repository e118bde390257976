"""TLSStream, the peer link's TLS layer: trio's stream conformance suite,
and what the peer link relies on beyond it."""

from __future__ import annotations

import os
import ssl
from collections.abc import Iterator

import pytest
import trio
import trio.testing
import trustme

from capsulefs.peer.tls import TLSStream
from helpers import HANG


@pytest.fixture(scope="module")
def contexts() -> Iterator[tuple[ssl.SSLContext, ssl.SSLContext]]:
    ca = trustme.CA()
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.minimum_version = ssl.TLSVersion.TLSv1_3
    ca.issue_cert("peer.test").configure_cert(server)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.minimum_version = ssl.TLSVersion.TLSv1_3
    ca.configure_trust(client)
    yield client, server


def _pair(contexts: tuple[ssl.SSLContext, ssl.SSLContext], *, lockstep: bool = False) -> tuple[TLSStream, TLSStream]:
    client_ctx, server_ctx = contexts
    make = trio.testing.lockstep_stream_pair if lockstep else trio.testing.memory_stream_pair
    a, b = make()
    return (TLSStream(a, client_ctx, server_hostname="peer.test"),
            TLSStream(b, server_ctx, server_side=True))


async def test_passes_trios_two_way_stream_conformance_suite(contexts: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    async def stream_maker() -> tuple[TLSStream, TLSStream]:
        return _pair(contexts)

    async def clogged_stream_maker() -> tuple[TLSStream, TLSStream]:
        return await _handshaken(contexts, lockstep=True)  # handshake first: a clogged stream cannot

    await trio.testing.check_two_way_stream(stream_maker, clogged_stream_maker)


async def _handshaken(contexts: tuple[ssl.SSLContext, ssl.SSLContext], *,
                      lockstep: bool = False) -> tuple[TLSStream, TLSStream]:
    client, server = _pair(contexts, lockstep=lockstep)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.do_handshake)
        nursery.start_soon(server.do_handshake)
    return client, server


async def test_one_receive_decrypts_every_record_that_has_arrived(contexts: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    """The reason this class exists: a bulk receiver steps once per batch
    of records, not once per 16 KiB record as with trio's SSLStream."""
    client, server = await _handshaken(contexts)
    data = bytes(range(256)) * 4096  # 1 MiB: 64 TLS records
    await client.send_all(data)
    got = await server.receive_some(len(data))
    assert len(got) > 16 * 1024, len(got)
    while len(got) < len(data):
        got += await server.receive_some(len(data) - len(got))
    assert got == data


async def test_receive_into_decrypts_straight_into_the_callers_buffer(contexts: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    """The bulk reader's path (a move's pieces): records land in the
    caller's buffer, many per call, exactly up to its length; the bytes
    after it stay for the next receive, and end of file reads as 0."""
    client, server = await _handshaken(contexts)
    data = os.urandom(1 << 20)
    await client.send_all(data + b"after")
    buf = bytearray(len(data))
    view = memoryview(buf)
    got = await server.receive_into(view)
    assert got > 16 * 1024, got
    while got < len(data):
        n = await server.receive_into(view[got:])
        assert n > 0
        got += n
    assert buf == data
    assert await server.receive_some(100) == b"after"
    await client.aclose()
    assert await server.receive_into(bytearray(10)) == 0
    with pytest.raises(ValueError):
        await server.receive_into(bytearray())


async def test_close_notify_reads_as_end_of_file_every_time(contexts: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    client, server = await _handshaken(contexts)
    await client.send_all(b"last words")
    await client.aclose()
    with trio.fail_after(HANG):  # an end of file must not turn into a busy loop
        assert await server.receive_some(100) == b"last words"
        assert await server.receive_some(100) == b""
        assert await server.receive_some(100) == b""


async def test_a_transport_that_ends_without_close_notify_is_a_broken_link(contexts: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    """A truncation attack looks exactly like this, so it is never a clean end."""
    client, server = await _handshaken(contexts)
    await client.send_all(b"partial")
    await client.transport_stream.aclose()  # no close_notify
    assert await server.receive_some(100) == b"partial"
    with trio.fail_after(HANG), pytest.raises(trio.BrokenResourceError) as info:
        await server.receive_some(100)
    assert isinstance(info.value.__cause__, ssl.SSLError)
    with pytest.raises(trio.BrokenResourceError):
        await server.receive_some(100)  # and it stays broken


class _Tamper(trio.abc.Stream):
    """A transport that flips one bit of the bytes it receives, once armed."""

    def __init__(self, inner: trio.abc.Stream) -> None:
        self.inner = inner
        self.armed = False

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        data = bytearray(await self.inner.receive_some(max_bytes))
        if self.armed and len(data) > 100:
            data[len(data) // 2] ^= 0x01
            self.armed = False
        return data

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_a_tampered_record_breaks_the_stream(contexts: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    client_ctx, server_ctx = contexts
    a, b = trio.testing.memory_stream_pair()
    wire = _Tamper(b)
    client = TLSStream(a, client_ctx, server_hostname="peer.test")
    server = TLSStream(wire, server_ctx, server_side=True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.do_handshake)
        nursery.start_soon(server.do_handshake)
    wire.armed = True
    await client.send_all(b"x" * 5000)
    with trio.fail_after(HANG), pytest.raises(trio.BrokenResourceError) as info:
        await server.receive_some(10000)
    assert isinstance(info.value.__cause__, ssl.SSLError)


async def test_a_server_that_closes_before_sending_anything_ends_cleanly(contexts: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    """A TLS 1.3 server holds back what its handshake wrote (session
    tickets) until it sends; its close_notify must go after those bytes, or
    the client cannot decrypt it."""
    client, server = await _handshaken(contexts)
    await server.aclose()
    with trio.fail_after(HANG):
        assert await client.receive_some(100) == b""


async def test_a_stream_closed_under_a_running_send_stays_closed(contexts: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    client, server = await _handshaken(contexts, lockstep=True)  # nothing moves unless the other end reads

    async def send_forever() -> None:
        with pytest.raises(trio.ClosedResourceError):
            await client.send_all(b"x" * 100_000)  # the server never reads: blocks

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send_forever)
        await trio.testing.wait_all_tasks_blocked()
        await client.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await client.send_all(b"more")
    await server.aclose()


async def test_closing_while_a_task_waits_to_send_wakes_it_as_closed(contexts: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    client, server = await _handshaken(contexts, lockstep=True)

    async def wait_to_send() -> None:
        with pytest.raises(trio.ClosedResourceError):
            await client.wait_send_all_might_not_block()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait_to_send)
        await trio.testing.wait_all_tasks_blocked()
        with trio.fail_after(HANG):
            await client.aclose()  # neither raises Busy nor waits on the blocked waiter
    await server.aclose()
