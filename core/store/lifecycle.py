"""An agent's lifecycle on this host: one table from what its holder record
says and what this host has learned about who else holds it, to what the
mount shows and whether the agent runs.

Rules:
  * A HELD record is what this host knew when it wrote it. A copy of the
    state directory restored from a backup, a VM rolled back, an import:
    each brings back a record that was true once. So a HELD record alone
    never runs an agent: it runs with *evidence* that no one holds a higher
    epoch (:class:`Evidence`); without it the agent is read-only ("in doubt").
  * Evidence is a peer's answer (its :class:`Claim` for the agent, which
    :func:`outranks` judges), or what this daemon did itself (created the
    agent, activated it in a move), or an operator's forced hold, or the one
    case that needs no peer: no peer is pinned and the manifest names this
    host at the held epoch (a host without peers never handed an agent on:
    a move needs a pinned peer). "No peer answered" is never evidence.
  * A peer's claim that outranks this host's hold (a higher epoch held or
    activated there) makes the agent STALE here at once, whatever else was
    learned: the driver stops it and records UNKNOWN.
  * One table, :data:`TABLE`, decides the view's state and the run state;
    docs/move.md shows it (generated, kept equal by a test). The daemon
    (capsulefs/daemon/agents.py) derives both from it alone, adding only
    that a move holds an agent still (:func:`shown`, :func:`runs`;
    docs/mount.md's table).

Theory of operation: the driver (capsulefs/move/standing.py) gathers peers'
claims in one batched ``holds`` call per peer, at start and periodically,
and answers theirs; it asks :func:`gather` for the evidence and
:func:`decide` for the decision, and carries the decision out.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..capsule.format import check_agent_id, check_int
from ..errors import FormatError
from ..view.nodes import AgentState
from .holder import HolderRecord, HolderState

__all__ = ["MAX_CLAIMS", "TABLE", "Claim", "Decision", "Evidence", "Standing", "claim_of", "claims_from_wire",
           "claims_to_wire", "decide", "describe_daemon_table", "describe_table", "gather", "outranks", "runs",
           "shown"]

#: Most claims one ``holds`` message may carry (a bound on a hostile peer's list).
MAX_CLAIMS = 100_000


@dataclass(frozen=True, slots=True, kw_only=True)
class Claim:
    """What one host says of one agent in a ``holds`` message."""

    agent_id: str  # 32 hex
    held: int | None  # the epoch it holds the agent at (HELD, FROZEN, COMMITTING); None if it does not
    top: int  # the highest epoch it knows activated: its own activations, and the epoch it handed over at
    named: bool = False  # its copy's manifest names it as the holder (false for an imported copy)

    def __post_init__(self) -> None:
        check_agent_id(self.agent_id)
        if self.held is not None:
            check_int(self.held, "held epoch", low=1)
        check_int(self.top, "top epoch")
        if not isinstance(self.named, bool):
            raise FormatError(f"claim of {self.agent_id}: 'named' must be true or false")


def claim_of(record: HolderRecord, *, named: bool) -> Claim:
    """This host's claim for an agent, from its record (``named``: the
    manifest of its copy names this host)."""
    top = max(record.activated, default=0)
    if record.state is HolderState.RETIRED:
        top = max(top, record.epoch)  # handed over at that epoch: the peer activated it
    return Claim(agent_id=record.agent_id, held=record.held_epoch, top=top, named=named)


def claims_to_wire(claims: list[Claim]) -> list[list[Any]]:
    return [[c.agent_id, c.held, c.top, c.named] for c in claims]


def claims_from_wire(value: object, what: str) -> dict[str, Claim]:
    """Parse a ``holds`` message's ``claims`` (hostile input): a list of at
    most :data:`MAX_CLAIMS` ``[agent_id, held epoch or null, top epoch,
    named]``, each agent once. FormatError naming the first problem."""
    if not isinstance(value, list):
        raise FormatError(f"{what}: claims must be a list")
    if len(value) > MAX_CLAIMS:
        raise FormatError(f"{what}: {len(value)} claims, at most {MAX_CLAIMS}")
    out: dict[str, Claim] = {}
    for i, item in enumerate(value):
        if not isinstance(item, list) or len(item) != 4:
            raise FormatError(f"{what}: claim {i} must be [agent_id, held, top, named]")
        agent_id, held, top, named = item
        if not isinstance(agent_id, str):
            raise FormatError(f"{what}: claim {i}: agent_id must be a string")
        try:
            claim = Claim(agent_id=agent_id, held=held, top=top, named=named)
        except FormatError as exc:
            raise FormatError(f"{what}: claim {i}: {exc}") from None
        if claim.agent_id in out:
            raise FormatError(f"{what}: agent {agent_id} claimed twice")
        out[claim.agent_id] = claim
    return out


def outranks(theirs: Claim | None, mine: HolderRecord, *, me: str, manifest_holder: str,
             manifest_epoch: int = 0) -> bool:
    """Does a peer's claim show that this host must not run the agent it
    holds (``mine``, a holding record)? A higher epoch held or activated
    there does. So does the same epoch held there, unless only this host's
    copy names its holder: an imported copy yields to the host it was
    copied from, and two copies that each name their own host at one epoch
    (a fork: a restored host moved the agent on) both yield, for an
    operator to settle.

    This host's epoch is the higher of its record's and its manifest's when
    the manifest names this host: files are installed here only at an
    activation, so a record older than them (``holders/`` rolled back alone)
    still holds the epoch they say."""
    if theirs is None or mine.held_epoch is None:
        return False
    e = max(mine.held_epoch, manifest_epoch if manifest_holder == me else 0)
    if theirs.top > e or (theirs.held or 0) > e:
        return True
    if theirs.held != e:
        return False
    return manifest_holder != me or theirs.named


class Evidence(enum.Enum):
    """What this host knows about whether someone else holds a higher epoch."""

    NONE = "none"  # not asked, no peer answered, or the manifest's holder is not a peer that answered
    CLEARED = "cleared"  # a peer answered (the manifest's holder, if another host) and none outranks us
    SOLE = "sole"  # no peer pinned and the manifest names this host at the held epoch
    FORCED = "forced"  # the record is a forced hold (move --force-hold --why)
    OWN = "own"  # this daemon created the agent or activated it in a move (a record it wrote)
    NEWER = "newer"  # a peer's claim outranks our hold: another host holds a higher epoch


def gather(record: HolderRecord, *, me: str, manifest_holder: str, manifest_epoch: int, peers: frozenset[str],
           answers: Mapping[str, Claim | None], own: bool = False) -> Evidence:
    """The evidence about a holding ``record``. ``answers``: peer host id ->
    its claim (None: it answered and has none), for the peers that answered
    since this daemon started; ``own``: this daemon wrote the hold itself."""
    if any(outranks(c, record, me=me, manifest_holder=manifest_holder, manifest_epoch=manifest_epoch)
           for c in answers.values()):
        return Evidence.NEWER
    if own:
        return Evidence.OWN
    if record.forced:
        return Evidence.FORCED
    if manifest_holder != me:
        # A copy of an agent another host held (an import): only that host can say it let go.
        return Evidence.CLEARED if manifest_holder in answers else Evidence.NONE
    if not peers:
        return Evidence.SOLE if record.held_epoch == manifest_epoch else Evidence.NONE
    return Evidence.CLEARED if answers else Evidence.NONE


class Standing(enum.Enum):
    """Where an agent stands on this host."""

    HOLDING = "holding"  # held, with evidence: shown writable, runs
    IN_DOUBT = "in doubt"  # held, no evidence yet: read-only, does not run, until a peer answers
    STALE = "stale"  # a peer holds a higher epoch: read-only, does not run; the record becomes UNKNOWN
    UNKNOWN = "unknown"  # record lost or damaged (or no record): read-only until --learn or --force-hold
    MOVING = "moving"  # a move of it is under way from here (FROZEN, COMMITTING): read-only
    ELSEWHERE = "elsewhere"  # retired, refused, or a move in not yet activated: not shown


@dataclass(frozen=True, slots=True)
class Decision:
    standing: Standing
    view: AgentState  # what the mount shows
    run: bool  # whether the supervisor may run it


_HOLD = Decision(Standing.HOLDING, AgentState.ACTIVE, True)
_DOUBT = Decision(Standing.IN_DOUBT, AgentState.FROZEN, False)
_STALE = Decision(Standing.STALE, AgentState.FROZEN, False)
_UNKNOWN = Decision(Standing.UNKNOWN, AgentState.FROZEN, False)
_MOVING = Decision(Standing.MOVING, AgentState.FROZEN, False)
_ELSEWHERE = Decision(Standing.ELSEWHERE, AgentState.RETIRED, False)

#: (holder state or None for no record, evidence or None for any) -> decision.
TABLE: dict[tuple[HolderState | None, Evidence | None], Decision] = {
    (None, None): _UNKNOWN,  # files without a record: the daemon records UNKNOWN
    (HolderState.UNKNOWN, None): _UNKNOWN,
    (HolderState.HELD, Evidence.NONE): _DOUBT,
    (HolderState.HELD, Evidence.CLEARED): _HOLD,
    (HolderState.HELD, Evidence.SOLE): _HOLD,
    (HolderState.HELD, Evidence.FORCED): _HOLD,
    (HolderState.HELD, Evidence.OWN): _HOLD,
    (HolderState.HELD, Evidence.NEWER): _STALE,
    (HolderState.FROZEN, None): _MOVING,
    (HolderState.COMMITTING, None): _MOVING,
    (HolderState.RETIRED, None): _ELSEWHERE,
    (HolderState.REFUSED, None): _ELSEWHERE,
    (HolderState.REMOVED, None): _ELSEWHERE,  # (removed here by an operator; a copy may be kept)
    (HolderState.OFFERED, None): _ELSEWHERE,
    (HolderState.VERIFIED, None): _ELSEWHERE,
    (HolderState.PREPARED, None): _ELSEWHERE,
}


def decide(record: HolderRecord | None, evidence: Evidence) -> Decision:
    state = None if record is None else record.state
    found = TABLE.get((state, evidence)) or TABLE.get((state, None))
    if found is None:
        raise KeyError(f"no lifecycle row for holder state {state} with evidence {evidence.value}")
    return found


def shown(decision: Decision, *, still: bool) -> AgentState:
    """What the mount shows of an agent: the decision's view, read-only while
    a move (or a doubt found while it was active) holds it still."""
    return AgentState.FROZEN if still and decision.view is AgentState.ACTIVE else decision.view


def runs(decision: Decision, *, still: bool) -> bool:
    """Whether the agent's process may run: the decision's, never while held still."""
    return decision.run and not still


def describe_daemon_table() -> str:
    """What the daemon derives for each standing (:func:`shown`, :func:`runs`),
    as markdown, for docs/mount.md."""
    rows = ["| standing | mount shows | runs | while a move holds it still: shows | runs |", "|---|---|---|---|---|"]
    yes = {True: "yes", False: "no"}
    seen: list[Decision] = []
    for d in TABLE.values():
        if d not in seen:
            seen.append(d)
            rows.append(f"| {d.standing.value} | {shown(d, still=False).value} | {yes[runs(d, still=False)]} | "
                        f"{shown(d, still=True).value} | {yes[runs(d, still=True)]} |")
    return "\n".join(rows)


def describe_table() -> str:
    """The table as markdown, for docs/move.md."""
    rows = ["| holder record | evidence | standing | mount shows | runs |", "|---|---|---|---|---|"]
    for (state, ev), d in TABLE.items():
        rows.append(f"| {'(none)' if state is None else state.value} | {'any' if ev is None else ev.value} | "
                    f"{d.standing.value} | {d.view.value} | {'yes' if d.run else 'no'} |")
    return "\n".join(rows)
