"""Hypothesis drives two (or three) hosts through moves with message loss,
duplication, reordering, corruption, timeouts and crashes (with and without
the holder record), and old copies of a host's records restored, and checks
after every step that never two hosts run the agent, and never two hold it;
once a restore happened, that two hosts run it only until they next
exchange claims (docs/move.md, "Checking before running, and while running")."""

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
        "duplicate", "drop", "start", "start", "crash", "crash_losing_record", "corrupt_next_blob", "learn",
        "exchange", "exchange", "exchange", "restore", "restore")

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
            case "start":  # (a daemon moves only an agent it may run: not one in doubt)
                idle = [h.name for h in w.hosts.values() if w.running(h) and h.source is None]
                if idle:
                    frm = data.draw(st.sampled_from(idle), label="from")
                    w.start(frm, data.draw(st.sampled_from([n for n in NAMES if n != frm]), label="to"))
            case "timeout":
                waiting = [h.name for h in w.hosts.values() if h.source is not None and h.awaiting]
                if waiting:
                    w.timeout(data.draw(st.sampled_from(waiting), label="who"))
            case "crash" | "crash_losing_record":
                w.crash(data.draw(st.sampled_from(NAMES), label="who"), lose_record=action == "crash_losing_record")
            case "exchange":
                x = data.draw(st.sampled_from(NAMES), label="host")
                w.exchange(x, data.draw(st.sampled_from([n for n in NAMES if n != x]), label="with"))
            case "restore":
                who = data.draw(st.sampled_from(NAMES), label="who")
                w.restore(who, data.draw(st.integers(0, len(w.history[who]) - 1), label="copy"))
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


# -- the fleet mode: the directory as one more party ----------------------------------------------

from hypothesis.stateful import initialize  # noqa: E402

from capsulefs.core.fleet.lease import CLOCK_RATE_BOUND  # noqa: E402
from capsulefs.testing.fleet_sim import FleetWorld  # noqa: E402
from capsulefs.testing.sim_parts import Fault  # noqa: E402

RATES = (1 - CLOCK_RATE_BOUND, 1.0, 1 + CLOCK_RATE_BOUND)
DIR_FAULTS = (Fault.OK, Fault.OK, Fault.LOST, Fault.UNSENT, Fault.DELAYED)


class FleetMoveWorld(RuleBasedStateMachine):
    """Three hosts and two agents moved through the directory (simulated etcd),
    with lost and delayed Txn replies, keepalives lost, partitions from etcd,
    lease expiry and takeovers, crashes and hosts restored from a backup, on
    clocks whose rates differ by up to the bound. After every step: never two
    runners of an agent, no acknowledged write lost."""

    def __init__(self) -> None:
        super().__init__()
        self.world: FleetWorld | None = None

    @initialize(rates=st.tuples(*[st.sampled_from(RATES)] * 3), etcd_rate=st.sampled_from(RATES))
    def build(self, rates: tuple[float, float, float], etcd_rate: float) -> None:
        self.world = FleetWorld(3, 2, rates=list(rates), etcd_rate=etcd_rate)

    ACTIONS = ("deliver",) * 4 + ("serve_dir",) * 4 + ("renew",) * 3 + ("advance",) * 2 + ("start",) * 2 + (
        "work", "work", "duplicate", "drop", "apply_delayed", "join", "cut", "heal", "crash", "snapshot", "restore",
        "takeover", "expire_pending", "timeout")

    @rule(action=st.sampled_from(ACTIONS), data=st.data())
    def step(self, action: str, data: st.DataObject) -> None:
        w = self.world
        assert w is not None
        hosts = list(w.hosts)

        def host() -> str:
            return data.draw(st.sampled_from(hosts), label="host")

        def agent() -> str:
            return data.draw(st.sampled_from(w.agents), label="agent")

        match action:
            case "deliver" | "duplicate" | "drop" if w.net:
                i = data.draw(st.integers(0, len(w.net) - 1), label="message")
                if action == "drop":
                    del w.net[i]
                else:
                    w.deliver(i, keep=action == "duplicate")
            case "serve_dir" if w.dir_queue:
                i = data.draw(st.integers(0, len(w.dir_queue) - 1), label="request")
                w.serve_dir(i, data.draw(st.sampled_from(DIR_FAULTS), label="fault"))
            case "apply_delayed" if w.delayed:
                w.apply_delayed(data.draw(st.integers(0, len(w.delayed) - 1), label="delayed"))
            case "renew":
                w.renew(host(), data.draw(st.sampled_from(DIR_FAULTS[:4]), label="fault"))
            case "advance":
                w.advance(data.draw(st.floats(0.05, 6.0), label="seconds"))
            case "start":
                frm = host()
                w.start_move(frm, agent(), data.draw(st.sampled_from([h for h in hosts if h != frm]), label="to"))
            case "work":
                w.work(host(), agent())
            case "join":
                w.join(host())
            case "cut" | "heal":
                w.cut(host(), action == "cut")
            case "crash":
                w.crash(host())
            case "snapshot":
                w.snapshot(host())
            case "restore":
                w.restore(host())
            case "takeover":
                w.takeover(host(), agent())
            case "expire_pending":
                w.expire_pending(host(), agent())
            case "timeout":
                w.timeout(host(), agent())

    @rule(data=st.data(), fault=st.sampled_from([Fault.OK, Fault.LOST, Fault.DELAYED, Fault.UNSENT]))
    def commit_with_fault(self, data: st.DataObject, fault: Fault) -> None:
        """A move run to its point of no return, whose commit Txn then meets ``fault``
        (a macro step: the search reaches the ambiguous moment often)."""
        w = self.world
        assert w is not None
        frm = data.draw(st.sampled_from(list(w.hosts)), label="from")
        agent = data.draw(st.sampled_from(w.agents), label="agent")
        to = data.draw(st.sampled_from([h for h in w.hosts if h != frm]), label="to")
        if not w.start_move(frm, agent, to):
            return
        for _ in range(40):
            commits = [i for i, r in enumerate(w.dir_queue) if r.kind == "commit" and r.agent == agent]
            if commits:
                w.serve_dir(commits[0], fault)
                return
            if w.dir_queue:
                w.serve_dir(0)
            elif w.net:
                w.deliver(0)
            else:
                return
            w.check()

    @rule(data=st.data())
    def lapse_and_takeover(self, data: st.DataObject) -> None:
        """A host cut from etcd while the others renew: its lease expires, another
        host takes its agents over (a macro step)."""
        w = self.world
        assert w is not None
        lapsing = data.draw(st.sampled_from(list(w.hosts)), label="lapsing")
        taker = data.draw(st.sampled_from([h for h in w.hosts if h != lapsing]), label="taker")
        w.cut(lapsing, True)
        end = w.now + w.timing.ttl * 1.2
        while w.now < end:
            w.advance(0.5)
            for n, h in w.hosts.items():
                if h.keeper.lease_id == 0:
                    w.join(n)
                elif h.keeper.renew_due(h.local(w.now)):
                    w.renew(n)
            w.check()
        for a in w.agents:
            w.takeover(taker, a)
        w.cut(lapsing, data.draw(st.booleans(), label="stays cut"))

    @rule(seconds=st.floats(0.5, 12.0))
    def quiet(self, seconds: float) -> None:
        """Time passes while every host renews in time and every request is answered:
        moves in flight run to their end (a macro step, so runs get deep into moves)."""
        w = self.world
        assert w is not None
        end = w.now + seconds
        while w.now < end:
            w.advance(min(0.5, end - w.now))
            for n, h in w.hosts.items():
                if h.keeper.lease_id == 0:
                    w.join(n)
                elif h.keeper.renew_due(h.local(w.now)):
                    w.renew(n)
            for _ in range(len(w.dir_queue)):  # a host cut from etcd asks again each time: one round
                w.serve_dir(0)
            for _ in range(len(w.net)):
                w.deliver(0)
            for a in w.agents:  # each agent acknowledges a write where it runs
                for n in sorted(w.holders[a]):
                    w.work(n, a)
            w.check()

    @invariant()
    def never_two_runners(self) -> None:
        if self.world is not None:
            self.world.check()


FleetMoveWorld.TestCase.settings = settings(
    max_examples=200, stateful_step_count=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestFleetMoveWorld = FleetMoveWorld.TestCase
