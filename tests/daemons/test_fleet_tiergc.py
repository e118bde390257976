"""The fleet's gc of the blob tier (capsulefs/fleet/tiergc.py, live.py) against a real etcd
and a real SeaweedFS (``weed mini``), the hosts' parts (store, uploader, live set publisher)
run in this process:

  * a blob only a removed agent named is deleted once older than the grace; one named
    by any host's live set stays, a host whose lease is gone included; a young one stays;
  * a host that holds an agent and has no live set, or a live host whose set is stale:
    the gc refuses in one line and deletes nothing;
  * two gcs at once: the second refuses; the first's marks, left by a gc that died,
    are stale for the hosts and removed by the next gc;
  * a put racing the gc (stopped between its marks and its deletes by the
    CAPSULEFS_TEST_GC_PAUSE seam's files): the put answered 412 under the mark does not
    count, and the blob ends in the tier; a blob a host names after the mark stays;
  * the eviction rule: only blobs a published set names, confirmed afterwards in the tier
    with no live mark.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio

from capsulefs.core.capsule import format as fmt
from capsulefs.core.fleet import directory as fd
from capsulefs.core.fleet import liveset as ls
from capsulefs.core.store.host_store import HostStore
from capsulefs.fleet.directory import claim_agent, register_host
from capsulefs.fleet.etcd import EtcdClient, open_etcd
from capsulefs.fleet.live import EvictionRecord, LivePublisher, Marks, may_evict
from capsulefs.fleet.s3 import BlobTier, S3Client
from capsulefs.fleet.tier import TierBlobs
from capsulefs.fleet.tiergc import GcRefused, TierGcReport, run_tier_gc
from capsulefs.fleet.uploader import TierRecord, TierUploader
from fleet_kit import EtcdServer
from helpers import HANG


@pytest.fixture
async def etcd(etcd_server: EtcdServer) -> AsyncIterator[EtcdClient]:
    async with open_etcd(etcd_server.spec, timeout=HANG) as client:
        yield client


@pytest.fixture
def layout() -> fd.Layout:
    return fd.Layout(f"/gc-{secrets.token_hex(4)}/".encode())


@dataclass
class Host:
    """One host's parts on the tier: its store, uploader and live set publisher."""

    host_id: str
    store: HostStore
    uploader: TierUploader
    live: LivePublisher
    record: EvictionRecord

    def agent(self, *blobs: bytes) -> tuple[str, list[str]]:
        with self.store.writing():
            shas = [self.store.put_blob(b) for b in blobs]
        agent = self.store.create_agent(f"a-{secrets.token_hex(3)}", host_id=self.host_id,
                                        agent_id=secrets.token_hex(16))
        agent.write_files({fmt.SNAPSHOT: fmt.snapshot_bytes({f"f{i}": s for i, s in enumerate(shas)})},
                          add_blobs=set(shas))
        return agent.agent_id, shas

    async def settle(self) -> None:
        """Every blob put, then a round of the publisher (the set published, evictions confirmed)."""
        with trio.fail_after(HANG):
            await self.uploader.wait_idle()
        await self.live.round()

    def may_evict(self, sha: str) -> bool:
        return may_evict(self.record.load(), sha)


@asynccontextmanager
async def running_host(tmp_path: Path, name: str, s3: S3Client, etcd: EtcdClient,
                       layout: fd.Layout) -> AsyncIterator[Host]:
    tier = BlobTier(s3)
    host_id = f"host-{name}"
    uploader: TierUploader | None = None
    marks = Marks(tier, etcd, layout)

    def notice(sha: str) -> None:
        if uploader is not None:
            uploader.notice(sha)

    store = HostStore.open(tmp_path / name, on_blob=notice)
    uploader = TierUploader(TierBlobs(tier, store), store, TierRecord(store.root, str(s3.tier)), marks=marks,
                            backoff_first=0.05, backoff_most=0.2)
    record = EvictionRecord(store.root, str(s3.tier))
    live = LivePublisher(store, tier, etcd, layout, host_id, record, uploader, marks)
    async with trio.open_nursery() as nursery:
        await nursery.start(uploader.serve)
        yield Host(host_id, store, uploader, live, record)
        nursery.cancel_scope.cancel()


async def in_tier(s3: S3Client, sha: str) -> bool:
    return await BlobTier(s3).has(sha)


async def gc(etcd: EtcdClient, s3: S3Client, layout: fd.Layout, **kw: object) -> TierGcReport:
    kw.setdefault("grace", 0.0)
    kw.setdefault("clock", lambda: time.time() + 5)  # (LastModified has whole seconds)
    return await run_tier_gc(etcd, s3, layout, **kw)  # type: ignore[arg-type]


async def test_a_blob_only_a_removed_agent_named_goes_and_every_named_one_stays(
        tmp_path: Path, s3: S3Client, etcd: EtcdClient, layout: fd.Layout) -> None:
    async with running_host(tmp_path, "a", s3, etcd, layout) as a, running_host(tmp_path, "b", s3, etcd, layout) as b:
        kept_id, (kept,) = a.agent(os.urandom(5000))
        gone_id, (gone, shared) = a.agent(os.urandom(7000), b"shared by a and b")
        b_id, (b_only, b_shared) = b.agent(os.urandom(3000), b"shared by a and b")
        assert b_shared == shared
        for h, agent_id in ((a, kept_id), (a, gone_id), (b, b_id)):
            assert await claim_agent(etcd, layout, agent_id, fd.AgentEntry(host_id=h.host_id, epoch=1))
        await a.settle()
        await b.settle()  # (b never had a lease: its set is the last word of a host that is gone)
        a.store.remove_agent(gone_id)
        a.store.gc()
        await a.settle()
        young = await gc(etcd, s3, layout, grace=3600.0, clock=time.time)
        assert (young.deleted, young.young) == (0, 1)  # (gone is unnamed, but younger than the grace)
        report = await gc(etcd, s3, layout)
        assert (report.deleted, report.candidates, report.named) == (1, 1, 3)
        assert report.freed == 7000 and report.sets == {a.host_id: 2, b.host_id: 1}
        assert not await in_tier(s3, gone)
        for sha in (kept, shared, b_only):
            assert await in_tier(s3, sha)
        assert [o async for o in s3.list(ls.marks_prefix(s3.tier.prefix))] == []  # (its marks removed)
        assert await etcd.get(ls.gc_key(layout)) is None  # (its key released)


async def test_a_holder_without_a_live_set_or_a_live_host_with_a_stale_one_stops_the_gc(
        tmp_path: Path, s3: S3Client, etcd: EtcdClient, layout: fd.Layout) -> None:
    async with running_host(tmp_path, "a", s3, etcd, layout) as a:
        a_id, (orphan,) = a.agent(b"x" * 100)
        await a.settle()
        a.store.remove_agent(a_id)
        await a.settle()
        assert await claim_agent(etcd, layout, secrets.token_hex(16), fd.AgentEntry(host_id="host-c", epoch=1))
        with pytest.raises(GcRefused, match="host host-c holds 1 agent.* has published no live set") as err:
            await gc(etcd, s3, layout)
        assert "\n" not in str(err.value)
        assert await in_tier(s3, orphan)
        assert await etcd.get(ls.gc_key(layout)) is None
        # host-c publishes, then stops renewing its set's time while its lease lives
        await etcd.put(ls.pointer_key(layout, "host-c"), ls.LivePointer(
            host_id="host-c", generation=1, count=0, sha256="0" * 64, checked=int(time.time()) - 7200).encode())
        lease = await register_host(etcd, layout, fd.HostEntry(host_id="host-c", address="-"), 30)
        try:
            with pytest.raises(GcRefused, match="host host-c's live set was last found current 72.. s ago"):
                await gc(etcd, s3, layout)
        finally:
            await etcd.revoke(lease.id)
        with pytest.raises(GcRefused, match="host host-c's live set .generation 1. is not in the tier"):
            await gc(etcd, s3, layout)  # (its lease gone, its pointer stands; the set it names must be there)
        assert await in_tier(s3, orphan)


async def test_two_gcs_at_once_the_second_refuses(tmp_path: Path, s3: S3Client, etcd: EtcdClient,
                                                  layout: fd.Layout) -> None:
    pause = tmp_path / "pause"
    pause.mkdir()
    async with running_host(tmp_path, "a", s3, etcd, layout) as a:
        a_id, (orphan,) = a.agent(b"y" * 100)
        await a.settle()
        a.store.remove_agent(a_id)
        await a.settle()
        async with trio.open_nursery() as nursery:
            first: list[TierGcReport] = []

            async def run_first() -> None:
                first.append(await gc(etcd, s3, layout, pause=str(pause)))

            nursery.start_soon(run_first)
            with trio.fail_after(HANG):
                while not (pause / "marked").exists():
                    await trio.sleep(0.02)
            with pytest.raises(GcRefused, match="another tier gc runs: .* pid"):
                await gc(etcd, s3, layout)
            assert await Marks(BlobTier(s3), etcd, layout).live_mark(orphan)
            (pause / "go").touch()
        assert first[0].deleted == 1
        assert not await in_tier(s3, orphan)


async def test_a_dead_gcs_marks_are_stale_for_hosts_and_removed_by_the_next(
        tmp_path: Path, s3: S3Client, etcd: EtcdClient, layout: fd.Layout) -> None:
    async with running_host(tmp_path, "a", s3, etcd, layout) as a:
        _, (sha,) = a.agent(b"z" * 100)
        await a.settle()
        await s3.put(ls.mark_key(s3.tier.prefix, sha), ls.encode_mark("ab" * 16))  # (its gc died: no gc key)
        marks = Marks(BlobTier(s3), etcd, layout)
        assert not await marks.live_mark(sha)
        report = await gc(etcd, s3, layout)
        assert (report.stale_marks, report.deleted) == (1, 0)
        assert [o async for o in s3.list(ls.marks_prefix(s3.tier.prefix))] == []


async def test_a_put_racing_the_gc_ends_with_the_blob_in_the_tier(tmp_path: Path, s3: S3Client, etcd: EtcdClient,
                                                                  layout: fd.Layout) -> None:
    pause = tmp_path / "pause"
    pause.mkdir()
    data, named_later = b"raced" * 1000, b"named after the mark" * 100
    async with running_host(tmp_path, "a", s3, etcd, layout) as a, running_host(tmp_path, "b", s3, etcd, layout) as b, \
            running_host(tmp_path, "c", s3, etcd, layout) as c:
        a_id, (sha, sha2) = a.agent(data, named_later)
        await a.settle()
        a.store.remove_agent(a_id)
        a.store.gc()
        await a.settle()  # (a's set names neither now)
        report: list[TierGcReport] = []

        async def run_gc() -> None:
            report.append(await gc(etcd, s3, layout, pause=str(pause)))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_gc)
            with trio.fail_after(HANG):
                while not (pause / "marked").exists():
                    await trio.sleep(0.02)
            # b stores the same bytes while the gc's marks are out: the tier answers 412 under a live mark
            b.agent(data)
            with trio.fail_after(HANG):
                while b.uploader.problem is None or "mark" not in b.uploader.problem:
                    await trio.sleep(0.02)
            assert sha not in b.uploader.known_blobs() and b.uploader.pending
            # c names the other blob and publishes its set before the gc reads the sets again
            c.agent(named_later)
            await c.live.round()  # (its put is answered 412 under a live mark: it waits for the mark to go)
            assert not c.may_evict(sha2)
            (pause / "go").touch()
        assert report[0].deleted == 1  # (b had published no set: the gc took it)
        assert not await in_tier(s3, sha) or sha in b.uploader.known_blobs()
        await b.settle()  # (b put it again once the mark went)
        assert await in_tier(s3, sha) and await in_tier(s3, sha2)
        assert sha in b.uploader.known_blobs() and b.may_evict(sha)
        await c.settle()
        assert c.may_evict(sha2)


async def test_the_eviction_rule(tmp_path: Path, s3: S3Client, etcd: EtcdClient, layout: fd.Layout) -> None:
    async with running_host(tmp_path, "a", s3, etcd, layout) as a:
        _, (named,) = a.agent(b"named" * 10)
        with trio.fail_after(HANG):
            await a.uploader.wait_idle()
        assert not a.may_evict(named)  # put, but no set naming it published yet
        with a.store.writing():
            loose = a.store.put_blob(b"put, named by no manifest")
        await a.settle()
        assert a.may_evict(named) and not a.may_evict(loose)
        # a blob the tier lost behind the record's back: the confirmation finds it gone and puts it again
        _, (lost,) = a.agent(b"lost" * 10)
        with trio.fail_after(HANG):
            await a.uploader.wait_idle()
        await s3.delete(BlobTier(s3).key(lost))
        await a.live.round()
        assert not a.may_evict(lost)
        await a.settle()
        assert await in_tier(s3, lost)
        await a.live.round()
        assert a.may_evict(lost)
        # no longer named: out of the record before the set that drops it is published
        for agent in a.store.agents():
            a.store.remove_agent(agent.agent_id)
        await a.live.round()
        assert not a.may_evict(named) and not a.may_evict(lost)
