"""The directory's commit Txn on one local etcd, with 1,000 host leases alive.

A real etcd (the tests' fixture, tests/fleet_kit.py) on 127.0.0.1. The bench
grants ``--hosts`` leases of 10 s, puts each host's key under its lease and
keeps every lease alive (a keepalive message per lease every 2 s, as the
host lease keeper sends; the bench sends 50 of them in one POST, as the
gateway's keepalive is a stream: one request per lease costs the bench's
Python, not etcd, more than this shared machine gives it), then alternates,
round by round:
  * candidate: moves. ``--workers`` tasks each move agents between random
    live hosts: read the agent's key (the source's read before its offer),
    then the commit Txn (compare the key's mod_revision and the target's host
    key, put the new entry: core.fleet.directory.commit_txn);
  * baseline: the same read, then a plain put of the same key with a value
    of the same size (what a directory with no compare would cost).
Reported: moves/s and puts/s (sustained over each phase), p50/p99 of the
commit Txn and of the plain put, the keepalives sent per second and how many
failed, whether every host key was still alive at the end and how many
commits went to a host whose lease had ended (refused, as they must be);
with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import common  # noqa: F401  (puts the repository on sys.path)

import httpx
import trio

sys.path.insert(0, str(common.REPO / "tests"))

from capsulefs.core.fleet import directory as fd  # noqa: E402
from capsulefs.core.fleet.errors import DirectoryError  # noqa: E402
from capsulefs.core.fleet import etcd as wire  # noqa: E402
from capsulefs.core.fleet.etcd import Put, prefix_end  # noqa: E402
from capsulefs.fleet.directory import register_host  # noqa: E402
from capsulefs.fleet.etcd import EtcdClient, open_etcd  # noqa: E402

LAYOUT = fd.Layout(b"/capsulefs-bench/")
TTL = 10
RENEW_EVERY = 2.0  # as the host lease keeper renews
BATCH = 50  # leases renewed in one POST


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


class Fleet:
    def __init__(self, etcd: EtcdClient, http: httpx.AsyncClient, url: str, hosts: int, agents: int) -> None:
        self.etcd = etcd
        self.http = http  # (a connection pool of its own: keepalives never wait behind moves)
        self.url = url
        self.dead_targets = 0  # commits refused because the target's lease had ended
        self.hosts = [f"h{i:04d}" for i in range(hosts)]
        self.agents = [f"{i:032x}" for i in range(agents)]
        self.leases: dict[str, int] = {}
        self.keepalives = 0
        self.keepalive_failures = 0
        self.rng = random.Random(1)

    async def join(self, keepers: trio.Nursery) -> None:
        """Every host's lease and key (each kept alive from its grant on, in ``keepers``), every agent's entry."""
        limiter = trio.CapacityLimiter(32)
        batch: list[int] = []

        async def one(host: str) -> None:
            async with limiter:
                lease = await register_host(self.etcd, LAYOUT, fd.HostEntry(host_id=host, address=f"{host}:7000"), TTL)
                self.leases[host] = lease.id
                batch.append(lease.id)
                if len(batch) == BATCH:
                    keepers.start_soon(self.keep_alive, batch.copy())
                    batch.clear()

        async with trio.open_nursery() as nursery:
            for host in self.hosts:
                nursery.start_soon(one, host)
        if batch:
            keepers.start_soon(self.keep_alive, batch)

        for start in range(0, len(self.agents), 100):  # (setup, not measured: 100 entries a Txn)
            puts = [Put(key=LAYOUT.agent(a), value=fd.AgentEntry(host_id=self.hosts[i % len(self.hosts)], epoch=1)
                        .encode()) for i, a in enumerate(self.agents[start:start + 100], start)]
            await self.etcd.txn((), puts)

    async def keep_alive(self, leases: list[int]) -> None:
        """Renew these leases every RENEW_EVERY: one keepalive message per lease,
        a batch of them in one POST (the gateway's keepalive is a stream)."""
        await trio.sleep(self.rng.random() * RENEW_EVERY)  # spread the batches over the period
        body = b"\n".join(wire.lease_keepalive_request(lease).body for lease in leases)
        while True:
            sent = trio.current_time()
            try:
                with trio.fail_after(TTL / 2):
                    resp = await self.http.post(self.url + "/v3/lease/keepalive", content=body)
                lines = [line for line in resp.content.split(b"\n") if line.strip()]
                if resp.status_code != 200 or len(lines) != len(leases):
                    raise ValueError(f"{resp.status_code}, {len(lines)} answers to {len(leases)} keepalives")
            except (trio.TooSlowError, httpx.HTTPError, ValueError) as exc:
                self.keepalive_failures += len(leases)
                print(f"keepalive batch: {exc!r}"[:200], file=sys.stderr, flush=True)
                continue  # again at once, as a host whose keepalive failed does before its deadline
            for lease, line in zip(leases, lines):
                try:
                    wire.decode_keepalive(line, lease)
                    self.keepalives += 1
                except DirectoryError:
                    self.keepalive_failures += 1
            leases = [lease for lease, line in zip(leases, lines) if b'"TTL"' in line]  # (a lost one stays lost)
            if not leases:
                return
            body = b"\n".join(wire.lease_keepalive_request(lease).body for lease in leases)
            await trio.sleep_until(sent + RENEW_EVERY)

    async def live_hosts(self) -> int:
        n, start, end = 0, LAYOUT.hosts, prefix_end(LAYOUT.hosts)
        while True:
            page = await self.etcd.range(start, range_end=end, limit=1000, keys_only=True)
            n += len(page.kvs)
            if not page.more or not page.kvs:
                return n
            start = page.kvs[-1].key + b"\x00"


async def phase(fleet: Fleet, workers: int, count: int, commit: bool) -> tuple[float, list[float]]:
    """``count`` operations by ``workers`` tasks; (ops per second, latencies of the write)."""
    latencies: list[float] = []
    todo = iter(range(count))
    rng = random.Random(count + commit)
    busy: set[str] = set()

    async def worker() -> None:
        for _ in todo:
            agent = rng.choice(fleet.agents)
            while agent in busy:
                agent = rng.choice(fleet.agents)
            busy.add(agent)
            try:
                kv = await fleet.etcd.get(LAYOUT.agent(agent))
                assert kv is not None
                entry = fd.decode_agent(kv.value)
                target = rng.choice(fleet.hosts)
                while target == entry.host_id:
                    target = rng.choice(fleet.hosts)
                if commit:
                    t = fd.commit_txn(LAYOUT, agent, kv, target, entry.epoch + 1)
                    t0 = time.perf_counter()
                    result = await fleet.etcd.txn(t.compare, t.success, t.failure)
                    latencies.append(time.perf_counter() - t0)
                    if not result.succeeded:  # nothing races it: only the target's lease can be gone
                        if await fleet.etcd.get(LAYOUT.host(target)) is not None:
                            raise SystemExit(f"a commit to {target}, whose lease lives, failed: {result.responses}"[:500])
                        fleet.dead_targets += 1
                else:
                    value = fd.AgentEntry(host_id=target, epoch=entry.epoch + 1).encode()
                    t0 = time.perf_counter()
                    await fleet.etcd.put(LAYOUT.agent(agent), value)
                    latencies.append(time.perf_counter() - t0)
            finally:
                busy.discard(agent)

    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(workers):
            nursery.start_soon(worker)
    return count / (time.perf_counter() - t0), latencies


async def bench(url: str, args: argparse.Namespace) -> dict:
    async with open_etcd([url]) as etcd, httpx.AsyncClient(trust_env=False, timeout=5.0) as http, \
            trio.open_nursery() as nursery:
        fleet = Fleet(etcd, http, url, args.hosts, args.agents)
        t0 = time.perf_counter()
        await fleet.join(nursery)
        joined = time.perf_counter() - t0
        print(f"{len(fleet.leases)} hosts joined in {joined:.1f}s", file=sys.stderr, flush=True)
        await trio.sleep(RENEW_EVERY)  # (every lease renewed once before the rounds: the load is on)
        moves, puts, commit_lat, put_lat = [], [], [], []
        k0, t_rounds = fleet.keepalives, time.perf_counter()
        for r in range(args.rounds):
            for commit in (True, False) if r % 2 == 0 else (False, True):  # (each first in turn)
                rate, lat = await phase(fleet, args.workers, args.moves, commit=commit)
                (moves if commit else puts).append(rate)
                (commit_lat if commit else put_lat).extend(lat)
            print(f"round {r + 1}: {moves[-1]:.0f} moves/s, {puts[-1]:.0f} puts/s, {fleet.keepalives} keepalives, "
                  f"{fleet.keepalive_failures} failed", file=sys.stderr, flush=True)
        keepalive_rate = (fleet.keepalives - k0) / (time.perf_counter() - t_rounds)
        alive = await fleet.live_hosts()
        nursery.cancel_scope.cancel()
    return {
        "hosts": args.hosts, "agents": args.agents, "workers": args.workers, "rounds": args.rounds,
        "moves_per_round": args.moves, "join_s": round(joined, 2),
        "moves_per_s": round(statistics.median(moves), 1), "plain_puts_per_s": round(statistics.median(puts), 1),
        "commit_ms_p50": round(pct(commit_lat, 50) * 1e3, 2), "commit_ms_p99": round(pct(commit_lat, 99) * 1e3, 2),
        "put_ms_p50": round(pct(put_lat, 50) * 1e3, 2), "put_ms_p99": round(pct(put_lat, 99) * 1e3, 2),
        "keepalives_per_s": round(keepalive_rate, 1), "keepalive_failures": fleet.keepalive_failures,
        "host_keys_alive_at_end": alive, "commits_to_an_ended_lease": fleet.dead_targets, "loadavg_1m": round(os.getloadavg()[0], 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one round: does it run (CI), not a figure")
    ap.add_argument("--hosts", type=int, default=1000, help="host leases kept alive")
    ap.add_argument("--agents", type=int, default=10_000)
    ap.add_argument("--workers", type=int, default=8, help="moves (or puts) in flight at once")
    ap.add_argument("--moves", type=int, default=1500, help="moves (and baseline puts) per round")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    if args.smoke:
        args.hosts, args.agents, args.workers, args.moves, args.rounds = 20, 50, 2, 20, 1
    import fleet_kit

    if fleet_kit.ETCD is None:
        print(json.dumps({"skipped": "etcd is not installed (Debian's etcd-server; scripts/setup.sh installs it)"}))
        return
    with fleet_kit.running_etcd() as server:
        out = trio.run(bench, server.url, args)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
