"""The test seam CAPSULEFS_TEST_LEASE_TIMING (capsulefs/testing/seams.py): the
timing a daemon's host lease gets, and the values refused."""

from __future__ import annotations

import pytest

from capsulefs.core.errors import FormatError
from capsulefs.core.fleet.lease import DEFAULT_TIMING
from capsulefs.testing.seams import lease_timing_seam


def test_unset_is_no_seam() -> None:
    assert lease_timing_seam(None) is None
    assert lease_timing_seam("") is None


def test_a_short_lease_keeps_the_rule() -> None:
    timing = lease_timing_seam("5,1,1,2")
    assert timing is not None
    assert (timing.ttl, timing.renew_every, timing.renew_timeout, timing.stop_within) == (5, 1.0, 1.0, 2.0)
    assert timing.rate_bound == DEFAULT_TIMING.rate_bound
    assert timing.run_window(5) == pytest.approx(2.90, abs=0.01)


@pytest.mark.parametrize("value", ["x", "4.5,1,1,2", "5,1,1", "3,1,1,2", "0,1,1,2", "5,1,x,2"])
def test_a_value_that_leaves_no_room_is_refused_in_one_line(value: str) -> None:
    with pytest.raises(FormatError) as err:
        lease_timing_seam(value)
    assert "CAPSULEFS_TEST_LEASE_TIMING" in str(err.value) and "\n" not in str(err.value)
