"""Fuzz targets: the parsers of outside JSON (manifest, spec, snapshot, holder
record, journal lines and drafts, whole journals) and the journal merge.

Each ``run`` parses as the outside input reaches capsulefs and, when the
input is accepted, checks what a reader relies on (an AssertionError is a
finding, like any exception that is not a CapsuleError):

  * holds (a peer's claims): what is accepted writes back to claims that
    parse the same.
  * manifest, spec, snapshot, holder record: what is accepted writes back
    to bytes that parse to the same thing; a manifest lists only the
    capsule's tree.
  * journal line: a line ``Record.from_line`` accepts has the envelope the
    fast reader (``envelope``) finds.
  * journal draft (a write through the mount, ``capsulefs append``): every
    accepted draft stamps into a line that reads back as the same record
    (an accepted write never poisons the journal).
  * journal file: verify never raises; a journal that verifies merges with
    itself into itself.
  * merge (two journals, split at the first NUL byte, which no journal line
    holds): the fast merge equals the reference on everything it accepts
    whose every envelope the reference reads; ``merge_bytes`` refuses with
    a CapsuleError or gives a merge that is commutative and idempotent and
    absorbs both inputs.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path

from capsulefs.core.capsule import format as fmt
from capsulefs.core.errors import CapsuleError
from capsulefs.core.journal.events import AssistantMessage, Note, ToolCall, UnknownEvent, UserMessage
from capsulefs.core.journal.record import Record
from capsulefs.core.store import lifecycle as lc
from capsulefs.core.store.holder import HolderRecord, HolderState
from capsulefs.core.journal.file import parse_draft_lines
from capsulefs.core.journal.chain import ChainState
from capsulefs.core.journal.envelope_index import Unreadable, fast_merge, merge_bytes
from capsulefs.core.journal.lines import (
    ChainError,
    check_journal_bytes,
    envelope,
    join_lines,
    merge,
    split_lines,
    verify_lines,
)
from capsulefs.core.capsule.spec import default_spec, parse_spec, spec_bytes

from . import Target

HOST = "FUZZHOSTAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
_SHA = "5891b5b522d5df086d0ff0b110fbd9d21bb4fc7163af34d08286a2e846f6be03"


# -- seeds -------------------------------------------------------------------------


def _manifest_seeds() -> list[bytes]:
    files = {path: fmt.FileEntry(sha256=_SHA, size=i) for i, path in enumerate(fmt.REQUIRED_FILES)}
    files[fmt.blob_path(_SHA)] = fmt.FileEntry(sha256=_SHA, size=2**53 - 1)
    m = fmt.Manifest(agent_id="a" * 32, name="fuzzy", holder=fmt.Holder(host=HOST, epoch=7), files=files,
                     extra={"x-note": {"nested": [1, 2.5, None, True, "é"]}})
    return [m.to_bytes(), m.with_files({}).to_bytes()]


def _spec_seeds() -> list[bytes]:
    full = {**default_spec(["python", "-m", "agent"]), "env": {"LANG": "C.UTF-8", "MODE": "x"},
            "secrets": ["OPENAI_API_KEY"], "setup": [["pip", "install", "x"]], "packages": ["ripgrep"],
            "x-extra": {"depth": [[[1]]], "n": 12345678901234567890}}
    return [spec_bytes(default_spec()), spec_bytes(full), spec_bytes(default_spec(None))]


def _snapshot_seeds() -> list[bytes]:
    return [fmt.snapshot_bytes({"src/main.py": _SHA, "README": "0" * 64}), fmt.snapshot_bytes({})]


def _holder_seeds() -> list[bytes]:
    held = HolderRecord(agent_id="b" * 32, state=HolderState.HELD, epoch=3, held_epoch=3, activated=(1, 3))
    moving = held.with_(state=HolderState.COMMITTING, epoch=4, peer=HOST, note="moving")
    gone = HolderRecord(agent_id="b" * 32, state=HolderState.REMOVED, epoch=3, activated=(1, 3),
                        note="removed from this host by an operator", kept="recovery/" + "b" * 32 + "/kept-e3-x")
    # (a record from before REMOVED was a state: REFUSED with the note, read as REMOVED)
    old = gone.body()
    del old["kept"]
    old["state"] = "refused"
    check = hashlib.sha256(json.dumps(old, sort_keys=True).encode()).hexdigest()
    forced = held.with_(forced=True, note="forced by operator: restored")
    return [held.to_bytes(), moving.to_bytes(), gone.to_bytes(), json.dumps({**old, "check": check}).encode(),
            forced.to_bytes()]


def _holds_seeds() -> list[bytes]:
    claims = [lc.Claim(agent_id="b" * 32, held=3, top=3, named=True), lc.Claim(agent_id="c" * 32, held=None, top=7)]
    return [json.dumps({"claims": lc.claims_to_wire(claims)}).encode(), b'{"claims": []}']


def _ids(prefix: int) -> "itertools.count[int]":
    return itertools.count(prefix << 32)


def _stamp(state: ChainState, machine: str, events: list, ids: "itertools.count[int]") -> list[bytes]:  # type: ignore[type-arg]
    recs = state.stamp(events, machine=machine, now=lambda: 1_764_684_000.0, new_id=lambda: f"{next(ids):024x}")
    return [r.line for r in recs]


def _events(tag: str) -> list:  # type: ignore[type-arg]
    return [
        UserMessage(text=f"{tag}: please look at src/f.py"),
        AssistantMessage(text='Sure, "quoted" {braces} [brackets]', provider="anthropic", model="m"),
        ToolCall(call_id=f"c-{tag}", name="read_file",
                 arguments={"path": "src/f.py", "clock": 5, "seq": {"seq": 2}, "deep": [[[{"x": None}]]]}),
        Note(text="é ✓ \U0001f600"),
        UnknownEvent(unknown_kind="hologram", fields_={"beam": [1, 2.5, {"x": None}]}),
    ]


def _two_journals() -> tuple[list[bytes], list[bytes]]:
    """Two copies of one journal that diverged after a shared start."""
    state = ChainState()
    shared = _stamp(state, "host-a", _events("a0"), _ids(1))
    b_state = ChainState()
    for line in shared:
        b_state.absorb(line)
    a = shared + _stamp(state, "host-a", _events("a1"), _ids(2))
    b = shared + _stamp(b_state, "host-b", _events("b1"), _ids(3))
    return a, b


def _line_seeds() -> list[bytes]:
    a, b = _two_journals()
    return a[:1] + a[2:4] + b[-3:]


def _draft_seeds() -> list[bytes]:
    return [
        b'{"kind":"user_message","text":"hi"}\n{"kind":"note","text":"n"}\n',
        json.dumps({"kind": "tool_call", "call_id": "c1", "name": "ls",
                    "arguments": {"p": "/", "n": [1, 2.5, -3e10], "d": {"e": None}}}).encode() + b"\n",
        b'{"kind":"memory_edit","text":"# notes\\n"}\n',
        json.dumps({"kind": "workspace_update", "changes": {"src/a.py": _SHA, "old.txt": None}}).encode() + b"\n",
        b'{"kind":"model_switch","provider":"anthropic","model":"claude-x"}\n',
    ]


def _journal_seeds() -> list[bytes]:
    a, b = _two_journals()
    return [join_lines(a), join_lines(b), join_lines(merge(a, b)), b""]


def _merge_seeds() -> list[bytes]:
    a, b = _two_journals()
    ja, jb = join_lines(a), join_lines(b)
    return [ja + b"\0" + jb, ja + b"\0" + ja, join_lines(a[:3]) + b"\0" + jb, b"\0" + jb]


# -- runs ---------------------------------------------------------------------------


def _manifest(data: bytes, _scratch: Path) -> None:
    m = fmt.Manifest.from_bytes(data)
    assert all(fmt.in_tree(path) for path in m.files), sorted(m.files)
    assert fmt.Manifest.from_bytes(m.to_bytes()) == m


def _spec(data: bytes, _scratch: Path) -> None:
    doc = parse_spec(data)
    assert parse_spec(spec_bytes(doc)) == doc


def _snapshot(data: bytes, _scratch: Path) -> None:
    files = fmt.parse_snapshot(data)
    assert fmt.parse_snapshot(fmt.snapshot_bytes(files)) == files


def _holder(data: bytes, _scratch: Path) -> None:
    rec = HolderRecord.from_bytes(data)
    assert HolderRecord.from_bytes(rec.to_bytes()) == rec


def _holds(data: bytes, _scratch: Path) -> None:
    """A peer's ``holds`` message (docs/wire.md): its claims, as the header's JSON."""
    claims = lc.claims_from_wire(fmt.load_json_object(data, "holds").get("claims"), "holds")
    assert lc.claims_from_wire(lc.claims_to_wire(list(claims.values())), "again") == claims


def _journal_line(data: bytes, _scratch: Path) -> None:
    try:
        rec = Record.from_line(data)
    except CapsuleError:
        envelope(data)  # must refuse with a CapsuleError too, or accept
        raise
    assert envelope(data) == (rec.order, rec.prev)


def _journal_draft(data: bytes, _scratch: Path) -> None:
    events = parse_draft_lines(data, "journal")
    ids = _ids(9)
    for line in _stamp(ChainState(), "host-z", events, ids):
        assert Record.from_line(line).line == line  # what was accepted reads back


def _journal_file(data: bytes, _scratch: Path) -> None:
    problems = check_journal_bytes(data)
    if problems:
        raise ChainError("journal does not verify", problems)
    lines = split_lines(data)
    assert verify_lines(lines, full=False) == []
    state = ChainState()
    for line in lines:
        state.absorb(line)
    assert merge_bytes(data, data) == data


def _readable(data: bytes) -> bool:
    """Whether the reference reads every line's envelope."""
    try:
        for line in split_lines(data):
            envelope(line)
    except CapsuleError:
        return False
    return True


def _merge(data: bytes, _scratch: Path) -> None:
    a, _nul, b = data.partition(b"\0")
    try:
        fast: bytes | None = b"".join(fast_merge(a, b))
    except Unreadable:
        fast = None
    try:
        ref: bytes | None = join_lines(merge(split_lines(a, "journal A"), split_lines(b, "journal B")))
    except CapsuleError:
        ref = None
    merged = merge_bytes(a, b)  # the reference's CapsuleError, when neither path accepts
    # The fast path reads envelopes, not whole lines: a line whose body is
    # broken (not JSON, a key twice) but whose envelope keys it finds once
    # each is merged as it stands (see core/journal/envelope_index.py); callers verify first.
    if _readable(a) and _readable(b):
        assert fast is None or fast == ref, "the fast merge accepted what the reference refuses, or differs from it"
        assert merged == ref
    assert merge_bytes(b, a) == merged, "not commutative"
    assert merge_bytes(merged, merged) == merged, "not idempotent"
    assert merge_bytes(merged, a) == merged == merge_bytes(b, merged), "does not absorb its inputs"


TARGETS = [
    Target("manifest", _manifest_seeds, _manifest),
    Target("spec", _spec_seeds, _spec),
    Target("snapshot", _snapshot_seeds, _snapshot),
    Target("holder_record", _holder_seeds, _holder),
    Target("holds_claims", _holds_seeds, _holds),
    Target("journal_line", _line_seeds, _journal_line),
    Target("journal_draft", _draft_seeds, _journal_draft),
    Target("journal_file", _journal_seeds, _journal_file),
    Target("journal_merge", _merge_seeds, _merge),
]
