"""The directory as the holder authority: records, the commit and fence Txns
and their judgement, evaluated by the simulated etcd (the same Compare/Put/
Range values the etcd client sends; tests/daemons/test_fleet_directory_etcd.py
runs them against a real etcd)."""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path

import pytest

from capsulefs.core.fleet import directory as fd
from capsulefs.core.fleet.etcd import KeyValue
from capsulefs.core.move import Outcome
from capsulefs.testing.sim_etcd import SimEtcd

L = fd.Layout(b"/t/")
AGENT = "a" * 32
SRC, TGT, OTHER = "src", "tgt", "other"
ROOT = Path(__file__).resolve().parents[2]


def _world() -> tuple[SimEtcd, int]:
    etcd = SimEtcd()
    etcd.txn(fd.claim_txn(L, AGENT, fd.AgentEntry(host_id=SRC, epoch=3)), 0.0)
    lease = etcd.grant(10, 0.0)
    etcd.txn(fd.DirTxn((), (fd.register_ops(L, fd.HostEntry(host_id=TGT, address="t:1"), lease),), ()), 0.0)
    return etcd, lease


def _kv(etcd: SimEtcd) -> KeyValue:
    kv = etcd.get(L.agent(AGENT))
    assert kv is not None
    return kv


MOVE = fd.Move(source=SRC, held_epoch=3, target=TGT, epoch=4)


def test_records_round_trip_and_are_canonical() -> None:
    e = fd.AgentEntry(host_id=SRC, epoch=3)
    assert fd.decode_agent(e.encode()) == e
    assert e.encode() == fd.AgentEntry(host_id=SRC, epoch=3, state=fd.EntryState.HELD).encode()
    h = fd.HostEntry(host_id=TGT, address="10.0.0.2:7000")
    assert fd.decode_host(h.encode()) == h


@pytest.mark.parametrize("data, says", [
    (b"[]", "JSON object"),
    (b'{"format":"fleet-agent/2","host_id":"h","epoch":1,"state":"held"}', "format"),
    (b'{"format":"fleet-agent/1","host_id":"h","epoch":0,"state":"held"}', "epoch"),
    (b'{"format":"fleet-agent/1","host_id":"h","epoch":1,"state":"gone"}', "state"),
    (b'{"format":"fleet-agent/1","host_id":"h","epoch":1,"state":["held"]}', "state"),
    (b'{"format":"fleet-agent/1","host_id":"h","epoch":1,"state":"held","x":1}', "fields"),
    (b'{"format":"fleet-agent/1","host_id":"h/../x","epoch":1,"state":"held"}', "host id"),
    (b" " * 5000, "more than"),
])
def test_a_bad_agent_record_is_named(data: bytes, says: str) -> None:
    with pytest.raises(fd.DirectoryRecordError, match=says):
        fd.decode_agent(data)


CERT = hashlib.sha256(b"a certificate's DER").hexdigest()


def test_a_host_record_names_its_certificate() -> None:
    h = fd.HostEntry(host_id=TGT, address="10.0.0.2:7000", cert_sha256=CERT)
    assert fd.decode_host(h.encode()) == h
    assert b"cert_sha256" not in fd.HostEntry(host_id=TGT, address="t:1").encode()  # (records before it read alike)
    daemon_id = base64.b32encode(bytes.fromhex(CERT)).decode().rstrip("=")  # as capsulefs.peer.identity names it
    assert fd.decode_host(fd.HostEntry(host_id=daemon_id, address="t:1", cert_sha256=CERT).encode()).host_id == daemon_id


@pytest.mark.parametrize("data, says", [
    (b'{"format":"fleet-host/1","host_id":"h","address":"a:1","cert_sha256":""}', "empty cert_sha256"),
    (b'{"format":"fleet-host/1","host_id":"h","address":"a:1","cert_sha256":"AB"}', "fingerprint"),
    (b'{"format":"fleet-host/1","host_id":"h","address":"a:1","cert_sha256":7}', "fingerprint"),
    (b'{"format":"fleet-host/1","host_id":"h","address":"a:1","cert":"x"}', "fields"),
    (b'{"format":"fleet-host/1","host_id":"' + b"A" * 52 + b'","address":"a:1","cert_sha256":"' + CERT.encode()
     + b'"}', "not the certificate's"),
])
def test_a_bad_host_record_is_named(data: bytes, says: str) -> None:
    with pytest.raises(fd.DirectoryRecordError, match=says):
        fd.decode_host(data)


def test_commit_applies_once_and_is_judged_active() -> None:
    etcd, _lease = _world()
    seen = _kv(etcd)
    txn = fd.commit_txn(L, AGENT, seen, TGT, 4)
    result = etcd.txn(txn, 1.0)
    assert fd.judge(txn, "commit", MOVE, result)[0] is Outcome.ACTIVE
    assert fd.decode_agent(_kv(etcd).value) == fd.AgentEntry(host_id=TGT, epoch=4)
    again = etcd.txn(txn, 1.0)  # a duplicate of the same request: its compare fails, its read names the target
    assert not again.succeeded and fd.judge(txn, "commit", MOVE, again)[0] is Outcome.ACTIVE


def test_a_fence_stops_a_commit_still_on_its_way() -> None:
    etcd, _lease = _world()
    commit = fd.commit_txn(L, AGENT, _kv(etcd), TGT, 4)  # sent; its reply is lost; not applied yet
    fence = fd.fence_txn(L, AGENT, _kv(etcd))
    fenced = etcd.txn(fence, 1.0)
    assert fd.judge(fence, "fence", MOVE, fenced)[0] is Outcome.NEVER
    late = etcd.txn(commit, 2.0)
    assert not late.succeeded and fd.judge(commit, "commit", MOVE, late)[0] is Outcome.NEVER
    assert fd.decode_agent(_kv(etcd).value).names(SRC, 3)


def test_a_fence_after_the_commit_applied_answers_active() -> None:
    """The bug the fleet simulation found: a fence that rewrote an entry already
    naming the target was judged 'never', and the source ran beside the target."""
    etcd, _lease = _world()
    commit = fd.commit_txn(L, AGENT, _kv(etcd), TGT, 4)
    etcd.txn(commit, 1.0)  # applied; its reply lost
    fence = fd.fence_txn(L, AGENT, _kv(etcd))
    result = etcd.txn(fence, 2.0)
    assert result.succeeded
    assert fd.judge(fence, "fence", MOVE, result)[0] is Outcome.ACTIVE


def test_a_commit_to_a_target_whose_lease_is_gone_fails() -> None:
    etcd, _lease = _world()
    etcd.expire(100.0)
    assert etcd.get(L.host(TGT)) is None
    commit = fd.commit_txn(L, AGENT, _kv(etcd), TGT, 4)
    result = etcd.txn(commit, 100.0)
    assert not result.succeeded and fd.judge(commit, "commit", MOVE, result)[0] is Outcome.NEVER


def test_takeover_only_once_the_holders_key_is_gone() -> None:
    etcd, _lease = _world()
    src_lease = etcd.grant(10, 0.0)
    etcd.txn(fd.DirTxn((), (fd.register_ops(L, fd.HostEntry(host_id=SRC, address="s:1"), src_lease),), ()), 0.0)
    assert etcd.keepalive(src_lease, 5.0) == 10  # lives until 15
    assert not etcd.txn(fd.takeover_txn(L, AGENT, _kv(etcd), OTHER, 4), 12.0).succeeded
    assert etcd.get(L.host(TGT)) is None  # the target's lease (granted at 0, never renewed) is gone
    assert etcd.keepalive(src_lease, 15.5) == 0
    take = fd.takeover_txn(L, AGENT, _kv(etcd), OTHER, 4)
    assert etcd.txn(take, 15.5).succeeded
    assert fd.decode_agent(_kv(etcd).value).names(OTHER, 4)
    assert not etcd.txn(take, 15.6).succeeded  # once: the entry changed


def test_may_run_needs_the_entry_to_name_this_host_at_its_epoch() -> None:
    etcd, _lease = _world()
    kv = _kv(etcd)
    assert fd.may_run(kv, SRC, 3)
    assert not fd.may_run(kv, SRC, 2)  # a restored host holding an older epoch
    assert not fd.may_run(kv, TGT, 3)
    assert not fd.may_run(None, SRC, 3)


def test_docs_show_the_judge_table() -> None:
    assert fd.describe_judge_table() in (ROOT / "docs" / "fleet.md").read_text()
