"""Fuzz targets: the host-local JSON files a state directory holds, read as
capsulefs reads them (each with the strict loader, one error naming the file):

  * store.json: ``HostStore.open`` opens only a store whose layout is the
    integer 1; anything else is a StoreError.
  * secrets.json (the keychain of a host without a system keyring): what is
    accepted is an object of services, each an object of NAME: value strings;
    a refusal never holds a value (they are secrets).
  * secret-grants.json: what is accepted maps agent ids to lists of names.
  * fleet.json (``mount --directory``): what is accepted names an etcd
    address that parses, a prefix the layout takes and, if any, a blob tier
    URL that parses (``--blobs``); a refusal is one
    FleetConfigError line naming the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from capsulefs.agents import grants
from capsulefs.agents.keychain import StateFileKeyring
from capsulefs.core.store.layout import SECRETS_FILE
from capsulefs.core.capsule import format as fmt
from capsulefs.core.errors import CapsuleError
from capsulefs.core.fleet import config as fleet_config
from capsulefs.core.fleet.etcd._ops import parse_endpoints
from capsulefs.core.store.host_store import HostStore
from capsulefs.core.store.layout import STORE_FILE

from . import Target
from capsulefs.core.store import layout

AGENT_ID = "0123456789abcdef0123456789abcdef"
SECRET = "s3cr3t-VALUE"


def _store_seeds() -> list[bytes]:
    return [b'{"layout": 1}\n', b'{"layout":1}']


def _run_store(data: bytes, scratch: Path) -> None:
    state = scratch / "state"
    state.mkdir()
    (state / STORE_FILE).write_bytes(data)
    HostStore.open(state, create=False)  # (StoreError: refused)
    assert json.loads(data)["layout"] == 1 and type(json.loads(data)["layout"]) is int


def _secrets_seeds() -> list[bytes]:
    return [json.dumps({"capsulefs": {"TOKEN": SECRET, "KEY": "k"}}).encode(), b"{}"]


def _run_secrets(data: bytes, scratch: Path) -> None:
    path = scratch / SECRETS_FILE
    path.write_bytes(data)
    os.chmod(path, 0o600)
    try:
        names = StateFileKeyring(str(scratch)).names()
    except CapsuleError as exc:
        assert SECRET not in str(exc) and SECRETS_FILE in str(exc) and "\n" not in str(exc), str(exc)
        raise
    assert all(isinstance(n, str) for n in names), names


def _grants_seeds() -> list[bytes]:
    return [json.dumps({"format": 1, "grants": {AGENT_ID: ["TOKEN", "KEY"]}}).encode(),
            b'{"format": 1, "grants": {}}']


def _run_grants(data: bytes, scratch: Path) -> None:
    (scratch / layout.GRANTS_FILE).write_bytes(data)
    loaded = grants._load(str(scratch))
    assert loaded is not None
    assert all(fmt.is_agent_id(k) and all(isinstance(n, str) for n in v) for k, v in loaded.items()), loaded


def _fleet_seeds() -> list[bytes]:
    return [b'{"directory": "etcd://127.0.0.1:2379,[::1]:2379", "prefix": "/capsulefs/"}\n',
            b'{"directory": "etcd://etcd-a.example:2379"}',
            b'{"directory": "etcd://127.0.0.1:2379", "prefix": "/f/", "blobs": "https://s3.example:9000/fleet-blobs/eu"}']


def _run_fleet(data: bytes, scratch: Path) -> None:
    (scratch / layout.FLEET_FILE).write_bytes(data)
    try:
        cfg = fleet_config.load(str(scratch))
    except CapsuleError as exc:
        assert isinstance(exc, fleet_config.FleetConfigError), repr(exc)
        assert layout.FLEET_FILE in str(exc) and "\n" not in str(exc), str(exc)
        raise
    assert cfg is not None and parse_endpoints(cfg.directory) and cfg.layout.prefix == cfg.prefix.encode()
    assert cfg.blobs is None or cfg.tier is not None  # (a saved tier URL parses)


TARGETS = [
    Target("host_store_json", _store_seeds, _run_store),
    Target("host_secrets_json", _secrets_seeds, _run_secrets),
    Target("host_grants_json", _grants_seeds, _run_grants),
    Target("host_fleet_json", _fleet_seeds, _run_fleet),
]
