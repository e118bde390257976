"""The fleet codecs without an engine: etcd's JSON gateway, S3 addresses and
XML replies. Every reply is hostile: each parser raises one of our errors
naming the fault, and nothing else escapes (checked by hypothesis over the
fuzz targets of tests/fuzz/targets_fleet.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capsulefs.core.errors import CapsuleError
from capsulefs.core.fleet import etcd
from capsulefs.core.fleet.errors import (
    BlobTierProtocolError,
    BlobTierRefused,
    BlobTierUnavailable,
    BucketNotFound,
    ConditionalConflict,
    DirectoryProtocolError,
    DirectoryRefused,
    DirectoryReplyLost,
    FleetAddressError,
    LeaseNotFound,
    ObjectNotFound,
    PreconditionFailed,
    RevisionCompacted,
)
from capsulefs.core.fleet.s3_wire import check_key, error_for, object_path, parse_list_v2, parse_tier_url
from fuzz import Target
from fuzz.targets_fleet import HEADER, KV, TARGETS

# -- etcd requests ---------------------------------------------------------------


def test_requests_carry_base64_and_string_integers() -> None:
    req = etcd.txn_request([etcd.Compare.mod(b"\xffk", 7)], [etcd.Put(key=b"\xffk", value=b"v", lease=9)],
                           [etcd.Range(key=b"\xffk")])
    assert req.path == "/v3/kv/txn" and not req.idempotent
    assert json.loads(req.body) == {
        "compare": [{"key": "/2s=", "target": "MOD", "result": "EQUAL", "mod_revision": "7"}],
        "success": [{"request_put": {"key": "/2s=", "value": "dg==", "lease": "9"}}],
        "failure": [{"request_range": {"key": "/2s="}}],
    }
    assert etcd.txn_request([], [etcd.Range(key=b"k")], []).idempotent  # a read-only txn may be sent again
    assert etcd.range_request(etcd.Range(key=b"k")).idempotent
    assert not etcd.put_request(etcd.Put(key=b"k", value=b"")).idempotent


@pytest.mark.parametrize(("prefix", "end"), [(b"a", b"b"), (b"a\xff", b"b"), (b"\xff\xff", b"\x00"), (b"ab", b"ac")])
def test_prefix_end(prefix: bytes, end: bytes) -> None:
    assert etcd.prefix_end(prefix) == end


def test_operations_refuse_nonsense() -> None:
    for make in [lambda: etcd.Put(key=b"", value=b"v"), lambda: etcd.Range(key=b"k", revision=-1),
                 lambda: etcd.Compare.mod(b"k", -1), lambda: etcd.Compare(key=b"k", target=etcd.Target.VALUE, value=1),
                 lambda: etcd.Compare(key=b"k", target=etcd.Target.MOD, value=b"1"),
                 lambda: etcd.lease_grant_request(1 << 63)]:
        with pytest.raises(ValueError):
            make()


def test_endpoints() -> None:
    assert etcd.parse_endpoints("etcd://10.0.0.1:2379,db.example:2380,[::1]:1") == [
        "http://10.0.0.1:2379", "http://db.example:2380", "http://[::1]:1"]
    for bad in ["http://h:1", "etcd://", "etcd://h", "etcd://h:0", "etcd://h:99999", "etcd://h:1,", "etcd://a b:1",
                "etcd://::1:2379", "etcd://h:1/path"]:
        with pytest.raises(FleetAddressError):
            etcd.parse_endpoints(bad)


# -- etcd replies ----------------------------------------------------------------


def test_a_range_reply() -> None:
    result = etcd.decode_range(b"{" + HEADER + b',"kvs":[' + KV + b'],"count":"1","unknown":{"x":1}}')
    assert result.revision == 7 and result.count == 1 and not result.more
    assert result.kvs[0] == etcd.KeyValue(key=b"foo", value=b"baz", create_revision=2, mod_revision=3, version=2,
                                          lease=5)
    empty = etcd.decode_range(b"{" + HEADER + b"}")  # proto3 leaves defaults out
    assert (empty.kvs, empty.count) == ((), 0)


@pytest.mark.parametrize(("body", "match"), [
    (b"[1]", "not a JSON object"),
    (b"\xff{}", "not JSON"),
    (b"[" * 100_000, "not JSON"),
    (b'{"header":{"revision":"7","revision":"8"}}', "repeats the field 'revision'"),
    (b'{"header":{"revision":true}}', "not an integer"),
    (b'{"header":{"revision":"7e3"}}', "not an integer"),
    (b'{"header":{"revision":"9223372036854775808"}}', "out of range"),
    (b'{"header":{"revision":"-1"}}', "out of range"),
    (b'{"header":[]}', "header is not an object"),
    (b'{"kvs":{}}', "kvs is not a list"),
    (b'{"kvs":[{"key":"Zm9v","value":"a"}],"count":"1"}', "not base64"),
    (b'{"kvs":[{"value":"YQ=="}],"count":"1"}', "empty key"),
    (b'{"kvs":[' + KV + b'],"count":"0"}', "count 0 is less"),
    (b'{"more":"yes"}', "more is not a boolean"),
])
def test_bad_range_replies(body: bytes, match: str) -> None:
    with pytest.raises(DirectoryProtocolError, match=match):
        etcd.decode_range(body)


def test_a_txn_reply_must_answer_the_operations_sent() -> None:
    put, rng = [etcd.Put(key=b"k", value=b"v")], [etcd.Range(key=b"k")]
    ok = etcd.decode_txn(b'{"succeeded":true,"responses":[{"response_put":{"header":{"revision":"3"}}}]}', put, rng)
    assert ok.succeeded and ok.responses == (etcd.PutResult(revision=3, prev_kv=None),)
    failed = etcd.decode_txn(b'{"responses":[{"response_range":{"count":"0"}}]}', put, rng)
    assert not failed.succeeded and isinstance(failed.responses[0], etcd.RangeResult)
    for body, match in [(b'{"succeeded":true}', "0 responses for 1"),
                        (b'{"succeeded":true,"responses":[{"response_range":{}}]}', "not the response_put"),
                        (b'{"succeeded":true,"responses":[{"response_put":{},"response_range":{}}]}', "not the"),
                        (b'{"succeeded":true,"responses":[{"response_put":[]}]}', "not the response_put")]:
        with pytest.raises(DirectoryProtocolError, match=match):
            etcd.decode_txn(body, put, rng)


def test_lease_replies() -> None:
    assert etcd.decode_lease_grant(b'{"ID":"12","TTL":"5"}') == etcd.Lease(id=12, ttl=5)
    with pytest.raises(DirectoryRefused, match="lease already exists"):
        etcd.decode_lease_grant(b'{"ID":"12","error":"lease already exists"}')
    assert etcd.decode_keepalive(b'{"result":{"ID":"12","TTL":"5"}}\n', 12) == 5
    with pytest.raises(LeaseNotFound):
        etcd.decode_keepalive(b'{"result":{"ID":"12"}}', 12)
    with pytest.raises(DirectoryProtocolError, match="another lease"):
        etcd.decode_keepalive(b'{"result":{"ID":"13","TTL":"5"}}', 12)
    with pytest.raises(DirectoryProtocolError, match="2 answers"):
        etcd.decode_keepalive(b'{"result":{"ID":"12","TTL":"5"}}\n{"result":{"ID":"12","TTL":"5"}}', 12)
    assert etcd.decode_lease_ttl(b'{"ID":"12","TTL":"-1"}', 12) is None
    ttl = etcd.decode_lease_ttl(b'{"ID":"12","TTL":"3","grantedTTL":"5","keys":["Zm9v"]}', 12)
    assert ttl == etcd.LeaseTTL(id=12, ttl=3, granted_ttl=5, keys=(b"foo",))


def test_watch_lines_and_stream_errors() -> None:
    response = etcd.decode_watch_line(b'{"result":{' + HEADER + b',"events":[{"type":"DELETE","kv":' + KV + b"}]}}")
    assert response.events[0].type is etcd.EventType.DELETE and response.events[0].kv.key == b"foo"
    with pytest.raises(DirectoryReplyLost, match="no leader"):
        etcd.decode_watch_line(b'{"error":{"grpc_code":14,"message":"etcdserver: no leader"}}')
    with pytest.raises(DirectoryProtocolError, match="unknown event type"):
        etcd.decode_watch_line(b'{"result":{"events":[{"type":"EXPLODE","kv":' + KV + b"}]}}")
    splitter = etcd.LineSplitter(limit=10)
    assert splitter.feed(b"ab\n\ncd") == [b"ab"] and splitter.feed(b"e\n") == [b"cde"]
    with pytest.raises(DirectoryProtocolError, match="longer than 10"):
        splitter.feed(b"x" * 11)


@pytest.mark.parametrize(("status", "body", "error"), [
    (404, b'{"error":"etcdserver: requested lease not found","code":5}', LeaseNotFound),
    (400, b'{"message":"etcdserver: mvcc: required revision has been compacted","code":11}', RevisionCompacted),
    (400, b'{"message":"etcdserver: mvcc: required revision is a future revision","code":11}', DirectoryRefused),
    (503, b'{"message":"etcdserver: request timed out","code":4}', DirectoryReplyLost),
    (503, b'{"message":"etcdserver: leader changed","code":14}', DirectoryReplyLost),
    (400, b'{"message":"etcdserver: key is not provided","code":3}', DirectoryRefused),
    (502, b"<html>bad gateway</html>", DirectoryProtocolError),
    (400, b'{"code":"3","message":"x"}', DirectoryProtocolError),
])
def test_error_answers_map_by_grpc_code(status: int, body: bytes, error: type[Exception]) -> None:
    assert type(etcd.decode_error(status, body)) is error


# -- S3 --------------------------------------------------------------------------


def test_tier_urls() -> None:
    tier = parse_tier_url("http://127.0.0.1:8333/bucket")
    assert (tier.endpoint, tier.bucket, tier.prefix, tier.host_header) == (
        "http://127.0.0.1:8333", "bucket", "", "127.0.0.1:8333")
    tier = parse_tier_url("https://s3.eu.example.com/my.bucket/fleet/eu/")
    assert (tier.port, tier.prefix, tier.host_header, str(tier)) == (
        443, "fleet/eu/", "s3.eu.example.com", "https://s3.eu.example.com:443/my.bucket/fleet/eu/")
    assert parse_tier_url("http://[::1]:9000/b-1").host == "[::1]"


@pytest.mark.parametrize(("url", "match"), [
    ("s3://host/bucket", "http://HOST"),
    ("http://key:secret@host/bucket", "no credentials"),
    ("http://host/bucket?x=1", "no query"),
    ("http://host/bucket#f", "no query"),
    ("http://host/", "bucket name"),
    ("http://host/Bucket", "bucket name"),
    ("http://host/ab", "bucket name"),
    ("http://host/a..b", "bucket name"),
    ("http://host/bucket/a//b", "empty"),
    ("http://host/bucket/../x", "'..'"),
    ("http://host:99999/bucket", "not a blob tier URL"),
    ("http://ho st/bucket", "host name"),
])
def test_bad_tier_urls(url: str, match: str) -> None:
    with pytest.raises(FleetAddressError, match=match):
        parse_tier_url(url)


def test_keys_and_paths() -> None:
    assert object_path("b", "a b/é$") == "/b/a%20b/%C3%A9%24"
    assert object_path("b", None) == "/b"
    for bad in ["", "a\nb", "a/../b", "a//b", "/a", "x" * 1025, "a\udcffb"]:
        with pytest.raises(FleetAddressError):
            check_key(bad)


@pytest.mark.parametrize(("status", "code", "error"), [
    (412, "PreconditionFailed", PreconditionFailed),
    (409, "ConditionalRequestConflict", ConditionalConflict),
    (409, "BucketAlreadyOwnedByYou", BlobTierRefused),
    (404, "NoSuchBucket", BucketNotFound),
    (404, "NoSuchKey", ObjectNotFound),
    (404, "", ObjectNotFound),
    (503, "SlowDown", BlobTierUnavailable),
    (403, "AccessDenied", BlobTierRefused),
])
def test_s3_errors_map_by_status_and_code(status: int, code: str, error: type[Exception]) -> None:
    body = f"<Error><Code>{code}</Code><Message>m</Message></Error>".encode() if code else b""
    assert type(error_for(status, body, "put x")) is error


def test_list_pages() -> None:
    page = parse_list_v2(TARGETS[5].seeds()[0], "p/")
    assert page.next_token == "tok" and [(o.key, o.size, o.etag) for o in page.objects] == [("p/a", 5, '"5d41"')]
    assert parse_list_v2(b"<ListBucketResult><IsTruncated>false</IsTruncated></ListBucketResult>", "").objects == ()


@pytest.mark.parametrize(("body", "match"), [
    (b'<!DOCTYPE lolz [<!ENTITY lol "lol"><!ENTITY lol2 "&lol;&lol;">]><ListBucketResult>&lol2;</ListBucketResult>',
     "DTD"),
    (b"<ListBucketResult><IsTruncated>true</IsTruncated></ListBucketResult>", "without a continuation token"),
    (b"<ListBucketResult><IsTruncated>maybe</IsTruncated></ListBucketResult>", "IsTruncated"),
    (b"<ListBucketResult><IsTruncated>false</IsTruncated><IsTruncated>true</IsTruncated></ListBucketResult>",
     "appears 2 times"),
    (b"<ListBucketResult><Contents><Key>q/a</Key><Size>1</Size></Contents></ListBucketResult>", "not under"),
    (b"<ListBucketResult><Contents><Key>p/a</Key><Size>-1</Size></Contents></ListBucketResult>", "Size"),
    (b"<ListBucketResult><Contents><Size>1</Size></Contents></ListBucketResult>", "no Key"),
    (b"<ListBucketResult><Contents><Key>p/a<b/></Key><Size>1</Size></Contents></ListBucketResult>", "not text"),
    (b"<Error><Code>x</Code></Error>", "not a ListBucketResult"),
    (b"<ListBucketResult>", "not XML"),
])
def test_bad_list_pages(body: bytes, match: str) -> None:
    with pytest.raises(BlobTierProtocolError, match=match):
        parse_list_v2(body, "p/")


# -- fuzz ------------------------------------------------------------------------


def _mutations(seeds: list[bytes]) -> st.SearchStrategy[bytes]:
    def mutate(seed: bytes, cuts: list[tuple[int, int, bytes]]) -> bytes:
        data = bytearray(seed)
        for pos, length, insert in cuts:
            pos = pos % (len(data) + 1)
            data[pos:pos + length] = insert
        return bytes(data)

    cut = st.tuples(st.integers(0, 10_000), st.integers(0, 8), st.binary(max_size=8))
    return st.builds(mutate, st.sampled_from(seeds), st.lists(cut, min_size=1, max_size=4))


@pytest.mark.parametrize("target", TARGETS, ids=[t.name for t in TARGETS])
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_fuzz_only_our_errors_escape(target: Target, data: st.DataObject) -> None:
    seeds = target.seeds()
    for blob in [*seeds, data.draw(st.one_of(st.binary(max_size=600), _mutations(seeds)))]:
        try:
            target.run(blob, Path("/nonexistent"))  # (no target here writes)
        except CapsuleError:
            pass


@pytest.mark.parametrize("body", [b'<?xml version="" encoding="T"?>', b'<?xml version="1.0" encoding="no-such"?><Error/>'])
def test_an_xml_answer_naming_an_unknown_encoding_is_a_protocol_error(body: bytes) -> None:
    # (found by the fuzz target: ElementTree raised LookupError for the encoding)
    assert type(error_for(500, body, "put x")) is BlobTierUnavailable
