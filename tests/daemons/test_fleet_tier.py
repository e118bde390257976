"""The host store's blobs on the blob tier (capsulefs.fleet.tier) against a
real SeaweedFS (``weed mini``): put once (a 412 is fine), verified reads, which
blobs the tier lacks, and a parallel, bounded fetch into another host's store
through the store's durable path."""

from __future__ import annotations

import os
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import trio

from capsulefs.core.errors import CorruptBlobError
from capsulefs.core.store.host_store import HostStore
from capsulefs.fleet.s3 import BlobTier, S3Client
from capsulefs.fleet.tier import TierBlobs, TierFetchError




class Counting:
    """The real tier, with the fetches in flight and the bytes handed to puts
    counted (the bound and what reaches the tier are the properties)."""

    def __init__(self, tier: BlobTier) -> None:
        self.tier = tier
        self.in_flight = 0
        self.most = 0
        self.put_bytes = 0

    async def put_stream(self, digest: str, chunks: Callable[[], AsyncIterable[bytes]], *, size: int) -> bool:
        async def counted() -> AsyncIterator[bytes]:
            async for chunk in chunks():
                self.put_bytes += len(chunk)
                yield chunk

        return await self.tier.put_stream(digest, counted, size=size)

    async def has(self, digest: str) -> bool:
        return await self.tier.has(digest)

    async def fetch(self, digest: str, sink: Callable[[bytes], Awaitable[None]], *, limit: int) -> int:
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        try:
            await trio.sleep(0)  # (let every task that can start do so before this one goes on)
            return await self.tier.fetch(digest, sink, limit=limit)
        finally:
            self.in_flight -= 1


def _blobs(n: int, size: int) -> list[bytes]:
    return [os.urandom(size) for _ in range(n)]


def _staging_empty(store: HostStore) -> bool:
    return not os.path.isdir(store.staging_dir) or not os.listdir(store.staging_dir)


async def test_put_once_and_get_verified(s3: S3Client, tmp_path: Path) -> None:
    store = HostStore.open(tmp_path / "a")
    tier = BlobTier(s3)
    blobs = TierBlobs(tier, store)
    data = os.urandom(3 << 20)  # (several of the store's chunks)
    sha = store.put_blob(data)
    assert await blobs.put(sha) is True
    assert await blobs.put(sha) is False  # the tier answered 412: already there, fine
    other = TierBlobs(tier, HostStore.open(tmp_path / "b"))
    assert await other.get(sha, size=len(data)) == data
    empty = store.put_blob(b"")
    assert await blobs.put(empty) is True and await other.get(empty) == b""


async def test_a_wrong_body_from_the_tier_is_refused(s3: S3Client, tmp_path: Path) -> None:
    store = HostStore.open(tmp_path / "a")
    tier = BlobTier(s3)
    sha = store.put_blob(b"the real bytes")
    await s3.put(tier.key(sha), b"other bytes!!!")  # (the tier's copy went bad, or a hostile store)
    blobs = TierBlobs(tier, HostStore.open(tmp_path / "b"))
    with pytest.raises(CorruptBlobError) as info:
        await blobs.get(sha)
    assert sha in str(info.value) and "\n" not in str(info.value)


@pytest.mark.expect_error_log  # (the store logs the copy it quarantines)
async def test_a_local_copy_that_does_not_hash_to_its_name_is_not_put(s3: S3Client, tmp_path: Path) -> None:
    store = HostStore.open(tmp_path / "a")
    data = os.urandom(3 << 20)
    sha = store.put_blob(data)
    path = store.blob_file(sha)
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(len(data) - 1)
        f.write(bytes([data[-1] ^ 1]))  # rot in the last byte: found only once all is read
    tier = BlobTier(s3)
    counting = Counting(tier)
    with pytest.raises(CorruptBlobError, match=sha):
        await TierBlobs(counting, store).put(sha)
    assert counting.put_bytes < len(data)  # its last chunk was held back: the tier never had it whole
    blobs = TierBlobs(tier, store)
    reader = TierBlobs(tier, HostStore.open(tmp_path / "b"))
    with pytest.raises(Exception) as info:  # nothing whole was stored: not found, or a torn copy refused
        await reader.get(sha, size=len(data))
    assert type(info.value).__name__ in ("ObjectNotFound", "CorruptBlobError"), info.value
    assert not store.has_blob(sha)  # quarantined by the store
    store.put_blob(data)  # (the good bytes again, as a later move or import would bring them)
    await blobs.put(sha)
    assert await reader.get(sha, size=len(data)) == data


async def test_which_blobs_the_tier_lacks(s3: S3Client, tmp_path: Path) -> None:
    store = HostStore.open(tmp_path / "a")
    shas = [store.put_blob(b) for b in _blobs(6, 1000)]
    blobs = TierBlobs(BlobTier(s3), store, concurrency=3)
    for sha in shas[::2]:
        await blobs.put(sha)
    assert await blobs.lacking(shas + shas[:2]) == shas[1::2]
    assert await blobs.put_many(shas) == 3
    assert await blobs.lacking(shas) == []


async def test_fetch_into_store_is_parallel_bounded_and_durable(s3: S3Client, tmp_path: Path) -> None:
    src = HostStore.open(tmp_path / "a")
    datas = _blobs(20, 70_000)
    shas = [src.put_blob(b) for b in datas]
    tier = BlobTier(s3)
    assert await TierBlobs(tier, src).put_many(shas) == 20
    dst = HostStore.open(tmp_path / "b")
    dst.put_blob(datas[0])  # the target has one already
    counting = Counting(tier)
    report = await TierBlobs(counting, dst, concurrency=4).fetch_into_store({s: len(d) for s, d in zip(shas, datas)})
    assert report.present == shas[:1] and sorted(report.fetched) == sorted(shas[1:])
    assert report.bytes == 19 * 70_000
    assert 1 < counting.most <= 4, counting.most
    for sha, data in zip(shas, datas):
        dst.verify_blob(sha)
        assert dst.read_blob(sha) == data
    assert _staging_empty(dst)


async def test_a_bad_blob_in_a_fetch_is_named_and_the_others_are_stored(s3: S3Client, tmp_path: Path) -> None:
    src = HostStore.open(tmp_path / "a")
    datas = _blobs(5, 5000)
    shas = [src.put_blob(b) for b in datas]
    tier = BlobTier(s3)
    blobs = TierBlobs(tier, src)
    await blobs.put_many(shas[:4])  # the fifth never reached the tier
    await s3.delete(tier.key(shas[1]))
    await s3.put(tier.key(shas[1]), os.urandom(5000))  # same size, wrong bytes
    dst = HostStore.open(tmp_path / "b")
    with pytest.raises(TierFetchError) as info:
        await TierBlobs(tier, dst).fetch_into_store({s: len(d) for s, d in zip(shas, datas)})
    message = str(info.value)
    assert "2 of 5 blob(s)" in message and "\n" not in message
    assert [dst.has_blob(s) for s in shas] == [True, False, True, True, False]
    dst.verify_blob(shas[0])
    assert _staging_empty(dst)
