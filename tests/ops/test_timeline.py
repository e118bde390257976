"""The timeline: ``capsulefs log`` filters answered from a derived SQLite
index that is checked before every query and never trusted, the last
events read from the end, and --grep's bounded cost."""

from __future__ import annotations

import calendar
import io
import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capsulefs.cli import main
from capsulefs.core.capsule import format as fmt
from capsulefs.core.journal import query, timeline
from capsulefs.core.journal.events import Note, ToolResult, UserMessage
from capsulefs.core.journal.file import open_agent_journal
from capsulefs.core.store.agent import AgentHandle
from capsulefs.core.store.host_store import HostStore
from cli_kit import REPO

HOST = "TIMELINEHOST" + "A" * 40


@pytest.fixture
def cli(state_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """``capsulefs --state STATE ARGS`` in this process."""

    def run(*args: str, check: bool = True) -> SimpleNamespace:
        capsys.readouterr()
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"")))
        rc = main(["--state", str(state_dir), *args])
        out, err = capsys.readouterr()
        if check and rc != 0:
            raise AssertionError(f"capsulefs {' '.join(args)} failed ({rc}): {out}{err}")
        return SimpleNamespace(returncode=rc, stdout=out, stderr=err)

    return run


class Clock:
    def __init__(self, start: float) -> None:
        self.t = start

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def agent(store: HostStore) -> AgentHandle:
    """An agent whose journal spans three days: messages, tool results (some
    failed), notes; one event every ten minutes."""
    a = store.create_agent("tl", host_id=HOST, agent_id="c" * 32)
    clock = Clock(1_796_000_000.0)  # 2026-12-01T...
    ids = iter(range(1, 1 << 30))
    with open_agent_journal(a, machine=HOST, now=clock, new_id=lambda: f"{next(ids):024x}") as j:
        for i in range(3 * 144):
            if i % 9 == 4:
                ev = ToolResult(call_id=f"c{i}", content=f"error: build {i} failed", is_error=True)
            elif i % 3 == 0:
                ev = ToolResult(call_id=f"c{i}", content=f"ok {i}")
            elif i % 3 == 1:
                ev = UserMessage(text=f"please look at file number {i}")
            else:
                ev = Note(text=f"checkpoint {i} of the deployment")
            j.append(ev)
            clock.t += 600
    return a


def _lines(agent: AgentHandle) -> list[bytes]:
    return Path(agent.path(fmt.JOURNAL)).read_bytes().splitlines()


def _expect(agent: AgentHandle, keep) -> list[str]:  # type: ignore[no-untyped-def]
    return [line.decode() for line in _lines(agent) if keep(json.loads(line))]


def _ms(doc: dict) -> int:
    ms = query.event_ms(doc["time"])
    assert ms is not None
    return ms


def test_log_answers_each_filter_as_a_scan_of_the_journal_would(cli, agent: AgentHandle) -> None:  # type: ignore[no-untyped-def]
    cases = [
        (["--failed"], lambda d: d["kind"] == "tool_result" and d.get("is_error") is True),
        (["--kind", "note"], lambda d: d["kind"] == "note"),
        (["--kind", "note", "--kind", "user_message"], lambda d: d["kind"] in ("note", "user_message")),
        (["--since", "2026-12-02T00:00:00Z", "--until", "2026-12-02T01:00:00Z"],
         lambda d: query.parse_when("2026-12-02T00:00:00Z") <= _ms(d) < query.parse_when("2026-12-02T01:00:00Z")),
        (["--grep", r"build 1\d\d failed"], lambda d: d["kind"] == "tool_result" and d["content"].startswith("error: build 1")
         and len(d["content"].split()[2]) == 3),
        (["--grep", "deploy(ment|er)", "--kind", "note", "--since", "2026-12-01"],
         lambda d: d["kind"] == "note" and _ms(d) >= query.parse_when("2026-12-01")),
        (["--failed", "--tail", "3"], None),
    ]
    for args, keep in cases:
        got = cli("log", "tl", "--json", *args).stdout.splitlines()
        if keep is None:
            want = _expect(agent, lambda d: d["kind"] == "tool_result" and d.get("is_error") is True)[-3:]
        else:
            want = _expect(agent, keep)
        assert got == want and want, args


def test_log_tail_reads_the_last_events(cli, agent: AgentHandle, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(timeline, "BLOCK", 97)  # many blocks, lines cut across them
    lines = [line.decode() for line in _lines(agent)]
    for n in (0, 1, 2, 5, 100, len(lines), len(lines) + 10):
        assert cli("log", "tl", "--json", "--tail", str(n)).stdout.splitlines() == (lines[-n:] if n else []), n
    with open(agent.path(fmt.JOURNAL), "ab") as f:
        f.write(b'{"half a line')  # a line being written is not yet part of the journal
    assert cli("log", "tl", "--json", "--tail", "2").stdout.splitlines() == lines[-2:]
    assert cli("log", "tl", "--tail", "-1", check=False).returncode == 1


def test_the_index_follows_appends_with_the_new_lines_only(agent: AgentHandle, store: HostStore) -> None:
    index = timeline.TimelineIndex(os.path.join(timeline.timeline_dir(store.root, agent.agent_id),
                                                timeline.INDEX_NAME), agent.path(fmt.JOURNAL))

    def ask(q: query.Query) -> list[tuple[int, bytes]]:
        snap = timeline.open_snapshot(agent.path(fmt.JOURNAL))
        try:
            return timeline.query_index(index, snap, q)
        finally:
            os.close(snap.fd)

    before = ask(query.Query(kinds=("note",)))
    assert index.added == len(_lines(agent))  # (built from empty)
    with open_agent_journal(agent, machine=HOST, now=time.time, new_id=lambda: os.urandom(12).hex()) as j:
        j.append(Note(text="a late note"))
        j.append(UserMessage(text="hi"))
    after = ask(query.Query(kinds=("note",)))
    assert not index.rebuilt and index.added == 2
    assert after[:-1] == before and after[-1][1].endswith(b'"text":"a late note","time":' + after[-1][1].split(b'"time":')[1])
    assert [no for no, _ in after] == [no for no, line in enumerate(_lines(agent), 1) if b'"kind":"note"' in line]


def _index_path(store: HostStore, agent: AgentHandle) -> str:
    return os.path.join(timeline.timeline_dir(store.root, agent.agent_id), timeline.INDEX_NAME)


def test_an_index_that_lies_can_only_leave_lines_out(cli, agent: AgentHandle, store: HostStore) -> None:  # type: ignore[no-untyped-def]
    cli("log", "tl", "--kind", "note")  # builds it
    db = sqlite3.connect(_index_path(store, agent))
    db.execute("UPDATE events SET kind = 'note', failed = 1")  # every row says note, failed
    db.commit()
    db.close()
    notes = _expect(agent, lambda d: d["kind"] == "note")
    assert cli("log", "tl", "--json", "--kind", "note").stdout.splitlines() == notes  # each line checked again
    assert cli("log", "tl", "--json", "--kind", "user_message").stdout == ""  # left out: not wrong
    failed = _expect(agent, lambda d: d.get("is_error") is True)
    assert cli("log", "tl", "--json", "--failed").stdout.splitlines() == failed


def test_an_index_of_another_journal_is_built_again(cli, agent: AgentHandle, store: HostStore, caplog) -> None:  # type: ignore[no-untyped-def]
    cli("log", "tl", "--failed")
    lines = _lines(agent)
    # The journal replaced by one with the same first half (a merge that
    # rewrote the rest): the line the index ended on is gone.
    agent.write_files({fmt.JOURNAL: b"\n".join(lines[: len(lines) // 2]) + b"\n"})
    got = cli("log", "tl", "--json", "--failed").stdout.splitlines()
    assert got == [line.decode() for line in lines[: len(lines) // 2] if b'"is_error":true' in line]
    assert any("does not match its journal" in r.getMessage() for r in caplog.records)


def test_a_damaged_index_file_is_made_anew(cli, agent: AgentHandle, store: HostStore, caplog) -> None:  # type: ignore[no-untyped-def]
    cli("log", "tl", "--failed")
    path = _index_path(store, agent)
    with open(path, "r+b") as f:
        f.write(b"this is not a database" * 100)
    assert cli("log", "tl", "--json", "--kind", "note").stdout.splitlines() == _expect(agent, lambda d: d["kind"] == "note")
    assert any("unusable" in r.getMessage() for r in caplog.records)


def test_an_index_pointing_into_a_line_is_not_believed(cli, agent: AgentHandle, store: HostStore, caplog) -> None:  # type: ignore[no-untyped-def]
    cli("log", "tl", "--kind", "note")
    db = sqlite3.connect(_index_path(store, agent))
    db.execute("UPDATE events SET at = at + 5 WHERE kind = 'note'")
    db.commit()
    db.close()
    notes = _expect(agent, lambda d: d["kind"] == "note")
    assert cli("log", "tl", "--json", "--kind", "note").stdout.splitlines() == notes  # read whole this once
    assert cli("log", "tl", "--json", "--kind", "note").stdout.splitlines() == notes  # then built again
    assert any("middle of a line" in r.getMessage() for r in caplog.records)


def test_a_costly_pattern_is_stopped_at_its_budget(cli, store: HostStore, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    a = store.create_agent("slow", host_id=HOST, agent_id="d" * 32)
    with open_agent_journal(a, machine=HOST, now=time.time, new_id=lambda: os.urandom(12).hex()) as j:
        j.append_many([Note(text="x" * 3000) for _ in range(3)])
    monkeypatch.setattr(query, "GREP_SECONDS", 0.2)
    t = time.monotonic()
    p = cli("log", "slow", "--grep", "(x+x+)+y", check=False)
    assert p.returncode == 1 and "took more than 0.2 s" in p.stderr
    assert time.monotonic() - t < 30  # (bounds a hang only: the budget is 0.2 s)
    for bad, why in (("(", "is not a regular expression"), ("a" * 1001, "longer than 1000")):
        p = cli("log", "slow", "--grep", bad, check=False)
        assert p.returncode == 1 and why in p.stderr and len(p.stderr.splitlines()) == 1


def test_the_timeline_goes_with_its_agent(cli, agent: AgentHandle, store: HostStore) -> None:  # type: ignore[no-untyped-def]
    cli("log", "tl", "--failed")
    assert os.path.exists(_index_path(store, agent))
    assert not any("sqlite" in f for f in agent.local_files())
    store.remove_agent(agent.agent_id)
    assert not os.path.exists(timeline.timeline_dir(store.root, agent.agent_id))


def test_log_of_a_capsule_directory_filters_without_an_index(cli, agent: AgentHandle, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "copy.tar"
    cli("export", "tl", "-o", str(out))
    got = cli("log", str(out), "--json", "--failed", "--tail", "2").stdout.splitlines()
    assert got == _expect(agent, lambda d: d.get("is_error") is True)[-2:]


def test_times_as_users_write_them() -> None:
    now = 1_796_200_000.0  # 2026-12-02T...
    assert query.parse_when("2h", now) == int((now - 7200) * 1000)
    assert query.parse_when("2026-12-02T10:00:00Z") == calendar.timegm((2026, 12, 2, 10, 0, 0)) * 1000
    assert query.parse_when("2026-12-02T10:00Z") == query.parse_when("2026-12-02 10:00:00+00:00")
    assert query.parse_when("2026-12-02T11:00+01:00") == query.parse_when("2026-12-02T10:00Z")
    today = query.parse_when("today", now)
    assert today <= now * 1000 < today + 25 * 3600 * 1000
    assert 23 * 3600 * 1000 <= today - query.parse_when("yesterday", now) <= 25 * 3600 * 1000  # (a DST day)
    assert query.parse_when("09:30", now) == query.parse_when(
        time.strftime("%Y-%m-%dT09:30", time.localtime(now)))
    for bad in ("", "soon", "2026-13-01", "25:00", "2026-12-02T10:00:00ZZ", "1y", "9" * 50, "12:3"):
        with pytest.raises(query.QueryError):
            query.parse_when(bad, now)


_PIECES = st.sampled_from(["abc", "fail", "ed", "x", "é", "hello", "  ", "\n", "Err"])


@settings(max_examples=150, deadline=None)
@given(texts=st.lists(st.lists(_PIECES, max_size=6).map("".join), min_size=1, max_size=8),
       pattern=st.lists(st.sampled_from(["abc", "fail", "ed", "hello", ".", "x+", "(ed|abc)", "[a-z]", "é", "(?i)err",
                                         "(abc)?", "\\s", "Err"]), min_size=1, max_size=4).map("".join))
def test_the_trigram_prefilter_keeps_every_match(texts: list[str], pattern: str) -> None:
    """Whatever the FTS query drops must not match the pattern."""
    import regex

    db = sqlite3.connect(":memory:")
    db.execute("CREATE VIRTUAL TABLE words USING fts5(text, content='', tokenize='trigram', detail=none)")
    db.executemany("INSERT INTO words(rowid, text) VALUES(?, ?)", list(enumerate(texts, 1)))
    fts = query.fts_query(query.required_literals(pattern))
    kept = {r for (r,) in db.execute("SELECT rowid FROM words WHERE words MATCH ?", (fts,))} if fts else None
    for no, text in enumerate(texts, 1):
        if regex.search(pattern, text, regex.VERSION0) and kept is not None:
            assert no in kept, (pattern, text, fts)


def test_log_loads_only_what_it_uses(state_dir: Path, agent: AgentHandle) -> None:
    """A fresh ``capsulefs log`` loads no numpy, trio, pyfuse3 or
    cryptography, nor what a start need not pay for: dataclasses (with
    inspect, ast, dis: core/frozen.py), shutil (with bz2, lzma: argparse's
    help formatter); --tail alone not even sqlite3 or hashlib (OpenSSL: it
    hashes no line)."""
    code = ("import sys\nfrom capsulefs.cli import main\nmain(sys.argv[1:])\n"
            "heavy = ('numpy', 'trio', 'pyfuse3', 'cryptography', 'sqlite3', 'regex', 'keyring', 'anthropic', 'openai',"
            " 'dataclasses', 'inspect', 'shutil', 'hashlib')\n"
            "print(sorted(m for m in heavy if m in sys.modules), file=sys.stderr)\n")
    for args, loaded in ((["log", "tl", "--tail", "3"], "[]"), (["log", "tl", "--failed"], "['hashlib', 'sqlite3']"),
                         (["log", "tl", "--grep", "build"], "['hashlib', 'regex', 'sqlite3']")):
        p = subprocess.run([sys.executable, "-c", code, "--state", str(state_dir), *args], capture_output=True,
                           text=True, cwd=REPO, timeout=120, check=True)
        assert p.stderr.strip().splitlines()[-1] == loaded, (args, p.stderr)


def test_the_fuzz_targets_take_hostile_input() -> None:
    """A short pass of this area's fuzz targets (tests/fuzz): bad input
    raises a CapsuleError, nothing else escapes."""
    import random

    from capsulefs.core.errors import CapsuleError
    from fuzz import targets_timeline

    rng = random.Random(31)
    for target in targets_timeline.TARGETS:
        for seed in target.seeds():
            for _ in range(150):
                data = bytearray(seed)
                for _ in range(rng.randint(1, 4)):
                    op = rng.random()
                    pos = rng.randint(0, len(data))
                    if op < 0.4 and data:
                        data[min(pos, len(data) - 1)] = rng.randint(0, 255)
                    elif op < 0.7:
                        data[pos:pos] = bytes(rng.choice(b"(){}[]*+?|\\.:-TZ0123456789\n\"\x00") for _ in range(3))
                    else:
                        del data[pos : pos + rng.randint(1, 8)]
                try:
                    target.run(bytes(data), Path("."))
                except CapsuleError:
                    pass
