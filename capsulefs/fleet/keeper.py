"""The host's lease on the directory, kept alive: a trio service.

Rules:
  * The timing is :mod:`capsulefs.core.fleet.lease`'s: a keepalive every
    ``renew_every`` after the last answered one (each given ``renew_timeout``),
    and the host may run agents and take writes until ``stop_at``: the send
    of the last answered keepalive plus the run window (7.80 s for a 10 s
    lease). Time is trio's clock (monotonic, never stepped).
  * Every wait of the service ends at ``stop_at``, a keepalive in flight
    included: at ``stop_at`` it calls :meth:`LeaseListener.stop` (stop the
    agents, make the mount read-only), which must be done within
    ``stop_within``, so the host has stopped before etcd can expire the lease.
    A keepalive answered "lease gone" calls it at once.
  * Once stopped, the lease is over for this host: it asks for a new one
    (grant, put its host key under it, then revoke the old lease, so its key
    never vanishes while it is up), and tells :meth:`LeaseListener.regained`.
    It never writes an agent's key: whether the host may run an agent again
    is the directory's judgement, read by the caller
    (:meth:`capsulefs.fleet.authority.DirectoryAuthority.confirm`).
  * The host record (id, address, certificate fingerprint) is written under
    every new lease, before :meth:`may_run` turns true.

Theory of operation: one task (:meth:`HostLeaseKeeper.serve`) loops: with no
lease, grant one (retrying every ``renew_every``); with one, sleep until the
next keepalive is due or until ``stop_at``, whichever comes first; send it
within ``min(send + renew_timeout, stop_at)``. ``may_run`` and ``deadline``
are read by any task between checkpoints (they only read the sans-IO keeper).
The listener's ``regained`` runs inside that loop: it calls
:meth:`HostLeaseKeeper.renew_if_due` between its requests to the directory,
so the keepalives go on however many agents it confirms.
"""

from __future__ import annotations

import logging
from typing import Protocol

import trio

from capsulefs.core.fleet import directory as fd
from capsulefs.core.fleet.errors import DirectoryError, LeaseNotFound
from capsulefs.core.fleet.etcd import Lease, PutResult
from capsulefs.core.fleet.lease import DEFAULT_TIMING, LeaseKeeper, LeaseState, LeaseTiming

log = logging.getLogger(__name__)

__all__ = ["HostLeaseKeeper", "LeaseClient", "LeaseListener"]


class LeaseClient(Protocol):
    """What the keeper needs of the directory (:class:`capsulefs.fleet.etcd.EtcdClient` has it)."""

    async def grant(self, ttl: int, lease_id: int = 0) -> Lease: ...

    async def keepalive(self, lease_id: int) -> int: ...

    async def put(self, key: bytes, value: bytes, *, lease: int = 0, prev_kv: bool = False) -> PutResult: ...

    async def revoke(self, lease_id: int) -> None: ...


class LeaseListener(Protocol):
    """The host's side: what it does when its lease ends and when it has a new one."""

    async def stop(self, why: str) -> None:
        """Stop every agent and make the mount read-only, within ``stop_within`` seconds."""

    async def regained(self, lease_id: int) -> None:
        """A new lease and the host key under it. Run nothing yet: ask the
        directory about each agent first (the keeper takes nothing back)."""


class HostLeaseKeeper:
    """Grants the host's lease, keeps it alive, publishes the host record under it."""

    def __init__(self, client: LeaseClient, layout: fd.Layout, host: fd.HostEntry, listener: LeaseListener,
                 timing: LeaseTiming = DEFAULT_TIMING) -> None:
        self._client = client
        self._layout = layout
        self._host = host
        self._listener = listener
        self._timing = timing
        self._core = LeaseKeeper(timing)
        self._stopped = True  # the agents are stopped (nothing runs before the first lease)
        self._last_sent: float | None = None  # send time of the last answered keepalive or grant
        self._next_try = 0.0  # after a failed keepalive: the next one renew_every after its send
        self._given_up = 0  # a lease stopped on, revoked once the host key is under a new one
        self._alive = trio.Event()  # set while the host holds a lease it may run on
        self.renewals = 0  # keepalives answered (for status and tests)
        self.leases = 0  # leases granted

    # -- read by any task ------------------------------------------------------------
    @property
    def lease_id(self) -> int:
        return self._core.lease_id

    @property
    def deadline(self) -> float | None:
        """trio time at which the host must begin to stop (None: no lease)."""
        return None if self._stopped else self._core.stop_at

    @property
    def last_renewal_sent(self) -> float | None:
        """trio time at which the last answered keepalive (or grant) was sent."""
        return None if self._stopped else self._last_sent

    def may_run(self) -> bool:
        """May this host run agents and acknowledge writes now? (Check before each.)"""
        return not self._stopped and self._core.may_run(trio.current_time())

    def why_not(self) -> str:
        """Why :meth:`may_run` is false, in words (a refused write's reason)."""
        stop_at = self._core.stop_at
        if self._stopped or stop_at is None:
            return "this host has no lease from the directory"
        return (f"lease {self._core.lease_id:x} not renewed in time: its deadline passed "
                f"{trio.current_time() - stop_at:.1f}s ago (was the host paused?)")

    async def renew_if_due(self) -> None:
        """A keepalive now if one is due (or the stop, if the deadline
        passed): for the listener's long work inside the keeper's loop
        (``regained`` confirming thousands of agents), which holds the
        keepalives up otherwise. May stop the host (listener.stop)."""
        stop_at, last = self._core.stop_at, self._last_sent
        if self._stopped or stop_at is None or last is None:
            return
        now = trio.current_time()
        if now >= stop_at or now >= max(last + self._timing.renew_every, self._next_try):
            await self._keep()

    async def wait_alive(self) -> None:
        """Until the host holds a lease (the first, or a new one after a stop)."""
        await self._alive.wait()

    # -- the service -----------------------------------------------------------------
    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep the lease until cancelled (the lease is then left to expire:
        revoking it would let another host take the agents over at once)."""
        task_status.started()
        while True:
            if self._stopped:
                await self._new_lease()
            else:
                await self._keep()

    async def _new_lease(self) -> None:
        sent = trio.current_time()
        try:
            with trio.fail_after(self._timing.renew_timeout * 2):
                lease = await self._client.grant(self._timing.ttl)
                self._core.granted(lease.id, lease.ttl, sent)
                put = fd.register_ops(self._layout, self._host, lease.id)
                await self._client.put(put.key, put.value, lease=put.lease)
        except (DirectoryError, trio.TooSlowError) as exc:
            self._core.lost()  # (a lease granted without its key put expires by itself)
            log.warning("host %s: no lease from the directory: %s", self._host.host_id, exc or "timed out")
            await trio.sleep_until(sent + self._timing.renew_every)
            return
        if not self._core.may_run(trio.current_time()):
            log.warning("host %s: lease %x granted too late to use", self._host.host_id, lease.id)
            self._core.lost()
            return
        self.leases += 1
        self._last_sent = sent
        self._next_try = 0.0
        self._stopped = False
        log.info("host %s: lease %x (%ds), host record published", self._host.host_id, lease.id, lease.ttl)
        if self._given_up:
            old, self._given_up = self._given_up, 0
            await self._revoke(old)
        await self._listener.regained(lease.id)
        if not self._stopped:  # (a keepalive during regained may have found the lease gone)
            self._alive.set()

    async def _revoke(self, lease_id: int) -> None:
        """End a lease this host gave up (its key is under the new one now): best effort."""
        try:
            with trio.move_on_after(self._timing.renew_timeout):
                await self._client.revoke(lease_id)
        except DirectoryError as exc:
            log.info("host %s: old lease %x not revoked (%s): it expires by itself", self._host.host_id,
                     lease_id, exc)

    async def _keep(self) -> None:
        stop_at = self._core.stop_at
        assert stop_at is not None
        last = self._last_sent
        assert last is not None
        due = max(last + self._timing.renew_every, self._next_try)
        if trio.current_time() < stop_at and trio.current_time() < due:
            await trio.sleep_until(min(due, stop_at))
        if trio.current_time() >= stop_at:
            await self._stop(f"lease {self._core.lease_id:x} not renewed in time (since {last:.3f})")
            return
        lease_id = self._core.lease_id
        sent = trio.current_time()
        self._next_try = sent + self._timing.renew_every
        try:
            with trio.move_on_at(min(sent + self._timing.renew_timeout, stop_at)) as scope:
                ttl = await self._client.keepalive(lease_id)
        except LeaseNotFound:
            self._core.lost()
            await self._stop(f"lease {lease_id:x} is gone")
            return
        except DirectoryError as exc:
            log.warning("host %s: keepalive of lease %x failed: %s (must stop at %.3f)", self._host.host_id,
                        lease_id, exc, stop_at)
            return
        if scope.cancelled_caught:
            log.warning("host %s: keepalive of lease %x got no answer in time (must stop at %.3f)",
                        self._host.host_id, lease_id, stop_at)
            return
        self._core.renewed(lease_id, ttl, sent)
        if self._core.lease_id != lease_id:  # answered with no TTL: gone
            await self._stop(f"lease {lease_id:x} is gone")
            return
        self._last_sent = max(sent, self._last_sent or sent)
        self.renewals += 1

    async def _stop(self, why: str) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._given_up = self._core.lease_id  # (0 if it is gone already)
        self._alive = trio.Event()
        log.warning("host %s: stopping agents and going read-only: %s", self._host.host_id, why)
        with trio.move_on_after(self._timing.stop_within) as scope:
            await self._listener.stop(why)
        if scope.cancelled_caught:
            log.error("host %s: the stop took longer than %.1fs: the lease may expire before it is done",
                      self._host.host_id, self._timing.stop_within)
        if self._core.state(trio.current_time()) is not LeaseState.NONE:
            log.info("host %s: lease %x given up; asking for a new one", self._host.host_id, self._core.lease_id)
        self._core.lost()
