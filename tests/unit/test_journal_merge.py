"""merge: set union sorted by (clock, machine, seq); commutative, associative,
idempotent; refuses inputs whose chains do not verify. The vectorised fast
path must give exactly the reference's result, and refuse what it refuses."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from journal_helpers import Replica, future_event, note, replicas, retext

from capsulefs.core.errors import FormatError
from capsulefs.core.journal.events import AssistantMessage, Event, MemoryEdit, ToolCall, UserMessage
from capsulefs.core.journal.lines import ChainError, join_lines, merge, verify_lines
from capsulefs.core.journal.chain import ChainState
from capsulefs.core.journal.envelope_index import Unreadable, fast_merge, index_journal, index_parallel, merge_bytes

EVENTS = st.one_of(
    st.builds(note, st.text(max_size=30)),
    st.builds(lambda t: UserMessage(text=t), st.text(alphabet=st.characters(codec="utf-8"), max_size=40)),
    st.builds(lambda t: AssistantMessage(text='say "' + t + '" {x}', model="m"), st.text(max_size=10)),
    # Nested keys that look like the envelope's: the fast path must not be fooled.
    st.builds(
        lambda n: ToolCall(call_id="c", name="t", arguments={"clock": n, "seq": {"seq": n}, "machine": "evil", "prev": None}),
        st.integers(1, 10**6),
    ),
    st.builds(lambda t: MemoryEdit(text=t), st.text(max_size=20)),
    st.just(future_event()),
)

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(0, 2), EVENTS),
        st.tuples(st.just("sync"), st.integers(0, 2), st.integers(0, 2)),
    ),
    max_size=25,
)


def _play(ops: list[tuple[str, int, object]]) -> list[Replica]:
    reps = replicas(3)
    for op, x, y in ops:
        if op == "append":
            assert isinstance(y, Event)
            reps[x].append(y)
        elif x != y:
            reps[x].pull(reps[y])  # type: ignore[index]
    return reps


@st.composite
def three_journals(draw: st.DrawFn) -> tuple[list[bytes], list[bytes], list[bytes]]:
    """Three copies that diverged and synced at random, each cut at a random
    point (a prefix of a valid journal is a valid journal)."""
    reps = _play(draw(OPS))
    cuts = [draw(st.integers(0, len(r.lines))) for r in reps]
    return tuple(r.lines[:k] for r, k in zip(reps, cuts))  # type: ignore[return-value]


SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(three_journals())
def test_merge_is_a_sorted_union(js: tuple[list[bytes], list[bytes], list[bytes]]) -> None:
    a, b, _ = js
    m = merge(a, b)
    assert set(m) == set(a) | set(b) and len(m) == len(set(m))
    keys = [(d["clock"], d["machine"], d["seq"]) for d in map(json.loads, m)]
    assert keys == sorted(keys)
    assert verify_lines(m) == []


@SETTINGS
@given(three_journals())
def test_merge_is_commutative_associative_idempotent(js: tuple[list[bytes], list[bytes], list[bytes]]) -> None:
    a, b, c = js
    assert merge(a, b) == merge(b, a)
    assert merge(merge(a, b), c) == merge(a, merge(b, c))
    assert merge(a, a) == a
    assert merge(a, []) == a == merge([], a)


@SETTINGS
@given(three_journals())
def test_fast_merge_equals_the_reference(js: tuple[list[bytes], list[bytes], list[bytes]]) -> None:
    for x in js:
        for y in js:
            want = join_lines(merge(x, y))
            assert b"".join(fast_merge(join_lines(x), join_lines(y))) == want
            assert merge_bytes(join_lines(x), join_lines(y)) == want


def test_fast_merge_on_a_larger_journal() -> None:
    a, b = replicas(2)
    for i in range(300):
        a.append(note(f"a{i}"))
        if i % 7 == 0:
            b.pull(a)
        b.append(UserMessage(text=f"b{i} " * (i % 13)))
        if i % 11 == 0:
            a.pull(b)
    assert b"".join(fast_merge(a.data(), b.data())) == join_lines(merge(a.lines, b.lines))


@SETTINGS
@given(three_journals(), st.integers(2, 5), st.integers(0, 3))
def test_parallel_index_equals_serial(js: tuple[list[bytes], list[bytes], list[bytes]], parts: int, skip: int) -> None:
    lines = js[0]
    data = join_lines(lines)
    start = len(join_lines(lines[:skip]))
    one, many = index_journal(data, start), index_parallel(data, start, parts=parts, min_size=0)
    for name in ("starts", "ends", "clock", "seq", "has_prev", "prev"):
        assert (getattr(one, name) == getattr(many, name)).all(), name
    assert [one.names[i] for i in one.mid] == [many.names[i] for i in many.mid]


@pytest.mark.parametrize("machine", ["h" * 64, "H" * 65 + ".x_y-z", "n"])
def test_fast_merge_host_ids_of_any_length(machine: str) -> None:
    a = Replica(machine=machine)
    b = Replica(machine="host-b")
    for i in range(40):
        a.append(note(f"a{i}"))
        if i % 9 == 0:
            b.pull(a)
            b.append(note(f"b{i}"))
    want = join_lines(merge(a.lines, b.lines))
    assert b"".join(fast_merge(a.data(), b.data())) == want == merge_bytes(b.data(), a.data())


def test_clocks_up_to_2_53_merge_on_both_paths_and_beyond_are_refused_by_both() -> None:
    a = Replica(machine="host-a")
    a.append(note("one"))
    a.state.clock = 2**53 - 2  # a writer that had seen a huge clock
    a.append(note("two"))
    assert json.loads(a.lines[1])["clock"] == 2**53 - 1
    with pytest.raises(FormatError, match="2\\*\\*53-1"):
        a.append(note("three"))  # no clock left
    assert merge_bytes(a.data(), a.data()) == b"".join(fast_merge(a.data(), a.data())) == a.data()
    over = a.lines[1].replace(b'"clock":9007199254740991', b'"clock":9007199254740992')
    huge = a.lines[1].replace(b'"clock":9007199254740991', b'"clock":' + b"9" * 5000)
    for line, why in ((over, "clock, seq and v must be integers from 1 to 2\\*\\*53-1"), (huge, "more than 4300 digits")):
        with pytest.raises(Unreadable):
            fast_merge(a.data(), a.lines[0] + b"\n" + line + b"\n")
        with pytest.raises(ChainError, match=f"input B does not verify: line 2: .*{why}"):
            merge_bytes(a.data(), a.lines[0] + b"\n" + line + b"\n")


# -- refusals ------------------------------------------------------------------------


def _two() -> tuple[Replica, Replica]:
    a, b = replicas(2)
    for i in range(4):
        a.append(note(f"a{i}"))
    b.pull(a)
    for i in range(3):
        b.append(note(f"b{i}"))
    return a, b


@pytest.mark.parametrize("side", ["A", "B"])
def test_merge_refuses_a_tampered_input(side: str) -> None:
    a, b = _two()
    bad = list(b.lines)
    bad[1] = retext(bad[1], text="forged")
    x, y = (bad, a.lines) if side == "A" else (a.lines, bad)
    with pytest.raises(ChainError, match=f"input {side} does not verify.*machine host-a seq 3"):
        merge(x, y)
    with pytest.raises(Unreadable):
        fast_merge(join_lines(x), join_lines(y))
    with pytest.raises(ChainError, match="machine host-a seq 3"):
        merge_bytes(join_lines(x), join_lines(y))


def test_merge_refuses_a_fork_between_inputs() -> None:
    a, _ = _two()
    # A restored backup of the same machine writes again from seq 3.
    restored = Replica(machine="host-a", lines=a.lines[:2], state=ChainState())
    for line in restored.lines:
        restored.state.absorb(line)
    restored.append(note("written after a restore"))
    for x, y in ((a.lines, restored.lines), (restored.lines, a.lines)):
        with pytest.raises(ChainError, match="machine host-a seq 3.*fork"):
            merge(x, y)
        with pytest.raises(ChainError, match="machine host-a seq 3"):
            merge_bytes(join_lines(x), join_lines(y))


def test_merge_refuses_misordered_and_gapped_inputs() -> None:
    a, b = _two()
    swapped = list(b.lines)
    swapped[1], swapped[2] = swapped[2], swapped[1]
    gapped = b.lines[:2] + b.lines[3:]
    for bad in (swapped, gapped):
        with pytest.raises(ChainError, match="input B does not verify"):
            merge(a.lines, bad)
        with pytest.raises(ChainError):
            merge_bytes(a.data(), join_lines(bad))


def test_merge_refuses_unreadable_lines() -> None:
    a, b = _two()
    with pytest.raises(ChainError, match="input B does not verify: line 2"):
        merge(a.lines, [b.lines[0], b"{not json}"] + b.lines[1:])
    with pytest.raises(FormatError, match="torn tail"):
        merge_bytes(a.data(), b.data()[:-5])


def test_unknown_kinds_survive_merge_byte_for_byte() -> None:
    a, b = _two()
    r = b.append(future_event("teleport", payload={"deep": {"er": [1, "two"]}}))[0]
    merged = merge_bytes(a.data(), b.data())
    assert r.line + b"\n" in merged
    assert merged.count(b"teleport") == 1
