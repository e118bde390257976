"""What callers rely on of the journal's value classes (every event kind,
``Record``, ``Query``) and the store's (manifest, ring entry, gc report):
equality, hashing, repr, frozen-ness, keyword-only construction, slots,
copying and pickling, as ``@dataclass(frozen=True, slots=True,
kw_only=True)`` gives them (they were made with it; core/frozen.py makes
them now, at no cost at import)."""

from __future__ import annotations

import copy
import dataclasses
import pickle
from typing import Any

import pytest

from capsulefs.core.capsule.format import FileEntry, Holder, Manifest
from capsulefs.core.journal.events import (
    KINDS,
    AssistantMessage,
    Attachment,
    Event,
    MemoryEdit,
    ModelSwitch,
    Note,
    Reasoning,
    System,
    ToolCall,
    ToolResult,
    ToolsOffered,
    UnknownEvent,
    UserMessage,
    WorkspaceUpdate,
    event_from_fields,
)
from capsulefs.core.journal.query import Query
from capsulefs.core.journal.record import Record
from capsulefs.core.journal.ring import Entry
from capsulefs.core.store.host_store import GcReport

SHA = "ab" * 32
HOST = "H" * 52

#: One instance of each class, its fields in their order (what repr, eq and hash follow) and its repr.
SAMPLES: list[tuple[Any, tuple[Any, ...], str]] = [
    (UserMessage(text="hi"), ("hi",), "UserMessage(text='hi')"),
    (AssistantMessage(text="yes", model="m"), ("yes", None, "m"),
     "AssistantMessage(text='yes', provider=None, model='m')"),
    (Reasoning(provider="p", model="m", payload_format="f", data={"s": 1}), ("p", "m", "f", {"s": 1}, None),
     "Reasoning(provider='p', model='m', payload_format='f', data={'s': 1}, text=None)"),
    (ToolCall(call_id="c", name="t", arguments={"a": [1]}), ("c", "t", {"a": [1]}, None, None),
     "ToolCall(call_id='c', name='t', arguments={'a': [1]}, provider=None, model=None)"),
    (ToolResult(call_id="c", content="out", is_error=True), ("c", "out", True),
     "ToolResult(call_id='c', content='out', is_error=True)"),
    (MemoryEdit(blob=SHA), (None, SHA), f"MemoryEdit(text=None, blob='{SHA}')"),
    (WorkspaceUpdate(changes={"a.txt": None}), ({"a.txt": None},), "WorkspaceUpdate(changes={'a.txt': None})"),
    (ModelSwitch(provider="openai", model="gpt"), ("openai", "gpt"), "ModelSwitch(provider='openai', model='gpt')"),
    (Note(text="n"), ("n",), "Note(text='n')"),
    (System(text="s"), ("s",), "System(text='s')"),
    (ToolsOffered(tools=({"name": "t"},)), (({"name": "t"},),), "ToolsOffered(tools=({'name': 't'},))"),
    (Attachment(blob=SHA, media_type="image/png", size=3), (SHA, "image/png", 3, None, None),
     f"Attachment(blob='{SHA}', media_type='image/png', size=3, name=None, call_id=None)"),
    (UnknownEvent(unknown_kind="x.y", fields_={"k": 1}), ("x.y", {"k": 1}),
     "UnknownEvent(unknown_kind='x.y', fields_={'k': 1})"),
    (Query(kinds=("note",), tail=3), (("note",), None, None, None, False, 3),
     "Query(kinds=('note',), since_ms=None, until_ms=None, grep=None, failed=False, tail=3)"),
]
NOTE = Note(text="n")
RECORD = Record(id="0" * 24, machine=HOST, seq=1, clock=2, prev=None, time="2026-12-07T10:00:00.000Z", event=NOTE)
LINE = (b'{"clock":2,"id":"000000000000000000000000","kind":"note","machine":"' + HOST.encode()
        + b'","prev":null,"seq":1,"text":"n","time":"2026-12-07T10:00:00.000Z","v":1}')
SAMPLES.append((RECORD, ("0" * 24, HOST, 1, 2, None, "2026-12-07T10:00:00.000Z", NOTE, LINE),
                f"Record(id='{'0' * 24}', machine='{HOST}', seq=1, clock=2, prev=None, "
                f"time='2026-12-07T10:00:00.000Z', event=Note(text='n'), line={LINE!r})"))

HOLDER = Holder(host=HOST, epoch=2)
ENTRY = FileEntry(sha256=SHA, size=5)
SAMPLES += [
    (ENTRY, (SHA, 5), f"FileEntry(sha256='{SHA}', size=5)"),
    (HOLDER, (HOST, 2), f"Holder(host='{HOST}', epoch=2)"),
    (Manifest(agent_id="0" * 32, name="a", holder=HOLDER, files={"memory/working_memory.md": ENTRY}),
     ("0" * 32, "a", HOLDER, {"memory/working_memory.md": ENTRY}, {}),
     f"Manifest(agent_id='{'0' * 32}', name='a', holder={HOLDER!r}, files={{'memory/working_memory.md': {ENTRY!r}}}, "
     "extra={})"),
    (Entry(pos=1, offset=2, ino=3, data=b"x"), (1, 2, 3, b"x"), "Entry(pos=1, offset=2, ino=3, data=b'x')"),
    (GcReport(removed=1, freed=2, kept=3), (1, 2, 3), "GcReport(removed=1, freed=2, kept=3)"),
]


def _ids() -> list[str]:
    return [type(obj).__name__ for obj, _, _ in SAMPLES]


def test_every_kind_has_a_sample() -> None:
    assert set(KINDS.values()) | {UnknownEvent} <= {type(obj) for obj, _, _ in SAMPLES}


@pytest.mark.parametrize(("obj", "values", "text"), SAMPLES, ids=_ids())
def test_repr_equality_and_hash(obj: Any, values: tuple[Any, ...], text: str) -> None:
    assert repr(obj) == text
    twin = copy.copy(obj)
    assert twin is not obj and twin == obj and not twin != obj
    assert obj.__eq__(object()) is NotImplemented and obj != values
    assert type(obj).__match_args__ == (("removed", "freed", "kept") if type(obj) is GcReport else ())
    try:
        expected = hash(values)
    except TypeError:  # a field holds a dict or list: the object is unhashable as its fields are
        with pytest.raises(TypeError):
            hash(obj)
    else:
        assert hash(obj) == expected == hash(twin)
        assert {obj, twin} == {obj}


@pytest.mark.parametrize(("obj", "values", "text"), SAMPLES, ids=_ids())
def test_frozen_slotted(obj: Any, values: tuple[Any, ...], text: str) -> None:
    assert not hasattr(obj, "__dict__")
    field = text[text.index("(") + 1:text.index("=")]
    before = getattr(obj, field)
    with pytest.raises(dataclasses.FrozenInstanceError, match=f"cannot assign to field '{field}'"):
        setattr(obj, field, "other")
    with pytest.raises(dataclasses.FrozenInstanceError, match=f"cannot delete field '{field}'"):
        delattr(obj, field)
    with pytest.raises((AttributeError, TypeError)):  # (TypeError: what a slots=True dataclass raised)
        obj.something_new = 1
    with pytest.raises(AttributeError):  # FrozenInstanceError is one: callers catching that still do
        setattr(obj, field, "other")
    assert getattr(obj, field) is before


@pytest.mark.parametrize(("obj", "values", "text"), SAMPLES, ids=_ids())
def test_copies_and_pickles(obj: Any, values: tuple[Any, ...], text: str) -> None:
    for twin in (copy.copy(obj), copy.deepcopy(obj), pickle.loads(pickle.dumps(obj))):
        assert type(twin) is type(obj) and twin == obj and repr(twin) == text


def test_keyword_only() -> None:
    with pytest.raises(TypeError):
        Note("n")  # type: ignore[misc]
    with pytest.raises(TypeError):
        UserMessage()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Note(text="n", extra=1)  # type: ignore[call-arg]


def test_gc_report_by_position() -> None:
    report = GcReport(1, 2, 3)
    assert report == GcReport(removed=1, freed=2, kept=3)
    match report:
        case GcReport(removed, freed, kept):
            assert (removed, freed, kept) == (1, 2, 3)
        case _:
            pytest.fail("GcReport does not match by position")


def test_kinds_differ_with_equal_fields() -> None:
    assert Note(text="x") != System(text="x") and Note(text="x") != UserMessage(text="x")
    assert Note(text="x") != Note(text="y")
    assert isinstance(Note(text="x"), Event) and Event() == Event()


def test_defaults_and_payload() -> None:
    assert UnknownEvent(unknown_kind="k").fields_ == {}
    assert UnknownEvent(unknown_kind="k").fields_ is not UnknownEvent(unknown_kind="k").fields_
    assert AssistantMessage(text="t").payload() == {"text": "t"}  # optional fields left out when unset
    assert ToolResult(call_id="c", content="").payload() == {"call_id": "c", "content": "", "is_error": False}
    assert event_from_fields("note", {"text": "n"}) == NOTE
    assert Record.from_line(LINE) == RECORD and RECORD.line == LINE
    manifest = Manifest(agent_id="0" * 32, name="a", holder=HOLDER, files={})
    assert manifest.extra == {} and manifest.extra is not Manifest(agent_id="0" * 32, name="a", holder=HOLDER,
                                                                    files={}).extra
