"""A fleet run at random (:func:`simulate`): moves, crashes, cuts from etcd,
lost keepalives and directory faults over a :class:`.fleet_sim.FleetWorld`,
checking its invariants as it goes; ``bench/bench_fleet_sim.py`` and a unit
test run it.
"""

from __future__ import annotations

import random

from capsulefs.core.fleet.lease import DEFAULT_TIMING, LeaseTiming
from capsulefs.core.store.holder import HolderState
from capsulefs.testing.fleet_sim import LAYOUT, FleetWorld
from capsulefs.testing.sim_parts import Fault, Figures

__all__ = ["simulate"]


def _busy(w: FleetWorld) -> bool:
    for key in [k for k in w.pending_since if not w.still_pending(*k)]:
        del w.pending_since[key]
    return bool(w.net or w.dir_queue or any(h.sources for h in w.hosts.values()) or w.pending_since)


def simulate(hosts: int, agents: int, *, seconds: float, seed: int = 0, moves_per_second: float = 50.0,
             crash_every: float = 5.0, cut_every: float = 5.0, loss: float = 0.02,
             timing: LeaseTiming = DEFAULT_TIMING, full_check_every: int = 20, takeovers_per_tick: int = 2,
             pending_idle: float = 30.0, dir_faults: float = 0.1, hold_through_lapse: bool = False) -> Figures:
    """Run a fleet at random for ``seconds`` of simulated time, checking the invariants as it goes."""
    rng = random.Random(seed)
    r = timing.rate_bound
    w = FleetWorld(hosts, agents, seed=seed, timing=timing, rates=[1 - r, 1.0, 1 + r], etcd_rate=1 + r,
                   hold_through_lapse=hold_through_lapse)
    names = list(w.hosts)
    dt = 0.25
    cut_until: dict[str, float] = {}
    down_until: dict[str, float] = {}
    bad = round(dir_faults * 100)
    faults = [Fault.OK] * (100 - bad) + [Fault.LOST, Fault.UNSENT, Fault.DELAYED] * (bad // 3)
    faults += [Fault.LOST] * (bad % 3)
    tick = 0
    drain_until = seconds + 120.0  # after ``seconds``: no new moves or faults; moves in flight end
    while w.now < seconds or (w.now < drain_until and _busy(w)):
        tick += 1
        calm = w.now >= seconds
        if calm:
            loss = 0.0
            faults = [Fault.OK]
            crash_every = cut_every = 0.0
            moves_per_second = 0.0
            for n in list(cut_until):
                cut_until[n] = w.now
            for n in list(down_until):
                down_until[n] = w.now
        w.advance(dt)
        for n, until in list(cut_until.items()):
            if w.now >= until:
                w.cut(n, False)
                del cut_until[n]
        for n, until in list(down_until.items()):
            if w.now >= until:
                w.hosts[n].up = True
                w.crash(n)  # the restart
                del down_until[n]
        # leases: renew when due; a host without one joins
        for h in w.hosts.values():
            if not h.up:
                continue
            local = h.local(w.now)
            if h.keeper.lease_id == 0:
                w.join(h.name)
            elif h.keeper.renew_due(local):
                w.renew(h.name, Fault.OK if rng.random() > loss else Fault.LOST)
        # faults
        if crash_every and rng.random() < dt / crash_every:
            n = rng.choice(names)
            if w.hosts[n].up:
                w.crash(n)
                w.hosts[n].up = False
                down_until[n] = w.now + rng.uniform(0.5, 20.0)
        if cut_every and rng.random() < dt / cut_every:
            n = rng.choice(names)
            w.cut(n, True)
            cut_until[n] = w.now + rng.uniform(1.0, 25.0)
        # failover: agents of a host down or cut off, once its key is gone, go elsewhere
        gone = [n for n in set(down_until) | set(cut_until) if w.etcd.get(LAYOUT.host(n)) is None]
        for n in gone[:takeovers_per_tick]:
            held = [a for a, rec in w.hosts[n].records.items() if rec.state is HolderState.HELD]
            if held:
                w.takeover(rng.choice(names), rng.choice(held))
        # new moves
        for _ in range(int(moves_per_second * dt) + (rng.random() < (moves_per_second * dt) % 1)):
            a = rng.choice(w.agents)
            holders = [n for n in w.holders[a] if w.running(w.hosts[n], a, stopping=False)]
            if holders:
                w.start_move(holders[0], a, rng.choice(names))
        for _ in range(int(moves_per_second * dt) or (not calm)):
            a = rng.choice(w.agents)
            for n in list(w.holders[a]):
                w.work(n, a)
        # deliver what is in flight: directory requests, then messages (some lost, some late)
        for _ in range(len(w.dir_queue)):
            w.serve_dir(rng.randrange(len(w.dir_queue)), rng.choice(faults))
        for _ in range(len(w.delayed) // 2):
            w.apply_delayed(rng.randrange(len(w.delayed)))
        for _ in range(len(w.net)):
            i = rng.randrange(len(w.net))
            if rng.random() < loss:
                del w.net[i]
            else:
                w.deliver(i)
        # sources whose request or reply was lost time out; pending targets expire now and then
        in_flight = {m.id for m in w.net}
        for h in w.hosts.values():
            for a in list(h.sources):
                if h.awaiting.get(a) and not h.awaiting[a] & in_flight:
                    w.timeout(h.name, a)
        for (n, a, e), since in list(w.pending_since.items()):
            if not w.still_pending(n, a, e):
                del w.pending_since[(n, a, e)]
            elif w.now - since > pending_idle:
                del w.pending_since[(n, a, e)]
                w.expire_pending(n, a)
        if tick % full_check_every == 0:
            w.check()
    w.check()
    w.figures.dir_ops.update({f"etcd_{k}": v for k, v in w.etcd.ops.items()})
    w.figures.seconds = w.now
    return w.figures
