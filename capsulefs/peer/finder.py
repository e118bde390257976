"""Finding a peer: who a move's target is, and whether a link's certificate is a peer's.

Rules:
  * :class:`PeerFinder` is what the move code and the peer server ask. Two
    implementations, chosen by the composition root (capsulefs/daemon/root.py)
    by constructor: :class:`BookPeers`, the pinned peers of ``peers.json``
    (peer-to-peer mode, exactly as before), and
    :class:`capsulefs.fleet.peers.DirectoryPeers`, the live host records of
    the directory (the fleet mode).
  * Either way a peer is pinned by its host id, the sha256 of its
    certificate: the client compares the server's certificate with it and
    the server compares the client's (capsulefs/peer/client.py, server.py).
    A finder only says which host ids are peers, and where they listen.
  * ``find`` is the user naming a target (``.control/move``, ``capsulefs
    move``): an unknown name raises :class:`UnknownPeer` (EINVAL through the
    mount), a directory that cannot be read :class:`PeerLookupFailed`.
"""

from __future__ import annotations

from typing import Protocol

from capsulefs.core.errors import CapsuleError, FormatError, NotFoundError
from capsulefs.peer.book import Peer, PeerBook, PeerBookError

__all__ = ["BookPeers", "PeerFinder", "PeerLookupFailed", "UnknownPeer"]


class UnknownPeer(FormatError):
    """The name is no peer this host may move to: not pinned, or no live host in the directory."""


class PeerLookupFailed(CapsuleError):
    """Where the peers are written could not be read (the directory is unreachable): try again."""


class PeerFinder(Protocol):
    """Who the peers are: for a move's target, and for the server's check of a link."""

    async def find(self, target: str) -> Peer:
        """The peer a user named (a name, a host id, or what the finder's docs allow)."""
        ...

    async def by_id(self, host_id: str) -> Peer | None:
        """The peer with this host id (a certificate's digest), None if it is none."""
        ...

    async def learn_cert(self, cert_pem: bytes) -> str:
        """Keep a peer's certificate (introduced on an anonymous link) as a TLS
        trust anchor if its digest is a peer's id; return that id."""
        ...

    def trusted_pems(self) -> list[bytes]:
        """The learned certificates to trust as anchors for the next link."""
        ...


class BookPeers:
    """The pinned peers (``peers.json``): peer-to-peer mode."""

    def __init__(self, book: PeerBook) -> None:
        self.book = book

    async def find(self, target: str) -> Peer:
        try:
            return self.book.find(target)
        except (PeerBookError, NotFoundError, FormatError) as exc:
            names = ", ".join(p.name for p in self.book.peers()) or "none; see 'capsulefs peer add'"
            raise UnknownPeer(f"{target!r} is not a known peer ({exc}); peers: {names}") from None

    async def by_id(self, host_id: str) -> Peer | None:
        return self.book.by_id(host_id)

    async def learn_cert(self, cert_pem: bytes) -> str:
        return self.book.learn_cert(cert_pem)

    def trusted_pems(self) -> list[bytes]:
        return self.book.trusted_pems()
