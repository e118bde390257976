"""Ed25519 signatures over an exported capsule's manifest.

Rules:
  * A signature attests one exported state: it is made at export, over the
    exact bytes of manifest.json (which digests every other file), and
    stored beside it as manifest.sig. A running capsule changes, so it is
    signed again at each export, never at rest.
  * manifest.sig is JSON: {"format": "capsule-sig/1", "alg": "ed25519",
    "key": <sha256 hex of the raw public key>, "sig": <base64 signature>}.
  * Private keys are PKCS#8 PEM files of mode 0600; public keys are
    SubjectPublicKeyInfo PEM.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from ..errors import SignatureError
from .format import load_json_object
from ..fsutil import atomic_write

SIG_FORMAT = "capsule-sig/1"


def generate_keypair(path: str) -> tuple[str, str]:
    """Write a new private key to ``path`` (0600) and its public key to ``path.pub``."""
    if os.path.exists(path):
        raise SignatureError(f"{path} already exists; refusing to overwrite a key")
    key = Ed25519PrivateKey.generate()
    priv = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    pub = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    atomic_write(path, priv, mode=0o600)
    atomic_write(path + ".pub", pub, mode=0o644)
    return path, path + ".pub"


def load_private_key(data: bytes, what: str = "key file") -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise SignatureError(f"{what} is not an unencrypted PEM private key: {exc}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise SignatureError(f"{what} is not an Ed25519 key")
    return key


def load_public_key(data: bytes, what: str = "public key file") -> Ed25519PublicKey:
    try:
        key = serialization.load_pem_public_key(data)
    except ValueError:
        # A private key file also names its public key.
        return load_private_key(data, what).public_key()
    if not isinstance(key, Ed25519PublicKey):
        raise SignatureError(f"{what} is not an Ed25519 public key")
    return key


def key_id(pub: Ed25519PublicKey) -> str:
    raw = pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()


def sign_manifest(manifest_bytes: bytes, private_pem: bytes) -> bytes:
    key = load_private_key(private_pem)
    doc = {
        "format": SIG_FORMAT,
        "alg": "ed25519",
        "key": key_id(key.public_key()),
        "sig": base64.b64encode(key.sign(manifest_bytes)).decode(),
    }
    return (json.dumps(doc, sort_keys=True, indent=2) + "\n").encode()


def verify_manifest_signature(manifest_bytes: bytes, sig_bytes: bytes, public_pem: bytes) -> None:
    pub = load_public_key(public_pem)
    try:
        doc = load_json_object(sig_bytes, "manifest.sig", error=SignatureError)
        if doc.get("format") != SIG_FORMAT or doc.get("alg") != "ed25519":
            raise ValueError("unknown signature format")
        sig = base64.b64decode(doc["sig"], validate=True)
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise SignatureError(f"manifest.sig is malformed: {exc}") from None
    if doc.get("key") != key_id(pub):
        raise SignatureError(f"manifest.sig was made by key {doc.get('key')}, not by the given public key {key_id(pub)}")
    try:
        pub.verify(sig, manifest_bytes)
    except InvalidSignature:
        raise SignatureError("manifest.sig does not match manifest.json: the manifest was changed after signing") from None
