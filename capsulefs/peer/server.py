"""The server end of the peer link: authenticate each link, answer its calls.

Rules:
  * The server asks for a client certificate and trusts, as anchors, only
    the certificates of peers it has learned; after the handshake it asks
    its :class:`~capsulefs.peer.finder.PeerFinder` whether the digest is a
    peer's id, so a removed peer (a host gone from the directory) is
    refused. An unknown or mismatched peer is refused before any call. A
    link without a certificate may only ``introduce`` its host (kept if its
    digest is a peer's id: a pinned peer, or a live host in the directory).
  * Anyone who reaches the port can finish a TLS handshake without a
    certificate, so until the peer is known the server gives a link little:
    its hello (and an introduction) must arrive within the handshake
    timeout, in frames of at most ``MAX_ANONYMOUS_HEADER`` bytes.
  * A handler's CallFailed, CapsuleError or OSError is answered as an error
    frame and the link stays up; a link error ends the link.
  * ``serve_peers`` calls ``task_status.started(port)`` only once it listens.
    Each connection is served in a task of the server's nursery.
"""

from __future__ import annotations

import logging
import ssl
from dataclasses import dataclass
from typing import Any, Protocol

import trio

from capsulefs.core.errors import CapsuleError
from capsulefs.peer.book import Peer, PeerBook
from capsulefs.peer.finder import BookPeers, PeerFinder, PeerLookupFailed
from capsulefs.peer.errors import CallFailed, PeerError, PeerProtocolError, map_errors
from capsulefs.peer.framing import PROTOCOL, Framer, Payload
from capsulefs.peer.identity import Identity, host_id_from_der
from capsulefs.peer.tls import TLSStream

log = logging.getLogger(__name__)

__all__ = ["HANDSHAKE_TIMEOUT", "PeerHandler", "serve_peers", "server_context"]

HANDSHAKE_TIMEOUT = 15.0


def server_context(identity: Identity, trusted: list[bytes]) -> ssl.SSLContext:
    """Ask for a client certificate; trust only learned peer certificates."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(identity.pem_path)
    ctx.verify_mode = ssl.CERT_OPTIONAL
    if trusted:
        ctx.load_verify_locations(cadata="".join(p.decode("ascii") for p in trusted))
    return ctx


class PeerHandler(Protocol):
    """What a service plugged into ``serve_peers`` implements."""

    async def __call__(self, peer: Peer, call: str, args: dict[str, Any], payload: Payload) -> tuple[dict[str, Any], bytes]:
        """Run ``call`` for the authenticated ``peer``; read ``payload`` fully.

        Raise :class:`CallFailed` to answer with an error code; any other
        CapsuleError answers with code ``failed``.
        """
        ...


@dataclass
class _ServerState:
    identity: Identity
    peers: PeerFinder
    handler: PeerHandler
    handshake_timeout: float


async def _serve_connection(state: _ServerState, tcp: trio.SocketStream) -> None:
    tls = TLSStream(tcp, server_context(state.identity, state.peers.trusted_pems()), server_side=True)
    what = "incoming peer link"
    try:
        with trio.move_on_after(state.handshake_timeout) as scope:
            with map_errors(what):
                await tls.do_handshake()
        if scope.cancelled_caught:
            log.debug("%s: no TLS handshake within %.0fs", what, state.handshake_timeout)
            return
        der = tls.peer_certificate()
        framer = Framer(tls, what)
        with trio.move_on_after(state.handshake_timeout) as scope:
            peer = await _greet(state, framer, der)
        if scope.cancelled_caught:
            log.debug("%s: no hello within %.0fs", what, state.handshake_timeout)
            return
        if peer is None:
            return
        while True:
            header, payload = await framer.receive()
            if header["type"] != "call" or not isinstance(header.get("call"), str):
                raise PeerProtocolError(f"{framer.what}: expected a call, got {header['type']!r}")
            await _answer(state, framer, peer, header, payload)
    except PeerError as exc:
        log.debug("%s ended: %s", what, exc)
    finally:
        await trio.aclose_forcefully(tls)


async def _greet(state: _ServerState, framer: Framer, der: bytes | None) -> Peer | None:
    """The hello of a new link (and an introduction, for a link without a
    certificate); the authenticated peer, greeted back, or None if the link
    is done. The caller bounds it in time."""
    hello, body = await framer.receive(anonymous=True)
    await body.drain()
    if hello["type"] != "hello" or hello.get("protocol") != PROTOCOL:
        await framer.send({"type": "error", "id": None, "code": "protocol",
                           "message": f"expected hello for {PROTOCOL}"})
        return None
    if der is None:
        await _serve_introduction(state, framer)
        return None
    peer_id = host_id_from_der(der)
    try:
        peer = await state.peers.by_id(peer_id)
    except PeerLookupFailed as exc:
        log.warning("refused a link from host %s: %s", peer_id, exc)
        await framer.send({"type": "error", "id": None, "code": "unknown-peer",
                           "message": f"host {peer_id} cannot be checked now: {exc}"})
        return None
    if peer is None:
        log.warning("refused a link from unknown host %s", peer_id)
        await framer.send({"type": "error", "id": None, "code": "unknown-peer",
                           "message": f"host {peer_id} is not a peer of this host"})
        return None
    framer.what = f"peer {peer.name}"
    await framer.send({"type": "hello", "protocol": PROTOCOL, "host_id": state.identity.host_id})
    return peer


async def _answer(state: _ServerState, framer: Framer, peer: Peer, header: dict[str, Any], payload: Payload) -> None:
    cid, name = header.get("id"), header["call"]
    args = header.get("args") or {}
    try:
        result, data = await state.handler(peer, name, args, payload)
    except CallFailed as exc:
        await payload.drain()
        await framer.send({"type": "error", "id": cid, "code": exc.code, "message": exc.message})
        return
    except PeerError:
        raise
    except CapsuleError as exc:
        await payload.drain()
        await framer.send({"type": "error", "id": cid, "code": "failed", "message": str(exc)})
        return
    except OSError as exc:  # this host's disk, not the link: the caller hears why, the link stays up
        log.warning("%s from %s failed here: %s", name, peer.name, exc)
        await payload.drain()
        await framer.send({"type": "error", "id": cid, "code": "io-error", "message": f"{name}: {exc}"})
        return
    await payload.drain()
    await framer.send({"type": "reply", "id": cid, "result": result}, data)


async def _serve_introduction(state: _ServerState, framer: Framer) -> None:
    await framer.send({"type": "hello", "protocol": PROTOCOL, "host_id": state.identity.host_id})
    header, payload = await framer.receive(anonymous=True)
    await payload.drain()
    if header.get("call") != "introduce":
        await framer.send({"type": "error", "id": header.get("id"), "code": "unauthenticated",
                           "message": "present a certificate, or introduce yourself first"})
        return
    pem = (header.get("args") or {}).get("cert_pem")
    try:
        host_id = await state.peers.learn_cert(pem.encode("ascii") if isinstance(pem, str) and pem.isascii() else b"")
    except CapsuleError as exc:
        log.warning("refused an introduction: %s", exc)
        await framer.send({"type": "error", "id": header.get("id"), "code": "unknown-peer", "message": str(exc)})
        return
    log.info("learned the certificate of peer %s", host_id)
    await framer.send({"type": "reply", "id": header.get("id"), "result": {"host_id": host_id}})


async def serve_peers(
    identity: Identity,
    peers: PeerBook | PeerFinder,
    handler: PeerHandler,
    *,
    host: str = "0.0.0.0",
    port: int = 0,
    handshake_timeout: float = HANDSHAKE_TIMEOUT,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve peer links forever; ``started(port)`` once listening. ``peers``
    says who may call (a ``PeerBook`` is taken as its :class:`BookPeers`)."""
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound = listeners[0].socket.getsockname()[1]
    state = _ServerState(identity, BookPeers(peers) if isinstance(peers, PeerBook) else peers, handler,
                         handshake_timeout)

    async def one(tcp: trio.SocketStream) -> None:
        try:
            await _serve_connection(state, tcp)
        except Exception:  # a bug in a handler must not stop the server
            log.exception("peer connection failed")

    log.info("serving peers on %s:%d as %s", host, bound, identity.host_id)
    async with trio.open_nursery() as nursery:
        task_status.started(bound)
        await trio.serve_listeners(one, listeners, handler_nursery=nursery)
