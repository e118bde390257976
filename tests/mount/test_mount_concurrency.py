"""Real mounts under concurrent writers: appends lose nothing, snapshots verify."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import time
from contextlib import ExitStack
from pathlib import Path

import pytest

from capsulefs.core.capsule import format as fmt
from capsulefs.core.store.host_store import HostStore
from helpers import HANG, make_agent, wait_until
from mount_kit import capsulefs, check_chains, mounted, needs_fuse, status

pytestmark = [pytest.mark.fuse, needs_fuse]

#: One process appending N notes, one durable write each.
APPENDER = """
import os, sys
path, n, tag = sys.argv[1], int(sys.argv[2]), sys.argv[3]
fd = os.open(path, os.O_WRONLY | os.O_APPEND)
for i in range(n):
    os.write(fd, ('{"kind":"note","text":"%s-%d"}\\n' % (tag, i)).encode())
os.close(fd)
"""


def appenders(journal: Path, procs: int, each: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", APPENDER, str(journal), str(each), f"p{p}"])
            for p in range(procs)]


@pytest.mark.slow
def test_8_processes_x_500_appends_lose_nothing(store: HostStore, state_dir: Path, tmp_path: Path) -> None:
    make_agent(store, "alice")
    mnt = tmp_path / "mnt"
    with mounted(state_dir, mnt):
        journal = mnt / "alice" / fmt.JOURNAL
        subprocess.run(["bash", "-c", f"echo '{{\"kind\":\"user_message\",\"text\":\"first\"}}' >> {journal}"],
                       check=True)
        t0 = time.monotonic()
        procs = appenders(journal, 8, 500)
        assert [p.wait(timeout=2 * HANG) for p in procs] == [0] * 8
        elapsed = time.monotonic() - t0
        recs = check_chains(journal.read_bytes())
        assert len(recs) == 4001
        texts = {r.event.text for r in recs[1:]}  # type: ignore[attr-defined]
        assert texts == {f"p{p}-{i}" for p in range(8) for i in range(500)}
        print(f"4000 durable appends from 8 processes in {elapsed:.2f}s ({4000 / elapsed:.0f}/s)")
        assert capsulefs("verify", str(mnt / "alice")).stdout.startswith("OK:")


def test_snapshot_while_appending_verifies(store: HostStore, state_dir: Path, tmp_path: Path) -> None:
    make_agent(store, "alice")
    mnt = tmp_path / "mnt"
    with mounted(state_dir, mnt):
        agent = mnt / "alice"
        procs = appenders(agent / fmt.JOURNAL, 1, 400)
        try:
            while (agent / fmt.JOURNAL).stat().st_size == 0 and procs[0].poll() is None:
                pass  # wait (bounded by the appender) until appends are under way
            os.mkdir(agent / ".snapshots" / "nightly")
        finally:
            assert procs[0].wait(timeout=HANG) == 0
        tar = tmp_path / "nightly.tar"
        subprocess.run(["tar", "-C", str(agent / ".snapshots" / "nightly"), "-cf", str(tar), "."], check=True)
        assert capsulefs("verify", str(tar)).stdout.startswith("OK:")
        with tarfile.open(tar) as tf:
            member = tf.extractfile("./" + fmt.JOURNAL)
            assert member is not None
            snap_lines = member.read().count(b"\n")
        assert 0 < snap_lines <= 400
        assert len(check_chains((agent / fmt.JOURNAL).read_bytes())) == 400
        assert "nightly" in os.listdir(agent / ".snapshots")
        os.rmdir(agent / ".snapshots" / "nightly")
        assert os.listdir(agent / ".snapshots") == []


def test_a_snapshot_waiting_for_an_append_holds_up_nothing_else(store: HostStore, state_dir: Path,
                                                                  tmp_path: Path) -> None:
    """A snapshot (mkdir in .snapshots/) waits while a `capsulefs append`
    holds the agent's files, longer than the daemon's loop could, and the
    mount serves everything else meanwhile."""
    import threading

    from capsulefs.core.store.holder import HolderBook
    from capsulefs.move.host import holders_dir

    make_agent(store, "alice", memory="m\n")
    agent_id = store.find("alice").agent_id
    m = tmp_path / "mnt"
    with mounted(state_dir, m):
        done: list[BaseException | None] = []

        def snapshot() -> None:
            try:
                os.mkdir(m / "alice" / ".snapshots" / "s1")
                done.append(None)
            except BaseException as exc:  # noqa: BLE001 - reported below
                done.append(exc)

        with HolderBook(holders_dir(state_dir)).files_lock(agent_id, shared=False):  # what an append holds
            t = threading.Thread(target=snapshot)
            t.start()
            time.sleep(0.3)  # kept: the snapshot's mkdir reaches the daemon, which waits for the lock (polled:
            # no event says it got there); the checks below hold whether or not it did
            for _ in range(5):  # other requests are answered while the snapshot waits
                assert status(m / "alice")["state"] == "active"
                assert (m / "alice" / fmt.WORKING_MEMORY).read_text() == "m\n"
            assert t.is_alive() and done == []  # (it waits for our lock: no timing in this)
        t.join(HANG)
        assert done == [None]
        snap = m / "alice" / ".snapshots" / "s1"
        assert (snap / fmt.WORKING_MEMORY).read_text() == "m\n"
        out = capsulefs("verify", str(snap)).stdout
        assert out.startswith("OK:"), out


def test_a_daemon_starting_beside_an_import_serves_while_it_waits_for_its_record(store: HostStore, state_dir: Path,
                                                                                  tmp_path: Path) -> None:
    """An import holds the agent's files lock from its files to its holder
    record. A daemon starting meanwhile waits for the record (not marking
    the agent as one whose record was lost) off its loop: the mount serves."""
    import threading

    from capsulefs.core.store.holder import HolderBook, HolderState, new_held
    from capsulefs.move.host import holders_dir

    make_agent(store, "alice")  # its files are in the store, its record not yet
    agent_id = store.find("alice").agent_id
    book = HolderBook(holders_dir(state_dir))
    m = tmp_path / "mnt"
    with ExitStack() as importing:
        importing.enter_context(book.files_lock(agent_id, shared=False))  # what `capsulefs import` holds
        with mounted(state_dir, m):
            listed: list[list[str]] = []
            t = threading.Thread(target=lambda: listed.append(sorted(os.listdir(m))))
            t.start()
            t.join(HANG)  # (the recovery waits until we let go: a hang's bound, not a speed)
            assert listed == [["alice"]], "the mount did not answer while its recovery waited"
            book.put(new_held(agent_id, 1))  # the import records the agent, then lets go
            importing.close()
            wait_until(lambda: (m / "alice" / ".control" / "status").exists(), "the agent")
    assert book.get(agent_id).state is HolderState.HELD


def test_an_unmount_while_the_daemon_starts_ends_it_cleanly(store: HostStore, state_dir: Path, tmp_path: Path) -> None:
    """The mount is up before the daemon's services are (here its recovery
    waits for an import's record): an unmount from outside then ends the
    daemon with status 0, not with a traceback."""
    from capsulefs.core.store.holder import HolderBook, new_held
    from capsulefs.move.host import holders_dir
    from mount_kit import force_unmount

    make_agent(store, "alice", held=False)  # its import has not recorded it yet
    book = HolderBook(holders_dir(state_dir))
    m = tmp_path / "mnt"
    with ExitStack() as importing:
        importing.enter_context(book.files_lock(store.find("alice").agent_id, shared=False))  # recovery waits
        with mounted(state_dir, m) as daemon:
            force_unmount(m)
            time.sleep(0.3)  # kept: a window in which the daemon must not exit (an absence has no event)
            assert daemon.poll() is None  # its recovery still waits
            book.put(new_held(store.find("alice").agent_id, 1))  # recorded: the recovery activates it
            importing.close()
    # mounted() waited for the daemon to exit and found no traceback in its log
    assert daemon.returncode == 0
    assert "the mount ended while the daemon was starting" in (state_dir.parent / "daemon-mnt.log").read_text()



def test_a_restarted_daemon_shows_agents_as_their_records_say_before_its_recovery(
        store: HostStore, state_dir: Path, tmp_path: Path) -> None:
    """A crash can leave the files of an agent that moved away (retired
    here), and an agent in the middle of a move (its commit in doubt: the
    target may run it already). A daemon starting on that store serves the
    mount before its move recovery has settled them (here the recovery
    waits for an import's record): meanwhile the retired agent is not
    shown and the one in doubt takes no write. Abandoning the move makes
    it writable again."""
    import errno

    from capsulefs.core.store.holder import HolderBook, HolderRecord, HolderState, new_held
    from capsulefs.move.host import holders_dir

    book = HolderBook(holders_dir(state_dir))
    ids = {name: make_agent(store, name, memory="m\n", held=name == "alice").agent_id
           for name in ("alice", "bob", "carol", "dave")}
    peer = "B" * 52  # a peer this host has no address for: the move stays in doubt
    book.put(new_held(ids["alice"], 1))
    book.put(HolderRecord(agent_id=ids["bob"], state=HolderState.RETIRED, epoch=2, peer=peer, activated=(1,)))
    book.put(HolderRecord(agent_id=ids["carol"], state=HolderState.COMMITTING, epoch=2, held_epoch=1, peer=peer,
                          activated=(1,)))
    m = tmp_path / "mnt"
    with ExitStack() as importing:
        importing.enter_context(book.files_lock(ids["dave"], shared=False))  # dave's import: recovery waits
        with mounted(state_dir, m, "--no-run"):
            assert sorted(os.listdir(m)) == ["alice", "carol", "dave"]
            with pytest.raises(OSError) as exc:
                (m / "carol" / fmt.WORKING_MEMORY).write_text("written while its move is in doubt\n")
            assert exc.value.errno == errno.EROFS
            assert status(m / "carol")["state"] == "frozen"
            assert (m / "carol" / fmt.WORKING_MEMORY).read_text() == "m\n"
            book.put(new_held(ids["dave"], 1))
            importing.close()
            wait_until(lambda: not (Path(store.agents_dir) / ids["bob"]).exists(), "recovery to drop bob's files")
            assert sorted(os.listdir(m)) == ["alice", "carol", "dave"]
            assert status(m / "carol")["state"] == "frozen"  # still in doubt: its target cannot be asked
            (m / "carol" / ".control" / "abandon").write_text("the target is gone for good\n")
            wait_until(lambda: status(m / "carol")["state"] == "active", "carol to be resumed")
            (m / "carol" / fmt.WORKING_MEMORY).write_text("mine again\n")
    assert book.get(ids["carol"]).state is HolderState.HELD
    assert (Path(store.agents_dir) / ids["carol"] / fmt.WORKING_MEMORY).read_text() == "mine again\n"


def test_an_agent_whose_holder_record_is_lost_is_read_only_until_learned(
        store: HostStore, state_dir: Path, tmp_path: Path) -> None:
    """An agent whose holder record is lost or damaged may be held by
    another host by now, and 'capsulefs move --learn' may then remove its
    files here: the mount shows it but takes no write, from its first
    request (a record already in doubt) or from its recovery (no record at
    all), and its status says why and what to run."""
    import errno

    from capsulefs.core.store.holder import HolderBook, HolderState, unknown
    from capsulefs.move.host import holders_dir

    book = HolderBook(holders_dir(state_dir))
    ids = {name: make_agent(store, name, memory="m\n", held=name == "alice").agent_id
           for name in ("alice", "erin", "frank")}
    book.put(unknown(ids["erin"], "holder record corrupt"))
    m = tmp_path / "mnt"
    with mounted(state_dir, m):
        assert sorted(os.listdir(m)) == ["alice", "erin", "frank"]
        # (frank, with no record, is shown frozen from the first request, before recovery writes its record:
        # wait for the record and the runner's word on it, not for "frozen")
        def learned(name: str) -> bool:
            st = status(m / name)
            record = st.get("record") or {}
            return record.get("state") == "unknown" and (st.get("run") or {}).get("detail") == record.get("detail")

        wait_until(lambda: learned("erin") and learned("frank"), "recovery to record frank's holder as unknown")
        for name in ("erin", "frank"):
            with pytest.raises(OSError) as exc:
                (m / name / fmt.WORKING_MEMORY).write_text("written while in doubt\n")
            assert exc.value.errno == errno.EROFS, name
            assert (m / name / fmt.WORKING_MEMORY).read_text() == "m\n"
            st = status(m / name)
            assert st["state"] == "frozen" and st["writable"] is False
            assert st["record"]["state"] == "unknown"
            assert f"capsulefs move {name} --learn" in st["record"]["detail"]
            assert st["run"]["detail"] == st["record"]["detail"]  # why it does not run, not "a move"
        with pytest.raises(OSError) as exc:  # nothing to abandon: it is not in a move
            (m / "erin" / ".control" / "abandon").write_text("let me write\n")
        assert status(m / "erin")["state"] == "frozen"
        (m / "alice" / fmt.WORKING_MEMORY).write_text("mine\n")
        record = status(m / "alice")["record"]
        assert (record["state"], record["epoch"], record["story"]["state"], record["standing"]) == \
            ("held", 1, "held", "holding")
    assert book.get(ids["frank"]).state is HolderState.UNKNOWN
    assert (Path(store.agents_dir) / ids["erin"] / fmt.WORKING_MEMORY).read_text() == "m\n"


def test_an_agent_in_doubt_with_unsynced_sandbox_work_is_frozen_without_journaling_it(
        store: HostStore, state_dir: Path, tmp_path: Path) -> None:
    """An agent in doubt whose sandbox holds work not yet synced (a daemon's
    shutdown does not sync): freezing it at start synced the sandbox into a
    capsule that takes no write, and the ReadOnly took the whole daemon down
    at every start. Its sandbox now stays as it is, nothing is journaled,
    and the mount serves."""
    from capsulefs.core.store.holder import HolderBook, unknown
    from capsulefs.move.host import holders_dir

    book = HolderBook(holders_dir(state_dir))
    ids = {name: make_agent(store, name, memory="m\n", held=name == "alice").agent_id
           for name in ("alice", "erin", "frank")}
    book.put(unknown(ids["erin"], "holder record corrupt"))
    for name in ("erin", "frank"):  # frank has no record at all: the recovery finds it in doubt
        work = state_dir / "sandboxes" / ids[name] / "workspace"
        work.mkdir(parents=True)
        (work / "draft.txt").write_text("written by an earlier run\n")
    journals = {name: (Path(store.agents_dir) / ids[name] / fmt.JOURNAL).read_bytes() for name in ("erin", "frank")}
    m = tmp_path / "mnt"
    with mounted(state_dir, m):
        assert sorted(os.listdir(m)) == ["alice", "erin", "frank"]
        wait_until(lambda: status(m / "frank")["state"] == "frozen", "recovery to freeze frank")
        assert status(m / "erin")["state"] == "frozen"
        (m / "alice" / fmt.WORKING_MEMORY).write_text("still served\n")
    for name in ("erin", "frank"):
        assert (Path(store.agents_dir) / ids[name] / fmt.JOURNAL).read_bytes() == journals[name]
        assert (state_dir / "sandboxes" / ids[name] / "workspace" / "draft.txt").exists()
