"""Real daemons, each in a network namespace of its own (tests/netns_kit.py).

Three in the fleet mode, with a real etcd in another namespace: a host cut
from etcd, etcd killed with -9, a host killed with -9 and restored from a
backup. Two, peer-to-peer or in the fleet mode: a partition between them at
each phase of a move (the fleet mode at three). Two in the fleet mode: kill
-9 of the source or of etcd at a move's point of no return (the commit sent
and unanswered; applied before the target activated).

Each agent is a ticker process; a sampler (sampler_process.py) lists every
host's agent processes every few ms, and the test fails if any sample shows
one agent running on two hosts. A writer appends an event to every agent's
journal through its mount every 50 ms; every append that was acknowledged
must be in the capsule of the host that holds the agent at the end.

The hosts' lease is 5 s (the test seam CAPSULEFS_TEST_LEASE_TIMING=5,1,1,2:
a keepalive every second, the agents stopped 2.9 s after the send of the
last one answered), so a host cut from etcd stops in about 3 s. docs/fleet.md,
"Several daemons in network namespaces".
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import pytest
import trio

from capsulefs.agents import grants
from capsulefs.core.capsule.spec import parse_spec
from capsulefs.core.fleet import directory as fd
from capsulefs.core.store.holder import HolderBook, HolderState
from capsulefs.core.store.host_store import HostStore
from capsulefs.fleet.etcd import EtcdClient, open_etcd
from capsulefs.move.host import new_agent_files, record_new_agent
from capsulefs.peer.book import Peer, PeerBook
from capsulefs.peer.identity import load_or_create_identity
from capsulefs.testing.seams import CALL_TIMEOUT_ENV, CRASH_ENV, LEASE_TIMING_ENV, STOP_ENV
from fleet_kit import ETCD, KillableEtcd
from helpers import HANG
from mount_kit import CAPSULEFS, check_chains, needs_fuse
from mount_kit import status as agent_status
from netns_kit import Network, Node, leftovers, open_network, unavailable
from test_move_daemons import TICKER, Host, force_unmount, no_tracebacks, start_all, wait_for, write_move
from test_stale_run import Sampler

T = TypeVar("T")

_NO_NETNS = unavailable()
pytestmark = [pytest.mark.fuse, needs_fuse, pytest.mark.skipif(_NO_NETNS is not None, reason=_NO_NETNS or "")]

#: The hosts' lease (CAPSULEFS_TEST_LEASE_TIMING: TTL, keepalive every, each given, stop within; seconds)
LEASE_TIMING = "5,1,1,2"
CALL_TIMEOUT = 2.0  # seconds a move's call waits for its answer (CAPSULEFS_TEST_CALL_TIMEOUT)
PREFIX = "/capsulefs-netns/"
LAYOUT = fd.Layout(PREFIX.encode())
ETCD_PORTS = (2379, 2380)  # (each namespace has all its ports free)
WRITE_EVERY = 0.05
#: Which agents each host creates before it starts (one ticker process each).
AGENTS = {"a": ("ada",), "b": ("bob", "bea"), "c": ("cy",)}


class NsHost(Host):
    """A host of test_move_daemons, its daemon in its own network namespace
    and listening on its address there; in the fleet mode if given a
    ``directory``, else peer-to-peer."""

    def __init__(self, root: Path, name: str, node: Node, directory: str | None, said: str) -> None:
        super().__init__(root, name, said=said)
        self.node, self.directory = node, directory

    def spawn(self, crash_at: str | None = None, *, run: bool = True, cwd: Path | None = None,
              stop_at: str | None = None) -> None:
        """Start the daemon (running its agents); ``crash_at``/``stop_at``:
        the test seams CAPSULEFS_TEST_CRASH_AT / CAPSULEFS_TEST_STOP_AT."""
        assert run
        env = {k: v for k, v in os.environ.items() if not k.startswith("CAPSULEFS_TEST_")}
        env[LEASE_TIMING_ENV] = LEASE_TIMING
        env[CALL_TIMEOUT_ENV] = str(CALL_TIMEOUT)
        if crash_at:
            env[CRASH_ENV] = crash_at
        if stop_at:
            env[STOP_ENV] = stop_at
        fleet = ["--directory", self.directory, "--directory-prefix", PREFIX] if self.directory else []
        force_unmount(self.mnt)
        with open(self.log, "ab") as logf:
            self.proc = self.node.popen(
                [CAPSULEFS, "-v", "mount", str(self.mnt), "--state", str(self.state),
                 "--listen", f"{self.node.address}:{self.port}", *fleet],
                stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=cwd)

    def start(self, crash_at: str | None = None, *, run: bool = True, cwd: Path | None = None) -> None:
        self.spawn(crash_at, run=run, cwd=cwd)
        self.wait_started()

    def stopped(self) -> bool:
        """The daemon stopped itself (the stop seam): its process is in state T."""
        assert self.proc is not None
        try:
            with open(f"/proc/{self.proc.pid}/stat", "rb") as f:
                return f.read().rsplit(b")", 1)[1].split()[0] == b"T"
        except OSError:
            return False

    def go_on(self) -> None:
        """SIGCONT: the daemon the stop seam stopped goes on."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # (a stopped daemon cannot exit)
        super().stop()

    def kill(self) -> None:
        """kill -9 of the daemon (a host crash): its mount is left dead, then unmounted."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=HANG)
        force_unmount(self.mnt)
        self.proc = None

    def agent_id(self, name: str) -> str:
        return str(agent_status(self.mnt / name)["agent_id"])


class Writer:
    """Appends an event to each agent's journal through its host's mount
    every ``WRITE_EVERY`` s, from a thread; keeps each acknowledged text."""

    def __init__(self, agents: dict[str, NsHost]) -> None:
        self.agents = dict(agents)
        self.acked: dict[str, list[str]] = {name: [] for name in agents}
        self.refused: dict[str, int] = {name: 0 for name in agents}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        i = 0
        while not self._stop.wait(WRITE_EVERY):
            i += 1
            for name, host in list(self.agents.items()):
                text = f"{name} {i}"
                try:
                    with open(host.mnt / name / "memory" / "timeline_events.jsonl", "a") as f:
                        f.write(json.dumps({"kind": "user_message", "text": text}) + "\n")
                except OSError:
                    self.refused[name] += 1
                else:
                    self.acked[name].append(text)

    def drop(self, name: str) -> None:
        """Write no more to ``name`` (its host is about to go)."""
        self.agents.pop(name, None)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=HANG)


@dataclass
class Fleet:
    net: Network
    etcd: KillableEtcd | None  # (None: peer-to-peer)
    etcd_node: Node | None
    hosts: dict[str, NsHost]
    sampler: Sampler
    writer: Writer | None = None
    where: dict[str, NsHost] = field(default_factory=dict)  # agent name -> the host that created it

    def directory(self, fn: Callable[[EtcdClient], Awaitable[T]]) -> T:
        """``await fn(etcd)`` with a client of the fleet's etcd (from etcd's own namespace)."""
        assert self.etcd is not None and self.etcd_node is not None
        spec = self.etcd.spec

        async def run() -> T:
            async with open_etcd(spec, timeout=HANG) as etcd:
                return await fn(etcd)

        return self.etcd_node.call(trio.run, run)

    def lease_of(self, host: NsHost) -> int | None:
        """The lease of ``host``'s key in the directory (None: no key, its lease ended)."""
        async def get(etcd: EtcdClient) -> int | None:
            kv = await etcd.get(LAYOUT.host(host.host_id))
            return None if kv is None else kv.lease

        return self.directory(get)

    def ttl_left(self, host: NsHost) -> tuple[float, int]:
        """(when asked, seconds etcd says ``host``'s lease has left)."""
        async def ttl(etcd: EtcdClient) -> tuple[float, int]:
            kv = await etcd.get(LAYOUT.host(host.host_id))
            assert kv is not None and kv.lease
            asked = time.monotonic()
            left = await etcd.time_to_live(kv.lease)
            assert left is not None
            return asked, left.ttl

        return self.directory(ttl)

    def entry(self, agent_id: str) -> fd.AgentEntry | None:
        async def get(etcd: EtcdClient) -> fd.AgentEntry | None:
            kv = await etcd.get(LAYOUT.agent(agent_id))
            return None if kv is None else fd.decode_agent(kv.value)

        return self.directory(get)

    def take_over(self, agent_id: str, new_holder: NsHost) -> fd.AgentEntry:
        """The directory's takeover Txn (core/fleet/directory.py): the agent
        to ``new_holder`` at the next epoch, once its holder's key is gone."""
        async def take(etcd: EtcdClient) -> fd.AgentEntry:
            kv = await etcd.get(LAYOUT.agent(agent_id))
            assert kv is not None
            epoch = fd.decode_agent(kv.value).epoch + 1
            t = fd.takeover_txn(LAYOUT, agent_id, kv, new_holder.host_id, epoch)
            assert (await etcd.txn(t.compare, t.success, t.failure)).succeeded
            return fd.AgentEntry(host_id=new_holder.host_id, epoch=epoch)

        return self.directory(take)

    def runs(self, name: str) -> set[str]:
        """The hosts the last sample saw running agent ``name``."""
        if not self.sampler.samples:
            return set()
        return {label.partition("/")[0].removeprefix("mnt-") for label in self.sampler.samples[-1][1]
                if label.partition("/")[2] == name}

    def stopped_at(self, name: str, host: str) -> float:
        """When ``name`` last stopped on ``host``: the time of the first sample after the last that saw it run."""
        label = f"mnt-{host}/{name}"
        last = max(i for i, (_, labels) in enumerate(self.sampler.samples) if label in labels)
        assert last + 1 < len(self.sampler.samples), f"{name} still runs on {host}"
        return self.sampler.samples[last + 1][0]

    def ran_since(self, name: str, host: str, since: float) -> list[float]:
        """The times of the samples after ``since`` that saw ``name`` running on ``host``."""
        return [t for t, labels in self.sampler.samples if t > since and f"mnt-{host}/{name}" in labels]

    def wait_all_running(self) -> None:
        for name, host in self.where.items():
            wait_for(lambda n=name, h=host.name: self.runs(n) == {h}, f"{name} running on {host.name}")


def two_runners(samples: list[tuple[float, frozenset[str]]]) -> list[tuple[float, str, list[str]]]:
    """Every (sample time, agent, hosts) at which one agent ran on two hosts or more."""
    out = []
    for t, labels in samples:
        hosts: dict[str, set[str]] = {}
        for label in labels:
            host, _, agent = label.partition("/")
            hosts.setdefault(agent, set()).add(host)
        out += [(t, agent, sorted(h)) for agent, h in hosts.items() if len(h) > 1]
    return out


def journal_texts(host: NsHost, name: str) -> set[str]:
    """The user messages in ``name``'s journal on ``host`` (its chains checked), read through its mount."""
    data = (host.mnt / name / "memory" / "timeline_events.jsonl").read_bytes()
    return {str(getattr(r.event, "text", "")) for r in check_chains(data) if r.kind == "user_message"}


def held(host: NsHost, name: str) -> bool:
    """``host``'s own record says it holds agent ``name``."""
    rec = HolderBook(host.state / "holders").get(host.agent_id(name))
    return rec is not None and rec.state is HolderState.HELD


def write_memory(host: NsHost, name: str, text: str) -> int:
    """0 if a write of the agent's working memory is taken, else its errno."""
    try:
        (host.mnt / name / "memory" / "working_memory.md").write_text(text)
    except OSError as exc:
        return exc.errno or -1
    return 0


def ticker_spec(tmp_path: Path) -> tuple[Path, dict]:
    """The ticker script (the sampler looks for its path) and a spec running it."""
    script, shared = tmp_path / "ticker.py", tmp_path / "ticks.log"
    script.write_text(TICKER)
    shared.touch()
    shared.chmod(0o666)  # (as root each host runs each agent as a uid of its own)
    return script, parse_spec(json.dumps({"version": 1, "entrypoint": [sys.executable, str(script), str(shared)]})
                              .encode())


def new_host(state: Path, names: tuple[str, ...], spec: dict) -> str:
    """What ``capsulefs init`` and ``capsulefs new NAME --spec`` for each of
    ``names`` do, in this process (the CLI is not under test here, and a
    process each costs seconds on a loaded machine); the host id."""
    store = HostStore.open(state)
    grants.ensure(str(state), store)
    me = load_or_create_identity(state).host_id
    for name in names:
        agent_id = os.urandom(16).hex()
        with new_agent_files(state, agent_id):
            agent = store.create_agent(name, host_id=me, agent_id=agent_id, spec=spec)
            record_new_agent(state, agent.agent_id, agent.manifest().holder.epoch)
    return me


def pin_peers(hosts: list[NsHost]) -> None:
    """Each host a peer of every other, at its address in its namespace (``capsulefs peer add``'s book)."""
    for h in hosts:
        book = PeerBook(h.state)
        for o in hosts:
            if o is not h:
                book.add(Peer(name=o.name, address=f"{o.node.address}:{o.port}", host_id=o.host_id))


@contextmanager
def running_fleet(tmp_path: Path, agents: dict[str, tuple[str, ...]], *, directory: bool, peers: bool = False,
                  stop_at: dict[str, str] | None = None) -> Iterator[Fleet]:
    """One host per key of ``agents``, each in a namespace, running its
    agents; with ``directory`` in the fleet mode, with an etcd in a namespace
    of its own; with ``peers`` each pinned as a peer of the others;
    ``stop_at``: a host's stop seam. The sampler and the writer run. On exit
    (whatever happened) everything is stopped and removed, and checked:
    nothing left, no traceback in a daemon's log, never two runners."""
    if directory and ETCD is None:
        pytest.skip("etcd is not installed (Debian's etcd-server; scripts/setup.sh installs it)")
    with open_network(*(["etcd"] if directory else []), *agents) as net:
        etcd_node = net.nodes["etcd"] if directory else None
        etcd = None
        if etcd_node is not None:
            (tmp_path / "etcd").mkdir()
            etcd = KillableEtcd(tmp_path / "etcd", host=etcd_node.address, ports=ETCD_PORTS)
        script, spec = ticker_spec(tmp_path)
        hosts = {name: NsHost(tmp_path, name, net.nodes[name], etcd.spec if etcd else None,
                              "host id " + new_host(tmp_path / f"state-{name}", names, spec))
                 for name, names in agents.items()}
        if peers:
            pin_peers(list(hosts.values()))
        sampler = Sampler(script, per_agent=True)
        f = Fleet(net=net, etcd=etcd, etcd_node=etcd_node, hosts=hosts, sampler=sampler,
                  where={name: hosts[h] for h, names in agents.items() for name in names})
        try:
            if etcd_node is not None and etcd is not None:
                etcd_node.call(etcd.start)
            for name, at in (stop_at or {}).items():
                hosts[name].spawn(stop_at=at)
            start_all(*hosts.values())
            f.wait_all_running()
            f.writer = Writer(f.where)
            yield f
        finally:
            for h in hosts.values():
                if h.proc is not None and h.proc.poll() is None:
                    h.go_on()  # (a daemon the stop seam stopped holds the writer's request)
            if f.writer is not None:
                f.writer.stop()
            sampler.stop()
            for h in hosts.values():
                h.stop()
            if etcd is not None:
                etcd.stop()
    assert leftovers(net.tag) == []
    no_tracebacks(*hosts.values())
    assert two_runners(sampler.samples) == [], two_runners(sampler.samples)[:5]


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    with running_fleet(tmp_path, AGENTS, directory=True) as f:
        yield f


def check_acknowledged(f: Fleet) -> None:
    """Every acknowledged append is in the journal of the host that holds the agent (its record HELD)."""
    assert f.writer is not None
    f.writer.stop()
    for name, texts in f.writer.acked.items():
        assert texts, f"no append to {name} was acknowledged"
        (holder,) = [h for h in f.hosts.values() if name in os.listdir(h.mnt) and held(h, name)]
        missing = set(texts) - journal_texts(holder, name)
        assert not missing, f"{name}: {len(missing)} acknowledged appends lost on {holder.name}: {sorted(missing)[:5]}"


def test_a_host_cut_from_etcd_stops_before_its_lease_ends_and_runs_again_only_what_the_directory_confirms(
        fleet: Fleet) -> None:
    """B is cut from etcd (not from the other hosts): its agents stop and
    its mount refuses writes before its lease can end (etcd's own TTL,
    asked just before); A and C run on. Once etcd has ended B's lease, one
    of B's agents is taken over by C in the directory. Healed, B gets a new
    lease and runs the agent the directory still names it for, never the
    other (C does not run it either: it has no copy; the tier's restore is
    another slice)."""
    f = fleet
    assert f.etcd is not None and f.etcd_node is not None
    b, c = f.hosts["b"], f.hosts["c"]
    old_lease = f.lease_of(b)
    asked, ttl = f.ttl_left(b)
    f.net.partition(b.node, f.etcd_node)
    wait_for(lambda: not f.runs("bob") and not f.runs("bea") and write_memory(b, "bob", "x\n") == errno.EROFS
             and write_memory(b, "bea", "x\n") == errno.EROFS, "B's agents stopped and read-only")
    stopped = max(f.stopped_at("bob", "b"), f.stopped_at("bea", "b"))
    assert stopped < asked + ttl, (stopped - asked, ttl)  # (by the sampler's clock: the same monotonic clock)
    assert f.runs("ada") == {"a"} and f.runs("cy") == {"c"}  # the others run on
    assert agent_status(b.mnt / "bob")["run"]["detail"].startswith("fleet lease lost: ")

    wait_for(lambda: f.lease_of(b) is None, "etcd to end B's lease")
    bea = b.agent_id("bea")
    taken = f.take_over(bea, c)
    healing = time.monotonic()
    f.net.heal(b.node, f.etcd_node)
    wait_for(lambda: f.runs("bob") == {"b"} and write_memory(b, "bob", "# back\n") == 0, "bob running again on B")
    assert f.lease_of(b) not in (None, old_lease)
    assert min(f.ran_since("bob", "b", stopped)) > healing  # (not before: B was cut off)
    wait_for(lambda: "the directory does not name this host" in agent_status(b.mnt / "bea")["run"]["detail"],
             "bea to stay stopped on B, saying why")
    assert write_memory(b, "bea", "x\n") == errno.EROFS
    assert f.ran_since("bea", "b", stopped) == [] and f.runs("bea") == set()
    assert f.entry(bea) == taken
    check_acknowledged(f)


def test_etcd_killed_stops_every_host_before_its_lease_ends_and_all_run_again(fleet: Fleet) -> None:
    """etcd killed with -9: every host stops its agents and refuses writes
    before its lease can end by etcd's own TTL; nothing runs while etcd is
    down; started again on the same data, every host takes a new lease and
    runs its agents again, and nothing acknowledged is lost."""
    f = fleet
    assert f.etcd is not None and f.etcd_node is not None
    left = {name: f.ttl_left(h) for name, h in f.hosts.items()}
    f.etcd.kill()
    wait_for(lambda: not any(f.runs(name) for name in f.where), "every agent stopped")
    stopped = time.monotonic()
    for name, h in f.where.items():
        asked, ttl = left[h.name]
        assert f.stopped_at(name, h.name) < asked + ttl, (name, f.stopped_at(name, h.name) - asked, ttl)
    for name, h in f.where.items():
        assert write_memory(h, name, "x\n") == errno.EROFS, name
    restarting = time.monotonic()
    f.etcd_node.call(f.etcd.start)
    f.wait_all_running()
    for name, h in f.where.items():
        assert min(f.ran_since(name, h.name, stopped)) > restarting, name  # (none ran while etcd was down)
    for name, h in f.where.items():
        wait_for(lambda n=name, host=h: write_memory(host, n, "# back\n") == 0, f"{name} writable again")
    check_acknowledged(f)


def test_a_host_killed_and_restored_from_a_backup_never_runs_the_agent_given_away(fleet: Fleet,
                                                                                   tmp_path: Path) -> None:
    """A's state directory is backed up (daemon stopped); A runs again, then
    is killed with -9; once etcd has ended its lease, its agent is taken
    over by B in the directory. A is restored from the backup and started:
    its record says it holds the agent, the directory does not, so it never
    runs it (and says why); what A acknowledged before the backup is still
    in its copy."""
    f = fleet
    a, b = f.hosts["a"], f.hosts["b"]
    ada = a.agent_id("ada")
    wait_for(lambda: len(f.writer.acked["ada"]) >= 3, "a few appends to ada")  # type: ignore[union-attr]
    f.writer.drop("ada")  # type: ignore[union-attr]
    a.stop()
    wait_for(lambda: not f.runs("ada"), "ada stopped with A's daemon")
    backup = tmp_path / "backup-a"
    subprocess.run(["cp", "-a", str(a.state), str(backup)], check=True)
    a.start()
    wait_for(lambda: f.runs("ada") == {"a"}, "ada running on A again")
    a.kill()
    wait_for(lambda: not f.runs("ada"), "ada's process gone with A's daemon")
    wait_for(lambda: f.lease_of(a) is None, "etcd to end A's lease")
    taken = f.take_over(ada, b)
    shutil.rmtree(a.state)
    subprocess.run(["cp", "-a", str(backup), str(a.state)], check=True)  # an operator restores the backup
    assert HolderBook(a.state / "holders").get(ada).state is HolderState.HELD  # type: ignore[union-attr]
    # (from here on: a sample taken after the kill is the killed A's agent still dying, which held ada then;
    # a CI run under load took one)
    restored = time.monotonic()
    a.start()
    wait_for(lambda: "the directory does not name this host" in agent_status(a.mnt / "ada")["run"]["detail"],
             "ada to stay stopped on the restored A, saying why")
    assert write_memory(a, "ada", "x\n") == errno.EROFS
    assert f.ran_since("ada", "a", restored) == [] and f.runs("ada") == set()
    assert f.entry(ada) == taken
    check_acknowledged(f)


# -- a partition between two hosts during a move, at each phase ---------------------------

#: (side, the holder state after which that side's daemon is stopped while the partition is made)
PHASES = [("source", "frozen"), ("source", "committing"), ("source", "retired"),
          ("target", "offered"), ("target", "verified"), ("target", "prepared"), ("target", "held")]
#: How the hosts learn who holds an agent: pinned peers, or the directory (a move's commit is its Txn).
MODES = ["peer-to-peer", "fleet"]
#: The phases the fleet mode runs (each test costs 10-20 s): the ones where the directory changes
#: what happens. Committing: the commit Txn reaches etcd while the target is cut off, so the
#: target learns it from the directory (its gate), not from the source's nudge. Prepared: the
#: prepare's answer is lost, the source rolls back, the target's gate refuses. Held: the target
#: activated, its answer to the nudge is lost, the source retires by the directory's word. Before
#: the commit (frozen, offered, verified) a fleet move is a peer-to-peer one rolled back; after it
#: (retired) nothing is asked of the target any more.
FLEET_PHASES = [("source", "committing"), ("target", "prepared"), ("target", "held")]
PARTITION_CASES = [(m, side, st) for m in MODES for side, st in PHASES
                   if m == "peer-to-peer" or (side, st) in FLEET_PHASES]
PENDING = (HolderState.OFFERED, HolderState.VERIFIED, HolderState.PREPARED)  # (a target's, before it activates)


def move_target(f: Fleet, host: NsHost) -> str:
    """What ``.control/move`` takes to name ``host``: its host id in the
    fleet mode (found in the directory, once its key is there), else its
    peer name."""
    if f.etcd is None:
        return host.name
    wait_for(lambda: f.lease_of(host) is not None, f"{host.name}'s key in the directory")
    return host.host_id


@pytest.mark.parametrize(("mode", "side", "state"), PARTITION_CASES,
                         ids=[f"{m}-{s}-{p}" for m, s, p in PARTITION_CASES])
def test_a_partition_between_two_hosts_at_each_phase_of_a_move(tmp_path: Path, mode: str, side: str,
                                                               state: str) -> None:
    """A moves its running agent to B; the daemon on one side is stopped
    right after it made a phase durable (the stop seam), A and B are cut
    from each other (in the fleet mode both still reach etcd), and that
    daemon goes on: each side's calls fail or time out (2 s). The partition
    is healed once the source has rolled back or waits in doubt (in the
    fleet mode: once its move ended, the commit judged by etcd). Then
    exactly one host holds the agent and runs it (in the fleet mode, the
    one the directory names), no staging is left, nothing acknowledged is
    lost, and no sample ever saw it run on both."""
    stopped = "a" if side == "source" else "b"
    fleet = mode == "fleet"
    with running_fleet(tmp_path, {"a": ("ada",), "b": ()}, directory=fleet, peers=not fleet,
                       stop_at={stopped: f"{side}:{state}"}) as f:
        a, b = f.hosts["a"], f.hosts["b"]
        ada, mover, result = start_moving_ada(f, a, b)
        victim = f.hosts[stopped]
        wait_for(victim.stopped, f"{victim.name} stopped after {side}:{state}")
        f.net.partition(a.node, b.node)
        victim.go_on()
        if fleet:  # (the source reaches etcd: it is never in doubt for long, its move ends cut off)
            mover.join(timeout=HANG)
        else:
            wait_for(lambda: not mover.is_alive() or a.holder(ada) is HolderState.COMMITTING,
                     "the move to end, or the source to wait in doubt")
        f.net.heal(a.node, b.node)
        mover.join(timeout=HANG)
        assert not mover.is_alive()
        holder = settled(f, ada, pending_ok=not fleet)
        assert (result == [0]) == (holder is b), (result, holder.name)
        f.where["ada"] = holder
        check_acknowledged(f)


def start_moving_ada(f: Fleet, a: NsHost, b: NsHost) -> tuple[str, threading.Thread, list[int]]:
    """Once a few appends to ``ada`` were acknowledged, ``echo B > a/ada/.control/move`` in a thread:
    ada's id, the thread, and the list its write's errno goes into."""
    ada = a.agent_id("ada")
    target = move_target(f, b)
    wait_for(lambda: len(f.writer.acked["ada"]) >= 3, "a few appends to ada")  # type: ignore[union-attr]
    result: list[int] = []
    mover = threading.Thread(target=lambda: result.append(write_move(a.mnt, "ada", target + "\n")))
    mover.start()
    return ada, mover, result


def settled(f: Fleet, ada: str, *, pending_ok: bool) -> NsHost:
    """Until exactly one of A and B holds ``ada`` and the source is settled;
    then checks that it runs there only (in the fleet mode: the host the
    directory names, at the epoch of its record, and the other host has no
    pending move left), and that no staging is left; the holder."""
    a, b = f.hosts["a"], f.hosts["b"]
    holders = lambda: (a.holder(ada), b.holder(ada))  # noqa: E731
    fleet = f.etcd is not None
    states = wait_for(lambda: holders().count(HolderState.HELD) == 1 and
                      a.holder(ada) in (HolderState.HELD, HolderState.RETIRED) and
                      (pending_ok or not set(holders()) & set(PENDING)) and holders(),
                      "one holder, the source settled" + ("" if pending_ok else ", no move pending"))
    holder, other = (a, b) if states[0] is HolderState.HELD else (b, a)
    wait_for(lambda: f.runs("ada") == {holder.name}, f"ada running on {holder.name}")
    if fleet:
        rec = HolderBook(holder.state / "holders").get(ada)
        assert rec is not None and rec.held_epoch is not None
        assert f.entry(ada) == fd.AgentEntry(host_id=holder.host_id, epoch=rec.held_epoch)
    # Peer-to-peer, a target the source could not tell to abort keeps its pending record and staging
    # until it expires (target.DEFAULT_IDLE_TTL, 10 min; docs/move.md): nothing runs from them.
    # In the fleet mode its gate asks the directory within seconds.
    wait_for(lambda: holder.staging() == [] and (other.staging() == [] or other.holder(ada) in PENDING),
             "no staging left but a pending target's")
    assert pending_ok or other.staging() == [], other.staging()
    return holder


# -- kill -9 of the source or of etcd at a fleet move's point of no return ------------------

#: (what is killed, when): "sent": the commit Txn sent to etcd (paused: it holds the request),
#: no answer yet; "committed": the directory names the target, which has not activated yet (cut
#: from the source, it waits for its gate).
KILLS = [("source", "sent"), ("source", "committed"), ("etcd", "committed")]


@pytest.mark.parametrize(("killed", "when"), KILLS, ids=[f"{k}-{w}" for k, w in KILLS])
def test_kill_9_at_a_fleet_moves_point_of_no_return(tmp_path: Path, killed: str, when: str) -> None:
    """A moves its running agent to B through the directory; A's daemon
    stops itself once COMMITTING is durable (the stop seam), and either
    etcd is paused (``sent``: A's commit goes out and gets no answer, A
    says it is in doubt) or A and B are cut from each other (``committed``:
    A's commit applies, its nudge cannot reach B, B waits prepared). Then
    A's daemon or etcd is killed with -9 and started again (healed). In the
    end exactly one host runs the agent, the one the directory names at its
    record's epoch; no move is left pending, no staging; nothing
    acknowledged is lost; never two runners."""
    with running_fleet(tmp_path, {"a": ("ada",), "b": ()}, directory=True, stop_at={"a": "source:committing"}) as f:
        assert f.etcd is not None and f.etcd_node is not None
        a, b = f.hosts["a"], f.hosts["b"]
        ada, mover, result = start_moving_ada(f, a, b)
        wait_for(a.stopped, "A stopped after source:committing")
        if when == "sent":
            f.etcd.pause()
            a.go_on()
            wait_for(lambda: f"the commit to {b.host_id} is in doubt" in a.log.read_text(errors="replace"),
                     "A's commit sent and unanswered")
        else:
            f.net.partition(a.node, b.node)
            a.go_on()
            wait_for(lambda: f.entry(ada) == fd.AgentEntry(host_id=b.host_id, epoch=2), "the commit applied")
            assert b.holder(ada) is HolderState.PREPARED  # (B has not activated: it heard nothing)
        if killed == "source":
            f.writer.drop("ada")  # type: ignore[union-attr]
            a.kill()
        else:
            f.etcd.kill()
            wait_for(lambda: not f.runs("ada"), "nothing runs the agent while etcd is down")
        mover.join(timeout=HANG)  # (killed under it, or its nudge timed out: B heard nothing from A)
        assert not mover.is_alive()
        if when == "sent":
            f.etcd.resume()
        else:
            f.net.heal(a.node, b.node)
        if killed == "source":
            a.start()
        else:
            f.etcd_node.call(f.etcd.start)
        holder = settled(f, ada, pending_ok=False)
        if when == "committed":
            assert holder is b
        if killed == "etcd":
            assert result == [0]  # (the commit's verdict was "active": the source retired the agent)
        f.where["ada"] = holder
        check_acknowledged(f)
