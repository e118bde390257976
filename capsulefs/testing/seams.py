"""Test seams of the daemon, selected by environment variables a test sets
on a daemon it starts; production code never reads them itself: the
composition root (capsulefs/daemon/root.py) installs them, once, at start,
and each says so in the log.

The test seam ``CAPSULEFS_TEST_CRASH_AT=<side>:<state>`` (test-only, read once
at daemon start) makes the daemon ``os._exit(137)`` right after it durably
wrote that holder state: source:frozen, source:committing, source:retired,
source:held (rolled back), target:offered, target:verified, target:prepared,
target:held (activated, before the reply). tests/daemons/test_move_daemons.py uses it
to kill a real daemon at each phase of a move.

The test seam ``CAPSULEFS_TEST_CALL_TIMEOUT=SECONDS`` (test-only, read once at
daemon start) replaces the 120 s a move's call may take before it is a
timeout, so tests/daemons/test_move_daemon_errors.py can see ETIMEDOUT quickly.

The test seam ``CAPSULEFS_TEST_LEASE_TIMING=TTL,RENEW_EVERY,RENEW_TIMEOUT,STOP_WITHIN``
(test-only, read once at daemon start, fleet mode only) replaces the host
lease's timing (core/fleet/lease.py: 10 s, 2 s, 1.5 s, 2 s), so
tests/mount/test_fleet_mount.py can pause a daemon past its run window in seconds.
"""

from __future__ import annotations

import logging
import os

from capsulefs.core.errors import FormatError
from capsulefs.core.fleet.lease import LeaseTiming
from capsulefs.core.store.holder import HolderBook, HolderRecord, HolderState
from capsulefs.move.host import MoveHost

log = logging.getLogger(__name__)

__all__ = ["CALL_TIMEOUT_ENV", "CRASH_ENV", "CrashingHolders", "LEASE_TIMING_ENV", "call_timeout_seam", "crash_seam",
           "lease_timing_seam"]

CRASH_ENV = "CAPSULEFS_TEST_CRASH_AT"
CALL_TIMEOUT_ENV = "CAPSULEFS_TEST_CALL_TIMEOUT"
LEASE_TIMING_ENV = "CAPSULEFS_TEST_LEASE_TIMING"

_SOURCE_STATES = {HolderState.FROZEN, HolderState.COMMITTING, HolderState.RETIRED}
_TARGET_STATES = {HolderState.OFFERED, HolderState.VERIFIED, HolderState.PREPARED}


class CrashingHolders(HolderBook):
    """Test seam: exit right after a chosen holder state is durable."""

    def __init__(self, root: str, side: str, state: HolderState) -> None:
        super().__init__(root)
        self.side, self.state = side, state

    def put(self, record: HolderRecord) -> None:
        prev = self.get(record.agent_id)
        super().put(record)
        if record.state is not self.state:
            return
        prev_state = prev.state if prev is not None else None
        if record.state in _SOURCE_STATES or prev_state in (HolderState.FROZEN, HolderState.COMMITTING):
            side = "source"
        elif record.state in _TARGET_STATES or prev_state in _TARGET_STATES:
            side = "target"
        else:
            return
        if side == self.side:
            log.warning("test seam %s: exiting after %s:%s of %s", CRASH_ENV, side, record.state.value,
                        record.agent_id)
            logging.shutdown()
            os._exit(137)


def crash_seam(host: MoveHost, value: str | None) -> None:
    """Install the test-only crash seam if ``value`` (``side:state``) is set."""
    if not value:
        return
    side, _, state = value.partition(":")
    if side not in ("source", "target"):
        raise FormatError(f"{CRASH_ENV}={value!r}: the side must be source or target")
    try:
        st = HolderState(state)
    except ValueError:
        raise FormatError(f"{CRASH_ENV}={value!r}: {state!r} is not a holder state") from None
    log.warning("test seam %s=%s is set: this daemon will exit there", CRASH_ENV, value)
    host.holders = CrashingHolders(host.holders.directory, side, st)


def call_timeout_seam(value: str | None) -> float | None:
    """The test-only seam CAPSULEFS_TEST_CALL_TIMEOUT, in seconds (None if unset)."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        raise FormatError(f"{CALL_TIMEOUT_ENV}={value!r}: not a number of seconds") from None
    if not seconds > 0:
        raise FormatError(f"{CALL_TIMEOUT_ENV}={value!r}: must be above 0")
    log.warning("test seam %s=%s is set: a move's call times out after %gs", CALL_TIMEOUT_ENV, value, seconds)
    return seconds


def lease_timing_seam(value: str | None) -> LeaseTiming | None:
    """The test-only seam CAPSULEFS_TEST_LEASE_TIMING (None if unset)."""
    if not value:
        return None
    parts = value.split(",")
    try:
        ttl, renew_every, renew_timeout, stop_within = int(parts[0]), *map(float, parts[1:])
        timing = LeaseTiming(ttl=ttl, renew_every=renew_every, renew_timeout=renew_timeout, stop_within=stop_within)
    except (ValueError, TypeError) as exc:
        raise FormatError(f"{LEASE_TIMING_ENV}={value!r}: not TTL,RENEW_EVERY,RENEW_TIMEOUT,STOP_WITHIN "
                          f"of a usable lease ({exc})") from None
    log.warning("test seam %s=%s is set: the host lease runs for %.2fs after each answered keepalive",
                LEASE_TIMING_ENV, value, timing.run_window(timing.ttl))
    return timing
