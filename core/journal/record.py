"""A journal line: one :class:`Record`, an envelope (who wrote it, where it
sits in that writer's hash chain, its Lamport clock) around one event of
:mod:`capsulefs.core.journal.events`, written as canonical JSON (sorted
keys, no spaces, UTF-8), so its sha256 is its identity and the next line of
the same machine chains to it. The append path writes a stamped record's
line straight from the event's fields (:func:`_line_writer`), the same
bytes as ``canonical_json(record.to_json())``.

Line layout (every key at the top level of one JSON object)::

    v        int     event schema version, EVENT_VERSION (a greater one: kept as unknown)
    id       str     unique id of the event (random, 24 hex)
    machine  str     host id of the writer
    seq      int     1, 2, 3... per machine, no gaps
    clock    int     Lamport clock: > every clock the writer had seen
                     (v, seq and clock: integers from 1 to format.MAX_INT, 2**53-1)
    prev     str|null  sha256 hex of the previous line (without newline) of the
                     same machine; null for that machine's first line
    time     str     writer's wall clock, UTC ISO-8601 with ms; informational
    kind     str     one of KINDS (or a newer kind, kept verbatim)
    ...              the kind's own fields, listed on each class of events.py
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from ..capsule.format import check_host_id, check_int, check_sha256, load_json_object
from ..errors import FormatError
from ..frozen import Frozen
from .events import (
    _CANONICAL,
    _KIND_RE,
    ENVELOPE,
    EVENT_VERSION,
    Event,
    UnknownEvent,
    _need_str,
    _payload_fields,
    canonical_json,
    event_from_fields,
    line_hash,
)

_ID_RE = re.compile(r"[0-9a-f]{8,64}")
_HEX_DIGITS = "0123456789abcdef"


def _line_encoder() -> Any:
    """The C encoder behind ``_CANONICAL``, made once (``JSONEncoder.encode``
    makes a new one per call), for the journal's stamped lines; None where
    the C accelerator is missing. Without circular-reference markers: a
    payload that contains itself fails with RecursionError instead."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # pragma: no cover - CPython always has it
        return None
    c = _CANONICAL
    return make(None, c.default, json.encoder.encode_basestring, None, c.key_separator, c.item_separator,
                True, False, False)


_LINE_ENCODER = _line_encoder()
_QUOTE = json.encoder.encode_basestring  # the C function where CPython has it: a str as a JSON string


def _encode_value(value: Any) -> str:
    """One value of a stamped line, canonical (a str the common case)."""
    if type(value) is str:
        return _QUOTE(value)
    return "".join(_LINE_ENCODER(value, 0)) if _LINE_ENCODER is not None else _CANONICAL.encode(value)


@functools.cache
def _line_writer(cls: type) -> Any:
    """A function that writes the canonical line of a stamped event of
    ``cls`` straight from its fields, for the journal's append path: the
    same bytes as ``canonical_json(record.to_json())`` (the tests hold the
    two equal for every kind), without a dict to build and sort per line.
    Its keys are sorted once, here. None for a class it cannot serve: an
    unknown kind (its fields are data), or fields named like the envelope.

    The function takes (event, id, machine, seq, clock, prev, time): ``id``
    checked hex (it is written as it is), seq and clock ints, prev None or
    a str, machine and time str. Generated as source once per class, as
    dataclasses makes its methods."""
    if cls is UnknownEvent or not issubclass(cls, Event) or cls.payload is not Event.payload:
        return None
    payload = _payload_fields(cls)  # type: ignore[arg-type]  # a class is hashable
    if any(name in ENVELOPE or not name.isidentifier() for name, _ in payload):
        return None
    # The line is one f-string in which each member starts with its comma
    # (the first is cut). Its literal text holds only the JSON of the keys
    # (identifiers) and the kind; its expressions hold names, no quotes.
    if not _KIND_RE.fullmatch(cls.KIND):  # pragma: no cover - every kind is a plain name
        return None
    scope: dict[str, Any] = {"_q": _QUOTE, "_e": _encode_value, "_null": "null", "_nothing": ""}
    envelope = {
        "v": str(EVENT_VERSION),
        "id": '"{id}"',  # checked hex: written as it is
        "machine": "{_q(machine)}",
        "seq": "{seq}",
        "clock": "{clock}",
        "prev": "{_null if prev is None else _q(prev)}",
        "time": "{_q(time)}",
        "kind": f'"{cls.KIND}"',
    }
    optional = {name for name, opt in payload if opt}
    members = []
    for key in sorted([*envelope, *(name for name, _ in payload)]):
        value = f"(_q(f_{key}) if type(f_{key}) is str else _e(f_{key}))"
        if key in envelope:
            members.append(f',"{key}":{envelope[key]}')
        elif key in optional:  # left out when None, as Event.payload does
            scope[f"h_{key}"] = f',"{key}":'
            members.append(f"{{_nothing if f_{key} is None else h_{key} + {value}}}")
        else:
            members.append(f',"{key}":{{{value}}}')
    text = "".join(members)
    if "'" in text or "\\" in text:  # pragma: no cover - keys are identifiers, kinds plain names
        return None
    source = "\n".join([
        "def write(event, id, machine, seq, clock, prev, time):",
        *(f"    f_{name} = event.{name}" for name, _ in payload),
        f"    line = f'{text}'",
        "    return ('{' + line[1:] + '}').encode()",
    ]) + "\n"
    exec(compile(source, f"<line writer of {cls.__name__}>", "exec"), scope)  # noqa: S102 - our own source
    return scope["write"]


def _fill(rec: "Record", id: str, machine: str, seq: int, clock: int, prev: str | None, time: str,
          event: Event, line: bytes) -> None:
    """Set a record's fields (a frozen value: core/frozen.py), once for the
    checked constructor and the stamper's fast path."""
    _set = object.__setattr__
    _set(rec, "id", id)
    _set(rec, "machine", machine)
    _set(rec, "seq", seq)
    _set(rec, "clock", clock)
    _set(rec, "prev", prev)
    _set(rec, "time", time)
    _set(rec, "event", event)
    _set(rec, "line", line)


class Record(Frozen):
    """One journal line: the envelope plus its event. ``line`` is canonical."""

    __slots__ = ("id", "machine", "seq", "clock", "prev", "time", "event", "line")
    id: str
    machine: str
    seq: int
    clock: int
    prev: str | None
    time: str
    event: Event
    line: bytes  # canonical bytes, without newline; filled in by make/parse

    def __init__(
        self, *, id: str, machine: str, seq: int, clock: int, prev: str | None, time: str, event: Event,
        line: bytes = b"",
    ) -> None:
        if not isinstance(id, str) or not _ID_RE.fullmatch(id):
            raise FormatError(f"event id {id!r} is not 8-64 lowercase hex digits")
        check_host_id(machine)
        check_int(seq, "event seq", low=1)
        check_int(clock, "event clock", low=1)
        if prev is not None:
            check_sha256(prev, "event prev")
        _need_str(time, "event time")
        _fill(self, id, machine, seq, clock, prev, time, event, line)
        if not line:
            object.__setattr__(self, "line", canonical_json(self.to_json()))

    @classmethod
    def stamped(
        cls, event: Event, *, id: str, machine: str, seq: int, clock: int, prev: str | None, time: str
    ) -> "Record":
        """The record a journal stamps (``ChainState.plan``): the same record
        as the constructor gives, built with fewer checks because the stamper
        made the envelope itself: seq and clock counted up from the file's
        (positive ints), prev the sha256 hex it computed (or None), time from
        ``format_time``, machine checked once per group. Only ``id``, which
        comes from the caller's ``new_id``, is checked, and ``event`` must be
        an Event (every Event validated itself when it was made)."""
        # _ID_RE's test without the regex engine (one less thing to bring
        # back into the cache after the previous append's device wait).
        if type(id) is not str or not 8 <= len(id) <= 64 or id.strip(_HEX_DIGITS):
            raise FormatError(f"event id {id!r} is not 8-64 lowercase hex digits")
        if not isinstance(event, Event):
            raise FormatError(f"cannot stamp {type(event).__name__}: not an event")
        write = _line_writer(type(event))  # type: ignore[arg-type]  # a class is hashable
        if write is not None:  # (the common case: a kind of this version)
            line = write(event, id, machine, seq, clock, prev, time)
        else:
            doc = event.payload()  # a new dict on every call
            doc["v"] = EVENT_VERSION
            doc["id"] = id
            doc["machine"] = machine
            doc["seq"] = seq
            doc["clock"] = clock
            doc["prev"] = prev
            doc["time"] = time
            doc["kind"] = event.kind
            line = canonical_json(doc) if _LINE_ENCODER is None else "".join(_LINE_ENCODER(doc, 0)).encode()
        rec = object.__new__(cls)
        _fill(rec, id, machine, seq, clock, prev, time, event, line)
        return rec

    @property
    def kind(self) -> str:
        return self.event.kind

    @property
    def order(self) -> tuple[int, str, int]:
        """The journal's sort key: (clock, machine, seq)."""
        return (self.clock, self.machine, self.seq)

    @property
    def digest(self) -> str:
        return line_hash(self.line)

    def to_json(self) -> dict[str, Any]:
        doc = dict(self.event.payload())
        doc.update(
            v=EVENT_VERSION,
            id=self.id,
            machine=self.machine,
            seq=self.seq,
            clock=self.clock,
            prev=self.prev,
            time=self.time,
            kind=self.event.kind,
        )
        return doc

    @classmethod
    def from_line(cls, line: bytes) -> "Record":
        """Parse one journal line (without newline). Keeps unknown kinds.

        The line must be canonical: re-encoding it gives the same bytes,
        because the chain hashes exact bytes.
        """
        doc = load_json_object(line, "journal line")
        missing = [k for k in ENVELOPE if k not in doc]
        if missing:
            raise FormatError(f"journal line lacks {', '.join(missing)}")
        if canonical_json(doc) != line:
            raise FormatError("journal line is not canonical JSON (sorted keys, no spaces, UTF-8)")
        check_int(doc["v"], "journal line version v", low=1)
        payload = {k: v for k, v in doc.items() if k not in ENVELOPE}
        if doc["v"] > EVENT_VERSION:
            event: Event = UnknownEvent(unknown_kind=str(doc["kind"]), fields_=payload)
        else:
            event = event_from_fields(doc["kind"], payload, strict=False)
        return cls(
            id=doc["id"],
            machine=doc["machine"],
            seq=doc["seq"],
            clock=doc["clock"],
            prev=doc["prev"],
            time=doc["time"],
            event=event,
            line=line,
        )
