"""A move's target on a blob tier: what the tier holds comes from the tier, not over the peer link.

Rules:
  * Before the target answers an offer with the blobs it lacks, it asks the
    tier which of those the tier holds (:meth:`TierBlobs.lacking`) and
    fetches them, in parallel, each verified against its digest and size,
    into the store (:meth:`TierBlobs.fetch_into_store`). The answer then
    names only what neither the store nor the tier has: the source sends
    only that, beside the manifest and the capsule's small files.
  * The tier never makes a move fail: a tier that is down, a blob it lacks
    after all, or one whose bytes do not match its name (refused, nothing
    of it stored) is logged and left out, and the source sends it.
  * The fetched blobs are named by no agent here until the move installs
    one, so gc must not take them: before fetching, the offered manifest is
    written into a staging area of the store (under the store's shared
    lock, as the move's own staging area is), which gc reads; the area is
    kept by the ``keep`` stack the move service hands in, which it closes
    once the move's own staging manifest is written (or the offer is
    refused).
  * What the tier holds is told to the uploader before it lands, so the
    fetched blobs are not put back.

Theory of operation: :class:`TierOffers` is the move service's
``TierFetch`` (capsulefs/move/target.py), built by the daemon's
composition root only when the mount has a blob tier; None in
peer-to-peer mode.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from contextlib import ExitStack
from typing import Protocol

import trio

from capsulefs.core import metrics
from capsulefs.core.capsule import format as fmt
from capsulefs.core.errors import CapsuleError
from capsulefs.core.fsutil import atomic_write
from capsulefs.core.store.host_store import HostStore
from capsulefs.fleet.tier import TierBlobs, TierFetchError

log = logging.getLogger(__name__)

__all__ = ["KnownInTier", "TierOffers"]


class KnownInTier(Protocol):
    """Told which blobs the tier holds (the uploader: it never puts them back)."""

    def known(self, shas: Iterable[str]) -> None: ...


class TierOffers:
    """Fetches an offered manifest's blobs from the tier (see the rules)."""

    def __init__(self, blobs: TierBlobs, store: HostStore, known: KnownInTier | None = None) -> None:
        self._blobs = blobs
        self._store = store
        self._known = known
        self.fetched_bytes = 0  # (tests and the bench)

    async def fetch_for_offer(self, manifest: fmt.Manifest, keep: ExitStack) -> None:
        sizes = manifest.blobs()
        need = await trio.to_thread.run_sync(self._lacking_here, sizes)
        if not need:
            return
        area = keep.enter_context(self._store.staging("tier-offer"))
        await trio.to_thread.run_sync(self._protect, area, manifest)
        try:
            absent = set(await self._blobs.lacking(need))
        except CapsuleError as exc:
            log.warning("offer of %s: the blob tier cannot be asked (the source sends every blob): %s",
                        manifest.agent_id, exc)
            return
        there = {sha: size for sha, size in need.items() if sha not in absent}
        if not there:
            return
        if self._known is not None:
            self._known.known(there)
        try:
            report = await self._blobs.fetch_into_store(there)
        except TierFetchError as exc:  # (the others are stored; the source sends these)
            log.warning("offer of %s: %s; the source sends them", manifest.agent_id, exc)
            report = exc.report
        except CapsuleError as exc:
            log.warning("offer of %s: nothing fetched from the blob tier (the source sends it): %s",
                        manifest.agent_id, exc)
            return
        self.fetched_bytes += report.bytes
        metrics.TIER_BYTES.inc("fetched", by=report.bytes)
        log.info("offer of %s: %d blob(s), %d bytes, fetched from the blob tier; %d it lacks",
                 manifest.agent_id, len(report.fetched), report.bytes, len(absent))

    def _lacking_here(self, sizes: dict[str, int]) -> dict[str, int]:
        return {sha: size for sha, size in sizes.items() if not self._store.has_blob(sha)}

    def _protect(self, area: str, manifest: fmt.Manifest) -> None:
        with self._store.writing():
            atomic_write(os.path.join(area, fmt.MANIFEST), manifest.to_bytes())
