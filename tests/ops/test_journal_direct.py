"""Ring records written with O_DIRECT|O_DSYNC: one write of the pages a
record covers, the chain's tail page rewritten with the bytes it holds.

Power loss is simulated as in test_journal_ring: the journal keeps only what
it synced by itself (plus perhaps part of the rest); every acknowledged line
must come back from the ring.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
from pathlib import Path

import pytest

from capsulefs.core.capsule import format as fmt
from capsulefs.core.journal import ring as journal_ring
from capsulefs.core.journal.events import Note
from capsulefs.core.journal.file import open_agent_journal, open_journal
from capsulefs.core.journal.lines import split_lines, verify_lines
from capsulefs.core.journal.ring import HEADER, Ring
from capsulefs.core.store.agent import AgentHandle
from capsulefs.core.store.host_store import HostStore

HOST = "host-a"
T0 = 1_764_684_000.0


def _ids(prefix: int = 0):
    counter = itertools.count(1)
    return lambda: f"{prefix:08x}{next(counter):016x}"


def _open(agent: AgentHandle, prefix: int = 0):
    return open_agent_journal(agent, machine=HOST, now=lambda: T0, new_id=_ids(prefix))


def _chain(agent: AgentHandle):
    ring = Ring.open(agent.ring_path, create=False)
    assert ring is not None
    try:
        return ring.scan()
    finally:
        ring.close()


def _power_loss(agent: AgentHandle, keep: int = 0) -> None:
    path = agent.path(fmt.JOURNAL)
    cut = min(os.path.getsize(path), _chain(agent)[0].offset + keep)
    os.truncate(path, cut)


def _lines(agent: AgentHandle) -> list[bytes]:
    lines = split_lines(agent.read(fmt.JOURNAL))
    assert verify_lines(lines) == []
    return lines


def _direct_supported(path: Path) -> bool:
    probe = path / "probe"
    probe.write_bytes(bytes(4096))
    try:
        os.close(journal_ring.open_direct(str(probe)))
    except OSError:
        return False
    finally:
        probe.unlink()
    return True


@pytest.fixture
def agent(tmp_path: Path) -> AgentHandle:
    if not _direct_supported(tmp_path):
        pytest.skip("the test directory's file system has no O_DIRECT")
    store = HostStore.open(tmp_path / "state")
    return store.create_agent("dio", host_id=HOST, agent_id="d" * 32)


def _small_ring(agent: AgentHandle, size: int) -> None:
    ring = Ring.open(agent.ring_path, create=True, size=size)
    assert ring is not None
    ring.close()


def test_the_store_ring_is_written_directly(agent: AgentHandle) -> None:
    import fcntl

    with _open(agent) as j:
        j.append(Note(text="one"))
        ring = j._ring
        assert ring is not None and ring.direct
        assert fcntl.fcntl(ring._direct.fd, fcntl.F_GETFL) & (os.O_DIRECT | os.O_DSYNC) == os.O_DIRECT | os.O_DSYNC


@pytest.mark.parametrize("keep", [0, 33, 5000])
def test_direct_appends_across_page_boundaries_survive_a_power_loss(agent: AgentHandle, keep: int) -> None:
    with _open(agent) as j:
        # Sizes chosen so records start and end at every offset of a page,
        # and some span more than one page.
        for i in range(120):
            j.append(Note(text=f"n{i} " + "y" * ((i * 397) % 5000)))
        assert j._ring is not None and j._ring.direct
        assert j.checkpoints == 1
        before = agent.read(fmt.JOURNAL)
    chain = _chain(agent)
    assert len(chain) == 120 and chain[0].pos == 0
    assert b"".join(e.data for e in chain) == before[chain[0].offset :]
    assert any(e.pos // 4096 != (e.pos + HEADER.size + len(e.data)) // 4096 for e in chain)
    _power_loss(agent, keep=keep)
    HostStore.open(agent.store.root)
    assert agent.read(fmt.JOURNAL) == before
    assert len(_lines(agent)) == 120


def test_direct_chain_continues_across_ring_restarts(agent: AgentHandle) -> None:
    _small_ring(agent, 16384)
    with _open(agent) as j:
        for i in range(200):
            j.append(Note(text=f"r{i} " + "z" * ((i * 131) % 900)))
        assert j._ring is not None and j._ring.direct
        assert j.checkpoints > 5  # it filled and restarted the ring many times
        before = agent.read(fmt.JOURNAL)
    chain = _chain(agent)
    assert chain[0].pos == 0 and chain[-1].offset + len(chain[-1].data) == len(before)
    _power_loss(agent, keep=11)
    HostStore.open(agent.store.root)
    assert agent.read(fmt.JOURNAL) == before
    assert len(_lines(agent)) == 200


def test_two_journals_interleaving_on_one_ring(agent: AgentHandle) -> None:
    # Two appenders (as two processes would be: each its own Journal and
    # Ring) take turns: each turn the other one's chain is no longer its own
    # to continue, so it checkpoints and restarts the ring, and the kept
    # tail page of its earlier chain must never be written back.
    _small_ring(agent, 8192)
    a, b = _open(agent, prefix=1), _open(agent, prefix=2)
    try:
        for turn in range(30):
            j = a if turn % 2 == 0 else b
            for i in range(1 + turn % 4):
                j.append(Note(text=f"t{turn}-{i} " + "w" * (turn * 37 % 700)))
        assert a._ring is not None and a._ring.direct and b._ring is not None and b._ring.direct
        b.refresh()
        before = agent.read(fmt.JOURNAL)
        assert b.count == len(split_lines(before)) == sum(1 + t % 4 for t in range(30))
    finally:
        a.close()
        b.close()
    _power_loss(agent, keep=3)
    HostStore.open(agent.store.root)
    assert agent.read(fmt.JOURNAL) == before
    _lines(agent)


def test_a_lost_tail_image_is_read_back(agent: AgentHandle) -> None:
    with _open(agent) as j:
        for i in range(5):
            j.append(Note(text=f"a{i}"))
        assert j._ring is not None and j._ring._direct is not None
        j._ring._direct.image_end = -1  # as if the buffer did not hold the tail page
        for i in range(5):
            j.append(Note(text=f"b{i}"))
        before = agent.read(fmt.JOURNAL)
    assert len(_chain(agent)) == 10
    _power_loss(agent)
    HostStore.open(agent.store.root)
    assert agent.read(fmt.JOURNAL) == before


def test_without_o_direct_the_ring_falls_back_to_fdatasync(
    agent: AgentHandle, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(path: str) -> int:
        raise OSError(errno.EINVAL, "Invalid argument", path)

    monkeypatch.setattr(journal_ring, "open_direct", refuse)
    monkeypatch.setattr(journal_ring, "_fallback_noted", False)
    caplog.set_level(logging.INFO, logger=journal_ring.__name__)
    with _open(agent) as j:
        for i in range(30):
            j.append(Note(text=f"f{i} " + "v" * (i * 211 % 3000)))
        assert j._ring is not None and not j._ring.direct
        before = agent.read(fmt.JOURNAL)
    assert caplog.text.count("pwrite + fdatasync instead") == 1
    _power_loss(agent, keep=9)
    HostStore.open(agent.store.root)
    assert agent.read(fmt.JOURNAL) == before


def test_a_refused_first_direct_write_falls_back(agent: AgentHandle, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.pwrite
    refused = []

    def pwrite(fd: int, data, offset: int) -> int:
        if fd == direct_fd[0]:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    direct_fd = [-1]
    real_open = journal_ring.open_direct

    def open_direct(path: str) -> int:
        direct_fd[0] = real_open(path)
        return direct_fd[0]

    monkeypatch.setattr(journal_ring, "open_direct", open_direct)
    monkeypatch.setattr(os, "pwrite", pwrite)
    with _open(agent) as j:
        for i in range(10):
            j.append(Note(text=f"e{i}"))
        assert j._ring is not None and not j._ring.direct and refused == [0]
        before = agent.read(fmt.JOURNAL)
    monkeypatch.undo()
    _power_loss(agent)
    HostStore.open(agent.store.root)
    assert agent.read(fmt.JOURNAL) == before


@pytest.mark.expect_error_log
def test_a_failed_direct_write_stops_appends_until_reopened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    if not _direct_supported(tmp_path):
        pytest.skip("the test directory's file system has no O_DIRECT")
    path, ring_path = str(tmp_path / "j.jsonl"), str(tmp_path / "ring")
    ids = iter(range(10**6))

    def opener():
        return open_journal(path, machine="H", now=lambda: 1.0, new_id=lambda: f"{next(ids):024x}",
                            recovery_dir=str(tmp_path / "rec"), ring_path=ring_path)

    j = opener()
    j.append(Note(text="kept"))
    assert j._ring is not None and j._ring._direct is not None
    direct_fd = j._ring._direct.fd
    real = os.pwrite

    def pwrite(fd: int, data, offset: int) -> int:
        if fd == direct_fd:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    with pytest.raises(OSError):
        j.append(Note(text="lost"))
    monkeypatch.undo()
    with pytest.raises(OSError, match="reopen the journal"):
        j.append(Note(text="refused"))
    j.close()
    j2 = opener()
    j2.append(Note(text="after reopening"))
    texts = [r.event.text for r in j2.records()]
    j2.close()
    assert texts == ["kept", "after reopening"]
    assert "no more appends until it is reopened" in caplog.text
