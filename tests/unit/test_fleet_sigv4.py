"""AWS SigV4 signing against AWS's published vectors.

Two sources, both AWS's own: the Signature Version 4 test suite
(docs.aws.amazon.com/general/latest/gr/signature-v4-test-suite.html; service
"service", AKIDEXAMPLE, 2015-08-30T12:36:00Z) and the four worked examples
of the S3 API reference, "Signature Calculations for the Authorization
Header: Transferring Payload in a Single Chunk" (examplebucket,
AKIAIOSFODNN7EXAMPLE, 2013-05-24). The expected values are literals, so a
change to any canonicalisation step moves a byte and a test says so.
"""

from __future__ import annotations

import hashlib
from datetime import datetime, timedelta, timezone

import pytest

from capsulefs.core.fleet.sigv4 import (
    EMPTY_SHA256,
    Credentials,
    amz_date,
    authorization,
    canonical_request,
    uri_encode,
)

SUITE = Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY")
SUITE_HEADERS = [("Host", "example.amazonaws.com"), ("X-Amz-Date", "20150830T123600Z")]
S3_DOCS = Credentials("AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")
S3_HOST = ("Host", "examplebucket.s3.amazonaws.com")
S3_DATE = ("x-amz-date", "20130524T000000Z")


def suite_sign(method: str, query: list[tuple[str, str]], extra: list[tuple[str, str]]) -> str:
    return authorization(method=method, path="/", query=query, headers=SUITE_HEADERS + extra,
                         payload_hash=EMPTY_SHA256, credentials=SUITE, region="us-east-1", service="service")


def signature(auth: str) -> str:
    return auth.rsplit("Signature=", 1)[1]


@pytest.mark.parametrize(("name", "method", "query", "extra", "want"), [
    ("get-vanilla", "GET", [], [], "5fa00fa31553b73ebf1942676e86291e8372ff2a2260956d9b8aae1d763fbf31"),
    ("post-vanilla", "POST", [], [], "5da7c1a2acd57cee7505fc6676e4e544621c30862966e37dddb68e92efbe5d6b"),
    ("get-vanilla-query-order-key-case", "GET", [("Param2", "value2"), ("Param1", "value1")], [],
     "b97d918cfa904a5beff61c982a1b6f458b799221646efd99d3219ec94cdf2500"),
    ("get-vanilla-utf8-query", "GET", [("\u1234", "bar")], [],
     "2cdec8eed098649ff3a119c94853b13c643bcf08f8b0a1d91e12c9027818dd04"),
    ("get-header-value-trim", "GET", [], [("My-Header1", " value1"), ("My-Header2", ' "a   b   c"')],
     "acc3ed3afb60bb290fc8d2dd0098b9911fcaa05412b367055dee359757a9c736"),
    ("get-header-key-duplicate", "GET", [], [("My-Header1", "value2"), ("My-Header1", "value2"),
                                             ("My-Header1", "value1")],
     "c9d5ea9f3f72853aea855b47ea873832890dbdd183b4468f858259531a5138ea"),
    ("get-header-value-order", "GET", [], [("My-Header1", v) for v in ("value4", "value1", "value3", "value2")],
     "08c7e5a9acfcfeb3ab6b2185e75ce8b1deb5e634ec47601a50643f830c755c01"),
])
def test_the_sigv4_test_suite(name: str, method: str, query: list[tuple[str, str]],
                              extra: list[tuple[str, str]], want: str) -> None:
    assert signature(suite_sign(method, query, extra)) == want, name


def test_get_vanilla_whole_header_and_canonical_request() -> None:
    assert suite_sign("GET", [], []) == (
        "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20150830/us-east-1/service/aws4_request, "
        "SignedHeaders=host;x-amz-date, Signature=5fa00fa31553b73ebf1942676e86291e8372ff2a2260956d9b8aae1d763fbf31")
    creq, signed = canonical_request("GET", "/", [], SUITE_HEADERS + [("My-Header2", ' "a   b   c"')], EMPTY_SHA256)
    assert creq == ('GET\n/\n\nhost:example.amazonaws.com\nmy-header2:"a b c"\nx-amz-date:20150830T123600Z\n\n'
                    "host;my-header2;x-amz-date\n" + EMPTY_SHA256)
    assert signed == "host;my-header2;x-amz-date"


def s3_sign(method: str, path: str, query: list[tuple[str, str]], extra: list[tuple[str, str]],
            payload_hash: str) -> str:
    headers = [S3_HOST, S3_DATE, ("x-amz-content-sha256", payload_hash), *extra]
    return authorization(method=method, path=path, query=query, headers=headers, payload_hash=payload_hash,
                         credentials=S3_DOCS, region="us-east-1", service="s3")


def test_s3_get_object_example() -> None:
    auth = s3_sign("GET", "/test.txt", [], [("Range", "bytes=0-9")], EMPTY_SHA256)
    assert auth == ("AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, "
                    "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, "
                    "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41")


def test_s3_put_object_example() -> None:
    body = b"Welcome to Amazon S3."
    digest = hashlib.sha256(body).hexdigest()
    assert digest == "44ce7dd67c959e0d3524ffac1771dfbba87d2b6b4b4e99e42034a8b803f8b072"
    path = "/" + uri_encode("test$file.text", keep_slash=True)
    assert path == "/test%24file.text"
    auth = s3_sign("PUT", path, [], [("Date", "Fri, 24 May 2013 00:00:00 GMT"),
                                     ("x-amz-storage-class", "REDUCED_REDUNDANCY")], digest)
    assert "SignedHeaders=date;host;x-amz-content-sha256;x-amz-date;x-amz-storage-class," in auth
    assert signature(auth) == "98ad721746da40c64f1a55b78f14c238d841ea1380cd77a1b5971af0ece108bd"


def test_s3_bucket_examples() -> None:
    """GET Bucket lifecycle (a query name without a value) and GET Bucket
    (List Objects) with a query to sort."""
    assert signature(s3_sign("GET", "/", [("lifecycle", "")], [], EMPTY_SHA256)) == (
        "fea454ca298b7da1c68078a5d1bdbfbbe0d65c699e0f91ac7a200a0136783543")
    assert signature(s3_sign("GET", "/", [("prefix", "J"), ("max-keys", "2")], [], EMPTY_SHA256)) == (
        "34b48302e7b5fa45bde8084f4b7868a86f0a534bc59db6670ed5711ef69dc6f7")


def test_uri_encoding_and_dates() -> None:
    assert uri_encode("a b/c~d*é", keep_slash=True) == "a%20b/c~d%2A%C3%A9"
    assert uri_encode("a/b", keep_slash=False) == "a%2Fb"
    assert amz_date(datetime(2013, 5, 24, 2, 0, tzinfo=timezone(timedelta(hours=2)))) == "20130524T000000Z"
    with pytest.raises(ValueError):
        amz_date(datetime(2013, 5, 24))


def test_credentials_hide_the_secret_and_refuse_junk() -> None:
    creds = Credentials("AKID", "very-secret")
    assert "very-secret" not in repr(creds)
    for bad in [("", "x"), ("AK/ID", "x"), ("AKID", ""), ("AKID", "a b"), ("AKID", "x\n")]:
        with pytest.raises(ValueError):
            Credentials(*bad)
