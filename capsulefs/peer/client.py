"""The client end of the peer link: connect, authenticate, make calls.

Rules:
  * The client accepts any certificate at the TLS layer and then compares
    the digest of the server's certificate with the pinned host id before
    it sends a call; a mismatch is :class:`~capsulefs.peer.errors.PeerRefused`.
  * A client whose certificate the server has not learned yet first makes a
    connection without a client certificate and makes the single call
    ``introduce``, carrying its (public) certificate; the server keeps it
    only if its digest is a configured peer's id. Then it reconnects.
  * One call at a time per connection; a failed call leaves the connection
    for the caller to drop.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import AsyncIterable, AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import trio

from capsulefs.peer.book import Peer, parse_address
from capsulefs.peer.errors import PeerBroken, PeerProtocolError, PeerRefused, PeerUnreachable, RemoteError, map_errors
from capsulefs.peer.framing import PROTOCOL, Framer
from capsulefs.peer.identity import Identity, host_id_from_der
from capsulefs.peer.tls import TLSStream

log = logging.getLogger(__name__)

__all__ = ["PeerConnection", "StreamWrapper", "client_context", "open_peer"]


def client_context(identity: Identity | None) -> ssl.SSLContext:
    """Accept any server certificate (we pin its digest ourselves); present ours."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    if identity is not None:
        ctx.load_cert_chain(identity.pem_path)
    return ctx


class PeerConnection:
    """One authenticated link to a peer; one call at a time."""

    def __init__(self, framer: Framer, peer: Peer, tls: TLSStream) -> None:
        self._framer = framer
        self._tls = tls
        self.peer = peer
        self._ids = 0
        self._lock = trio.Lock()

    @property
    def bytes_sent(self) -> int:
        return self._framer.sent_bytes

    @property
    def bytes_received(self) -> int:
        return self._framer.received_bytes

    async def call(self, name: str, args: dict[str, Any] | None = None, *,
                   payload: bytes | AsyncIterable[bytes | bytearray | memoryview] = b"", size: int | None = None) -> tuple[dict[str, Any], bytes]:
        """Make call ``name``; return the reply's result and payload."""
        if self._lock.locked():
            raise trio.BusyResourceError(f"another call to {self.peer.name} is in progress")
        async with self._lock:
            self._ids += 1
            cid = self._ids
            await self._framer.send({"type": "call", "id": cid, "call": name, "args": args or {}}, payload, size)
            header, body = await self._framer.receive()
            data = await body.read()
            if header.get("id") != cid:
                raise PeerProtocolError(f"reply to call {header.get('id')!r} while waiting for {cid}")
            if header["type"] == "error":
                raise RemoteError(str(header.get("code", "failed")), str(header.get("message", "")))
            if header["type"] != "reply":
                raise PeerProtocolError(f"expected a reply, got {header['type']!r}")
            result = header.get("result", {})
            if not isinstance(result, dict):
                raise PeerProtocolError("a reply's result must be an object")
            return result, data

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            try:
                await self._tls.aclose()
            except (trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError, OSError):
                pass


StreamWrapper = Callable[[trio.abc.Stream], trio.abc.Stream]


async def _connect(identity: Identity | None, peer: Peer, timeout: float,
                   wrap: StreamWrapper | None = None) -> tuple[TLSStream, Framer]:
    host, port = parse_address(peer.address)
    what = f"peer {peer.name} ({peer.address})"
    with trio.move_on_after(timeout) as scope:
        try:
            tcp = await trio.open_tcp_stream(host, port)
        except OSError as exc:
            raise PeerUnreachable(f"{what}: cannot connect: {exc.strerror or exc}") from exc
        tls = TLSStream(wrap(tcp) if wrap else tcp, client_context(identity), server_hostname=None)
        try:
            with map_errors(what):
                await tls.do_handshake()
        except BaseException:
            await trio.aclose_forcefully(tls)
            raise
    if scope.cancelled_caught:
        raise PeerUnreachable(f"{what}: no TLS handshake within {timeout:.0f}s")
    der = tls.peer_certificate()
    got = host_id_from_der(der) if der else None
    if got != peer.host_id:
        await trio.aclose_forcefully(tls)
        raise PeerRefused(f"{what} presented host id {got}, not the pinned {peer.host_id}")
    return tls, Framer(tls, what)


async def _hello(framer: Framer) -> dict[str, Any]:
    await framer.send({"type": "hello", "protocol": PROTOCOL})
    header, body = await framer.receive()
    await body.drain()
    if header["type"] == "error":
        raise PeerRefused(f"{framer.what} refused us: {header.get('message', header.get('code'))}")
    if header["type"] != "hello" or header.get("protocol") != PROTOCOL:
        raise PeerProtocolError(f"{framer.what} speaks {header.get('protocol')!r}, not {PROTOCOL!r}")
    return header


async def _introduce(identity: Identity, peer: Peer, timeout: float) -> None:
    tls, framer = await _connect(None, peer, timeout)
    try:
        with trio.fail_after(timeout):
            await _hello(framer)
            conn = PeerConnection(framer, peer, tls)
            await conn.call("introduce", {"cert_pem": identity.cert_pem.decode("ascii")})
    except trio.TooSlowError:
        raise PeerBroken(f"{framer.what}: introduce got no answer within {timeout:.0f}s") from None
    except RemoteError as exc:
        raise PeerRefused(f"{framer.what} refused our certificate: {exc.message}") from exc
    finally:
        await trio.aclose_forcefully(tls)


@asynccontextmanager
async def open_peer(identity: Identity, peer: Peer, *, timeout: float = 30.0,
                    wrap: StreamWrapper | None = None) -> AsyncIterator[PeerConnection]:
    """Connect to ``peer``, authenticate both ways, yield the connection.

    ``wrap`` may wrap the TCP stream under TLS (e.g. to count bytes on the wire).

    Raises PeerUnreachable, PeerRefused, PeerBroken or PeerProtocolError.
    """
    for attempt in (1, 2):
        tls, framer = await _connect(identity, peer, timeout, wrap)
        try:
            with trio.fail_after(timeout):
                await _hello(framer)
        except (PeerBroken, trio.TooSlowError) as exc:
            await trio.aclose_forcefully(tls)
            if attempt == 2:
                raise PeerRefused(f"{framer.what} did not accept our certificate: {exc}") from exc
            # TLS 1.3: a server that does not know our certificate yet fails
            # the link right after the handshake. Introduce ourselves once.
            log.info("introducing this host to %s", framer.what)
            await _introduce(identity, peer, timeout)
            continue
        except BaseException:
            await trio.aclose_forcefully(tls)
            raise
        conn = PeerConnection(framer, peer, tls)
        try:
            yield conn
        finally:
            await conn.aclose()
        return
