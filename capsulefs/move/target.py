"""The target side of a move: the peer-link handler that runs TargetMachine.

Rules:
  * Each request is judged by a :class:`~capsulefs.core.move.TargetMachine`
    built from the agent's current holder record, under the agent's lock;
    this module only carries out the commands, in order, and stops at the
    first failure (the reply is then an error, which a source treats like a
    lost reply: it never counts as a decision).
  * The caller's host id comes from its authenticated certificate, never
    from the request.
  * Incoming content lands in a staging area of the store (``move-*``,
    :mod:`capsulefs.move.staging`): ``content/<sha256>`` for every piece. Each move has an intake
    (:mod:`capsulefs.move.intake`): a ``blobs`` call hands its payload to
    the intake's writer (hashing, ``O_DIRECT`` writes, in a worker thread)
    and answers once the bytes have arrived; the writer and the settler
    (fsync, adoption of the blobs into ``objects/``) finish them while the
    next call's bytes come in. A piece that does not hash to its name is
    dropped. Verify waits until the intake has passed every piece, then
    reports every piece missing or corrupt. The capsule
    directory is assembled at prepare and renamed into ``agents/`` at
    activate. A discarded move leaves no staging behind; blobs already
    adopted stay (content addressed; gc frees them if no agent lists them
    once the move has ended: until then the staging area's manifest.json,
    written before any blob is adopted, keeps them).
  * Blobs the target already had are checked for presence and size at
    verify; the store only ever names a blob after hashing it.
  * On a blob tier (fleet mode, ``mount --blobs``) an offer is answered
    only after the store fetched from the tier what it holds of the blobs
    this host lacks, and a ``warm`` call before the freeze does the same
    (capsulefs/move/warm.py: :class:`~capsulefs.move.warm.TierOnOffer`).

  * In the fleet mode (a :class:`~capsulefs.move.fleet.Fleet` given) a
    prepared move activates only once the directory names this host at its
    epoch: the source's ``activate`` is a nudge (``confirm``, then activate;
    else "unknown"), and a prepared move idle, restarted, asked ``status``
    or fenced by a peer asks the directory's ``gate`` before it ever refuses.
    Its staging area holds STAGING_KEEP from prepare on, so a restart
    spares it (docs/fleet.md, "A move through the directory").

Theory of operation: the staging areas of moves in progress live in
``self._incoming``, keyed by (agent_id, epoch), each owning its staging
context. A crash loses them; on restart :meth:`MoveService.recover` feeds
TargetRestarted to every record, which refuses every pending move (in the
fleet mode a prepared one keeps its area, in ``self._kept``, until the
directory's gate decides).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from typing import Any

import trio

from capsulefs.core.capsule import format as fmt
from capsulefs.core import metrics
from capsulefs.core import move as mv
from capsulefs.core.errors import CapsuleError, FormatError
from capsulefs.core.fsutil import atomic_write
from capsulefs.core.linuxfs import FileSystemSync
from capsulefs.core.store.holder import HolderRecord, HolderState
from capsulefs.core.store.host_store import STAGING_KEEP
from capsulefs.core.store.story import story
from capsulefs.core.move.wire import BLOBS_CALL, answer_to_result
from capsulefs.move.fleet import Fleet, gate, gate_before_fence, named
from capsulefs.move.host import MoveHost
from capsulefs.peer.errors import CallFailed
from capsulefs.peer.framing import Payload
from capsulefs.peer.server import PeerHandler, serve_peers
from capsulefs.move.intake import Intake
from capsulefs.move.staging import Incoming, adopt, missing
from capsulefs.move.warm import WARM_CALL, TierFetch, TierOnOffer, answer_warm
from capsulefs.move.writers import SpareHelper
from capsulefs.move.pieces import Piece
from capsulefs.peer.book import DEFAULT_PORT, Peer

log = logging.getLogger(__name__)

__all__ = ["MoveService", "ServingMoves", "serve_moves"]

DEFAULT_IDLE_TTL = 600.0  # a pending move idle this long is refused (liveness only)
#: Fleet mode: a prepared move idle this long asks the directory (the nudge may have been lost).
FLEET_GATE_AFTER = 10.0
FLEET_GATE_EVERY = 2.0  # fleet mode: how often idle moves are looked at


class MoveService:
    """Answers the move calls of docs/wire.md for one host. Plug into serve_peers."""

    def __init__(self, host: MoveHost, *, deep_verify: bool = False, fleet: Fleet | None = None,
                 tier: TierFetch | None = None, gate_after: float = FLEET_GATE_AFTER) -> None:
        self.host = host
        self.fleet, self.gate_after = fleet, gate_after  # None: peer-to-peer; seconds idle before asking the gate
        #: Fleet mode: the staging areas of prepared moves a restart spared, by (agent_id, epoch).
        self._kept: dict[tuple[str, int], str] = {}
        self.deep_verify = deep_verify  # re-hash blobs the target already had
        self.tier = tier  # fleet mode with a blob tier; None: peer-to-peer
        self._on_offer = TierOnOffer(tier)
        self._incoming: dict[tuple[str, int], Incoming] = {}
        self.served: list[str] = []  # names of the calls served, for tests and logs
        self._offered: dict[tuple[str, int], fmt.Manifest] = {}  # manifests of offers being judged
        self._nursery: trio.Nursery | None = None  # where the intakes run (run_intakes)
        # A writer process started ahead for the next move's intake (run_intakes owns it).
        self.spare: SpareHelper | None = None

    # -- the peer-link entry point --------------------------------------------------------
    async def __call__(self, peer: Peer, call: str, args: dict[str, Any], payload: Payload) -> tuple[dict[str, Any], bytes]:
        if call == WARM_CALL:  # (advice before a move's freeze, outside the move machines: capsulefs/move/warm.py)
            return await answer_warm(self.tier, args), b""
        try:
            which = mv.Call.BLOB if call == BLOBS_CALL else mv.Call(call)
            if which is mv.Call.BLOB and call != BLOBS_CALL:
                raise ValueError(call)
        except ValueError:
            raise CallFailed("unknown-call", f"no call named {call!r}") from None
        try:
            agent_id = fmt.check_agent_id(args.get("agent_id"))
            # (a fence names no epoch: it asks about the agent at any)
            epoch = 0 if which is mv.Call.FENCE else fmt.check_int(args.get("epoch"), "epoch", low=1)
        except FormatError as exc:
            raise CallFailed("bad-request", str(exc)) from None
        self.served.append(call)
        if which is mv.Call.BLOB:
            async with self.host.lock(agent_id):
                return await self._blobs(peer.host_id, agent_id, epoch, args.get("items"), payload), b""
        async with self.host.lock(agent_id), self._on_offer.keeping(agent_id, epoch):
            if self.fleet is not None and which in (mv.Call.ACTIVATE, mv.Call.STATUS):
                return answer_to_result(await self._through_directory(which, peer.host_id, agent_id, epoch)), b""
            if self.fleet is not None and which is mv.Call.FENCE:  # (the directory decides a prepared move)
                await gate_before_fence(self.record(agent_id), self._gated, peer.host_id)
            event = await self._event(which, peer.host_id, agent_id, epoch, args, payload)
            answer = await self.run(agent_id, event)
            offered = self._offered.pop((agent_id, epoch), None)
            if isinstance(answer, mv.OfferReply) and answer.accepted and (agent_id, epoch) not in self._incoming:
                assert offered is not None
                self._open(agent_id, epoch, peer.host_id, offered)
        return answer_to_result(answer), b""

    async def _event(self, which: mv.Call, source: str, agent_id: str, epoch: int, args: dict[str, Any],
                     payload: Payload) -> object:
        match which:
            case mv.Call.OFFER:
                try:
                    manifest = fmt.Manifest.from_bytes(str(args["manifest"]).encode())
                except (KeyError, FormatError) as exc:
                    raise CallFailed("bad-request", f"offer without a valid manifest: {exc}") from None
                if manifest.agent_id != agent_id:
                    raise CallFailed("bad-request", f"manifest of {manifest.agent_id} offered as {agent_id}")
                self._offered[(agent_id, epoch)] = manifest
                await self._on_offer.fetch(agent_id, epoch, manifest)
                inc = self._incoming.get((agent_id, epoch))
                have = frozenset(inc.sent) if inc is not None else frozenset()
                # A stat per blob: in a thread, so that a manifest of many
                # blobs does not hold up the event loop (and the mount on it).
                missing = await trio.to_thread.run_sync(self._missing, manifest, have)
                return mv.OfferReceived(agent_id=agent_id, epoch=epoch, source=source, missing=missing)
            case mv.Call.VERIFY:
                return mv.VerifyRequested(agent_id=agent_id, epoch=epoch, source=source)
            case mv.Call.PREPARE:
                return mv.PrepareRequested(agent_id=agent_id, epoch=epoch, source=source)
            case mv.Call.ACTIVATE:
                return mv.ActivateRequested(agent_id=agent_id, epoch=epoch, source=source)
            case mv.Call.STATUS:
                return mv.StatusRequested(agent_id=agent_id, epoch=epoch, source=source)
            case mv.Call.ABORT:
                return mv.AbortRequested(agent_id=agent_id, epoch=epoch, source=source)
            case mv.Call.FENCE:
                return mv.FenceRequested(agent_id=agent_id, source=source)
        raise AssertionError(which)

    # -- the fleet's directory (docs/fleet.md, "A move through the directory") ------------------
    async def _through_directory(self, which: mv.Call, source: str, agent_id: str, epoch: int) -> object:
        """Fleet mode, under the agent's lock: the source's activate (its
        nudge, after the directory's verdict) or status. A move prepared here
        activates only once the directory names this host at its epoch."""
        rec = self.record(agent_id)
        prepared = (rec is not None and rec.state is HolderState.PREPARED and rec.epoch == epoch
                    and rec.peer == source)
        if which is mv.Call.ACTIVATE:
            if prepared and self.fleet is not None and await named(self.fleet, agent_id, epoch):
                log.info("agent %s: activating the move prepared at epoch %d on the nudge of %s", agent_id, epoch, source)
                return await self.run(agent_id, mv.ActivateRequested(agent_id=agent_id, epoch=epoch, source=source))
            if prepared:  # (a nudge only ever activates: never refuse on it)
                return mv.ActivateReply(agent_id=agent_id, epoch=epoch, outcome=mv.Outcome.UNKNOWN)
            return await self.run(agent_id, mv.ActivateRequested(agent_id=agent_id, epoch=epoch, source=source))
        if prepared:
            assert rec is not None
            match await self._gated(rec):
                case mv.Outcome.ACTIVE:
                    return mv.StatusReply(agent_id=agent_id, epoch=epoch, outcome=mv.Outcome.ACTIVE)
                case None:
                    return mv.StatusReply(agent_id=agent_id, epoch=epoch, outcome=mv.Outcome.UNKNOWN)
        return await self.run(agent_id, mv.StatusRequested(agent_id=agent_id, epoch=epoch, source=source))

    async def _gated(self, rec: HolderRecord) -> mv.Outcome | None:
        """A prepared move (under the agent's lock) asks the directory's gate:
        ACTIVE: activated now; NEVER: refused (no commit of it can apply any
        more); None: no answer yet, it stays prepared."""
        assert self.fleet is not None and rec.peer is not None
        agent_id, epoch, source = rec.agent_id, rec.epoch, rec.peer
        outcome = await gate(self.fleet, agent_id, epoch, source)
        if outcome is mv.Outcome.ACTIVE:
            await self.run(agent_id, mv.ActivateRequested(agent_id=agent_id, epoch=epoch, source=source), record=rec)
        elif outcome is mv.Outcome.NEVER:
            await self.run(agent_id, mv.Expired(agent_id=agent_id), record=rec)
        return outcome

    async def _gate_prepared(self, now: float) -> None:
        """Fleet mode: every prepared move idle for ``gate_after``, or kept over a restart, asks the directory."""
        idle = {k for k, inc in self._incoming.items() if now - inc.last_activity >= self.gate_after}
        keys = set(self._kept) | idle
        for agent_id, epoch in sorted(keys):
            async with self.host.lock(agent_id):
                rec = self.host.holders.get(agent_id)
                if rec is not None and rec.state is HolderState.PREPARED and rec.epoch == epoch:
                    await self._gated(rec)
                elif (agent_id, epoch) in self._kept:
                    await self._close(agent_id, epoch)

    async def _keep_prepared(self) -> None:
        """After a restart (fleet mode): take back the staging area of each
        prepared move (the directory may name this host already); remove the
        areas no prepared record owns."""
        for area in await trio.to_thread.run_sync(self.host.store.kept_staging):
            name = os.path.basename(area)
            owner = None
            for agent_id in self.host.holders.agent_ids():
                rec = self.host.holders.get(agent_id)
                if (rec is not None and rec.state is HolderState.PREPARED
                        and name.startswith(f"move-{agent_id}-{rec.epoch}-") and (agent_id, rec.epoch) not in self._kept
                        and os.path.isdir(os.path.join(area, "capsule"))):
                    owner = (agent_id, rec.epoch)
                    break
            if owner is None or self.fleet is None:
                log.info("removing the staging area %s (no prepared move owns it)", area)
                await trio.to_thread.run_sync(self.host.store.remove_kept, area)
            else:
                log.info("agent %s: the move prepared at epoch %d kept its staging area: the directory decides",
                         *owner)
                self._kept[owner] = area

    # -- blobs ----------------------------------------------------------------------------------
    async def _blobs(self, source: str, agent_id: str, epoch: int, items: Any, payload: Payload) -> dict[str, Any]:
        """One ``blobs`` call: the payload is the pieces' bytes, back to back."""
        try:
            if not isinstance(items, list) or not items:
                raise FormatError("items must be a non-empty list of [sha256, size]")
            pieces = []
            for item in items:
                sha, size = item
                fmt.check_sha256(sha, "blob")
                fmt.check_int(size, f"size of {sha}")
                pieces.append((sha, size))
            if sum(size for _, size in pieces) != payload.size:
                raise FormatError(f"the items add up to {sum(s for _, s in pieces)} bytes, the payload has {payload.size}")
        except (FormatError, TypeError, ValueError) as exc:
            raise CallFailed("bad-request", f"blobs: {exc}") from None
        rec = self.record(agent_id)  # read once: BlobReceived never changes it, and we hold the lock
        inc = self._open_move(rec, epoch, source)
        if inc is None:
            await payload.drain()  # no open move for these: read and drop
        else:
            # A piece already received, or still in the intake, or twice
            # in this call, is read and dropped (Piece without a path).
            plan: list[Piece] = []
            writing: set[str] = set()
            for sha, size in pieces:
                keep = sha not in inc.received and sha not in inc.intake.inflight and sha not in writing
                if keep:
                    writing.add(sha)
                plan.append(Piece(sha, size, inc.content(sha) if keep else None))
            await inc.intake.take(payload, plan)
            metrics.MOVE_BYTES.inc("received", by=payload.size)
        results = []
        for sha, _ in pieces:
            # Arrived whole for an open move (a piece already here counts too);
            # whether it hashed to its name is verify's to report, which names
            # every bad piece once the intake has passed them all.
            event = mv.BlobReceived(agent_id=agent_id, epoch=epoch, source=source, sha=sha, intact=inc is not None)
            results.append(answer_to_result(await self.run(agent_id, event, record=rec)))
        if inc is not None:
            inc.last_activity = trio.current_time()
        return {"results": results}

    def _open_move(self, rec: HolderRecord | None, epoch: int, source: str) -> "Incoming | None":
        """The staging area the pieces of this call go to, or None when no
        move of ``source`` is open at ``epoch`` (the machine then judges the
        pieces stale; their bytes are read and dropped)."""
        inc = None if rec is None else self._incoming.get((rec.agent_id, epoch))
        if inc is None or inc.source != source or rec is None or rec.state is not HolderState.OFFERED:
            return None
        inc.last_activity = trio.current_time()
        return inc

    # -- running the machine ------------------------------------------------------------------
    def record(self, agent_id: str) -> HolderRecord | None:
        rec = self.host.holders.get(agent_id)
        if rec is None and os.path.isdir(os.path.join(self.host.store.agents_dir, agent_id)):
            rec = HolderRecord(agent_id=agent_id, state=HolderState.UNKNOWN, epoch=0, note="holder record lost")
            self.host.holders.put(rec)
        return rec

    async def run(self, agent_id: str, event: object, *, record: HolderRecord | None | bool = False) -> object | None:
        """Feed ``event`` to a machine built from the current record (or
        ``record``, if the caller just read it); carry out its commands."""
        current = self.record(agent_id) if record is False else record
        tm = mv.TargetMachine(agent_id, current, me=self.host.me)  # type: ignore[arg-type]
        queue = list(tm.handle(event))
        answer = None
        while queue:
            cmd = queue.pop(0)
            log.debug("target %s: %s", agent_id, cmd)
            match cmd:
                case mv.Persist(record=rec):
                    self.host.holders.put(rec)
                case mv.DiscardStaging(epoch=e):
                    await self._close(agent_id, e)
                case mv.DropAgentFiles():
                    if os.path.isdir(os.path.join(self.host.store.agents_dir, agent_id)):
                        log.info("removing leftover files of agent %s (not held here)", agent_id)
                        self.host.store.remove_agent(agent_id)
                case mv.CheckBlobs(epoch=e):
                    assert isinstance(event, mv.VerifyRequested)  # the one event that asks for it
                    bad = await self._check(agent_id, e)
                    queue[:0] = tm.handle(mv.BlobsChecked(agent_id=agent_id, epoch=e, source=event.source, bad=bad))
                case mv.BuildStaging(epoch=e):
                    assert isinstance(event, mv.PrepareRequested)  # the one event that asks for it
                    ok, why = await self._build(agent_id, e)
                    queue[:0] = tm.handle(mv.StagingBuilt(agent_id=agent_id, epoch=e, source=event.source, ok=ok, reason=why))
                case mv.Install(epoch=e):
                    await self._install(agent_id, e)
                case mv.ActivateAgent():
                    await self.host.hooks.activate(agent_id)
                    metrics.MOVES_IN.inc()
                case mv.Reply(answer=a):
                    answer = a
                case _:
                    raise AssertionError(f"unexpected target command {cmd}")
        return answer

    # -- staging areas ------------------------------------------------------------------------
    def _open(self, agent_id: str, epoch: int, source: str, manifest: fmt.Manifest) -> Incoming:
        if self._nursery is None:
            raise RuntimeError("MoveService.run_intakes is not running: a move cannot be received")
        stack = ExitStack()
        try:
            area = stack.enter_context(self.host.store.staging(f"move-{agent_id}-{epoch}"))
            # Before any blob is adopted: gc keeps the blobs a staged manifest
            # names (the move needs them until install, and no agent here
            # lists them yet). Under the store's shared lock: a gc that began
            # before it has ended (and verify sees what it took), one after
            # it reads the manifest.
            with self.host.store.writing():
                atomic_write(os.path.join(area, fmt.MANIFEST), manifest.to_bytes())
            os.mkdir(os.path.join(area, "content"))
            # Opened before any piece is written (see FileSystemSync), closed
            # with the staging area: by _close, once the intake has stopped
            # (its settler's thread is waited for), so never under a sync.
            sync = stack.enter_context(FileSystemSync(area))
            intake = Intake(record=lambda outcomes: inc.record(outcomes), settle=partial(adopt, self.host.store, manifest, sync),
                            depth=FEED_DEPTH, writers=INTAKE_WRITERS, sync=sync, spare=self.spare)
            inc = Incoming(agent_id, epoch, source, manifest, area, stack, trio.current_time(), intake)
        except BaseException:
            stack.close()
            raise
        self._incoming[(agent_id, epoch)] = inc
        self._nursery.start_soon(intake.run)
        return inc

    async def run_intakes(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the intakes of the moves this service receives (their tasks
        run here) until cancelled."""
        if INTAKE_WRITERS == "process":
            self.spare = SpareHelper(FEED_DEPTH + 2)
            self.spare.fill()
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                try:
                    task_status.started()
                    await trio.sleep_forever()
                finally:
                    self._nursery = None
        finally:
            if self.spare is not None:
                self.spare.close()  # (the intakes have ended: their nursery is done)
                self.spare = None

    async def _close(self, agent_id: str, epoch: int, *, keep: bool = False) -> None:
        """The move's staging area goes (``keep``: the daemon stops; a kept
        one, of a prepared move in the fleet mode, stays for the next start)."""
        kept = self._kept.pop((agent_id, epoch), None)
        if kept is not None and not keep:
            await trio.to_thread.run_sync(self.host.store.remove_kept, kept)
        inc = self._incoming.pop((agent_id, epoch), None)
        if inc is not None:
            with trio.CancelScope(shield=True):  # the staging area goes only once nothing writes in it
                await inc.intake.aclose()
                if self.spare is not None:
                    # For the next move: the fork and exec (about 0.5 ms) run
                    # here, in activate or rollback; the helper's start-up
                    # runs in its own process. Never let it skip the cleanup.
                    try:
                        self.spare.fill()
                    except Exception:  # pragma: no cover - fill logs the OSErrors it expects
                        log.exception("cannot start a spare writer process for moves")
                # Removing the staging area is a file per piece: in a thread,
                # off the event loop (waited for: it is gone when we return).
                await trio.to_thread.run_sync(inc.stack.close)
                if not keep and os.path.exists(os.path.join(inc.area, STAGING_KEEP)):
                    await trio.to_thread.run_sync(self.host.store.remove_kept, inc.area)

    async def aclose_all(self) -> None:
        """The daemon stops: every intake ends and its staging area goes, but
        a kept one (a prepared move in the fleet mode) stays for the next start."""
        for key in list(self._incoming) + list(self._kept):
            await self._close(*key, keep=True)

    def _missing(self, manifest: fmt.Manifest, have: frozenset[str]) -> tuple[str, ...]:
        return missing(self.host.store, manifest, have)

    # -- verify ---------------------------------------------------------------------------------
    async def _check(self, agent_id: str, epoch: int) -> tuple[str, ...]:
        inc = self._incoming[(agent_id, epoch)]
        await inc.intake.settled()  # every piece that arrived is hashed, durable and adopted (or failed)
        inc.last_activity = trio.current_time()
        return await trio.to_thread.run_sync(inc.check, self.host.store, self.deep_verify)

    # -- prepare, install -------------------------------------------------------------------------
    async def _build(self, agent_id: str, epoch: int) -> tuple[bool, str]:
        inc = self._incoming[(agent_id, epoch)]
        store = self.host.store
        m = inc.manifest
        for other in store.agents():
            if other.agent_id != agent_id and other.manifest().name == m.name:
                return False, f"another agent named {m.name!r} is held here ({other.agent_id})"

        try:
            await trio.to_thread.run_sync(inc.build, self.host.me)
            await self.host.hooks.prepare(agent_id, inc.capsule_dir)
            if self.fleet is not None:  # (the directory may name this host from PREPARED on: survive a restart)
                await trio.to_thread.run_sync(atomic_write, os.path.join(inc.area, STAGING_KEEP), b"")
        except (CapsuleError, OSError) as exc:
            return False, str(exc)
        inc.last_activity = trio.current_time()
        return True, ""

    async def _install(self, agent_id: str, epoch: int) -> None:
        inc = self._incoming.get((agent_id, epoch))
        capsule_dir = inc.capsule_dir if inc is not None else os.path.join(self._kept[(agent_id, epoch)], "capsule")
        await trio.to_thread.run_sync(self.host.store.install_agent, capsule_dir)
        await self._close(agent_id, epoch)

    # -- recovery and expiry -----------------------------------------------------------------------
    async def recover(self) -> None:
        """After a restart: mark agents without a record UNKNOWN and freeze
        every UNKNOWN one (read-only until ``capsulefs move --learn``), refuse
        every pending move, drop leftovers, re-activate held agents."""
        await self._keep_prepared()
        present = set(self.host.store.agent_ids())
        # (off the loop: it may wait for a `capsulefs import` to record its agent)
        in_doubt = await trio.to_thread.run_sync(self.host.holders.reconcile, present)
        for agent_id in sorted(present):  # one line each for an agent that does not run here: the one story
            rec = self.host.holders.get(agent_id)
            if rec is None or not rec.runnable:
                try:
                    name = self.host.store.agent(agent_id).name
                except CapsuleError:
                    name = agent_id
                log.warning("agent %s (%s): %s", name, agent_id, story(rec, name).line())
        for rec in in_doubt:  # (the daemon showed those without a record as active until now)
            async with self.host.lock(rec.agent_id):
                try:
                    await self.host.hooks.freeze(rec.agent_id)
                except (CapsuleError, OSError) as exc:  # one agent's trouble must not end the daemon
                    log.error("agent %s is in doubt (%s) but could not be frozen: %s", rec.agent_id, rec.note, exc)
        for agent_id in self.host.holders.agent_ids():
            async with self.host.lock(agent_id):
                rec = self.record(agent_id)
                if rec is None or rec.state in (HolderState.FROZEN, HolderState.COMMITTING):
                    continue  # the source side resumes these (capsulefs.move.source.resume_moves)
                if rec.state is HolderState.HELD and agent_id not in present:
                    # Held, but its files are gone (removed by a capsulefs that
                    # kept the record HELD): nothing to start.
                    log.warning("agent %s is recorded as held here but its files are gone; not started", agent_id)
                    continue
                if rec.state is HolderState.PREPARED and (agent_id, rec.epoch) in self._kept:
                    continue  # (fleet mode: the directory's gate decides, once the host has a lease)
                await self.run(agent_id, mv.TargetRestarted(agent_id=agent_id))

    async def expire_idle(self, ttl: float = DEFAULT_IDLE_TTL) -> None:
        now = trio.current_time()
        if self.fleet is not None:
            await self._gate_prepared(now)
        for (agent_id, epoch), inc in list(self._incoming.items()):
            if now - inc.last_activity >= ttl:
                async with self.host.lock(agent_id):
                    rec = self.host.holders.get(agent_id)
                    if (self.fleet is not None and rec is not None and rec.state is HolderState.PREPARED
                            and rec.epoch == epoch):
                        continue  # (the directory decides: _gate_prepared)
                    log.info("refusing the idle move of %s at epoch %d", agent_id, epoch)
                    await self.run(agent_id, mv.Expired(agent_id=agent_id))
                    await self._close(agent_id, epoch)

    async def serve_expiry(self, *, ttl: float = DEFAULT_IDLE_TTL, every: float = 60.0,
                           task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await trio.sleep(every)
            await self.expire_idle(ttl)


@dataclass(frozen=True, slots=True)
class ServingMoves:
    port: int  # where serve_moves listens
    service: MoveService


FEED_DEPTH = 2  # slabs (pieces.BUFFER bytes each) received ahead of the writer
INTAKE_WRITERS = "process"  # where a move's pieces are hashed and written (capsulefs/move/writers.py)


async def serve_moves(
    host: MoveHost,
    *,
    listen_host: str = "0.0.0.0",
    port: int = DEFAULT_PORT,
    idle_ttl: float = DEFAULT_IDLE_TTL,
    wrap: Callable[[MoveService], PeerHandler] | None = None,
    fleet: Fleet | None = None,
    tier: TierFetch | None = None,
    gate_after: float = FLEET_GATE_AFTER,
    task_status: trio.TaskStatus[ServingMoves] = trio.TASK_STATUS_IGNORED,
) -> None:
    """The target side of a daemon: recover, then answer move calls forever.

    ``started()`` reports the bound port once it listens. ``wrap`` may put
    something around the service (tests put a fault injector there).
    ``tier``: the blob tier's fetch for offers (fleet mode), else None; ``gate_after``: MoveService's.
    """
    service = MoveService(host, fleet=fleet, tier=tier, gate_after=gate_after)
    await service.recover()
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(service.run_intakes)
            handler = wrap(service) if wrap is not None else service
            bound = await nursery.start(partial(serve_peers, host.identity, host.peer_finder, handler,
                                                host=listen_host, port=port))
            every = FLEET_GATE_EVERY if fleet is not None else max(1.0, idle_ttl / 10)
            nursery.start_soon(partial(service.serve_expiry, ttl=idle_ttl, every=every))
            task_status.started(ServingMoves(bound, service))
    finally:
        with trio.CancelScope(shield=True):
            await service.aclose_all()
