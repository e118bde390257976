"""The lease: a journal keeps its flock between appends, and gives it back.

Real files, real flocks, a real second process; the keeper is the
process's own thread. Its clock is the test's (``lease_clock``) where a
lease must be seen held or over: with real time, a busy machine that
paused the test for a lease's few milliseconds decided the outcome.
Bounds on waiting are liveness bounds (seconds), not speed targets.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from capsulefs.core.capsule import format as fmt
from capsulefs.core.errors import FormatError, NotFoundError
from capsulefs.core.journal import lease as journal_lease
from capsulefs.core.journal.events import Note
from capsulefs.core.journal.record import Record
from capsulefs.core.journal.file import open_agent_journal, open_journal
from capsulefs.core.journal.lines import split_lines, verify_lines
from capsulefs.core.store.host_store import HostStore

from helpers import HANG, wait_until
from journal_helpers import T0, LeaseClock, id_source, open_test_journal

HOST = "host-a"


def _try_flock(path: Path) -> bool:
    """Whether another open file description gets the journal's flock right now."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return True
    finally:
        os.close(fd)


@pytest.fixture
def lease_clock(monkeypatch: pytest.MonkeyPatch) -> LeaseClock:
    """The process's lease keeper, on a clock that moves only when the test
    says so. (Its thread still waits in real time, ``lease_idle`` at a time,
    before it looks at the clock again: keep that short.)"""
    clock = LeaseClock()
    monkeypatch.setattr(journal_lease, "_keeper", journal_lease.Keeper(clock=clock))
    return clock


def _wait_free(path: Path) -> None:
    wait_until(lambda: _try_flock(path), "the keeper to give the flock back")


def test_the_flock_is_kept_after_an_append_and_given_back_when_idle(tmp_path: Path, lease_clock: LeaseClock) -> None:
    path = tmp_path / "j.jsonl"
    with open_test_journal(path) as j:
        j.lease_idle = 0.05
        j.lease_max = 60.0
        j.append(Note(text="alone"))
        assert _try_flock(path)  # a lone append takes no lease
        lease_clock.advance(1.0)
        j.append(Note(text="one"))  # (alone too: a second after the last)
        j.append(Note(text="right after"))
        assert not _try_flock(path)  # a run of appends keeps it: the next one asks the file nothing
        lease_clock.advance(j.lease_idle / 2)
        j.append(Note(text="within the lease"))
        assert not _try_flock(path)  # still kept: not idle yet
        lease_clock.advance(j.lease_idle)
        _wait_free(path)  # idle: the keeper gives it back
        for i in range(20):
            j.append(Note(text=f"n{i}"))
        # back to back: each commit but the first two (the first of the run takes
        # the flock, and so the lease; "within the lease" found it too) found the lease
        assert j.leased_commits == 1 + 19
        assert j.commits == 24
    assert _try_flock(path)  # closing gives it back at once
    assert verify_lines(split_lines(path.read_bytes())) == []


def test_a_failed_append_gives_the_flock_back_at_once(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    with open_journal(path, machine=HOST, now=lambda: T0, new_id=lambda: "NOT-HEX",  # every stamp fails
                      recovery_dir=tmp_path / "recovery") as j:
        with pytest.raises(FormatError):
            j.append(Note(text="bad id"))
        assert _try_flock(path)
    with open_test_journal(path) as j:
        j.lease_idle = j.lease_max = 60.0
        j.append(Note(text="good"))
        j.append(Note(text="good too"))
        assert not _try_flock(path)
        with pytest.raises(FormatError):
            j.append_many([Note(text="fine"), "not an event"])  # type: ignore[list-item]
        assert _try_flock(path)  # the failed group ended the lease
        assert len(split_lines(path.read_bytes())) == 2


OTHER = r"""
import fcntl, os, sys, time
from capsulefs.core.journal.events import Note
from capsulefs.core.journal.file import open_journal
path = sys.argv[1]
j = open_journal(path, machine="host-b", now=lambda: 1764684000.0,
                 new_id=iter(f"{0xb:08x}{k:016x}" for k in range(1, 10**6)).__next__,
                 recovery_dir=os.path.join(os.path.dirname(path), "recovery"))
print("ready", flush=True)
sys.stdin.readline()
t0 = time.monotonic()
recs = [j.append(Note(text=f"b{k}")) for k in range(5)]
print(f"{time.monotonic() - t0:.6f} " + " ".join(r.id for r in recs), flush=True)
j.close()
"""


def test_a_tight_appender_lets_another_process_in_and_catches_up_with_it(tmp_path: Path) -> None:
    """MAX_HOLD: however often this process appends, it gives the flock
    back often enough for another process's appends, and its own next
    append reads what that process wrote."""
    path = tmp_path / "j.jsonl"
    with open_test_journal(path) as j:
        # Every append is in a run, however slow this machine's disk is now
        # (with the 2 ms in use, a loaded disk took no lease at all); a lease
        # still ends MAX_HOLD after it was taken, which is what is tested.
        j.lease_idle = 3600.0
        j.append(Note(text="first"))
        with subprocess.Popen([sys.executable, "-c", OTHER, str(path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) as other:
            assert other.stdout is not None and other.stdin is not None
            watchdog = threading.Timer(HANG, other.kill)  # a starved child fails the test, never hangs it
            watchdog.start()
            assert other.stdout.readline().strip() == "ready"
            stop = threading.Event()
            mine: list[Record] = []

            def tight() -> None:
                while not stop.is_set():
                    mine.append(j.append(Note(text=f"a{len(mine)}")))

            appender = threading.Thread(target=tight)
            appender.start()
            try:
                wait_until(lambda: j.leased_commits >= 5 or not appender.is_alive(), "a stream of leased appends")
                other.stdin.write("go\n")
                other.stdin.flush()
                answer = other.stdout.readline().split()
                ours = len(mine)
                wait_until(lambda: len(mine) >= ours + 5 or not appender.is_alive(), "our appends to go on after")
            finally:
                stop.set()
                appender.join()
            assert other.wait(HANG) == 0
            watchdog.cancel()
    assert answer, "the other process never appended"
    theirs = answer[1:]  # (answer[0]: how long its appends took, for a person; no bound but the watchdog's)
    assert len(theirs) == 5  # it got in while we kept appending
    lines = split_lines(path.read_bytes())
    assert verify_lines(lines) == []
    records = [Record.from_line(x) for x in lines]
    assert sorted(r.id for r in records if r.machine == "host-b") == sorted(theirs)
    after = [r for r in mine if r.clock > max(r2.clock for r2 in records if r2.machine == "host-b")]
    assert after, "no append of ours came after the other process's"
    assert {r.id for r in mine} <= {r.id for r in records}  # nothing of ours lost either
    assert j.leased_commits > 0


def test_removing_the_agent_waits_for_the_lease_and_the_next_append_is_refused(
        tmp_path: Path, lease_clock: LeaseClock) -> None:
    store = HostStore.open(tmp_path / "state")
    agent = store.create_agent("leasy", host_id=HOST, agent_id="c" * 32)
    j = open_agent_journal(agent, machine=HOST, now=lambda: T0, new_id=id_source(1))
    j.lease_idle = 0.05
    try:
        j.append(Note(text="before"))
        j.append(Note(text="just before"))
        assert not _try_flock(Path(agent.path(fmt.JOURNAL)))  # leased
        lease_clock.advance(1.0)  # idle now: the keeper will give the flock back
        store.remove_agent(agent.agent_id)  # takes the journal's flock: waits for the keeper
        with pytest.raises(NotFoundError, match="removed"):
            j.append(Note(text="after the agent left"))
    finally:
        j.close()


def test_a_journal_replaced_through_the_store_under_a_lease_is_followed(tmp_path: Path, lease_clock: LeaseClock) -> None:
    """Replacing goes through replacing_journal, which takes the flock: an
    appender holding a lease lets go first, then follows the new file."""
    store = HostStore.open(tmp_path / "state")
    agent = store.create_agent("leasy", host_id=HOST, agent_id="d" * 32)
    with open_agent_journal(agent, machine=HOST, now=lambda: T0, new_id=id_source(1)) as j:
        j.lease_idle = 0.05
        j.append(Note(text="old"))
        j.append(Note(text="old too"))
        assert not _try_flock(Path(agent.path(fmt.JOURNAL)))  # leased
        lease_clock.advance(1.0)  # idle now: the keeper will give the flock back
        new_lines = b""
        with open_test_journal(tmp_path / "other.jsonl", "host-b", prefix=2) as other:
            other.append(Note(text="b1"))
            new_lines = (tmp_path / "other.jsonl").read_bytes()
        agent.write_files({fmt.JOURNAL: new_lines})
        r = j.append(Note(text="after"))
        assert (r.seq, r.prev) == (1, None)  # host-a's first line in the new file
    lines = split_lines(Path(agent.path(fmt.JOURNAL)).read_bytes())
    assert [Record.from_line(x).machine for x in lines] == ["host-b", HOST]
    assert verify_lines(lines) == []


FORKING = r"""
import fcntl, os, sys, time
from capsulefs.core.journal.events import Note
from capsulefs.core.journal.file import open_journal
path = sys.argv[1]

def free():
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)

j = open_journal(path, machine="host-a", now=lambda: 1764684000.0,
                 new_id=iter(f"{k:024x}" for k in range(1, 10**6)).__next__,
                 recovery_dir=os.path.join(os.path.dirname(path), "recovery"))
j.lease_idle = j.lease_max = 60.0  # held until closed, however slow this machine is
j.append(Note(text="one"))
j.append(Note(text="two"))
print("leased before fork:", j._leased, "free:", free(), flush=True)
r, w = os.pipe()
done_r, done_w = os.pipe()
child = os.fork()
if child == 0:
    os.close(r)
    os.close(done_w)
    os.write(w, f"child leased: {j._leased}\n".encode())
    os.close(w)
    os.read(done_r, 1)  # keeps the shared open file alive until the parent has looked
    os._exit(0)
os.close(w)
os.close(done_r)
print(os.read(r, 100).decode().strip(), flush=True)
j.close()
print("free right after close:", free(), flush=True)
os.close(done_w)
os.waitpid(child, 0)
"""


def test_close_and_fork_under_a_lease(tmp_path: Path) -> None:
    """close() gives the flock back even if a forked child still holds the
    open file; a forked child forgets the parent's lease."""
    out = subprocess.run([sys.executable, "-c", FORKING, str(tmp_path / "j.jsonl")], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "leased before fork: True free: False",
        "child leased: False",
        "free right after close: True",
    ]


NO_THREADS = r"""
import fcntl, os, resource, sys
from capsulefs.core.journal.events import Note
from capsulefs.core.journal.file import open_journal
path = sys.argv[1]
j = open_journal(path, machine="host-a", now=lambda: 1764684000.0,
                 new_id=iter(f"{k:024x}" for k in range(1, 10**6)).__next__,
                 recovery_dir=os.path.join(os.path.dirname(path), "recovery"))
j.lease_idle = 3600.0  # "two" follows "one" closely enough for a lease however slow this machine is now
j.append(Note(text="one"))
size = int([x for x in open("/proc/self/status") if x.startswith("VmSize:")][0].split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (size + (4 << 20), resource.RLIM_INFINITY))  # no room for a thread's stack
rec = j.append(Note(text="two"))  # would take a lease: the keeper's thread cannot start
resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
fd = os.open(path, os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError if the flock was kept
print("acknowledged", rec.seq, "leased", j._leased, flush=True)
"""


def test_an_append_stands_and_keeps_no_flock_when_the_keeper_cannot_start(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", NO_THREADS, str(tmp_path / "j.jsonl")], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "acknowledged 2 leased False"
    assert "no lease" in out.stderr  # logged
    assert len(split_lines((tmp_path / "j.jsonl").read_bytes())) == 2
