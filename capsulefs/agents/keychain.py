"""Secrets for agent runs, read through the ``keyring`` library.

Rules:
  * A secret's value never enters a capsule, a log line or the journal. The
    spec names secrets; their values are fetched here for one run and handed
    to that run's process environment only.
  * On a desktop, or whenever ``PYTHON_KEYRING_BACKEND`` names a backend,
    the system keyring is used. On a headless server, where keyring finds no
    usable backend, capsulefs uses its own backend: ``secrets.json`` in the
    state directory, mode 0600, written atomically. It is plain text
    protected by file permissions (like ~/.netrc): keep the state directory
    on an encrypted disk if that matters.
  * Secrets live under the keyring service ``capsulefs``; the username is
    the secret's variable name.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable

import keyring
import keyring.backend
import keyring.backends.fail
import keyring.errors

from capsulefs.core.capsule.format import load_json_object
from capsulefs.core.errors import CapsuleError
from capsulefs.core.fsutil import atomic_write, makedirs_durable
from capsulefs.core.store.layout import SECRETS_FILE

log = logging.getLogger(__name__)

SERVICE = "capsulefs"


class MissingSecret(CapsuleError):
    def __init__(self, names: list[str]) -> None:
        self.names = names
        super().__init__(
            f"missing secret(s) {', '.join(names)}: set them with "
            f"'capsulefs secret set NAME' (the value is read from stdin)"
        )


class StateFileKeyring(keyring.backend.KeyringBackend):
    """keyring backend over a 0600 JSON file in the capsulefs state directory."""

    priority = 1  # type: ignore[assignment]

    def __init__(self, state_dir: str) -> None:
        super().__init__()
        self.path = os.path.join(state_dir, SECRETS_FILE)

    def _load(self) -> dict[str, dict[str, str]]:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return {}
        if st.st_mode & 0o077:
            raise CapsuleError(f"{self.path} is readable by others (mode {oct(st.st_mode & 0o777)}); chmod 600 it")
        with open(self.path, "rb") as f:
            doc = load_json_object(f.read(), self.path, error=CapsuleError)
        # (the error names the file and the fault, never a value: they are secrets)
        if not all(isinstance(names, dict) and all(isinstance(v, str) for v in names.values())
                   for names in doc.values()):
            raise CapsuleError(f'{self.path} is not a secrets file ({{"service": {{"NAME": "value"}}}}); '
                               f"fix it, or remove it and set the secrets again")
        return doc

    def get_password(self, service: str, username: str) -> str | None:
        return self._load().get(service, {}).get(username)

    def set_password(self, service: str, username: str, password: str) -> None:
        doc = self._load()
        doc.setdefault(service, {})[username] = password
        makedirs_durable(os.path.dirname(self.path), 0o700)
        atomic_write(self.path, json.dumps(doc, sort_keys=True, indent=2).encode(), mode=0o600)

    def delete_password(self, service: str, username: str) -> None:
        doc = self._load()
        if username not in doc.get(service, {}):
            raise keyring.errors.PasswordDeleteError(f"no secret {username}")
        del doc[service][username]
        atomic_write(self.path, json.dumps(doc, sort_keys=True, indent=2).encode(), mode=0o600)

    def names(self, service: str = SERVICE) -> list[str]:
        return sorted(self._load().get(service, {}))


def backend_for(state_dir: str) -> keyring.backend.KeyringBackend:
    """The system keyring if one is usable or chosen, else the state-file backend."""
    if os.environ.get("PYTHON_KEYRING_BACKEND"):
        return keyring.get_keyring()
    system = keyring.get_keyring()
    if isinstance(system, keyring.backends.fail.Keyring) or getattr(system, "priority", 0) <= 0:
        return StateFileKeyring(state_dir)
    chained = getattr(system, "backends", None)
    if chained is not None and not chained:
        return StateFileKeyring(state_dir)
    return system


def fetch(state_dir: str, names: Iterable[str]) -> dict[str, str]:
    """Values of the named secrets, for one run. Raises MissingSecret naming every absent one."""
    backend = backend_for(state_dir)
    out: dict[str, str] = {}
    missing = []
    for name in names:
        value = backend.get_password(SERVICE, name)
        if value is None:
            missing.append(name)
        else:
            out[name] = value
    if missing:
        raise MissingSecret(missing)
    return out


def store_secret(state_dir: str, name: str, value: str) -> None:
    backend_for(state_dir).set_password(SERVICE, name, value)


def delete_secret(state_dir: str, name: str) -> None:
    try:
        backend_for(state_dir).delete_password(SERVICE, name)
    except keyring.errors.PasswordDeleteError:
        raise CapsuleError(f"no secret named {name}") from None


def secret_names(state_dir: str) -> list[str] | None:
    """Names stored in the state-file backend (None: a system keyring cannot list)."""
    backend = backend_for(state_dir)
    return backend.names() if isinstance(backend, StateFileKeyring) else None
