"""The daemon's blob tier components against a real SeaweedFS (``weed mini``):
the uploader (capsulefs/fleet/uploader.py: every blob the store places is put,
a durable record of what the tier holds, the reconcile at start) and the
move target's fetch for an offer (capsulefs/fleet/tier_moves.py: what the
tier holds is fetched, verified, and kept from gc until the move's own
staging manifest names it)."""

from __future__ import annotations

import os
import secrets
from contextlib import ExitStack
from pathlib import Path

import pytest
import trio

from capsulefs.core.capsule import format as fmt
from capsulefs.core.fleet.s3_wire import parse_tier_url
from capsulefs.core.fleet.sigv4 import Credentials
from capsulefs.core.store.host_store import HostStore
from capsulefs.fleet.s3 import BlobTier, S3Client, open_s3
from capsulefs.fleet.tier import TierBlobs
from capsulefs.fleet.tier_moves import TierOffers
from capsulefs.fleet.uploader import TierRecord, TierUploader
from fleet_kit import free_ports
from helpers import HANG




class CountingPuts:
    """TierBlobs, with the puts it was asked for counted."""

    def __init__(self, blobs: TierBlobs) -> None:
        self.blobs = blobs
        self.asked: list[str] = []

    async def put(self, sha256: str) -> bool:
        self.asked.append(sha256)
        return await self.blobs.put(sha256)


async def _until(cond, what: str) -> None:  # type: ignore[no-untyped-def]
    with trio.fail_after(HANG):
        while not await cond():
            await trio.sleep(0.02)


async def test_the_uploader_puts_each_blob_the_store_places_and_records_it(s3: S3Client, tmp_path: Path) -> None:
    tier = BlobTier(s3)
    record = TierRecord(str(tmp_path / "a"), "tier")
    holder: list[TierUploader] = []
    store = HostStore.open(tmp_path / "a", on_blob=lambda sha: holder[0].notice(sha) if holder else None)
    early = store.put_blob(os.urandom(10_000))  # (placed before the uploader serves: found at its start)
    puts = CountingPuts(TierBlobs(tier, store))
    uploader = TierUploader(puts, store, record)
    holder.append(uploader)
    async with trio.open_nursery() as nursery:
        await nursery.start(uploader.serve)
        later = await trio.to_thread.run_sync(store.put_blob, os.urandom(20_000))  # (told from a worker thread)
        await _until(lambda: tier.has(later), "the blob stored after the start put")
        await uploader.wait_idle()
        assert await tier.has(early)
        nursery.cancel_scope.cancel()
    assert record.load() == {early, later}
    assert sorted(puts.asked) == sorted([early, later])

    # A new run with the same record puts nothing it names, and nothing is asked of the tier.
    again = CountingPuts(TierBlobs(tier, store))
    fresh = store.put_blob(os.urandom(5_000))  # (stored while no uploader ran: another process, say)
    second = TierUploader(again, store, record)
    async with trio.open_nursery() as nursery:
        await nursery.start(second.serve)
        await _until(lambda: tier.has(fresh), "the blob stored meanwhile, put at start")
        await second.wait_idle()
        nursery.cancel_scope.cancel()
    assert again.asked == [fresh]


async def test_blobs_fetched_from_the_tier_are_not_put_back(s3: S3Client, tmp_path: Path) -> None:
    tier = BlobTier(s3)
    source = HostStore.open(tmp_path / "a")
    shas = [source.put_blob(os.urandom(3000)) for _ in range(4)]
    await TierBlobs(tier, source).put_many(shas)
    holder: list[TierUploader] = []
    target = HostStore.open(tmp_path / "b", on_blob=lambda sha: holder[0].notice(sha))
    puts = CountingPuts(TierBlobs(tier, target))
    uploader = TierUploader(puts, target, TierRecord(str(tmp_path / "b"), "tier"))
    holder.append(uploader)
    offers = TierOffers(TierBlobs(tier, target), target, uploader)
    manifest = _manifest(shas)
    async with trio.open_nursery() as nursery:
        await nursery.start(uploader.serve)
        with ExitStack() as keep:
            await offers.fetch_for_offer(manifest, keep)
        await uploader.wait_idle()
        nursery.cancel_scope.cancel()
    assert all(target.has_blob(sha) for sha in shas)
    assert puts.asked == []


def _manifest(shas: list[str]) -> fmt.Manifest:
    store_files = {f"artifacts/blobs/{sha}": fmt.FileEntry(sha256=sha, size=3000) for sha in shas}
    return fmt.Manifest(agent_id=secrets.token_hex(16), name="carrier",
                        holder=fmt.Holder(host="a" * 64, epoch=2), files=store_files)


async def test_what_an_offer_fetched_is_kept_from_gc_until_the_move_names_it(s3: S3Client, tmp_path: Path) -> None:
    tier = BlobTier(s3)
    source = HostStore.open(tmp_path / "a")
    shas = [source.put_blob(os.urandom(3000)) for _ in range(5)]
    await TierBlobs(tier, source).put_many(shas[:4])  # the tier lacks the last one
    target = HostStore.open(tmp_path / "b")
    offers = TierOffers(TierBlobs(tier, target), target)
    with ExitStack() as keep:
        await offers.fetch_for_offer(_manifest(shas), keep)
        assert [target.has_blob(sha) for sha in shas] == [True] * 4 + [False]
        assert offers.fetched_bytes == 4 * 3000
        report = await trio.to_thread.run_sync(target.gc)
        assert report.removed == 0 and all(target.has_blob(sha) for sha in shas[:4])
    # The offer ended (in a move, its staging manifest names them by now): nothing here lists them.
    report = await trio.to_thread.run_sync(target.gc)
    assert report.removed == 4 and os.listdir(target.staging_dir) == []


async def test_a_tier_that_is_down_leaves_every_blob_to_the_source(tmp_path: Path) -> None:
    (port,) = free_ports(1)  # (nothing listens there)
    async with open_s3(parse_tier_url(f"http://127.0.0.1:{port}/fleet-blobs"), Credentials("k", "s")) as s3:
        target = HostStore.open(tmp_path / "b")
        offers = TierOffers(TierBlobs(BlobTier(s3), target), target)
        with ExitStack() as keep:
            await offers.fetch_for_offer(_manifest(["ab" * 32, "cd" * 32]), keep)  # (no error: logged)
        assert offers.fetched_bytes == 0


def test_the_record_survives_a_torn_append(tmp_path: Path) -> None:
    record = TierRecord(str(tmp_path), "tier")
    a, b, c = ("1" * 64, "2" * 64, "3" * 64)
    record.add([a])
    with open(record.path, "ab") as f:
        f.write(b"2222")  # a crash in the middle of an append
    assert record.load() == {a}
    record.add([b, c])
    assert record.load() == {a, b, c}


async def test_a_warm_call_is_checked_and_fetches_only_on_a_tier(s3: S3Client, tmp_path: Path) -> None:
    from capsulefs.move.warm import answer_warm
    from capsulefs.peer.errors import CallFailed

    tier = BlobTier(s3)
    source = HostStore.open(tmp_path / "a")
    shas = [source.put_blob(os.urandom(3000)) for _ in range(3)]
    await TierBlobs(tier, source).put_many(shas)
    target = HostStore.open(tmp_path / "b")
    manifest = _manifest(shas)
    args = {"agent_id": manifest.agent_id, "manifest": manifest.to_bytes().decode()}
    for bad, words in [({}, "agent"), ({**args, "manifest": "{"}, "valid manifest"),
                       ({**args, "agent_id": "f" * 32}, "sent to warm")]:
        with pytest.raises(CallFailed, match=words):
            await answer_warm(None, bad)
    assert await answer_warm(None, args) == {"tier": False}  # (peer-to-peer: nothing fetched)
    assert not any(target.has_blob(sha) for sha in shas)
    assert await answer_warm(TierOffers(TierBlobs(tier, target), target), args) == {"tier": True}
    assert all(target.has_blob(sha) for sha in shas) and os.listdir(target.staging_dir) == []
