"""environment/spec.json: how to rebuild an agent's sandbox, never a secret.

Rules:
  * The spec holds an entrypoint, plain environment variables, the NAMES of
    secrets, and setup steps or packages. Secret values come from the host
    keychain for one run and never enter a capsule.
  * A plain env variable whose name contains TOKEN, KEY, SECRET, PASSWORD,
    PASSWD or CREDENTIAL (any case) is refused: declare it under "secrets".
  * Unknown top-level keys are refused (a typo must not silently disable a
    rule), except keys starting with "x-", which are kept for extensions.

Fields::

    version     int            SPEC_VERSION
    entrypoint  [str] | null   argv of the agent process, run in the workspace
    env         {str: str}     plain environment variables
    secrets     [str]          names of secrets to fetch from the keychain
    setup       [[str]]        argv of each setup step, run in order in the workspace
    packages    [str]          packages the sandbox needs (informational)
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from ..errors import SpecError
from .format import load_json

SPEC_VERSION = 1
#: The environment variable in which the supervisor names (never values) the
#: secrets it gave an agent process, comma-separated: the reference agent
#: keeps them from its tools (see :func:`redact_secrets`).
SECRETS_ENV = "CAPSULE_SECRETS"
#: The file a running agent reports its problem in, for .control/status (capsulefs.agents.supervisor).
STATUS_ENV = "CAPSULE_STATUS"
SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # names of env variables and secrets
_FIELDS = {"version", "entrypoint", "env", "secrets", "setup", "packages"}


#: The entrypoint of a new agent: the reference agent. The supervisor runs
#: ``capsulefs`` as the host's own capsulefs.
REFERENCE_AGENT = ["capsulefs", "agent"]


def default_spec(entrypoint: list[str] | None = REFERENCE_AGENT) -> dict[str, Any]:
    return {
        "version": SPEC_VERSION,
        "entrypoint": list(entrypoint) if entrypoint is not None else None,
        "env": {},
        "secrets": [],
        "setup": [],
        "packages": [],
    }


def _argv(value: object, what: str) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(a, str) for a in value):
        raise SpecError(f"spec: {what} must be a non-empty list of strings (an argv)")
    if any("\0" in a for a in value):
        raise SpecError(f"spec: {what} holds a NUL character, which no program can be given")
    return value


def validate_spec(doc: object) -> dict[str, Any]:
    """Return the spec if it keeps every rule; raise SpecError naming the fault."""
    if not isinstance(doc, dict):
        raise SpecError("spec must be a JSON object")
    unknown = sorted(k for k in doc if k not in _FIELDS and not (isinstance(k, str) and k.startswith("x-")))
    if unknown:
        raise SpecError(f"spec: unknown field(s) {', '.join(unknown)} (extensions must start with 'x-')")
    if doc.get("version") != SPEC_VERSION:
        raise SpecError(f"spec: version must be {SPEC_VERSION}, not {doc.get('version')!r}")
    entry = doc.get("entrypoint")
    if entry is not None:
        _argv(entry, "entrypoint")
    env = doc.get("env", {})
    if not isinstance(env, dict):
        raise SpecError("spec: env must be an object of NAME: value strings")
    for name, value in env.items():
        if not ENV_NAME.fullmatch(name):
            raise SpecError(f"spec: env name {name!r} is not a valid variable name")
        if not isinstance(value, str) or "\0" in value:
            raise SpecError(f"spec: env {name} must be a string without NUL characters")
        upper = name.upper()
        hit = next((w for w in SECRET_WORDS if w in upper), None)
        if hit:
            raise SpecError(
                f"spec: env {name} looks like a secret (its name contains {hit}); "
                f'declare it by name under "secrets" and keep its value in the host keychain'
            )
    secrets = doc.get("secrets", [])
    if isinstance(secrets, dict):
        raise SpecError('spec: "secrets" lists names only; values live in the host keychain')
    if not isinstance(secrets, list) or not all(isinstance(s, str) and ENV_NAME.fullmatch(s) for s in secrets):
        raise SpecError('spec: "secrets" must be a list of variable names')
    overlap = sorted(set(secrets) & set(env))
    if overlap:
        raise SpecError(f"spec: {', '.join(overlap)} is both a plain env variable and a secret")
    setup = doc.get("setup", [])
    if not isinstance(setup, list):
        raise SpecError("spec: setup must be a list of argv lists")
    for i, step in enumerate(setup):
        _argv(step, f"setup[{i}]")
    packages = doc.get("packages", [])
    if not isinstance(packages, list) or not all(isinstance(p, str) and p for p in packages):
        raise SpecError("spec: packages must be a list of package names")
    return doc


def secrets_in(environ: Mapping[str, str]) -> dict[str, str]:
    """The secrets (name -> value) that ``SECRETS_ENV`` names in ``environ``."""
    names = [n for n in environ.get(SECRETS_ENV, "").split(",") if n]
    return {n: environ[n] for n in names if environ.get(n)}


def redact_secrets(text: str, secrets: Mapping[str, str]) -> str:
    """``text`` with every secret value replaced by ``[secret NAME]`` (longest first)."""
    for name, value in sorted(secrets.items(), key=lambda kv: -len(kv[1])):
        if value:
            text = text.replace(value, f"[secret {name}]")
    return text


def parse_spec(data: bytes) -> dict[str, Any]:
    return validate_spec(load_json(data, "spec", error=SpecError))


def spec_bytes(doc: dict[str, Any]) -> bytes:
    validate_spec(doc)
    return (json.dumps(doc, sort_keys=True, indent=2) + "\n").encode()
