"""The peer link: framed, named calls over mutual TLS with pinned host ids.

Rules:
  * Both ends authenticate by certificate digest (the host id), never by
    name or CA. The client accepts any certificate at the TLS layer and then
    compares the digest of the server's certificate with the pinned id
    before it sends a call. The server asks for a client certificate and
    trusts, as anchors, only the certificates of configured peers it has
    learned; after the handshake it compares the digest with the pinned ids
    again, so a removed peer is refused. An unknown or mismatched peer is
    refused before any call.
  * A client whose certificate the server has not learned yet first makes a
    connection without a client certificate and makes the single call
    ``introduce``, carrying its (public) certificate; the server keeps it
    only if its digest is a configured peer's id. Then it reconnects.
  * Errors are mapped at this boundary (httpcore style): OSError, ssl and
    trio errors become :class:`PeerError` subclasses; a remote handler's
    failure arrives as :class:`RemoteError` with a code.
  * Anyone who reaches the port can finish a TLS handshake without a
    certificate, so until the peer is known the server gives a link little:
    its hello (and an introduction) must arrive within the handshake
    timeout, in frames of at most ``MAX_ANONYMOUS_HEADER`` bytes.
  * ``serve_peers`` calls ``task_status.started(port)`` only once it listens.
    Each connection is served in a task of the server's nursery.

Framing, calls and errors are documented in docs/wire.md.
"""

from __future__ import annotations

import json
import logging
import mmap
import ssl
import struct
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterator
from contextlib import aclosing, asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import trio

from capsulefs.core.errors import CapsuleError
from capsulefs.core.capsule.format import load_json
from capsulefs.peer.identity import Identity, host_id_from_der
from capsulefs.peer.book import Peer, PeerBook, parse_address
from capsulefs.peer.tls import TLSStream

log = logging.getLogger(__name__)

__all__ = [
    "PROTOCOL",
    "Payload",
    "PeerBroken",
    "PeerConnection",
    "PeerError",
    "PeerHandler",
    "PeerProtocolError",
    "PeerRefused",
    "PeerUnreachable",
    "RemoteError",
    "open_peer",
    "serve_peers",
]

PROTOCOL = "capsulefs-peer/1"
_PREFIX = struct.Struct("!IQ")  # header length (u32), payload length (u64), big-endian
MAX_HEADER = 1 << 20
MAX_ANONYMOUS_HEADER = 64 << 10  # header and payload of a frame before the peer is known (hello, introduce)
RECEIVE_CHUNK = 1 << 20
HANDSHAKE_TIMEOUT = 15.0


class PeerError(CapsuleError):
    """The peer link failed; the subclass says how."""


class PeerUnreachable(PeerError):
    """No TCP connection could be made to the peer's address."""


class PeerRefused(PeerError):
    """Authentication failed: the peer is unknown, or its id is not the pinned one."""


class PeerBroken(PeerError):
    """The link broke in the middle of a call (reset, EOF, TLS failure)."""


class PeerProtocolError(PeerError):
    """The other end sent something that is not a valid frame or message."""


class RemoteError(PeerError):
    """The remote end ran the call and reports a failure."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        self.message = message
        super().__init__(f"peer error {code}: {message}")


class CallFailed(CapsuleError):
    """Raised by a handler to send a named error code back to the caller."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        self.message = message
        super().__init__(message)


@contextmanager
def _map_errors(what: str) -> Iterator[None]:
    try:
        yield
    except PeerError:
        raise
    except ssl.SSLError as exc:
        raise PeerBroken(f"{what}: TLS failure: {exc.reason or exc}") from exc
    except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        cause = exc.__cause__ or exc
        if isinstance(cause, ssl.SSLError):
            raise PeerBroken(f"{what}: TLS failure: {cause.reason or cause}") from exc
        raise PeerBroken(f"{what}: link broken: {cause}") from exc
    except OSError as exc:
        raise PeerBroken(f"{what}: {exc.strerror or exc}") from exc


# -- TLS contexts ------------------------------------------------------------------


def client_context(identity: Identity | None) -> ssl.SSLContext:
    """Accept any server certificate (we pin its digest ourselves); present ours."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    if identity is not None:
        ctx.load_cert_chain(identity.pem_path)
    return ctx


def server_context(identity: Identity, trusted: list[bytes]) -> ssl.SSLContext:
    """Ask for a client certificate; trust only learned peer certificates."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(identity.pem_path)
    ctx.verify_mode = ssl.CERT_OPTIONAL
    if trusted:
        ctx.load_verify_locations(cadata="".join(p.decode("ascii") for p in trusted))
    return ctx


# -- framing ----------------------------------------------------------------------------


class _Framer:
    """Frames over a byte stream: prefix, JSON header, raw payload."""

    def __init__(self, stream: trio.abc.Stream, what: str) -> None:
        self.stream = stream
        self.what = what
        self._buf = bytearray()
        self.sent_bytes = 0
        self.received_bytes = 0

    async def _fill(self, n: int) -> None:
        while len(self._buf) < n:
            with _map_errors(self.what):
                data = await self.stream.receive_some(RECEIVE_CHUNK)
            if not data:
                raise PeerBroken(f"{self.what}: the peer closed the link")
            self.received_bytes += len(data)
            self._buf += data

    async def send(self, header: dict[str, Any], payload: bytes | AsyncIterable[bytes] = b"", size: int | None = None) -> None:
        head = json.dumps(header, separators=(",", ":")).encode()
        if isinstance(payload, (bytes, bytearray, memoryview)):
            size = len(payload)
        elif size is None:
            raise ValueError("a streamed payload needs its size")
        prefix = _PREFIX.pack(len(head), size)
        with _map_errors(self.what):
            if isinstance(payload, (bytes, bytearray, memoryview)):
                await self.stream.send_all(prefix + head + bytes(payload))
                self.sent_bytes += len(prefix) + len(head) + size
                return
            await self.stream.send_all(prefix + head)
            self.sent_bytes += len(prefix) + len(head)
            sent = 0
            async with _closing(payload) as chunks:
                async for chunk in chunks:
                    sent += len(chunk)
                    if sent > size:
                        raise PeerProtocolError(f"{self.what}: payload longer than its declared {size} bytes")
                    await self.stream.send_all(chunk)
                    self.sent_bytes += len(chunk)
        if sent != size:
            # The frame cannot be completed: the link is now unusable.
            raise PeerBroken(f"{self.what}: payload ended at {sent} of {size} bytes")

    async def receive(self, *, anonymous: bool = False) -> tuple[dict[str, Any], "Payload"]:
        """The next frame. ``anonymous``: from a link not authenticated yet,
        whose header and payload may not exceed ``MAX_ANONYMOUS_HEADER``."""
        await self._fill(_PREFIX.size)
        head_len, size = _PREFIX.unpack(self._buf[: _PREFIX.size])
        limit = MAX_ANONYMOUS_HEADER if anonymous else MAX_HEADER
        if head_len > limit or (anonymous and size > limit):
            raise PeerProtocolError(f"{self.what}: frame of {head_len} + {size} bytes is over {limit}")
        await self._fill(_PREFIX.size + head_len)
        raw = bytes(self._buf[_PREFIX.size: _PREFIX.size + head_len])
        del self._buf[: _PREFIX.size + head_len]
        header = load_json(raw, f"{self.what}: header", error=PeerProtocolError)
        if not isinstance(header, dict) or not isinstance(header.get("type"), str):
            raise PeerProtocolError(f"{self.what}: header must be an object with a 'type'")
        return header, Payload(self, size)


@asynccontextmanager
async def _closing(it: AsyncIterable[bytes]) -> AsyncIterator[AsyncIterable[bytes]]:
    """Close an async generator payload even when sending it fails midway."""
    try:
        yield it
    finally:
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            await aclose()


class Payload:
    """A frame's payload, read as it arrives. Must be read (or drained) before the next frame."""

    def __init__(self, framer: _Framer, size: int) -> None:
        self._framer = framer
        self.size = size
        self.remaining = size

    async def chunks(self) -> AsyncIterator[bytes]:
        """The rest of the payload, a chunk (about one TLS record) at a time."""
        async with aclosing(self.batches(1)) as batches:
            async for batch in batches:
                for chunk in batch:
                    yield chunk

    async def batches(self, size: int) -> AsyncIterator[list[bytes]]:
        """The rest of the payload as lists of chunks that add up to at least
        ``size`` bytes (the last list may hold less): a bulk reader steps
        once per list rather than once per TLS record."""
        f = self._framer
        while self.remaining:
            batch: list[bytes] = []
            have = 0
            with _map_errors(f.what):
                while have < size and self.remaining:
                    if f._buf:
                        n = min(len(f._buf), self.remaining)
                        chunk = bytes(f._buf[:n])
                        del f._buf[:n]
                    else:  # straight from the stream, without a copy through the buffer
                        chunk = await f.stream.receive_some(RECEIVE_CHUNK)
                        if not chunk:
                            raise PeerBroken(f"{f.what}: the peer closed the link")
                        f.received_bytes += len(chunk)
                        if type(chunk) is not bytes:
                            chunk = bytes(chunk)
                        if len(chunk) > self.remaining:
                            f._buf += chunk[self.remaining:]
                            chunk = chunk[: self.remaining]
                    self.remaining -= len(chunk)
                    have += len(chunk)
                    batch.append(chunk)
            yield batch

    async def readinto(self, buffer: bytearray | memoryview | mmap.mmap) -> None:
        """Fill ``buffer`` with the payload's next ``len(buffer)`` bytes (at
        most what remains). Over a :class:`TLSStream` the records are
        decrypted straight into it: the bulk reader's path, without a copy."""
        f = self._framer
        with memoryview(buffer) as whole, whole.cast("B") as view:
            if len(view) > self.remaining:
                raise ValueError(f"{len(view)} bytes asked for, {self.remaining} left in the payload")
            got = 0
            if f._buf:
                got = min(len(f._buf), len(view))
                view[:got] = f._buf[:got]
                del f._buf[:got]
                self.remaining -= got
            receive_into = getattr(f.stream, "receive_into", None)
            with _map_errors(f.what):
                while got < len(view):
                    if receive_into is not None:
                        n = await receive_into(view[got:])
                    else:
                        chunk = await f.stream.receive_some(RECEIVE_CHUNK)
                        n = min(len(chunk), len(view) - got)
                        view[got : got + n] = chunk[:n]
                        f._buf += chunk[n:]
                        f.received_bytes += len(chunk) - n
                    if not n:
                        raise PeerBroken(f"{f.what}: the peer closed the link")
                    f.received_bytes += n
                    self.remaining -= n  # as it goes: a cancelled read leaves the frame's count true
                    got += n

    async def read(self, limit: int = 64 << 20) -> bytes:
        if self.remaining > limit:
            raise PeerProtocolError(f"payload of {self.remaining} bytes is over the {limit} byte limit")
        async with aclosing(self.batches(self.remaining)) as batches:
            return b"".join([c async for batch in batches for c in batch])

    async def drain(self) -> None:
        async with aclosing(self.batches(RECEIVE_CHUNK)) as batches:
            async for _ in batches:
                pass


# -- the client ------------------------------------------------------------------------------


class PeerConnection:
    """One authenticated link to a peer; one call at a time."""

    def __init__(self, framer: _Framer, peer: Peer, tls: TLSStream) -> None:
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
                   payload: bytes | AsyncIterable[bytes] = b"", size: int | None = None) -> tuple[dict[str, Any], bytes]:
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
                   wrap: StreamWrapper | None = None) -> tuple[TLSStream, _Framer]:
    host, port = parse_address(peer.address)
    what = f"peer {peer.name} ({peer.address})"
    with trio.move_on_after(timeout) as scope:
        try:
            tcp = await trio.open_tcp_stream(host, port)
        except OSError as exc:
            raise PeerUnreachable(f"{what}: cannot connect: {exc.strerror or exc}") from exc
        tls = TLSStream(wrap(tcp) if wrap else tcp, client_context(identity), server_hostname=None)
        try:
            with _map_errors(what):
                await tls.do_handshake()
        except BaseException:
            await trio.aclose_forcefully(tls)
            raise
    if scope.cancelled_caught:
        raise PeerUnreachable(f"{what}: no TLS handshake within {timeout:.0f}s")
    der = tls.getpeercert(binary_form=True)
    got = host_id_from_der(der) if der else None
    if got != peer.host_id:
        await trio.aclose_forcefully(tls)
        raise PeerRefused(f"{what} presented host id {got}, not the pinned {peer.host_id}")
    return tls, _Framer(tls, what)


async def _hello(framer: _Framer) -> dict[str, Any]:
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


# -- the server ------------------------------------------------------------------------------


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
    book: PeerBook
    handler: PeerHandler
    handshake_timeout: float


async def _serve_connection(state: _ServerState, tcp: trio.SocketStream) -> None:
    tls = TLSStream(tcp, server_context(state.identity, state.book.trusted_pems()), server_side=True)
    what = "incoming peer link"
    try:
        with trio.move_on_after(state.handshake_timeout) as scope:
            with _map_errors(what):
                await tls.do_handshake()
        if scope.cancelled_caught:
            log.debug("%s: no TLS handshake within %.0fs", what, state.handshake_timeout)
            return
        der = tls.getpeercert(binary_form=True)
        framer = _Framer(tls, what)
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


async def _greet(state: _ServerState, framer: _Framer, der: bytes | None) -> Peer | None:
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
    peer = state.book.by_id(peer_id)
    if peer is None:
        log.warning("refused a link from unknown host %s", peer_id)
        await framer.send({"type": "error", "id": None, "code": "unknown-peer",
                           "message": f"host {peer_id} is not a peer of this host"})
        return None
    framer.what = f"peer {peer.name}"
    await framer.send({"type": "hello", "protocol": PROTOCOL, "host_id": state.identity.host_id})
    return peer


async def _answer(state: _ServerState, framer: _Framer, peer: Peer, header: dict[str, Any], payload: Payload) -> None:
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


async def _serve_introduction(state: _ServerState, framer: _Framer) -> None:
    await framer.send({"type": "hello", "protocol": PROTOCOL, "host_id": state.identity.host_id})
    header, payload = await framer.receive(anonymous=True)
    await payload.drain()
    if header.get("call") != "introduce":
        await framer.send({"type": "error", "id": header.get("id"), "code": "unauthenticated",
                           "message": "present a certificate, or introduce yourself first"})
        return
    pem = (header.get("args") or {}).get("cert_pem")
    try:
        host_id = state.book.learn_cert(pem.encode("ascii") if isinstance(pem, str) and pem.isascii() else b"")
    except CapsuleError as exc:
        log.warning("refused an introduction: %s", exc)
        await framer.send({"type": "error", "id": header.get("id"), "code": "unknown-peer", "message": str(exc)})
        return
    log.info("learned the certificate of peer %s", host_id)
    await framer.send({"type": "reply", "id": header.get("id"), "result": {"host_id": host_id}})


async def serve_peers(
    identity: Identity,
    book: PeerBook,
    handler: PeerHandler,
    *,
    host: str = "0.0.0.0",
    port: int = 0,
    handshake_timeout: float = HANDSHAKE_TIMEOUT,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve peer links forever; ``started(port)`` once listening."""
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound = listeners[0].socket.getsockname()[1]
    state = _ServerState(identity, book, handler, handshake_timeout)

    async def one(tcp: trio.SocketStream) -> None:
        try:
            await _serve_connection(state, tcp)
        except Exception:  # a bug in a handler must not stop the server
            log.exception("peer connection failed")

    log.info("serving peers on %s:%d as %s", host, bound, identity.host_id)
    async with trio.open_nursery() as nursery:
        task_status.started(bound)
        await trio.serve_listeners(one, listeners, handler_nursery=nursery)


Handler = Callable[[Peer, str, dict[str, Any], Payload], Awaitable[tuple[dict[str, Any], bytes]]]
