"""The journal's tip: opening starts from it, and only when it matches the file."""

from __future__ import annotations

import hashlib
import logging
import os
import stat
from pathlib import Path

import pytest

from capsulefs.core.capsule import format as fmt
from capsulefs.core import sha256_state
from capsulefs.core.errors import FormatError
from capsulefs.core.journal.events import ModelSwitch, Note
from capsulefs.core.journal.file import Journal
from capsulefs.core.journal.lines import verify_lines
from capsulefs.core.journal.tip import TIP_EVERY, journal_tip_path, load_tip, parse_tip, tip_bytes
from capsulefs.core.view.journal_tail import JournalTail
from capsulefs.core.store.host_store import HostStore
from journal_helpers import open_test_journal

TEXT = "a note long enough that a few hundred of them pass the tip's interval " * 3


def _fill(j: Journal, nbytes: int, *, text: str = TEXT) -> None:
    """Append notes in groups until the journal grew by ``nbytes``."""
    start = j.size
    while j.size - start < nbytes:
        j.append_many([Note(text=text) for _ in range(50)])


def _state(j: Journal) -> tuple:
    return (j.size, j.count, j.clock, sorted((m, t.seq, t.digest, t.clock) for m, t in j._state.tails.items()),
            j._state.last)


def _full_read(path: Path) -> tuple:
    with open_test_journal(path, None) as j:
        return _state(j)


@pytest.fixture
def journal(tmp_path: Path) -> tuple[Path, Path]:
    """A journal with a tip, two machines' lines in it, longer than TIP_EVERY."""
    path, tip = tmp_path / "journal.jsonl", tmp_path / "tips" / "agent"
    with open_test_journal(path, "host-a", tip_path=tip) as a:
        _fill(a, TIP_EVERY // 2)
        with open_test_journal(path, "host-b", prefix=1, tip_path=tip) as b:
            b.append(Note(text="b was here"))
            b.append(ModelSwitch(provider="openai", model="gpt-x"))
        _fill(a, TIP_EVERY)
    return path, tip


def test_a_journal_writes_its_tip_and_reopens_from_it(journal: tuple[Path, Path]) -> None:
    path, tip_path = journal
    tip = load_tip(str(tip_path))
    assert tip is not None and set(tip.tails) == {"host-a", "host-b"}
    assert stat.S_IMODE(os.stat(tip_path).st_mode) == 0o600
    size = path.stat().st_size
    assert size - TIP_EVERY <= tip.size <= size  # written every TIP_EVERY bytes, of whole lines
    assert path.read_bytes()[tip.size - 1 : tip.size] == b"\n"
    assert tip.model == ("openai", "gpt-x")
    with open_test_journal(path, "host-a", tip_path=tip_path) as j:
        assert _state(j) == _full_read(path)
        j.append(Note(text="after"))
    verify_lines(path.read_bytes().splitlines())  # raises if the chains do not verify


def test_opening_from_the_tip_reads_only_what_came_after_it(journal: tuple[Path, Path]) -> None:
    """The documented limit of the check: a line before the tip that is no
    machine's last line is not read again (verify reads every line)."""
    path, tip_path = journal
    data = bytearray(path.read_bytes())
    nl = data.index(b"\n", 1000)
    end = data.index(b"\n", nl + 1)
    data[nl + 1 : end] = b"x" * (end - nl - 1)  # line 2-ish made unreadable, same length
    path.write_bytes(bytes(data))
    with pytest.raises(FormatError, match="line"):
        with open_test_journal(path, "host-a"):  # without the tip: every line is read
            pass
    with open_test_journal(path, "host-a", tip_path=tip_path) as j:  # with it: only the bytes after the tip
        j.append(Note(text="after"))


def _damage_checksum(path: Path, tip: Path) -> None:
    data = bytearray(tip.read_bytes())
    data[10] ^= 1
    tip.write_bytes(bytes(data))


def _rewrite_last_line(path: Path, tip: Path) -> None:
    """The tip's last line, rewritten in place (same length)."""
    t = load_tip(str(tip))
    assert t is not None
    data = path.read_bytes()
    start = data.rfind(b"\n", 0, t.size - 1) + 1
    path.write_bytes(data[:start] + data[start:].replace(b"a note", b"A note", 1))


def _cut_below_tip(path: Path, tip: Path) -> None:
    t = load_tip(str(tip))
    assert t is not None
    data = path.read_bytes()
    path.write_bytes(data[: data.rfind(b"\n", 0, t.size - 1) + 1])


def _another_journals_tip(path: Path, tip: Path) -> None:
    other = path.parent / "other.jsonl"
    with open_test_journal(other, "host-a", prefix=7, tip_path=tip) as j:
        _fill(j, TIP_EVERY + 1, text="other " * 40)
    assert path.stat().st_size >= load_tip(str(tip)).size  # type: ignore[union-attr]


def _edit_other_machines_line(path: Path, tip: Path) -> None:
    t = load_tip(str(tip))
    assert t is not None
    at = t.tails["host-b"].at
    data = bytearray(path.read_bytes())
    data[at : at + 400] = data[at : at + 400].replace(b"gpt-x", b"gpt-y", 1)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("spoil", [_damage_checksum, _rewrite_last_line, _cut_below_tip, _another_journals_tip,
                                   _edit_other_machines_line])
def test_a_tip_that_does_not_match_is_not_used(journal: tuple[Path, Path], spoil, caplog) -> None:
    path, tip_path = journal
    spoil(path, tip_path)
    with caplog.at_level(logging.WARNING):
        with open_test_journal(path, "host-a", tip_path=tip_path) as j:
            assert _state(j) == _full_read(path)
            j.append(Note(text="after"))
    assert any("tip" in r.getMessage() and "reading the journal whole" in r.getMessage() for r in caplog.records)
    lines = path.read_bytes().splitlines()
    if spoil is not _rewrite_last_line and spoil is not _edit_other_machines_line:
        verify_lines(lines)
    tip = load_tip(str(tip_path))  # a fresh tip, that matches again
    with open(path, "rb") as f:
        from capsulefs.core.journal.tip import mismatch

        assert tip is not None and mismatch(f.fileno(), tip, path.stat().st_size) is None


def test_a_tip_lists_each_machines_last_line_where_it_is(journal: tuple[Path, Path]) -> None:
    path, tip_path = journal
    tip = load_tip(str(tip_path))
    assert tip is not None
    data = path.read_bytes()
    for machine, t in tip.tails.items():
        line = data[t.at : data.index(b"\n", t.at)]
        assert hashlib.sha256(line).hexdigest() == t.digest and f'"machine":"{machine}"'.encode() in line


@pytest.mark.skipif(not sha256_state.available(), reason="no resumable sha256 here")
def test_the_mounts_journal_digest_starts_from_the_tip(journal: tuple[Path, Path]) -> None:
    path, tip_path = journal
    with open_test_journal(path, "host-a", tip_path=tip_path) as j:
        j.append(Note(text="one more, after the tip"))
    follower = JournalTail(str(path), tip_path=str(tip_path))
    follower.refresh()
    data = path.read_bytes()
    assert follower.sha256() == hashlib.sha256(data).hexdigest()
    assert follower.events == data.count(b"\n") and follower.model == ("openai", "gpt-x")
    with open(path, "ab") as f:
        f.write(b'{"half a line')  # a line being written is not yet part of it
    follower.refresh()
    assert follower.sha256() == hashlib.sha256(data).hexdigest()


def test_the_mounts_follower_without_a_matching_tip_hashes_the_file(journal: tuple[Path, Path], caplog) -> None:
    path, tip_path = journal
    _rewrite_last_line(path, tip_path)
    follower = JournalTail(str(path), tip_path=str(tip_path))
    with caplog.at_level(logging.WARNING):
        follower.refresh()
    assert follower.sha256() == hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_tip_in_a_store_goes_with_its_agent(store: HostStore) -> None:
    from capsulefs.core.journal.file import open_agent_journal

    agent = store.create_agent("tipped", host_id="host-a", agent_id="ab" * 16)
    with open_agent_journal(agent, machine="host-a", now=lambda: 1.0, new_id=lambda: os.urandom(12).hex()) as j:
        _fill(j, TIP_EVERY)
    tip = journal_tip_path(store.root, agent.agent_id)
    assert os.path.exists(tip)
    assert fmt.MANIFEST in os.listdir(agent.dir) and not any("tip" in f for f in agent.local_files())
    store.remove_agent(agent.agent_id)
    assert not os.path.exists(tip)


def test_tip_bytes_round_trip(journal: tuple[Path, Path]) -> None:
    _path, tip_path = journal
    data = tip_path.read_bytes()
    assert tip_bytes(parse_tip(data)) == data
    for bad in (b"", b"{}\n", data[:-5], data.replace(b'"v":1', b'"v":2'), b"\xff\n00\n"):
        with pytest.raises(FormatError):
            parse_tip(bad)


@pytest.mark.skipif(not sha256_state.available(), reason="no resumable sha256 here")
@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 1000])
def test_a_saved_sha256_state_resumes_only_for_the_bytes_it_covers(n: int) -> None:
    data = bytes(range(256)) * 8
    h = sha256_state.Sha256State()
    h.update(data[:n])
    saved = h.state()
    assert sha256_state.covers(saved) == n
    resumed = sha256_state.resume(saved, sha256_state.library(), n)
    assert resumed is not None
    resumed.update(data[n:])
    assert resumed.hexdigest() == hashlib.sha256(data).hexdigest()
    assert sha256_state.resume(saved, sha256_state.library(), n + 1) is None
    # a damaged partial-block length is never handed to OpenSSL
    spoiled = saved[:104] + (200).to_bytes(4, "little") + saved[108:]
    assert sha256_state.covers(spoiled) is None
    assert sha256_state.resume(spoiled, sha256_state.library(), n) is None
