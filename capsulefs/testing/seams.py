"""Test seams of the daemon, selected by environment variables a test sets
on a daemon it starts; production code never reads them itself: the
composition root (capsulefs/daemon/root.py) installs them, once, at start,
and each says so in the log.

The test seam ``CAPSULEFS_TEST_CRASH_AT=<side>:<state>`` (test-only, read once
at daemon start) makes the daemon ``os._exit(137)`` right after it durably
wrote that holder state: source:frozen, source:committing, source:retired,
source:held (rolled back), target:offered, target:verified, target:prepared,
target:held (activated, before the reply). tests/daemons/test_move_daemons.py uses it
to kill a real daemon at each phase of a move. ``CAPSULEFS_TEST_STOP_AT=<side>:<state>``
(test-only, read once at daemon start) stops the daemon instead (SIGSTOP to
itself), the first time only: the test makes a fault meanwhile (a partition,
tests/daemons/test_fleet_netns.py) and lets it go on with SIGCONT.

The test seam ``CAPSULEFS_TEST_CALL_TIMEOUT=SECONDS`` (test-only, read once at
daemon start) replaces the 120 s a move's call may take before it is a
timeout, so tests/daemons/test_move_daemon_errors.py can see ETIMEDOUT quickly.

The test seam ``CAPSULEFS_TEST_LEASE_TIMING=TTL,RENEW_EVERY,RENEW_TIMEOUT,STOP_WITHIN``
(test-only, read once at daemon start, fleet mode only) replaces the host
lease's timing (core/fleet/lease.py: 10 s, 2 s, 1.5 s, 2 s), so
tests/mount/test_fleet_mount.py can pause a daemon past its run window in seconds.

The test seam ``CAPSULEFS_TEST_LIVE_REFRESH=SECONDS`` (test-only, read once at
daemon start, with ``--blobs``) replaces the 300 s after which the live set
is recomputed and its pointer's time renewed (capsulefs/fleet/live.py).

The test seam ``CAPSULEFS_TEST_GC_PAUSE=DIR`` (test-only, read by ``capsulefs
fleet gc``) stops the gc once it wrote its marks, before it reads the live
sets again: it writes ``DIR/marked`` and waits until ``DIR/go`` exists, so a
test can put a blob meanwhile (tests/daemons/test_fleet_tiergc.py).

The test seam ``CAPSULEFS_TEST_GATE_AFTER=SECONDS`` (test-only, fleet mode,
read once at daemon start) replaces the 10 s a prepared move sits idle before
the target asks the directory's gate (``FLEET_GATE_AFTER``), so
tests/daemons/test_fleet_moves.py can see that a target activated on the
source's nudge, not on its own gate.

The test seam ``CAPSULEFS_TEST_LOSE_COMMIT=applied|unsent`` (test-only, fleet
mode, read once at daemon start) loses the answer of the first move's commit
Txn, after etcd applied it (``applied``) or without sending it (``unsent``):
the move is in doubt and its status question, the directory's settle, decides
(tests/daemons/test_fleet_moves.py).
"""

from __future__ import annotations

import logging
import os
import signal

from typing import TYPE_CHECKING

from capsulefs.core.errors import FormatError
from capsulefs.core.fleet.lease import LeaseTiming
from capsulefs.core.move import Outcome
from capsulefs.core.store.holder import HolderBook, HolderRecord, HolderState
from capsulefs.move.fleet import MoveDirectory
from capsulefs.move.host import MoveHost

if TYPE_CHECKING:
    from capsulefs.fleet.authority import Ticket, Verdict

log = logging.getLogger(__name__)

__all__ = ["CALL_TIMEOUT_ENV", "CRASH_ENV", "CrashingHolders", "GATE_AFTER_ENV", "GC_PAUSE_ENV", "LEASE_TIMING_ENV",
           "LIVE_REFRESH_ENV", "LOSE_COMMIT_ENV", "LosingCommit", "STOP_ENV", "call_timeout_seam", "crash_seam",
           "gate_after_seam", "gc_pause_seam", "lease_timing_seam", "live_refresh_seam", "lose_commit_seam",
           "stop_seam"]

CRASH_ENV = "CAPSULEFS_TEST_CRASH_AT"
STOP_ENV = "CAPSULEFS_TEST_STOP_AT"
CALL_TIMEOUT_ENV = "CAPSULEFS_TEST_CALL_TIMEOUT"
LEASE_TIMING_ENV = "CAPSULEFS_TEST_LEASE_TIMING"
LOSE_COMMIT_ENV = "CAPSULEFS_TEST_LOSE_COMMIT"
LIVE_REFRESH_ENV = "CAPSULEFS_TEST_LIVE_REFRESH"
GC_PAUSE_ENV = "CAPSULEFS_TEST_GC_PAUSE"
GATE_AFTER_ENV = "CAPSULEFS_TEST_GATE_AFTER"

_SOURCE_STATES = {HolderState.FROZEN, HolderState.COMMITTING, HolderState.RETIRED}
_TARGET_STATES = {HolderState.OFFERED, HolderState.VERIFIED, HolderState.PREPARED}


class CrashingHolders(HolderBook):
    """Test seam: exit right after a chosen holder state is durable (with
    ``stop``: stop, with SIGSTOP to this process, the first time only)."""

    def __init__(self, root: str, side: str, state: HolderState, *, stop: bool = False) -> None:
        super().__init__(root)
        self.side, self.state = side, state
        self.stop, self.stopped = stop, False

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
        if side == self.side and self.stop:
            if not self.stopped:
                self.stopped = True
                log.warning("test seam %s: stopping (SIGSTOP) after %s:%s of %s", STOP_ENV, side,
                            record.state.value, record.agent_id)
                os.kill(os.getpid(), signal.SIGSTOP)
        elif side == self.side:
            log.warning("test seam %s: exiting after %s:%s of %s", CRASH_ENV, side, record.state.value,
                        record.agent_id)
            logging.shutdown()
            os._exit(137)


def _side_state(env: str, value: str) -> tuple[str, HolderState]:
    side, _, state = value.partition(":")
    if side not in ("source", "target"):
        raise FormatError(f"{env}={value!r}: the side must be source or target")
    try:
        return side, HolderState(state)
    except ValueError:
        raise FormatError(f"{env}={value!r}: {state!r} is not a holder state") from None


def crash_seam(host: MoveHost, value: str | None) -> None:
    """Install the test-only crash seam if ``value`` (``side:state``) is set."""
    if not value:
        return
    side, st = _side_state(CRASH_ENV, value)
    log.warning("test seam %s=%s is set: this daemon will exit there", CRASH_ENV, value)
    host.holders = CrashingHolders(host.holders.directory, side, st)


def stop_seam(host: MoveHost, value: str | None) -> None:
    """Install the test-only stop seam if ``value`` (``side:state``) is set."""
    if not value:
        return
    side, st = _side_state(STOP_ENV, value)
    log.warning("test seam %s=%s is set: this daemon will stop itself there once", STOP_ENV, value)
    host.holders = CrashingHolders(host.holders.directory, side, st, stop=True)


def _seconds(env: str, value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise FormatError(f"{env}={value!r}: not a number of seconds") from None
    if not seconds > 0:
        raise FormatError(f"{env}={value!r}: must be above 0")
    return seconds


def call_timeout_seam(value: str | None) -> float | None:
    """The test-only seam CAPSULEFS_TEST_CALL_TIMEOUT, in seconds (None if unset)."""
    if not value:
        return None
    seconds = _seconds(CALL_TIMEOUT_ENV, value)
    log.warning("test seam %s=%s is set: a move's call times out after %gs", CALL_TIMEOUT_ENV, value, seconds)
    return seconds


def live_refresh_seam(value: str | None) -> float | None:
    """The test-only seam CAPSULEFS_TEST_LIVE_REFRESH, in seconds (None if unset)."""
    if not value:
        return None
    seconds = _seconds(LIVE_REFRESH_ENV, value)
    log.warning("test seam %s=%s is set: the live set is recomputed every %gs", LIVE_REFRESH_ENV, value, seconds)
    return seconds


def gc_pause_seam(value: str | None) -> str | None:
    """The test-only seam CAPSULEFS_TEST_GC_PAUSE: the directory of its two files (None if unset)."""
    if not value:
        return None
    if not os.path.isdir(value):
        raise FormatError(f"{GC_PAUSE_ENV}={value!r}: not a directory")
    log.warning("test seam %s=%s is set: the tier gc stops after its marks", GC_PAUSE_ENV, value)
    return value


def gate_after_seam(value: str | None) -> float | None:
    """The test-only seam CAPSULEFS_TEST_GATE_AFTER, in seconds (None if unset)."""
    if not value:
        return None
    seconds = _seconds(GATE_AFTER_ENV, value)
    log.warning("test seam %s=%s is set: a prepared move asks the directory after %gs idle", GATE_AFTER_ENV, value,
                seconds)
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


class LosingCommit:
    """Test seam: the directory, except that the first commit's answer is lost
    (after it was applied, or without sending it)."""

    def __init__(self, inner: MoveDirectory, *, applied: bool) -> None:
        self._inner = inner
        self._applied = applied
        self._spent = False

    async def commit(self, ticket: Ticket) -> Verdict:
        from capsulefs.fleet.authority import CommitInDoubt

        if self._spent:
            return await self._inner.commit(ticket)
        self._spent = True
        if self._applied:
            verdict = await self._inner.commit(ticket)
            log.warning("test seam %s: the commit's answer (%s) is lost", LOSE_COMMIT_ENV, verdict.outcome.value)
        else:
            log.warning("test seam %s: the commit is lost before it was sent", LOSE_COMMIT_ENV)
        raise CommitInDoubt(ticket, f"test seam {LOSE_COMMIT_ENV}: no answer")

    async def begin(self, agent_id: str, held_epoch: int, target: str, epoch: int) -> Ticket:
        return await self._inner.begin(agent_id, held_epoch, target, epoch)

    async def settle(self, ticket: Ticket) -> Verdict:
        return await self._inner.settle(ticket)

    def ticket(self, agent_id: str, held_epoch: int, target: str, epoch: int) -> Ticket:
        return self._inner.ticket(agent_id, held_epoch, target, epoch)

    async def confirm(self, agent_id: str, epoch: int) -> bool:
        return await self._inner.confirm(agent_id, epoch)

    async def gate(self, agent_id: str, epoch: int, source: str) -> Outcome:
        return await self._inner.gate(agent_id, epoch, source)

    async def claim(self, agent_id: str, epoch: int) -> bool:
        return await self._inner.claim(agent_id, epoch)


def lose_commit_seam(directory: MoveDirectory, value: str | None) -> MoveDirectory:
    """The directory the moves use: ``directory``, or the test-only LosingCommit if ``value`` is set."""
    if not value:
        return directory
    if value not in ("applied", "unsent"):
        raise FormatError(f"{LOSE_COMMIT_ENV}={value!r}: must be applied or unsent")
    log.warning("test seam %s=%s is set: the first commit's answer will be lost", LOSE_COMMIT_ENV, value)
    return LosingCommit(directory, applied=value == "applied")
