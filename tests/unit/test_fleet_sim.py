"""The fleet simulation (capsulefs.testing.fleet_sim, the code behind
bench/bench_fleet_sim.py) at small sizes: its invariants hold under faults,
a calm move costs three directory requests, and the checks catch a host
that runs past its lease."""

from __future__ import annotations

import pytest

from capsulefs.core.fleet.lease import DEFAULT_TIMING, LeaseTiming
from capsulefs.core.store.holder import HolderState
from capsulefs.testing.fleet_sim import LAYOUT, FleetWorld
from capsulefs.testing.sim_parts import Fault
from capsulefs.testing.sim_run import simulate


@pytest.mark.parametrize("seed", range(4))
def test_random_moves_crashes_and_expiries_keep_the_invariants(seed: int) -> None:
    f = simulate(30, 300, seconds=60, seed=seed, moves_per_second=5, crash_every=1.0, cut_every=1.0)
    # the run went where the checks matter: moves ended both ways, some in doubt, leases expired
    assert f.moves_done > 20 and f.moves_rolled_back > 5, f
    assert f.takeovers > 5 and f.crashes > 20 and f.acks > 50, f
    assert f.checks > 100


def test_a_calm_move_costs_three_directory_requests() -> None:
    f = simulate(10, 100, seconds=30, seed=3, moves_per_second=5, crash_every=0, cut_every=0, loss=0.0,
                 dir_faults=0.0)
    assert f.moves_done == f.moves_started > 50 and f.moves_rolled_back == 0
    assert f.per_move() == 3.0
    assert (f.dir_ops["start_read"], f.dir_ops["commit"], f.dir_ops["nudge_read"]) == (f.moves_done,) * 3


def test_the_checks_catch_a_host_that_runs_past_its_lease() -> None:
    """The planted fault: hosts ignore their keeper's stop time."""
    with pytest.raises(AssertionError, match="runs on"):
        for seed in range(4):
            simulate(30, 300, seconds=60, seed=seed, moves_per_second=5, crash_every=1.0, cut_every=1.0,
                     hold_through_lapse=True)


def _lapse(timing: LeaseTiming) -> None:
    """h0000 holds the agent on a clock 1% slow, etcd's runs 1% fast; h0000 is
    cut from etcd; h0001 renews and tries to take the agent over every 50 ms."""
    w = FleetWorld(2, 1, rates=[0.99, 1.0], etcd_rate=1.01, timing=timing)
    agent = w.agents[0]
    assert w.runners(agent) == ["h0000"]
    w.cut("h0000", True)
    while w.now < 2 * timing.ttl:
        w.advance(0.05)
        other = w.hosts["h0001"]
        if other.keeper.renew_due(other.local(w.now)):
            w.renew("h0001")
        w.takeover("h0001", agent)
        w.check()
    assert w.runners(agent) == ["h0001"]


def test_a_host_cut_from_etcd_stops_before_its_agent_is_taken_over() -> None:
    _lapse(DEFAULT_TIMING)


def test_without_the_clock_rate_bound_the_takeover_overlaps_the_stop() -> None:
    with pytest.raises(AssertionError, match="runs on"):
        _lapse(LeaseTiming(rate_bound=0.0))


def test_a_source_whose_commit_was_sent_reads_the_key_again_before_it_resumes() -> None:
    """Found by the hypothesis test: the commit applies but its reply is lost;
    the target's lease expires before it activates; another host takes the
    agent over; the source's fence then says "never" (true for the target),
    the source rolls back, and must not run on the read it made before."""
    w = FleetWorld(3, 1)
    agent = w.agents[0]
    src, tgt, taker = "h0000", "h0001", "h0002"
    assert w.start_move(src, agent, tgt)
    while not any(r.kind == "commit" for r in w.dir_queue):
        if w.dir_queue:
            w.serve_dir(0)
        else:
            w.deliver(0)
    (commit,) = [i for i, r in enumerate(w.dir_queue) if r.kind == "commit"]
    w.serve_dir(commit, Fault.LOST)  # applied; the source is in doubt and asks its status
    w.net.clear()  # the nudge never reaches the target
    w.cut(tgt, True)
    while w.etcd.get(LAYOUT.host(tgt)) is not None:
        w.advance(0.5)
        for n in (src, taker):
            if w.hosts[n].keeper.renew_due(w.hosts[n].local(w.now)):
                w.renew(n)
    assert w.takeover(taker, agent)
    while w.dir_queue:  # the status read, the fence ("never"), the read before resuming
        w.serve_dir(0)
        w.check()
    assert w.hosts[src].records[agent].state is HolderState.HELD  # rolled back...
    assert w.runners(agent) == [taker]  # ...but it does not run: the directory names the taker
