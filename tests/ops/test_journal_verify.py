"""verify_lines: every problem, each naming its line, machine and seq."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers import export_and_unpack, make_agent
from journal_helpers import note, replicas, retext

from capsulefs.core.capsule import format as fmt
from capsulefs.core.capsule.archive import verify_capsule
from capsulefs.core.journal.lines import ChainError, check_journal_bytes, check_lines, join_lines, merge, verify_lines
from capsulefs.core.store.host_store import HostStore


def _journal(n_a: int = 3, n_b: int = 3) -> list[bytes]:
    """Two machines, interleaved by a sync in the middle."""
    a, b = replicas(2)
    for i in range(n_a):
        a.append(note(f"a{i}"))
    b.pull(a)
    for i in range(n_b):
        b.append(note(f"b{i}"))
    a.pull(b)
    a.append(note("a-last"))
    return a.lines


def _machine_seq(line: bytes) -> tuple[str, int]:
    doc = json.loads(line)
    return doc["machine"], doc["seq"]


def test_a_valid_journal_has_no_problems() -> None:
    lines = _journal()
    assert verify_lines(lines) == [] and verify_lines(lines, full=False) == []
    check_lines(lines)
    assert verify_lines([]) == []


def test_tampered_line_names_machine_and_seq() -> None:
    lines = _journal()
    lines[1] = retext(lines[1], text="rewritten history")  # still canonical, chain broken
    machine, seq = _machine_seq(lines[1])
    problems = verify_lines(lines)
    assert len(problems) == 1
    assert f"machine {machine} seq {seq + 1}" in problems[0] and f"seq {seq} (line 2)" in problems[0]
    assert "line 3" in problems[0] and "altered" in problems[0]
    with pytest.raises(ChainError, match=f"machine {machine} seq {seq + 1}") as info:
        check_lines(lines)
    assert info.value.problems == problems


def test_fork_same_machine_and_seq_with_different_content() -> None:
    lines = _journal()
    machine, seq = _machine_seq(lines[2])
    fork = retext(lines[2], text="the other branch", clock=json.loads(lines[2])["clock"] + 100)
    problems = verify_lines(lines + [fork])
    assert any(f"machine {machine} seq {seq}" in p and "fork" in p and "line 3" in p for p in problems), problems


def test_duplicate_line() -> None:
    lines = _journal()
    problems = verify_lines(lines[:3] + [lines[2]] + lines[3:])
    machine, seq = _machine_seq(lines[2])
    assert any(f"line 4: machine {machine} seq {seq}: duplicates line 3" == p for p in problems), problems


def test_gap() -> None:
    lines = _journal()
    machine, seq = _machine_seq(lines[1])
    problems = verify_lines(lines[:1] + lines[2:])
    assert any(f"machine {machine} seq {seq + 1}: gap" in p for p in problems), problems


def test_first_line_of_a_machine_must_be_seq_one() -> None:
    lines = _journal()
    problems = verify_lines(lines[1:])
    machine, _ = _machine_seq(lines[0])
    assert any(f"machine {machine} seq 2: the machine's first line must have seq 1" in p for p in problems)


def test_misorder() -> None:
    lines = _journal()
    swapped = lines[:]
    swapped[2], swapped[3] = swapped[3], swapped[2]
    problems = verify_lines(swapped)
    assert any("line 4" in p and "out of order" in p for p in problems), problems


def test_clock_must_grow_along_a_chain() -> None:
    a = replicas(1)[0]
    a.append(note("one"))
    a.append(note("two"))
    lines = [a.lines[0], retext(a.lines[1], clock=1, prev=json.loads(a.lines[1])["prev"])]
    problems = verify_lines(lines)
    assert any("machine host-a seq 2: clock 1 is not greater than clock 1" in p for p in problems), problems


def test_unreadable_and_non_canonical_lines_are_named() -> None:
    lines = _journal()
    spaced = json.dumps(json.loads(lines[0]), sort_keys=True).encode()  # spaces: not canonical
    problems = verify_lines([spaced, b"garbage"] + lines[1:])
    assert problems[0].startswith("line 1:") and "canonical" in problems[0]
    assert problems[1].startswith("line 2:") and "JSON" in problems[1]


def test_lines_from_outside_that_json_alone_accepts_are_named_not_raised() -> None:
    # a copy from elsewhere (an import, a merge) may hold any bytes
    lines = _journal()
    surrogate = lines[0].replace(b'"kind"', b'"x":"\\ud800","kind"')
    deep = b'{"clock":' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    utf16 = json.dumps(json.loads(surrogate), ensure_ascii=False).encode("utf-16-le", "surrogatepass")
    nan, huge = (re.sub(rb'"seq":1\b', b'"seq":' + x, lines[0]) for x in (b"NaN", b"1e999"))
    problems = verify_lines([surrogate, deep, utf16, nan, huge] + lines[1:])
    assert problems[0].startswith("line 1:") and "surrogate" in problems[0], problems
    assert problems[1].startswith("line 2:") and "nested too deeply" in problems[1], problems
    assert problems[2].startswith("line 3:") and "not UTF-8" in problems[2], problems  # UTF-16: not the one form
    assert problems[3].startswith("line 4:") and "NaN is not a JSON number" in problems[3], problems
    assert problems[4].startswith("line 5:") and "1e999 is out of range" in problems[4], problems
    with pytest.raises(ChainError, match="line 1"):
        merge([surrogate] + lines[1:], lines)


def test_every_problem_is_listed_not_just_the_first() -> None:
    lines = _journal(4, 4)
    lines[1] = retext(lines[1], text="x")
    lines[5] = retext(lines[5], text="y")
    problems = verify_lines(lines)
    assert len(problems) == 2 and "line 3" in problems[0] and "line 7" in problems[1]


def test_torn_file_is_reported() -> None:
    data = join_lines(_journal())
    assert check_journal_bytes(data) == []
    problems = check_journal_bytes(data + b'{"cl')
    assert len(problems) == 1 and "torn tail of 4 bytes" in problems[0]


# -- through capsule verify -----------------------------------------------------------


def _tamper_capsule(cap: Path) -> tuple[str, int]:
    """Rewrite one journal line (keeping it canonical) and fix the manifest's
    digest, so only the chain can tell. Returns the machine and the seq whose
    prev no longer matches."""
    jpath = cap / fmt.JOURNAL
    lines = jpath.read_bytes().splitlines()
    lines[0] = retext(lines[0], text="forged")
    jpath.write_bytes(join_lines(lines))
    m = fmt.Manifest.from_bytes((cap / fmt.MANIFEST).read_bytes())
    data = jpath.read_bytes()
    import hashlib

    files = dict(m.files)
    files[fmt.JOURNAL] = fmt.FileEntry(sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    m2 = fmt.Manifest(agent_id=m.agent_id, name=m.name, holder=m.holder, files=files, extra=m.extra)
    (cap / fmt.MANIFEST).write_bytes(m2.to_bytes())
    return _machine_seq(lines[1])


def _agent_with_journal(store: HostStore, name: str = "ada"):  # type: ignore[no-untyped-def]
    agent = make_agent(store, name)
    r = replicas(1)[0]
    for i in range(3):
        r.append(note(f"n{i}"))
    agent.write_files({fmt.JOURNAL: r.data()})
    return agent


def test_capsule_verify_fails_on_a_tampered_journal_naming_machine_and_seq(store: HostStore, tmp_path: Path) -> None:
    agent = _agent_with_journal(store)
    _tar, cap = export_and_unpack(agent, tmp_path)
    assert verify_capsule(str(cap))[1] == []
    machine, seq = _tamper_capsule(cap)
    _manifest, problems = verify_capsule(str(cap))
    assert len(problems) == 1
    assert problems[0].path == fmt.JOURNAL
    assert re.search(rf"machine {machine} seq {seq}\b", str(problems[0])), str(problems[0])


def test_cli_verify_names_machine_and_seq(store: HostStore, tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    agent = _agent_with_journal(store)
    _tar, cap = export_and_unpack(agent, tmp_path)
    machine, seq = _tamper_capsule(cap)
    proc = cli("verify", str(cap))
    assert proc.returncode == 1
    assert f"machine {machine} seq {seq}" in proc.stderr and fmt.JOURNAL in proc.stderr
