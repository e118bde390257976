"""Host identity: key and self-signed certificate, host id = base32(sha256(cert DER))."""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import os
import stat
from pathlib import Path

import pytest
from cryptography import x509

from capsulefs.core.capsule.format import check_host_id
from capsulefs.peer.identity import HOST_ID_LENGTH, IdentityError, identity_path, load_identity, load_or_create_identity


def test_create_then_load_gives_the_same_identity(tmp_path: Path) -> None:
    first = load_or_create_identity(tmp_path)
    again = load_or_create_identity(tmp_path)
    assert again == first
    assert load_identity(tmp_path) == first


def test_host_id_is_base32_sha256_of_the_certificate(tmp_path: Path) -> None:
    ident = load_or_create_identity(tmp_path)
    expected = base64.b32encode(hashlib.sha256(ident.cert_der).digest()).decode().rstrip("=")
    assert ident.host_id == expected
    assert len(ident.host_id) == HOST_ID_LENGTH
    assert ident.host_id == ident.host_id.upper()
    assert check_host_id(ident.host_id) == ident.host_id
    cert = x509.load_pem_x509_certificate(ident.cert_pem)
    assert cert.issuer == cert.subject


def test_key_file_is_private_and_no_temp_is_left(tmp_path: Path) -> None:
    ident = load_or_create_identity(tmp_path)
    assert stat.S_IMODE(os.stat(ident.pem_path).st_mode) == 0o600
    assert sorted(p.name for p in ident.pem_path.parent.iterdir()) == ["host.pem"]


def test_two_hosts_get_different_ids(tmp_path: Path) -> None:
    a = load_or_create_identity(tmp_path / "a")
    b = load_or_create_identity(tmp_path / "b")
    assert a.host_id != b.host_id


def test_now_sets_the_start_of_validity(tmp_path: Path) -> None:
    now = dt.datetime(2030, 1, 2, tzinfo=dt.timezone.utc)
    ident = load_or_create_identity(tmp_path, now=now)
    cert = x509.load_pem_x509_certificate(ident.cert_pem)
    assert cert.not_valid_before_utc == now - dt.timedelta(days=1)


def test_missing_identity_is_an_error_that_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(IdentityError, match="capsulefs init"):
        load_identity(tmp_path)


def test_mismatched_key_and_certificate_are_refused(tmp_path: Path) -> None:
    a = load_or_create_identity(tmp_path / "a")
    b = load_or_create_identity(tmp_path / "b")
    key_a = a.pem_path.read_bytes().split(b"-----BEGIN CERTIFICATE-----")[0]
    identity_path(tmp_path / "a").write_bytes(key_a + b.cert_pem)
    with pytest.raises(IdentityError, match="does not belong"):
        load_identity(tmp_path / "a")


def test_garbage_identity_is_refused(tmp_path: Path) -> None:
    load_or_create_identity(tmp_path)
    identity_path(tmp_path).write_bytes(b"not pem")
    with pytest.raises(IdentityError, match="not a PEM"):
        load_identity(tmp_path)
