"""Appending to a journal file: stamping, durability bookkeeping, reopen, torn tails."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from journal_helpers import future_event, note, open_test_journal

from capsulefs.core.errors import FormatError
from capsulefs.core.journal.events import (
    AssistantMessage,
    Event,
    MemoryEdit,
    ModelSwitch,
    Note,
    Reasoning,
    System,
    ToolCall,
    ToolResult,
    UnknownEvent,
    UserMessage,
    WorkspaceUpdate,
    canonical_json,
    line_hash,
)
from capsulefs.core.journal.record import Record
from capsulefs.core.journal.recovery import TORN_SUFFIX
from capsulefs.core.journal.lines import split_lines, verify_lines


def test_append_stamps_chain_and_clock(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    with open_test_journal(path) as j:
        r1 = j.append(UserMessage(text="hello"))
        r2, r3 = j.append_many([note("a"), ToolCall(call_id="c1", name="ls", arguments={"p": {"q": [1]}})])
        assert (r1.seq, r1.clock, r1.prev) == (1, 1, None)
        assert (r2.seq, r2.clock, r2.prev) == (2, 2, line_hash(r1.line))
        assert (r3.seq, r3.clock, r3.prev) == (3, 3, line_hash(r2.line))
        assert j.size == path.stat().st_size and j.count == 3 and j.clock == 3
    data = path.read_bytes()
    assert data == r1.line + b"\n" + r2.line + b"\n" + r3.line + b"\n"
    for line in split_lines(data):
        assert Record.from_line(line).line == line  # canonical
    assert verify_lines(split_lines(data)) == []


def test_reopen_continues_the_chain(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    with open_test_journal(path) as j:
        first = j.append(note("one"))
    with open_test_journal(path, prefix=7) as j:
        assert j.tail("host-a") is not None and j.tail("host-a").seq == 1
        second = j.append(note("two"))
    assert (second.seq, second.clock, second.prev) == (2, 2, first.digest)
    assert verify_lines(split_lines(path.read_bytes())) == []


def test_a_second_writer_sees_the_first_ones_appends(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    a = open_test_journal(path, "host-a", prefix=1)
    b = open_test_journal(path, "host-b", prefix=2)
    with a, b:
        a.append(note("a1"))
        rb = b.append(note("b1"))  # b catches up with a's line before stamping
        assert rb.clock == 2
        a.append_many([note("a2"), note("a3")])
        rb2 = b.append(note("b2"))
        assert (rb2.seq, rb2.clock, rb2.prev) == (2, 5, rb.digest)
        assert a.refresh() == b.size == path.stat().st_size
    lines = split_lines(path.read_bytes())
    assert [json.loads(x)["machine"] for x in lines] == ["host-a", "host-b", "host-a", "host-a", "host-b"]
    assert verify_lines(lines) == []


def test_same_machine_two_handles_share_one_seq_run(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    with open_test_journal(path, prefix=1) as a, open_test_journal(path, prefix=2) as b:
        seqs = [a.append(note("x")).seq, b.append(note("y")).seq, a.append(note("z")).seq]
    assert seqs == [1, 2, 3]
    assert verify_lines(split_lines(path.read_bytes())) == []


def test_read_serves_whole_lines_only(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    with open_test_journal(path) as j:
        r = j.append(note("one"))
        assert j.read() == r.line + b"\n"
        assert j.read(5, 10) == (r.line + b"\n")[5:15]
        assert j.read(j.size) == b"" and j.read(0, 0) == b""
        with open(path, "ab") as f:
            f.write(b'{"half a line')
        assert j.read() == r.line + b"\n"  # never the bytes of an append in flight
        assert j.lines() == [r.line] and [x.line for x in j.records()] == [r.line]


def test_read_only_journal_refuses_appends(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    open_test_journal(path).close()
    with open_test_journal(path, None) as j, pytest.raises(ValueError, match="read-only"):
        j.append(note("x"))


def test_missing_journal_without_create(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        open_test_journal(tmp_path / "nope.jsonl", create=False)


def test_drafts_are_all_or_nothing(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    with open_test_journal(path) as j:
        good = b'{"kind":"user_message","text":"hi"}\n{"kind":"note","text":"n"}\n'
        assert [r.kind for r in j.append_drafts(good)] == ["user_message", "note"]
        before = path.read_bytes()
        for bad, word in [
            (b'{"kind":"note","text":"ok"}\n{"kind":"nope"}\n', "draft line 2"),
            (b'{"kind":"note","text":"ok"}\n{"kind":"note","text":"x","seq":3}\n', "stamped"),
            (b'{"kind":"note","text":"no newline"}', "whole lines"),
            (b"not json\n", "not valid JSON"),
            (b'{"kind":"note","text":"\\udc80"}\n', "lone UTF-16 surrogate"),
            (b'{"kind":"note","text":"' + "\udc80".encode("utf-8", "surrogatepass") + b'"}\n', "not UTF-8"),
            (b"[" * 50_000 + b"]" * 50_000 + b"\n", "nested too deeply"),
        ]:
            with pytest.raises(FormatError, match=word):
                j.append_drafts(bad)
        assert path.read_bytes() == before


def test_a_draft_built_in_python_with_a_non_finite_number_is_refused() -> None:
    from capsulefs.core.journal.events import parse_draft

    for value in (float("nan"), float("inf")):
        with pytest.raises(FormatError, match="numbers must be finite"):
            parse_draft({"kind": "note", "text": "x", "n": value})


def test_a_drafted_model_switch_reads_back_from_control_model() -> None:
    from capsulefs.core.journal.events import parse_draft

    # .control/model shows "provider:model" on one line and splits a write at its first ':'
    for provider, model in [("openai:x", "gpt"), ("openai", "gpt\n5"), ("open\x00ai", "gpt"), ("openai", "\x1b[31mred")]:
        with pytest.raises(FormatError, match="model_switch"):
            parse_draft({"kind": "model_switch", "provider": provider, "model": model})
    ev = parse_draft({"kind": "model_switch", "provider": "openrouter", "model": "meta/llama-3:70b"})
    assert (ev.provider, ev.model) == ("openrouter", "meta/llama-3:70b")  # type: ignore[attr-defined]


def test_unknown_kinds_are_kept_byte_for_byte(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    with open_test_journal(path) as j:
        r = j.append(future_event())
        j.append(note("after"))
    lines = split_lines(path.read_bytes())
    assert lines[0] == r.line
    rec = Record.from_line(lines[0])
    assert rec.kind == "hologram" and rec.line == lines[0]
    assert verify_lines(lines) == []


def test_appending_after_a_line_it_cannot_read_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    with open_test_journal(path) as j:
        j.append(note("one"))
    with open(path, "ab") as f:
        f.write(b"this is not a journal line\n")
    with pytest.raises(FormatError, match="line 2"):
        open_test_journal(path)


# -- torn tails --------------------------------------------------------------------


def _recovery_files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


def test_torn_tail_is_moved_aside_on_open(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "j.jsonl"
    rec_dir = tmp_path / "recovery"
    with open_test_journal(path) as j:
        r1 = j.append(note("kept"))
    tail = b'{"clock":2,"id":"0000000000000000000000ff","kind":"note","mach'
    with open(path, "ab") as f:
        f.write(tail)
    with caplog.at_level(logging.WARNING, logger="capsulefs.core.journal.follow"):
        with open_test_journal(path, recovery_dir=rec_dir) as j:
            assert path.read_bytes() == r1.line + b"\n"
            r2 = j.append(note("next"))
    assert (r2.seq, r2.prev) == (2, r1.digest)
    assert _recovery_files(rec_dir) == ["j.jsonl" + TORN_SUFFIX + "1"]
    assert (rec_dir / ("j.jsonl" + TORN_SUFFIX + "1")).read_bytes() == tail
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("torn tail" in m and str(rec_dir) in m and str(len(tail)) in m for m in warned)
    assert verify_lines(split_lines(path.read_bytes())) == []


def test_each_torn_tail_gets_its_own_recovery_file(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    rec_dir = tmp_path / "recovery"
    open_test_journal(path, recovery_dir=rec_dir).close()
    for garbage in (b"\0\0\0\0", b'{"partial'):
        with open(path, "ab") as f:
            f.write(garbage)
        open_test_journal(path, recovery_dir=rec_dir).close()
        assert path.read_bytes() == b""
    assert [(rec_dir / n).read_bytes() for n in _recovery_files(rec_dir)] == [b"\0\0\0\0", b'{"partial']


def test_torn_tail_left_by_another_writer_is_recovered_before_appending(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    rec_dir = tmp_path / "recovery"
    with open_test_journal(path, recovery_dir=rec_dir) as j:
        r1 = j.append(note("one"))
        with open(path, "ab") as f:  # another process died in the middle of its write
            f.write(b'{"clock":9')
        r2 = j.append(note("two"))
        assert path.read_bytes() == r1.line + b"\n" + r2.line + b"\n"
    assert _recovery_files(rec_dir) == ["j.jsonl" + TORN_SUFFIX + "1"]


def _big_journal(min_bytes: int) -> list[bytes]:
    """Two machines writing in turns, with nested keys that look like the envelope."""
    from journal_helpers import fixed_now, id_source

    from capsulefs.core.journal.chain import ChainState

    state, ids, lines, size = ChainState(), id_source(5), [], 0
    while size < min_bytes:
        for machine in ("host-a", "host-a", "host-b"):
            ev = note("x" * 300) if machine == "host-a" else ToolCall(
                call_id="c", name="t", arguments={"seq": 1, "clock": {"machine": "m"}})
            (rec,) = state.stamp([ev], machine=machine, now=fixed_now, new_id=ids)
            lines.append(rec.line)
            size += len(rec.line) + 1
    return lines


def test_opening_a_big_journal_catches_up_in_bulk_exactly(tmp_path: Path) -> None:
    from capsulefs.core.journal.follow import BULK_CATCH_UP
    from capsulefs.core.journal.chain import ChainState

    lines = _big_journal(2 * BULK_CATCH_UP)
    path = tmp_path / "j.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    one_by_one, bulk = ChainState(), ChainState()
    for line in lines:
        one_by_one.absorb(line)
    assert bulk.absorb_bulk(path.read_bytes())  # the vectorised path takes it all
    assert (bulk.tails, bulk.clock, bulk.count, bulk.last) == (
        one_by_one.tails, one_by_one.clock, one_by_one.count, one_by_one.last)
    with open_test_journal(path, "host-a", prefix=9) as j:
        assert (j.count, j.clock) == (one_by_one.count, one_by_one.clock) == (len(lines), len(lines))
        for machine in ("host-a", "host-b"):
            assert j.tail(machine) == one_by_one.tails[machine]
        r = j.append(note("next"))
    assert verify_lines(split_lines(path.read_bytes())) == []
    assert (r.seq, r.clock, r.prev) == (one_by_one.tails["host-a"].seq + 1, len(lines) + 1, one_by_one.tails["host-a"].digest)


def test_a_bad_line_in_a_big_journal_is_named(tmp_path: Path) -> None:
    from capsulefs.core.journal.follow import BULK_CATCH_UP

    lines = _big_journal(2 * BULK_CATCH_UP)
    lines[1000] = b"{broken"
    path = tmp_path / "j.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(FormatError, match="line 1001"):
        open_test_journal(path)


def test_threads_share_group_commits_and_a_bad_event_fails_alone(tmp_path: Path) -> None:
    import threading

    from capsulefs.core.journal.events import UnknownEvent

    path = tmp_path / "j.jsonl"
    results: dict[int, list[str]] = {}
    errors: list[BaseException] = []
    with open_test_journal(path) as j, open_test_journal(path, prefix=99) as other:

        def writer(k: int) -> None:
            target = other if k == 0 else j
            ids = []
            for i in range(100):
                ids.append(target.append(note(f"w{k}-{i}")).id)
                if k == 1 and i == 50:
                    try:
                        target.append(UnknownEvent(unknown_kind="Bad Kind"))  # type: ignore[arg-type]
                    except FormatError as exc:
                        errors.append(exc)
            results[k] = ids

        threads = [threading.Thread(target=writer, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert 1 <= j.commits + other.commits <= 800
    assert len(errors) == 1 and "kind" in str(errors[0])
    records = [Record.from_line(x) for x in split_lines(path.read_bytes())]
    assert len(records) == 800 and verify_lines([r.line for r in records]) == []
    assert sorted(r.id for r in records) == sorted(i for ids in results.values() for i in ids)
    for k in range(8):  # each writer's events are in its own order
        mine = [int(r.event.text.split("-")[1]) for r in records if r.event.text.startswith(f"w{k}-")]  # type: ignore[attr-defined]
        assert mine == list(range(100))


def test_a_journal_replaced_by_rename_is_followed(tmp_path: Path) -> None:
    import fcntl
    import os

    from capsulefs.core.errors import NotFoundError

    path = tmp_path / "j.jsonl"
    with open_test_journal(path) as j:
        j.append(note("old file"))
        # Someone replaces the file (holding its flock, as the protocol asks).
        new = tmp_path / "new.jsonl"
        with open_test_journal(new, "host-b", prefix=3) as other:
            other.append(note("b1"))
            other.append(note("b2"))
        fd = os.open(path, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(new, path)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
        r = j.append(note("after the rename"))
        assert (r.seq, r.clock, r.prev) == (1, 3, None)  # host-a's first line in this file
        lines = split_lines(path.read_bytes())
        assert len(lines) == 3 and verify_lines(lines) == []
        # Removed, again holding its flock (HostStore.remove_agent does so):
        # an appender under a lease checks nothing until it lets go of it.
        fd = os.open(path, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.unlink(path)
        os.close(fd)
        with pytest.raises(NotFoundError, match="removed"):
            j.append(note("lost?"))


def test_stamped_records_equal_constructed_ones() -> None:
    # Record.stamped (the journal's path) skips re-checking the envelope it
    # made; the record, line included, must be what the constructor gives.
    events = [
        UserMessage(text="h\u00e9llo \"quoted\" \\ \n\t\u2028 \U0001f600"),
        AssistantMessage(text="a", provider=None, model="m"),
        Reasoning(provider="p", model="m", payload_format="f", data={"z": 1, "a": [1.5, {"y": None, "b": True}]}),
        ToolCall(call_id="c", name="n", arguments={"b": 2, "a": {"d": "x", "c": "\u00fc"}}),
        ToolResult(call_id="c", content="out", is_error=True),
        MemoryEdit(blob="a" * 64),
        WorkspaceUpdate(changes={"b/c": None, "a": "b" * 64}),
        ModelSwitch(provider="p", model="m"),
        Note(text=""),
        System(text="s"),
        UnknownEvent(unknown_kind="future_kind", fields_={"zz": [1, 2], "aa": "x"}),
    ]
    for i, event in enumerate(events):
        env = dict(id=f"{i:024x}", machine="host-a", seq=i + 1, clock=i + 7,
                   prev=None if i == 0 else "c" * 64, time="2026-12-02T14:04:58.123Z")
        stamped = Record.stamped(event, **env)
        assert stamped == Record(event=event, **env)
        assert stamped.line == Record(event=event, **env).line
        assert Record.from_line(stamped.line) == stamped or isinstance(event, UnknownEvent)
    for bad in ["NOT-HEX", "ABCDEF12", "abc", "g" * 10, "a" * 65, " " + "a" * 10, "a" * 10 + "\n", 12345678]:
        with pytest.raises(FormatError, match="event id"):
            Record.stamped(note("x"), id=bad, machine="host-a", seq=1, clock=1, prev=None, time="t")  # type: ignore[arg-type]
    with pytest.raises(FormatError, match="not an event"):
        Record.stamped({"kind": "note"}, id="0" * 24, machine="host-a", seq=1, clock=1, prev=None, time="t")  # type: ignore[arg-type]


_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)  # any text a str can encode
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | _TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
    max_leaves=8)
_SHA = st.text("0123456789abcdef", min_size=64, max_size=64)
_OPT = st.none() | _TEXT
_EVENTS = st.one_of(
    st.builds(UserMessage, text=_TEXT),
    st.builds(AssistantMessage, text=_TEXT, provider=_OPT, model=_OPT),
    st.builds(Reasoning, provider=_TEXT.filter(bool), model=_TEXT.filter(bool), payload_format=_TEXT.filter(bool),
              data=st.dictionaries(_TEXT, _JSON, max_size=3), text=_OPT),
    st.builds(ToolCall, call_id=_TEXT.filter(bool), name=_TEXT.filter(bool),
              arguments=st.dictionaries(_TEXT, _JSON, max_size=4), provider=_OPT, model=_OPT),
    st.builds(ToolResult, call_id=_TEXT.filter(bool), content=_TEXT, is_error=st.booleans()),
    st.builds(MemoryEdit, text=_TEXT),
    st.builds(MemoryEdit, blob=_SHA),
    st.builds(WorkspaceUpdate, changes=st.dictionaries(st.sampled_from(["a", "b/c", "d.txt"]), st.none() | _SHA,
                                                       min_size=1)),
    st.builds(ModelSwitch, provider=_TEXT.filter(bool), model=_TEXT.filter(bool)),
    st.builds(Note, text=_TEXT),
    st.builds(System, text=_TEXT),
)


@settings(max_examples=300, deadline=None)
@given(event=_EVENTS, machine=st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True),
       seq=st.integers(1, 2**53 - 1), clock=st.integers(1, 2**53 - 1), prev=st.none() | _SHA,
       id=st.text("0123456789abcdef", min_size=8, max_size=64), time=_TEXT)
def test_a_stamped_line_is_the_canonical_json_of_its_record(event: Event, machine: str, seq: int, clock: int,
                                                            prev: str | None, id: str, time: str) -> None:
    """The append path writes each known kind's line from its fields (a
    writer generated per kind, keys sorted once); the bytes must be exactly
    the canonical JSON of the record (sorted keys, no spaces, UTF-8), or
    the chain's hashes would differ from every other reader's."""
    stamped = Record.stamped(event, id=id, machine=machine, seq=seq, clock=clock, prev=prev, time=time)
    record = Record(event=event, id=id, machine=machine, seq=seq, clock=clock, prev=prev, time=time)
    assert stamped.line == canonical_json(record.to_json()) == record.line
    assert Record.from_line(stamped.line) == stamped


def test_every_known_kind_has_a_line_writer() -> None:
    # The fast path of the append (see Record.stamped); unknown kinds keep the generic encoder.
    from capsulefs.core.journal.events import KINDS
    from capsulefs.core.journal.record import _line_writer

    assert all(_line_writer(cls) is not None for cls in KINDS.values())
    assert _line_writer(UnknownEvent) is None


def test_a_bad_machine_id_is_refused_before_stamping(tmp_path: Path) -> None:
    from capsulefs.core.journal.file import open_journal

    with open_journal(tmp_path / "j.jsonl", machine="bad host/id", now=lambda: 1.0, new_id=lambda: "0" * 24,
                      recovery_dir=tmp_path / "rec") as j:
        with pytest.raises(FormatError, match="host id"):
            j.append(note("x"))
        assert j.count == 0 and (tmp_path / "j.jsonl").read_bytes() == b""


@pytest.mark.slow
def test_a_journal_over_2_gib_is_read_whole_at_open(tmp_path: Path) -> None:
    """Linux reads at most 2 GiB - 4 KiB per read(): opening a journal past
    that took the short read for the whole file, called the partial line at
    2 GiB a torn tail, saved that fragment and cut the file there, losing
    every acknowledged line beyond it."""
    from capsulefs.core.journal.chain import ChainState

    disk = os.statvfs(tmp_path)
    if disk.f_bavail * disk.f_frsize < 6 << 30 or os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") < 6 << 30:
        pytest.skip("needs 6 GiB free on disk and in memory for a journal over 2 GiB")
    state, ids, size = ChainState(), iter(f"{k:024x}" for k in range(1, 10**6)), 0
    path = tmp_path / "j.jsonl"
    text = "x" * (8 << 20)
    with open(path, "wb") as f:
        while size <= (2 << 30) + (16 << 20):
            (rec,) = state.stamp([note(text)], machine="host-a", now=lambda: 1.0, new_id=ids.__next__)
            f.write(rec.line + b"\n")
            size += len(rec.line) + 1
    try:
        with open_test_journal(path, prefix=9) as j:
            assert (j.count, j.size) == (state.count, size)
            assert j.tail("host-a") == state.tails["host-a"]
            assert len(j.read()) == size
        assert path.stat().st_size == size
        assert not (tmp_path / "recovery").exists()
    finally:
        path.unlink()  # pytest keeps the last runs' directories: not 2 GiB of them


def test_catching_up_in_pieces_moves_exactly_the_torn_tail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """The catch-up reads in pieces (see the 2 GiB test): lines across a
    piece's end, and lines longer than a piece, are read whole; only the
    bytes after the file's last newline are a torn tail."""
    import capsulefs.core.journal.follow as J

    path = tmp_path / "j.jsonl"
    with open_test_journal(path) as j:
        for i in range(30):
            j.append(note(f"{i} " + "y" * (i * 97 % 700 + (3000 if i == 17 else 0))))
    whole = path.read_bytes()
    path.write_bytes(whole + b'{"clock":31,"id":')
    monkeypatch.setattr(J, "CATCH_UP_PIECE", 500)
    with open_test_journal(path) as j:
        assert (j.count, j.size) == (30, len(whole))
        assert j.read() == whole
    assert path.read_bytes() == whole
    assert (tmp_path / "recovery" / f"j.jsonl{TORN_SUFFIX}1").read_bytes() == b'{"clock":31,"id":'
    assert "torn tail of 17 bytes" in caplog.text


def test_torn_tails_saved_at_once_into_one_recovery_directory_are_all_kept(tmp_path: Path) -> None:
    """Capsules side by side share one recovery directory (the agent
    runtime's <parent>/.recovery): two torn tails saved at the same time
    took the same number, and the second rename replaced the first."""
    import threading

    from capsulefs.core.journal.recovery import save_torn

    def save(k: int) -> None:
        for i in range(100):
            save_torn(str(tmp_path / "rec"), f"/capsule-{k}/timeline_events.jsonl", f"{k}-{i}".encode())

    threads = [threading.Thread(target=save, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    kept = {p.read_bytes() for p in (tmp_path / "rec").iterdir()}
    assert kept == {f"{k}-{i}".encode() for k in range(2) for i in range(100)}
    assert sorted(p.name for p in (tmp_path / "rec").iterdir()) == sorted(
        f"timeline_events.jsonl{TORN_SUFFIX}{n}" for n in range(1, 201))


# -- a file rewritten in place behind an open Journal ---------------------------------


def test_a_journal_rewritten_in_place_and_grown_is_read_again(tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """A tool rewrites the file in place (same inode): its last line edited
    (same length), a line of another machine added. The file grew, so an
    open Journal read only the bytes past the end it knew, and its next
    append chained onto a line that was no longer there. Catching up checks
    that the last line it knew is still where it was; it is not, so the
    Journal reads the file again (as it does when a file shrank)."""
    from journal_helpers import retext

    from capsulefs.core.journal.chain import ChainState

    path = tmp_path / "j.jsonl"
    with open_test_journal(path) as j:
        j.append(note("one"))
        j.append(note("two"))
        before = path.read_bytes()
        first, second = split_lines(before)
        edited = retext(second, text="TWO")
        assert len(edited) == len(second) and edited != second
        (other,) = ChainState().stamp([note("b")], machine="host-b", now=lambda: 0.0, new_id=lambda: "f" * 24)
        with open(path, "r+b") as f:  # same inode
            f.write(first + b"\n" + edited + b"\n" + other.line.replace(b'"clock":1', b'"clock":3') + b"\n")
        ino = os.stat(path).st_ino
        rec = j.append(note("three"))
    assert os.stat(path).st_ino == ino
    assert verify_lines(split_lines(path.read_bytes())) == []
    assert (rec.seq, rec.clock) == (3, 4)
    assert "rewritten" in caplog.text


# -- readers never write -----------------------------------------------------------


def test_a_reader_leaves_a_torn_tail_where_it_is(tmp_path: Path) -> None:
    """A read-only open (no machine id) sees the whole lines only and writes
    nothing: the torn tail stays for a writer's open to move aside."""
    path = tmp_path / "j.jsonl"
    rec_dir = tmp_path / "recovery"
    with open_test_journal(path, recovery_dir=rec_dir) as j:
        r1 = j.append(note("kept"))
    with open(path, "ab") as f:
        f.write(b'{"clock":2,"id":"torn')
    before = path.read_bytes()
    with open_test_journal(path, machine=None, recovery_dir=rec_dir) as reader:
        assert reader.lines() == [r1.line]
        with open(path, "ab") as f:
            f.write(b'","kind"')
        reader.refresh()
        assert reader.lines() == [r1.line]
        assert path.read_bytes() == before + b'","kind"'
    assert path.read_bytes() == before + b'","kind"'
    assert _recovery_files(rec_dir) == []
    with open_test_journal(path, recovery_dir=rec_dir):  # a writer's open repairs
        assert path.read_bytes() == r1.line + b"\n"
    assert _recovery_files(rec_dir) == ["j.jsonl" + TORN_SUFFIX + "1"]


def test_a_reader_stops_before_a_line_of_nuls_and_leaves_it(tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "j.jsonl"
    rec_dir = tmp_path / "recovery"
    with open_test_journal(path, recovery_dir=rec_dir) as j:
        r1 = j.append(note("kept"))
    with open(path, "ab") as f:
        f.write(bytes(100) + b'end of a line"}\n')
    before = path.read_bytes()
    with open_test_journal(path, machine=None, recovery_dir=rec_dir) as reader:
        assert reader.lines() == [r1.line]
    assert path.read_bytes() == before and _recovery_files(rec_dir) == []
    assert "NUL" in caplog.text
