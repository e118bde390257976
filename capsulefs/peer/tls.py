"""TLS over any trio byte stream, tuned for bulk transfers: the peer link's
transport.

Why not ``trio.SSLStream``: it hands out at most one TLS record (16 KiB)
per ``receive_some``, each through its general retry machinery, so a
receiver pays that Python path some 65,000 times per GiB. Here a
``receive_some`` decrypts every record its buffer holds, up to
``max_bytes``, in one tight loop, and reads the transport in large steps.
The peer link needs nothing else of it: TLS 1.3 only, so there is no
renegotiation, and writing never has to wait for reading after the
handshake.

Rules (the same contract as trio's streams; see ``trio.abc.Stream``):
  * ``send_all``, ``receive_some`` and ``wait_send_all_might_not_block``
    are checkpoints. Two tasks may not send at once, nor receive at once
    (``trio.BusyResourceError``); one task may send while another receives.
  * Bytes leave in the order the TLS object made them: whoever flushes the
    outgoing buffer does so under one FIFO lock, so records that a receive
    produced (a key update, an alert) never overtake or split a send.
  * A receive that is cancelled loses no data: decrypted bytes are returned
    through a schedule point that cannot be cancelled, and a transport
    receive is atomic. A send or handshake that is cancelled or fails
    leaves the stream broken (some unknown part went out), as does any TLS
    error: later calls raise ``trio.BrokenResourceError``.
  * TLS errors are raised as ``trio.BrokenResourceError`` from the
    ``ssl.SSLError``, as trio's own SSLStream does, so the peer link maps
    both alike. A clean close_notify from the peer reads as end of file; a
    transport that ends without one is an error (a truncation attack looks
    exactly like that).
  * ``aclose`` sends close_notify if it can without waiting on a sender,
    then closes the transport. It never waits for the peer's close_notify.
"""

from __future__ import annotations

import enum
import ssl
from typing import cast

import trio

__all__ = ["TLSStream"]

#: Bytes asked of the transport at a time. Loopback and LAN sockets hand
#: over up to this much per system call when a bulk transfer is running.
TRANSPORT_RECEIVE = 256 << 10
#: What ``receive_some()`` without a size returns at most.
DEFAULT_RECEIVE = 256 << 10


class _State(enum.Enum):
    OPEN = "open"
    BROKEN = "broken"
    CLOSED = "closed"


class _OneTask:
    """Lets one task at a time in (one sender, one receiver: trio's rule);
    a second raises ``trio.BusyResourceError``."""

    __slots__ = ("_busy", "_doing")

    def __init__(self, doing: str) -> None:
        self._busy = False
        self._doing = doing

    def __enter__(self) -> None:
        if self._busy:
            raise trio.BusyResourceError(f"another task is {self._doing} on this TLS stream")
        self._busy = True

    def __exit__(self, *exc: object) -> None:
        self._busy = False


_IGNORE_UNEXPECTED_EOF = getattr(ssl, "OP_IGNORE_UNEXPECTED_EOF", 0)


class TLSStream(trio.abc.Stream):
    """A TLS client or server over ``transport``, from ``context``."""

    def __init__(
        self,
        transport: trio.abc.Stream,
        context: ssl.SSLContext,
        *,
        server_side: bool = False,
        server_hostname: str | None = None,
    ) -> None:
        self.transport_stream = transport
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        # Some Pythons (Debian 12's 3.11.2) set OP_IGNORE_UNEXPECTED_EOF on
        # every context: a transport that ends without close_notify (a
        # truncation) would then read as a clean end of file.
        context.options &= ~_IGNORE_UNEXPECTED_EOF
        self._tls = context.wrap_bio(self._incoming, self._outgoing, server_side=server_side,
                                     server_hostname=server_hostname)
        self._state = _State.OPEN
        self._handshook = False
        self._handshake_lock = trio.Lock()
        self._flush_lock = trio.Lock()  # FIFO: flushes go out in the order they were asked for
        self._sending = _OneTask("sending")
        self._receiving = _OneTask("receiving")
        self._eof = False  # the peer's close_notify has been read
        self._error: ssl.SSLError | None = None  # a TLS error met after data that was returned first
        self._delayed = b""  # bytes the handshake wrote that go out before the next send's
        self._held = b""  # decrypted, not handed out yet (a receive cancelled while flushing a reply)

    # -- what the handshake learned -------------------------------------------------
    def peer_certificate(self) -> bytes | None:
        """The certificate the peer presented (DER), None if it sent none."""
        return self._tls.getpeercert(binary_form=True)

    # -- internals ----------------------------------------------------------------------
    def _check(self) -> None:
        if self._state is _State.CLOSED:
            raise trio.ClosedResourceError("the TLS stream is closed")
        if self._state is _State.BROKEN:
            raise trio.BrokenResourceError("the TLS stream is broken by an earlier failure")

    def _break(self) -> None:
        if self._state is _State.OPEN:  # a closed stream stays closed
            self._state = _State.BROKEN

    def _broken(self, exc: ssl.SSLError) -> trio.BrokenResourceError:
        self._break()
        err = trio.BrokenResourceError(f"TLS failure: {exc}")
        err.__cause__ = exc
        return err

    async def _flush(self) -> bool:
        """Send whatever the TLS object has written so far; True if this
        yielded to the scheduler. Cancelled while waiting for the lock, it
        sent nothing and the bytes stay queued; any failure while sending
        breaks the stream (an unknown part of a record may have gone out)."""
        lock = self._flush_lock
        yielded = False
        try:
            lock.acquire_nowait()
        except trio.WouldBlock:
            await lock.acquire()
            yielded = True
        try:
            self._check()  # a flush before ours may have failed
            data = self._outgoing.read()
            if self._delayed:
                data, self._delayed = self._delayed + data, b""
            if data:
                try:
                    await self.transport_stream.send_all(data)
                except BaseException:
                    self._break()
                    raise
                yielded = True
        finally:
            lock.release()
        return yielded

    async def _fill(self) -> None:
        """Feed the TLS object the transport's next bytes (or its end)."""
        data = await self.transport_stream.receive_some(TRANSPORT_RECEIVE)
        if data:
            self._incoming.write(data)
        else:
            self._incoming.write_eof()

    async def _ensure_handshake(self) -> None:
        if self._handshook:
            return
        async with self._handshake_lock:
            if self._handshook:
                return
            self._check()  # an earlier attempt may have failed while we waited
            try:
                while True:
                    try:
                        self._tls.do_handshake()
                        break
                    except ssl.SSLWantReadError:
                        await self._flush()
                        await self._fill()
                    except ssl.SSLError as exc:
                        try:
                            await self._flush()  # the alert that tells the peer why, if we can
                        except Exception:
                            pass
                        raise self._broken(exc) from exc
                if self._tls.server_side and self._tls.version() == "TLSv1.3":
                    # What a TLS 1.3 server writes after its handshake (session
                    # tickets) goes out with its next send. Sent now, it could
                    # wait forever on a client that has finished its own
                    # handshake and reads only once it has sent something.
                    self._delayed = self._outgoing.read()
                else:
                    await self._flush()
            except BaseException:
                self._break()
                raise
            self._handshook = True

    async def do_handshake(self) -> None:
        """Run the handshake now (else the first send or receive runs it)."""
        self._check()
        if self._handshook:
            await trio.lowlevel.checkpoint()
            return
        await self._ensure_handshake()

    # -- sending --------------------------------------------------------------------
    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        with self._sending:
            self._check()
            await trio.lowlevel.checkpoint_if_cancelled()
            await self._ensure_handshake()
            self._check()
            if data:
                try:
                    self._tls.write(data)  # every byte: partial writes are off
                except ssl.SSLError as exc:
                    raise self._broken(exc) from exc
            try:
                flushed = await self._flush()
            except BaseException:
                self._break()  # our records may go out later or never: the caller cannot know
                raise
            if not flushed:
                await trio.lowlevel.cancel_shielded_checkpoint()

    async def wait_send_all_might_not_block(self) -> None:
        with self._sending:
            self._check()
            async with self._flush_lock:  # the transport's send side is the flusher's
                await self.transport_stream.wait_send_all_might_not_block()

    # -- receiving ------------------------------------------------------------------
    def _decrypt(self, max_bytes: int) -> bytes:
        """Every record already buffered, up to ``max_bytes`` of plain text."""
        chunks: list[bytes] = []
        got = 0
        read = self._tls.read
        while got < max_bytes:
            try:
                data = read(max_bytes - got)
            except ssl.SSLWantReadError:
                break
            except ssl.SSLZeroReturnError:  # close_notify, once both ends have sent theirs
                self._eof = True
                break
            except ssl.SSLError as exc:
                if not chunks:
                    raise self._broken(exc) from exc
                self._error = exc  # hand out what came before it first
                break
            if not data:  # close_notify: CPython reads it as b"" rather than raising
                self._eof = True
                break
            chunks.append(data)
            got += len(data)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _decrypt_into(self, view: memoryview) -> int:
        """Every record already buffered, up to ``len(view)`` bytes of plain
        text, decrypted straight into ``view``; how many bytes it wrote."""
        got = 0
        want = len(view)
        read = self._tls.read
        while got < want:
            try:
                # (typeshed says bytes: with a buffer, read returns the count)
                n = cast(int, read(want - got, view[got:]))
            except ssl.SSLWantReadError:
                break
            except ssl.SSLZeroReturnError:
                self._eof = True
                break
            except ssl.SSLError as exc:
                if not got:
                    raise self._broken(exc) from exc
                self._error = exc
                break
            if not n:
                self._eof = True
                break
            got += n
        return got

    async def receive_into(self, buffer: bytearray | memoryview) -> int:
        """``receive_some(len(buffer))``, but the plain text is decrypted
        straight into ``buffer`` (a bulk reader saves a copy of every byte);
        returns how many bytes it wrote there, 0 at end of file. The same
        rules as receive_some; a receive cancelled after it wrote into
        ``buffer`` hands those bytes out again next time."""
        with memoryview(buffer) as whole, whole.cast("B") as view:
            if not len(view):
                raise ValueError("the buffer must not be empty")
            got = await self._receive(len(view), view)
            assert isinstance(got, int)
            return got

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if max_bytes is None:
            max_bytes = DEFAULT_RECEIVE
        elif max_bytes < 1:
            raise ValueError("max_bytes must be >= 1")
        data = await self._receive(max_bytes, None)
        assert isinstance(data, bytes)
        return data

    async def _receive(self, max_bytes: int, into: memoryview | None) -> bytes | int:
        """receive_some's and receive_into's common path: with ``into``, the
        bytes land there and their count is returned."""
        with self._receiving:
            self._check()
            await trio.lowlevel.checkpoint_if_cancelled()
            await self._ensure_handshake()
            yielded = False
            while True:
                self._check()
                if self._error is not None:
                    exc, self._error = self._error, None
                    raise self._broken(exc) from exc
                data = b""
                if self._held:
                    data, self._held = self._held[:max_bytes], self._held[max_bytes:]
                    if into is not None:
                        into[: len(data)] = data
                    got = len(data)
                elif self._eof:
                    got = 0
                elif into is not None:
                    got = self._decrypt_into(into)
                else:
                    data = self._decrypt(max_bytes)
                    got = len(data)
                if self._outgoing.pending:  # records that asked for an answer (a key update)
                    try:
                        yielded = await self._flush() or yielded
                    except BaseException:
                        # cancelled before sending: hand the bytes out next time
                        self._held = (bytes(into[:got]) if into is not None else data) + self._held
                        raise
                if got or self._eof:
                    break
                await self._fill()
                yielded = True
            if not yielded:
                await trio.lowlevel.cancel_shielded_checkpoint()
            return got if into is not None else data

    # -- closing --------------------------------------------------------------------
    async def aclose(self) -> None:
        if self._state is _State.CLOSED:
            await trio.lowlevel.checkpoint()
            return
        was_open = self._state is _State.OPEN and self._handshook
        self._state = _State.CLOSED
        try:
            if was_open and not self._flush_lock.locked():
                try:
                    self._tls.unwrap()
                except (ssl.SSLWantReadError, ssl.SSLError):
                    pass  # unwrap waits for the peer's close_notify, which we do not
                data = self._delayed + self._outgoing.read()  # close_notify after what the handshake wrote
                if data:
                    try:
                        await self.transport_stream.send_all(data)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        pass
        finally:
            await self.transport_stream.aclose()
