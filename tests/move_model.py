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
from capsulefs.core.store import lifecycle as lc
from capsulefs.core.store.holder import HolderRecord, HolderState, new_held
from capsulefs.core.store.learning import PeerView, learn_from_peers

AGENT = "a" * 32
BLOBS = ("1" * 64, "2" * 64, "3" * 64)


@dataclass
class Host:
    name: str
    record: HolderRecord | None = None  # durable
    files_epoch: int | None = None  # durable: agent files installed here, at this holder epoch
    files_holder: str | None = None  # durable: the host their manifest names
    blobs: set[str] = field(default_factory=set)  # durable
    staging: set[int] = field(default_factory=set)  # volatile: epochs with a staging area
    frozen: bool = False  # volatile
    source: mv.SourceMachine | None = None  # volatile
    awaiting: dict[int, mv.Send] = field(default_factory=dict)  # volatile: request id -> call
    # What the daemon learned in this life (capsulefs/move/standing.py): peers' claims, and whether
    # it created the agent; the record's epoch at its start (a higher hold from a peer: moved in).
    answers: dict[str, lc.Claim | None] = field(default_factory=dict)  # volatile
    created: bool = False  # volatile
    start_epoch: int = 0  # volatile
    lives: int = 0  # restarts, to tell whether two hosts talked since

    @property
    def running(self) -> bool:
        """Held and not frozen (the move machines' view; World.running adds the lifecycle's)."""
        return self.record is not None and self.record.state is HolderState.HELD and not self.frozen

    def durable(self) -> tuple[HolderRecord | None, int | None, str | None, frozenset[str]]:
        return self.record, self.files_epoch, self.files_holder, frozenset(self.blobs)

    def evidence(self, peers: frozenset[str]) -> lc.Evidence:
        r = self.record
        assert r is not None and r.state is HolderState.HELD
        if self.files_epoch is None or self.files_holder is None:
            return lc.Evidence.NONE
        own = self.created or (r.peer is not None and r.held_epoch is not None and r.held_epoch in r.activated
                               and r.held_epoch > self.start_epoch)
        return lc.gather(r, me=self.name, manifest_holder=self.files_holder, manifest_epoch=self.files_epoch,
                         peers=peers - {self.name}, answers=self.answers, own=own)

    def may_run(self, peers: frozenset[str]) -> bool:
        """The lifecycle's decision (core/store/lifecycle.py)."""
        if self.record is None or self.record.state is not HolderState.HELD:
            return False
        return lc.decide(self.record, self.evidence(peers)).run

    def claim(self) -> lc.Claim | None:
        r = self.record
        if r is None or r.state is HolderState.UNKNOWN:
            return None
        c = lc.claim_of(r, named=self.files_epoch is not None and self.files_holder == self.name)
        return c if c.held is not None or c.top > 0 else None


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
        first.files_holder = first.name
        first.created = True
        first.blobs = set(BLOBS)
        self.names = frozenset(names)
        #: every durable state each host has been in (for restoring an old copy)
        self.history: dict[str, list[tuple[HolderRecord | None, int | None, str | None, frozenset[str]]]] = {
            n: [h.durable()] for n, h in self.hosts.items()}
        self.restored = False  # an old copy of some host's records was restored
        #: pair of hosts -> what each had (record, lives) when they last exchanged claims
        self.talked: dict[frozenset[str], dict[str, tuple[HolderRecord | None, int]]] = {}
        self.net: list[Message] = []
        self.ids = itertools.count(1)
        self.corrupt_next_blob = False
        self.log: list[str] = []

    # -- invariant -----------------------------------------------------------
    def running(self, h: Host) -> bool:
        return h.may_run(self.names) and not h.frozen

    def talked_since(self, x: Host, y: Host) -> bool:
        """Have x and y exchanged claims since either restarted or changed its record?"""
        seen = self.talked.get(frozenset((x.name, y.name)))
        return seen is not None and all(seen[h.name] == (h.record, h.lives) for h in (x, y))

    def check(self) -> None:
        run = [h for h in self.hosts.values() if self.running(h)]
        for i, x in enumerate(run):
            for y in run[i + 1:]:
                # Two hosts may both run it only until they next talk (a restored host whose
                # holder was not asked yet); without restores, never.
                assert self.restored and not self.talked_since(x, y), (
                    f"two hosts run the agent: {x.name[:1]} {y.name[:1]}\n" + "\n".join(self.log[-30:]))
        held = [h.name[:1] for h in self.hosts.values() if h.record is not None and h.record.state is HolderState.HELD]
        assert self.restored or len(held) <= 1, f"two HELD records: {held}\n" + "\n".join(self.log[-30:])
        for h in self.hosts.values():
            if h.record is not None and h.record.state is HolderState.HELD:
                assert h.files_epoch is not None, f"{h.name[:1]} holds the agent but has no files"
            if self.history[h.name][-1] != h.durable():
                self.history[h.name].append(h.durable())

    # -- checking before running, and while running (core/store/lifecycle.py) ---------------
    def exchange(self, x_name: str, y_name: str) -> None:
        """One ``holds`` exchange between two hosts, then each settles: a host a
        peer outranks records UNKNOWN (and so stops running the agent)."""
        x, y = self.hosts[x_name], self.hosts[y_name]
        x.answers[y.name], y.answers[x.name] = y.claim(), x.claim()
        for h in (x, y):
            r = h.record
            if r is not None and r.state is HolderState.HELD and h.evidence(self.names) is lc.Evidence.NEWER:
                seen = max([r.epoch] + [max(c.top, c.held or 0) for c in h.answers.values() if c is not None])
                h.record = HolderRecord(agent_id=AGENT, state=HolderState.UNKNOWN, epoch=seen,
                                        activated=r.activated, note="a peer holds a higher epoch")
                self.log.append(f"{h.name[:1]} stale: {h.answers}")
        self.talked[frozenset((x.name, y.name))] = {h.name: (h.record, h.lives) for h in (x, y)}

    def restore(self, name: str, index: int) -> None:
        """An old copy of a host's durable state (records, files, blobs) put
        back, as from a backup or a VM snapshot; then the host restarts."""
        h = self.hosts[name]
        h.record, h.files_epoch, h.files_holder, blobs = self.history[name][index]
        h.blobs = set(blobs)
        self.restored = True
        self.log.append(f"{name[:1]} restored to {h.record} files {h.files_epoch}")
        self.crash(name)

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
                    h.files_epoch = h.files_holder = None
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
                    h.files_epoch = h.files_holder = None
                case mv.CheckBlobs(epoch=e):
                    bad = tuple(b for b in BLOBS if b not in h.blobs)
                    queue[:0] = tm.handle(mv.BlobsChecked(agent_id=AGENT, epoch=e, source=ev.source, bad=bad))
                case mv.BuildStaging(epoch=e):
                    h.staging.add(e)
                    queue[:0] = tm.handle(mv.StagingBuilt(agent_id=AGENT, epoch=e, source=ev.source, ok=True))
                case mv.Install(epoch=e):
                    assert e in h.staging, "install without a staging area"
                    h.staging.discard(e)
                    h.files_epoch, h.files_holder = e, h.name
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
        h.answers.clear()
        h.created = False
        h.lives += 1
        h.start_epoch = h.record.epoch if h.record is not None and not lose_record else 0
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
            h.files_epoch = h.files_holder = None
