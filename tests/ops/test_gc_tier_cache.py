"""``capsulefs gc --tier-cache SIZE``: the host store as a cache of the blob tier
(core/store/cache.py, ``HostStore.gc_tier_cache``, capsulefs/fleet/cache.py
``EvictionPolicy``). No tier is asked anything here: the eviction record
(``STATE/fleet-tier/*.evictable``) says what may go, as the live set
publisher writes it (capsulefs/fleet/live.py); tests/daemons/test_fleet_tier_cache.py
reads evicted blobs back from a real tier."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from capsulefs.core.capsule import format as fmt
from capsulefs.core.fleet import config as fleet_config
from capsulefs.core.fsutil import atomic_write
from capsulefs.core.store.cache import TOUCH_EVERY
from capsulefs.core.store.host_store import HostStore
from capsulefs.fleet.cache import EvictionPolicy
from capsulefs.fleet.live import EvictionRecord
from capsulefs.fleet.uploader import TierRecord

from helpers import make_agent

TIER = "http://127.0.0.1:9/fleet-blobs/eu"
KB = 1024
DAY = TOUCH_EVERY * 1_000_000_000
#: The agent's evicted blobs are in no tier here (none runs): its export, the end-of-test check, cannot be made.
EVICTED = pytest.mark.capsule_left_broken("blobs evicted to a tier that these tests do not run")


def _agent_blobs(store: HostStore, name: str, sizes: list[int]) -> list[str]:
    agent = make_agent(store, name, workspace={f"f{i}": os.urandom(n) for i, n in enumerate(sizes)})
    snap = fmt.parse_snapshot(agent.read(fmt.SNAPSHOT))
    return [snap[f"f{i}"] for i in range(len(sizes))]


def _read_at(store: HostStore, sha: str, days_ago: float) -> None:
    """The blob was last read ``days_ago`` days ago (its access time)."""
    path = store.blob_file(sha)
    os.utime(path, ns=(time.time_ns() - int(days_ago * DAY), os.stat(path).st_mtime_ns))


def _record(store: HostStore, shas: list[str]) -> EvictionRecord:
    """These blobs were published as live, then confirmed in the tier: they may be evicted."""
    record = EvictionRecord(store.root, str(fleet_config.make("etcd://127.0.0.1:2379", blobs=TIER).tier))
    record.add(shas)
    return record


@EVICTED
def test_gc_evicts_recorded_blobs_coldest_first_until_the_rest_fits(store: HostStore) -> None:
    shas = _agent_blobs(store, "a", [10 * KB] * 5)
    for days, sha in zip([5, 1, 9, 3, 7], shas):
        _read_at(store, sha, days)
    orphan = store.put_blob(b"nobody lists me")
    record = _record(store, shas[:4])  # the last blob is not known to be in the tier

    report, cache = store.gc_tier_cache(25 * KB, EvictionPolicy(record))
    assert report.removed == 1 and not store.has_blob(orphan)
    # Coldest first among the recorded: 9 days (shas[2]), then 5 (shas[0]), then 3 (shas[3]); 20 KiB stay.
    assert [store.has_blob(s) for s in shas] == [False, True, False, False, True]
    assert (cache.evicted, cache.evicted_bytes, cache.cached_bytes, cache.over) == (3, 30 * KB, 20 * KB, False)

    # What the tier does not hold stays, however cold and however small the limit.
    _read_at(store, shas[4], 30)
    _report, cache = store.gc_tier_cache(0, EvictionPolicy(record))
    assert [store.has_blob(s) for s in shas] == [False, False, False, False, True]
    assert cache.cached_bytes == 10 * KB and cache.over


@EVICTED
def test_gc_never_evicts_a_blob_a_staging_area_names(store: HostStore) -> None:
    shas = _agent_blobs(store, "a", [10 * KB] * 3)
    agent = store.agent(store.agent_ids()[0])
    record = _record(store, shas)
    with store.staging("tier-send") as area:  # (a move's source, an offer, an export in flight)
        atomic_write(os.path.join(area, fmt.MANIFEST), agent.manifest().to_bytes())
        _report, cache = store.gc_tier_cache(0, EvictionPolicy(record))
        assert all(store.has_blob(s) for s in shas) and cache.evicted == 0
    _report, cache = store.gc_tier_cache(0, EvictionPolicy(record))
    assert not any(store.has_blob(s) for s in shas) and cache.evicted == 3


def test_a_read_marks_a_blob_hot_at_most_once_a_day(store: HostStore) -> None:
    (sha,) = _agent_blobs(store, "a", [KB])
    _read_at(store, sha, 3)
    store.touch_blob(sha)
    touched = os.stat(store.blob_file(sha))
    assert time.time_ns() - touched.st_atime_ns < DAY // 24
    store.touch_blob(sha, now_ns=touched.st_atime_ns + DAY // 2)  # (half a day later: left as it is)
    assert os.stat(store.blob_file(sha)).st_ctime_ns == touched.st_ctime_ns


@EVICTED
def test_the_cli_evicts_and_says_what_the_cache_holds(store: HostStore, state_dir: Path, cli) -> None:
    shas = _agent_blobs(store, "a", [100 * KB] * 4)
    for days, sha in zip([1, 2, 3, 4], shas):
        _read_at(store, sha, days)
    fleet_config.save(str(state_dir), fleet_config.make("etcd://127.0.0.1:2379", blobs=TIER))
    _record(store, shas)
    out = cli("gc", "--tier-cache", "250K", check=True).stdout
    assert "evicted 2 blob(s) held by the blob tier, freed 204800 bytes" in out
    assert "cache: 204800 bytes of listed blobs kept here (limit 256000)" in out
    assert [store.has_blob(s) for s in shas] == [True, True, False, False]


@pytest.mark.parametrize(("args", "words"), [
    (("--tier-cache", "10X"), "size '10X' is not a number of bytes"),
    (("--tier-cache", "-5"), "is not a number of bytes"),
])
def test_the_cli_refuses_a_bad_size_in_one_line(store: HostStore, state_dir: Path, cli, args, words: str) -> None:
    fleet_config.save(str(state_dir), fleet_config.make("etcd://127.0.0.1:2379", blobs=TIER))
    proc = cli("gc", *args)
    assert proc.returncode != 0 and words in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


@EVICTED
def test_blobs_only_put_to_the_tier_are_not_evicted(store: HostStore, state_dir: Path, cli) -> None:
    # The uploader's record says the put was answered (201 or 412), which a tier gc's mark can undo:
    # a blob may go only once the eviction record names it (docs/fleet.md, "The eviction rule").
    shas = _agent_blobs(store, "a", [10 * KB] * 2)
    fleet_config.save(str(state_dir), fleet_config.make("etcd://127.0.0.1:2379", blobs=TIER))
    TierRecord(store.root, str(fleet_config.make("etcd://127.0.0.1:2379", blobs=TIER).tier)).add(shas)
    _record(store, shas[:1])
    out = cli("gc", "--tier-cache", "0", check=True).stdout
    assert "evicted 1 blob(s) held by the blob tier" in out
    assert [store.has_blob(s) for s in shas] == [False, True]


def test_the_cli_refuses_tier_cache_on_a_host_without_a_tier(store: HostStore, state_dir: Path, cli) -> None:
    (sha,) = _agent_blobs(store, "a", [KB])
    for saved in (None, fleet_config.make("etcd://127.0.0.1:2379")):  # no fleet; a fleet without a tier
        if saved is not None:
            fleet_config.save(str(state_dir), saved)
        proc = cli("gc", "--tier-cache", "1G")
        assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
        assert "gc --tier-cache: this host has no blob tier" in proc.stderr
    assert store.has_blob(sha)
