"""A host's lease on the directory, sans-IO: when to renew, when to stop its agents.

Rules:
  * A host may run agents only while its lease is alive *by its own clock*
    with room to spare: from the moment it sent the last keepalive that
    etcd answered, for ``LeaseTiming.run_window(ttl)`` seconds. Past that it
    stops its agents and makes its mount read-only; stopping takes at most
    ``stop_within`` seconds, and the window ends that long before the
    earliest moment etcd can expire the lease (docs/fleet.md's argument).
  * The window counts from the keepalive's *send*, never its answer: etcd
    restarted the TTL when it received it, which is later.
  * A lease reported gone (LeaseNotFound) stops the agents at once; a new
    lease is a new start (the host reads its agents' keys again before it
    runs any).
  * Time is a parameter (``now``: a monotonic clock's seconds); nothing here
    reads a clock.

Theory of operation: the driver asks :meth:`LeaseKeeper.renew_due` and
:meth:`LeaseKeeper.stop_at`, sends keepalives (recording the send time it
hands back to :meth:`renewed`), and stops its agents when
:meth:`LeaseKeeper.may_run` turns false.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["DEFAULT_TIMING", "LeaseKeeper", "LeaseState", "LeaseTiming"]

#: Seconds of a host lease (etcd's TTL).
LEASE_TTL = 10
#: Seconds between keepalives while all goes well.
RENEW_EVERY = 2.0
#: Seconds one keepalive may take before it counts as failed (the client's timeout).
RENEW_TIMEOUT = 1.5
#: Bound on how far any clock's rate may be from true time (1%: far above
#: what NTP-disciplined clocks show, ~1e-4, and room for a VM's drift).
CLOCK_RATE_BOUND = 0.01
#: Seconds a host needs, once it decides to stop, to have its agents stopped
#: (SIGKILL of each sandbox's process group) and its mount read-only.
STOP_WITHIN = 2.0


@dataclass(frozen=True, slots=True)
class LeaseTiming:
    ttl: int = LEASE_TTL
    renew_every: float = RENEW_EVERY
    renew_timeout: float = RENEW_TIMEOUT
    rate_bound: float = CLOCK_RATE_BOUND
    stop_within: float = STOP_WITHIN

    def __post_init__(self) -> None:
        if not 0 <= self.rate_bound < 0.5:
            raise ValueError(f"clock rate bound {self.rate_bound} is not in [0, 0.5)")
        if self.run_window(self.ttl) < self.renew_every + self.renew_timeout:
            raise ValueError(f"a {self.ttl}s lease leaves a run window of {self.run_window(self.ttl):.2f}s, "
                             f"less than one renewal ({self.renew_every}s + {self.renew_timeout}s timeout)")

    def run_window(self, ttl: float) -> float:
        """Seconds of local time, from the send of a keepalive that etcd
        answered with ``ttl``, during which the host may run agents.

        A local clock may run slow by the rate bound and etcd's fast by as
        much: ``d`` local seconds are at most ``d (1+r)/(1-r)`` of etcd's.
        The host has stopped by local ``w + stop_within``; that must come
        before etcd's ``ttl``: ``(w + stop_within)(1+r)/(1-r) <= ttl``.
        """
        r = self.rate_bound
        return ttl * (1 - r) / (1 + r) - self.stop_within


DEFAULT_TIMING = LeaseTiming()


class LeaseState(enum.Enum):
    NONE = "none"  # no lease yet, or the last one is gone: run nothing, ask for a new one
    ALIVE = "alive"  # renewed in time: may run agents until stop_at
    LAPSED = "lapsed"  # past stop_at without a renewal: agents stopped; the lease may still live in etcd


class LeaseKeeper:
    """One host's view of its lease, fed the times of its keepalives."""

    def __init__(self, timing: LeaseTiming = DEFAULT_TIMING) -> None:
        self.timing = timing
        self.lease_id = 0
        self._last_sent: float | None = None  # send time of the last answered keepalive (or grant)
        self._ttl = 0
        self._stop_at: float | None = None

    def state(self, now: float) -> LeaseState:
        if self._stop_at is None:
            return LeaseState.NONE
        return LeaseState.ALIVE if now < self._stop_at else LeaseState.LAPSED

    @property
    def stop_at(self) -> float | None:
        """The local time at which agents must begin to stop (None: no lease)."""
        return self._stop_at

    def may_run(self, now: float) -> bool:
        return self._stop_at is not None and now < self._stop_at

    def granted(self, lease_id: int, ttl: int, sent_at: float) -> None:
        """A lease was granted in answer to a request sent at ``sent_at``."""
        if lease_id <= 0 or ttl <= 0:
            raise ValueError(f"lease {lease_id} with TTL {ttl}: not a live lease")
        self.lease_id = lease_id
        self._last_sent = None
        self._renewed(ttl, sent_at)

    def renewed(self, lease_id: int, ttl: int, sent_at: float) -> None:
        """etcd answered a keepalive sent at ``sent_at`` with ``ttl`` (answers may come out of order)."""
        if lease_id != self.lease_id or self._stop_at is None:
            return  # an answer about a lease we gave up
        if ttl <= 0:
            self.lost()
            return
        if self._last_sent is not None and sent_at <= self._last_sent:
            return  # an older keepalive's answer: the newer one counts
        self._renewed(ttl, sent_at)

    def _renewed(self, ttl: int, sent_at: float) -> None:
        self._last_sent = sent_at
        self._ttl = ttl
        self._stop_at = sent_at + self.timing.run_window(ttl)

    def lost(self) -> None:
        """The lease is gone (expired or revoked): stop now, get a new one."""
        self.lease_id = 0
        self._last_sent = None
        self._stop_at = None

    def renew_due(self, now: float) -> bool:
        """Should a keepalive be sent now (the last answered one is old enough)?"""
        return self._last_sent is not None and now >= self._last_sent + self.timing.renew_every
