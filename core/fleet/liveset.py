"""The fleet's gc of the blob tier, sans-IO: live sets, their pointers, marks, the gc's key.

Rules:
  * A host's **live set** is the set of blobs its manifests name (agents,
    snapshots, staging areas: exactly what local gc keeps). It is an object
    in the tier, ``PREFIX_capsulefs/live/<host_id>`` (:func:`live_key`):
    a header line, then the digests as 32 raw bytes each, strictly
    ascending (sha256 digests do not compress: raw bytes halve the hex).
    Its **pointer** in the directory, ``DIRPREFIX/live/<host_id>``, no
    lease (a set outlives its host's lease), says which generation is
    published, the object's sha256 and when the host last found the set
    current (``checked``, Unix seconds).
  * A **mark** ``PREFIX_capsulefs/marks/<sha256>`` is written by the gc
    with If-None-Match before it re-reads the sets and deletes the blob; it
    names the gc (``gc_id``). A mark whose gc no longer holds the
    directory's gc key is stale: that gc stopped acting before its lease
    could end (the lease timing argument), so the mark protects nothing.
  * The **gc key** ``DIRPREFIX/gc`` exists while one gc runs, under its
    lease, created by a Txn only if absent: one gc at a time.
  * Everything here is read back from another host: parsed strictly, within
    a size given by the caller, one :class:`LiveSetError` line naming the
    problem.

Theory of operation: capsulefs/fleet/live.py publishes the sets and checks
marks for the put path and the eviction rule; capsulefs/fleet/tiergc.py is
the gc. docs/fleet.md ("The fleet's gc of the blob tier") has the argument.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

from ..capsule.format import check_host_id, check_int, is_sha256, load_json_object
from ..errors import FormatError
from .directory import Layout
from .errors import FleetError

__all__ = [
    "GC_FORMAT", "LIVE_FORMAT", "MARK_FORMAT", "POINTER_FORMAT", "GcEntry", "LiveSet", "LiveSetError",
    "LivePointer", "decode_gc", "decode_mark", "decode_pointer", "encode_mark", "gc_key", "live_key",
    "live_prefix", "mark_key", "marks_prefix", "parse_live_set", "pointer_key", "pointers_prefix", "union",
]

LIVE_FORMAT = "capsulefs-live/1"
POINTER_FORMAT = "fleet-live/1"
MARK_FORMAT = "capsulefs-gc-mark/1"
GC_FORMAT = "fleet-gc/1"
MAX_HEADER = 1024  # bytes of a live set's header line
MAX_RECORD = 4096  # bytes of a pointer, a mark or the gc key
MAX_BLOBS = 1 << 26  # digests in one set (2 GiB of set): past any store; the caller's byte cap comes first
_MAGIC = LIVE_FORMAT.encode() + b"\n"
_TIER_DIR = "_capsulefs/"


class LiveSetError(FleetError, FormatError):
    """A live set, its pointer, a mark or the gc key is not one capsulefs writes."""


# -- where ------------------------------------------------------------------------------
def live_prefix(tier_prefix: str) -> str:
    return f"{tier_prefix}{_TIER_DIR}live/"


def live_key(tier_prefix: str, host_id: str) -> str:
    return live_prefix(tier_prefix) + check_host_id(host_id)


def marks_prefix(tier_prefix: str) -> str:
    return f"{tier_prefix}{_TIER_DIR}marks/"


def mark_key(tier_prefix: str, sha256: str) -> str:
    if not is_sha256(sha256):
        raise ValueError(f"not a sha256 hex digest: {str(sha256)[:80]!r}")
    return marks_prefix(tier_prefix) + sha256


def pointers_prefix(layout: Layout) -> bytes:
    return layout.prefix + b"live/"


def pointer_key(layout: Layout, host_id: str) -> bytes:
    return pointers_prefix(layout) + check_host_id(host_id).encode()


def gc_key(layout: Layout) -> bytes:
    return layout.prefix + b"gc"


# -- the set ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LiveSet:
    """One host's live set at one generation."""

    host_id: str
    generation: int  # grows with each set the host publishes
    blobs: frozenset[str]  # sha256 hex digests

    def encode(self) -> bytes:
        check_host_id(self.host_id)
        check_int(self.generation, "live set generation", low=1)
        digests = sorted(self.blobs)
        header = {"format": LIVE_FORMAT, "host_id": self.host_id, "generation": self.generation,
                  "count": len(digests)}
        return b"".join([_MAGIC, _canonical(header), b"\n", *(bytes.fromhex(d) for d in digests)])


def parse_live_set(data: bytes, *, limit: int) -> LiveSet:
    """A live set read from the tier; :class:`LiveSetError` if it is not one
    (more than ``limit`` bytes, a header that is not ours, digests not
    strictly ascending, a count that is not the body's). Time and memory in
    proportion to ``data``."""
    what = "live set"
    if len(data) > limit:
        raise LiveSetError(f"{what}: {len(data)} bytes, more than the {limit} allowed")
    if not data.startswith(_MAGIC):
        raise LiveSetError(f"{what}: does not start with {LIVE_FORMAT!r}")
    end = data.find(b"\n", len(_MAGIC), len(_MAGIC) + MAX_HEADER + 1)
    if end < 0:
        raise LiveSetError(f"{what}: no header line within {MAX_HEADER} bytes")
    doc = load_json_object(data[len(_MAGIC):end], f"{what} header", error=LiveSetError)
    if set(doc) != {"format", "host_id", "generation", "count"} or doc["format"] != LIVE_FORMAT:
        raise LiveSetError(f"{what} header: fields {sorted(doc)[:8]} are not those of {LIVE_FORMAT!r}")
    try:
        host_id = check_host_id(doc["host_id"])
        generation = check_int(doc["generation"], "live set generation", low=1)
        count = check_int(doc["count"], "live set count")
    except FormatError as exc:
        raise LiveSetError(f"{what} header: {exc}") from None
    body = memoryview(data)[end + 1:]
    if count > MAX_BLOBS or len(body) != 32 * count:
        raise LiveSetError(f"{what} of {host_id}: {len(body)} bytes of digests, not {count} x 32")
    blobs = []
    last = b""
    for i in range(count):
        d = bytes(body[32 * i:32 * i + 32])
        if d <= last:
            raise LiveSetError(f"{what} of {host_id}: digest {i} is not above the one before it")
        blobs.append(d.hex())
        last = d
    return LiveSet(host_id, generation, frozenset(blobs))


# -- its pointer in the directory ------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class LivePointer:
    host_id: str
    generation: int  # the set's generation in the tier
    count: int  # blobs in it
    sha256: str  # of the set object's bytes
    checked: int  # Unix seconds when the host last found the set current

    def __post_init__(self) -> None:
        check_host_id(self.host_id)
        check_int(self.generation, "live set generation", low=1)
        check_int(self.count, "live set count")
        check_int(self.checked, "live set time")
        if not is_sha256(self.sha256):
            raise FormatError(f"live set digest {str(self.sha256)[:80]!r} is not a sha256")

    def encode(self) -> bytes:
        return _canonical({"format": POINTER_FORMAT, "host_id": self.host_id, "generation": self.generation,
                           "count": self.count, "sha256": self.sha256, "checked": self.checked})


def decode_pointer(data: bytes) -> LivePointer:
    doc = _record(data, "live set pointer", POINTER_FORMAT, {"host_id", "generation", "count", "sha256", "checked"})
    try:
        return LivePointer(host_id=doc["host_id"], generation=doc["generation"], count=doc["count"],  # type: ignore[arg-type]
                           sha256=doc["sha256"], checked=doc["checked"])  # type: ignore[arg-type]
    except FormatError as exc:
        raise LiveSetError(f"live set pointer: {exc}") from None


# -- marks and the gc's key -------------------------------------------------------------------
def encode_mark(gc_id: str) -> bytes:
    return _canonical({"format": MARK_FORMAT, "gc_id": _check_gc_id(gc_id)})


def decode_mark(data: bytes) -> str:
    """The id of the gc that wrote this mark."""
    doc = _record(data, "gc mark", MARK_FORMAT, {"gc_id"})
    return _check_gc_id(doc["gc_id"])


@dataclass(frozen=True, slots=True, kw_only=True)
class GcEntry:
    gc_id: str  # 32 hex digits, new for each run
    by: str  # who runs it (printable, for a person: the host and pid)
    started: int  # Unix seconds

    def __post_init__(self) -> None:
        _check_gc_id(self.gc_id)
        if not isinstance(self.by, str) or not 0 < len(self.by) <= 200 or not self.by.isprintable():
            raise LiveSetError(f"gc key: 'by' {str(self.by)[:80]!r} is not 1-200 printable characters")
        try:
            check_int(self.started, "gc start time")
        except FormatError as exc:
            raise LiveSetError(f"gc key: {exc}") from None

    def encode(self) -> bytes:
        return _canonical({"format": GC_FORMAT, "gc_id": self.gc_id, "by": self.by, "started": self.started})


def decode_gc(data: bytes) -> GcEntry:
    doc = _record(data, "gc key", GC_FORMAT, {"gc_id", "by", "started"})
    return GcEntry(gc_id=doc["gc_id"], by=doc["by"], started=doc["started"])  # type: ignore[arg-type]


def _check_gc_id(value: object) -> str:
    if not isinstance(value, str) or len(value) != 32 or not set(value) <= set("0123456789abcdef"):
        raise LiveSetError(f"gc id {str(value)[:80]!r} is not 32 lowercase hex digits")
    return value


def _record(data: bytes, what: str, fmt: str, fields: set[str]) -> dict[str, object]:
    if len(data) > MAX_RECORD:
        raise LiveSetError(f"{what}: {len(data)} bytes, more than {MAX_RECORD}")
    doc = load_json_object(data, what, error=LiveSetError)
    if doc.get("format") != fmt or set(doc) != fields | {"format"}:
        raise LiveSetError(f"{what}: format {str(doc.get('format'))[:40]!r} with fields {sorted(doc)[:8]} "
                           f"is not {fmt!r} with {sorted(fields | {'format'})}")
    return doc


def _canonical(doc: dict[str, object]) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def union(sets: Iterable[LiveSet]) -> set[str]:
    out: set[str] = set()
    for s in sets:
        out |= s.blobs
    return out
