"""The peer link over real TLS on loopback: pinning both ways, introduction,
framing with streamed payloads, and errors mapped to our own types."""

from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio

from capsulefs.peer.identity import Identity, load_or_create_identity
from capsulefs.peer.client import open_peer
from capsulefs.peer.errors import CallFailed, PeerBroken, PeerRefused, PeerUnreachable, RemoteError
from capsulefs.peer.framing import Payload
from capsulefs.peer.server import serve_peers
from capsulefs.peer.book import Peer, PeerBook
from helpers import HANG


@dataclass
class Recorder:
    calls: list[tuple[str, str]] = field(default_factory=list)
    hang: trio.Event | None = None
    hanging: trio.Event = field(default_factory=trio.Event)

    async def __call__(self, peer: Peer, call: str, args: dict[str, Any], payload: Payload) -> tuple[dict, bytes]:
        self.calls.append((peer.name, call))
        if call == "echo":
            data = await payload.read()
            return {"args": args, "sha": hashlib.sha256(data).hexdigest(), "size": len(data)}, data
        if call == "stream":
            h = hashlib.sha256()
            async for chunk in payload.chunks():
                h.update(chunk)
            return {"sha": h.hexdigest()}, b""
        if call == "batches":
            h, sizes = hashlib.sha256(), []
            async with aclosing(payload.batches(args["size"])) as batches:
                async for batch in batches:
                    sizes.append(sum(map(len, batch)))
                    for chunk in batch:
                        h.update(chunk)
            return {"sha": h.hexdigest(), "sizes": sizes}, b""
        if call == "readinto":
            buf = bytearray(payload.size)
            view = memoryview(buf)
            at = 0
            for step in args["steps"]:
                await payload.readinto(view[at : at + step])
                at += step
            try:
                await payload.readinto(bytearray(payload.remaining + 1))
            except ValueError:
                pass  # more than the frame holds: refused, nothing read
            await payload.readinto(view[at:])
            return {"sha": hashlib.sha256(buf).hexdigest(), "left": payload.remaining}, b""
        if call == "fail":
            raise CallFailed("nope", "the handler said no")
        if call == "hang":
            assert self.hang is not None
            self.hanging.set()
            await self.hang.wait()
        return {}, b""


@dataclass
class Pair:
    a: Identity
    b: Identity
    book_a: PeerBook
    book_b: PeerBook
    port: int
    handler: Recorder

    def peer_b(self, host_id: str | None = None) -> Peer:
        return Peer(name="b", address=f"127.0.0.1:{self.port}", host_id=host_id or self.b.host_id)


@pytest.fixture
async def pair(tmp_path: Path, nursery: trio.Nursery) -> AsyncIterator[Pair]:
    a = load_or_create_identity(tmp_path / "a")
    b = load_or_create_identity(tmp_path / "b")
    book_a, book_b = PeerBook(tmp_path / "a"), PeerBook(tmp_path / "b")
    book_b.add(Peer(name="a", address="127.0.0.1:1", host_id=a.host_id))
    handler = Recorder()
    port = await nursery.start(lambda task_status: serve_peers(b, book_b, handler, host="127.0.0.1",
                                                               task_status=task_status))
    book_a.add(Peer(name="b", address=f"127.0.0.1:{port}", host_id=b.host_id))
    yield Pair(a, b, book_a, book_b, port, handler)


async def test_call_round_trip_with_payload_and_introduction(pair: Pair) -> None:
    data = os.urandom(3 << 20)
    async with open_peer(pair.a, pair.book_a.find("b")) as conn:
        result, back = await conn.call("echo", {"x": 1}, payload=data)
        assert result == {"args": {"x": 1}, "sha": hashlib.sha256(data).hexdigest(), "size": len(data)}
        assert back == data
        assert conn.bytes_sent >= len(data) and conn.bytes_received >= len(data)
    # the server learned a's certificate on the first link
    assert (pair.book_b.certs_dir / f"{pair.a.host_id}.pem").exists()
    async with open_peer(pair.a, pair.book_a.find("b")) as conn:
        await conn.call("ping")
    assert pair.handler.calls == [("a", "echo"), ("a", "ping")]


async def test_streamed_payload(pair: Pair) -> None:
    parts = [os.urandom(100_000) for _ in range(7)]

    async def gen() -> AsyncIterator[bytes]:
        for p in parts:
            yield p

    async with open_peer(pair.a, pair.peer_b()) as conn:
        result, _ = await conn.call("stream", payload=gen(), size=sum(map(len, parts)))
    assert result["sha"] == hashlib.sha256(b"".join(parts)).hexdigest()


async def test_a_payload_read_in_batches(pair: Pair) -> None:
    """Batches add up to at least the size asked (the last may be short),
    in order, and end where the frame does: the next call still works."""
    data = os.urandom(1_000_003)
    async with open_peer(pair.a, pair.peer_b()) as conn:
        result, _ = await conn.call("batches", {"size": 200_000}, payload=data)
        again, _ = await conn.call("batches", {"size": 1 << 30}, payload=b"tail")
    assert result["sha"] == hashlib.sha256(data).hexdigest()
    assert sum(result["sizes"]) == len(data)
    assert all(s >= 200_000 for s in result["sizes"][:-1]) and len(result["sizes"]) <= 5
    assert again == {"sha": hashlib.sha256(b"tail").hexdigest(), "sizes": [4]}


async def test_a_payload_read_into_buffers(pair: Pair) -> None:
    """The bulk reader's path: any cut of the payload into buffers gets its
    bytes in order; asking for more than the frame holds is refused without
    reading; the next call's frame is untouched."""
    data = os.urandom(3_000_001)
    steps = [1, 4095, 1 << 20, 17, 1_500_000]
    async with open_peer(pair.a, pair.peer_b()) as conn:
        result, _ = await conn.call("readinto", {"steps": steps}, payload=data)
        again, _ = await conn.call("readinto", {"steps": [2]}, payload=b"tail")
    assert result == {"sha": hashlib.sha256(data).hexdigest(), "left": 0}
    assert again == {"sha": hashlib.sha256(b"tail").hexdigest(), "left": 0}


async def test_a_payload_read_into_buffers_over_a_plain_stream() -> None:
    """Over a stream without receive_into (any trio stream): the same
    bytes, and what a receive brought past the frame waits for the next."""
    import trio.testing

    from capsulefs.peer.framing import Framer

    a, b = trio.testing.memory_stream_pair()
    sender, receiver = Framer(a, "test"), Framer(b, "test")
    data = os.urandom(300_001)
    await sender.send({"type": "x"}, data)
    await sender.send({"type": "y"}, b"next")
    _, payload = await receiver.receive()
    buf = bytearray(len(data))
    for lo, hi in [(0, 7), (7, 100_000), (100_000, len(data))]:
        await payload.readinto(memoryview(buf)[lo:hi])
    assert buf == data and payload.remaining == 0
    header, payload = await receiver.receive()
    assert header == {"type": "y"} and await payload.read() == b"next"


async def test_a_header_nested_too_deeply_is_a_protocol_error() -> None:
    """A peer's header is outside input: one nested past the parser's depth
    is refused as a protocol error, not raised as a RecursionError."""
    import struct

    import trio.testing

    from capsulefs.peer.errors import PeerProtocolError
    from capsulefs.peer.framing import Framer

    a, b = trio.testing.memory_stream_pair()
    head = b"[" * 100_000
    await a.send_all(struct.pack("!IQ", len(head), 0) + head)
    with pytest.raises(PeerProtocolError, match="header is not valid JSON: nested too deeply"):
        await Framer(b, "test").receive()


async def test_client_refuses_a_server_with_another_id(pair: Pair, tmp_path: Path) -> None:
    other = load_or_create_identity(tmp_path / "other")
    with pytest.raises(PeerRefused, match="not the pinned"):
        async with open_peer(pair.a, pair.peer_b(host_id=other.host_id)):
            pass
    assert pair.handler.calls == []


async def test_server_refuses_an_unknown_client(pair: Pair, tmp_path: Path) -> None:
    stranger = load_or_create_identity(tmp_path / "stranger")
    with pytest.raises(PeerRefused, match="not a configured peer"):
        async with open_peer(stranger, pair.peer_b()):
            pass
    assert pair.handler.calls == []
    assert not (pair.book_b.certs_dir / f"{stranger.host_id}.pem").exists()


async def test_a_removed_peer_is_refused_although_its_certificate_was_learned(pair: Pair) -> None:
    async with open_peer(pair.a, pair.peer_b()) as conn:
        await conn.call("ping")
    pair.book_b.remove("a")
    with pytest.raises(PeerRefused):
        async with open_peer(pair.a, pair.peer_b()) as conn:
            await conn.call("ping")
    assert pair.handler.calls == [("a", "ping")]


async def test_remote_failure_arrives_as_a_typed_error(pair: Pair) -> None:
    async with open_peer(pair.a, pair.peer_b()) as conn:
        with pytest.raises(RemoteError) as info:
            await conn.call("fail", payload=b"ignored")
        assert info.value.code == "nope"
        result, _ = await conn.call("echo", payload=b"still usable")
        assert result["size"] == 12


async def test_unreachable_peer(pair: Pair) -> None:
    s = trio.socket.socket()
    await s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    with pytest.raises(PeerUnreachable):
        async with open_peer(pair.a, Peer(name="gone", address=f"127.0.0.1:{port}", host_id=pair.b.host_id)):
            pass


async def test_link_dying_mid_call_is_broken_not_a_hang(tmp_path: Path) -> None:
    a = load_or_create_identity(tmp_path / "a")
    b = load_or_create_identity(tmp_path / "b")
    book_b = PeerBook(tmp_path / "b")
    book_b.add(Peer(name="a", address="127.0.0.1:1", host_id=a.host_id))
    handler = Recorder(hang=trio.Event())
    async with trio.open_nursery() as server:
        port = await server.start(lambda task_status: serve_peers(b, book_b, handler, host="127.0.0.1",
                                                                   task_status=task_status))
        async with open_peer(a, Peer(name="b", address=f"127.0.0.1:{port}", host_id=b.host_id)) as conn:
            async with trio.open_nursery() as n:
                async def kill_when_hanging() -> None:
                    await handler.hanging.wait()
                    server.cancel_scope.cancel()  # the whole server dies, its links with it
                n.start_soon(kill_when_hanging)
                with pytest.raises(PeerBroken):
                    await conn.call("hang")


async def test_serve_peers_reports_its_port_only_once_listening(pair: Pair) -> None:
    # connecting right after start() returned must work: started() came after bind
    with trio.fail_after(HANG):
        s = await trio.open_tcp_stream("127.0.0.1", pair.port)
        await s.aclose()


async def _anonymous_tls(port: int):
    """A TLS link to the server without a client certificate: what anyone
    who can reach the port can open."""
    from capsulefs.peer.client import client_context
    from capsulefs.peer.tls import TLSStream

    tls = TLSStream(await trio.open_tcp_stream("127.0.0.1", port), client_context(None))
    await tls.do_handshake()
    return tls


async def _closed_by_server(tls) -> bool:
    try:
        while await tls.receive_some():
            pass
    except trio.BrokenResourceError:
        pass
    return True


async def test_an_anonymous_link_that_says_nothing_is_closed(tmp_path: Path, nursery: trio.Nursery) -> None:
    # Anyone can finish a TLS handshake without a certificate. Kept open
    # forever, such links exhaust the daemon's file descriptors (and with
    # them the mount): they must say hello within the handshake timeout.
    b = load_or_create_identity(tmp_path / "b")
    port = await nursery.start(lambda task_status: serve_peers(b, PeerBook(tmp_path / "b"), Recorder(),
                                                               host="127.0.0.1", handshake_timeout=0.5,
                                                               task_status=task_status))
    tls = await _anonymous_tls(port)
    with trio.fail_after(HANG):
        assert await _closed_by_server(tls)
    await tls.aclose()


async def test_an_anonymous_link_cannot_make_the_server_buffer_a_big_header(pair: Pair) -> None:
    import struct

    from capsulefs.peer.framing import MAX_ANONYMOUS_HEADER

    tls = await _anonymous_tls(pair.port)
    await tls.send_all(struct.pack("!IQ", MAX_ANONYMOUS_HEADER + 1, 0) + b"{")
    with trio.fail_after(5):  # refused at once, not after the timeout
        assert await _closed_by_server(tls)
    await tls.aclose()


async def test_a_server_that_learned_several_peers_accepts_each(pair: Pair, tmp_path: Path) -> None:
    """Each host's certificate has a name and key identifier of its own: a
    server that trusts two peers' certificates finds each client's own
    (with one name for all, it picked the first anchor of that name and
    refused the other peer: TLSV1_ALERT_UNKNOWN_CA)."""
    c = load_or_create_identity(tmp_path / "c")
    book_c = PeerBook(tmp_path / "c")
    pair.book_b.add(Peer(name="c", address="127.0.0.1:1", host_id=c.host_id))
    book_c.add(Peer(name="b", address=f"127.0.0.1:{pair.port}", host_id=pair.b.host_id))
    for _ in range(2):  # (the second round: both certificates learned, both anchors)
        for me, book in ((pair.a, pair.book_a), (c, book_c)):
            async with open_peer(me, book.find("b")) as conn:
                await conn.call("ping")
    assert [who for who, _ in pair.handler.calls] == ["a", "c", "a", "c"]
