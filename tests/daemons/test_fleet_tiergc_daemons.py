"""`capsulefs fleet gc` beside two real daemons on one tier (``mount --directory etcd://...
--blobs http://...``; a real etcd and a real ``weed mini`` from the fixtures): each daemon
publishes its live set; a blob only a removed agent named is deleted once older than the
grace, while every blob a live set names stays, that of a host whose lease is gone
included; a host that holds an agent and has published no set stops the gc (one line,
exit 1, nothing deleted)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from capsulefs.core.fleet import directory as fd
from capsulefs.fleet.directory import claim_agent
from capsulefs.fleet.etcd import open_etcd
from fleet_kit import EtcdServer
from helpers import HANG
from mount_kit import needs_fuse
from test_fleet_tier_daemons import Tier, agent_with_blobs, etcd, fleet_flags, tier, weed  # noqa: F401
from test_move_daemons import Host, start_all, two_hosts, wait_for

pytestmark = [pytest.mark.fuse, needs_fuse]


@pytest.fixture
def hosts(tmp_path: Path, etcd: EtcdServer, tier: Tier,  # noqa: F811
          monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Host, Host]]:
    monkeypatch.setenv("CAPSULEFS_TEST_LIVE_REFRESH", "1")  # (the daemons inherit it: a set a second)
    monkeypatch.setenv("CAPSULEFS_TEST_LEASE_TIMING", "5,1,1,2")  # (a stopped host's lease ends in 5 s)
    with two_hosts(tmp_path) as (a, b):
        a.extra = b.extra = fleet_flags(etcd, tier.url)
        yield a, b


def _prefix(h: Host) -> str:
    return h.extra[h.extra.index("--directory-prefix") + 1]


def gc(h: Host, *args: str, check: bool = True):  # type: ignore[no-untyped-def]
    return h.cli("fleet", "gc", *args, check=check)


def dry_run_would_delete(h: Host, n: int, sets: int = 2) -> bool:
    out = gc(h, "--grace", "0s", "--dry-run", check=False)
    return (out.returncode == 0 and f"dry run: {n} blob(s) would be deleted" in out.stdout
            and f"named by the live sets of {sets} host(s)" in out.stdout)


def lease_gone(a: Host, b: Host) -> bool:
    hosts = [json.loads(line) for line in a.cli("fleet", "hosts", "--json").stdout.splitlines()]
    return all(h["host_id"] != b.host_id for h in hosts)


def test_fleet_gc_deletes_what_no_live_set_names_and_keeps_a_gone_hosts(
        hosts: tuple[Host, Host], tier: Tier, etcd: EtcdServer) -> None:  # noqa: F811
    a, b = hosts
    _, kept = agent_with_blobs(a, "keep", 2)
    _, gone = agent_with_blobs(a, "gone", 2)
    _, bees = agent_with_blobs(b, "bee", 2)
    start_all(a, b)
    wait_for(lambda: tier.has_all(kept + gone + bees), "every blob in the tier")
    wait_for(lambda: dry_run_would_delete(a, 0), "both hosts' live sets published")
    b.stop()  # (its lease left to end; the directory still names it the holder of "bee")
    a.cli("rm", "gone")
    wait_for(lambda: dry_run_would_delete(a, 2), "a's live set without the removed agent's blobs")
    wait_for(lambda: lease_gone(a, b), "b's lease ended", timeout=HANG)
    young = gc(a, "--grace", "1h")
    assert "deleted 0 blob(s)" in young.stdout and "2 unnamed but younger than the grace" in young.stdout
    out = gc(a, "--grace", "0s")
    assert "deleted 2 blob(s), 524288 bytes" in out.stdout, out.stdout
    assert "named by the live sets of 2 host(s)" in out.stdout
    assert not any(tier.has(sha) for sha in gone)
    assert tier.has_all(kept + bees)
    # a host that holds an agent and never published a live set: refused, nothing deleted
    a.cli("rm", "keep")
    wait_for(lambda: dry_run_would_delete(a, 2), "a's live set without the second agent's blobs")

    async def claim() -> None:
        async with open_etcd(etcd.spec, timeout=HANG) as client:
            assert await claim_agent(client, fd.Layout(_prefix(a).encode()), "c" * 32,
                                     fd.AgentEntry(host_id="host-without-a-set", epoch=1))

    trio.run(claim)
    refused = gc(a, "--grace", "0s", check=False)
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr.count("\n") == 1
    assert "host host-without-a-set holds 1 agent(s) in the directory and has published no live set" in refused.stderr
    assert tier.has_all(kept + bees)
