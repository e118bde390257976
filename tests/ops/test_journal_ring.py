"""The write-ahead ring: appends of the store's journals are durable in a
fixed-size side file (an overwrite in place), and a crash that keeps them
from the journal file is repaired from it.

A crash is simulated as a power loss: the journal keeps only what it had
made durable by itself (the ring's chain starts there), perhaps plus part of
what followed (cut mid-line), perhaps as zeros. Everything is real: files,
processes, SIGKILL.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from capsulefs.core.capsule import format as fmt
from capsulefs.core.errors import FormatError
from capsulefs.core.journal import lease as journal_lease
from capsulefs.core.journal.events import Note
from capsulefs.core.journal.recovery import RingMismatch
from capsulefs.core.journal.file import open_agent_journal, open_journal
from capsulefs.core.journal.lines import split_lines, verify_lines
from capsulefs.core.journal.ring import HEADER, Ring
from capsulefs.core.store.agent import AgentHandle
from capsulefs.core.store.host_store import HostStore

from helpers import wait_until
from journal_helpers import LeaseClock

HOST = "host-a"
T0 = 1_764_684_000.0


def _ids(prefix: int = 0):
    counter = itertools.count(1)
    return lambda: f"{prefix:08x}{next(counter):016x}"


def _agent(store: HostStore, name: str = "ringo", agent_id: str = "a" * 32) -> AgentHandle:
    return store.create_agent(name, host_id=HOST, agent_id=agent_id)


def _open(agent: AgentHandle, machine: str | None = HOST, prefix: int = 0):
    return open_agent_journal(agent, machine=machine, now=lambda: T0, new_id=_ids(prefix))


def _small_ring(agent: AgentHandle, size: int) -> None:
    """Create the agent's ring at ``size`` bytes before anything opens it (an
    existing ring keeps its size)."""
    ring = Ring.open(agent.ring_path, create=True, size=size)
    assert ring is not None
    ring.close()


def _chain(agent: AgentHandle):
    return _ring_chain(agent.ring_path)


def _ring_chain(path: str):
    ring = Ring.open(path, create=False)
    assert ring is not None
    try:
        return ring.scan()
    finally:
        ring.close()


def _power_loss(agent: AgentHandle, *, keep: int = 0, zeros: bool = False) -> int:
    """Cut the journal back to what it had made durable by itself (where the
    ring's chain starts), keeping ``keep`` more bytes; with ``zeros``, the lost
    bytes come back as zeros (a grown file whose data never reached the disk).
    Returns the size cut to."""
    path = agent.path(fmt.JOURNAL)
    size = os.path.getsize(path)
    cut = min(size, _chain(agent)[0].offset + keep)
    with open(path, "r+b") as f:
        f.truncate(cut)
        if zeros:
            f.seek(cut)
            f.write(bytes(size - cut))
    return cut


def _lines(agent: AgentHandle) -> list[bytes]:
    data = agent.read(fmt.JOURNAL)
    lines = split_lines(data)
    assert verify_lines(lines) == []
    return lines


def _recovery(store: HostStore, agent: AgentHandle) -> list[str]:
    d = agent.recovery_dir
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


def _append_notes(j, n: int, tag: str = "e", size: int = 0) -> list[str]:
    ids = []
    for i in range(n):
        text = f"{tag}{i} " + "x" * (size if i % 3 == 2 else 0)
        if i % 7 == 6:
            ids += [r.id for r in j.append_many([Note(text=text), Note(text=text + "/b")])]
        else:
            ids.append(j.append(Note(text=text)).id)
    return ids


# -- acknowledged appends survive losing the journal's unsynced tail ----------------


@pytest.mark.parametrize("keep", [0, 1, 57, 2000])
def test_acked_appends_survive_a_power_loss(tmp_path: Path, keep: int, caplog: pytest.LogCaptureFixture) -> None:
    store = HostStore.open(tmp_path / "state")
    agent = _agent(store)
    with _open(agent) as j:
        acked = _append_notes(j, 40, size=300)
        assert j.checkpoints == 1  # only the first append synced the journal itself
        before = agent.read(fmt.JOURNAL)
    cut = _power_loss(agent, keep=keep)
    assert cut < len(before)
    reopened = HostStore.open(tmp_path / "state")  # the store replays every ring at open
    assert agent.read(fmt.JOURNAL) == before
    assert [line for line in _lines(agent)] == split_lines(before)
    assert _recovery(reopened, agent) == []  # nothing was torn that had not been acknowledged
    assert "restored" in caplog.text
    assert _chain(agent) == []  # the ring was reset once the journal held and synced it all
    with _open(agent) as j:
        assert j.count == len(acked)
        j.append(Note(text="after"))
    assert len(_lines(agent)) == len(acked) + 1


def test_a_zero_filled_tail_is_replaced_by_the_ring(tmp_path: Path) -> None:
    store = HostStore.open(tmp_path / "state")
    agent = _agent(store)
    with _open(agent) as j:
        _append_notes(j, 20)
        before = agent.read(fmt.JOURNAL)
    _power_loss(agent, keep=30, zeros=True)
    assert agent.read(fmt.JOURNAL) != before and len(agent.read(fmt.JOURNAL)) == len(before)
    with _open(agent) as j:  # opening the journal replays too
        assert j.count == len(split_lines(before))
    assert agent.read(fmt.JOURNAL) == before
    (saved,) = _recovery(store, agent)
    assert saved.startswith("timeline_events.jsonl.torn-")
    assert set(Path(agent.recovery_dir, saved).read_bytes()) == {0}


def test_a_lost_page_in_the_middle_is_restored_from_the_ring(tmp_path: Path) -> None:
    """Delayed allocation can leave a page unwritten while later pages reached
    the disk: a zero hole inside the ring's range, real bytes after it. Every
    byte is the ring's or zero, so the ring fills the hole."""
    store = HostStore.open(tmp_path / "state")
    agent = _agent(store)
    with _open(agent) as j:
        _append_notes(j, 60, size=200)
        before = agent.read(fmt.JOURNAL)
    start = _chain(agent)[0].offset
    assert len(before) - start > 3 * 4096
    hole = (start // 4096 + 1) * 4096
    with open(agent.path(fmt.JOURNAL), "r+b") as f:
        f.seek(hole)
        f.write(bytes(4096))
    HostStore.open(tmp_path / "state")  # the store's open replays every ring
    assert agent.read(fmt.JOURNAL) == before
    (saved,) = _recovery(store, agent)
    assert Path(agent.recovery_dir, saved).read_bytes().count(0) >= 4096


def test_unacknowledged_lines_beyond_the_ring_are_kept_and_a_torn_tail_moved(tmp_path: Path) -> None:
    store = HostStore.open(tmp_path / "state")
    agent = _agent(store)
    with _open(agent) as j:
        _append_notes(j, 10)
    acked = agent.read(fmt.JOURNAL)
    # Past the ring's chain: a whole line its ring never vouched for (written
    # here without the ring), then half of a line (a write cut by the crash).
    path = agent.path(fmt.JOURNAL)
    with open_journal(path, machine=HOST, now=lambda: T0, new_id=_ids(9), recovery_dir=tmp_path / "x") as other:
        extra = other.append(Note(text="whole, never acknowledged here")).line + b"\n"
    with open(path, "ab") as f:
        f.write(b'{"clock":99,"id":"torn')
    # The ring vouches for less than the file holds: nothing to restore.
    HostStore.open(tmp_path / "state")
    with _open(agent) as j:
        assert j.count == len(split_lines(acked)) + 1
    assert agent.read(fmt.JOURNAL) == acked + extra
    (saved,) = _recovery(store, agent)
    assert Path(agent.recovery_dir, saved).read_bytes() == b'{"clock":99,"id":"torn'


# -- the ring itself: wrap, torn and stale records ------------------------------------


def test_the_ring_wraps_and_every_pass_recovers(tmp_path: Path) -> None:
    store = HostStore.open(tmp_path / "state")
    agent = _agent(store)
    _small_ring(agent, 4096)
    with _open(agent) as j:
        acked = _append_notes(j, 300, size=200)
        assert j.checkpoints > 10  # it filled the 4 KiB ring many times
        assert os.path.getsize(agent.ring_path) == 4096
        before = agent.read(fmt.JOURNAL)
    chain = _chain(agent)
    assert chain[0].pos == 0 and chain[-1].offset + len(chain[-1].data) == len(before)
    _power_loss(agent, keep=5)
    HostStore.open(tmp_path / "state")
    assert agent.read(fmt.JOURNAL) == before
    assert len(_lines(agent)) == len(acked)


def test_a_chain_that_ends_exactly_at_the_rings_end_recovers_and_then_restarts(tmp_path: Path) -> None:
    store = HostStore.open(tmp_path / "state")
    agent = _agent(store)
    _small_ring(agent, 4096)
    with _open(agent) as j:
        j.append(Note(text="a"))
        j.append(Note(text="b"))
        second = _chain(agent)[-1]
        free = 4096 - (second.pos + HEADER.size + len(second.data))
        # A third line differs from the second only by its text (same digits
        # in seq and clock, same id length): size it to fill the ring exactly.
        text = "x" * (free - HEADER.size - len(second.data) + 1)
        j.append(Note(text=text))
        chain = _chain(agent)
        assert [e.pos for e in chain][0] == 0 and len(chain) == 3
        assert chain[-1].pos + HEADER.size + len(chain[-1].data) == 4096  # not a byte to spare
        assert j.checkpoints == 1  # the first append only: the full ring did not restart
        before = agent.read(fmt.JOURNAL)
    _power_loss(agent, keep=7)
    HostStore.open(tmp_path / "state")  # the headers' reading stops at the ring's end, not past it
    assert agent.read(fmt.JOURNAL) == before
    assert len(_lines(agent)) == 3
    with _open(agent) as j:
        j.append(Note(text="after"))  # the checked chain was reset: this one starts a new pass
        assert j.checkpoints == 1
        after = agent.read(fmt.JOURNAL)
    chain = _chain(agent)
    assert [e.pos for e in chain] == [0] and chain[0].offset == len(before)
    _power_loss(agent)
    HostStore.open(tmp_path / "state")
    assert agent.read(fmt.JOURNAL) == after


def test_stale_records_of_an_earlier_pass_are_not_replayed(tmp_path: Path) -> None:
    store = HostStore.open(tmp_path / "state")
    agent = _agent(store)
    _small_ring(agent, 8192)
    with _open(agent) as j:
        _append_notes(j, 25, size=100)  # fills most of the ring
        chain = _chain(agent)
        # Exactly one more big-enough append restarts the ring at 0...
        while _chain(agent)[0].offset == chain[0].offset:
            j.append(Note(text="y" * 500))
        before = agent.read(fmt.JOURNAL)
    ring_bytes = Path(agent.ring_path).read_bytes()
    new = _chain(agent)
    assert len(new) == 1
    # ...and the old pass's records are still there after it, valid but stale.
    assert ring_bytes.count(b"\xffJR1", new[0].pos + HEADER.size + len(new[0].data)) >= 5
    _power_loss(agent)
    HostStore.open(tmp_path / "state")
    assert agent.read(fmt.JOURNAL) == before  # nothing duplicated, nothing missing
    _lines(agent)


@pytest.mark.parametrize("where", ["last", "middle"])
def test_a_torn_ring_record_ends_the_chain(tmp_path: Path, where: str) -> None:
    store = HostStore.open(tmp_path / "state")
    agent = _agent(store)
    with _open(agent) as j:
        _append_notes(j, 12)
    before = agent.read(fmt.JOURNAL)
    chain = _chain(agent)
    victim = chain[-1] if where == "last" else chain[len(chain) // 2]
    # Garbage in the middle of a record's data: a write the crash tore (never acknowledged).
    with open(agent.ring_path, "r+b") as f:
        f.seek(victim.pos + HEADER.size + len(victim.data) // 2)
        f.write(b"\x00garbage\x00")
    assert [e.pos for e in _chain(agent)] == [e.pos for e in chain if e.pos < victim.pos]
    _power_loss(agent)
    HostStore.open(tmp_path / "state")
    assert agent.read(fmt.JOURNAL) == before[: victim.offset]  # whole lines, up to the torn record
    _lines(agent)
    assert _recovery(store, agent) == []


def test_opening_the_store_reads_a_ring_whose_bytes_the_journal_holds_without_changing_either(tmp_path: Path) -> None:
    """Every store open checks every agent's ring (a daemon's rings stay
    full while it runs). When the journal holds every byte even the ring's
    headers alone vouch for, nothing is changed; a record torn in the middle
    of its data (its header intact) still ends the checked chain, and the
    journal that holds the whole chain is left as it is."""
    store = HostStore.open(tmp_path / "state")
    agent = _agent(store)
    with _open(agent) as j:
        _append_notes(j, 30)
    before, ring_before = agent.read(fmt.JOURNAL), Path(agent.ring_path).read_bytes()
    ring = Ring.open(agent.ring_path, create=False)
    assert ring is not None
    try:
        start, ino, data = ring.vouched()
        chain = ring.scan()
        assert (start, ino) == (chain[0].offset, chain[0].ino)
        assert data == b"".join(e.data for e in chain) == before[start:]
    finally:
        ring.close()
    HostStore.open(tmp_path / "state")
    assert agent.read(fmt.JOURNAL) == before and Path(agent.ring_path).read_bytes() == ring_before

    victim = chain[len(chain) // 2]
    with open(agent.ring_path, "r+b") as f:  # garbage in a record's data, its header intact
        f.seek(victim.pos + HEADER.size + len(victim.data) // 2)
        f.write(b"\x00garbage\x00")
    ring = Ring.open(agent.ring_path, create=False)
    assert ring is not None
    try:
        assert len(ring.vouched()[2]) == len(before) - start  # the headers still read as one chain
        assert [e.pos for e in ring.scan()] == [e.pos for e in chain if e.pos < victim.pos]
    finally:
        ring.close()
    HostStore.open(tmp_path / "state")
    assert agent.read(fmt.JOURNAL) == before  # held every checked byte: untouched
    _lines(agent)
    assert _recovery(store, agent) == []


# -- replaced journals, disagreements ----------------------------------------------------


@pytest.mark.expect_error_log
@pytest.mark.capsule_left_broken("the journal renamed over disagrees with its ring on purpose: export refuses it")
def test_a_journal_renamed_over_is_not_replayed_into(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = HostStore.open(tmp_path / "state")
    agent = _agent(store)
    with _open(agent) as j:
        _append_notes(j, 10)
    _power_loss(agent)
    # Someone puts another file (same bytes as the durable part) in its place by hand.
    path = agent.path(fmt.JOURNAL)
    shutil.copyfile(path, path + ".new")
    os.rename(path + ".new", path)
    journal_before, ring_before = agent.read(fmt.JOURNAL), Path(agent.ring_path).read_bytes()
    HostStore.open(tmp_path / "state")  # logs, does not guess
    with pytest.raises(RingMismatch, match="inode"):
        _open(agent)
    assert agent.read(fmt.JOURNAL) == journal_before
    assert Path(agent.ring_path).read_bytes() == ring_before
    assert "disagrees with its write-ahead ring" in caplog.text and agent.ring_path in caplog.text
    with _open(agent, machine=None) as reader:  # reading still works
        assert reader.read() == journal_before


def test_a_copy_holding_every_acked_byte_drops_the_ring(tmp_path: Path) -> None:
    # The state directory copied elsewhere (all inodes change) while nothing was lost.
    store = HostStore.open(tmp_path / "state")
    agent = _agent(store)
    with _open(agent) as j:
        _append_notes(j, 10)
    before = agent.read(fmt.JOURNAL)
    shutil.copytree(tmp_path / "state", tmp_path / "copy")
    copy = HostStore.open(tmp_path / "copy").agent(agent.agent_id)
    assert _chain(copy) == []
    with _open(copy) as j:
        j.append(Note(text="in the copy"))
    assert copy.read(fmt.JOURNAL).startswith(before)


def test_a_journal_replaced_through_the_store_never_sees_the_old_ring(tmp_path: Path) -> None:
    store = HostStore.open(tmp_path / "state")
    agent = _agent(store)
    with _open(agent) as j:
        _append_notes(j, 10)
        old_lines = _lines(agent)
        agent.write_files({fmt.JOURNAL: b"\n".join(old_lines[:4]) + b"\n"})  # a rewrite (tests, repairs)
        assert _chain(agent) == []  # emptied under the journal's lock, before the rename
        j.append(Note(text="follows the new file"))  # the appender follows the replacement
        after = agent.read(fmt.JOURNAL)
    assert split_lines(after)[:4] == old_lines[:4] and len(split_lines(after)) == 5
    _power_loss(agent)
    HostStore.open(tmp_path / "state")
    assert agent.read(fmt.JOURNAL) == after
    _lines(agent)


@pytest.mark.expect_error_log
@pytest.mark.parametrize("damage", ["differs", "shorter"])
@pytest.mark.capsule_left_broken("the journal is made to disagree with its ring: export refuses it")
def test_a_journal_that_disagrees_with_its_ring_is_refused(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = HostStore.open(tmp_path / "state")
    agent = _agent(store)
    with _open(agent) as j:
        _append_notes(j, 3)
        j.append(Note(text="forces a checkpoint later"))
    with _open(agent, prefix=5) as j:  # another process: a new chain that starts past the first lines
        _append_notes(j, 3, tag="f")
    start = _chain(agent)[0].offset
    assert start > 0
    path = agent.path(fmt.JOURNAL)
    with open(path, "r+b") as f:
        if damage == "differs":
            f.truncate(start + 20)
            f.seek(start + 5)
            f.write(b"X")
        else:
            f.truncate(start - 10)
    journal_before, ring_before = agent.read(fmt.JOURNAL), Path(agent.ring_path).read_bytes()
    with pytest.raises(RingMismatch) as info:
        _open(agent)
    assert path in str(info.value) and agent.ring_path in str(info.value)
    HostStore.open(tmp_path / "state")
    assert agent.read(fmt.JOURNAL) == journal_before
    assert Path(agent.ring_path).read_bytes() == ring_before
    assert caplog.text.count("disagrees with its write-ahead ring") >= 2


# -- the store: recovery at open, rings of removed and installed agents --------------------


def test_store_open_recovers_every_agent_and_remove_agent_removes_the_ring(tmp_path: Path) -> None:
    store = HostStore.open(tmp_path / "state")
    agents = [_agent(store, f"a{k}", f"{k:x}" * 32) for k in range(3)]
    before = {}
    for k, agent in enumerate(agents):
        with _open(agent, prefix=k) as j:
            _append_notes(j, 5 + k)
        before[agent.agent_id] = agent.read(fmt.JOURNAL)
        _power_loss(agent, keep=k * 13)
    reopened = HostStore.open(tmp_path / "state")
    for agent in agents:
        assert agent.read(fmt.JOURNAL) == before[agent.agent_id]
    ring = agents[0].ring_path
    assert os.path.exists(ring)
    reopened.remove_agent(agents[0].agent_id)
    assert not os.path.exists(ring)
    assert os.listdir(os.path.dirname(ring)) == sorted(a.agent_id for a in agents[1:])


def test_installing_an_agent_drops_a_ring_left_by_its_earlier_stay(tmp_path: Path) -> None:
    from capsulefs.core.capsule.archive import export_agent, import_tar

    store = HostStore.open(tmp_path / "state")
    agent = _agent(store)
    with _open(agent) as j:
        _append_notes(j, 5)
    export_agent(agent, str(tmp_path / "ringo.tar"), mtime=0)
    stale = Path(agent.ring_path).read_bytes()
    store.remove_agent(agent.agent_id)
    Path(agent.ring_path).write_bytes(stale)  # as if the removal had crashed before dropping it
    back = import_tar(store, str(tmp_path / "ringo.tar"))
    assert not os.path.exists(back.ring_path)
    with _open(back) as j:
        j.append(Note(text="back"))
    assert len(_lines(back)) == 6


def test_export_replays_the_ring_first(tmp_path: Path) -> None:
    from capsulefs.core.capsule.archive import snapshot_files

    store = HostStore.open(tmp_path / "state")
    agent = _agent(store)
    with _open(agent) as j:
        _append_notes(j, 8)
    before = agent.read(fmt.JOURNAL)
    _power_loss(agent, keep=3)  # (a crash while this store stays open cannot happen; the call is what counts)
    assert snapshot_files(agent)[fmt.JOURNAL] == before
    assert agent.read(fmt.JOURNAL) == before


def test_plain_journals_have_no_ring(tmp_path: Path) -> None:
    path = tmp_path / "timeline_events.jsonl"
    with open_journal(path, machine=HOST, now=lambda: T0, new_id=_ids(), recovery_dir=tmp_path / "rec") as j:
        j.append(Note(text="plain"))
        assert j.ring_path is None and j.checkpoints == 0
    assert sorted(os.listdir(tmp_path)) == ["timeline_events.jsonl"]


# -- real processes ---------------------------------------------------------------------------

CHILD = r"""
import itertools, os, sys
from capsulefs.core.errors import FormatError
from capsulefs.core.journal.events import Note
from capsulefs.core.journal.file import open_agent_journal
from capsulefs.core.store.host_store import HostStore
root, agent_id, count, tag = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
ids = itertools.count(1)
agent = HostStore.open(root).agent(agent_id)
j = open_agent_journal(agent, machine="host-a", now=lambda: 1764684000.0,
                       new_id=lambda: f"{os.getpid():08x}{next(ids):016x}")
print("ready", flush=True)
for i in range(count):
    text = f"{tag}-{i} " + ("x" * 3000 if i % 3 == 2 else "")
    recs = j.append_many([Note(text=text), Note(text=text + "/b")]) if i % 5 == 4 else [j.append(Note(text=text))]
    print(" ".join(f"{r.seq}:{r.id}" for r in recs), flush=True)
"""


def _spawn(root: Path, agent_id: str, count: int, tag: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", CHILD, str(root), agent_id, str(count), tag],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_sigkill_then_power_loss_keeps_every_printed_seq(tmp_path: Path) -> None:
    root = tmp_path / "state"
    store = HostStore.open(root)
    agent = _agent(store)
    _small_ring(agent, 64 << 10)  # wraps every few dozen appends
    acked: set[tuple[int, str]] = set()
    for round_ in range(4):
        child = _spawn(root, agent.agent_id, 100_000, f"r{round_}")
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        for _ in range(30 + 25 * round_):
            line = child.stdout.readline()
            assert line, child.stderr.read() if child.stderr else ""
            acked.update((int(s), i) for s, i in (w.split(":") for w in line.split()))
        child.send_signal(signal.SIGKILL)
        rest, _err = child.communicate()
        for line in rest.splitlines():
            acked.update((int(s), i) for s, i in (w.split(":") for w in line.split()))
        assert child.returncode == -signal.SIGKILL
        _power_loss(agent, keep=round_ * 101)  # and the machine lost what the journal had not synced
        HostStore.open(root)
        records = _records(agent)
        have = {(r.seq, r.id) for r in records}
        assert acked <= have, f"round {round_}: lost {sorted(acked - have)[:3]}"
        assert [r.seq for r in records] == list(range(1, len(records) + 1))


def _records(agent: AgentHandle):
    from capsulefs.core.journal.record import Record

    return [Record.from_line(x) for x in _lines(agent)]


def test_interleaved_appenders_with_rings_lose_nothing(tmp_path: Path) -> None:
    root = tmp_path / "state"
    store = HostStore.open(root)
    agent = _agent(store)
    children = [_spawn(root, agent.agent_id, 150, f"w{k}") for k in range(4)]
    acked: list[str] = []
    for child in children:
        out, err = child.communicate(timeout=180)
        assert child.returncode == 0, err
        acked += [w.split(":")[1] for line in out.splitlines()[1:] for w in line.split()]
    before = agent.read(fmt.JOURNAL)
    records = _records(agent)
    assert len(records) == len(acked) == 4 * 180  # 150 appends, every 5th a pair
    assert sorted(r.id for r in records) == sorted(acked)
    assert [r.seq for r in records] == list(range(1, 721))
    _power_loss(agent, keep=7)
    HostStore.open(root)
    assert agent.read(fmt.JOURNAL) == before


def test_threads_sharing_a_journal_write_one_record_per_group(tmp_path: Path) -> None:
    import threading

    store = HostStore.open(tmp_path / "state")
    agent = _agent(store)
    with _open(agent) as j:
        j.append(Note(text="first"))

        def writer(k: int) -> None:
            for i in range(40):
                j.append(Note(text=f"t{k}-{i}"))

        threads = [threading.Thread(target=writer, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert j.count == 241
        assert j.commits == len(_chain(agent)) < 241  # one ring record per group, no wrap
        before = agent.read(fmt.JOURNAL)
    _power_loss(agent)
    HostStore.open(tmp_path / "state")
    assert agent.read(fmt.JOURNAL) == before
    _lines(agent)


def test_a_stale_record_right_after_the_new_chain_is_not_replayed(tmp_path: Path) -> None:
    # Records of one size: after the ring restarts, the next slot holds a
    # whole, valid record of the previous pass, which must not join the chain.
    from capsulefs.core.journal.recovery import replay_ring

    journal = tmp_path / "journal"
    line = lambda i: f"{i:04d}".encode() + b"x" * 95 + b"\n"  # noqa: E731
    with open(journal, "wb") as f:
        f.write(b"".join(line(i) for i in range(10)))
    ino = os.stat(journal).st_ino
    ring = Ring.open(str(tmp_path / "ring"), create=True, size=10 * (HEADER.size + 100))
    assert ring is not None
    for i in range(10):
        ring.append(i * 100, ino, line(i), restart=i == 0)
    assert not ring.fits(100)
    ring.append(1000, ino, line(10), restart=True)  # the journal was synced up to 1000 first
    entries = ring.scan()
    assert [(e.pos, e.offset) for e in entries] == [(0, 1000)]
    ring.close()
    fd = os.open(journal, os.O_RDWR | os.O_APPEND)
    try:
        assert replay_ring(fd, str(journal), str(tmp_path / "ring"), str(tmp_path / "rec")) == 100
    finally:
        os.close(fd)
    assert journal.read_bytes() == b"".join(line(i) for i in range(11))


def test_path_identity_is_the_inode_and_device_of_stat(tmp_path: Path) -> None:
    from capsulefs.core.linuxfs import path_identity

    f = tmp_path / "f"
    f.write_bytes(b"x")
    st = os.stat(f)
    assert path_identity(str(f)) == (st.st_ino, st.st_dev)
    with pytest.raises(FileNotFoundError):
        path_identity(str(tmp_path / "missing"))


@pytest.mark.expect_error_log
def test_a_failed_fdatasync_stops_appends_until_reopened(tmp_path, monkeypatch, caplog) -> None:
    """Linux reports a failed write-back once: a retried fdatasync can return 0
    over pages that never reached the disk, and restarting the ring after it
    would overwrite the only durable copy. So after one failure the Journal
    refuses appends until it is reopened; reopening writes what the ring
    vouches for into the journal again and syncs it before the ring is
    reset (a replay alone found the journal's cached pages right, and
    left them undurable)."""
    import errno as _errno

    import capsulefs.core.journal.append as JA
    import capsulefs.core.journal.file as J
    import capsulefs.core.journal.recovery as JR
    from capsulefs.core.journal.events import Note

    path, ring = str(tmp_path / "j.jsonl"), str(tmp_path / "ring")
    ids = iter(range(10**6))
    opener = lambda: J.open_journal(path, machine="H", now=lambda: 1.0, new_id=lambda: f"{next(ids):024x}",  # noqa: E731
                                    recovery_dir=str(tmp_path / "rec"), ring_path=ring)
    j = opener()
    j.append(Note(text="kept"))

    def failing(fd: int) -> None:
        raise OSError(_errno.EIO, "Input/output error")

    monkeypatch.setattr(JA, "fdatasync", failing)
    j._ring.forget()  # the next append must checkpoint the journal itself: that fdatasync fails
    with pytest.raises(OSError):
        j.append(Note(text="lost"))
    monkeypatch.undo()
    with pytest.raises(OSError, match="reopen the journal"):
        j.append(Note(text="refused"))
    j.close()
    synced = []
    monkeypatch.setattr(JR, "fdatasync", lambda fd: (synced.append(fd), os.fdatasync(fd)))
    j2 = opener()
    monkeypatch.undo()
    assert len(synced) == 1 and _ring_chain(ring) == []  # written again and synced, then the ring reset
    j2.append(Note(text="after reopening"))
    texts = [json.loads(line).get("text") for line in j2.lines()]
    j2.close()
    assert texts == ["kept", "after reopening"]
    assert "no more appends until it is reopened" in caplog.text


def test_a_ring_that_cannot_be_created_leaves_no_temp_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A disk too full for the ring: each append fell back to syncing the
    journal, but left the half-written ring behind as a .tmp- file, which ate
    the space freed meanwhile until the journal itself hit ENOSPC. The file
    size limit stands in for a full disk (EFBIG instead of ENOSPC)."""
    import resource

    path, ring = str(tmp_path / "j.jsonl"), str(tmp_path / "wal" / "ring")
    j = open_journal(path, machine=HOST, now=lambda: T0, new_id=_ids(), recovery_dir=str(tmp_path / "rec"),
                     ring_path=ring)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, hard))  # Python ignores SIGXFSZ: writes get EFBIG
    try:
        for i in range(3):
            j.append(Note(text=f"n{i}"))  # the ring cannot be made: the journal syncs itself
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert "cannot open its write-ahead ring" in caplog.text
    assert os.listdir(tmp_path / "wal") == []
    j.append(Note(text="with the ring"))
    j.close()
    assert os.listdir(tmp_path / "wal") == ["ring"]
    assert len(split_lines((tmp_path / "j.jsonl").read_bytes())) == 4


def test_a_journal_cut_short_under_an_open_journal_gets_its_acked_lines_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A tool cuts the last lines off a journal that a Journal holds open.
    Its next append re-read the file, stamped seq 8 again (a fork of the
    acknowledged seq 8) and restarted the ring over the only copy of seqs
    8..10, which a reopen would have restored. Now it replays the ring
    first, as opening does."""
    store = HostStore.open(tmp_path / "state")
    agent = _agent(store)
    path = agent.path(fmt.JOURNAL)
    with _open(agent) as j:
        _append_notes(j, 10)
        before = agent.read(fmt.JOURNAL)
        lines = split_lines(before)
        os.truncate(path, sum(len(line) + 1 for line in lines[:-3]))
        rec = j.append(Note(text="after the cut"))
    assert rec.seq == len(lines) + 1
    after = _lines(agent)
    assert after[:-1] == lines
    assert "shrank" in caplog.text and "restored" in caplog.text


def test_appends_after_the_ring_is_deleted_under_an_open_journal_survive_a_power_loss(tmp_path: Path) -> None:
    """Someone deletes the ring file while a Journal has it open. Appends
    went on into the unlinked file (durable, but where no replay finds it)
    until the ring filled, so a power loss then lost them. Now the next
    append sees the ring is gone, syncs the journal and starts a new ring."""
    store = HostStore.open(tmp_path / "state")
    agent = _agent(store)
    with _open(agent) as j:
        _append_notes(j, 5)
        checkpoints = j.checkpoints
        os.unlink(agent.ring_path)
        _append_notes(j, 5, tag="after")
        assert os.path.exists(agent.ring_path) and j.checkpoints == checkpoints + 1
        before = agent.read(fmt.JOURNAL)
    _power_loss(agent)
    HostStore.open(tmp_path / "state")  # replays the ring
    assert agent.read(fmt.JOURNAL) == before


def test_appends_ask_no_file_for_its_timestamps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Since Linux 6.13 a stat() that returns a file's timestamps makes its
    next change take a fine-grained one: a stat of the ring between its
    O_DSYNC writes made each about 60 us slower (a quarter of an append).
    An append, with or without a lease, checks what it must through statx
    asking for the inode or link count alone: no stat, fstat or lstat."""
    store = HostStore.open(tmp_path / "state")
    agent = _agent(store)
    clock = LeaseClock()  # (the keeper's: a busy machine must not end a lease between two appends)
    monkeypatch.setattr(journal_lease, "_keeper", journal_lease.Keeper(clock=clock))
    with _open(agent) as j:
        j.lease_idle = 0.05
        _append_notes(j, 3)  # the second takes a lease, the third finds it

        def no_stat(*args: object, **kw: object) -> None:
            raise AssertionError(f"an append asked for timestamps: stat{args}")

        for name in ("stat", "fstat", "lstat"):
            monkeypatch.setattr(os, name, no_stat)
        try:
            for i in range(6):
                j.append(Note(text=f"leased {i}"))
                if i % 2:
                    clock.advance(1.0)  # idle: the keeper gives the flock back, and
                    wait_until(lambda: _flock_free(j.path), "the keeper to give the flock back")
                    # the next append takes the flock and checks the file again
        finally:
            monkeypatch.undo()  # (the keeper too: close() ends a lease itself)
        # leased: the third note, i = 0 and 1; then each pair takes the flock and the lease anew
        assert j.leased_commits == 3 and j.commits == 3 + 6


def _flock_free(path: str) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # (the flock, if taken, goes with it)
    return True


#: What a crash in a multi-page append can leave: a page never written
#: (zeros), then the end of a real line.
GARBAGE = bytes(5000) + b'ng text of a note that was being appended"}\n'


def _crash_garbage(agent: AgentHandle) -> None:
    with open(agent.path(fmt.JOURNAL), "ab") as f:
        f.write(GARBAGE)


def _assert_garbage_moved_aside(store: HostStore, agent: AgentHandle, acked: bytes,
                                caplog: pytest.LogCaptureFixture) -> None:
    """A writer's open cuts the garbage (to the recovery directory, logged),
    keeps every acknowledged line and appends after them."""
    with _open(agent) as j:
        assert j.lines() == split_lines(acked)
        j.append(Note(text="after"))
    assert len(_lines(agent)) == len(split_lines(acked)) + 1
    (saved,) = _recovery(store, agent)
    assert (Path(agent.recovery_dir) / saved).read_bytes() == GARBAGE
    assert "NUL bytes" in caplog.text


def test_a_crash_that_left_a_page_of_an_unacknowledged_append_unwritten_does_not_stop_the_journal(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Power lost in the middle of a multi-page append, before it was
    acknowledged: one of its pages reads back as zeros, a later one holds
    the end of a real line. That "line" (NULs, then a line's end) made
    every open fail with a FormatError until someone cut it by hand. It lies
    past the ring's chain, so it was never acknowledged: it is moved to the
    recovery directory like a torn tail, and the journal opens and appends."""
    store = HostStore.open(tmp_path / "state")
    agent = _agent(store)
    with _open(agent) as j:
        _append_notes(j, 5)
        acked = agent.read(fmt.JOURNAL)
    _crash_garbage(agent)
    _assert_garbage_moved_aside(store, agent, acked, caplog)


def test_a_crash_that_left_a_page_unwritten_right_after_the_ring_was_reset_does_not_stop_the_journal(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The same garbage when the ring holds no chain (a writer's open had
    synced the journal and reset the ring): every acknowledged line was
    then made durable by the journal's own fdatasync, which a crash cannot
    undo, so the garbage past where the journal was synced was never
    acknowledged. It made every open fail with a FormatError."""
    store = HostStore.open(tmp_path / "state")
    agent = _agent(store)
    with _open(agent) as j:
        _append_notes(j, 5)
    with _open(agent):  # a writer's open syncs the journal and resets the ring
        pass
    assert _chain(agent) == []
    acked = agent.read(fmt.JOURNAL)
    _crash_garbage(agent)
    HostStore.open(tmp_path / "state")  # a reader: leaves it
    assert agent.read(fmt.JOURNAL) == acked + GARBAGE
    _assert_garbage_moved_aside(store, agent, acked, caplog)


@pytest.mark.capsule_left_broken("the journal holds NUL bytes on purpose")
def test_nuls_in_bytes_the_journal_had_synced_are_refused_not_cut(tmp_path: Path) -> None:
    """NULs before the point the journal was synced to are damage to
    acknowledged data, not a crash's leftovers: opening refuses, naming the
    line, and moves nothing."""
    store = HostStore.open(tmp_path / "state")
    agent = _agent(store)
    with _open(agent) as j:
        _append_notes(j, 5)
    with _open(agent):
        pass
    path = agent.path(fmt.JOURNAL)
    first = len(split_lines(agent.read(fmt.JOURNAL))[0]) + 1
    with open(path, "r+b") as f:
        f.seek(first + 10)
        f.write(bytes(8))
    damaged = agent.read(fmt.JOURNAL)
    with pytest.raises(FormatError, match="line 2"):
        _open(agent)
    assert agent.read(fmt.JOURNAL) == damaged and _recovery(store, agent) == []
