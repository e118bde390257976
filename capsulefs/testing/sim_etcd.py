"""A simulated etcd for the fleet simulation (:mod:`.fleet_sim`) and the unit
tests of the directory's Txns: keys with create/mod revisions, leases that
expire on its own clock, and Txns with compares, applied as etcd applies
them; it counts the requests a fleet makes of it (``ops``).
"""

from __future__ import annotations

import itertools
from collections import Counter

from capsulefs.core.fleet import directory as fd
from capsulefs.core.fleet.etcd import (
    Compare,
    KeyValue,
    Op,
    Put,
    PutResult,
    Range,
    RangeResult,
    Result,
    Target,
    TxnResult,
)

__all__ = ["SimEtcd"]


class SimEtcd:
    """etcd's key-value store and leases, evaluating the same Compare/Put/Range values."""

    def __init__(self, rate: float = 1.0) -> None:
        self.rate = rate
        self.revision = 1
        self.kv: dict[bytes, KeyValue] = {}
        self.leases: dict[int, tuple[float, int]] = {}  # id -> (expiry on etcd's clock, ttl)
        self.lease_keys: dict[int, set[bytes]] = {}
        self.ids = itertools.count(1000)
        self.ops: Counter[str] = Counter()  # requests served, by kind

    def clock(self, now: float) -> float:
        return now * self.rate

    def expire(self, now: float) -> list[int]:
        t = self.clock(now)
        gone = [lid for lid, (expiry, _ttl) in self.leases.items() if t > expiry]
        for lid in gone:
            self._drop_lease(lid)
        return gone

    def _drop_lease(self, lid: int) -> None:
        del self.leases[lid]
        keys = self.lease_keys.pop(lid, set())
        if keys:
            self.revision += 1
            for k in keys:
                self.kv.pop(k, None)

    def grant(self, ttl: int, now: float) -> int:
        self.ops["grant"] += 1
        lid = next(self.ids)
        self.leases[lid] = (self.clock(now) + ttl, ttl)
        return lid

    def keepalive(self, lid: int, now: float) -> int:
        self.ops["keepalive"] += 1
        self.expire(now)
        if lid not in self.leases:
            return 0
        ttl = self.leases[lid][1]
        self.leases[lid] = (self.clock(now) + ttl, ttl)
        return ttl

    def get(self, key: bytes) -> KeyValue | None:
        return self.kv.get(key)

    def _holds(self, c: Compare) -> bool:
        kv = self.kv.get(c.key)
        match c.target:
            case Target.MOD:
                have: int | bytes = 0 if kv is None else kv.mod_revision
            case Target.CREATE:
                have = 0 if kv is None else kv.create_revision
            case Target.VERSION:
                have = 0 if kv is None else kv.version
            case Target.LEASE:
                have = 0 if kv is None else kv.lease
            case Target.VALUE:
                if kv is None:
                    return False
                have = kv.value
        match c.result:
            case Result.EQUAL:
                return have == c.value
            case Result.NOT_EQUAL:
                return have != c.value
            case Result.GREATER:
                return have > c.value  # type: ignore[operator]
            case Result.LESS:
                return have < c.value  # type: ignore[operator]
        raise AssertionError(c)

    def _apply(self, op: Op, revision: int) -> RangeResult | PutResult:
        match op:
            case Range(key=key):
                kv = self.kv.get(key)
                kvs = () if kv is None else (kv,)
                return RangeResult(revision=self.revision, kvs=kvs, count=len(kvs), more=False)
            case Put(key=key, value=value, lease=lease):
                if lease and lease not in self.leases:
                    raise AssertionError("a put under a lease that is gone")  # etcd refuses it; we never do it
                old = self.kv.get(key)
                if old is not None and old.lease:
                    self.lease_keys.get(old.lease, set()).discard(key)
                self.kv[key] = KeyValue(key=key, value=value, mod_revision=revision, lease=lease,
                                        create_revision=revision if old is None else old.create_revision,
                                        version=1 if old is None else old.version + 1)
                if lease:
                    self.lease_keys.setdefault(lease, set()).add(key)
                return PutResult(revision=revision, prev_kv=None)
        raise AssertionError(op)

    def txn(self, t: fd.DirTxn, now: float) -> TxnResult:
        self.ops["txn"] += 1
        self.expire(now)
        ok = all(self._holds(c) for c in t.compare)
        ops = t.success if ok else t.failure
        writes = any(isinstance(op, Put) for op in ops)
        revision = self.revision + 1 if writes else self.revision
        responses = tuple(self._apply(op, revision) for op in ops)
        self.revision = revision
        return TxnResult(revision=revision, succeeded=ok, responses=responses)

    def read(self, keys: list[bytes], now: float) -> list[KeyValue | None]:
        """One request reading several keys (a Txn of Ranges, at most 128 per request)."""
        self.ops["read"] += (len(keys) + 127) // 128
        self.ops["keys_read"] += len(keys)
        self.expire(now)
        return [self.kv.get(k) for k in keys]
