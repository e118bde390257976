"""An in-memory world of hosts that run the sans-IO move machines.

Used by the stateful hypothesis test and the core unit tests. Each host has
a durable holder record (survives crashes), volatile staging and a source
machine (lost on a crash), and files on disk (survive crashes). Messages are
kept in a list the test may deliver in any order, duplicate or drop. A
source is only handed replies to the requests it still awaits (a real driver
correlates replies with requests); everything else is noise it never sees.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from capsulefs.core import move as mv
from capsulefs.core.store.holder import HolderRecord, HolderState, PeerView, learn_from_peers, new_held

AGENT = "a" * 32
BLOBS = ("1" * 64, "2" * 64, "3" * 64)


@dataclass
class Host:
    name: str
    record: HolderRecord | None = None  # durable
    files_epoch: int | None = None  # durable: agent files installed here, at this holder epoch
    blobs: set[str] = field(default_factory=set)  # durable
    staging: set[int] = field(default_factory=set)  # volatile: epochs with a staging area
    frozen: bool = False  # volatile
    source: mv.SourceMachine | None = None  # volatile
    awaiting: dict[int, mv.Send] = field(default_factory=dict)  # volatile: request id -> call

    @property
    def running(self) -> bool:
        return self.record is not None and self.record.state is HolderState.HELD and not self.frozen


@dataclass
class Message:
    id: int
    to: str
    frm: str
    request: mv.Send | None = None  # a request, or
    answer: object | None = None  # a reply to request ``id``


class World:
    def __init__(self, names: tuple[str, ...] = ("A" * 52, "B" * 52), *, shared_blobs: int = 0) -> None:
        self.hosts = {n: Host(n, blobs=set(BLOBS[:shared_blobs])) for n in names}
        first = self.hosts[names[0]]
        first.record = new_held(AGENT, 1)
        first.files_epoch = 1
        first.blobs = set(BLOBS)
        self.net: list[Message] = []
        self.ids = itertools.count(1)
        self.corrupt_next_blob = False
        self.log: list[str] = []

    # -- invariant -----------------------------------------------------------
    def check(self) -> None:
        running = [h.name[:1] for h in self.hosts.values() if h.running]
        assert len(running) <= 1, f"two hosts run the agent: {running}\n" + "\n".join(self.log[-30:])
        held = [h.name[:1] for h in self.hosts.values() if h.record is not None and h.record.state is HolderState.HELD]
        assert len(held) <= 1, f"two HELD records: {held}\n" + "\n".join(self.log[-30:])
        for h in self.hosts.values():
            if h.record is not None and h.record.state is HolderState.HELD:
                assert h.files_epoch is not None, f"{h.name[:1]} holds the agent but has no files"

    # -- the source side -------------------------------------------------------
    def start(self, frm: str, to: str) -> None:
        h = self.hosts[frm]
        assert h.record is not None and h.record.state is HolderState.HELD and h.source is None
        h.source = mv.SourceMachine(h.record, me=frm)
        self._source_do(h, h.source.handle(mv.MoveRequested(target=to)))

    def _source_do(self, h: Host, commands: list) -> None:
        assert h.source is not None
        for c in commands:
            self.log.append(f"{h.name[:1]} src {h.source.state.name}: {c}")
            match c:
                case mv.Freeze():
                    h.frozen = True
                case mv.Resume():
                    h.frozen = False
                case mv.Persist(record=r):
                    h.record = r
                case mv.Retire():
                    h.frozen = False
                    h.files_epoch = None
                case mv.Send():
                    mid = next(self.ids)
                    if c.call is not mv.Call.ABORT:  # aborts are fire and forget
                        h.awaiting[mid] = c
                    self.net.append(Message(id=mid, to=c.target, frm=h.name, request=c))
                case _:
                    raise AssertionError(f"unexpected source command {c}")
        if h.source.state in mv.TERMINAL_SOURCE_STATES:
            h.source = None
            h.awaiting.clear()

    def timeout(self, name: str) -> None:
        h = self.hosts[name]
        assert h.source is not None and h.awaiting
        h.awaiting.clear()
        self._source_do(h, h.source.handle(mv.Timeout()))

    def abandon(self, name: str) -> None:
        h = self.hosts[name]
        assert h.source is not None
        h.awaiting.clear()
        self._source_do(h, h.source.handle(mv.OperatorAbandon(why="test")))

    # -- the network --------------------------------------------------------------
    def deliver(self, index: int, *, keep: bool = False) -> None:
        msg = self.net[index] if keep else self.net.pop(index)
        h = self.hosts[msg.to]
        if msg.request is not None:
            self._serve(h, msg)
            return
        if msg.id not in h.awaiting or h.source is None:
            return  # a late or duplicated reply: the driver drops it
        del h.awaiting[msg.id]
        self._source_do(h, h.source.handle(msg.answer))

    # -- the target side ----------------------------------------------------------
    def _serve(self, h: Host, msg: Message) -> None:
        req = msg.request
        assert req is not None
        base = dict(agent_id=req.agent_id, epoch=req.epoch, source=msg.frm)
        match req.call:
            case mv.Call.OFFER:
                ev: object = mv.OfferReceived(**base, missing=tuple(b for b in BLOBS if b not in h.blobs))
            case mv.Call.BLOB:
                intact = not self.corrupt_next_blob
                self.corrupt_next_blob = False
                if intact:
                    h.blobs.add(req.sha)
                ev = mv.BlobReceived(**base, sha=req.sha, intact=intact)
            case mv.Call.VERIFY:
                ev = mv.VerifyRequested(**base)
            case mv.Call.PREPARE:
                ev = mv.PrepareRequested(**base)
            case mv.Call.ACTIVATE:
                ev = mv.ActivateRequested(**base)
            case mv.Call.STATUS:
                ev = mv.StatusRequested(**base)
            case mv.Call.ABORT:
                ev = mv.AbortRequested(**base)
            case _:
                raise AssertionError(req.call)
        self.target_event(h, ev, reply_to=msg)

    def target_event(self, h: Host, ev: object, reply_to: Message | None = None) -> list:
        tm = mv.TargetMachine(AGENT, h.record, me=h.name)
        out = []
        queue = list(tm.handle(ev))
        while queue:
            c = queue.pop(0)
            self.log.append(f"{h.name[:1]} tgt {tm.state}: {c}")
            match c:
                case mv.Persist(record=r):
                    h.record = r
                case mv.DiscardStaging(epoch=e):
                    h.staging.discard(e)
                case mv.DropAgentFiles():
                    assert h.record is None or not h.record.holding
                    h.files_epoch = None
                case mv.CheckBlobs(epoch=e):
                    bad = tuple(b for b in BLOBS if b not in h.blobs)
                    queue[:0] = tm.handle(mv.BlobsChecked(agent_id=AGENT, epoch=e, source=ev.source, bad=bad))
                case mv.BuildStaging(epoch=e):
                    h.staging.add(e)
                    queue[:0] = tm.handle(mv.StagingBuilt(agent_id=AGENT, epoch=e, source=ev.source, ok=True))
                case mv.Install(epoch=e):
                    assert e in h.staging, "install without a staging area"
                    h.staging.discard(e)
                    h.files_epoch = e
                case mv.ActivateAgent():
                    h.frozen = False
                case mv.Reply(answer=a):
                    out.append(a)
                    if reply_to is not None:
                        self.net.append(Message(id=reply_to.id, to=reply_to.frm, frm=h.name, answer=a))
                case _:
                    raise AssertionError(f"unexpected target command {c}")
        return out

    # -- crashes ---------------------------------------------------------------------
    def crash(self, name: str, *, lose_record: bool = False) -> None:
        h = self.hosts[name]
        h.source = None
        h.awaiting.clear()
        h.staging.clear()
        h.frozen = False
        if lose_record:
            h.record = None
        # restart: first the record decides; a lost one with files here is UNKNOWN
        if h.record is None and h.files_epoch is not None:
            h.record = HolderRecord(agent_id=AGENT, state=HolderState.UNKNOWN, epoch=0, note="lost")
        if h.record is None:
            return
        if h.record.state in (HolderState.FROZEN, HolderState.COMMITTING):
            h.frozen = True
            h.source = mv.SourceMachine(h.record, me=name)
            self._source_do(h, h.source.handle(mv.Restarted()))
        else:
            self.target_event(h, mv.TargetRestarted(agent_id=AGENT))

    def learn(self, name: str) -> None:
        """The UNKNOWN host fences every peer and learns (calls assumed to get through)."""
        h = self.hosts[name]
        assert h.record is not None and h.record.state is HolderState.UNKNOWN and h.files_epoch is not None
        views: dict[str, PeerView] = {}
        for other in self.hosts.values():
            if other is h:
                continue
            (answer,) = self.target_event(other, mv.FenceRequested(agent_id=AGENT, source=name))
            views[other.name] = answer.view
        h.record = learn_from_peers(h.record, local_epoch=h.files_epoch, views=views,
                                    peers=[o for o in self.hosts if o != name])
        if h.record.state is HolderState.RETIRED:
            h.files_epoch = None
