"""The directory authority (capsulefs.fleet.authority) against a real etcd: a
move's commit and its lost-reply fence, a prepared target's gate, a
takeover only once the holder's lease is gone. The one seam is the HTTP
transport, which loses a reply after etcd applied the request, or before
it was sent on (fleet_kit.LosingTransport)."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator

import httpx
import pytest
import trio

from capsulefs.core.fleet import directory as fd
from capsulefs.core.move import Outcome
from capsulefs.fleet.authority import CommitInDoubt, DirectoryAuthority, NotTheHolder
from capsulefs.fleet.directory import register_host
from capsulefs.fleet.etcd import EtcdClient
from fleet_kit import EtcdServer, LosingTransport

AGENT = "a1" * 16
TXN = "/v3/kv/txn"


class Lease:
    """The host's lease, as the authority sees it (the keeper in the daemon)."""

    def __init__(self) -> None:
        self.alive = True

    def may_run(self) -> bool:
        return self.alive


class World:
    def __init__(self, etcd: EtcdClient, transport: LosingTransport, layout: fd.Layout) -> None:
        self.etcd, self.transport, self.layout = etcd, transport, layout
        self.lease = Lease()
        self.src = DirectoryAuthority(etcd, layout, "src", self.lease, settle_within=3.0)
        self.tgt = DirectoryAuthority(etcd, layout, "tgt", Lease())

    async def entry(self) -> fd.AgentEntry:
        kv = await self.etcd.get(self.layout.agent(AGENT))
        assert kv is not None
        return fd.decode_agent(kv.value)


@pytest.fixture
async def world(etcd_server: EtcdServer) -> AsyncIterator[World]:
    transport = LosingTransport()
    layout = fd.Layout(b"/capsulefs-test/" + secrets.token_hex(4).encode() + b"/")
    async with httpx.AsyncClient(transport=transport, timeout=5.0, trust_env=False) as http:
        w = World(EtcdClient([etcd_server.url], http), transport, layout)
        assert await w.src.claim(AGENT, 3)
        assert not await w.tgt.claim(AGENT, 9)  # (claimed once)
        yield w


async def _register(w: World, host: str) -> int:
    return (await register_host(w.etcd, w.layout, fd.HostEntry(host_id=host, address=f"{host}:7000"), 30)).id


async def test_a_commit_applies_and_the_target_confirms(world: World) -> None:
    await _register(world, "tgt")
    ticket = await world.src.begin(AGENT, 3, "tgt", 4)
    assert (await world.src.commit(ticket)).outcome is Outcome.ACTIVE
    assert await world.entry() == fd.AgentEntry(host_id="tgt", epoch=4)
    assert await world.tgt.confirm(AGENT, 4)
    assert not await world.src.confirm(AGENT, 3)  # the source never runs it again
    with pytest.raises(NotTheHolder, match="does not name src at epoch 3"):
        await world.src.begin(AGENT, 3, "tgt", 5)


async def test_a_commit_whose_reply_was_lost_after_it_applied_is_settled_active(world: World) -> None:
    await _register(world, "tgt")
    ticket = await world.src.begin(AGENT, 3, "tgt", 4)
    world.transport.lose_next(TXN, applied=True)
    verdict = await world.src.commit(ticket)
    assert world.transport.lost, "the seam lost no reply"
    assert verdict.outcome is Outcome.ACTIVE, verdict
    assert await world.entry() == fd.AgentEntry(host_id="tgt", epoch=4)
    kv = await world.etcd.get(world.layout.agent(AGENT))
    assert kv is not None and kv.version == ticket.seen.version + 1  # written once: the settle only read
    assert await world.tgt.confirm(AGENT, 4)


async def test_a_commit_lost_before_etcd_is_fenced_and_can_never_apply_late(world: World,
                                                                          etcd_server: EtcdServer) -> None:
    await _register(world, "tgt")
    ticket = await world.src.begin(AGENT, 3, "tgt", 4)
    world.transport.lose_next(TXN, applied=False)
    verdict = await world.src.commit(ticket)
    assert verdict.outcome is Outcome.NEVER, verdict
    assert "rewritten as it was" in verdict.why
    assert await world.entry() == fd.AgentEntry(host_id="src", epoch=3)
    # the lost commit reaches etcd now, late: the fence moved the key's mod_revision, so it fails
    (late_body,) = world.transport.lost
    async with httpx.AsyncClient(trust_env=False) as http:
        resp = await http.post(etcd_server.url + TXN, content=late_body)
    assert resp.status_code == 200
    assert '"succeeded":true' not in resp.text.replace(" ", "")
    assert await world.entry() == fd.AgentEntry(host_id="src", epoch=3)
    assert await world.src.confirm(AGENT, 3)  # the source may resume
    assert not await world.tgt.confirm(AGENT, 4)


async def test_a_commit_that_cannot_be_settled_is_in_doubt_until_asked_again(world: World) -> None:
    await _register(world, "tgt")
    ticket = await world.src.begin(AGENT, 3, "tgt", 4)
    world.transport.lose_next(TXN, applied=True)
    world.transport.lose_next("/v3/kv/range", applied=True, count=10**6)  # etcd answers no read for now
    with pytest.raises(CommitInDoubt, match="in doubt") as info:
        await world.src.commit(ticket)
    world.transport.lose_next("/v3/kv/range", applied=True, count=0)
    verdict = await world.src.settle(info.value.ticket)  # the move machine's status question, later
    assert verdict.outcome is Outcome.ACTIVE
    assert await world.entry() == fd.AgentEntry(host_id="tgt", epoch=4)


async def test_a_commit_to_a_target_without_a_lease_never_applies(world: World) -> None:
    ticket = await world.src.begin(AGENT, 3, "tgt", 4)  # tgt never registered
    verdict = await world.src.commit(ticket)
    assert verdict.outcome is Outcome.NEVER and "lease is gone" in verdict.why
    assert await world.entry() == fd.AgentEntry(host_id="src", epoch=3)


async def test_a_host_without_a_live_lease_neither_moves_nor_runs(world: World) -> None:
    world.lease.alive = False
    with pytest.raises(NotTheHolder, match="no live lease"):
        await world.src.begin(AGENT, 3, "tgt", 4)
    assert not await world.src.confirm(AGENT, 3)


async def test_a_prepared_target_activates_only_once_named_and_else_fences(world: World) -> None:
    await _register(world, "tgt")
    # no commit came: the gate fences the source's entry, so a commit on its way can never apply
    ticket = await world.src.begin(AGENT, 3, "tgt", 4)
    assert await world.tgt.gate(AGENT, 4, "src") is Outcome.NEVER
    assert (await world.src.commit(ticket)).outcome is Outcome.NEVER
    # a commit applied: the gate says active
    ticket = await world.src.begin(AGENT, 3, "tgt", 4)
    assert (await world.src.commit(ticket)).outcome is Outcome.ACTIVE
    # named, but not under a live lease (a target just restarted): never "never", ask again
    tgt_lease = Lease()
    tgt_lease.alive = False
    restarted = DirectoryAuthority(world.etcd, world.layout, "tgt", tgt_lease)
    with pytest.raises(NotTheHolder, match="ask again"):
        await restarted.gate(AGENT, 4, "src")
    tgt_lease.alive = True
    assert await restarted.gate(AGENT, 4, "src") is Outcome.ACTIVE
    assert await world.tgt.gate(AGENT, 4, "src") is Outcome.ACTIVE


async def test_a_takeover_only_once_the_holders_lease_is_gone(world: World) -> None:
    src_lease = await _register(world, "src")
    other = DirectoryAuthority(world.etcd, world.layout, "other", Lease())
    assert await other.takeover(AGENT) is None  # src's lease lives
    assert await world.entry() == fd.AgentEntry(host_id="src", epoch=3)
    await world.etcd.revoke(src_lease)  # (as its expiry would)
    with trio.fail_after(10):
        assert await other.takeover(AGENT, above=5) == 6
    assert await world.entry() == fd.AgentEntry(host_id="other", epoch=6)
    assert not await world.src.confirm(AGENT, 3)  # src, back with a new lease, does not run it
