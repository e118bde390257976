"""The sans-IO move machines and holder records, without any I/O."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from move_model import AGENT, BLOBS, World

from capsulefs.core import move as mv
from capsulefs.core.errors import FormatError
from capsulefs.core.store.holder import HolderBook, HolderRecord, HolderState, new_held, removed
from capsulefs.core.store.learning import PeerView, force_hold, learn_from_peers

A, B, C = "A" * 52, "B" * 52, "C" * 52
DOCS = Path(__file__).resolve().parents[2] / "docs" / "move.md"


def pump(w: World, until=lambda: False, limit: int = 100) -> None:
    for _ in range(limit):
        if until() or not w.net:
            return
        w.deliver(0)
        w.check()


def in_flight(w: World, call: mv.Call) -> int:
    return next(i for i, m in enumerate(w.net) if m.request is not None and m.request.call is call)


def state(w: World, host: str) -> HolderState | None:
    r = w.hosts[host].record
    return None if r is None else r.state


# -- tables and messages -------------------------------------------------------------


def test_unknown_pair_names_state_and_event_and_puts_the_source_in_error() -> None:
    m = mv.SourceMachine(new_held(AGENT, 1), me=A)
    with pytest.raises(mv.MoveProtocolError, match="state IDLE on event Timeout"):
        m.handle(mv.Timeout())
    assert m.state is mv.SourceState.ERROR
    with pytest.raises(mv.MoveProtocolError, match="state ERROR on event MoveRequested"):
        m.handle(mv.MoveRequested(target=B))


def test_unknown_target_pair_names_both() -> None:
    tm = mv.TargetMachine(AGENT, None, me=B)
    with pytest.raises(mv.MoveProtocolError, match="state ABSENT on event Timeout"):
        tm.handle(mv.Timeout())


def test_every_target_state_answers_every_request() -> None:
    requests = [mv.OfferReceived, mv.BlobReceived, mv.VerifyRequested, mv.BlobsChecked, mv.PrepareRequested,
                mv.StagingBuilt, mv.ActivateRequested, mv.StatusRequested, mv.AbortRequested, mv.FenceRequested,
                mv.TargetRestarted, mv.Expired]
    for s in (None, *HolderState):
        for r in requests:
            assert (s, r) in mv.TARGET_TABLE, (s, r)
            assert mv.TARGET_TABLE[(s, r)][-1].when is mv.always, f"{s} {r.__name__}: last edge must be unguarded"


@pytest.mark.parametrize(
    "make",
    [
        lambda: mv.OfferReply(agent_id=AGENT, epoch=0, accepted=True),
        lambda: mv.OfferReply(agent_id=AGENT, epoch=True, accepted=True),
        lambda: mv.OfferReply(agent_id=AGENT, epoch=2, accepted=True, missing=["x"]),
        lambda: mv.OfferReply(agent_id="nope", epoch=2, accepted=True),
        lambda: mv.BlobReply(agent_id=AGENT, epoch=2, sha="Z" * 64, ok=True),
        lambda: mv.OperatorAbandon(why="  "),
        lambda: mv.Send(call=mv.Call.BLOB, target=A, agent_id=AGENT, epoch=2),
        lambda: mv.Send(call=mv.Call.OFFER, target=A, agent_id=AGENT, epoch=2, sha=BLOBS[0]),
        lambda: mv.ActivateReply(agent_id=AGENT, epoch=2, outcome="active"),
        lambda: mv.OfferReceived(agent_id=AGENT, epoch=2, source="bad host!", missing=()),
    ],
)
def test_messages_validate_in_their_constructor(make) -> None:
    with pytest.raises(FormatError):
        make()


def test_messages_are_frozen_slotted_and_keyword_only() -> None:
    r = mv.StatusReply(agent_id=AGENT, epoch=2, outcome=mv.Outcome.NEVER)
    with pytest.raises(AttributeError):
        r.epoch = 3  # type: ignore[misc]
    assert not hasattr(r, "__dict__")
    with pytest.raises(TypeError):
        mv.StatusReply(AGENT, 2, mv.Outcome.NEVER)  # type: ignore[misc]


def test_docs_hold_the_generated_tables() -> None:
    text = DOCS.read_text(encoding="utf-8")
    assert mv.describe("source") in text
    assert mv.describe("target") in text


# -- moves ----------------------------------------------------------------------------------


def test_a_move_hands_the_agent_over() -> None:
    w = World((A, B), shared_blobs=1)
    w.start(A, B)
    assert not w.hosts[A].running  # frozen before anything is sent
    pump(w)
    assert state(w, A) is HolderState.RETIRED and state(w, B) is HolderState.HELD
    assert w.hosts[B].record.held_epoch == 2 and w.hosts[B].record.activated == (2,)
    assert w.hosts[B].blobs == set(BLOBS) and w.hosts[A].files_epoch is None
    assert not w.hosts[B].staging
    # and back again, at a higher epoch
    w.start(B, A)
    pump(w)
    assert state(w, A) is HolderState.HELD and w.hosts[A].record.held_epoch == 3


def test_lost_activate_reply_resolves_to_active() -> None:
    w = World((A, B), shared_blobs=3)
    w.start(A, B)
    pump(w, until=lambda: any(m.answer is not None and isinstance(m.answer, mv.ActivateReply) for m in w.net))
    w.net.clear()  # the reply to activate is lost
    assert state(w, B) is HolderState.HELD and state(w, A) is HolderState.COMMITTING
    w.timeout(A)
    assert w.hosts[A].source.state is mv.SourceState.IN_DOUBT
    pump(w)
    assert state(w, A) is HolderState.RETIRED


def test_lost_activate_request_resolves_to_never_and_a_replay_is_refused() -> None:
    w = World((A, B), shared_blobs=2)
    w.start(A, B)
    sent = []
    for _ in range(40):  # deliver in order, keeping a copy of every request
        if not w.net or w.net[0].request is not None and w.net[0].request.call is mv.Call.ACTIVATE:
            break
        if w.net[0].request is not None:
            sent.append(w.net[0])
        w.deliver(0)
    activate = w.net.pop(0)  # the activate request is delayed
    w.timeout(A)
    pump(w)
    assert state(w, A) is HolderState.HELD and w.hosts[A].running
    assert state(w, B) is HolderState.REFUSED and not w.hosts[B].staging
    # every request of the resolved attempt arrives again, then the activate
    for m in [*sent, activate, activate]:
        w.net.append(m)
        w.deliver(len(w.net) - 1)
        w.check()
    assert state(w, B) is HolderState.REFUSED
    # the next move uses a fresh epoch and succeeds
    w.net.clear()
    w.start(A, B)
    pump(w)
    assert state(w, B) is HolderState.HELD and w.hosts[B].record.held_epoch == 3


def test_repeated_activate_returns_the_recorded_outcome() -> None:
    w = World((A, B), shared_blobs=3)
    w.start(A, B)
    pump(w, until=lambda: w.net and w.net[0].request is not None and w.net[0].request.call is mv.Call.ACTIVATE)
    w.deliver(0, keep=True)
    w.deliver(0, keep=True)
    answers = [m.answer for m in w.net if m.answer is not None]
    assert [a.outcome for a in answers] == [mv.Outcome.ACTIVE, mv.Outcome.ACTIVE]


def test_unreachable_target_leaves_the_source_frozen_and_asking() -> None:
    w = World((A, B), shared_blobs=3)
    w.start(A, B)
    pump(w, until=lambda: w.net and w.net[0].request is not None and w.net[0].request.call is mv.Call.ACTIVATE)
    w.net.clear()
    for _ in range(20):  # no timer decides: every timeout only asks again
        w.timeout(A)
        assert [m.request.call for m in w.net] == [mv.Call.STATUS]
        w.net.clear()
        assert state(w, A) is HolderState.COMMITTING and not w.hosts[A].running
    w.check()


def test_operator_abandon_resumes_and_warns(caplog: pytest.LogCaptureFixture) -> None:
    w = World((A, B), shared_blobs=3)
    w.start(A, B)
    pump(w, until=lambda: w.net and w.net[0].request is not None and w.net[0].request.call is mv.Call.ACTIVATE)
    w.net.clear()
    w.timeout(A)
    with caplog.at_level(logging.WARNING):
        w.abandon(A)
    assert "two hosts now run the agent" in caplog.text
    assert w.hosts[A].running and "operator abandoned" in w.hosts[A].record.note


def test_corrupt_blob_rolls_back_and_cleans_the_target() -> None:
    w = World((A, B))
    w.start(A, B)
    w.corrupt_next_blob = True
    pump(w)
    assert w.hosts[A].running and w.hosts[A].record.held_epoch == 1 and w.hosts[A].record.epoch == 2
    assert state(w, B) is HolderState.REFUSED and not w.hosts[B].staging


def test_stale_epoch_from_a_partitioned_host_is_refused_and_the_host_stops() -> None:
    w = World((A, B, C), shared_blobs=3)
    w.start(A, B)
    pump(w)
    w.start(B, C)
    pump(w)
    assert state(w, C) is HolderState.HELD
    # A wakes up from an old backup believing it still holds epoch 1
    w.hosts[A].record = new_held(AGENT, 1)
    w.hosts[A].files_epoch = 1
    w.hosts[A].frozen = True  # it does not run before it has asked (the check below holds it to that)
    w.start(A, B)
    pump(w)
    assert state(w, A) is HolderState.UNKNOWN and "newer" in w.hosts[A].record.note
    assert state(w, B) is HolderState.RETIRED and state(w, C) is HolderState.HELD


def test_retry_after_rollback_never_reuses_an_epoch() -> None:
    w = World((A, B), shared_blobs=3)
    w.start(A, B)
    w.deliver(0)  # offer accepted
    w.timeout(A)  # its reply is lost: roll back, abort sent
    assert w.hosts[A].record.epoch == 2
    w.net.clear()  # the abort is lost too
    w.start(A, B)
    assert [m.request.epoch for m in w.net] == [3]
    pump(w)
    assert state(w, B) is HolderState.HELD and w.hosts[B].record.held_epoch == 3


def test_crash_of_the_source_before_commit_rolls_back() -> None:
    w = World((A, B), shared_blobs=3)
    w.start(A, B)
    pump(w, until=lambda: state(w, B) is HolderState.VERIFIED)
    w.crash(A)
    assert w.hosts[A].running
    pump(w)
    assert state(w, B) is HolderState.REFUSED and not w.hosts[B].staging


def test_crash_of_the_source_in_doubt_resumes_asking() -> None:
    w = World((A, B), shared_blobs=3)
    w.start(A, B)
    pump(w, until=lambda: state(w, A) is HolderState.COMMITTING)
    w.crash(A)
    assert w.hosts[A].source.state is mv.SourceState.IN_DOUBT
    pump(w)
    assert {state(w, A), state(w, B)} == {HolderState.RETIRED, HolderState.HELD} or (
        state(w, A) is HolderState.HELD and state(w, B) is HolderState.REFUSED)


def test_crash_of_a_prepared_target_refuses_the_pending_epoch() -> None:
    w = World((A, B), shared_blobs=3)
    w.start(A, B)
    pump(w, until=lambda: state(w, B) is HolderState.PREPARED)
    w.crash(B)
    assert state(w, B) is HolderState.REFUSED
    pump(w)
    assert w.hosts[A].running


def test_crash_losing_the_record_on_the_new_holder_then_learning() -> None:
    w = World((A, B), shared_blobs=3)
    w.start(A, B)
    pump(w)
    w.crash(B, lose_record=True)
    assert state(w, B) is HolderState.UNKNOWN and not w.hosts[B].running
    w.learn(B)  # A is RETIRED and activated only epoch 1: B holds epoch 2
    assert state(w, B) is HolderState.HELD and w.hosts[B].running


def test_crash_losing_the_record_while_a_peer_holds_retires() -> None:
    w = World((A, B), shared_blobs=3)
    w.hosts[B].files_epoch = 1  # leftover files from an old stay
    w.crash(B, lose_record=True)
    w.learn(B)
    assert state(w, B) is HolderState.RETIRED and w.hosts[B].files_epoch is None


def test_same_agent_id_on_both_sides_replaces_the_retired_copy() -> None:
    w = World((A, B), shared_blobs=3)
    w.start(A, B)
    pump(w)
    w.hosts[A].files_epoch = 2  # A kept a stale copy of the agent's files, same agent_id
    w.start(B, A)
    pump(w)
    assert state(w, A) is HolderState.HELD and w.hosts[A].files_epoch == 3


def test_an_offer_to_a_host_that_holds_the_same_agent_id_is_refused() -> None:
    w = World((A, B), shared_blobs=3)
    w.hosts[B].record = new_held(AGENT, 1)  # the same capsule imported twice, by mistake
    w.hosts[B].files_epoch = 1
    w.start(A, B)
    while w.net:
        w.deliver(0)  # no check: the world is already broken; the move must not make it worse
    # A learns that another host holds it: it stops, and waits to learn or be forced
    assert not w.hosts[A].running and state(w, A) is HolderState.UNKNOWN
    assert state(w, B) is HolderState.HELD and w.hosts[B].record.epoch == 1
    assert "holds the agent itself" in w.hosts[A].record.note


# -- holder records ---------------------------------------------------------------------


def test_record_round_trips_and_detects_corruption(tmp_path: Path) -> None:
    book = HolderBook(tmp_path)
    rec = HolderRecord(agent_id=AGENT, state=HolderState.COMMITTING, epoch=5, held_epoch=4, peer=B,
                       activated=(1, 4), note="activate sent")
    book.put(rec)
    assert book.get(AGENT) == rec
    path = tmp_path / f"{AGENT}.json"
    path.write_bytes(path.read_bytes().replace(b'"epoch": 5', b'"epoch": 6'))
    got = book.get(AGENT)
    assert got.state is HolderState.UNKNOWN and "check digest" in got.note and not got.runnable


def test_reconcile_marks_agents_without_a_record_unknown(tmp_path: Path) -> None:
    book = HolderBook(tmp_path)
    other = "b" * 32
    book.put(new_held(other, 3))
    out = book.reconcile([AGENT, other])
    assert [r.agent_id for r in out] == [AGENT]
    assert book.get(AGENT).state is HolderState.UNKNOWN


def test_reconcile_waits_for_a_new_agent_to_be_recorded(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`capsulefs new` and `import` hold the agent's files lock from its files
    to its record: a daemon starting meanwhile waits for the record instead
    of taking the new agent for one whose record was lost."""
    import threading

    book = HolderBook(tmp_path)
    locked, release = threading.Event(), threading.Event()

    def new_agent() -> None:  # files installed, record not yet written
        with book.files_lock(AGENT, shared=False):
            locked.set()
            release.wait(10)
            book.put(new_held(AGENT, 1))

    t = threading.Thread(target=new_agent)
    t.start()
    locked.wait(10)
    threading.Timer(0.3, release.set).start()
    try:
        assert book.reconcile([AGENT]) == []
    finally:
        release.set()
        t.join()
    assert book.get(AGENT).state is HolderState.HELD
    # One that holds the lock too long (a suspended import) is left for next time, not marked.
    with book.files_lock("c" * 32, shared=False), caplog.at_level(logging.WARNING):
        assert book.reconcile(["c" * 32], wait=0.1) == []
    assert book.get("c" * 32) is None and "left alone" in caplog.text


@pytest.mark.parametrize(
    "kw",
    [
        dict(state=HolderState.HELD, epoch=2),  # no held_epoch
        dict(state=HolderState.REFUSED, epoch=2, held_epoch=2),
        dict(state=HolderState.FROZEN, epoch=2, held_epoch=2, peer=B),  # move to the same epoch
        dict(state=HolderState.OFFERED, epoch=2),  # no peer
        dict(state=HolderState.HELD, epoch=2, held_epoch=2, activated=(3,)),
    ],
)
def test_inconsistent_records_are_rejected(kw) -> None:
    with pytest.raises(FormatError):
        HolderRecord(agent_id=AGENT, **kw)


def test_learning_needs_every_peer() -> None:
    rec = HolderRecord(agent_id=AGENT, state=HolderState.UNKNOWN, epoch=0)
    v = PeerView(host=B, state=HolderState.RETIRED, epoch=4, activated=(1,))
    assert learn_from_peers(rec, local_epoch=4, views={B: v}, peers=[B, C]) is rec
    held = learn_from_peers(rec, local_epoch=4, views={B: v}, peers=[B])
    assert held.state is HolderState.HELD and held.held_epoch == 4
    forced = force_hold(rec, local_epoch=4, why="disk replaced")
    assert forced.runnable and "forced by operator" in forced.note


def test_a_host_that_removed_the_agent_does_not_claim_it() -> None:
    """An agent exported from B, removed on B, imported on A: B's record no
    longer holds it, so A learns it may hold it (with B still HELD, A would
    have had to retire its copy or be forced)."""
    on_b = removed(new_held(AGENT, 3))
    assert not on_b.holding and not on_b.runnable and on_b.removed_here and on_b.epoch == 3
    view = PeerView(host=B, state=on_b.state, epoch=on_b.epoch, activated=on_b.activated)
    rec = HolderRecord(agent_id=AGENT, state=HolderState.UNKNOWN, epoch=0)
    learned = learn_from_peers(rec, local_epoch=3, views={B: view}, peers=[B])
    assert learned.state is HolderState.HELD and learned.held_epoch == 3
    still_held = PeerView(host=B, state=HolderState.HELD, epoch=3, held_epoch=3, activated=(3,))
    assert learn_from_peers(rec, local_epoch=3, views={B: still_held}, peers=[B]).state is HolderState.RETIRED


def test_removed_here_is_a_state_of_its_own_and_old_records_read_as_it() -> None:
    """'Removed here' is the state REMOVED, never a REFUSED record told apart
    by its note: a move refused here with the same words is still REFUSED.
    A record written before REMOVED existed (REFUSED, the old note) reads as
    REMOVED; a REMOVED record fences offers as REFUSED does."""
    import hashlib
    import json

    from capsulefs.core.store.holder import REMOVED_NOTE

    on_b = removed(new_held(AGENT, 3))
    assert on_b.state is HolderState.REMOVED and on_b.removed_here
    assert HolderRecord.from_bytes(on_b.to_bytes()) == on_b
    refused = HolderRecord(agent_id=AGENT, state=HolderState.REFUSED, epoch=3, note="peer said no")
    assert not refused.removed_here
    old = {"format": "holder/1", "agent_id": AGENT, "state": "refused", "epoch": 3, "held_epoch": None,
           "peer": None, "activated": [3], "note": REMOVED_NOTE}
    check = hashlib.sha256(json.dumps(old, sort_keys=True).encode()).hexdigest()
    parsed = HolderRecord.from_bytes(json.dumps({**old, "check": check}).encode())
    assert parsed.state is HolderState.REMOVED and parsed.removed_here and parsed.epoch == 3
    tm = mv.TargetMachine(AGENT, on_b, me=B)
    tm.handle(mv.OfferReceived(agent_id=AGENT, epoch=3, source=C, missing=()))
    assert tm.state is HolderState.REMOVED  # at the fence: refused
    tm.handle(mv.OfferReceived(agent_id=AGENT, epoch=4, source=C, missing=()))
    assert tm.state is HolderState.OFFERED  # above it: accepted, as after a refusal


def test_a_target_that_lost_its_record_after_activating_keeps_the_agent() -> None:
    """B activated the move to epoch 5 (its files say 5), the reply was lost
    (A is COMMITTING to 5), then B lost its record. Learning used to count
    A as the holder: B retired and dropped its files, A then heard "never"
    and resumed from its old snapshot, losing what B acknowledged while it
    ran. B holds it now, and answers A's status question "active"."""
    rec = HolderRecord(agent_id=AGENT, state=HolderState.UNKNOWN, epoch=0, note="holder record lost")
    a = PeerView(host=B, state=HolderState.COMMITTING, epoch=5, held_epoch=4, activated=(4,))
    learned = learn_from_peers(rec, local_epoch=5, views={B: a}, peers=[B])
    assert learned.state is HolderState.HELD and learned.held_epoch == 5 and 5 in learned.activated
    # Files of an older epoch (B was not that move's target): A still counts as the holder.
    assert learn_from_peers(rec, local_epoch=3, views={B: a}, peers=[B]).state is HolderState.RETIRED


@pytest.mark.parametrize("kept", ["/etc/passwd", "recovery/../../etc", "agents/x", "recovery/a\x00b", "r" * 600])
def test_a_kept_path_outside_recovery_is_refused(kept: str) -> None:
    """The record's kept copy is a path under the state directory's recovery/
    that ls opens: anything else in a record is a FormatError, never followed."""
    import hashlib
    import json

    body = removed(new_held(AGENT, 1)).body()
    body["kept"] = kept
    check = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    with pytest.raises(FormatError):
        HolderRecord.from_bytes(json.dumps({**body, "check": check}).encode())
