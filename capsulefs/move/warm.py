"""Before a move freezes its agent: the target warms its store from the blob tier.

Rules:
  * On a blob tier (fleet mode, ``mount --blobs``) the source, before it
    freezes the agent (which runs meanwhile), sends the target the agent's
    current manifest in a ``warm`` call. A target on the tier fetches from it
    what it lacks of the manifest's blobs, verified, as for an offer
    (capsulefs/fleet/tier_moves.py), and answers once it has them; a target
    without a tier answers at once. The offer after the freeze then finds
    only the delta since this manifest missing, so the freeze no longer
    waits for the tier's bulk.
  * The warm-up is advice: it reads no holder record and writes none on
    either side, and any failure (a target that does not know the call, a
    link error, ``timeout``) is logged and the move goes on without it. The
    move's invariants are the move machines' alone.
  * What a warm-up fetched is kept from gc only while its call runs (under a
    staging manifest, as for an offer); if a gc takes it before the offer,
    the offer's own fetch gets it again from the tier.

Theory of operation: :func:`warm_target` (the source, one connection of its
own before the move's) and :func:`answer_warm` (the target's move service,
before the call reaches the move machine, which does not know it); and
:class:`TierOnOffer`, the target's use of the tier when an offer comes:
what it fetched is kept from gc (by the ``keep`` stack) until the offer's
call ends, by when the move's own staging manifest names it, or the offer
was refused.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import ExitStack, asynccontextmanager
from typing import TYPE_CHECKING, Any, Protocol

import trio

from capsulefs.core.capsule import format as fmt
from capsulefs.core.errors import CapsuleError, FormatError
from capsulefs.peer.book import Peer
from capsulefs.peer.errors import CallFailed

if TYPE_CHECKING:
    from capsulefs.move.host import MoveHost
    from capsulefs.move.source import Connector

log = logging.getLogger(__name__)


class TierFetch(Protocol):
    """Fetches into the store, before an offer is answered, what a blob tier
    holds of the offered manifest's blobs (capsulefs/fleet/tier_moves.py);
    what it fetched stays protected from gc until ``keep`` closes."""

    async def fetch_for_offer(self, manifest: fmt.Manifest, keep: ExitStack) -> None: ...


class TierOnOffer:
    """The move service's use of a blob tier (None: peer-to-peer) for the offers it judges."""

    def __init__(self, tier: TierFetch | None) -> None:
        self.tier = tier
        self._keep: dict[tuple[str, int], ExitStack] = {}  # what the tier fetched for an offer being judged

    @asynccontextmanager
    async def keeping(self, agent_id: str, epoch: int) -> AsyncIterator[None]:
        """For one call: what the tier fetched for its offer stays kept from gc until the call ends."""
        with ExitStack() as keep:
            self._keep[(agent_id, epoch)] = keep
            try:
                yield
            finally:
                del self._keep[(agent_id, epoch)]

    async def fetch(self, agent_id: str, epoch: int, manifest: fmt.Manifest) -> None:
        """Before an offer is answered: fill the store from the tier (within :meth:`keeping`)."""
        if self.tier is not None:
            await self.tier.fetch_for_offer(manifest, self._keep[(agent_id, epoch)])


__all__ = ["WARM_CALL", "TierFetch", "TierOnOffer", "answer_warm", "warm_target"]

WARM_CALL = "warm"


async def warm_target(host: MoveHost, agent_id: str, target: Peer, *, connect: Connector, timeout: float) -> None:
    """Ask ``target`` to fetch from the tier what it lacks of the agent's current manifest (see the rules)."""
    started = time.monotonic()
    try:
        manifest = await trio.to_thread.run_sync(lambda: host.store.agent(agent_id).manifest())
    except CapsuleError as exc:
        log.info("no warm-up for the move of %s: %s", agent_id, exc)
        return
    with trio.move_on_after(timeout) as scope:
        try:
            async with connect(host.identity, target) as conn:
                result, _ = await conn.call(WARM_CALL, {"agent_id": agent_id,
                                                        "manifest": manifest.to_bytes().decode()})
        except (CapsuleError, OSError, trio.BrokenResourceError) as exc:
            log.info("warm-up of %s on %s failed (the move goes on without it): %s", agent_id, target.name, exc)
            return
    if scope.cancelled_caught:
        log.info("warm-up of %s on %s took over %.0f s: the move goes on", agent_id, target.name, timeout)
        return
    log.info("warm-up of %s on %s: %s in %.2f s", agent_id, target.name,
             "fetched from the tier" if result.get("tier") else "no tier there", time.monotonic() - started)


async def answer_warm(tier: TierFetch | None, args: dict[str, Any]) -> dict[str, Any]:
    """The target's answer to a ``warm`` call (see the rules)."""
    try:
        agent_id = fmt.check_agent_id(args.get("agent_id"))
        manifest = fmt.Manifest.from_bytes(str(args["manifest"]).encode())
    except (KeyError, FormatError) as exc:
        raise CallFailed("bad-request", f"warm without a valid manifest: {exc}") from None
    if manifest.agent_id != agent_id:
        raise CallFailed("bad-request", f"manifest of {manifest.agent_id} sent to warm {agent_id}")
    if tier is None:
        return {"tier": False}
    with ExitStack() as keep:
        await tier.fetch_for_offer(manifest, keep)
    return {"tier": True}
