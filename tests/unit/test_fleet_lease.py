"""The lease timing: a host stops its agents before its lease can expire,
on a fake clock (time is a parameter of the keeper)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from capsulefs.core.fleet import lease as fl
from capsulefs.core.fleet.lease import DEFAULT_TIMING, LeaseKeeper, LeaseState, LeaseTiming


def test_the_constants_leave_three_renewals_before_the_stop() -> None:
    t = DEFAULT_TIMING
    assert (t.ttl, t.renew_every, t.rate_bound, t.stop_within) == (10, 2.0, 0.01, 2.0)
    assert t.run_window(t.ttl) == pytest.approx(10 * 0.99 / 1.01 - 2.0)  # 7.80 s
    # keepalives due at 2, 4, 6 s after the last good one all fail (each within its timeout) before the stop
    assert 3 * t.renew_every + t.renew_timeout < t.run_window(t.ttl)


def test_a_timing_without_room_for_a_renewal_is_refused() -> None:
    with pytest.raises(ValueError, match="run window"):
        LeaseTiming(ttl=4, stop_within=2.0)


def test_the_keeper_stops_at_the_window_counted_from_the_last_answered_send() -> None:
    k = LeaseKeeper()
    assert k.state(0.0) is LeaseState.NONE and not k.may_run(0.0)
    k.granted(7, 10, sent_at=100.0)
    w = DEFAULT_TIMING.run_window(10)
    assert k.may_run(100.0 + w - 0.001) and not k.may_run(100.0 + w)
    assert not k.renew_due(101.9) and k.renew_due(102.0)
    k.renewed(7, 10, sent_at=102.0)  # answered late, at 105: the send time counts
    assert k.stop_at == pytest.approx(102.0 + w)
    k.renewed(7, 10, sent_at=101.0)  # an older keepalive's answer arriving last changes nothing
    assert k.stop_at == pytest.approx(102.0 + w)
    k.renewed(99, 10, sent_at=104.0)  # an answer about another lease: ignored
    assert k.stop_at == pytest.approx(102.0 + w)
    # every keepalive from here fails: at the stop time the host may no longer run agents
    assert k.state(102.0 + w - 0.01) is LeaseState.ALIVE
    assert k.state(102.0 + w) is LeaseState.LAPSED and not k.may_run(102.0 + w)
    # a late answer shows the lease lived on in etcd: running again is safe (nobody could take over)
    k.renewed(7, 10, sent_at=110.0)
    assert k.may_run(110.5)
    k.renewed(7, 0, sent_at=112.0)  # etcd says the lease is gone: stop now, get a new one
    assert k.state(112.0) is LeaseState.NONE and k.lease_id == 0 and not k.may_run(112.0)


@given(local_rate=st.floats(1 - fl.CLOCK_RATE_BOUND, 1 + fl.CLOCK_RATE_BOUND),
       etcd_rate=st.floats(1 - fl.CLOCK_RATE_BOUND, 1 + fl.CLOCK_RATE_BOUND),
       sent=st.floats(0, 1e6), delay=st.floats(0, 5), ttl=st.integers(10, 60))
def test_stopped_before_etcd_can_expire_the_lease(local_rate: float, etcd_rate: float, sent: float,
                                                  delay: float, ttl: int) -> None:
    """True time T: the host's clock reads local_rate*T, etcd's etcd_rate*T.
    A keepalive sent at true time ``sent`` reaches etcd ``delay`` later; etcd
    expires the lease once its clock passes the receipt plus the TTL. The
    host's agents are stopped by its stop time plus stop_within, which must
    come first for every pair of rates within the bound."""
    k = LeaseKeeper()
    k.granted(1, ttl, sent_at=local_rate * sent)
    assert k.stop_at is not None
    stopped_true = (k.stop_at + DEFAULT_TIMING.stop_within) / local_rate
    expires_true = (etcd_rate * (sent + delay) + ttl) / etcd_rate
    assert stopped_true <= expires_true * (1 + 1e-12)


def test_without_the_rate_bound_a_fast_etcd_expires_the_lease_first() -> None:
    """The bound is needed: with rate_bound 0 and clocks 1% apart, the host
    would still be stopping when etcd expires its lease."""
    k = LeaseKeeper(LeaseTiming(rate_bound=0.0))
    k.granted(1, 10, sent_at=0.0)
    assert k.stop_at is not None
    stopped_true = (k.stop_at + 2.0) / 0.99
    expires_true = 10 / 1.01
    assert stopped_true > expires_true
