"""The source machine: one move of one agent from this host.

Rules: built from the host's holder record; fed only the reply to the
request it is waiting for (the driver correlates), or Timeout/IoFailure;
any unknown (state, event) pair raises and leaves it in ERROR.
"""

from __future__ import annotations

import enum
import logging
from typing import Any

from ..capsule.format import check_host_id
from ..store.holder import HolderRecord, HolderState
from ._messages import *  # noqa: F403
from ._messages import _Answer

log = logging.getLogger("capsulefs.core.move")

# ======================================================================================
# Source
# ======================================================================================


class SourceState(enum.Enum):
    IDLE = "idle"  # holds the agent (record HELD); no move in progress
    OFFERING = "offering"  # frozen, record FROZEN, offer sent
    TRANSFERRING = "transferring"  # sending what the target lacks
    VERIFYING = "verifying"
    PREPARING = "preparing"
    COMMITTING = "committing"  # record COMMITTING, activate sent: the point of no return
    IN_DOUBT = "in_doubt"  # activate's reply lost: asking status until a durable answer
    RESTARTED_FROZEN = "restarted_frozen"  # rebuilt from a FROZEN record after a crash
    RESTARTED_COMMITTING = "restarted_committing"  # rebuilt from a COMMITTING record
    DONE = "done"  # retired: the agent is active on the target
    ROLLED_BACK = "rolled_back"  # resumed at the old epoch
    STALE = "stale"  # learned that a newer epoch exists: record UNKNOWN, not resumed
    ABANDONED = "abandoned"  # an operator resumed the agent without an answer
    ERROR = "error"  # a protocol error; the durable record decides recovery


TERMINAL_SOURCE_STATES = frozenset(
    {SourceState.DONE, SourceState.ROLLED_BACK, SourceState.STALE, SourceState.ABANDONED, SourceState.ERROR}
)


class SourceMachine:
    """One move of one agent, from this host (``me``) to a target."""

    def __init__(self, record: HolderRecord, *, me: str) -> None:
        self.me = check_host_id(me)
        self.record = record
        self.pending: set[str] = set()
        match record.state:
            case HolderState.HELD:
                self.state = SourceState.IDLE
            case HolderState.FROZEN:
                self.state = SourceState.RESTARTED_FROZEN
            case HolderState.COMMITTING:
                self.state = SourceState.RESTARTED_COMMITTING
            case _:
                raise MoveError(
                    f"agent {record.agent_id} is {record.state.value} on this host, not held: it cannot move from here"
                    + (f" ({record.note})" if record.note else "")
                )

    @property
    def agent_id(self) -> str:
        return self.record.agent_id

    @property
    def epoch(self) -> int:
        """The epoch being moved to (meaningful once a move started)."""
        return self.record.epoch

    @property
    def target(self) -> str | None:
        return self.record.peer

    def handle(self, event: object) -> list[Command]:
        edges = SOURCE_TABLE.get((self.state, type(event)))
        if edges is None:
            bad_state = self.state
            self.state = SourceState.ERROR
            raise MoveProtocolError("source", bad_state, event)
        if isinstance(event, _Answer) and (event.agent_id, event.epoch) != (self.agent_id, self.epoch):
            self.state = SourceState.ERROR
            raise MoveError(
                f"source machine: reply for {event.agent_id} epoch {event.epoch} "
                f"while moving {self.agent_id} to epoch {self.epoch}"
            )
        for edge in edges:
            if edge.when(self, event):
                commands = edge.do(self, event)
                log.debug("source %s: %s --%s--> %s", self.agent_id, self.state.name, type(event).__name__, edge.to.name)
                self.state = edge.to
                for c in commands:
                    if isinstance(c, Persist):
                        self.record = c.record
                return commands
        raise AssertionError(f"no guard held for {self.state.name} on {type(event).__name__}")  # tables end in `always`

    # -- helpers -------------------------------------------------------------
    def _send(self, call: Call, sha: str | None = None) -> Send:
        assert self.record.peer is not None
        return Send(call=call, target=self.record.peer, agent_id=self.agent_id, epoch=self.epoch, sha=sha)

    def _held(self, *, highest: int, note: str) -> HolderRecord:
        r = self.record
        assert r.held_epoch is not None
        return HolderRecord(
            agent_id=r.agent_id, state=HolderState.HELD, epoch=max(r.epoch, highest),
            held_epoch=r.held_epoch, peer=r.peer, activated=r.activated, note=note,
        )


# Guards and actions of the source. Each takes (machine, event).


def _s_start(m: SourceMachine, ev: MoveRequested) -> list[Command]:
    if ev.target == m.me:
        raise MoveError(f"agent {m.agent_id}: cannot move to this host itself")
    r = m.record
    frozen = r.with_(state=HolderState.FROZEN, epoch=r.epoch + 1, peer=ev.target, note=f"moving to {ev.target}")
    # FROZEN is durable before the agent is frozen and its files read: a
    # writer outside the daemon (`capsulefs append`) checks the record under
    # the agent's files lock, and the snapshot reads the files under it, so
    # an event is either in the snapshot or refused, never left behind.
    return [Persist(record=frozen), Freeze(agent_id=m.agent_id), _send_after(frozen, Call.OFFER)]


def _send_after(record: HolderRecord, call: Call) -> Send:
    assert record.peer is not None
    return Send(call=call, target=record.peer, agent_id=record.agent_id, epoch=record.epoch)


def _s_accepted_with_missing(m: SourceMachine, ev: OfferReply) -> bool:
    return ev.accepted and bool(ev.missing)


def _s_accepted_complete(m: SourceMachine, ev: OfferReply) -> bool:
    return ev.accepted and not ev.missing


def _s_refused_newer(m: SourceMachine, ev: OfferReply) -> bool:
    """Refused by a host that holds the agent, or has seen an epoch this host never made."""
    return not ev.accepted and (ev.highest > m.epoch or ev.held_there)


def _s_send_missing(m: SourceMachine, ev: OfferReply) -> list[Command]:
    m.pending = set(ev.missing)
    return [m._send(Call.BLOB, sha) for sha in dict.fromkeys(ev.missing)]


def _s_send_verify(m: SourceMachine, _ev: object) -> list[Command]:
    return [m._send(Call.VERIFY)]


def _s_stale(m: SourceMachine, ev: OfferReply) -> list[Command]:
    r = m.record
    stale = HolderRecord(
        agent_id=r.agent_id, state=HolderState.UNKNOWN, epoch=max(r.epoch, ev.highest), peer=r.peer,
        activated=r.activated,
        note=(f"{r.peer} holds the agent itself" if ev.held_there else
              f"{r.peer} has seen epoch {ev.highest}, newer than any this host made") + ": another host may hold it",
    )
    return [Persist(record=stale)]


def _s_rollback(m: SourceMachine, ev: object) -> list[Command]:
    """Roll back without telling the target (it refused, or decided never)."""
    highest = ev.highest if isinstance(ev, OfferReply) else 0
    why = getattr(ev, "reason", "") or type(ev).__name__
    return [Persist(record=m._held(highest=highest, note=f"move to {m.target} rolled back: {why}")),
            Resume(agent_id=m.agent_id)]


def _s_rollback_abort(m: SourceMachine, ev: object) -> list[Command]:
    """Roll back, then tell the target to discard its staging (best effort)."""
    target_epoch = m.epoch
    cmds = _s_rollback(m, ev)
    assert m.record.peer is not None
    return cmds + [Send(call=Call.ABORT, target=m.record.peer, agent_id=m.agent_id, epoch=target_epoch)]


def _s_blob_ok_more(m: SourceMachine, ev: BlobReply) -> bool:
    return ev.ok and ev.sha in m.pending and len(m.pending) > 1


def _s_blob_ok_last(m: SourceMachine, ev: BlobReply) -> bool:
    return ev.ok and m.pending == {ev.sha}


def _s_blob_ok_dup(m: SourceMachine, ev: BlobReply) -> bool:
    return ev.ok and ev.sha not in m.pending


def _s_ack(m: SourceMachine, ev: BlobReply) -> list[Command]:
    m.pending.discard(ev.sha)
    return []


def _s_ack_last(m: SourceMachine, ev: BlobReply) -> list[Command]:
    m.pending.discard(ev.sha)
    return [m._send(Call.VERIFY)]


def _ok(_m: object, ev: Any) -> bool:
    return bool(ev.ok)


def _s_send_prepare(m: SourceMachine, _ev: object) -> list[Command]:
    return [m._send(Call.PREPARE)]


def _s_commit(m: SourceMachine, _ev: object) -> list[Command]:
    committing = m.record.with_(state=HolderState.COMMITTING, note=f"activate sent to {m.target}")
    return [Persist(record=committing), _send_after(committing, Call.ACTIVATE)]


def _is_active(_m: object, ev: Any) -> bool:
    return ev.outcome is Outcome.ACTIVE


def _is_never(_m: object, ev: Any) -> bool:
    return ev.outcome is Outcome.NEVER


def _s_retire(m: SourceMachine, _ev: object) -> list[Command]:
    r = m.record
    assert r.peer is not None
    retired = HolderRecord(
        agent_id=r.agent_id, state=HolderState.RETIRED, epoch=r.epoch, peer=r.peer,
        activated=r.activated, note=f"active on {r.peer} at epoch {r.epoch}",
    )
    return [Persist(record=retired), Retire(agent_id=r.agent_id, epoch=r.epoch, peer=r.peer)]


def _s_ask_status(m: SourceMachine, _ev: object) -> list[Command]:
    return [m._send(Call.STATUS)]


def _s_abandon(m: SourceMachine, ev: OperatorAbandon) -> list[Command]:
    log.warning(
        "agent %s: operator abandoned the in-doubt move to %s at epoch %d (%s); resuming here. "
        "If %s did activate it, two hosts now run the agent.",
        m.agent_id, m.target, m.epoch, ev.why, m.target,
    )
    # (an operator's word, as a forced hold: the daemon runs it without a peer's answer, the target
    # being unreachable, until a peer claims a higher epoch; core/store/lifecycle.py)
    held = m._held(highest=0, note=f"operator abandoned the move to {m.target}: {ev.why}").with_(forced=True)
    return [Persist(record=held), Resume(agent_id=m.agent_id)]


_S = SourceState
_PRE_COMMIT = (_S.OFFERING, _S.TRANSFERRING, _S.VERIFYING, _S.PREPARING)
_ROLLBACK_ABORT = (Edge(always, _S.ROLLED_BACK, _s_rollback_abort),)

SOURCE_TABLE: dict[tuple[SourceState, type], tuple[Edge, ...]] = {
    (_S.IDLE, MoveRequested): (Edge(always, _S.OFFERING, _s_start),),
    (_S.OFFERING, OfferReply): (
        Edge(_s_accepted_with_missing, _S.TRANSFERRING, _s_send_missing),
        Edge(_s_accepted_complete, _S.VERIFYING, _s_send_verify),
        Edge(_s_refused_newer, _S.STALE, _s_stale),
        Edge(always, _S.ROLLED_BACK, _s_rollback),
    ),
    (_S.TRANSFERRING, BlobReply): (
        Edge(_s_blob_ok_more, _S.TRANSFERRING, _s_ack),
        Edge(_s_blob_ok_last, _S.VERIFYING, _s_ack_last),
        Edge(_s_blob_ok_dup, _S.TRANSFERRING, nothing),
        Edge(always, _S.ROLLED_BACK, _s_rollback_abort),
    ),
    (_S.VERIFYING, VerifyReply): (
        Edge(_ok, _S.PREPARING, _s_send_prepare),
        Edge(always, _S.ROLLED_BACK, _s_rollback_abort),
    ),
    (_S.PREPARING, PrepareReply): (
        Edge(_ok, _S.COMMITTING, _s_commit),
        Edge(always, _S.ROLLED_BACK, _s_rollback_abort),
    ),
    (_S.COMMITTING, ActivateReply): (
        Edge(_is_active, _S.DONE, _s_retire),
        Edge(_is_never, _S.ROLLED_BACK, _s_rollback),
        Edge(always, _S.IN_DOUBT, _s_ask_status),
    ),
    (_S.COMMITTING, Timeout): (Edge(always, _S.IN_DOUBT, _s_ask_status),),
    (_S.COMMITTING, IoFailure): (Edge(always, _S.IN_DOUBT, _s_ask_status),),
    (_S.IN_DOUBT, StatusReply): (
        Edge(_is_active, _S.DONE, _s_retire),
        Edge(_is_never, _S.ROLLED_BACK, _s_rollback),
        Edge(always, _S.IN_DOUBT, _s_ask_status),
    ),
    (_S.IN_DOUBT, Timeout): (Edge(always, _S.IN_DOUBT, _s_ask_status),),
    (_S.IN_DOUBT, IoFailure): (Edge(always, _S.IN_DOUBT, _s_ask_status),),
    (_S.IN_DOUBT, OperatorAbandon): (Edge(always, _S.ABANDONED, _s_abandon),),
    (_S.RESTARTED_FROZEN, Restarted): (Edge(always, _S.ROLLED_BACK, _s_rollback_abort),),
    (_S.RESTARTED_COMMITTING, Restarted): (Edge(always, _S.IN_DOUBT, _s_ask_status),),
}
for _state in _PRE_COMMIT:
    for _ev in (Timeout, IoFailure, OperatorAbandon):
        SOURCE_TABLE[(_state, _ev)] = _ROLLBACK_ABORT
