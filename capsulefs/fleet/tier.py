"""The host store's blobs on the blob tier: put once, verify on read, fetch what is missing.

Rules:
  * A blob is named by its sha256 in the tier as in the store. A put is
    ``If-None-Match: *`` (:class:`~capsulefs.fleet.s3.BlobTier`): a 412 means
    the tier has it already, which is success. A put streams the local copy,
    which the store hashes as it reads; if it does not hash to its name the
    last chunk is withheld (the tier stores nothing whole) and the put is
    refused (the store quarantines its copy).
  * Every byte read from the tier is verified against its name before the
    store or the caller sees it as a blob: a wrong body is a one-line
    :class:`CorruptBlobError` naming the blob, and nothing of it lands.
  * A fetch into the store writes each blob to a file in the store's
    staging area (fsynced), verifies it, and then adopts the verified files
    through the store's own durable path (``adopt_blob_files``: rename into
    ``objects/``, each directory fsynced once). At most ``concurrency``
    requests run at once, in one nursery.
  * "Which of these does the tier lack" asks with HEAD requests, at most
    ``concurrency`` at once (S3 has no batched existence check; a listing
    would cost in proportion to the tier, not to the question).

Theory of operation: :class:`TierBlobs` is built with the tier and the
store (both typed by the Protocols below); its calls are plain coroutines
run by the caller's task (the move's target, the runtime's sync), with
their own nursery for the parallel part. File I/O runs in worker threads.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import BinaryIO, Protocol

import trio

from capsulefs.core.errors import CapsuleError, CorruptBlobError

log = logging.getLogger(__name__)

__all__ = ["BlobStore", "FetchReport", "Tier", "TierBlobs", "TierError", "TierFetchError"]

CONCURRENCY = 8  # requests at once to the tier
MAX_BLOB = 1 << 40  # bytes: the largest blob a get without a known size accepts


class Tier(Protocol):
    """What this module needs of the blob tier (:class:`capsulefs.fleet.s3.BlobTier` has it)."""

    async def put_stream(self, digest: str, chunks: Callable[[], AsyncIterable[bytes]], *, size: int) -> bool: ...

    async def fetch(self, digest: str, sink: Callable[[bytes], Awaitable[None]], *, limit: int) -> int: ...

    async def has(self, digest: str) -> bool: ...


class BlobStore(Protocol):
    """What this module needs of the host store (:class:`capsulefs.core.store.host_store.HostStore` has it)."""

    def has_blob(self, sha256: str) -> bool: ...

    def blob_size(self, sha256: str) -> int: ...

    def iter_blob(self, sha256: str, chunk: int = ...) -> Iterator[bytes]:
        """The blob's chunks; CorruptBlobError at the end if they do not hash to its name."""

    def staging(self, label: str) -> AbstractContextManager[str]: ...

    def adopt_blob_files(self, items: Iterable[tuple[str, str]], *,
                         sync_dirs: Callable[[Iterable[str]], None] | None = None) -> None: ...


class TierError(CapsuleError):
    """Some blobs could not be put to, asked of or fetched from the tier (the others were)."""


class TierFetchError(TierError):
    """Some blobs could not be fetched from the tier (the verified others were stored: ``report``)."""

    def __init__(self, message: str, report: FetchReport | None = None) -> None:
        super().__init__(message)
        self.report = report if report is not None else FetchReport()


@dataclass
class FetchReport:
    fetched: list[str] = field(default_factory=list)  # stored from the tier by this call
    present: list[str] = field(default_factory=list)  # the store had them already
    bytes: int = 0  # fetched from the tier, verified


class TierBlobs:
    """The host store's blobs and the tier's, side by side."""

    def __init__(self, tier: Tier, store: BlobStore, *, concurrency: int = CONCURRENCY) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency {concurrency} is not a positive number")
        self._tier = tier
        self._store = store
        self._limit = trio.CapacityLimiter(concurrency)

    # -- to the tier -----------------------------------------------------------------
    async def put(self, sha256: str) -> bool:
        """Put a blob of the store to the tier once: True if this call stored
        it, False if the tier had it (a 412: fine). CorruptBlobError if the
        local copy does not hash to its name (nothing whole is stored)."""
        size = await trio.to_thread.run_sync(self._store.blob_size, sha256)
        async with self._limit:
            return await self._tier.put_stream(sha256, lambda: self._local_chunks(sha256), size=size)

    async def _local_chunks(self, sha256: str) -> AsyncIterator[bytes]:
        """The local copy's chunks, the last held back until the store's
        ``iter_blob`` has checked that the whole hashes to its name (it
        raises CorruptBlobError at its end, and quarantines the copy)."""
        chunks = self._store.iter_blob(sha256)
        held: bytes | None = None
        try:
            while (chunk := await trio.to_thread.run_sync(next, chunks, None)) is not None:
                if held is not None:
                    yield held
                held = chunk
            if held is not None:
                yield held
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()

    async def put_many(self, shas: Iterable[str]) -> int:
        """Put each of these blobs (in parallel, bounded); how many this call
        stored. Blobs that fail are named in one :class:`TierError` after the
        others are put."""
        stored: list[bool] = []

        async def one(sha: str) -> None:
            stored.append(await self.put(sha))

        await _each(one, dict.fromkeys(shas), "put to the tier")
        return sum(stored)

    # -- from the tier ---------------------------------------------------------------
    async def get(self, sha256: str, *, size: int | None = None) -> bytes:
        """A blob's bytes from the tier, verified (CorruptBlobError if they are not its bytes)."""
        parts: list[bytes] = []

        async def keep(chunk: bytes) -> None:
            parts.append(chunk)

        async with self._limit:
            got = await self._tier.fetch(sha256, keep, limit=MAX_BLOB if size is None else size)
        if size is not None and got != size:
            raise CorruptBlobError(f"tier blob {sha256}", f"{got} bytes", why=f"the tier's copy is not {size} bytes")
        return b"".join(parts)

    async def lacking(self, shas: Iterable[str]) -> list[str]:
        """Which of these blobs the tier does not hold (in the order given, once each)."""
        wanted = list(dict.fromkeys(shas))
        has: dict[str, bool] = {}

        async def ask(sha: str) -> None:
            async with self._limit:
                has[sha] = await self._tier.has(sha)

        await _each(ask, wanted, "asked of the tier")
        return [sha for sha in wanted if not has[sha]]

    async def fetch_into_store(self, sizes: Mapping[str, int]) -> FetchReport:
        """Fetch the blobs the store lacks of ``sizes`` (digest -> size, from
        a manifest), in parallel, verify each, and store them durably. Blobs
        that fail are named in one :class:`TierFetchError` after the others
        are stored."""
        report = FetchReport()
        missing = []
        for sha, size in sizes.items():
            if await trio.to_thread.run_sync(self._store.has_blob, sha):
                report.present.append(sha)
            else:
                missing.append((sha, size))
        if not missing:
            return report
        failures: dict[str, str] = {}
        done: list[tuple[str, str]] = []
        with self._store.staging("tier-fetch") as scratch:
            async with trio.open_nursery() as nursery:
                for sha, size in missing:
                    nursery.start_soon(self._fetch_one, sha, size, scratch, done, failures)
            if done:
                await trio.to_thread.run_sync(self._adopt, done)
        report.fetched = [sha for _, sha in done]
        report.bytes = sum(sizes[sha] for sha in report.fetched)
        if failures:
            first = next(iter(failures.items()))
            raise TierFetchError(f"{len(failures)} of {len(missing)} blob(s) not fetched from the tier; "
                                 f"blob {first[0]}: {first[1]}", report)
        return report

    def _adopt(self, done: list[tuple[str, str]]) -> None:
        self._store.adopt_blob_files(done)

    async def _fetch_one(self, sha: str, size: int, scratch: str, done: list[tuple[str, str]],
                         failures: dict[str, str]) -> None:
        path = os.path.join(scratch, sha)
        async with self._limit:
            f: BinaryIO = await trio.to_thread.run_sync(open, path, "xb")
            try:
                async def write(chunk: bytes) -> None:
                    await trio.to_thread.run_sync(f.write, chunk)

                got = await self._tier.fetch(sha, write, limit=size)
                if got != size:
                    raise CorruptBlobError(f"tier blob {sha}", f"{got} bytes",
                                           why=f"the manifest says {size} bytes")
                await trio.to_thread.run_sync(_sync, f)
            except CapsuleError as exc:
                failures[sha] = str(exc)
                log.warning("blob %s not fetched from the tier: %s", sha, exc)
                await trio.to_thread.run_sync(_discard, f, path)
                return
            except BaseException:
                _discard(f, path)  # (cancelled: no thread now; a local close and unlink)
                raise
            await trio.to_thread.run_sync(f.close)
        done.append((path, sha))


async def _each(fn: Callable[[str], Awaitable[None]], shas: Iterable[str], what: str) -> None:
    """``fn`` of every digest in one nursery (each bounds itself); the
    CapsuleErrors, after all ran, as one TierError naming the first."""
    failures: dict[str, str] = {}
    count = 0

    async def one(sha: str) -> None:
        try:
            await fn(sha)
        except CapsuleError as exc:
            failures[sha] = str(exc)

    async with trio.open_nursery() as nursery:
        for sha in shas:
            count += 1
            nursery.start_soon(one, sha)
    if failures:
        sha, why = next(iter(failures.items()))
        raise TierError(f"{len(failures)} of {count} blob(s) not {what}; blob {sha}: {why}")


def _sync(f: BinaryIO) -> None:
    f.flush()
    os.fsync(f.fileno())


def _discard(f: BinaryIO, path: str) -> None:
    f.close()
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
