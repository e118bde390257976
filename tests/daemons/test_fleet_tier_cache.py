"""The host store as a cache of the blob tier, with real daemons (``mount --directory etcd://...
--blobs http://...``), a real etcd and a real SeaweedFS (``weed mini``), and real FUSE mounts.

  * ``capsulefs gc --tier-cache SIZE`` beside the daemon deletes the local
    copies of the coldest listed blobs the eviction record names (published
    in the host's live set, then confirmed in the tier), until the rest
    fits SIZE; a ``cat`` through the mount gets one back from the tier
    (verified, stored again).
  * The tier down: the open of an evicted blob fails with EIO and a log
    line naming the blob; the mount stays read-write, the agent's other
    files readable; the tier back, the same open works.
  * The tier hanging: the open waits, and the mount's other requests go on.
  * A tier copy with wrong bytes: EIO, nothing of it stored.
  * An agent whose workspace was evicted starts (the sandbox build fetches it).
  * ``capsulefs export`` of an agent with evicted blobs makes a tar ``capsulefs verify`` accepts.
  * A move to a host without the tier still delivers every blob (the source fetches them back first).
"""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from capsulefs.core.capsule import format as fmt
from capsulefs.core.capsule.spec import spec_bytes
from capsulefs.core.store.host_store import HostStore
from capsulefs.fleet.uploader import RECORD_DIR
from fleet_kit import EtcdServer
from helpers import HANG
from mount_kit import needs_fuse
from prom_kit import value
import test_fleet_tier_daemons as tier_daemons
from test_fleet_tier_daemons import BLOB, Forwarder, Tier, active, agent_with_blobs, fleet_flags, metrics, recorded
from test_move_daemons import Host, no_tracebacks, verify_on, wait_for, write_move

pytestmark = [pytest.mark.fuse, needs_fuse]

# The fixtures of the tier's daemon tests: one weed and one etcd for this module, a bucket per test, two hosts.
weed, etcd, tier, forwarder, hosts = (tier_daemons.weed, tier_daemons.etcd, tier_daemons.tier,
                                      tier_daemons.forwarder, tier_daemons.hosts)

DAY = 24 * 3600 * 1_000_000_000  # ns


def object_path(h: Host, sha: str) -> Path:
    return h.state / "objects" / sha[:2] / sha


def local(h: Host, sha: str) -> bool:
    return object_path(h, sha).exists()


def read_days_ago(h: Host, sha: str, days: float) -> None:
    """The blob was last read ``days`` days ago (its object's access time)."""
    path = object_path(h, sha)
    os.utime(path, ns=(time.time_ns() - int(days * DAY), os.stat(path).st_mtime_ns))


def through_mount(h: Host, name: str, sha: str) -> Path:
    return h.mnt / name / "artifacts" / "blobs" / sha


def contents(h: Host, shas: list[str]) -> dict[str, bytes]:
    return {sha: object_path(h, sha).read_bytes() for sha in shas}


@pytest.fixture(autouse=True)
def _live_sets_every_second(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CAPSULEFS_TEST_LIVE_REFRESH", "1")  # (the daemons inherit it: a live set round a second)


def evictable_record(h: Host) -> Path | None:
    """The host's eviction record (STATE/fleet-tier/<tier>.evictable; capsulefs/fleet/live.py)."""
    return next((h.state / RECORD_DIR).glob("*.evictable"), None)


def evictable(h: Host) -> set[str]:
    path = evictable_record(h)
    return set(path.read_text().split()) if path is not None else set()


def all_recorded(h: Host, shas: list[str]) -> None:
    """Every blob put to the tier, and confirmed there after the host published them as live (evictable)."""
    wait_for(lambda: recorded(h) >= set(shas), "every blob put to the tier and in the record")
    wait_for(lambda: evictable(h) >= set(shas), "every blob published as live, confirmed: evictable")


def gc_tier_cache(h: Host, size: int) -> str:
    return h.cli("gc", "--tier-cache", str(size)).stdout


def evict_all_while_stopped(h: Host, shas: list[str]) -> None:
    """Start the daemon (--no-run) until every blob is put and evictable, stop it, evict them all."""
    h.start()
    all_recorded(h, shas)
    h.stop()
    gc_tier_cache(h, 0)
    assert not any(local(h, sha) for sha in shas)


def open_errno(path: Path) -> int:
    try:
        path.read_bytes()
    except OSError as exc:
        return exc.errno or 0
    return 0


def test_gc_evicts_the_coldest_recorded_blobs_and_a_cat_fetches_one_back(hosts: tuple[Host, Host]) -> None:
    a, _b = hosts
    _agent_id, shas = agent_with_blobs(a, "carrier", 4)
    data = contents(a, shas)
    a.start()
    all_recorded(a, shas)
    for sha, days in zip(shas, [1, 4, 3, 10]):
        read_days_ago(a, sha, days)
    # A read through the mount makes a blob hot: its last read is now, not 3 days ago.
    assert through_mount(a, "carrier", shas[2]).read_bytes() == data[shas[2]]
    # The coldest blob may not go: as if its confirmation in the tier had not come yet (with the daemon
    # stopped, whose live set rounds would confirm it again).
    a.stop()
    record = evictable_record(a)
    assert record is not None
    record.write_text("".join(f"{sha}\n" for sha in shas[:3]))
    out = gc_tier_cache(a, 2 * BLOB)
    a.start()
    assert f"evicted 2 blob(s) held by the blob tier, freed {2 * BLOB} bytes" in out, out
    assert f"cache: {2 * BLOB} bytes of listed blobs kept here" in out, out
    assert [local(a, sha) for sha in shas] == [False, False, True, True]

    before = metrics(a)
    assert through_mount(a, "carrier", shas[1]).read_bytes() == data[shas[1]]
    assert local(a, shas[1]) and not local(a, shas[0])
    after = metrics(a)
    assert value(after, "capsulefs_tier_cache_fetches_total", outcome="fetched") - \
        value(before, "capsulefs_tier_cache_fetches_total", outcome="fetched") == 1
    assert value(after, "capsulefs_tier_cache_fetched_bytes_total") - \
        value(before, "capsulefs_tier_cache_fetched_bytes_total") == BLOB
    assert through_mount(a, "carrier", shas[0]).read_bytes() == data[shas[0]]  # (the store whole again)
    assert a.staging() == []


def test_the_tier_down_fails_the_open_of_an_evicted_blob_and_nothing_else(
        tmp_path: Path, etcd: EtcdServer, tier: Tier, forwarder: Forwarder) -> None:
    (a,) = Host.init_all(tmp_path, "a")
    a.extra = fleet_flags(etcd, f"http://127.0.0.1:{forwarder.port}/{tier.bucket}/eu")
    forwarder.start()
    _agent_id, shas = agent_with_blobs(a, "carrier", 2)
    data = contents(a, shas)
    try:
        a.start()
        all_recorded(a, shas)
        wait_for(lambda: active(a, "carrier"), "the agent active under the host's lease")
        read_days_ago(a, shas[1], 2)
        gc_tier_cache(a, BLOB)
        assert [local(a, sha) for sha in shas] == [True, False]

        forwarder.stop()  # the tier is down: connections refused
        assert open_errno(through_mount(a, "carrier", shas[1])) == errno.EIO
        assert f"blob {shas[1]}: evicted here and not fetched from the blob tier" in a.log.read_text()
        assert not local(a, shas[1])
        # The agent's other files are readable and the mount still takes writes.
        assert through_mount(a, "carrier", shas[0]).read_bytes() == data[shas[0]]
        memory = a.mnt / "carrier" / fmt.WORKING_MEMORY
        memory.write_text("written while the tier is down\n")
        assert memory.read_text() == "written while the tier is down\n"
        m = metrics(a)
        assert value(m, "capsulefs_failsafe") == 0
        assert value(m, "capsulefs_tier_cache_fetches_total", outcome="failed") >= 1

        forwarder.start()  # the tier back: the same open fetches it
        wait_for(lambda: open_errno(through_mount(a, "carrier", shas[1])) == 0, "the evicted blob read again")
        assert through_mount(a, "carrier", shas[1]).read_bytes() == data[shas[1]]
    finally:
        a.stop()
    no_tracebacks(a)


def test_other_requests_go_on_while_an_open_waits_for_the_tier(hosts: tuple[Host, Host], tier: Tier) -> None:
    a, _b = hosts
    _agent_id, shas = agent_with_blobs(a, "carrier", 2)
    data = contents(a, shas)
    a.start()
    all_recorded(a, shas)
    read_days_ago(a, shas[1], 2)
    gc_tier_cache(a, BLOB)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(through_mount(a, "carrier", shas[1]).read_bytes()))
    os.kill(tier.weed.proc.pid, signal.SIGSTOP)  # the tier hangs: every request to it waits
    try:
        reader.start()
        wait_for(lambda: f"fetching 1 evicted blob(s) back for a reader ({shas[1]})" in a.log.read_text(),
                 "the open waiting for the tier")
        assert through_mount(a, "carrier", shas[0]).read_bytes() == data[shas[0]]
        memory = a.mnt / "carrier" / fmt.WORKING_MEMORY
        memory.write_text("written while an open waits\n")
        assert memory.read_text() == "written while an open waits\n"
        assert reader.is_alive() and got == []
    finally:
        os.kill(tier.weed.proc.pid, signal.SIGCONT)
    reader.join(HANG)
    assert got == [data[shas[1]]]


def test_a_tier_copy_with_wrong_bytes_is_eio_and_nothing_is_stored(hosts: tuple[Host, Host], tier: Tier) -> None:
    a, _b = hosts
    _agent_id, shas = agent_with_blobs(a, "carrier", 2)
    data = contents(a, shas)
    a.start()
    all_recorded(a, shas)
    gc_tier_cache(a, 0)
    tier.overwrite(shas[0], os.urandom(BLOB))  # same size, other bytes
    assert open_errno(through_mount(a, "carrier", shas[0])) == errno.EIO
    assert not local(a, shas[0]) and a.staging() == []
    assert "does not match its name" in a.log.read_text()
    assert value(metrics(a), "capsulefs_failsafe") == 0
    tier.overwrite(shas[0], data[shas[0]])  # (repaired: the store whole again for the end-of-test check)
    for sha in shas:
        assert through_mount(a, "carrier", sha).read_bytes() == data[sha]


def test_an_agent_whose_workspace_was_evicted_starts(hosts: tuple[Host, Host]) -> None:
    a, _b = hosts
    agent_id, shas = agent_with_blobs(a, "runner", 3)
    data = contents(a, shas)
    # It reads a workspace file (materialised from the blobs by the sandbox build), then stays.
    store = HostStore.open(a.state, create=False)
    store.agent(agent_id).write_files({fmt.SPEC: spec_bytes(
        {"version": 1, "entrypoint": ["sh", "-c", "cat data/0002 > /dev/null && exec sleep 600"]})})
    evict_all_while_stopped(a, shas)
    try:
        a.start(run=True)
        wait_for(lambda: a.status("runner").get("run", {}).get("state") == "running", "the agent running")
        assert all(local(a, sha) for sha in shas)
        assert contents(a, shas) == data
    finally:
        a.stop()
    no_tracebacks(a)


def test_an_export_with_evicted_blobs_makes_a_tar_that_verifies(hosts: tuple[Host, Host], tmp_path: Path) -> None:
    a, _b = hosts
    _agent_id, shas = agent_with_blobs(a, "carrier", 3)
    evict_all_while_stopped(a, shas)
    out = tmp_path / "carrier.tar"
    a.cli("export", "carrier", "-o", str(out))
    assert "OK" in a.cli("verify", str(out)).stdout
    assert all(local(a, sha) for sha in shas) and a.staging() == []


def test_a_move_to_a_host_without_the_tier_delivers_every_blob(hosts: tuple[Host, Host], tmp_path: Path) -> None:
    a, b = hosts
    b.extra = a.extra[:-2]  # the same directory, no --blobs
    assert a.extra[-2] == "--blobs"
    agent_id, shas = agent_with_blobs(a, "carrier", 4)
    data = contents(a, shas)
    a.start()
    all_recorded(a, shas)
    gc_tier_cache(a, 0)
    assert not any(local(a, sha) for sha in shas)
    b.start()
    wait_for(lambda: active(a, "carrier"), "the agent active under A's lease")
    wait_for(lambda: b.host_id in a.cli("fleet", "hosts").stdout, "b in the directory")
    assert write_move(a.mnt, "carrier", f"{b.host_id}\n") == 0
    verify_on(b, "carrier", tmp_path, 0)
    assert {sha: hashlib.sha256(object_path(b, sha).read_bytes()).hexdigest() for sha in shas} == \
        {sha: sha for sha in shas}
    assert contents(b, shas) == data
    assert value(metrics(a), "capsulefs_tier_cache_fetches_total", outcome="fetched") == len(shas)
    assert a.staging() == []
    del agent_id
