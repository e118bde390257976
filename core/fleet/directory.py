"""The directory as the holder authority, sans-IO: its records, its Txns, their answers.

Rules:
  * An agent's key ``PREFIX/agents/<agent_id>`` holds ``{host_id, epoch,
    state}``: the one host that may run the agent, at which epoch. A host's
    key ``PREFIX/hosts/<host_id>`` holds ``{host_id, address, cert_sha256}``
    under the host's lease: it exists exactly while the lease is alive.
  * A host runs an agent only while (a) a read of the agent's key made while
    its lease was alive named it at the epoch it holds, and (b) its lease is
    still alive by its own clock (:mod:`.lease` says until when). Nobody but
    that host can change such a key while its lease lives (only its own moves
    and a takeover of a host whose key is gone write it), so (a) stays true.
  * A move's point of no return is one Txn (:func:`commit_txn`): if the
    agent's key is unchanged since the source read it at the move's start
    (``mod_revision``) and the target's host key exists, write the target at
    the new epoch. A commit whose reply was lost is settled by a fence
    (:func:`fence_txn`): rewrite the key's current value, if unchanged, so
    that its ``mod_revision`` moves and a commit still on its way can never
    apply. A target fences the same way before it refuses a prepared move.
  * A takeover (:func:`takeover_txn`) writes a new holder only if the holder's
    host key is gone (its lease expired) and the agent's key is unchanged.
  * Every record read back is hostile input: :func:`decode_agent` and
    :func:`decode_host` check every field and raise :class:`DirectoryRecordError`.

Theory of operation. Each Txn is a plain :class:`DirTxn` (compares, success
and failure operations of ``core.fleet.etcd``) that the etcd client sends
as it is and the simulated directory (``capsulefs.testing.fleet_sim``)
evaluates the same way. Its answer, a ``TxnResult``, is judged here into the
move protocol's :class:`~capsulefs.core.move.Outcome`: so the directory is
the party that answers a source's ``activate`` and ``status`` calls in the
fleet mode (:func:`judge`), by the table ``JUDGE_TABLE`` rendered into
docs/fleet.md.
"""

from __future__ import annotations

import base64
import enum
import json
from collections.abc import Callable
from dataclasses import dataclass

from ..capsule.format import check_agent_id, check_host_id, check_int, load_json_object
from ..errors import FormatError
from ..move import Outcome
from .errors import DirectoryError
from .etcd import Compare, KeyValue, Op, Put, Range, RangeResult, Result, TxnResult

__all__ = [
    "AGENT_FORMAT",
    "HOST_FORMAT",
    "JUDGE_TABLE",
    "AgentEntry",
    "DirTxn",
    "DirectoryRecordError",
    "EntryState",
    "HostEntry",
    "Layout",
    "Move",
    "claim_txn",
    "commit_txn",
    "decode_agent",
    "decode_host",
    "describe_judge_table",
    "fence_txn",
    "judge",
    "may_run",
    "register_ops",
    "takeover_txn",
]

AGENT_FORMAT = "fleet-agent/1"
HOST_FORMAT = "fleet-host/1"
MAX_RECORD = 4096  # bytes: a record is a few fields; anything longer is not ours


class DirectoryRecordError(DirectoryError, FormatError):
    """A record in the directory is not one capsulefs writes."""


class EntryState(enum.Enum):
    HELD = "held"  # host_id holds the agent at epoch and may run it (rules above)
    REMOVED = "removed"  # the agent was removed from the fleet; nobody runs it


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentEntry:
    host_id: str  # the holder
    epoch: int  # the holder's epoch; only grows
    state: EntryState = EntryState.HELD

    def __post_init__(self) -> None:
        check_host_id(self.host_id)
        check_int(self.epoch, "directory epoch", low=1)
        if not isinstance(self.state, EntryState):
            raise FormatError(f"entry state {self.state!r} is not an EntryState")

    def encode(self) -> bytes:
        """Canonical bytes (sorted keys, no spaces): equal entries, equal bytes."""
        body = {"format": AGENT_FORMAT, "host_id": self.host_id, "epoch": self.epoch, "state": self.state.value}
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    def names(self, host_id: str, epoch: int) -> bool:
        return self.state is EntryState.HELD and self.host_id == host_id and self.epoch == epoch


_HEX = frozenset("0123456789abcdef")
_B32 = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZ234567")


@dataclass(frozen=True, slots=True, kw_only=True)
class HostEntry:
    host_id: str
    address: str  # HOST:PORT of its move listener (mutual TLS, host id pinned from here)
    # sha256 of its TLS certificate's DER, 64 lowercase hex digits ("": not published;
    # then the field is not written, so records without it read and write as before).
    # A daemon's host id is base32 of the same digest (capsulefs.peer.identity): a
    # record whose 52-character base32 host id names another digest is refused.
    cert_sha256: str = ""

    def __post_init__(self) -> None:
        check_host_id(self.host_id)
        if not isinstance(self.address, str) or not 0 < len(self.address) <= 300 or not self.address.isprintable():
            raise FormatError(f"host address {self.address!r} is not 1-300 printable characters")
        if not isinstance(self.cert_sha256, str) or (
                self.cert_sha256 and (len(self.cert_sha256) != 64 or not set(self.cert_sha256) <= _HEX)):
            raise FormatError(f"certificate fingerprint {str(self.cert_sha256)[:80]!r} is not 64 lowercase hex digits")
        if self.cert_sha256 and len(self.host_id) == 52 and set(self.host_id) <= _B32:
            named = base64.b32encode(bytes.fromhex(self.cert_sha256)).decode("ascii").rstrip("=")
            if named != self.host_id:
                raise FormatError(f"host id {self.host_id} is not the certificate's (sha256 {self.cert_sha256})")

    def encode(self) -> bytes:
        body = {"format": HOST_FORMAT, "host_id": self.host_id, "address": self.address}
        if self.cert_sha256:
            body["cert_sha256"] = self.cert_sha256
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _doc(data: bytes, what: str, fmt: str, fields: set[str], optional: frozenset[str] = frozenset()) -> dict[str, object]:
    if len(data) > MAX_RECORD:
        raise DirectoryRecordError(f"{what}: {len(data)} bytes, more than {MAX_RECORD}")
    doc = load_json_object(data, what, error=DirectoryRecordError)
    if doc.get("format") != fmt:
        raise DirectoryRecordError(f"{what}: format {str(doc.get('format'))[:40]!r} is not {fmt!r}")
    if set(doc) - optional != fields | {"format"}:
        raise DirectoryRecordError(f"{what}: fields {sorted(doc)[:10]} are not {sorted(fields | {'format'})}")
    return doc


def decode_agent(data: bytes) -> AgentEntry:
    doc = _doc(data, "directory agent record", AGENT_FORMAT, {"host_id", "epoch", "state"})
    state = doc["state"]
    if not isinstance(state, str) or state not in {s.value for s in EntryState}:
        raise DirectoryRecordError(f"directory agent record: state {str(state)[:40]!r} is not one of "
                                   f"{[s.value for s in EntryState]}")
    try:
        return AgentEntry(host_id=doc["host_id"], epoch=doc["epoch"], state=EntryState(state))  # type: ignore[arg-type]
    except FormatError as exc:
        raise DirectoryRecordError(f"directory agent record: {exc}") from None


def decode_host(data: bytes) -> HostEntry:
    doc = _doc(data, "directory host record", HOST_FORMAT, {"host_id", "address"}, frozenset({"cert_sha256"}))
    if doc.get("cert_sha256", None) == "":
        raise DirectoryRecordError("directory host record: an empty cert_sha256 is left out, not written")
    try:
        return HostEntry(host_id=doc["host_id"], address=doc["address"],  # type: ignore[arg-type]
                         cert_sha256=doc.get("cert_sha256", ""))  # type: ignore[arg-type]
    except FormatError as exc:
        raise DirectoryRecordError(f"directory host record: {exc}") from None


@dataclass(frozen=True, slots=True)
class Layout:
    """Where the records live: every key under ``prefix`` (one fleet per prefix)."""

    prefix: bytes = b"/capsulefs/"

    def __post_init__(self) -> None:
        if not self.prefix.startswith(b"/") or not self.prefix.endswith(b"/"):
            raise ValueError(f"a directory prefix starts and ends with '/', not {self.prefix!r}")

    def agent(self, agent_id: str) -> bytes:
        return self.prefix + b"agents/" + check_agent_id(agent_id).encode()

    def host(self, host_id: str) -> bytes:
        return self.prefix + b"hosts/" + check_host_id(host_id).encode()

    @property
    def agents(self) -> bytes:
        return self.prefix + b"agents/"

    @property
    def hosts(self) -> bytes:
        return self.prefix + b"hosts/"

    def agent_id_of(self, key: bytes) -> str:
        if not key.startswith(self.agents):
            raise DirectoryRecordError(f"key {key[:80]!r} is not under {self.agents!r}")
        try:
            return check_agent_id(key[len(self.agents):].decode("ascii"))
        except (UnicodeDecodeError, FormatError):
            raise DirectoryRecordError(f"key {key[:80]!r}: not an agent id") from None


@dataclass(frozen=True, slots=True)
class DirTxn:
    """One Txn, as the etcd client's ``txn(compare, success, failure)`` takes it."""

    compare: tuple[Compare, ...]
    success: tuple[Op, ...]
    failure: tuple[Op, ...]


def register_ops(layout: Layout, host: HostEntry, lease_id: int) -> Put:
    """The put of a host's key under its lease (after each new lease)."""
    return Put(key=layout.host(host.host_id), value=host.encode(), lease=lease_id)


def claim_txn(layout: Layout, agent_id: str, entry: AgentEntry) -> DirTxn:
    """A new agent enters the fleet: write its entry if the key is absent."""
    key = layout.agent(agent_id)
    return DirTxn((Compare.create(key, 0),), (Put(key=key, value=entry.encode()),), (Range(key=key),))


def commit_txn(layout: Layout, agent_id: str, seen: KeyValue, target: str, epoch: int) -> DirTxn:
    """The point of no return: if the agent's key is as the source read it
    before its offer (``seen``) and the target's lease is alive, the target
    holds the agent at ``epoch``. The failure branch reads both keys."""
    key = layout.agent(agent_id)
    before = decode_agent(seen.value)
    if epoch <= before.epoch:
        raise ValueError(f"a move from epoch {before.epoch} must be to a higher epoch, not {epoch}")
    compare = (Compare.mod(key, seen.mod_revision), Compare.create(layout.host(target), 0, Result.GREATER))
    success = (Put(key=key, value=AgentEntry(host_id=target, epoch=epoch).encode()),)
    return DirTxn(compare, success, (Range(key=key), Range(key=layout.host(target))))


def fence_txn(layout: Layout, agent_id: str, current: KeyValue) -> DirTxn:
    """Rewrite the key's value as it is, if unchanged since ``current`` was
    read: its mod_revision moves, so no commit based on an earlier read can
    apply. The failure branch reads the key."""
    key = layout.agent(agent_id)
    return DirTxn((Compare.mod(key, current.mod_revision),), (Put(key=key, value=current.value),),
                  (Range(key=key),))


def takeover_txn(layout: Layout, agent_id: str, seen: KeyValue, new_holder: str, epoch: int) -> DirTxn:
    """Give the agent of a host whose lease expired to ``new_holder``."""
    key = layout.agent(agent_id)
    old = decode_agent(seen.value)
    if epoch <= old.epoch:
        raise ValueError(f"a takeover from epoch {old.epoch} must be to a higher epoch, not {epoch}")
    compare = (Compare.mod(key, seen.mod_revision), Compare.create(layout.host(old.host_id), 0))
    return DirTxn(compare, (Put(key=key, value=AgentEntry(host_id=new_holder, epoch=epoch).encode()),),
                  (Range(key=key),))


def may_run(kv: KeyValue | None, host_id: str, epoch: int) -> bool:
    """Does this read of an agent's key let ``host_id`` run it at ``epoch``
    (given the read was made while the host's lease was alive)?"""
    if kv is None:
        return False
    return decode_agent(kv.value).names(host_id, epoch)


# -- the directory answers the source's activate and status ---------------------------------


@dataclass(frozen=True, slots=True)
class Move:
    """What a judge knows of the move: its source and held epoch, its target and new epoch."""

    source: str
    held_epoch: int
    target: str
    epoch: int


def _entry_after(sent: DirTxn, result: TxnResult) -> AgentEntry | None:
    """The agent's entry once the Txn was applied: what its success branch
    wrote, or what its failure branch read."""
    if result.succeeded:
        put = sent.success[0]
        assert isinstance(put, Put)
        return decode_agent(put.value)
    first = result.responses[0] if result.responses else None
    if not isinstance(first, RangeResult):
        raise DirectoryError("a failed commit or fence must answer its read of the agent's key")
    return decode_agent(first.kvs[0].value) if first.kvs else None


def _target_holds(m: Move, _r: TxnResult, e: AgentEntry | None) -> bool:
    return e is not None and e.names(m.target, m.epoch)


def _succeeded(_m: Move, r: TxnResult, _e: AgentEntry | None) -> bool:
    return r.succeeded


def _anything(_m: Move, _r: TxnResult, _e: AgentEntry | None) -> bool:
    return True


@dataclass(frozen=True, slots=True)
class JudgeRow:
    txn: str  # "commit" (the source's activate) or "fence" (its status question)
    when: Callable[[Move, TxnResult, AgentEntry | None], bool]  # of the entry after the Txn
    outcome: Outcome
    why: str


JUDGE_TABLE: tuple[JudgeRow, ...] = (
    JudgeRow("commit", _target_holds, Outcome.ACTIVE, "the entry names the target at the new epoch"),
    JudgeRow("commit", _anything, Outcome.NEVER,
             "the entry changed since the move began (fenced, taken over) or the target's lease is gone"),
    JudgeRow("fence", _target_holds, Outcome.ACTIVE, "the commit applied (the fence rewrote or read its entry)"),
    JudgeRow("fence", _succeeded, Outcome.NEVER, "the entry was rewritten as it was: no commit can apply any more"),
    JudgeRow("fence", _anything, Outcome.NEVER,
             "the entry changed after the fence's read, so after the move began, and does not name the target"),
)


def judge(sent: DirTxn, txn: str, move: Move, result: TxnResult) -> tuple[Outcome, str]:
    """The outcome of a commit or fence Txn (``sent``) for ``move``, from its answer, and why."""
    entry = _entry_after(sent, result)
    for row in JUDGE_TABLE:
        if row.txn == txn and row.when(move, result, entry):
            return row.outcome, row.why
    raise ValueError(f"no judgement for a {txn!r} Txn")


def describe_judge_table() -> str:
    """The judge table as markdown (docs/fleet.md is generated from it)."""
    lines = ["| Txn | condition | outcome | why |", "|---|---|---|---|"]
    for row in JUDGE_TABLE:
        cond = row.when.__name__.lstrip("_").replace("_", " ")
        lines.append(f"| {row.txn} | {cond} | {row.outcome.value} | {row.why} |")
    return "\n".join(lines) + "\n"
