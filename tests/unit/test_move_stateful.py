"""Hypothesis drives two (or three) hosts through moves with message loss,
duplication, reordering, corruption, timeouts and crashes (with and without
the holder record), and checks after every step that never two hosts run
the agent, and never two hold it."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from capsulefs.core import move as mv
from capsulefs.core.store.holder import HolderState

from move_model import World

NAMES = ("A" * 52, "B" * 52, "C" * 52)


class MoveWorld(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        # Targets already hold two of the three blobs, so moves are short
        # enough for the search to reach the ambiguous moment often.
        self.world = World(NAMES, shared_blobs=2)

    # One rule with weighted actions: delivering is common, faults are rarer,
    # so runs get deep into moves (the ambiguous moment) and not only noisy.
    ACTIONS = ("deliver",) * 4 + ("deliver_newest",) * 4 + ("timeout",) * 3 + (
        "duplicate", "drop", "start", "start", "crash", "crash_losing_record", "corrupt_next_blob", "learn")

    @rule(action=st.sampled_from(ACTIONS), data=st.data())
    def step(self, action: str, data: st.DataObject) -> None:
        w = self.world
        match action:
            case "deliver" | "duplicate" | "drop" if w.net:
                i = data.draw(st.integers(0, len(w.net) - 1), label="message")
                if action == "drop":
                    del w.net[i]
                else:
                    w.deliver(i, keep=action == "duplicate")
            case "deliver_newest" if w.net:
                w.deliver(len(w.net) - 1)  # reordering: the last sent overtakes the rest
            case "start":
                idle = [h.name for h in w.hosts.values()
                        if h.record is not None and h.record.state is HolderState.HELD and h.source is None]
                if idle:
                    frm = data.draw(st.sampled_from(idle), label="from")
                    w.start(frm, data.draw(st.sampled_from([n for n in NAMES if n != frm]), label="to"))
            case "timeout":
                waiting = [h.name for h in w.hosts.values() if h.source is not None and h.awaiting]
                if waiting:
                    w.timeout(data.draw(st.sampled_from(waiting), label="who"))
            case "crash" | "crash_losing_record":
                w.crash(data.draw(st.sampled_from(NAMES), label="who"), lose_record=action == "crash_losing_record")
            case "corrupt_next_blob":
                w.corrupt_next_blob = True
            case "learn":
                unknown = [h.name for h in w.hosts.values() if h.record is not None
                           and h.record.state is HolderState.UNKNOWN and h.files_epoch is not None]
                if unknown:
                    w.learn(data.draw(st.sampled_from(unknown), label="who"))

    @rule(phase=st.sampled_from([mv.SourceState.TRANSFERRING, mv.SourceState.VERIFYING,
                                 mv.SourceState.PREPARING, mv.SourceState.COMMITTING, mv.SourceState.IN_DOUBT]))
    def advance(self, phase: mv.SourceState) -> None:
        """Deliver the oldest message until some source reaches ``phase`` (a
        macro step, so that runs get deep into moves before chaos strikes)."""
        w = self.world
        for _ in range(50):
            if not w.net or any(h.source is not None and h.source.state is phase for h in w.hosts.values()):
                return
            w.deliver(0)
            w.check()

    @invariant()
    def at_most_one_runs(self) -> None:
        self.world.check()


MoveWorld.TestCase.settings = settings(
    max_examples=500, stateful_step_count=80, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestMoveWorld = MoveWorld.TestCase
