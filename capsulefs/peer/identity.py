"""Host identity: one key and one self-signed certificate per host.

Rules:
  * A host's identity is the single file ``<state>/tls/host.pem`` holding its
    private key (Ed25519, PKCS#8) followed by its self-signed X.509
    certificate. It is mode 0600, written atomically and created at most once:
    two processes racing to create it both end up with the same identity.
  * The host id is derived, never stored: base32 (RFC 4648, upper case, no
    padding) of the sha256 of the certificate's DER bytes, 52 characters, as
    in Syncthing. It names the certificate exactly, so pinning an id pins the
    certificate, and it fits ``capsulefs.core.capsule.format.check_host_id``.
  * Key and certificate live in one file because the id depends on the
    certificate: a key without its certificate would make a new certificate,
    hence a new id, and the host would silently become someone else.

Theory of operation: ``load_or_create_identity(state_dir)`` reads
``host.pem`` if it exists (and checks that its key matches its certificate);
otherwise it makes a key and certificate, writes them to a fresh temporary
file with :func:`capsulefs.core.fsutil.atomic_write`, and links that file
into place with ``os.link``, which fails if another process got there first;
in that case the other process's identity is loaded and ours is dropped.
"""

from __future__ import annotations

import base64
import datetime as _dt
import hashlib
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from capsulefs.core.errors import CapsuleError
from capsulefs.core.fsutil import atomic_write, fsync_dir, makedirs_durable
from capsulefs.core.store.layout import TLS_DIR

__all__ = [
    "HOST_ID_LENGTH",
    "Identity",
    "IdentityError",
    "cert_from_pem",
    "host_id_from_der",
    "identity_path",
    "load_identity",
    "load_or_create_identity",
]

#: Length of a host id: base32 of 32 bytes without padding.
HOST_ID_LENGTH = 52
_PEM_NAME = "host.pem"
# RFC 5280 4.1.2.5: 99991231235959Z means "no well-defined expiration date".
_NOT_AFTER = _dt.datetime(9999, 12, 31, 23, 59, 59, tzinfo=_dt.timezone.utc)


class IdentityError(CapsuleError):
    """The host identity file is missing, unreadable or inconsistent."""


def host_id_from_der(cert_der: bytes) -> str:
    """The host id that names a certificate: base32(sha256(DER)), no padding."""
    digest = hashlib.sha256(cert_der).digest()
    return base64.b32encode(digest).decode("ascii").rstrip("=")


def cert_from_pem(cert_pem: bytes) -> tuple[str, bytes]:
    """A peer's certificate (PEM, hostile): its host id and its canonical PEM.
    Raises IdentityError if it is not one PEM certificate."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError as exc:
        raise IdentityError(f"not a PEM certificate: {exc}") from None
    der = cert.public_bytes(serialization.Encoding.DER)
    return host_id_from_der(der), cert.public_bytes(serialization.Encoding.PEM)


def identity_path(state_dir: str | os.PathLike[str]) -> Path:
    return Path(state_dir) / TLS_DIR / _PEM_NAME


@dataclass(frozen=True, slots=True, kw_only=True)
class Identity:
    """This host's identity, loaded from ``pem_path``."""

    host_id: str  # base32(sha256(cert DER)), 52 characters
    pem_path: Path  # key + certificate, mode 0600: pass to SSLContext.load_cert_chain
    cert_pem: bytes  # the certificate alone, PEM (public; safe to hand to peers)
    cert_der: bytes  # the certificate alone, DER (what host_id digests)

    @property
    def cert_path(self) -> Path:
        return self.pem_path

    @property
    def key_path(self) -> Path:
        return self.pem_path


def _make_pem(now: _dt.datetime) -> bytes:
    key = ed25519.Ed25519PrivateKey.generate()
    # A name of its own, and key identifiers: a server that trusts several
    # peers' certificates as anchors looks a client's issuer up by name (and
    # key identifier); with one name for every host it picked the first
    # anchor of that name, and refused every other peer (TLSV1_ALERT_UNKNOWN_CA).
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"capsulefs host {ski.digest.hex()[:16]}")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _dt.timedelta(days=1))
        .not_valid_after(_NOT_AFTER)
        # Self-signed and trusted as its own anchor by peers that pinned it.
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(ski, critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .sign(key, None)  # Ed25519 signs without a separate hash
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return key_pem + cert.public_bytes(serialization.Encoding.PEM)


def _parse(path: Path, data: bytes) -> Identity:
    try:
        key = serialization.load_pem_private_key(data, password=None)
        cert = x509.load_pem_x509_certificate(data)
    except ValueError as exc:
        raise IdentityError(f"host identity {path} is not a PEM key and certificate: {exc}") from exc
    pub = serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(serialization.Encoding.DER, pub) != cert.public_key().public_bytes(
        serialization.Encoding.DER, pub
    ):
        raise IdentityError(f"host identity {path}: the key does not belong to the certificate")
    der = cert.public_bytes(serialization.Encoding.DER)
    return Identity(
        host_id=host_id_from_der(der),
        pem_path=path,
        cert_pem=cert.public_bytes(serialization.Encoding.PEM),
        cert_der=der,
    )


def load_identity(state_dir: str | os.PathLike[str]) -> Identity:
    """Load this host's identity; raise IdentityError if there is none."""
    path = identity_path(state_dir)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise IdentityError(f"no host identity at {path}: run 'capsulefs init'") from None
    return _parse(path, data)


def load_or_create_identity(
    state_dir: str | os.PathLike[str], *, now: _dt.datetime | None = None
) -> Identity:
    """Load this host's identity, making it first if there is none.

    ``now`` (timezone-aware) sets the certificate's start of validity; it
    defaults to the current time.
    """
    path = identity_path(state_dir)
    if path.exists():
        return load_identity(state_dir)
    makedirs_durable(path.parent, mode=0o700)
    stamp = now if now is not None else _dt.datetime.now(_dt.timezone.utc)
    tmp = path.with_name(f".tmp-{_PEM_NAME}-{secrets.token_hex(8)}")
    atomic_write(tmp, _make_pem(stamp), mode=0o600)
    try:
        os.link(tmp, path)  # fails if another process created it meanwhile
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
        fsync_dir(path.parent)
    return load_identity(state_dir)
