"""An agent's lifecycle on one host (core/store/lifecycle.py): from its holder
record and the evidence about who else holds it, what the mount shows and
whether the agent runs; and the ``holds`` claims peers exchange."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from capsulefs.core.errors import FormatError
from capsulefs.core.store.holder import HolderRecord, HolderState, new_held
from capsulefs.core.store.learning import force_hold

AGENT = "a" * 32


def test_a_forced_hold_is_recorded_and_read_back() -> None:
    rec = force_hold(HolderRecord(agent_id=AGENT, state=HolderState.UNKNOWN, epoch=0), local_epoch=1, why="restored")
    assert rec.forced and rec.runnable
    assert HolderRecord.from_bytes(rec.to_bytes()) == rec
    plain = new_held(AGENT, 1)
    assert b"forced" not in plain.to_bytes()  # records from before the field read and write the same
    assert not HolderRecord.from_bytes(plain.to_bytes()).forced
    frozen = rec.with_(state=HolderState.FROZEN, epoch=2, peer="B" * 52)
    assert not frozen.forced  # the force ends with the hold
    with pytest.raises(FormatError):
        HolderRecord(agent_id=AGENT, state=HolderState.RETIRED, epoch=2, peer="B" * 52, forced=True)


# -- the lifecycle's decisions -----------------------------------------------------------

from capsulefs.core.store import lifecycle as lc  # noqa: E402
from capsulefs.core.view.nodes import AgentState  # noqa: E402

if TYPE_CHECKING:
    from move_model import World

ME, B, C = "A" * 52, "B" * 52, "C" * 52


def held(epoch: int = 1, **kw: object) -> HolderRecord:
    return new_held(AGENT, epoch).with_(**kw)


def gather(rec: HolderRecord, *, holder: str = ME, epoch: int = 1, peers: tuple[str, ...] = (B,),
           answers: dict[str, lc.Claim | None] | None = None, own: bool = False) -> lc.Evidence:
    return lc.gather(rec, me=ME, manifest_holder=holder, manifest_epoch=epoch, peers=frozenset(peers),
                     answers=answers or {}, own=own)


def claim(held: int | None, top: int, named: bool = False) -> lc.Claim:
    return lc.Claim(agent_id=AGENT, held=held, top=top, named=named)


def test_no_peer_answered_is_never_evidence() -> None:
    assert gather(held()) is lc.Evidence.NONE
    assert lc.decide(held(), lc.Evidence.NONE) == lc.Decision(lc.Standing.IN_DOUBT, AgentState.FROZEN, False)


def test_a_host_without_peers_runs_what_its_manifest_says_it_holds() -> None:
    """A capsule created here and never moved (a move needs a pinned peer)."""
    assert gather(held(), peers=()) is lc.Evidence.SOLE
    assert gather(held(2), peers=(), epoch=1) is lc.Evidence.NONE  # records and manifest disagree
    assert gather(held(), peers=(), holder=B) is lc.Evidence.NONE  # an import of B's copy: B cannot be asked


def test_an_imported_copy_waits_for_the_host_its_manifest_names() -> None:
    assert gather(held(), holder=C, answers={B: None}) is lc.Evidence.NONE  # C is not a peer, or has not answered
    assert gather(held(), holder=B, answers={B: None}) is lc.Evidence.CLEARED  # B let it go
    assert gather(held(), holder=B, answers={B: claim(1, 1)}) is lc.Evidence.NEWER  # B still holds that epoch
    assert gather(held(), holder=B, answers={C: None}, peers=(B, C)) is lc.Evidence.NONE


def test_one_peer_answering_clears_and_any_higher_epoch_makes_it_stale() -> None:
    assert gather(held(), answers={B: None}) is lc.Evidence.CLEARED
    assert gather(held(), answers={B: claim(None, 1)}) is lc.Evidence.CLEARED  # B once held epoch 1, and gave it up
    assert gather(held(), answers={B: claim(2, 2)}) is lc.Evidence.NEWER  # B holds epoch 2
    assert gather(held(), answers={B: claim(None, 3)}) is lc.Evidence.NEWER  # B activated 2 and handed on at 3
    assert gather(held(), answers={B: claim(1, 1)}) is lc.Evidence.CLEARED  # the same epoch, B's an imported copy
    assert gather(held(), answers={B: claim(1, 1, named=True)}) is lc.Evidence.NEWER  # a fork: both yield
    # the newer claim wins over everything else this host knows
    forced = force_hold(HolderRecord(agent_id=AGENT, state=HolderState.UNKNOWN, epoch=0), local_epoch=1, why="x")
    assert gather(forced, answers={B: claim(2, 2)}, own=True) is lc.Evidence.NEWER
    assert gather(forced) is lc.Evidence.FORCED and gather(held(), own=True) is lc.Evidence.OWN
    assert lc.decide(held(), lc.Evidence.NEWER).standing is lc.Standing.STALE


def test_a_record_older_than_the_files_holds_the_epoch_they_say() -> None:
    """holders/ rolled back alone, on the host that holds the agent: moved
    here at epoch 3 (the manifest says so), the record says 1; B handed it
    back at 3. Not stale."""
    assert gather(held(1), epoch=3, answers={B: claim(None, 3)}) is lc.Evidence.CLEARED
    assert gather(held(1), epoch=3, answers={B: claim(4, 4)}) is lc.Evidence.NEWER
    assert gather(held(1), epoch=3, holder=B, answers={B: claim(None, 3)}) is lc.Evidence.NEWER  # not our files


def test_claims_say_what_a_record_holds_and_handed_on() -> None:
    assert lc.claim_of(held(3, activated=(1, 3)), named=True) == claim(3, 3, named=True)
    retired = HolderRecord(agent_id=AGENT, state=HolderState.RETIRED, epoch=4, peer=B, activated=(1,))
    assert lc.claim_of(retired, named=False) == claim(None, 4)
    moving = held(1).with_(state=HolderState.COMMITTING, epoch=2, peer=B)
    assert lc.claim_of(moving, named=True) == claim(1, 1, named=True)


@pytest.mark.parametrize("bad", [
    None, {}, [["a" * 32, 1, 1]], [["a" * 32, 1, 1, True, 1]], [["A" * 32, 1, 1, True]], [["a" * 32, 0, 1, True]],
    [["a" * 32, True, 1, True]], [["a" * 32, 1, -1, True]], [["a" * 32, 1, 2 ** 64, True]], [[1, 1, 1, True]],
    [["a" * 32, "1", 1, True]], [["a" * 32, 1, 1, 1]], [["a" * 32, 1, 1, True], ["a" * 32, 2, 2, False]],
    [["%02x" % (i % 256) * 16, None, 1, False] for i in range(lc.MAX_CLAIMS + 1)],
])
def test_hostile_claims_are_refused_naming_the_problem(bad: object) -> None:
    with pytest.raises(FormatError) as err:
        lc.claims_from_wire(bad, "holds from b")
    assert str(err.value).startswith("holds from b: ")  # one line, naming the message and the problem


def test_every_holder_state_has_a_decision() -> None:
    for state in [None, *HolderState]:
        for ev in lc.Evidence:
            rec = None if state is None else HolderRecord(
                agent_id=AGENT, state=state, epoch=2, peer=B,
                held_epoch=1 if state in (HolderState.HELD, HolderState.FROZEN, HolderState.COMMITTING) else None)
            d = lc.decide(rec, ev)
            assert d.run == (d.view is AgentState.ACTIVE) == (d.standing is lc.Standing.HOLDING)
            assert d.run == (state is HolderState.HELD and ev not in (lc.Evidence.NONE, lc.Evidence.NEWER))


def test_the_docs_show_the_table() -> None:
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "move.md").read_text()
    assert lc.describe_table() in doc


def test_the_docs_show_what_the_daemon_derives() -> None:
    """docs/mount.md's table of what the daemon's lifecycle owner
    (capsulefs/daemon/agents.py) shows and runs for each standing, generated
    from the same functions it calls."""
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "mount.md").read_text()
    assert lc.describe_daemon_table() in doc


def test_the_daemon_runs_only_what_it_shows_active() -> None:
    """Whatever the decision, an agent runs only if the mount shows it active,
    and never while a move holds it still."""
    for d in lc.TABLE.values():
        for still in (False, True):
            assert not lc.runs(d, still=still) or lc.shown(d, still=still) is AgentState.ACTIVE
            assert lc.shown(d, still=still) is not AgentState.ACTIVE or lc.runs(d, still=still)


# -- the same rules over the move machines (tests/move_model.py) ----------------------------


def _settle(w: "World") -> None:
    while w.net:
        w.deliver(0)
        w.check()


def _shown(w: "World") -> dict[str, tuple[HolderState | None, bool]]:
    return {n[:1]: (h.record.state if h.record else None, w.running(h)) for n, h in w.hosts.items()}


def test_a_restored_host_is_stopped_by_the_first_exchange_with_the_holder() -> None:
    from move_model import World

    w = World((ME, B, C), shared_blobs=2)
    w.start(ME, B)
    _settle(w)
    w.restore(ME, 0)  # A's records from before the move
    _settle(w)
    assert _shown(w)["A"] == (HolderState.HELD, False)  # in doubt: nobody answered
    w.exchange(ME, C)  # C never saw the agent: A runs it (B is not asked yet)
    assert _shown(w)["A"] == (HolderState.HELD, True) and _shown(w)["B"] == (HolderState.HELD, True)
    w.exchange(B, ME)
    assert _shown(w)["A"] == (HolderState.UNKNOWN, False) and _shown(w)["B"] == (HolderState.HELD, True)
    w.check()


def test_a_fork_made_by_a_restored_host_stops_both_copies() -> None:
    """A, restored, hears only from C, and moves the agent to C at epoch 2,
    the epoch B already holds: two copies that each name their own host at
    one epoch. When B and C talk, neither runs it (an operator settles)."""
    from move_model import World

    w = World((ME, B, C), shared_blobs=2)
    w.start(ME, B)
    _settle(w)
    w.restore(ME, 0)
    _settle(w)
    w.exchange(ME, C)
    w.start(ME, C)
    _settle(w)
    assert _shown(w)["B"] == (HolderState.HELD, True) and _shown(w)["C"] == (HolderState.HELD, True)
    assert w.hosts[B].record.held_epoch == w.hosts[C].record.held_epoch == 2
    w.exchange(B, C)
    assert not w.running(w.hosts[B]) and not w.running(w.hosts[C])
    assert w.hosts[B].record.state is w.hosts[C].record.state is HolderState.UNKNOWN
