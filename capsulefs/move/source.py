"""The source side of a move: runs SourceMachine against a target over the peer link.

Rules:
  * The machine decides, the driver only carries out its commands in order:
    persist a record, freeze/resume/retire through the hooks, make a call and
    feed the reply (or Timeout, IoFailure) back. A call that fails for any
    reason (the link, a malformed reply, a remote error, our own corrupt
    blob) is an IoFailure: never an answer.
  * A failed call drops the connection; the next call reconnects. So a reply
    that arrives late is never mistaken for the answer to a later call.
  * Timers only pace: a call that takes longer than ``call_timeout`` is a
    Timeout, and status is asked again after a growing pause. Whether the
    agent runs here is decided only by the target's durable answer or an
    operator's abandon.
  * The driver holds the agent's lock from the first to the last command.
  * On a blob tier (``tier_cache``), blobs ``gc --tier-cache`` evicted are fetched back before they are
    sent (else a local read error), and the frozen manifest sits in a staging area (gc evicts none of it).
  * In the fleet mode (a :class:`~capsulefs.move.fleet.Fleet` given) the
    directory answers at the point of no return instead of the target: the
    key is read after the freeze (``begin``), ``activate`` is its commit Txn,
    ``status`` its settle, and a verdict "active" is followed by a nudge of
    the target (its ``activate`` call), whose answer decides nothing. A
    refused offer only rolls back (and raises this host's fence); a move
    that rolls back after its commit was sent runs the agent again only
    once the directory names this host (docs/fleet.md). A resumed move finds
    its target's address in the directory (``fleet.find_target``).

Theory of operation: :func:`move_agent` freezes the agent, reads one
consistent snapshot of its capsule files (the journal up to its last whole
line) and offers the manifest of that snapshot. The target answers which
contents it lacks, named by sha256; they are sent in ``blobs`` calls whose
payload streams from the store or from the snapshot
(:mod:`capsulefs.move.read_ahead`). The target hashes every
piece as it arrives, which checks this disk and the link at once, so the
happy path reads each blob once and hashes it once (there); a piece the
target reports bad is re-hashed here to tell a blob that rotted in this
store (the move fails naming its path) from one damaged on the way.
:func:`resume_moves` finishes, after a restart, every move a record says
was in progress; :mod:`capsulefs.move.doubt` has the operator's way out
(``abandon_move``) and learning who holds an agent in doubt (``learn_holder``).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, ExitStack
from dataclasses import dataclass
from typing import Any

import trio

from capsulefs.core.capsule import archive
from capsulefs.core.capsule import format as fmt
from capsulefs.core import move as mv
from capsulefs.core.errors import CapsuleError, CorruptBlobError, FormatError, NotFoundError
from capsulefs.core.view.control import TierCache
from capsulefs.core.store.holder import HolderState
from capsulefs.peer.identity import Identity
from capsulefs.core.move.wire import BLOBS_CALL, result_to_answer
from capsulefs.move.fleet import Fleet, SourceCalls, find_target
from capsulefs.move.host import MoveHost
from capsulefs.move.outcome import MoveControl, MoveResult
from capsulefs.move.read_ahead import read_ahead
from capsulefs.move.warm import warm_target
from capsulefs.peer.client import PeerConnection, open_peer
from capsulefs.peer.errors import PeerError, PeerRefused, PeerUnreachable, RemoteError
from capsulefs.peer.book import Peer

log = logging.getLogger(__name__)

__all__ = ["Connector", "MoveControl", "MoveResult", "move_agent", "resume_moves"]

Connector = Callable[[Identity, Peer], AbstractAsyncContextManager[PeerConnection]]
BATCH_ITEMS = 256  # pieces per blobs call
BATCH_BYTES = 64 << 20  # about this many bytes per blobs call
#: Seconds the snapshot waits for a `capsulefs append` to let go of the agent's
#: files (one suspended with ^Z would otherwise hang the move): then it rolls back.
FILES_WAIT = archive.FILES_WAIT
#: Seconds the fleet mode's nudge of the target (after the directory's verdict
#: "active") may take; it decides nothing, the target also asks on its own.
NUDGE_TIMEOUT = 10.0
_UNKNOWN_ADDRESS = "0.0.0.0:1"  # a resumed move's target before it is known (fleet mode: never dialled)


class _Driver:
    def __init__(self, host: MoveHost, machine: mv.SourceMachine, peer: Peer, *, connect: Connector,
                 call_timeout: float, retry_pause: float, max_retry_pause: float, control: MoveControl,
                 fleet: Fleet | None = None, tier_cache: TierCache | None = None, find_target: bool = False) -> None:
        self.host = host
        self.tier_cache = tier_cache  # with a blob tier: evicted blobs fetched back to send (see the rules)
        self.pins = ExitStack()
        self.find_target = self.resumed = find_target  # fleet mode, resumed: the target's address is the directory's
        # None: peer-to-peer, the target answers activate and status
        self.directory = None if fleet is None else SourceCalls(
            fleet, committing=machine.state is mv.SourceState.RESTARTED_COMMITTING)
        self.raise_fence = 0  # fleet mode: the epoch a refused offer named (the rollback keeps it)
        self.m = machine
        self.peer = peer
        self.connect = connect
        self.call_timeout = call_timeout
        self.retry_pause = retry_pause
        self.max_retry_pause = max_retry_pause
        self.control = control
        self.stack = AsyncExitStack()
        self.conn: PeerConnection | None = None
        self.files: dict[str, bytes] = {}  # sha -> bytes of the snapshot's capsule files
        self.blob_sizes: dict[str, int] = {}  # sha -> size of each blob the snapshot's manifest lists
        self.manifest: fmt.Manifest | None = None
        self.bytes_sent = 0
        self.sent = 0
        self.status_asked = 0
        self.last_event: object | None = None  # the last event fed to the machine
        self.link_error: Exception | None = None  # the last call's failure, if it failed
        self.failed_here = False  # the agent could not be read or frozen here (Cause.CORRUPT)

    # -- connection ---------------------------------------------------------------
    async def _conn(self) -> PeerConnection:
        if self.conn is None:
            if self.find_target:
                await self._find_target()
            self.conn = await self.stack.enter_async_context(self.connect(self.host.identity, self.peer))
        return self.conn

    async def _find_target(self) -> None:
        self.peer, self.find_target = await find_target(self.host.peer_finder, self.peer.host_id), False
        log.info("move of %s: its target %s is at %s (the directory's record)", self.m.agent_id, self.peer.host_id,
                 self.peer.address)

    async def _drop(self) -> None:
        if self.conn is not None:
            self.bytes_sent += self.conn.bytes_sent
        self.conn = None
        await self.stack.aclose()
        self.stack = AsyncExitStack()

    # -- calls ----------------------------------------------------------------------
    def _args(self, c: mv.Send) -> dict[str, Any]:
        args: dict[str, Any] = {"agent_id": c.agent_id, "epoch": c.epoch}
        if c.call is mv.Call.OFFER:
            assert self.manifest is not None
            args["manifest"] = self.manifest.to_bytes().decode()
        return args

    def _batch_size(self, sha: str | None) -> int:
        """For cutting calls only: 0 for a digest the snapshot does not have
        (the call then fails as an IoFailure and the move rolls back)."""
        return len(self.files[sha]) if sha in self.files else self.blob_sizes.get(sha or "", 0)

    def _size(self, sha: str) -> int:
        """A piece's size as the frozen manifest gives it (never the file's:
        a blob that changed size here must not change the call's framing)."""
        return len(self.files[sha]) if sha in self.files else self.blob_sizes[sha]

    async def _call_with_pieces(self, conn: PeerConnection, args: dict[str, Any], shas: list[str],
                                total: int) -> dict[str, Any]:
        def blob(sha: str) -> tuple[str, int]:
            return self.host.store.blob_file(sha), self._size(sha)

        async with read_ahead(shas, files=self.files, blob=blob) as pieces:
            result, _ = await conn.call(BLOBS_CALL, args, payload=pieces, size=total)
        return result

    async def _send_blobs(self, batch: list[mv.Send]) -> list[object]:
        """One ``blobs`` call for consecutive blob sends: one event per piece,
        or a single Timeout/IoFailure."""
        first = batch[0]
        try:
            items = [(c.sha, self._size(c.sha)) for c in batch if c.sha is not None]
            total = sum(size for _, size in items)
            if self.tier_cache is not None:  # (blobs gc --tier-cache evicted here: back from the tier first)
                try:
                    await self.tier_cache.ensure_local({sha: size for sha, size in items if sha not in self.files})
                except CapsuleError as exc:
                    log.error("move of %s: %s", first.agent_id, exc)
                    self.failed_here = True
                    return [mv.IoFailure(reason=f"reading the agent here: {exc}")]
            conn = await self._conn()
            args = {"agent_id": first.agent_id, "epoch": first.epoch, "items": items}
            with trio.fail_after(self.call_timeout):
                result = await self._call_with_pieces(conn, args, [sha for sha, _ in items], total)
            answers = [result_to_answer(mv.Call.BLOB, first.agent_id, first.epoch, r) for r in result["results"]]
            if [a.sha if isinstance(a, mv.BlobReply) else None for a in answers] != [sha for sha, _ in items]:
                raise FormatError("blobs: the results do not match the pieces sent")
            return answers
        except trio.TooSlowError:
            why = f"blobs got no answer from {self.peer.name} within {self.call_timeout:g}s"
            log.warning("move of %s: %s", first.agent_id, why)
            await self._drop()
            return [mv.Timeout(reason=why)]
        except (PeerError, CapsuleError, KeyError, TypeError) as exc:
            log.warning("move of %s: blobs to %s failed: %s", first.agent_id, self.peer.name, exc)
            self.link_error = exc
            await self._drop()
            return [mv.IoFailure(reason=f"blobs: {exc}")]

    async def _call(self, c: mv.Send) -> object:
        try:
            conn = await self._conn()
            with trio.fail_after(self.call_timeout):
                result, _ = await conn.call(c.call.value, self._args(c))
            return result_to_answer(c.call, c.agent_id, c.epoch, result)
        except trio.TooSlowError:
            why = f"{c.call.value} got no answer from {self.peer.name} within {self.call_timeout:g}s"
            log.warning("move of %s: %s", c.agent_id, why)
            await self._drop()
            return mv.Timeout(reason=why)
        except (PeerError, CapsuleError) as exc:
            log.warning("move of %s: %s to %s failed: %s", c.agent_id, c.call.value, self.peer.name, exc)
            self.link_error = exc
            await self._drop()
            return mv.IoFailure(reason=f"{c.call.value}: {exc}")

    async def _abort(self, c: mv.Send) -> None:
        """Best effort: the target refuses a pending move on its own too."""
        for attempt in range(3):
            event = await self._call(c)
            if isinstance(event, mv.AbortReply):
                return
            if isinstance(self.link_error, PeerUnreachable):
                break  # nothing to tell: we cannot even connect (it refuses on its own when it is back)
            await trio.sleep(self.retry_pause * (attempt + 1))
        log.info("move of %s: could not tell %s to abort; it will discard the staging on its own",
                 c.agent_id, self.peer.name)

    async def _pause_before_status(self) -> bool:
        """Wait before asking status again; True if an operator abandoned meanwhile."""
        if self.status_asked:
            pause = min(self.max_retry_pause, self.retry_pause * 2 ** min(self.status_asked - 1, 16))
            with trio.move_on_after(pause):
                await self.control._abandoned.wait()
        self.status_asked += 1
        return self.control.abandon_reason is not None

    async def _diagnose(self, reply: mv.VerifyReply) -> object:
        """The target found pieces missing or corrupt: re-hash them here. One
        that rotted in this store fails the move as a local read error that
        names its path (and the machine rolls back as for any bad piece);
        otherwise the target's answer stands (damaged on the way)."""

        def rotten() -> CapsuleError | None:
            for sha in reply.bad:
                if sha in self.files:
                    continue  # read and hashed when the snapshot was taken
                try:
                    self.host.store.verify_blob(sha)
                except CorruptBlobError as exc:
                    return exc
                except (CapsuleError, OSError) as exc:
                    return CorruptBlobError(self.host.store.blob_file(sha), why=f"unreadable ({exc})")
            return None

        exc = await trio.to_thread.run_sync(rotten)
        if exc is None:
            return reply
        log.error("move of %s: %s; the target refused it", self.m.agent_id, exc)
        self.link_error, self.failed_here = exc, True
        return mv.IoFailure(reason=f"reading the agent here: {exc}")

    # -- the fleet's directory (capsulefs/move/fleet.py) ----------------------------------
    async def _nudge(self, c: mv.Send) -> None:
        """The directory names the target: tell it now (its activate call), not
        once its prepared move sat idle. Best effort: its answer decides nothing."""
        nudge, answer = mv.Send(call=mv.Call.ACTIVATE, target=c.target, agent_id=c.agent_id, epoch=c.epoch), object()
        assert self.directory is not None  # (the fleet mode's)
        lease = self.directory.fleet.lease
        if self.resumed:  # (the target takes a link only from a live host: once this restarted one has its lease)
            with trio.move_on_after(NUDGE_TIMEOUT):
                await lease.wait_alive()
        if self.resumed and not lease.may_run():
            answer = mv.Timeout(reason=f"this host had no lease from the directory within {NUDGE_TIMEOUT:g}s")
        else:
            with trio.move_on_after(min(self.call_timeout, NUDGE_TIMEOUT)):
                answer = await self._call(nudge)
        told = answer.outcome.value if isinstance(answer, mv.ActivateReply) else None
        log.log(logging.INFO if told else logging.WARNING, "move of %s: nudged %s to activate epoch %d: %s",
                c.agent_id, self.peer.name, c.epoch, told or f"not reached ({getattr(answer, 'reason', 'no answer')}); it "
                f"activates once its own gate asks the directory")

    def _refused_offer(self, reply: mv.OfferReply) -> object:
        """Fleet mode: the directory, not the target's records, says who holds
        the agent; a refused offer rolls back and raises this host's fence to
        the epoch the target named (the next move goes above it)."""
        assert self.directory is not None
        self.directory.cause, self.raise_fence = mv.Cause.REFUSED, reply.highest
        return mv.IoFailure(reason=f"offer refused: {reply.reason}")

    # -- snapshot ---------------------------------------------------------------------
    def _snapshot(self) -> None:
        agent = self.host.store.agent(self.m.agent_id)
        # FROZEN is durable by now: a `capsulefs append` still running
        # finishes first (journal, projections, manifest; snapshot_files
        # waits for the agent's files lock), later ones are refused.
        files = archive.snapshot_files(agent, wait=FILES_WAIT)
        self.manifest = archive.frozen_manifest(agent, files)
        self.files = {self.manifest.files[rel].sha256: data for rel, data in files.items()}
        self.blob_sizes = self.manifest.blobs()
        if self.tier_cache is not None:
            self.pins.enter_context(self.host.store.keeping(self.manifest, "tier-send"))

    def _progress(self, phase: str) -> None:
        if self.control.on_progress is not None:
            total = len(self.m.pending) + self.sent
            self.control.on_progress(phase, self.sent, total, self.bytes_sent + (self.conn.bytes_sent if self.conn else 0))

    # -- the loop -----------------------------------------------------------------------
    def _feed(self, event: object) -> list[Any]:
        if (self.control.abandon_reason is not None and self.m.state in _PRE_COMMIT
                and not (isinstance(event, mv.OfferReply) and not event.accepted)):
            # An abandon written before the point of no return rolls the move
            # back here, at its next step (activate never goes out). Kept for
            # later, it would resume the agent at the first lost activate
            # reply without asking the target once. A refused offer still
            # decides for itself (stale: the agent must not run here).
            event = mv.OperatorAbandon(why=self.control.abandon_reason)
        if not isinstance(event, (mv.Restarted, mv.MoveRequested)):
            self.last_event = event
        return self.m.handle(event)

    def cause(self) -> mv.Cause:
        """MoveResult.cause, from the final state and the event that led there."""
        ev = self.last_event
        match self.m.state:
            case mv.SourceState.DONE:
                return mv.Cause.MOVED
            case mv.SourceState.STALE:
                return mv.Cause.STALE
            case mv.SourceState.ABANDONED:
                return mv.Cause.ABANDONED
        if self.directory is not None and self.directory.cause is not None:
            return self.directory.cause
        match ev:
            case mv.OperatorAbandon():
                return mv.Cause.ABANDONED
            case mv.Timeout():
                return mv.Cause.TIMEOUT
            case mv.IoFailure() if isinstance(self.link_error, RemoteError):
                return mv.Cause.REFUSED  # the target ran the call and could not do it (e.g. its disk is full)
            case mv.IoFailure() if isinstance(self.link_error, PeerRefused):
                return mv.Cause.REFUSED
            case mv.IoFailure() if isinstance(self.link_error, PeerUnreachable):
                return mv.Cause.CONNECTION_REFUSED if _connection_refused(self.link_error) else mv.Cause.UNREACHABLE
            case mv.IoFailure() if self.failed_here:
                return mv.Cause.CORRUPT
            case mv.IoFailure() if isinstance(self.link_error, CorruptBlobError):
                return mv.Cause.CORRUPT
            case mv.IoFailure():
                return mv.Cause.UNREACHABLE
            case mv.BlobReply() | mv.VerifyReply():
                return mv.Cause.CORRUPT
        return mv.Cause.REFUSED  # a refused offer or prepare, or the target decided never

    async def run(self, first: object) -> None:
        try:
            await self._run(first)
        finally:
            await self._drop()
            self.pins.close()

    async def _run(self, first: object) -> None:
        m = self.m
        queue = deque(self._feed(first))
        while queue:
            c = queue.popleft()
            match c:
                case mv.Freeze():
                    # FROZEN is durable already: a freeze that fails (committing
                    # the workspace on a full disk) rolls back like a failed
                    # read, to HELD and a resumed agent.
                    try:
                        await self.host.hooks.freeze(c.agent_id)
                        await trio.to_thread.run_sync(self._snapshot)
                    except (CapsuleError, OSError) as exc:  # roll back like any failure before commit
                        queue = deque([c2 for c2 in queue if isinstance(c2, mv.Persist)])
                        queue.extend([_Local(reason=str(exc))])
                case _Local():
                    self.failed_here = True
                    queue.extend(self._feed(mv.IoFailure(reason=f"reading the agent here: {c.reason}")))
                case mv.Persist(record=rec):
                    if self.raise_fence > rec.epoch and rec.state is HolderState.HELD:
                        rec = rec.with_(epoch=self.raise_fence)
                    self.host.holders.put(rec)
                case mv.Resume() if self.directory is not None and self.directory.commit_sent:
                    if await self.directory.may_resume(c.agent_id, m.record.held_epoch or 0, self.retry_pause):
                        await self.host.hooks.resume(c.agent_id)
                case mv.Resume():
                    await self.host.hooks.resume(c.agent_id)
                case mv.Retire():
                    await self.host.hooks.retire(c.agent_id)
                    try:
                        await trio.to_thread.run_sync(self.host.store.remove_agent, c.agent_id)
                    except NotFoundError:
                        pass
                case mv.Send(call=mv.Call.ABORT):
                    await self._abort(c)
                case mv.Send(call=mv.Call.BLOB):
                    batch, size = [c], self._batch_size(c.sha)
                    while (queue and isinstance(queue[0], mv.Send) and queue[0].call is mv.Call.BLOB
                           and len(batch) < BATCH_ITEMS and size < BATCH_BYTES):
                        nxt = queue.popleft()
                        batch.append(nxt)
                        size += self._batch_size(nxt.sha)
                    batch = [b for b in batch if m.state is mv.SourceState.TRANSFERRING and b.sha in m.pending]
                    if not batch:
                        continue  # the move rolled back meanwhile
                    for event in await self._send_blobs(batch):
                        if m.state is not mv.SourceState.TRANSFERRING:
                            break
                        if isinstance(event, mv.BlobReply) and event.ok:
                            self.sent += 1
                        queue.extend(self._feed(event))
                    self._progress("transferring")
                case mv.Send(call=mv.Call.OFFER) if self.directory is not None and self.directory.ticket is None:
                    failed = await self.directory.begin(c, m.record.held_epoch or 0)
                    if failed is None:
                        queue.appendleft(c)  # the directory names this host: offer as always
                    else:
                        queue.extend(self._feed(failed))
                case mv.Send(call=mv.Call.ACTIVATE) if self.directory is not None:
                    self._progress("activate")
                    event = await self.directory.commit(c)
                    queue.extend(self._feed(event))
                    if isinstance(event, mv.ActivateReply) and event.outcome is mv.Outcome.ACTIVE:
                        await self._nudge(c)  # (before the retire: a crash there leaves the target told)
                case mv.Send(call=mv.Call.STATUS) if self.directory is not None:
                    if await self._pause_before_status():
                        queue.extend(self._feed(mv.OperatorAbandon(why=self.control.abandon_reason or "")))
                        continue
                    self._progress("in doubt")
                    event = await self.directory.settle(c, m.record.held_epoch or 0)
                    queue.extend(self._feed(event))
                    if isinstance(event, mv.StatusReply) and event.outcome is mv.Outcome.ACTIVE:
                        await self._nudge(c)
                case mv.Send(call=mv.Call.STATUS):
                    if await self._pause_before_status():
                        queue.extend(self._feed(mv.OperatorAbandon(why=self.control.abandon_reason or "")))
                        continue
                    self._progress("in doubt")
                    queue.extend(self._feed(await self._call(c)))
                case mv.Send():
                    self._progress(c.call.value)
                    answer = await self._call(c)
                    if isinstance(answer, mv.VerifyReply) and answer.bad:
                        answer = await self._diagnose(answer)
                    if self.directory is not None and isinstance(answer, mv.OfferReply) and not answer.accepted:
                        answer = self._refused_offer(answer)
                    queue.extend(self._feed(answer))
                case _:
                    raise AssertionError(f"unexpected source command {c}")


def _connection_refused(exc: BaseException | None, depth: int = 0) -> bool:
    """Whether ConnectionRefusedError is among an error's causes (trio wraps
    the failed attempts of a connect in an ExceptionGroup)."""
    if exc is None or depth > 8:
        return False
    if isinstance(exc, ConnectionRefusedError):
        return True
    if isinstance(exc, BaseExceptionGroup):
        return any(_connection_refused(e, depth + 1) for e in exc.exceptions)
    return _connection_refused(exc.__cause__ or exc.__context__, depth + 1)


_PRE_COMMIT = frozenset({mv.SourceState.OFFERING, mv.SourceState.TRANSFERRING, mv.SourceState.VERIFYING,
                         mv.SourceState.PREPARING})


@dataclass(frozen=True, slots=True)
class _Local:
    reason: str  # reading the frozen agent here failed


async def move_agent(host: MoveHost, agent_id: str, target: Peer, *, connect: Connector = open_peer,
                     call_timeout: float = 120.0, retry_pause: float = 1.0, max_retry_pause: float = 60.0,
                     control: MoveControl | None = None, fleet: Fleet | None = None,
                     warm: bool = False, tier_cache: TierCache | None = None) -> MoveResult:
    """Move ``agent_id`` from this host to ``target``; return once it moved,
    rolled back, or was abandoned. Blocks as long as the move is in doubt.
    ``fleet``: the directory answers at the point of no return (docs/fleet.md).
    ``warm``: first ask the target to fetch the agent's blobs from the blob
    tier, while the agent still runs (capsulefs/move/warm.py). ``tier_cache``:
    blobs ``gc --tier-cache`` evicted here are fetched back to be sent."""
    control = control or MoveControl()
    if warm:
        if control.on_progress is not None:
            control.on_progress("warming", 0, 0, 0)
        await warm_target(host, agent_id, target, connect=connect, timeout=call_timeout)
        if control.on_progress is not None:
            control.on_progress("freezing", 0, 0, 0)
    async with host.lock(agent_id):
        record = host.holders.get(agent_id)
        if record is None:
            raise mv.MoveError(f"agent {agent_id} has no holder record here")
        machine = mv.SourceMachine(record, me=host.me)
        if machine.state is not mv.SourceState.IDLE:
            raise mv.MoveError(f"agent {agent_id} is already moving ({record.state.value}); see 'capsulefs move --resume'")
        driver = _Driver(host, machine, target, connect=connect, call_timeout=call_timeout, retry_pause=retry_pause,
                         max_retry_pause=max_retry_pause, control=control, fleet=fleet, tier_cache=tier_cache)
        await driver.run(mv.MoveRequested(target=target.host_id))
        return _result(driver)


async def resume_moves(host: MoveHost, *, connect: Connector = open_peer, call_timeout: float = 120.0,
                       retry_pause: float = 1.0, max_retry_pause: float = 60.0,
                       control: MoveControl | None = None,
                       control_for: Callable[[str], MoveControl] | None = None,
                       agent_ids: Iterable[str] | None = None, fleet: Fleet | None = None) -> list[MoveResult]:
    """After a restart: roll back every FROZEN move, resolve every COMMITTING
    one. The agents are resumed concurrently: one whose target is
    unreachable waits (in doubt, asking) without holding up the others.
    ``control_for(agent_id)`` gives each its own control (the daemon's
    ``.control/abandon`` reaches it); else they share ``control``.
    ``agent_ids`` limits the resume to the agents the caller found in doubt
    (a move started after that has a driver of its own); default: all."""
    results: list[MoveResult] = []

    async def one(agent_id: str) -> None:
        async with host.lock(agent_id):
            record = host.holders.get(agent_id)
            if record is None or record.state not in (HolderState.FROZEN, HolderState.COMMITTING):
                return
            assert record.peer is not None
            try:  # (fleet mode: its address is the directory's, at the first call to it; never peers.json)
                peer = (None if fleet is not None else host.peers.by_id(record.peer)) or Peer(
                    name=record.peer if fleet is not None else "unknown", address=_UNKNOWN_ADDRESS, host_id=record.peer)
            except CapsuleError as exc:  # the record names no host a peer could be: nobody to ask
                log.error("cannot resume the move of %s (%s): %s; it stays %s until an operator abandons it",
                          agent_id, record.describe_move(), exc, record.state.value)
                return
            ctl = control_for(agent_id) if control_for is not None else control or MoveControl()
            driver = _Driver(host, mv.SourceMachine(record, me=host.me), peer, connect=connect,
                             call_timeout=call_timeout, retry_pause=retry_pause, max_retry_pause=max_retry_pause,
                             control=ctl, fleet=fleet, find_target=fleet is not None)
            log.info("resuming the move of %s to %s (%s)", agent_id, peer.name, record.state.value)
            await driver.run(mv.Restarted())
            results.append(_result(driver))

    async with trio.open_nursery() as nursery:
        for agent_id in host.holders.agent_ids() if agent_ids is None else agent_ids:
            nursery.start_soon(one, agent_id)
    return results


def _result(d: _Driver) -> MoveResult:
    assert d.m.state in mv.TERMINAL_SOURCE_STATES, d.m.state
    return MoveResult(agent_id=d.m.agent_id, target=d.peer.host_id, epoch=d.m.epoch, state=d.m.state,
                      reason=d.m.record.note, bytes_sent=d.bytes_sent, contents_sent=d.sent, cause=d.cause())
