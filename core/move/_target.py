"""The target machine: judges each request against the durable record.

Rules: the target's state is its holder record (None: never seen the
agent). Every "never activate" answer is persisted before it is sent; a
pending move is the only thing a target ever refuses on its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..capsule.format import check_agent_id, check_host_id
from ..store.holder import HolderRecord, HolderState
from ..store.learning import PeerView
from ._messages import *  # noqa: F403
from ._messages import _Request

# ======================================================================================
# Target
# ======================================================================================


class TargetMachine:
    """Judges one request against this host's durable record of the agent.

    ``record`` is None when this host has never seen the agent. Build one
    per request (or per driver-reported result) from the current record;
    after :meth:`handle`, ``record`` is the record the commands persist.
    """

    def __init__(self, agent_id: str, record: HolderRecord | None, *, me: str) -> None:
        self.agent_id = check_agent_id(agent_id)
        self.me = check_host_id(me)
        if record is not None and record.agent_id != agent_id:
            raise MoveError(f"record of {record.agent_id} given for agent {agent_id}")
        self.record = record

    @property
    def state(self) -> HolderState | None:
        return None if self.record is None else self.record.state

    @property
    def highest(self) -> int:
        return 0 if self.record is None else self.record.epoch

    def handle(self, event: object) -> list[Command]:
        if getattr(event, "agent_id", self.agent_id) != self.agent_id:
            raise MoveError(f"target machine for {self.agent_id} got an event for {event.agent_id}")  # type: ignore[attr-defined]
        edges = TARGET_TABLE.get((self.state, type(event)))
        if edges is None:
            raise MoveProtocolError("target", self.state, event)
        for edge in edges:
            if edge.when(self, event):
                before = self.state
                commands = edge.do(self, event)
                for c in commands:
                    if isinstance(c, Persist):
                        self.record = c.record
                expected = before if edge.to is None else edge.to
                if self.state is not expected:
                    raise AssertionError(f"target table says {expected}, action gave {self.state}")
                return commands
        raise AssertionError(f"no guard held for {self.state} on {type(event).__name__}")

    # -- record helpers ----------------------------------------------------------
    def _current(self, ev: _Request) -> bool:
        """Is ``ev`` about the pending move recorded here, from its source?"""
        r = self.record
        return r is not None and r.pending and r.epoch == ev.epoch and r.peer == ev.source

    def _activated(self, epoch: int) -> bool:
        return self.record is not None and epoch in self.record.activated

    def _refuse(self, agent_id: str, epoch: int, source: str, why: str) -> list[Command]:
        """Record, durably, that ``epoch`` never activates here (if needed)."""
        r = self.record
        if r is not None and (r.holding or r.state is HolderState.UNKNOWN):
            raise AssertionError("a holder never refuses its own epochs")
        cmds: list[Command] = []
        if r is None or epoch > r.epoch:
            activated = () if r is None else r.activated
            new = HolderRecord(agent_id=agent_id, state=HolderState.REFUSED, epoch=epoch, peer=source,
                               activated=activated, note=why)
            cmds.append(Persist(record=new))
            if r is not None and r.pending:
                cmds.append(DiscardStaging(agent_id=agent_id, epoch=r.epoch))
        elif epoch == r.epoch and r.pending:
            cmds.append(Persist(record=r.with_(state=HolderState.REFUSED, note=why)))
            cmds.append(DiscardStaging(agent_id=agent_id, epoch=epoch))
        return cmds


# Guards and actions of the target. Each takes (machine, event).


def _t_fresh(m: TargetMachine, ev: _Request) -> bool:
    return ev.epoch > m.highest


def _t_current(m: TargetMachine, ev: _Request) -> bool:
    return m._current(ev)


def _t_accept(m: TargetMachine, ev: OfferReceived) -> list[Command]:
    r = m.record
    cmds: list[Command] = []
    if r is not None and r.pending:
        cmds.append(DiscardStaging(agent_id=ev.agent_id, epoch=r.epoch))
    if r is not None and r.state in (HolderState.RETIRED, HolderState.REFUSED, HolderState.REMOVED):
        cmds.append(DropAgentFiles(agent_id=ev.agent_id))
    new = HolderRecord(
        agent_id=ev.agent_id, state=HolderState.OFFERED, epoch=ev.epoch, peer=ev.source,
        activated=() if r is None else r.activated, note=f"offered by {ev.source}",
    )
    cmds.append(Persist(record=new))
    cmds.append(Reply(answer=OfferReply(agent_id=ev.agent_id, epoch=ev.epoch, accepted=True, missing=ev.missing)))
    return cmds


def _t_reaccept(m: TargetMachine, ev: OfferReceived) -> list[Command]:
    missing = ev.missing if m.state is HolderState.OFFERED else ()
    return [Reply(answer=OfferReply(agent_id=ev.agent_id, epoch=ev.epoch, accepted=True, missing=missing))]


def _t_refuse_offer(m: TargetMachine, ev: OfferReceived) -> list[Command]:
    r = m.record
    if r is not None and r.holding:
        why = f"this host holds the agent (epoch {r.held_epoch})"
    elif r is not None and r.state is HolderState.UNKNOWN:
        why = "this host lost its record of the agent and cannot fence it"
    else:
        why = f"epoch {ev.epoch} is not newer than {m.highest}, the highest seen here"
    held = r is not None and r.holding
    return [Reply(answer=OfferReply(agent_id=ev.agent_id, epoch=ev.epoch, accepted=False, highest=m.highest,
                                    held_there=held, reason=why))]


def _t_blob_ok(m: TargetMachine, ev: BlobReceived) -> list[Command]:
    if ev.intact:
        return [Reply(answer=BlobReply(agent_id=ev.agent_id, epoch=ev.epoch, sha=ev.sha, ok=True))]
    return [Reply(answer=BlobReply(agent_id=ev.agent_id, epoch=ev.epoch, sha=ev.sha, ok=False,
                                   reason="the piece did not arrive whole or does not match its digest"))]


def _t_blob_stale(m: TargetMachine, ev: BlobReceived) -> list[Command]:
    return [Reply(answer=BlobReply(agent_id=ev.agent_id, epoch=ev.epoch, sha=ev.sha, ok=False,
                                   reason=f"no move of epoch {ev.epoch} from {ev.source} is open here"))]


def _t_check(m: TargetMachine, ev: VerifyRequested) -> list[Command]:
    return [CheckBlobs(agent_id=ev.agent_id, epoch=ev.epoch)]


def _t_verified_again(m: TargetMachine, ev: _Request) -> list[Command]:
    return [Reply(answer=VerifyReply(agent_id=ev.agent_id, epoch=ev.epoch, ok=True))]


def _t_verify_stale(m: TargetMachine, ev: _Request) -> list[Command]:
    return [Reply(answer=VerifyReply(agent_id=ev.agent_id, epoch=ev.epoch, ok=False,
                                     reason=f"no offer of epoch {ev.epoch} awaits verification here"))]


def _t_no_bad(m: TargetMachine, ev: BlobsChecked) -> bool:
    return m._current(ev) and not ev.bad


def _t_verified(m: TargetMachine, ev: BlobsChecked) -> list[Command]:
    assert m.record is not None
    return [Persist(record=m.record.with_(state=HolderState.VERIFIED, note="every digest checked")),
            Reply(answer=VerifyReply(agent_id=ev.agent_id, epoch=ev.epoch, ok=True))]


def _t_verify_failed(m: TargetMachine, ev: BlobsChecked) -> list[Command]:
    why = f"{len(ev.bad)} digest(s) missing or corrupt"
    return m._refuse(ev.agent_id, ev.epoch, ev.source, why) + [
        Reply(answer=VerifyReply(agent_id=ev.agent_id, epoch=ev.epoch, ok=False, bad=ev.bad, reason=why))]


def _t_build(m: TargetMachine, ev: PrepareRequested) -> list[Command]:
    return [BuildStaging(agent_id=ev.agent_id, epoch=ev.epoch)]


def _t_prepared_again(m: TargetMachine, ev: _Request) -> list[Command]:
    return [Reply(answer=PrepareReply(agent_id=ev.agent_id, epoch=ev.epoch, ok=True))]


def _t_prepare_stale(m: TargetMachine, ev: _Request) -> list[Command]:
    return [Reply(answer=PrepareReply(agent_id=ev.agent_id, epoch=ev.epoch, ok=False,
                                      reason=f"no verified offer of epoch {ev.epoch} is here"))]


def _t_built_ok(m: TargetMachine, ev: StagingBuilt) -> bool:
    return m._current(ev) and ev.ok


def _t_prepared(m: TargetMachine, ev: StagingBuilt) -> list[Command]:
    assert m.record is not None
    return [Persist(record=m.record.with_(state=HolderState.PREPARED, note="staged; awaiting activate")),
            Reply(answer=PrepareReply(agent_id=ev.agent_id, epoch=ev.epoch, ok=True))]


def _t_prepare_failed(m: TargetMachine, ev: StagingBuilt) -> list[Command]:
    why = f"prepare failed: {ev.reason}"
    return m._refuse(ev.agent_id, ev.epoch, ev.source, why) + [
        Reply(answer=PrepareReply(agent_id=ev.agent_id, epoch=ev.epoch, ok=False, reason=why))]


def _t_was_activated(m: TargetMachine, ev: _Request) -> bool:
    return m._activated(ev.epoch)


def _t_prepared_current(m: TargetMachine, ev: _Request) -> bool:
    return m.state is HolderState.PREPARED and m._current(ev)


def _t_activate(m: TargetMachine, ev: ActivateRequested) -> list[Command]:
    r = m.record
    assert r is not None
    held = HolderRecord(
        agent_id=ev.agent_id, state=HolderState.HELD, epoch=ev.epoch, held_epoch=ev.epoch, peer=ev.source,
        activated=tuple(sorted(set(r.activated) | {ev.epoch})), note=f"moved here from {ev.source}",
    )
    return [Install(agent_id=ev.agent_id, epoch=ev.epoch), Persist(record=held),
            ActivateAgent(agent_id=ev.agent_id, epoch=ev.epoch),
            Reply(answer=ActivateReply(agent_id=ev.agent_id, epoch=ev.epoch, outcome=Outcome.ACTIVE))]


def _t_answer(outcome: Outcome, cls: type) -> Callable[[TargetMachine, _Request], list[Command]]:
    def answer(m: TargetMachine, ev: _Request) -> list[Command]:
        return [Reply(answer=cls(agent_id=ev.agent_id, epoch=ev.epoch, outcome=outcome))]

    answer.__name__ = f"_t_answer_{outcome.value}"
    return answer


def _t_never(cls: type) -> Callable[[TargetMachine, _Request], list[Command]]:
    def never(m: TargetMachine, ev: _Request) -> list[Command]:
        cmds = m._refuse(ev.agent_id, ev.epoch, ev.source, f"epoch {ev.epoch} will never activate here")
        return cmds + [Reply(answer=cls(agent_id=ev.agent_id, epoch=ev.epoch, outcome=Outcome.NEVER))]

    never.__name__ = "_t_record_never"
    return never


def _t_changes_record(m: TargetMachine, ev: _Request) -> bool:
    """Would refusing ``ev.epoch`` change the record (a new epoch, or the pending one)?"""
    r = m.record
    return r is None or ev.epoch > r.epoch or (ev.epoch == r.epoch and r.pending)


def _t_not_above_fence(m: TargetMachine, ev: _Request) -> bool:
    return ev.epoch <= m.highest


def _t_abort(m: TargetMachine, ev: AbortRequested) -> list[Command]:
    return m._refuse(ev.agent_id, ev.epoch, ev.source, f"aborted by {ev.source}") + [
        Reply(answer=AbortReply(agent_id=ev.agent_id, epoch=ev.epoch))]


def _t_abort_noop(m: TargetMachine, ev: AbortRequested) -> list[Command]:
    return [Reply(answer=AbortReply(agent_id=ev.agent_id, epoch=ev.epoch))]


def _t_view(m: TargetMachine, r: HolderRecord | None) -> PeerView:
    return PeerView(host=m.me, state=None if r is None else r.state, epoch=0 if r is None else r.epoch,
                    held_epoch=None if r is None else r.held_epoch, activated=() if r is None else r.activated)


def _t_fence_pending(m: TargetMachine, ev: FenceRequested) -> list[Command]:
    assert m.record is not None
    cmds = m._refuse(ev.agent_id, m.record.epoch, ev.source, f"fenced by {ev.source}, which is recovering")
    refused = [c.record for c in cmds if isinstance(c, Persist)][-1]
    return cmds + [Reply(answer=FenceReply(agent_id=ev.agent_id, view=_t_view(m, refused)))]


def _t_fence_view(m: TargetMachine, ev: FenceRequested) -> list[Command]:
    return [Reply(answer=FenceReply(agent_id=ev.agent_id, view=_t_view(m, m.record)))]


def _t_drop_pending(m: TargetMachine, ev: TargetRestarted | Expired) -> list[Command]:
    r = m.record
    assert r is not None and r.peer is not None
    why = "restarted before activation" if isinstance(ev, TargetRestarted) else "expired before activation"
    return m._refuse(ev.agent_id, r.epoch, r.peer, why) + [DropAgentFiles(agent_id=ev.agent_id)]


def _t_drop_leftovers(m: TargetMachine, ev: TargetRestarted) -> list[Command]:
    return [DropAgentFiles(agent_id=ev.agent_id)]


def _t_reactivate(m: TargetMachine, ev: TargetRestarted) -> list[Command]:
    r = m.record
    assert r is not None and r.held_epoch is not None
    return [ActivateAgent(agent_id=ev.agent_id, epoch=r.held_epoch)]


_H = HolderState
_NOT_HOLDING = (None, _H.RETIRED, _H.REFUSED, _H.REMOVED)  # may accept an offer above the fence
_PENDING = (_H.OFFERED, _H.VERIFIED, _H.PREPARED)
_HOLDING_OR_UNKNOWN = (_H.HELD, _H.FROZEN, _H.COMMITTING, _H.UNKNOWN)
_ALL: tuple[HolderState | None, ...] = (None, *HolderState)

TARGET_TABLE: dict[tuple[HolderState | None, type], tuple[Edge, ...]] = {}


def _row(states: Sequence[HolderState | None], event: type, *edges: Edge) -> None:
    for s in states:
        TARGET_TABLE[(s, event)] = edges


# offer: the fence
_row(_NOT_HOLDING, OfferReceived,
     Edge(_t_fresh, _H.OFFERED, _t_accept),
     Edge(always, None, _t_refuse_offer))
_row(_PENDING, OfferReceived,
     Edge(_t_current, None, _t_reaccept),
     Edge(_t_fresh, _H.OFFERED, _t_accept),
     Edge(always, None, _t_refuse_offer))
_row(_HOLDING_OR_UNKNOWN, OfferReceived, Edge(always, None, _t_refuse_offer))
# blobs
_row([_H.OFFERED], BlobReceived, Edge(_t_current, None, _t_blob_ok), Edge(always, None, _t_blob_stale))
_row([s for s in _ALL if s is not _H.OFFERED], BlobReceived, Edge(always, None, _t_blob_stale))
# verify
_row([_H.OFFERED], VerifyRequested, Edge(_t_current, None, _t_check), Edge(always, None, _t_verify_stale))
_row([_H.VERIFIED, _H.PREPARED], VerifyRequested,
     Edge(_t_current, None, _t_verified_again), Edge(always, None, _t_verify_stale))
_row([s for s in _ALL if s not in _PENDING], VerifyRequested, Edge(always, None, _t_verify_stale))
_row([_H.OFFERED], BlobsChecked,
     Edge(_t_no_bad, _H.VERIFIED, _t_verified),
     Edge(_t_current, _H.REFUSED, _t_verify_failed),
     Edge(always, None, _t_verify_stale))
_row([s for s in _ALL if s is not _H.OFFERED], BlobsChecked, Edge(always, None, _t_verify_stale))
# prepare
_row([_H.VERIFIED], PrepareRequested, Edge(_t_current, None, _t_build), Edge(always, None, _t_prepare_stale))
_row([_H.PREPARED], PrepareRequested, Edge(_t_current, None, _t_prepared_again), Edge(always, None, _t_prepare_stale))
_row([s for s in _ALL if s not in (_H.VERIFIED, _H.PREPARED)], PrepareRequested, Edge(always, None, _t_prepare_stale))
_row([_H.VERIFIED], StagingBuilt,
     Edge(_t_built_ok, _H.PREPARED, _t_prepared),
     Edge(_t_current, _H.REFUSED, _t_prepare_failed),
     Edge(always, None, _t_prepare_stale))
_row([s for s in _ALL if s is not _H.VERIFIED], StagingBuilt, Edge(always, None, _t_prepare_stale))
# activate and status: the ambiguous moment
for _event, _cls in ((ActivateRequested, ActivateReply), (StatusRequested, StatusReply)):
    _active = Edge(_t_was_activated, None, _t_answer(Outcome.ACTIVE, _cls))
    _never = _t_never(_cls)
    _row([_H.PREPARED] if _event is StatusRequested else [], _event, _active,
         Edge(_t_changes_record, _H.REFUSED, _never), Edge(always, None, _never))
    _row([_H.OFFERED, _H.VERIFIED], _event, _active,
         Edge(_t_changes_record, _H.REFUSED, _never), Edge(always, None, _never))
    _row(_NOT_HOLDING, _event, _active, Edge(_t_changes_record, _H.REFUSED, _never), Edge(always, None, _never))
    _row([_H.HELD, _H.FROZEN, _H.COMMITTING], _event, _active,
         Edge(_t_not_above_fence, None, _t_answer(Outcome.NEVER, _cls)),
         Edge(always, None, _t_answer(Outcome.UNKNOWN, _cls)))
    _row([_H.UNKNOWN], _event, Edge(always, None, _t_answer(Outcome.UNKNOWN, _cls)))
_row([_H.PREPARED], ActivateRequested,
     Edge(_t_was_activated, None, _t_answer(Outcome.ACTIVE, ActivateReply)),
     Edge(_t_prepared_current, _H.HELD, _t_activate),
     Edge(_t_changes_record, _H.REFUSED, _t_never(ActivateReply)),
     Edge(always, None, _t_never(ActivateReply)))
# abort: refuse the epoch durably (even one never offered, so a late offer is refused)
_row((*_NOT_HOLDING, *_PENDING), AbortRequested,
     Edge(_t_was_activated, None, _t_abort_noop),
     Edge(_t_changes_record, _H.REFUSED, _t_abort),
     Edge(always, None, _t_abort_noop))
_row(_HOLDING_OR_UNKNOWN, AbortRequested, Edge(always, None, _t_abort_noop))
# fence: a recovering peer asks; a pending move is refused before the answer
_row(_PENDING, FenceRequested, Edge(always, _H.REFUSED, _t_fence_pending))
_row([s for s in _ALL if s not in _PENDING], FenceRequested, Edge(always, None, _t_fence_view))
# restart and expiry: refusing a pending move is always safe
_row(_PENDING, TargetRestarted, Edge(always, _H.REFUSED, _t_drop_pending))
_row(_PENDING, Expired, Edge(always, _H.REFUSED, _t_drop_pending))
_row([_H.RETIRED, _H.REFUSED, _H.REMOVED], TargetRestarted, Edge(always, None, _t_drop_leftovers))
_row([_H.HELD], TargetRestarted, Edge(always, None, _t_reactivate))
_row([None, _H.FROZEN, _H.COMMITTING, _H.UNKNOWN], TargetRestarted, Edge(always, None, nothing))
_row([s for s in _ALL if s not in _PENDING], Expired, Edge(always, None, nothing))
