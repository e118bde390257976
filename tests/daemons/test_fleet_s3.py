"""The S3 client and the blob tier against a real SeaweedFS (``weed mini``).

The module shares one weed; each test uses a bucket of its own. weed checks
every request's SigV4 signature against the identity the fixture made, so
these tests also check our signing end to end (special characters in keys,
queries, conditional headers).
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import AsyncIterator

import pytest
import trio

from capsulefs.core.errors import CorruptBlobError
from capsulefs.core.fleet.errors import (
    BlobTierError,
    BlobTierProtocolError,
    BlobTierRefused,
    BlobTierUnavailable,
    BucketNotFound,
    PreconditionFailed,
)
from capsulefs.core.fleet.s3_wire import parse_tier_url
from capsulefs.core.fleet.sigv4 import Credentials
from capsulefs.fleet.s3 import BlobTier, S3Client, open_s3
from fleet_kit import WeedServer, free_ports
from helpers import HANG



def creds(weed: WeedServer) -> Credentials:
    return Credentials(weed.access_key, weed.secret_key)


@pytest.fixture
async def s3(weed_server: WeedServer) -> AsyncIterator[S3Client]:
    bucket = "test-" + secrets.token_hex(4)
    async with open_s3(parse_tier_url(weed_server.tier_url(bucket, "fleet")), creds(weed_server)) as client:
        assert await client.create_bucket() is True
        yield client


async def test_create_bucket_twice(s3: S3Client) -> None:
    assert await s3.create_bucket() is False


async def test_put_get_head_list_delete_with_awkward_keys(s3: S3Client) -> None:
    keys = ["fleet/plain", "fleet/a b$c/é+x=y&z", "fleet/~tilde*star(paren)'"]
    etags = {key: await s3.put(key, key.encode() * 3) for key in keys}
    for key in keys:
        assert await s3.get(key, limit=1000) == key.encode() * 3
        info = await s3.head(key)
        assert info is not None and info.size == len(key.encode()) * 3 and info.etag == etags[key]
    assert sorted(o.key for o in [o async for o in s3.list("fleet/")]) == sorted(keys)
    assert [o.key async for o in s3.list("fleet/a b")] == ["fleet/a b$c/é+x=y&z"]
    await s3.delete(keys[1])
    await s3.delete(keys[1])  # a second delete is no error
    assert await s3.head(keys[1]) is None
    with pytest.raises(BlobTierRefused, match="no such object"):
        await s3.get(keys[1], limit=10)


async def test_list_follows_continuation_tokens(s3: S3Client) -> None:
    for i in range(7):
        await s3.put(f"fleet/p/{i}", b"x")
    assert [o.key async for o in s3.list("fleet/p/", page_size=2)] == [f"fleet/p/{i}" for i in range(7)]


async def test_if_none_match_refuses_a_second_write(s3: S3Client) -> None:
    await s3.put("fleet/once", b"first", if_none_match=True)
    with pytest.raises(PreconditionFailed):
        await s3.put("fleet/once", b"second", if_none_match=True)
    assert await s3.get("fleet/once", limit=100) == b"first"


async def test_if_match_writes_only_over_the_etag_given(s3: S3Client) -> None:
    first = await s3.put("fleet/cas", b"one")
    second = await s3.put("fleet/cas", b"two", if_match=first)
    with pytest.raises(PreconditionFailed):
        await s3.put("fleet/cas", b"three", if_match=first)
    assert await s3.get("fleet/cas", limit=100) == b"two"
    assert (await s3.head("fleet/cas")).etag == second  # type: ignore[union-attr]


async def test_a_body_over_the_limit_is_refused(s3: S3Client) -> None:
    await s3.put("fleet/big", b"x" * 5000)
    with pytest.raises(BlobTierProtocolError, match="more than the 4096"):
        await s3.get("fleet/big", limit=4096)
    got: list[bytes] = []

    async def sink(chunk: bytes) -> None:
        got.append(chunk)

    with pytest.raises(BlobTierProtocolError, match="more than the 100"):
        await s3.get_into("fleet/big", sink, limit=100)


async def test_blob_tier_stores_once_and_verifies_on_read(s3: S3Client) -> None:
    tier = BlobTier(s3)
    data = secrets.token_bytes(300_000)
    digest = hashlib.sha256(data).hexdigest()
    assert await tier.put(digest, data) is True
    assert await tier.put(digest, data) is False  # the tier had it
    assert await tier.has(digest)
    assert await tier.get(digest, limit=len(data)) == data
    assert [d async for d in tier.digests()] == [digest]
    with pytest.raises(ValueError):
        await tier.put(digest, data + b"x")


async def test_blob_tier_streams_in_and_out(s3: S3Client) -> None:
    tier = BlobTier(s3)
    data = secrets.token_bytes(3 << 20)
    digest = hashlib.sha256(data).hexdigest()

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(data), 1 << 20):
            yield data[i:i + (1 << 20)]

    assert await tier.put_stream(digest, chunks, size=len(data)) is True
    received = bytearray()

    async def sink(chunk: bytes) -> None:
        received.extend(chunk)

    assert await tier.fetch(digest, sink, limit=len(data)) == len(data)
    assert bytes(received) == data


async def test_a_stream_of_another_length_than_declared_is_refused(s3: S3Client) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b"12345"

    digest = hashlib.sha256(b"12345").hexdigest()
    with pytest.raises(BlobTierError, match="not its declared 6"):
        await s3.put_stream("fleet/short", chunks(), size=6, sha256=digest)
    with pytest.raises(BlobTierError, match="longer than its declared 4"):
        await s3.put_stream("fleet/long", chunks(), size=4, sha256=digest)
    assert await s3.head("fleet/short") is None  # weed refuses a body cut short (499)
    # (the long one was cut before its first byte: weed keeps an empty object
    # for that, which BlobTier replaces; see the next test)


async def test_a_torn_copy_on_the_tier_is_replaced(s3: S3Client, weed_server: WeedServer) -> None:
    """SeaweedFS 4.48 answers 200 to a put whose connection ends before its
    body and keeps an empty object: the blob's name is then taken by the
    wrong bytes. The next put of the blob sees the size is wrong and
    replaces that copy (If-Match on its ETag), so the blob is not lost."""
    tier = BlobTier(s3)
    data = b"the blob a torn upload left empty"
    digest = hashlib.sha256(data).hexdigest()
    key = tier.key(digest)
    headers = [("content-length", str(len(data))), ("if-none-match", "*")]
    url, signed = s3.sign("PUT", key, [], headers, digest)
    with trio.fail_after(HANG):
        stream = await trio.open_tcp_stream("127.0.0.1", url.port)
        async with stream:
            head = f"PUT {url.raw_path.decode()} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in signed)
            await stream.send_all(head.encode() + b"\r\n")
            await stream.send_eof()  # the uploader dies before its first body byte
            answer = await stream.receive_some(4096)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:100]
    assert (await s3.head(key)).size == 0  # type: ignore[union-attr]
    with pytest.raises(CorruptBlobError):
        await tier.get(digest, limit=100)
    assert await tier.put(digest, data) is True
    assert await tier.get(digest, limit=100) == data
    assert await tier.put(digest, data) is False


async def test_a_blob_whose_bytes_do_not_match_its_name_is_refused(s3: S3Client) -> None:
    """The tier's copy rotted or was overwritten outside capsulefs: a read
    names it corrupt instead of handing the bytes out as the blob."""
    tier = BlobTier(s3)
    digest = hashlib.sha256(b"the real blob").hexdigest()
    await s3.put(tier.key(digest), b"something else")
    with pytest.raises(CorruptBlobError, match=f"blobs/{digest}"):
        await tier.get(digest, limit=100)


async def test_wrong_secret_missing_bucket_and_dead_endpoint(weed_server: WeedServer) -> None:
    bad = Credentials(weed_server.access_key, "not-the-secret")
    async with open_s3(parse_tier_url(weed_server.tier_url("anything")), bad) as s3:
        with pytest.raises(BlobTierRefused, match="SignatureDoesNotMatch"):
            await s3.get("x", limit=1)
    async with open_s3(parse_tier_url(weed_server.tier_url("no-such-bucket")), creds(weed_server)) as s3:
        with pytest.raises(BucketNotFound):
            await s3.put("x", b"1")
    dead = free_ports(1)[0]
    async with open_s3(parse_tier_url(f"http://127.0.0.1:{dead}/bucket"), creds(weed_server)) as s3:
        with pytest.raises(BlobTierUnavailable, match="cannot connect"):
            await s3.get("x", limit=1)
