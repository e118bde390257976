"""The tier gc's records (core/fleet/liveset.py): a live set, its pointer, a mark, the gc key.

Each is written by another host: parsed strictly, within the caller's byte cap, one error line.
"""

from __future__ import annotations

import hashlib
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from capsulefs.core.fleet import liveset as ls
from capsulefs.core.fleet.directory import Layout
from capsulefs.core.fleet.s3_wire import parse_list_v2

SHAS = st.frozensets(st.binary(min_size=32, max_size=32).map(bytes.hex), max_size=40)


@given(SHAS, st.integers(1, 2**40))
def test_a_live_set_round_trips(blobs: frozenset[str], generation: int) -> None:
    s = ls.LiveSet("host-1", generation, blobs)
    data = s.encode()
    assert ls.parse_live_set(data, limit=len(data)) == s
    assert len(data) <= 200 + 32 * len(blobs)  # (raw digests: half of hex)


def _set(*ints: int) -> bytes:
    return ls.LiveSet("h", 2, frozenset(f"{i:064x}" for i in ints)).encode()


def _header(data: bytes) -> tuple[bytes, dict, bytes]:
    magic, header, body = data.split(b"\n", 2)
    return magic, json.loads(header), body


def _with_header(data: bytes, **change: object) -> bytes:
    magic, header, body = _header(data)
    header.update(change)
    return magic + b"\n" + json.dumps(header).encode() + b"\n" + body


@pytest.mark.parametrize(("data", "problem"), [
    (b"", "does not start with"),
    (b"capsulefs-live/2\n{}\n", "does not start with"),
    (b"capsulefs-live/1\n" + b" " * 2000, "no header line"),
    (b"capsulefs-live/1\n{\n", "header"),
    (_with_header(_set(1, 2), count=3), "not 3 x 32"),
    (_with_header(_set(1, 2), count=1), "not 1 x 32"),
    (_set(1, 2) + b"x", "not 2 x 32"),
    (_with_header(_set(1), generation=0), "generation"),
    (_with_header(_set(1), generation=True), "generation"),
    (_with_header(_set(1), host_id="a/b"), "host id"),
    (_with_header(_set(1), extra=1), "fields"),
    (_with_header(_set(1), format="capsulefs-live/9"), "fields"),
])
def test_a_live_set_that_is_not_ours_is_refused_in_one_line(data: bytes, problem: str) -> None:
    with pytest.raises(ls.LiveSetError, match=problem) as err:
        ls.parse_live_set(data, limit=1 << 20)
    assert "\n" not in str(err.value)


def test_digests_must_be_strictly_ascending() -> None:
    good = _set(1, 2)
    magic, _, body = good.split(b"\n", 2)
    swapped = good[:len(good) - 64] + body[32:] + body[:32]
    with pytest.raises(ls.LiveSetError, match="not above"):
        ls.parse_live_set(swapped, limit=1 << 20)
    twice = good[:len(good) - 32] + body[:32]
    with pytest.raises(ls.LiveSetError, match="not above"):
        ls.parse_live_set(twice, limit=1 << 20)


def test_a_live_set_over_the_cap_is_refused_before_it_is_read() -> None:
    data = _set(*range(1, 100))
    with pytest.raises(ls.LiveSetError, match="more than the 100 allowed"):
        ls.parse_live_set(data, limit=100)


def test_a_huge_count_costs_nothing() -> None:
    with pytest.raises(ls.LiveSetError, match="x 32"):
        ls.parse_live_set(_with_header(_set(1), count=2**50), limit=1 << 20)


def test_the_pointer_mark_and_gc_key_round_trip_and_refuse_strangers() -> None:
    p = ls.LivePointer(host_id="h-1", generation=4, count=9, sha256="ab" * 32, checked=1765000000)
    assert ls.decode_pointer(p.encode()) == p
    assert ls.decode_mark(ls.encode_mark("0f" * 16)) == "0f" * 16
    g = ls.GcEntry(gc_id="0f" * 16, by="h pid 3", started=5)
    assert ls.decode_gc(g.encode()) == g
    for bad, parse in [
        (p.encode().replace(b'"count":9', b'"count":-1'), ls.decode_pointer),
        (p.encode().replace(b"ab" * 32, b"AB" * 32), ls.decode_pointer),
        (p.encode()[:-1] + b',"x":1}', ls.decode_pointer),
        (b'{"format":"capsulefs-gc-mark/1","gc_id":"xyz"}', ls.decode_mark),
        (b'{"format":"fleet-gc/1","gc_id":"' + b"0f" * 16 + b'","by":"a\\nb","started":1}', ls.decode_gc),
        (b"x" * 5000, ls.decode_gc),
        (b"[]", ls.decode_mark),
    ]:
        with pytest.raises(ls.LiveSetError):
            parse(bad)


def test_the_keys_live_outside_the_blobs_and_the_agents() -> None:
    layout = Layout(b"/fleet/")
    assert ls.pointer_key(layout, "h-1") == b"/fleet/live/h-1"
    assert ls.gc_key(layout) == b"/fleet/gc"
    assert not ls.pointer_key(layout, "h").startswith(layout.agents)
    assert ls.live_key("eu/", "h-1") == "eu/_capsulefs/live/h-1"
    assert ls.mark_key("eu/", "a" * 64) == "eu/_capsulefs/marks/" + "a" * 64
    assert not ls.mark_key("eu/", "a" * 64).startswith("eu/blobs/")
    with pytest.raises(ValueError):
        ls.mark_key("eu/", "../x")


def test_a_listing_gives_each_object_its_last_modified_time() -> None:
    body = (b"<ListBucketResult><IsTruncated>false</IsTruncated><Contents><Key>p/a</Key><Size>5</Size>"
            b"<LastModified>2026-12-07T16:38:15.000Z</LastModified></Contents>"
            b"<Contents><Key>p/b</Key><Size>1</Size></Contents></ListBucketResult>")
    a, b = parse_list_v2(body, "p/").objects
    assert a.modified == 1796661495.0 and b.modified is None
    with pytest.raises(Exception, match="LastModified"):
        parse_list_v2(body.replace(b"2026-12-07T16:38:15.000Z", b"yesterday"), "p/")


def test_the_set_digest_is_what_the_pointer_carries() -> None:
    data = _set(3, 4)
    assert len(hashlib.sha256(data).hexdigest()) == 64


def test_the_eviction_record_skips_a_torn_line_and_shrinks_to_a_set(tmp_path: object) -> None:
    from capsulefs.fleet.live import EvictionRecord, may_evict

    rec = EvictionRecord(str(tmp_path), "http://t/b/eu/")
    a, b, c = ("a" * 64, "b" * 64, "c" * 64)
    rec.add([a])
    with open(rec.path, "ab") as f:
        f.write(b"d" * 30)  # (a crash mid-append)
    rec.add([b])
    rec.add([c])
    assert rec.load() == {a, b, c}
    with open(rec.path, "rb") as f:
        assert f.read().count(b"\n\n") == 0
    rec.keep_only({b, c, "e" * 64})
    evictable = rec.load()
    assert evictable == {b, c} and may_evict(evictable, b) and not may_evict(evictable, a)
