"""The host lease keeper (capsulefs.fleet.keeper) against a real etcd: it
renews, publishes the host record under its lease, stops the host's agents
before etcd can expire the lease when etcd is killed (-9), and with etcd back
takes a new lease without taking any agent back (the directory decides)."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterator

import pytest
import trio
import trio.testing

from capsulefs.core.fleet import directory as fd
from capsulefs.core.fleet.lease import DEFAULT_TIMING
from capsulefs.fleet.authority import DirectoryAuthority
from capsulefs.fleet.etcd import open_etcd
from capsulefs.fleet.keeper import HostLeaseKeeper
from fleet_kit import KillableEtcd, killable_etcd
from helpers import HANG

ME = "host-a"
A1, A2 = "a1" * 16, "b2" * 16
CERT = hashlib.sha256(b"host-a's certificate").hexdigest()


@pytest.fixture
def etcd_server() -> Iterator[KillableEtcd]:
    with killable_etcd() as server:
        yield server


class Host:
    """The keeper's listener: what the daemon does (stop agents, go read-only; a new lease)."""

    def __init__(self) -> None:
        self.stopped = trio.Event()
        self.stop_began: float | None = None
        self.stop_done: float | None = None
        self.why = ""
        self.regained_leases: list[int] = []
        self.got_lease = trio.Event()

    async def stop(self, why: str) -> None:
        self.stop_began = trio.current_time()
        self.why = why
        await trio.sleep(0)  # (a real stop kills process groups and remounts read-only)
        self.stop_done = trio.current_time()
        self.stopped.set()

    async def regained(self, lease_id: int) -> None:
        self.regained_leases.append(lease_id)
        self.got_lease.set()


async def _wait_for(predicate: object, what: str) -> None:
    """Until ``predicate()`` holds (a status read between checkpoints); HANG bounds a hang."""
    assert callable(predicate)
    with trio.fail_after(HANG):
        while not predicate():
            await trio.sleep(0.05)
    assert predicate(), what


async def test_renews_stops_before_expiry_when_etcd_dies_and_takes_nothing_back(etcd_server: KillableEtcd) -> None:
    layout = fd.Layout(b"/capsulefs-test/" + secrets.token_hex(4).encode() + b"/")
    me = fd.HostEntry(host_id=ME, address="10.0.0.1:7000", cert_sha256=CERT)
    host = Host()
    timing = DEFAULT_TIMING
    async with open_etcd(etcd_server.spec) as etcd, trio.open_nursery() as nursery:
        keeper = HostLeaseKeeper(etcd, layout, me, host, timing)
        await nursery.start(keeper.serve)
        with trio.fail_after(HANG):
            await keeper.wait_alive()
        assert keeper.may_run() and host.regained_leases == [keeper.lease_id]
        first = keeper.lease_id
        kv = await etcd.get(layout.host(ME))
        assert kv is not None and kv.lease == first and fd.decode_host(kv.value) == me

        # the agents' keys: A1 names this host at 1; A2 named it, but another host has it at 2
        # now (this host's record of A2 is stale, say restored from a backup)
        authority = DirectoryAuthority(etcd, layout, ME, keeper)
        assert await authority.claim(A1, 1)
        assert await authority.claim(A2, 1)
        seen = await etcd.get(layout.agent(A2))
        assert seen is not None
        await etcd.put(layout.agent(A2), fd.AgentEntry(host_id="host-b", epoch=2).encode())
        a1_before = await etcd.get(layout.agent(A1))
        assert a1_before is not None

        # renewals: etcd's TTL left follows the keeper's last answered keepalive
        await _wait_for(lambda: keeper.renewals >= 2, "two keepalives answered")
        sent = keeper.last_renewal_sent
        assert sent is not None
        left = await etcd.time_to_live(first)
        assert left is not None
        assert left.ttl >= timing.ttl - (trio.current_time() - sent) - 1, (left.ttl, trio.current_time() - sent)

        # etcd dies: the host stops before etcd could expire the lease
        queried = trio.current_time()
        left = await etcd.time_to_live(first)
        assert left is not None
        renewals = keeper.renewals
        etcd_server.kill()
        last = keeper.last_renewal_sent
        assert last is not None
        with trio.fail_after(timing.ttl + HANG):
            await host.stopped.wait()
        assert host.stop_began is not None and host.stop_done is not None
        assert keeper.renewals == renewals, "a keepalive was answered by a dead etcd"
        assert not keeper.may_run() and keeper.deadline is None
        assert "not renewed in time" in host.why
        # by the keeper's rule: from the last answered keepalive's send, the run window
        assert host.stop_began >= last + timing.run_window(timing.ttl)
        # etcd's own view: the lease had left.ttl (whole) seconds when asked at `queried`, so it
        # could expire no earlier than queried + left.ttl
        assert host.stop_done < queried + left.ttl, (host.stop_done - queried, left.ttl)
        assert host.stop_done < last + timing.ttl / (1 + timing.rate_bound)

        # etcd is back: a new lease, the host key under it; no agent's key written
        host.got_lease = trio.Event()
        etcd_server.start()
        with trio.fail_after(HANG):
            await host.got_lease.wait()
        second = keeper.lease_id
        assert second != first and keeper.may_run()
        kv = await etcd.get(layout.host(ME))
        assert kv is not None and kv.lease == second and fd.decode_host(kv.value) == me
        assert await etcd.time_to_live(first) is None  # the old lease revoked (its key moved first)
        assert await etcd.get(layout.agent(A1)) == a1_before  # not rewritten: not "taken back"
        assert fd.decode_agent((await etcd.get(layout.agent(A2)) or seen).value).host_id == "host-b"
        # the directory's judgement decides which the host runs again
        assert await authority.confirm(A1, 1)
        assert not await authority.confirm(A2, 1)
        nursery.cancel_scope.cancel()


async def test_a_lease_reported_gone_stops_at_once(etcd_server: KillableEtcd) -> None:
    layout = fd.Layout(b"/capsulefs-test/" + secrets.token_hex(4).encode() + b"/")
    host = Host()
    async with open_etcd(etcd_server.spec) as etcd, trio.open_nursery() as nursery:
        keeper = HostLeaseKeeper(etcd, layout, fd.HostEntry(host_id=ME, address="a:1"), host)
        await nursery.start(keeper.serve)
        with trio.fail_after(HANG):
            await keeper.wait_alive()
        first = keeper.lease_id
        host.got_lease = trio.Event()
        await etcd.revoke(first)  # (an operator, or an expiry the host did not see coming)
        with trio.fail_after(HANG):
            await host.stopped.wait()
        assert "is gone" in host.why  # at its next keepalive, not at the end of its run window
        with trio.fail_after(HANG):
            await host.got_lease.wait()
        assert keeper.lease_id != first and keeper.may_run()
        nursery.cancel_scope.cancel()


async def test_a_keepalive_that_hangs_stops_the_host_at_its_deadline(etcd_server: KillableEtcd) -> None:
    """etcd paused (SIGSTOP): every request hangs, as across a partition; each keepalive is given up after
    its timeout and the stop still comes at the deadline, before etcd's TTL."""
    layout = fd.Layout(b"/capsulefs-test/" + secrets.token_hex(4).encode() + b"/")
    host = Host()
    timing = DEFAULT_TIMING
    async with open_etcd(etcd_server.spec) as etcd, trio.open_nursery() as nursery:
        keeper = HostLeaseKeeper(etcd, layout, fd.HostEntry(host_id=ME, address="a:1"), host, timing)
        await nursery.start(keeper.serve)
        with trio.fail_after(HANG):
            await keeper.wait_alive()
        await _wait_for(lambda: keeper.renewals >= 1, "a keepalive answered")
        first = keeper.lease_id
        queried = trio.current_time()
        left = await etcd.time_to_live(first)
        assert left is not None
        etcd_server.pause()
        try:
            last = keeper.last_renewal_sent
            assert last is not None
            with trio.fail_after(timing.ttl + HANG):
                await host.stopped.wait()
            assert host.stop_began is not None and host.stop_done is not None
            assert host.stop_began >= last + timing.run_window(timing.ttl)
            assert host.stop_done < queried + left.ttl, (host.stop_done - queried, left.ttl)
            assert not keeper.may_run()
        finally:
            etcd_server.resume()
        host.got_lease = trio.Event()
        with trio.fail_after(HANG):
            await host.got_lease.wait()
        assert keeper.lease_id != first and keeper.may_run()
        nursery.cancel_scope.cancel()


class SlowRegain(Host):
    """A listener whose ``regained`` works through ``batches`` requests to a
    slow directory, ``each`` seconds apiece (trio's mock clock jumped), and
    asks the keeper for a keepalive if one is due between them, as the
    daemon's confirmation of thousands of agents does."""

    def __init__(self, clock: trio.testing.MockClock, batches: int, each: float) -> None:
        super().__init__()
        self.clock, self.batches, self.each = clock, batches, each
        self.keeper: HostLeaseKeeper | None = None
        self.alive_after: list[bool] = []

    async def regained(self, lease_id: int) -> None:
        assert self.keeper is not None
        if not self.alive_after:  # (the first lease only)
            for _ in range(self.batches):
                self.clock.jump(self.each)
                await self.keeper.renew_if_due()
                self.alive_after.append(self.keeper.may_run())
        await super().regained(lease_id)


async def test_a_regained_longer_than_the_run_window_keeps_the_lease_alive(
        etcd_server: KillableEtcd, mock_clock: trio.testing.MockClock) -> None:
    mock_clock.rate = 1  # (as time runs, but for the jumps: the directory's slow answers)
    layout = fd.Layout(b"/capsulefs-test/" + secrets.token_hex(4).encode() + b"/")
    timing = DEFAULT_TIMING
    host = SlowRegain(mock_clock, batches=12, each=timing.renew_every * 0.75)
    assert host.batches * host.each > timing.run_window(timing.ttl)
    async with open_etcd(etcd_server.spec) as etcd, trio.open_nursery() as nursery:
        keeper = host.keeper = HostLeaseKeeper(etcd, layout, fd.HostEntry(host_id=ME, address="a:1"), host, timing)
        await nursery.start(keeper.serve)
        with trio.fail_after(HANG):
            await keeper.wait_alive()
        assert host.alive_after == [True] * host.batches, host.alive_after
        assert keeper.leases == 1 and keeper.renewals >= 5  # (one every 2 s of the 18: 6, less a margin)
        assert host.regained_leases == [keeper.lease_id] and not host.stopped.is_set()
        nursery.cancel_scope.cancel()
