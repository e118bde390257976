"""Builders for the journal tests: deterministic stamping, in-memory replicas."""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from capsulefs.core.journal.events import Event, Note, UnknownEvent, canonical_json
from capsulefs.core.journal.record import Record
from capsulefs.core.journal.chain import ChainState
from capsulefs.core.journal.file import Journal, open_journal
from capsulefs.core.journal.lines import join_lines, merge

T0 = 1_764_684_000.0  # a fixed wall clock for stamped times


def id_source(prefix: int = 0) -> Callable[[], str]:
    """Deterministic event ids: 24 hex digits, unique per source prefix."""
    counter = itertools.count(1)
    return lambda: f"{prefix:08x}{next(counter):016x}"


def fixed_now() -> float:
    return T0


def open_test_journal(path: str | os.PathLike[str], machine: str | None = "host-a", *, prefix: int = 0, **kw) -> Journal:
    path = os.fspath(path)
    kw.setdefault("recovery_dir", os.path.join(os.path.dirname(path), "recovery"))
    return open_journal(path, machine=machine, now=fixed_now, new_id=id_source(prefix), **kw)


@dataclass
class Replica:
    """One copy of a journal, held by one machine, in memory."""

    machine: str
    lines: list[bytes] = field(default_factory=list)
    state: ChainState = field(default_factory=ChainState)
    ids: Callable[[], str] = field(default_factory=lambda: id_source(0))

    def append(self, *events: Event) -> list[Record]:
        records = self.state.stamp(events, machine=self.machine, now=fixed_now, new_id=self.ids)
        self.lines.extend(r.line for r in records)
        return records

    def pull(self, other: "Replica") -> None:
        """Take every line of ``other`` (merge), as a sync would."""
        self.lines = merge(self.lines, other.lines)
        self.state = ChainState()
        for line in self.lines:
            self.state.absorb(line)

    def data(self) -> bytes:
        return join_lines(self.lines)


def replicas(n: int) -> list[Replica]:
    return [Replica(machine=f"host-{chr(ord('a') + i)}", ids=id_source(i + 1)) for i in range(n)]


def note(text: str) -> Note:
    return Note(text=text)


def future_event(kind: str = "hologram", **fields: object) -> UnknownEvent:
    """An event of a kind a newer capsulefs wrote."""
    return UnknownEvent(unknown_kind=kind, fields_=dict(fields) or {"beam": [1, 2, {"x": None}], "zeta": "é"})


def retext(line: bytes, **changes: object) -> bytes:
    """The same line with some fields changed, still canonical (a tampering)."""
    doc = json.loads(line)
    doc.update(changes)
    return canonical_json(doc)


def lines_of(records: Iterable[Record]) -> list[bytes]:
    return [r.line for r in records]


class LeaseClock:
    """The journal lease keeper's clock, moved only by the test (see
    :func:`lease_clock`): whether appends are "in a run" and when a lease
    is over no longer depend on how fast the machine runs the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
