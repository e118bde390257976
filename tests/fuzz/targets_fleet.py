"""Fuzz targets: the fleet engines' replies (etcd's JSON gateway, S3's XML)
and the tier addresses and cache sizes a person types. Bad input raises a CapsuleError."""

from __future__ import annotations

import base64
from pathlib import Path

from capsulefs.core.errors import CapsuleError
from capsulefs.core.fleet import directory, etcd, liveset
from capsulefs.core.fleet.s3_wire import error_for, parse_list_v2, parse_tier_url
from capsulefs.core.store.cache import MAX_SIZE, SizeError, parse_size
from capsulefs.fleet.peers import peer_of

from . import Target

HEADER = b'"header":{"cluster_id":"14443903163313418560","member_id":"1","revision":"7","raft_term":"2"}'
KV = b'{"key":"Zm9v","create_revision":"2","mod_revision":"3","version":"2","value":"YmF6","lease":"5"}'


def _range_seeds() -> list[bytes]:
    return [b"{" + HEADER + b',"kvs":[' + KV + b'],"count":"1"}', b"{" + HEADER + b"}",
            b"{" + HEADER + b',"kvs":[' + KV + b"," + KV + b'],"count":"2","more":true}']


def _txn_seeds() -> list[bytes]:
    return [b"{" + HEADER + b',"succeeded":true,"responses":[{"response_put":{"header":{"revision":"3"}}}]}',
            b"{" + HEADER + b',"responses":[{"response_range":{' + HEADER + b',"kvs":[' + KV + b'],"count":"1"}}]}']


def _watch_seeds() -> list[bytes]:
    return [b'{"result":{' + HEADER + b',"created":true}}',
            b'{"result":{' + HEADER + b',"events":[{"kv":' + KV + b'},{"type":"DELETE","kv":' + KV
            + b',"prev_kv":' + KV + b"}]}}",
            b'{"result":{"header":{"raft_term":"2"},"canceled":true,"compact_revision":"5"}}',
            b'{"error":{"grpc_code":14,"http_code":503,"message":"etcdserver: no leader"}}']


def _lease_seeds() -> list[bytes]:
    return [b'{"result":{' + HEADER + b',"ID":"1","TTL":"5"}}', b'{"result":{' + HEADER + b',"ID":"1"}}',
            b"{" + HEADER + b',"ID":"1","TTL":"4","grantedTTL":"5","keys":["Zm9v"]}', b'{"ID":"1","TTL":"-1"}']


def _error_seeds() -> list[bytes]:
    return [b'{"error":"etcdserver: requested lease not found","message":"etcdserver: requested lease not found",'
            b'"code":5}', b'{"message":"etcdserver: mvcc: required revision has been compacted","code":11}',
            b"404 page not found"]


def _list_seeds() -> list[bytes]:
    return [b'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
            b"<Name>b</Name><Prefix>p/</Prefix><KeyCount>1</KeyCount><IsTruncated>true</IsTruncated>"
            b"<NextContinuationToken>tok</NextContinuationToken><Contents><Key>p/a</Key>"
            b"<Size>5</Size><ETag>&quot;5d41&quot;</ETag><LastModified>2026-12-07T16:38:15.000Z</LastModified>"
            b"</Contents></ListBucketResult>",
            b"<ListBucketResult><IsTruncated>false</IsTruncated></ListBucketResult>"]


def _s3_error_seeds() -> list[bytes]:
    return [b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>NoSuchBucket</Code>'
            b"<Message>The specified bucket does not exist</Message></Error>", b""]


def _url_seeds() -> list[bytes]:
    return [b"http://127.0.0.1:8333/bucket", b"https://s3.example.com/my.bucket/fleet/eu",
            b"http://[::1]:9000/b-1/", b"etcd://127.0.0.1:2379,[::1]:2380"]


def _record_seeds() -> list[bytes]:
    return [directory.AgentEntry(host_id="h-1", epoch=7).encode(),
            directory.HostEntry(host_id="h-1", address="10.0.0.1:7000").encode(),
            directory.HostEntry(host_id="h-1", address="10.0.0.1:7000", cert_sha256="ab" * 32).encode(),
            b'{"epoch":1,"format":"fleet-agent/1","host_id":"h","state":"removed"}']


def _run_records(data: bytes, scratch: Path) -> None:
    try:
        directory.decode_agent(data)
    except CapsuleError:
        pass
    directory.decode_host(data)


_LAYOUT = directory.Layout(b"/f/")
_HOST_SHA = "5d" * 32
_HOST_ID = base64.b32encode(bytes.fromhex(_HOST_SHA)).decode().rstrip("=")  # (a daemon's id for that certificate)


def _live_seeds() -> list[bytes]:
    blobs = frozenset(f"{i:064x}" for i in (1, 7, 2**200))
    return [liveset.LiveSet("h-1", 3, blobs).encode(), liveset.LiveSet("h-1", 1, frozenset()).encode(),
            liveset.LivePointer(host_id="h-1", generation=3, count=3, sha256="ab" * 32, checked=1765000000).encode(),
            liveset.encode_mark("cd" * 16),
            liveset.GcEntry(gc_id="cd" * 16, by="host pid 1", started=1765000000).encode()]


def _run_live(data: bytes, scratch: Path) -> None:
    """A live set, its pointer, a mark, the gc key: another host wrote them (fleet/live.py, tiergc.py)."""
    refused = 0
    for parse in (lambda d: liveset.parse_live_set(d, limit=1 << 20), liveset.decode_pointer, liveset.decode_mark,
                  liveset.decode_gc):
        try:
            parse(data)
        except CapsuleError:
            refused += 1
    if refused == 4:
        raise liveset.LiveSetError("refused by every parser")
    s = None
    try:
        s = liveset.parse_live_set(data, limit=1 << 20)
    except CapsuleError:
        pass
    if s is not None:
        assert liveset.parse_live_set(s.encode(), limit=1 << 20) == s  # (what parses, round-trips)


def _grace_seeds() -> list[bytes]:
    return [b"24h", b"90s", b"7d", b"15", b"0s"]


def _run_grace(data: bytes, scratch: Path) -> None:
    """``fleet gc --grace``: what a person typed."""
    from capsulefs.cli import UsageError
    from capsulefs.cli.fleet_cmds import parse_duration
    from capsulefs.core.errors import FormatError

    try:
        seconds = parse_duration(data.decode("utf-8", "surrogateescape"), "--grace")
    except UsageError as exc:
        raise FormatError(str(exc)) from None
    assert 0 <= seconds <= 999_999_999 * 86400


def _host_seeds() -> list[bytes]:
    return [directory.HostEntry(host_id=_HOST_ID, address="10.0.0.1:7714", cert_sha256=_HOST_SHA).encode(),
            directory.HostEntry(host_id=_HOST_ID, address="[::1]:7714", cert_sha256=_HOST_SHA).encode(),
            directory.HostEntry(host_id=_HOST_ID, address="-", cert_sha256=_HOST_SHA).encode()]


def _run_host_peer(data: bytes, scratch: Path) -> None:
    """A host record read from the directory, as the fleet's peer finder takes it (a target, a link's check)."""
    for key, lease in ((_LAYOUT.host(_HOST_ID), 7), (_LAYOUT.hosts + data[:60], 7), (_LAYOUT.host(_HOST_ID), 0)):
        try:
            peer_of(_LAYOUT, etcd.KeyValue(key=key, value=data, create_revision=1, mod_revision=1, version=1,
                                           lease=lease))
        except CapsuleError:
            pass


def _run_range(data: bytes, scratch: Path) -> None:
    etcd.decode_range(data)


def _run_txn(data: bytes, scratch: Path) -> None:
    etcd.decode_txn(data, [etcd.Put(key=b"k", value=b"v")], [etcd.Range(key=b"k")])


def _run_watch(data: bytes, scratch: Path) -> None:
    splitter = etcd.LineSplitter(limit=1 << 16)
    for line in splitter.feed(data + b"\n"):
        etcd.decode_watch_line(line)


def _run_lease(data: bytes, scratch: Path) -> None:
    for decode in (etcd.decode_keepalive, etcd.decode_lease_ttl):
        try:
            decode(data, 1)
        except CapsuleError:
            pass
    etcd.decode_lease_grant(data)


def _run_error(data: bytes, scratch: Path) -> None:
    for status in (400, 404, 503):
        if not isinstance(etcd.decode_error(status, data), CapsuleError):
            raise AssertionError("decode_error returned something else than an error")


def _run_list(data: bytes, scratch: Path) -> None:
    parse_list_v2(data, "p/")


def _run_s3_error(data: bytes, scratch: Path) -> None:
    for status in (403, 404, 409, 412, 503):
        if not isinstance(error_for(status, data, "fuzz"), CapsuleError):
            raise AssertionError("error_for returned something else than an error")


def _run_urls(data: bytes, scratch: Path) -> None:
    text = data.decode("utf-8", "surrogateescape")
    try:
        parse_tier_url(text)
    except CapsuleError:
        pass
    etcd.parse_endpoints(text)


def _size_seeds() -> list[bytes]:
    return [b"10G", b"500M", b"64KiB", b"123", b"1T", b"0"]


def _run_size(data: bytes, scratch: Path) -> None:
    """``gc --tier-cache SIZE``: a size, or one SizeError line."""
    text = data.decode("utf-8", "surrogateescape")
    try:
        size = parse_size(text)
    except SizeError as exc:
        assert "\n" not in str(exc) and len(str(exc)) < 300, str(exc)
        return
    assert 0 <= size <= MAX_SIZE and text.strip()[:1].isdigit(), (text, size)


TARGETS = [
    Target("fleet-etcd-range", _range_seeds, _run_range),
    Target("fleet-etcd-txn", _txn_seeds, _run_txn),
    Target("fleet-etcd-watch", _watch_seeds, _run_watch),
    Target("fleet-etcd-lease", _lease_seeds, _run_lease),
    Target("fleet-etcd-error", _error_seeds, _run_error),
    Target("fleet-s3-list", _list_seeds, _run_list),
    Target("fleet-s3-error", _s3_error_seeds, _run_s3_error),
    Target("fleet-addresses", _url_seeds, _run_urls),
    Target("fleet-directory-records", _record_seeds, _run_records),
    Target("fleet-host-peers", _host_seeds, _run_host_peer),
    Target("fleet-tier-cache-size", _size_seeds, _run_size),
    Target("fleet-live-sets", _live_seeds, _run_live),
    Target("fleet-gc-grace", _grace_seeds, _run_grace),
]
