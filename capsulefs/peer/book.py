"""The peer book: the hosts this host talks to, by name, address and host id.

Rules:
  * ``<state>/peers.json`` (format ``peers/1``) maps a name to its address
    (``host:port``) and pinned host id. It is rewritten atomically.
  * A host id pins a certificate exactly (it is the certificate's digest),
    so a peer's certificate is trusted only if its digest is a pinned id.
  * Certificates learned from peers (see ``introduce`` in docs/wire.md) are
    kept in ``<state>/tls/peers/<host_id>.pem``, named by their own digest;
    they are public and are only ever used as trust anchors for pinned ids.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from capsulefs.core.errors import CapsuleError, ExistsError, NotFoundError
from capsulefs.core.capsule.format import check_host_id
from capsulefs.core.fsutil import atomic_write, makedirs_durable
from capsulefs.peer.identity import HOST_ID_LENGTH, IdentityError, cert_from_pem
from capsulefs.core.store.layout import PEERS_FILE, TLS_DIR, TLS_PEERS_DIR

__all__ = ["DEFAULT_PORT", "Peer", "PeerBook", "PeerBookError", "parse_address"]

PEERS_FORMAT = "peers/1"
DEFAULT_PORT = 7714
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_ID_RE = re.compile(rf"[A-Z2-7]{{{HOST_ID_LENGTH}}}")


class PeerBookError(CapsuleError):
    """A peer name, address or host id is malformed, or peers.json is unreadable."""


def parse_address(address: str, *, listen: bool = False) -> tuple[str, int]:
    """``host:port`` (or ``[v6]:port``, or a bare host) -> (host, port).

    With ``listen``, port 0 (any free port) is allowed."""
    if address.startswith("["):
        host, sep, rest = address[1:].partition("]")
        port_s = rest[1:] if rest.startswith(":") else ""
        if not sep:
            raise PeerBookError(f"address {address!r}: unclosed '['")
    elif address.count(":") == 1:
        host, _, port_s = address.partition(":")
    else:
        host, port_s = address, ""
    if not host:
        raise PeerBookError(f"address {address!r} has no host")
    try:
        port = int(port_s) if port_s else DEFAULT_PORT
    except ValueError:
        raise PeerBookError(f"address {address!r}: port {port_s!r} is not a number") from None
    if not (0 if listen else 1) <= port < 65536:
        raise PeerBookError(f"address {address!r}: port {port} is out of range")
    return host, port


@dataclass(frozen=True, slots=True, kw_only=True)
class Peer:
    name: str  # local nickname, e.g. "laptop"
    address: str  # host:port to connect to
    host_id: str  # the pinned id: base32(sha256(certificate DER))

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.fullmatch(self.name):
            raise PeerBookError(f"peer name {self.name!r} must be 1-64 letters, digits, '.', '_' or '-'")
        parse_address(self.address)
        check_host_id(self.host_id)
        if not _ID_RE.fullmatch(self.host_id):
            raise PeerBookError(
                f"host id {self.host_id!r} is not {HOST_ID_LENGTH} base32 characters (run 'capsulefs id' on the peer)"
            )


class PeerBook:
    """peers.json and the learned certificates of one state directory."""

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.state_dir = Path(state_dir)
        self.path = self.state_dir / PEERS_FILE
        self.certs_dir = self.state_dir / TLS_DIR / TLS_PEERS_DIR

    # -- peers.json ------------------------------------------------------------
    def peers(self) -> list[Peer]:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return []
        try:
            doc = json.loads(data)
            if doc.get("format") != PEERS_FORMAT:
                raise PeerBookError(f"{self.path}: format {doc.get('format')!r} is not {PEERS_FORMAT!r}")
            return [Peer(name=n, address=p["address"], host_id=p["host_id"]) for n, p in sorted(doc["peers"].items())]
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            raise PeerBookError(f"{self.path} is unreadable: {exc}") from None

    def _save(self, peers: list[Peer]) -> None:
        makedirs_durable(self.state_dir, 0o700)
        doc = {"format": PEERS_FORMAT,
               "peers": {p.name: {"address": p.address, "host_id": p.host_id} for p in peers}}
        atomic_write(self.path, (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode(), mode=0o600)

    def add(self, peer: Peer) -> None:
        peers = self.peers()
        for p in peers:
            if p.name == peer.name:
                raise ExistsError(f"a peer named {peer.name!r} exists already ({p.host_id})")
            if p.host_id == peer.host_id:
                raise ExistsError(f"host {peer.host_id} is already a peer, named {p.name!r}")
        self._save(peers + [peer])

    def remove(self, name: str) -> Peer:
        peers = self.peers()
        for p in peers:
            if p.name == name:
                self._save([q for q in peers if q.name != name])
                try:
                    os.unlink(self.certs_dir / f"{p.host_id}.pem")
                except FileNotFoundError:
                    pass
                return p
        raise NotFoundError(f"no peer named {name!r}")

    def find(self, name_or_id: str) -> Peer:
        for p in self.peers():
            if name_or_id in (p.name, p.host_id):
                return p
        raise NotFoundError(f"no peer named {name_or_id!r} (see 'capsulefs peer ls')")

    def by_id(self, host_id: str) -> Peer | None:
        return next((p for p in self.peers() if p.host_id == host_id), None)

    # -- learned certificates ------------------------------------------------------
    def learn_cert(self, cert_pem: bytes) -> str:
        """Keep a peer's certificate if its digest is a pinned id; return the id."""
        try:
            host_id, pem = cert_from_pem(cert_pem)
        except IdentityError as exc:
            raise PeerBookError(str(exc)) from None
        if self.by_id(host_id) is None:
            raise NotFoundError(f"host {host_id} is not a configured peer")
        makedirs_durable(self.certs_dir, 0o700)
        atomic_write(self.certs_dir / f"{host_id}.pem", pem)
        return host_id

    def trusted_pems(self) -> list[bytes]:
        """Learned certificates of peers that are still configured."""
        ids = {p.host_id for p in self.peers()}
        out = []
        for host_id in sorted(ids):
            try:
                out.append((self.certs_dir / f"{host_id}.pem").read_bytes())
            except FileNotFoundError:
                continue
        return out
