"""The conformance check of a blob tier: does it honour conditional writes?

The fleet stores each blob once per tier with ``If-None-Match: *`` and
relies on the tier to refuse a second writer. Some S3-compatible stores have
silently ignored the header (SeaweedFS before its fix for issue 8800, some
MinIO builds, s3rver); a tier that does is refused.

Properties, each on a key of its own under ``PREFIX/capsulefs-check/<random>/``:
  * sequential If-None-Match: a second ``If-None-Match: *`` write of a key
    is refused (412) once the first was accepted.
  * racing If-None-Match: of ``writers`` writers released together to create
    one key, exactly one is accepted and every other refused (412). A 409
    ConditionalRequestConflict (AWS's answer to a write racing another) is
    retried, as AWS asks; the retry must then be refused.
  * If-Match with a stale ETag: a write carrying the ETag of a version since
    replaced is refused (412); the write that replaced it, carrying the then
    current ETag, was accepted.
  * read-after-write: every key reads back the bytes and ETag of the write
    that won.
The check's objects are deleted at the end. A tier that cannot be reached
or refuses the first plain write raises its BlobTierError instead.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass

import trio

from capsulefs.core.fleet.errors import BlobTierError, ConditionalConflict, PreconditionFailed
from capsulefs.fleet.s3 import S3Client

log = logging.getLogger(__name__)

__all__ = ["PROPERTIES", "Property", "Report", "check_blob_tier"]

SEQUENTIAL = "sequential If-None-Match"
RACING = "racing If-None-Match"
IF_MATCH = "If-Match with a stale ETag"
READ_AFTER_WRITE = "read-after-write"
PROPERTIES = (SEQUENTIAL, RACING, IF_MATCH, READ_AFTER_WRITE)
CONFLICT_RETRIES = 6
READ_LIMIT = 1 << 20
CLEAN_UP_WITHIN = 30.0  # seconds the deletes may take, even when the check was cancelled


@dataclass(frozen=True, slots=True)
class Property:
    name: str
    ok: bool
    detail: str


@dataclass(frozen=True, slots=True)
class Report:
    tier: str
    properties: tuple[Property, ...]

    @property
    def ok(self) -> bool:
        return all(p.ok for p in self.properties)

    @property
    def failed(self) -> list[str]:
        return [p.name for p in self.properties if not p.ok]

    def lines(self) -> list[str]:
        verdict = "conforms" if self.ok else "does NOT conform"
        return [f"blob tier {self.tier}: {verdict}"] + [
            f"  {'ok  ' if p.ok else 'FAIL'}  {p.name}: {p.detail}" for p in self.properties
        ]


class _Run:
    """One run of the check: its keys, and what each should read back."""

    def __init__(self, s3: S3Client, writers: int, token: str) -> None:
        self.s3 = s3
        self.writers = writers
        self.token = token
        self.base = f"{s3.tier.prefix}capsulefs-check/{token}/"
        self.keys: list[str] = []
        # key -> the (bytes, ETag) pairs a read may return: the writes that won
        self.winners: dict[str, list[tuple[bytes, str]]] = {}

    def key(self, name: str) -> str:
        self.keys.append(self.base + name)
        return self.base + name

    def body(self, what: str) -> bytes:
        return f"capsulefs blob tier check {self.token}: {what}\n".encode()

    async def sequential(self) -> Property:
        key = self.key("sequential")
        first, second = self.body("first write"), self.body("second write")
        try:
            etag = await self.s3.put(key, first, if_none_match=True)
        except BlobTierError as exc:
            return Property(SEQUENTIAL, False, f"the first write of a new key failed: {exc}")
        self.winners[key] = [(first, etag)]
        try:
            etag2 = await self.s3.put(key, second, if_none_match=True)
        except PreconditionFailed:
            return Property(SEQUENTIAL, True, "the second write was refused (412)")
        except BlobTierError as exc:
            return Property(SEQUENTIAL, False, f"the second write failed otherwise than with 412: {exc}")
        self.winners[key] = [(second, etag2)]
        return Property(SEQUENTIAL, False, "the second write was accepted: the tier ignores If-None-Match")

    async def racing(self) -> Property:
        key = self.key("race")
        bodies = [self.body(f"racing writer {i}") for i in range(self.writers)]
        outcomes: list[str] = [""] * self.writers
        won: list[tuple[bytes, str]] = []
        conflicts = 0
        go = trio.Event()

        async def write(i: int) -> None:
            nonlocal conflicts
            await go.wait()
            for attempt in range(CONFLICT_RETRIES):
                try:
                    won.append((bodies[i], await self.s3.put(key, bodies[i], if_none_match=True)))
                    outcomes[i] = "won"
                    return
                except PreconditionFailed:
                    outcomes[i] = "refused"
                    return
                except ConditionalConflict:
                    conflicts += 1
                    await trio.sleep(0.01 * 2**attempt)
                except BlobTierError as exc:
                    outcomes[i] = f"failed: {exc}"
                    return
            outcomes[i] = f"failed: 409 ConditionalRequestConflict {CONFLICT_RETRIES} times"

        await self._warm_up(key)
        async with trio.open_nursery() as nursery:
            for i in range(self.writers):
                nursery.start_soon(write, i)
            await trio.sleep(0)  # let every writer reach go.wait() before the release
            go.set()
        self.winners[key] = won
        refused = outcomes.count("refused")
        detail = f"{len(won)} of {self.writers} writers won, {refused} were refused (412)"
        if conflicts:
            detail += f"; {conflicts} 409 conflicts retried"
        errors = [o for o in outcomes if o.startswith("failed")]
        if errors:
            detail += f"; {len(errors)} failed, e.g. {errors[0]}"
        return Property(RACING, len(won) == 1 and refused == self.writers - 1, detail)

    async def _warm_up(self, key: str) -> None:
        """Open one pooled connection per writer first, so the writes race
        on the wire rather than queue for connections."""
        async def head() -> None:
            try:
                await self.s3.head(key)
            except BlobTierError:
                pass  # only the connection counts here; the writes will say what is wrong

        async with trio.open_nursery() as nursery:
            for _ in range(self.writers):
                nursery.start_soon(head)

    async def if_match(self) -> Property:
        key = self.key("if-match")
        v1, v2, v3 = self.body("version 1"), self.body("version 2"), self.body("version 3 (stale)")
        try:
            etag1 = await self.s3.put(key, v1)
        except BlobTierError as exc:
            return Property(IF_MATCH, False, f"a plain write failed: {exc}")
        self.winners[key] = [(v1, etag1)]
        try:
            etag2 = await self.s3.put(key, v2, if_match=etag1)
        except BlobTierError as exc:
            return Property(IF_MATCH, False, f"a write with the current ETag was not accepted: {exc}")
        self.winners[key] = [(v2, etag2)]
        try:
            etag3 = await self.s3.put(key, v3, if_match=etag1)
        except PreconditionFailed:
            return Property(IF_MATCH, True, "refused (412); the write with the then current ETag was accepted")
        except BlobTierError as exc:
            return Property(IF_MATCH, False, f"the stale write failed otherwise than with 412: {exc}")
        self.winners[key] = [(v3, etag3)]
        return Property(IF_MATCH, False, "the write with a stale ETag was accepted: the tier ignores If-Match")

    async def read_after_write(self) -> Property:
        problems = []
        for key, winners in self.winners.items():
            name = key[len(self.base):]
            if not winners:
                continue
            try:
                got = await self.s3.get(key, limit=READ_LIMIT)
                info = await self.s3.head(key)
            except BlobTierError as exc:
                problems.append(f"{name}: {exc}")
                continue
            if all(got != body for body, _ in winners):
                problems.append(f"{name} read back other bytes than the write that won")
            elif info is None or all(info.etag != etag for body, etag in winners if body == got):
                problems.append(f"{name} read back another ETag than the write that won")
        if problems:
            return Property(READ_AFTER_WRITE, False, "; ".join(problems))
        return Property(READ_AFTER_WRITE, True, f"each of the {len(self.winners)} keys read back what won")

    async def clean_up(self) -> None:
        for key in self.keys:
            try:
                await self.s3.delete(key)
            except BlobTierError as exc:
                log.warning("blob tier check: could not delete %s: %s", key, exc)


async def check_blob_tier(s3: S3Client, *, writers: int = 8) -> Report:
    """Check the tier ``s3`` points at; raises a BlobTierError if it cannot
    be reached or refuses a plain write at all."""
    if writers < 2:
        raise ValueError("a race needs two writers or more")
    run = _Run(s3, writers, secrets.token_hex(8))
    # Unreachable, no bucket, no access: say so once, before anything is written.
    await s3.put(run.base + "probe", run.body("probe"))
    run.keys.append(run.base + "probe")
    try:
        results = [await run.sequential(), await run.racing(), await run.if_match()]
        results.append(await run.read_after_write())
    finally:
        with trio.CancelScope(shield=True, deadline=trio.current_time() + CLEAN_UP_WITHIN):
            await run.clean_up()
    return Report(str(s3.tier), tuple(results))
