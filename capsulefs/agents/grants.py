"""Which of this host's secrets each agent may be given.

Rules:
  * A spec only asks for secrets; this host answers with grants. A secret
    goes into an agent's run only if the host granted that agent (by id)
    that secret's name. So an agent that arrives by a move or from a tar
    never takes this host's keys on its own say-so: a peer, or whoever wrote
    the tar, could otherwise name any secret of this host's keychain and
    have its tools read it.
  * ``capsulefs new --spec`` grants what the spec asks: the operator wrote
    it. ``capsulefs secret grant AGENT NAME...`` and ``revoke`` change
    grants by hand; an agent not on this host yet is named by its id, so a
    move can be prepared before it arrives. An edit of the spec through the
    mount grants nothing (an agent's own tools may be able to write it).
  * An agent whose spec asks for a secret it was not granted does not start;
    its status says which grant is missing and the command that gives it
    (:class:`UngrantedSecret`). A grant takes effect without a restart.
  * Grants stay when an agent leaves (it may come back); ``capsulefs rm``
    drops them.
  * The file is ``STATE/secret-grants.json`` (mode 0600, written
    atomically, read-modify-write under an flock of ``STATE/.grants.lock``):
    ``{"format": 1, "grants": {agent_id: [name, ...]}}``.
  * A state directory made before grants existed has no such file. The first
    command or daemon that opens it (:func:`ensure`) grants every agent it
    holds what that agent's spec asks for today, and says so in the log:
    agents that ran before keep running. From then on the file exists, and
    only the rules above add grants; ``STATE/.grants-made`` records that,
    so a grants file removed later comes back empty, never migrated again.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from capsulefs.core.capsule import format as fmt
from capsulefs.core.errors import CapsuleError, FormatError
from capsulefs.core.fsutil import atomic_write
from capsulefs.core.capsule.spec import parse_spec
from capsulefs.core.store.host_store import HostStore
from capsulefs.core.store.layout import GRANTS_FILE, GRANTS_LOCK, GRANTS_MADE

log = logging.getLogger(__name__)

FORMAT = 1


class UngrantedSecret(CapsuleError):
    """The agent's spec asks for secrets this host has not granted it."""

    def __init__(self, agent: str, names: list[str]) -> None:
        self.names = names
        super().__init__(
            f"its spec asks for secret(s) {', '.join(names)}, which this host has not granted it: "
            f"if it should have them, run 'capsulefs secret grant {agent} {' '.join(names)}' "
            f"(an agent moved or imported here never takes this host's secrets on its own)"
        )


def _path(state_dir: str) -> str:
    return os.path.join(state_dir, GRANTS_FILE)


@contextmanager
def _locked(state_dir: str) -> Iterator[None]:
    fd = os.open(os.path.join(state_dir, GRANTS_LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _load(state_dir: str) -> dict[str, list[str]] | None:
    """The grants, or None if the file does not exist (a state directory
    older than grants). A damaged file is an error naming it: guessing
    could give secrets away."""
    path = _path(state_dir)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    try:
        doc = fmt.load_json(data, path)
    except FormatError as exc:
        raise FormatError(f"{exc}; fix it, or remove it "
                          f"(then no agent here has a grant until 'capsulefs secret grant')") from None
    grants = doc.get("grants") if isinstance(doc, dict) and doc.get("format") == FORMAT else None
    if not isinstance(grants, dict) or not all(
            fmt.is_agent_id(k) and isinstance(v, list) and all(isinstance(n, str) for n in v)
            for k, v in grants.items()):
        raise FormatError(f"{path} is not a grants file of format {FORMAT} "
                          f'({{"format": 1, "grants": {{agent_id: [names]}}}})')
    return grants


def _save(state_dir: str, grants: dict[str, list[str]]) -> None:
    doc = {"format": FORMAT, "grants": {k: sorted(set(v)) for k, v in sorted(grants.items()) if v}}
    atomic_write(_path(state_dir), (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode(), mode=0o600)


def _asked(store: HostStore, agent_id: str) -> list[str]:
    try:
        return list(parse_spec(store.agent(agent_id).read(fmt.SPEC)).get("secrets", []))
    except (CapsuleError, OSError) as exc:
        log.warning("grants: agent %s: its spec cannot be read (%s); it is granted nothing", agent_id, exc)
        return []


def ensure(state_dir: str, store: HostStore) -> None:
    """Make sure the grants file exists. The very first time in a state
    directory (no ``GRANTS_MADE``), grant every agent in the store what its spec
    asks for now (see the module's rules); later, a grants file removed by
    hand comes back empty: removing it never grants anything."""
    if os.path.exists(_path(state_dir)) and os.path.exists(os.path.join(state_dir, GRANTS_MADE)):
        return
    try:
        with _locked(state_dir):
            first = not os.path.exists(os.path.join(state_dir, GRANTS_MADE))
            made: dict[str, list[str]] = {}
            if _load(state_dir) is None:
                if first:
                    made = {aid: names for aid in store.agent_ids() if (names := _asked(store, aid))}
                else:
                    log.warning("grants: %s was removed; no agent here has a grant until one is given",
                                _path(state_dir))
                _save(state_dir, made)
            if first:
                atomic_write(os.path.join(state_dir, GRANTS_MADE), b"grants exist in this state directory\n", mode=0o600)
    except OSError as exc:  # e.g. a state directory this user may only read: then nothing is granted
        log.warning("grants: cannot create %s (%s); agents whose specs ask for secrets will not start",
                    _path(state_dir), exc)
        return
    for aid, names in sorted(made.items()):
        log.info("grants: agent %s keeps the secret(s) it used before grants existed: %s", aid, ", ".join(names))


def granted(state_dir: str, agent_id: str) -> set[str]:
    return set((_load(state_dir) or {}).get(agent_id, ()))


def check(state_dir: str, agent_id: str, names: Iterable[str]) -> None:
    """Raise UngrantedSecret naming every secret in ``names`` that the agent
    was not granted."""
    names = list(names)
    if not names:
        return
    have = granted(state_dir, agent_id)
    missing = [n for n in names if n not in have]
    if missing:
        raise UngrantedSecret(agent_id, missing)


def grant(state_dir: str, agent_id: str, names: Iterable[str]) -> list[str]:
    """Grant ``names`` to the agent; return its grants now."""
    fmt.check_agent_id(agent_id)
    with _locked(state_dir):
        grants = _load(state_dir) or {}
        now = sorted(set(grants.get(agent_id, ())) | set(names))
        grants[agent_id] = now
        _save(state_dir, grants)
    return now


def revoke(state_dir: str, agent_id: str, names: Iterable[str] | None = None) -> list[str]:
    """Take ``names`` back (all of the agent's grants if None); return what is left."""
    fmt.check_agent_id(agent_id)
    with _locked(state_dir):
        grants = _load(state_dir)
        if grants is None:
            return []
        left = [] if names is None else sorted(set(grants.get(agent_id, ())) - set(names))
        grants[agent_id] = left
        _save(state_dir, grants)
    return left


def all_grants(state_dir: str) -> dict[str, list[str]]:
    return {k: sorted(v) for k, v in sorted((_load(state_dir) or {}).items())}
