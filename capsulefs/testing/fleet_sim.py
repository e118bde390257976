"""A fleet on the sans-IO core with a simulated directory: hosts, agents, moves, faults.

Used by the hypothesis stateful test (a few hosts, each step chosen by the
search), a unit test and ``bench/bench_fleet_sim.py`` (1,000 hosts, 100,000
agents, steps chosen at random by :func:`.sim_run.simulate`). Its parts (hosts,
messages, directory requests, faults, figures) are in :mod:`.sim_parts`, the
simulated etcd in :mod:`.sim_etcd`. The move machines (``core.move``), the
directory's Txns and judge (``core.fleet.directory``) and the lease keeper
(``core.fleet.lease``) are the real ones; only the I/O is simulated.

Rules of the model:
  * Time: ``now`` is true time. Each host's clock and etcd's run at a rate
    within ``timing.rate_bound`` of it (chosen per host); a lease expires
    when etcd's clock passes the last keepalive's receipt plus its TTL.
  * A host's records and agent files are durable (survive a crash, not a
    restore from a backup), and so is the staging area of a PREPARED move
    (the directory may name the host already); other staging, frozen
    agents, source machines, permissions and the lease are not.
  * Directory requests wait in ``dir_queue``; each is served with a fault:
    OK, LOST (applied, its reply lost), UNSENT (not applied), DELAYED
    (its reply lost now, applied later by :meth:`FleetWorld.apply_delayed`).
  * An agent runs on a host while the host is up, holds it (record HELD,
    not frozen), has read the directory naming it at that epoch while its
    lease lived (``permits``) and its keeper lets it run. A source drops its
    permit when it sends its commit, and reads the key again if the move
    rolls back. After the keeper's
    stop time it may still be stopping for ``timing.stop_within`` of its
    clock: it counts as a runner until then (:meth:`FleetWorld.runners`).
  * Acknowledged work: a runner's write is acknowledged once it is in the
    tier (``tier[agent]`` counts them); it must build on every write
    acknowledged before (its copy's version equals the tier's), else it is
    an acknowledged write lost. A takeover restores the tier's copy.

Invariants (:meth:`FleetWorld.check`): never two runners of an agent; no
acknowledged write lost (except on a host restored from a backup while it
still held the agent at the same epoch: ``restored``, see docs/fleet.md).
"""

from __future__ import annotations

import itertools
import random

from capsulefs.core import move as mv
from capsulefs.core.fleet import directory as fd
from capsulefs.core.fleet.etcd import (
    KeyValue,
    TxnResult,
)
from capsulefs.core.fleet.lease import DEFAULT_TIMING, LeaseKeeper, LeaseTiming
from capsulefs.core.store.holder import HolderRecord, HolderState, new_held
from capsulefs.testing.sim_etcd import SimEtcd
from capsulefs.testing.sim_parts import DirRequest, Fault, Figures, Host, Message

__all__ = ["LAYOUT", "FleetWorld"]

LAYOUT = fd.Layout(b"/sim/")


class FleetWorld:
    def __init__(self, hosts: int, agents: int, *, seed: int = 0, timing: LeaseTiming = DEFAULT_TIMING,
                 rates: list[float] | None = None, etcd_rate: float = 1.0, hold_through_lapse: bool = False) -> None:
        self.timing = timing
        self.rng = random.Random(seed)
        self.now = 0.0
        self.etcd = SimEtcd(etcd_rate)
        self.ids = itertools.count(1)
        self.figures = Figures()
        self.hold_through_lapse = hold_through_lapse  # a fault planted by tests: ignore the keeper's stop time
        names = [f"h{i:04d}" for i in range(hosts)]
        self.hosts = {n: Host(n, rates[i % len(rates)] if rates else 1.0, LeaseKeeper(timing))
                      for i, n in enumerate(names)}
        self.agents = [f"{i:032x}" for i in range(agents)]
        self.holders: dict[str, set[str]] = {a: set() for a in self.agents}  # hosts with a record of it
        self.tier: dict[str, int] = {a: 0 for a in self.agents}  # acknowledged writes, kept in the tier
        self.net: list[Message] = []
        self.dir_queue: list[DirRequest] = []
        self.delayed: list[DirRequest] = []
        self.snapshots: dict[str, tuple[dict[str, HolderRecord], dict[str, int]]] = {}
        self.pending_since: dict[tuple[str, str, int], float] = {}  # (host, agent, epoch) of pending moves
        self.offered: dict[tuple[str, str, int], int] = {}  # (target, agent, epoch) -> version offered
        self.rolled_back: set[str] = set()  # agents a restore from a backup set back (see the module's rules)
        self.log: list[str] = []
        for i, a in enumerate(self.agents):
            h = self.hosts[names[i % hosts]]
            h.records[a] = new_held(a, 1)
            h.files[a] = 0
            self.holders[a].add(h.name)
            self.etcd.kv[LAYOUT.agent(a)] = KeyValue(key=LAYOUT.agent(a), value=fd.AgentEntry(host_id=h.name, epoch=1)
                                                     .encode(), create_revision=1, mod_revision=1, version=1, lease=0)
        for h in self.hosts.values():
            self.join(h.name)

    # -- observing ------------------------------------------------------------------------
    def _note(self, text: str) -> None:
        if len(self.log) > 200:
            del self.log[:100]
        self.log.append(f"{self.now:9.3f} {text}")

    def running(self, h: Host, agent: str, *, stopping: bool = True) -> bool:
        """Does ``agent`` run on ``h`` now (``stopping``: or may it still be stopping)?"""
        r = h.records.get(agent)
        if not h.up or r is None or r.state is not HolderState.HELD or agent in h.frozen:
            return False
        if h.permits.get(agent) != r.held_epoch:
            return False
        stop_at = h.keeper.stop_at
        if stop_at is None:
            return False
        if self.hold_through_lapse:
            return True
        limit = stop_at + (self.timing.stop_within if stopping else 0.0)
        return h.local(self.now) < limit

    def runners(self, agent: str) -> list[str]:
        return [n for n in self.holders[agent] if self.running(self.hosts[n], agent)]

    def check(self, agent: str | None = None) -> None:
        self.figures.checks += 1
        for a in (self.agents if agent is None else [agent]):
            run = self.runners(a)
            assert len(run) <= 1, f"agent {a[-6:]} runs on {run} at {self.now:.3f}\n" + "\n".join(self.log[-40:])

    # -- time and leases ---------------------------------------------------------------------
    def advance(self, dt: float) -> None:
        self.now += dt
        for lid in self.etcd.expire(self.now):
            self._note(f"etcd expired lease {lid}")

    def renew(self, name: str, fault: Fault = Fault.OK) -> None:
        """``name`` sends a keepalive now (etcd gets it at once: a delay only helps)."""
        h = self.hosts[name]
        if not h.up or h.keeper.lease_id == 0:
            return
        sent = h.local(self.now)
        if h.cut_from_etcd or fault is Fault.UNSENT:
            return
        ttl = self.etcd.keepalive(h.keeper.lease_id, self.now)
        self.figures.dir_ops["keepalive"] += 1
        if fault is not Fault.OK:
            return
        lid = h.keeper.lease_id
        h.keeper.renewed(lid, ttl, sent)
        if ttl == 0:
            self._lease_lost(h)

    def _lease_lost(self, h: Host) -> None:
        self._note(f"{h.name} lost its lease")
        self.figures.lease_losses += 1
        h.keeper.lost()
        h.permits.clear()

    def join(self, name: str) -> None:
        """A host without a lease gets one, registers and reads its agents' keys."""
        h = self.hosts[name]
        if not h.up or h.cut_from_etcd or h.keeper.lease_id:
            return
        sent = h.local(self.now)
        lid = self.etcd.grant(self.timing.ttl, self.now)
        self.etcd.txn(fd.DirTxn((), (fd.register_ops(LAYOUT, fd.HostEntry(host_id=name, address=f"{name}:7000"),
                                                     lid),), ()), self.now)
        h.keeper.granted(lid, self.timing.ttl, sent)
        self.figures.dir_ops["grant"] += 1
        self.figures.dir_ops["register"] += 1
        held = [a for a, r in h.records.items() if r.state is HolderState.HELD]
        self.figures.dir_ops["join_read"] += (len(held) + 127) // 128
        for a, kv in zip(held, self.etcd.read([LAYOUT.agent(a) for a in held], self.now)):
            r = h.records[a]
            if kv is not None and fd.may_run(kv, name, r.held_epoch or 0):
                h.permits[a] = r.held_epoch or 0
                self.check(a)
        self._note(f"{name} joined with lease {lid}, permits {len(h.permits)}")

    def cut(self, name: str, cut: bool) -> None:
        """A partition between ``name`` and etcd (on) or its end (off)."""
        self.hosts[name].cut_from_etcd = cut

    # -- moves: the source -------------------------------------------------------------------
    def start_move(self, name: str, agent: str, target: str) -> bool:
        h = self.hosts[name]
        if not self.running(h, agent, stopping=False) or agent in h.sources or target == name:
            return False
        if not h.keeper.may_run(h.local(self.now)):
            return False
        sm = mv.SourceMachine(h.records[agent], me=name)
        h.sources[agent] = sm
        self.figures.moves_started += 1
        self._source_do(h, agent, sm.handle(mv.MoveRequested(target=target)))
        return True

    def _dir(self, h: Host, agent: str, kind: str, **kw: object) -> None:
        self.dir_queue.append(DirRequest(next(self.ids), h.name, h.boot, agent, kind, **kw))  # type: ignore[arg-type]

    def _source_do(self, h: Host, agent: str, commands: list[mv.Command]) -> None:
        sm = h.sources[agent]
        for c in commands:
            match c:
                case mv.Freeze():
                    h.frozen.add(agent)
                case mv.Resume():
                    h.frozen.discard(agent)
                    if agent not in h.permits:  # its commit was sent: read the key again before it runs
                        self._dir(h, agent, "resume_read", epoch=h.records[agent].held_epoch or 0)
                    self.check(agent)
                case mv.Persist(record=r):
                    h.records[agent] = r
                case mv.Retire():
                    h.frozen.discard(agent)
                    h.files.pop(agent, None)
                    h.permits.pop(agent, None)
                case mv.Send(call=mv.Call.OFFER):
                    # the source reads its key before the offer: the commit compares against this read
                    self._dir(h, agent, "start_read", epoch=c.epoch, target=c.target)
                case mv.Send(call=mv.Call.ACTIVATE):
                    # From here the entry may name the target: the read behind the permit is void.
                    h.permits.pop(agent, None)
                    seen = h.seen[agent]
                    self._dir(h, agent, "commit", txn=fd.commit_txn(LAYOUT, agent, seen, c.target, c.epoch),
                              epoch=c.epoch, target=c.target)
                case mv.Send(call=mv.Call.STATUS):
                    self._dir(h, agent, "status_read", epoch=c.epoch, target=c.target)
                case mv.Send():
                    self._send(h, agent, c)
                case _:
                    raise AssertionError(f"unexpected source command {c}")
        if sm.state in mv.TERMINAL_SOURCE_STATES:
            del h.sources[agent]
            h.awaiting.pop(agent, None)
            h.seen.pop(agent, None)
            if sm.state is mv.SourceState.DONE:
                self.figures.moves_done += 1
            else:
                self.figures.moves_rolled_back += 1

    def _send(self, h: Host, agent: str, c: mv.Send, *, version: int = 0) -> None:
        mid = next(self.ids)
        if c.call is not mv.Call.ABORT and c.call is not mv.Call.ACTIVATE:
            h.awaiting.setdefault(agent, set()).add(mid)
        self.net.append(Message(mid, c.target, h.name, c, version=version))

    def _feed(self, h: Host, agent: str, event: object) -> None:
        sm = h.sources.get(agent)
        if sm is None:
            return
        h.awaiting.pop(agent, None)
        self._source_do(h, agent, sm.handle(event))

    def timeout(self, name: str, agent: str) -> None:
        h = self.hosts[name]
        if agent in h.sources and h.awaiting.get(agent):
            self._feed(h, agent, mv.Timeout())

    # -- the directory's requests ---------------------------------------------------------------
    def serve_dir(self, index: int, fault: Fault = Fault.OK) -> None:
        req = self.dir_queue.pop(index)
        h = self.hosts[req.host]
        if not h.up or h.boot != req.boot:
            return  # the host that asked is gone: the request died with it
        if h.cut_from_etcd:
            fault = Fault.UNSENT
        self.figures.dir_ops[req.kind] += 1
        if fault is Fault.DELAYED:
            self.delayed.append(req)
        elif fault is not Fault.UNSENT:
            answer = self._apply_dir(req)
            if fault is Fault.OK:
                self._dir_answer(h, req, answer)
                return
        self._dir_failed(h, req)

    def apply_delayed(self, index: int) -> None:
        """A request whose reply was lost reaches etcd now (nobody hears the answer)."""
        req = self.delayed.pop(index)
        self._apply_dir(req)

    def _apply_dir(self, req: DirRequest) -> object:
        key = LAYOUT.agent(req.agent)
        if req.txn is not None:
            return self.etcd.txn(req.txn, self.now)
        (kv,) = self.etcd.read([key], self.now)
        return kv

    def _dir_failed(self, h: Host, req: DirRequest) -> None:
        """No answer: the source machine hears an I/O failure; a target's gate tries again later."""
        if req.kind == "resume_read":
            self._dir(h, req.agent, "resume_read", epoch=req.epoch)
            return
        if req.kind in ("start_read", "commit", "status_read", "fence"):
            if self._current(h, req):
                self._feed(h, req.agent, mv.IoFailure(reason=f"directory: {req.kind} got no answer"))
                if req.kind == "commit":
                    self.figures.moves_in_doubt += 1

    def _current(self, h: Host, req: DirRequest) -> bool:
        sm = h.sources.get(req.agent)
        return sm is not None and sm.epoch == req.epoch

    def _dir_answer(self, h: Host, req: DirRequest, answer: object) -> None:
        a = req.agent
        match req.kind:
            case "start_read":
                if not self._current(h, req):
                    return
                kv = answer if isinstance(answer, KeyValue) else None
                r = h.records[a]
                if kv is None or not fd.may_run(kv, h.name, r.held_epoch or 0):
                    self._feed(h, a, mv.IoFailure(reason="the directory does not name this host"))
                    return
                h.seen[a] = kv
                self._send(h, a, mv.Send(call=mv.Call.OFFER, target=req.target, agent_id=a, epoch=req.epoch),
                           version=h.files[a])
            case "commit" | "fence":
                if not self._current(h, req):
                    return
                assert isinstance(answer, TxnResult)
                sm = h.sources[a]
                move = fd.Move(source=h.name, held_epoch=sm.record.held_epoch or 0, target=req.target,
                               epoch=req.epoch)
                assert req.txn is not None  # (a commit or fence request carries its Txn)
                outcome, why = fd.judge(req.txn, req.kind, move, answer)
                self._note(f"{h.name} {req.kind} {a[-6:]}@{req.epoch}: {outcome.value} ({why})")
                cls = mv.ActivateReply if req.kind == "commit" else mv.StatusReply
                self._feed(h, a, cls(agent_id=a, epoch=req.epoch, outcome=outcome))
                if outcome is mv.Outcome.ACTIVE:
                    # the nudge: the target activates once it reads that the directory names it
                    self._send(h, a, mv.Send(call=mv.Call.ACTIVATE, target=req.target, agent_id=a, epoch=req.epoch))
            case "status_read":
                if not self._current(h, req):
                    return
                kv = answer if isinstance(answer, KeyValue) else None
                if kv is None:
                    self._feed(h, a, mv.StatusReply(agent_id=a, epoch=req.epoch, outcome=mv.Outcome.NEVER))
                    return
                if fd.decode_agent(kv.value).names(req.target, req.epoch):
                    self._feed(h, a, mv.StatusReply(agent_id=a, epoch=req.epoch, outcome=mv.Outcome.ACTIVE))
                    self._send(h, a, mv.Send(call=mv.Call.ACTIVATE, target=req.target, agent_id=a, epoch=req.epoch))
                    return
                self._dir(h, a, "fence", txn=fd.fence_txn(LAYOUT, a, kv), epoch=req.epoch, target=req.target)
            case "resume_read":
                held = h.records.get(a)
                kv = answer if isinstance(answer, KeyValue) else None
                if (held is not None and held.state is HolderState.HELD and held.held_epoch == req.epoch
                        and h.keeper.lease_id and fd.may_run(kv, h.name, req.epoch)):
                    h.permits[a] = req.epoch
                    self.check(a)
            case "nudge_read" | "gate_read":
                kv = answer if isinstance(answer, KeyValue) else None
                self._target_gate(h, a, req, kv)
            case "gate_fence":
                assert isinstance(answer, TxnResult)
                pending = h.records.get(a)
                if pending is None or not pending.pending or pending.epoch != req.epoch:
                    return
                if answer.succeeded:
                    self._target_event(h, a, mv.Expired(agent_id=a))
                else:
                    self._dir(h, a, "gate_read", epoch=req.epoch)
            case _:
                raise AssertionError(req.kind)

    # -- moves: the target ------------------------------------------------------------------------
    def deliver(self, index: int, *, keep: bool = False) -> None:
        msg = self.net[index] if keep else self.net.pop(index)
        h = self.hosts[msg.to]
        if not h.up:
            return
        if msg.answer is not None:
            a = msg.send.agent_id
            if msg.id not in h.awaiting.get(a, set()):
                return  # late or duplicated: the driver drops it
            ans = msg.answer
            if isinstance(ans, mv.OfferReply) and not ans.accepted:
                # The fleet's rule: the directory, not the target's records, says who holds the
                # agent; a refusal naming a newer epoch only raises this host's fence.
                self._feed(h, a, mv.IoFailure(reason=f"offer refused: {ans.reason}"))
                r = h.records[a]
                if r.state is HolderState.HELD and ans.highest > r.epoch:
                    h.records[a] = r.with_(epoch=ans.highest)
                return
            self._feed(h, a, ans)
            return
        self._serve(h, msg)

    def _serve(self, h: Host, msg: Message) -> None:
        s = msg.send
        a = s.agent_id
        match s.call:
            case mv.Call.OFFER:
                ev: object = mv.OfferReceived(agent_id=a, epoch=s.epoch, source=msg.frm, missing=())
                self.offered[(h.name, a, s.epoch)] = msg.version
            case mv.Call.VERIFY:
                ev = mv.VerifyRequested(agent_id=a, epoch=s.epoch, source=msg.frm)
            case mv.Call.PREPARE:
                ev = mv.PrepareRequested(agent_id=a, epoch=s.epoch, source=msg.frm)
            case mv.Call.ABORT:
                ev = mv.AbortRequested(agent_id=a, epoch=s.epoch, source=msg.frm)
            case mv.Call.ACTIVATE:
                r = h.records.get(a)
                if r is not None and r.state is HolderState.PREPARED and r.epoch == s.epoch:
                    self._dir(h, a, "nudge_read", epoch=s.epoch)
                return
            case _:
                raise AssertionError(s.call)
        for answer in self._target_event(h, a, ev):
            self.net.append(Message(msg.id, msg.frm, h.name, s, answer=answer))

    def _target_event(self, h: Host, a: str, ev: object) -> list[object]:
        tm = mv.TargetMachine(a, h.records.get(a), me=h.name)
        src = getattr(ev, "source", "")  # the requests' caller (CheckBlobs and BuildStaging follow one)
        out: list[object] = []
        queue = list(tm.handle(ev))
        while queue:
            c = queue.pop(0)
            match c:
                case mv.Persist(record=r):
                    h.records[a] = r
                    self.holders[a].add(h.name)
                    if r.state is HolderState.OFFERED:
                        self.pending_since[(h.name, a, r.epoch)] = self.now
                case mv.DiscardStaging(epoch=e):
                    h.staging.pop((a, e), None)
                case mv.DropAgentFiles():
                    h.files.pop(a, None)
                    h.permits.pop(a, None)
                case mv.CheckBlobs(epoch=e):
                    queue[:0] = tm.handle(mv.BlobsChecked(agent_id=a, epoch=e, source=src, bad=()))
                case mv.BuildStaging(epoch=e):
                    h.staging[(a, e)] = self.offered.pop((h.name, a, e), 0)
                    queue[:0] = tm.handle(mv.StagingBuilt(agent_id=a, epoch=e, source=src, ok=True))
                case mv.Install(epoch=e):
                    h.files[a] = h.staging.pop((a, e))
                case mv.ActivateAgent(epoch=e):
                    h.frozen.discard(a)
                case mv.Reply(answer=ans):
                    out.append(ans)
                case _:
                    raise AssertionError(f"unexpected target command {c}")
        return out

    def _target_gate(self, h: Host, a: str, req: DirRequest, kv: KeyValue | None) -> None:
        """A prepared target asks the directory: activate if it names us, refuse once no commit can apply."""
        r = h.records.get(a)
        if r is None or not r.pending or r.epoch != req.epoch:
            return
        entry = None if kv is None else fd.decode_agent(kv.value)
        if entry is not None and entry.names(h.name, r.epoch):
            if r.state is HolderState.PREPARED and h.keeper.may_run(h.local(self.now)):
                assert r.peer is not None
                self._target_event(h, a, mv.ActivateRequested(agent_id=a, epoch=r.epoch, source=r.peer))
                h.permits[a] = r.epoch
                self.check(a)
            return
        if req.kind == "nudge_read":
            return  # a nudge only ever activates
        if kv is not None and entry is not None and entry.host_id == r.peer:
            self._dir(h, a, "gate_fence", txn=fd.fence_txn(LAYOUT, a, kv), epoch=r.epoch)
            return
        self._target_event(h, a, mv.Expired(agent_id=a))  # the entry moved on: no commit of ours can apply

    def still_pending(self, name: str, agent: str, epoch: int) -> bool:
        r = self.hosts[name].records.get(agent)
        return r is not None and r.pending and r.epoch == epoch

    def expire_pending(self, name: str, agent: str) -> None:
        """A pending move sat idle: the target asks the directory before it refuses."""
        h = self.hosts[name]
        r = h.records.get(agent)
        if h.up and r is not None and r.pending:
            self._dir(h, agent, "gate_read", epoch=r.epoch)

    # -- crashes, restores, takeovers, work --------------------------------------------------------
    def crash(self, name: str) -> None:
        """kill -9 and restart: volatile state gone, the lease left to expire."""
        h = self.hosts[name]
        self.figures.crashes += 1
        h.boot += 1
        # A prepared staging area survives the restart: the directory may name this host already.
        h.staging = {(a, e): v for (a, e), v in h.staging.items()
                     if (r := h.records.get(a)) is not None and r.state is HolderState.PREPARED and r.epoch == e}
        h.frozen.clear()
        h.sources.clear()
        h.awaiting.clear()
        h.seen.clear()
        h.permits.clear()
        h.keeper = LeaseKeeper(self.timing)
        self._note(f"{name} crashed")
        for a, r in list(h.records.items()):
            if r.state in (HolderState.FROZEN, HolderState.COMMITTING):
                h.frozen.add(a)
                sm = mv.SourceMachine(r, me=name)
                h.sources[a] = sm
                self._source_do(h, a, sm.handle(mv.Restarted()))
            elif r.pending:
                self._dir(h, a, "gate_read", epoch=r.epoch)  # instead of refusing at once: it may hold it
            else:
                self._target_event(h, a, mv.TargetRestarted(agent_id=a))

    def snapshot(self, name: str) -> None:
        h = self.hosts[name]
        self.snapshots[name] = (dict(h.records), dict(h.files))

    def restore(self, name: str) -> None:
        """The host comes back from its backup: records and files as they were."""
        if name not in self.snapshots:
            return
        h = self.hosts[name]
        records, files = self.snapshots[name]
        for a, v in files.items():
            if h.files.get(a) != v:
                self.rolled_back.add(a)
        h.records, h.files = dict(records), dict(files)
        for a in h.records:
            self.holders[a].add(name)
        self.crash(name)

    def takeover(self, name: str, agent: str) -> bool:
        """``name`` takes ``agent`` from a holder whose host key is gone, restoring the tier's copy."""
        h = self.hosts[name]
        if not h.up or h.cut_from_etcd or not h.keeper.may_run(h.local(self.now)):
            return False
        (kv,) = self.etcd.read([LAYOUT.agent(agent)], self.now)
        self.figures.dir_ops["takeover_read"] += 1
        if kv is None:
            return False
        entry = fd.decode_agent(kv.value)
        if entry.host_id == name or self.etcd.get(LAYOUT.host(entry.host_id)) is not None:
            return False
        mine = h.records.get(agent)
        if mine is not None and (mine.holding or mine.pending):
            return False  # keep the model simple: the new holder has no move of it under way
        epoch = max(entry.epoch, 0 if mine is None else mine.epoch) + 1
        self.figures.dir_ops["takeover"] += 1
        result = self.etcd.txn(fd.takeover_txn(LAYOUT, agent, kv, name, epoch), self.now)
        if not result.succeeded:
            return False
        self.figures.takeovers += 1
        activated = () if mine is None else mine.activated
        h.records[agent] = HolderRecord(agent_id=agent, state=HolderState.HELD, epoch=epoch, held_epoch=epoch,
                                        activated=(*activated, epoch), note=f"taken over from {entry.host_id}")
        h.files[agent] = self.tier[agent]
        h.permits[agent] = epoch
        self.holders[agent].add(name)
        self._note(f"{name} took over {agent[-6:]} from {entry.host_id} at epoch {epoch}")
        self.check(agent)
        return True

    def work(self, name: str, agent: str) -> bool:
        """The agent acknowledges a write (once it is in the tier) if it runs on ``name``."""
        h = self.hosts[name]
        if not self.running(h, agent, stopping=False):
            return False
        if agent not in self.rolled_back:
            assert h.files[agent] == self.tier[agent], (
                f"agent {agent[-6:]} on {name} builds on version {h.files[agent]} but {self.tier[agent]} "
                f"writes were acknowledged: acknowledged work lost\n" + "\n".join(self.log[-40:]))
        h.files[agent] = self.tier[agent] = max(h.files[agent], self.tier[agent]) + 1
        self.figures.acks += 1
        return True
