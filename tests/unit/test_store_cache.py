"""The local store as a cache of the blob tier, the pure parts (core/store/cache.py):
the SIZE of ``gc --tier-cache`` and the order in which listed blobs are evicted."""

from __future__ import annotations

import pytest

from capsulefs.core.store.cache import MAX_SIZE, SizeError, choose_evictions, parse_size


@pytest.mark.parametrize(("text", "size"), [
    ("0", 0), ("123", 123), ("64K", 64 << 10), ("500M", 500 << 20), ("10G", 10 << 30), ("1T", 1 << 40),
    ("10g", 10 << 30), ("10GB", 10 << 30), ("10GiB", 10 << 30), (" 2m ", 2 << 20), ("7B", 7),
])
def test_sizes_parse(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "G", "-1G", "1.5G", "10X", "10 G", "1e9", "0x10", "10GG", "１０G",
                                  "9" * 16, "2000000T", "10G\n5", "1" * 10_000])
def test_other_sizes_are_one_line_refusals(text: str) -> None:
    with pytest.raises(SizeError) as err:
        parse_size(text)
    assert "\n" not in str(err.value) and len(str(err.value)) < 200


def test_the_largest_size() -> None:
    assert parse_size(f"{MAX_SIZE >> 40}T") == MAX_SIZE


def test_the_coldest_go_first_until_the_rest_fits() -> None:
    sizes = {"a": 100, "b": 100, "c": 100, "d": 100}
    atimes = {"a": 4, "b": 1, "c": 3, "d": 2}
    assert choose_evictions(sizes, atimes, set(sizes), 400) == []
    assert choose_evictions(sizes, atimes, set(sizes), 399) == ["b"]
    assert choose_evictions(sizes, atimes, set(sizes), 200) == ["b", "d"]
    assert choose_evictions(sizes, atimes, set(sizes), 0) == ["b", "d", "c", "a"]


def test_only_candidates_go_and_the_others_still_count() -> None:
    sizes = {"a": 100, "b": 100, "c": 300}
    atimes = {"a": 2, "b": 1, "c": 0}
    # c (coldest, the largest) may not go: a and b go, and the rest is still over the limit.
    assert choose_evictions(sizes, atimes, {"a", "b"}, 200) == ["b", "a"]


def test_equal_times_are_ordered_by_name() -> None:
    sizes = dict.fromkeys("dcba", 10)
    assert choose_evictions(sizes, dict.fromkeys("dcba", 5), set(sizes), 20) == ["a", "b"]
