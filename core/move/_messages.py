"""Events, commands, errors and the table types of the move protocol.

Rules: every class here is frozen, slotted and keyword-only, and checks its
fields in its constructor, so a malformed message never reaches a machine.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Union

from ..errors import CapsuleError, FormatError
from ..capsule.format import check_agent_id, check_host_id, check_int, check_sha256
from ..store.holder import HolderRecord
from ..store.learning import PeerView

__all__ = [
    "MoveError",
    "MoveProtocolError",
    "Call",
    "Outcome",
    "MoveRequested",
    "Timeout",
    "IoFailure",
    "Restarted",
    "OperatorAbandon",
    "OfferReply",
    "BlobReply",
    "VerifyReply",
    "PrepareReply",
    "ActivateReply",
    "StatusReply",
    "AbortReply",
    "FenceReply",
    "Persist",
    "Freeze",
    "Resume",
    "Retire",
    "Send",
    "Reply",
    "DiscardStaging",
    "CheckBlobs",
    "BuildStaging",
    "Install",
    "ActivateAgent",
    "DropAgentFiles",
    "OfferReceived",
    "BlobReceived",
    "VerifyRequested",
    "BlobsChecked",
    "PrepareRequested",
    "StagingBuilt",
    "ActivateRequested",
    "StatusRequested",
    "AbortRequested",
    "FenceRequested",
    "TargetRestarted",
    "Expired",
    "Edge",
    "TargetAnswer",
    "Command",
    "always",
    "nothing",
]



class MoveError(CapsuleError):
    """A move cannot start or cannot go on (the message says why)."""


class MoveProtocolError(MoveError):
    """An event arrived in a state that has no transition for it."""

    def __init__(self, machine: str, state: object, event: object) -> None:
        self.state = state
        self.event = event
        name = state.name if isinstance(state, enum.Enum) else "ABSENT"
        super().__init__(f"{machine} machine: no transition from state {name} on event {type(event).__name__}")


class Call(enum.Enum):
    """The named calls a source makes to a target (see docs/wire.md)."""

    OFFER = "offer"
    BLOB = "blob"
    VERIFY = "verify"
    PREPARE = "prepare"
    ACTIVATE = "activate"
    STATUS = "status"
    ABORT = "abort"
    FENCE = "fence"


class Outcome(enum.Enum):
    """A target's durable answer about one epoch."""

    ACTIVE = "active"  # the epoch activated here (now or earlier)
    NEVER = "never"  # recorded: the epoch will never activate here
    UNKNOWN = "unknown"  # this host lost its record: ask again later


# -- validation helpers --------------------------------------------------------


def _epoch(value: object, what: str = "epoch") -> int:
    return check_int(value, what, low=1)


def _shas(values: object, what: str) -> tuple[str, ...]:
    if not isinstance(values, tuple):
        raise FormatError(f"{what} must be a tuple of sha256s, not {type(values).__name__}")
    for v in values:
        check_sha256(v, what)
    return values


def _text(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise FormatError(f"{what} must be a string")
    return value


def _flag(value: object, what: str) -> bool:
    if not isinstance(value, bool):
        raise FormatError(f"{what} must be a bool")
    return value


# -- source events: what the source's driver observed ----------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class MoveRequested:
    target: str  # host id of the target

    def __post_init__(self) -> None:
        check_host_id(self.target)


@dataclass(frozen=True, slots=True, kw_only=True)
class Timeout:
    """The outstanding request got no reply in time (pacing only, not safety)."""

    reason: str = ""  # which call, how long: "blobs got no answer from b within 120s"


@dataclass(frozen=True, slots=True, kw_only=True)
class IoFailure:
    reason: str  # what broke: "connection reset", "peer refused TLS", ...

    def __post_init__(self) -> None:
        _text(self.reason, "io failure reason")


@dataclass(frozen=True, slots=True, kw_only=True)
class Restarted:
    """The machine was rebuilt from the durable record after a crash."""


@dataclass(frozen=True, slots=True, kw_only=True)
class OperatorAbandon:
    why: str  # the operator's stated reason, logged

    def __post_init__(self) -> None:
        if not _text(self.why, "abandon reason").strip():
            raise FormatError("an abandon must say why")


@dataclass(frozen=True, slots=True, kw_only=True)
class _Answer:
    agent_id: str
    epoch: int

    def __post_init__(self) -> None:
        check_agent_id(self.agent_id)
        _epoch(self.epoch)


@dataclass(frozen=True, slots=True, kw_only=True)
class OfferReply(_Answer):
    accepted: bool
    missing: tuple[str, ...] = ()  # content digests the target lacks (blobs and capsule files)
    highest: int = 0  # on refusal: the highest epoch the target has seen
    held_there: bool = False  # on refusal: the target itself holds the agent
    reason: str = ""

    def __post_init__(self) -> None:
        super(OfferReply, self).__post_init__()
        _flag(self.accepted, "accepted")
        _flag(self.held_there, "held_there")
        _shas(self.missing, "missing")
        check_int(self.highest, "highest epoch")
        _text(self.reason, "reason")


@dataclass(frozen=True, slots=True, kw_only=True)
class BlobReply(_Answer):
    sha: str
    ok: bool
    reason: str = ""

    def __post_init__(self) -> None:
        super(BlobReply, self).__post_init__()
        check_sha256(self.sha, "blob")
        _flag(self.ok, "ok")
        _text(self.reason, "reason")


@dataclass(frozen=True, slots=True, kw_only=True)
class VerifyReply(_Answer):
    ok: bool
    bad: tuple[str, ...] = ()  # digests missing or corrupt on the target
    reason: str = ""

    def __post_init__(self) -> None:
        super(VerifyReply, self).__post_init__()
        _flag(self.ok, "ok")
        _shas(self.bad, "bad")
        _text(self.reason, "reason")


@dataclass(frozen=True, slots=True, kw_only=True)
class PrepareReply(_Answer):
    ok: bool
    reason: str = ""

    def __post_init__(self) -> None:
        super(PrepareReply, self).__post_init__()
        _flag(self.ok, "ok")
        _text(self.reason, "reason")


@dataclass(frozen=True, slots=True, kw_only=True)
class ActivateReply(_Answer):
    outcome: Outcome

    def __post_init__(self) -> None:
        super(ActivateReply, self).__post_init__()
        if not isinstance(self.outcome, Outcome):
            raise FormatError(f"outcome {self.outcome!r} is not an Outcome")


@dataclass(frozen=True, slots=True, kw_only=True)
class StatusReply(_Answer):
    outcome: Outcome

    def __post_init__(self) -> None:
        super(StatusReply, self).__post_init__()
        if not isinstance(self.outcome, Outcome):
            raise FormatError(f"outcome {self.outcome!r} is not an Outcome")


@dataclass(frozen=True, slots=True, kw_only=True)
class AbortReply(_Answer):
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class FenceReply:
    agent_id: str
    view: PeerView

    def __post_init__(self) -> None:
        check_agent_id(self.agent_id)
        if not isinstance(self.view, PeerView):
            raise FormatError("fence reply needs a PeerView")


# -- commands ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Persist:
    """Write this holder record durably before running the next command."""

    record: HolderRecord


@dataclass(frozen=True, slots=True, kw_only=True)
class Freeze:
    agent_id: str  # stop the agent and flush its files; nothing may change until Resume/Retire


@dataclass(frozen=True, slots=True, kw_only=True)
class Resume:
    agent_id: str  # the move rolled back: run the agent again at its old epoch


@dataclass(frozen=True, slots=True, kw_only=True)
class Retire:
    agent_id: str  # the agent is active elsewhere: stop showing it and drop its files
    epoch: int  # the epoch it is active at, on ``peer``
    peer: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Send:
    """Make the named call on the target; report its reply (or Timeout/IoFailure)."""

    call: Call
    target: str
    agent_id: str
    epoch: int
    sha: str | None = None  # the content to send, for Call.BLOB

    def __post_init__(self) -> None:
        if not isinstance(self.call, Call):
            raise FormatError(f"call {self.call!r} is not a Call")
        check_host_id(self.target)
        check_agent_id(self.agent_id)
        _epoch(self.epoch)
        if (self.sha is not None) != (self.call is Call.BLOB):
            raise FormatError("sha is given for, and only for, a blob call")
        if self.sha is not None:
            check_sha256(self.sha, "blob")


# Target commands.
@dataclass(frozen=True, slots=True, kw_only=True)
class Reply:
    answer: "TargetAnswer"


@dataclass(frozen=True, slots=True, kw_only=True)
class DiscardStaging:
    agent_id: str  # remove the staging area of this (agent, epoch), if any
    epoch: int


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckBlobs:
    agent_id: str  # check every digest of the offer; report BlobsChecked
    epoch: int


@dataclass(frozen=True, slots=True, kw_only=True)
class BuildStaging:
    agent_id: str  # assemble the capsule and its sandbox in staging; report StagingBuilt
    epoch: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Install:
    agent_id: str  # move the staged capsule into the store, holder = this host at epoch
    epoch: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ActivateAgent:
    agent_id: str  # the record is HELD: show and run the agent
    epoch: int


@dataclass(frozen=True, slots=True, kw_only=True)
class DropAgentFiles:
    agent_id: str  # the record says this host does not hold it: remove leftover files


TargetAnswer = Union[
    OfferReply, BlobReply, VerifyReply, PrepareReply, ActivateReply, StatusReply, AbortReply, FenceReply
]
Command = Union[
    Persist, Freeze, Resume, Retire, Send, Reply, DiscardStaging, CheckBlobs, BuildStaging, Install,
    ActivateAgent, DropAgentFiles,
]


# -- target events: requests as the target's driver received them -----------------


@dataclass(frozen=True, slots=True, kw_only=True)
class _Request:
    agent_id: str
    epoch: int
    source: str  # host id of the caller, from its authenticated certificate

    def __post_init__(self) -> None:
        check_agent_id(self.agent_id)
        _epoch(self.epoch)
        check_host_id(self.source)


@dataclass(frozen=True, slots=True, kw_only=True)
class OfferReceived(_Request):
    missing: tuple[str, ...]  # digests of the offered capsule this host lacks

    def __post_init__(self) -> None:
        super(OfferReceived, self).__post_init__()
        _shas(self.missing, "missing")


@dataclass(frozen=True, slots=True, kw_only=True)
class BlobReceived(_Request):
    sha: str
    intact: bool  # it arrived whole and was kept (a driver may judge its digest now or at verify)

    def __post_init__(self) -> None:
        super(BlobReceived, self).__post_init__()
        check_sha256(self.sha, "blob")
        _flag(self.intact, "intact")


@dataclass(frozen=True, slots=True, kw_only=True)
class VerifyRequested(_Request):
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class BlobsChecked(_Request):
    bad: tuple[str, ...]  # digests found missing or corrupt

    def __post_init__(self) -> None:
        super(BlobsChecked, self).__post_init__()
        _shas(self.bad, "bad")


@dataclass(frozen=True, slots=True, kw_only=True)
class PrepareRequested(_Request):
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class StagingBuilt(_Request):
    ok: bool
    reason: str = ""

    def __post_init__(self) -> None:
        super(StagingBuilt, self).__post_init__()
        _flag(self.ok, "ok")
        _text(self.reason, "reason")


@dataclass(frozen=True, slots=True, kw_only=True)
class ActivateRequested(_Request):
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class StatusRequested(_Request):
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class AbortRequested(_Request):
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class FenceRequested:
    agent_id: str
    source: str

    def __post_init__(self) -> None:
        check_agent_id(self.agent_id)
        check_host_id(self.source)


@dataclass(frozen=True, slots=True, kw_only=True)
class TargetRestarted:
    agent_id: str

    def __post_init__(self) -> None:
        check_agent_id(self.agent_id)


@dataclass(frozen=True, slots=True, kw_only=True)
class Expired:
    """A pending move sat idle too long (liveness only: refusing is always safe)."""

    agent_id: str

    def __post_init__(self) -> None:
        check_agent_id(self.agent_id)


# -- the table machinery -----------------------------------------------------------------


def always(_m: Any, _ev: Any) -> bool:
    return True


def nothing(_m: Any, _ev: Any) -> list[Any]:
    return []


@dataclass(frozen=True, slots=True)
class Edge:
    when: Callable[[Any, Any], bool]  # guard, tried in table order
    to: Any  # the state after the action (None: unchanged, for the target)
    do: Callable[[Any, Any], list[Any]]  # action: returns the commands
