"""A mount in the fleet mode (``mount --directory etcd://...``) against a
real etcd, with a running agent: etcd killed with -9, the agent's process is
gone and its working memory refuses writes before the host's lease can
expire, and the status says why; etcd back, the agent runs and takes writes
again. An agent the directory gives to another host meanwhile stays stopped.
A daemon paused (SIGSTOP, as a paused VM) past its lease's deadline refuses
the first write after it resumes. A held agent imported while the daemon
serves runs only once the directory names this host (claimed if new)."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from mount_kit import SLEEPER, capsulefs, export_of, mounted, needs_fuse, new_reference_agent
from mount_kit import status as agent_status

from capsulefs.core.capsule import format as fmt
from capsulefs.core.fleet import directory as fd
from capsulefs.core.store.holder import HolderBook
from capsulefs.fleet.directory import read_hosts
from capsulefs.fleet.etcd import open_etcd
from capsulefs.peer.identity import load_or_create_identity
from capsulefs.testing import seams
from capsulefs.testing.stub_provider import serve
from fleet_kit import KillableEtcd, killable_etcd
from helpers import HANG, wait_until

pytestmark = [needs_fuse]

PREFIX = "/capsulefs-mount-test/"


@pytest.fixture
def etcd_server() -> Iterator[KillableEtcd]:
    with killable_etcd() as server:
        yield server


def _hosts(spec: str) -> list:
    async def run() -> list:
        async with open_etcd(spec, timeout=HANG) as etcd:
            return await read_hosts(etcd, fd.Layout(PREFIX.encode()))

    return trio.run(run)


def _put_agent(spec: str, agent_id: str, entry: fd.AgentEntry) -> None:
    async def run() -> None:
        async with open_etcd(spec, timeout=HANG) as etcd:
            await etcd.put(fd.Layout(PREFIX.encode()).agent(agent_id), entry.encode())

    trio.run(run)


def _revoke(spec: str, lease_id: int) -> None:
    async def run() -> None:
        async with open_etcd(spec, timeout=HANG) as etcd:
            await etcd.revoke(lease_id)

    trio.run(run)


def _write_memory(agent: Path, text: str) -> int:
    """0 if a write of working memory is taken, else its errno."""
    try:
        (agent / "memory" / "working_memory.md").write_text(text)
    except OSError as exc:
        return exc.errno or -1
    return 0


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _running(agent: Path) -> int | None:
    run = agent_status(agent)["run"]
    return run["pid"] if run["state"] == "running" else None


def test_etcd_killed_stops_the_agent_read_only_before_the_lease_ends_and_back(
        tmp_path: Path, etcd_server: KillableEtcd) -> None:
    with serve() as (url, _stub):
        state = new_reference_agent(tmp_path, url)
        mnt = tmp_path / "mnt"
        with mounted(state, mnt, "--directory", etcd_server.spec, "--directory-prefix", PREFIX):
            agent = mnt / "pilot"
            wait_until(lambda: _running(agent), "the agent to run once the host has a lease")
            pid = _running(agent)
            assert pid is not None
            assert _write_memory(agent, "# notes\nbefore etcd died\n") == 0
            # later commands know the directory (saved in the state dir); the agent is claimed
            rows = json.loads("[" + ",".join(capsulefs("--state", str(state), "fleet", "ls", "--json")
                                             .stdout.splitlines()) + "]")
            assert [r["agent_id"] for r in rows] == [agent_status(agent)["agent_id"]]
            assert rows[0]["state"] == "held" and rows[0]["holder_alive"] and rows[0]["epoch"] >= 1

            # etcd's own answer: the lease has ttl (whole) seconds left when asked at `asked`
            asked = time.monotonic()
            (host,) = _hosts(etcd_server.spec)
            assert host.lease_ttl is not None
            etcd_server.kill()

            wait_until(lambda: _gone(pid) and _write_memory(agent, "after\n") == errno.EROFS,
                       "the agent's process gone and its working memory read-only")
            stopped = time.monotonic()
            assert stopped < asked + host.lease_ttl, (stopped - asked, host.lease_ttl)
            st = agent_status(agent)
            assert st["state"] == "frozen" and st["run"]["state"] != "running"
            assert st["run"]["detail"].startswith("fleet lease lost: "), st["run"]
            table = capsulefs("--state", str(state), "status").stdout
            assert "pilot: not running: fleet lease lost: " in table, table

            etcd_server.start()
            wait_until(lambda: _running(agent), "the agent to run again with a new lease")
            assert _running(agent) != pid
            assert agent_status(agent)["state"] == "active"
            assert _write_memory(agent, "# notes\nafter etcd came back\n") == 0
            assert "after etcd came back" in (agent / "memory" / "working_memory.md").read_text()


def test_an_agent_the_directory_names_elsewhere_stays_stopped_after_a_new_lease(
        tmp_path: Path, etcd_server: KillableEtcd) -> None:
    with serve() as (url, _stub):
        state = new_reference_agent(tmp_path, url, "kept")
        spec = tmp_path / "spec.json"  # (new_reference_agent's; the second agent runs it too)
        capsulefs("--state", str(state), "new", "taken", "--spec", str(spec))
        mnt = tmp_path / "mnt"
        with mounted(state, mnt, "--directory", etcd_server.spec, "--directory-prefix", PREFIX):
            kept, taken = mnt / "kept", mnt / "taken"
            wait_until(lambda: _running(kept) and _running(taken), "both agents to run")
            taken_pid = _running(taken)
            assert taken_pid is not None
            # another host takes "taken" over in the directory; this host's lease ends
            (host,) = _hosts(etcd_server.spec)
            _put_agent(etcd_server.spec, agent_status(taken)["agent_id"], fd.AgentEntry(host_id="host-b", epoch=9))
            lease_id = _lease_of(etcd_server.spec, host.host_id)
            _revoke(etcd_server.spec, lease_id)

            wait_until(lambda: _gone(taken_pid) and _write_memory(taken, "x\n") == errno.EROFS,
                       "the taken agent stopped and read-only")
            wait_until(lambda: _running(kept) and _lease_of(etcd_server.spec, host.host_id) not in (None, lease_id),
                       "the kept agent to run again under a new lease")
            assert _write_memory(kept, "# notes\nstill mine\n") == 0
            st = agent_status(taken)
            assert st["state"] == "frozen" and _running(taken) is None
            assert "the directory does not name this host" in st["run"]["detail"], st["run"]
            assert _write_memory(taken, "x\n") == errno.EROFS


def _lease_of(spec: str, host_id: str) -> int | None:
    async def run() -> int | None:
        async with open_etcd(spec, timeout=HANG) as etcd:
            kv = await etcd.get(fd.Layout(PREFIX.encode()).host(host_id))
            return None if kv is None else kv.lease

    return trio.run(run)


#: A short host lease for the paused-daemon test (the seam capsulefs.testing.seams.LEASE_TIMING_ENV):
#: a 4 s TTL, a keepalive every 0.5 s given 1 s, 1.5 s to stop: a run window of 2.42 s.
SHORT_LEASE = "4,0.5,1,1.5"
#: Write syscall numbers, to see a write blocked in the kernel (waiting on the paused daemon).
_WRITE_SYSCALL = {"x86_64": 1, "aarch64": 64}.get(os.uname().machine)


def _blocked_in_write(tid: int) -> bool:
    """Is thread ``tid`` of this process inside write(2) (waiting for the FUSE daemon's answer)?"""
    try:
        with open(f"/proc/self/task/{tid}/syscall") as f:
            fields = f.read().split()
    except FileNotFoundError:
        return False  # (the thread ended: its write was answered)
    return bool(fields) and fields[0] not in ("running", "-1") and \
        (_WRITE_SYSCALL is None or fields[0] == str(_WRITE_SYSCALL))


def _append(fd_: int, text: str, answer: dict[str, int]) -> None:
    """Append one note to the journal open as ``fd_``; ``answer``: the thread's id, then the errno (0: taken)."""
    answer["tid"] = threading.get_native_id()
    try:
        os.write(fd_, json.dumps({"kind": "note", "text": text}).encode() + b"\n")
    except OSError as exc:
        answer["errno"] = exc.errno or -1
    else:
        answer["errno"] = 0


def _paused_round(daemon: subprocess.Popen, agent: Path, round_: int, pause: float) -> None:
    """One round: the agent runs; the daemon is stopped ``pause`` seconds with
    a journal append waiting on it; once it resumes the append fails with
    EROFS, nothing of it is in the journal, and the agent's process stops."""
    journal = agent / fmt.JOURNAL
    wait_until(lambda: _running(agent), "the agent to run under a lease")
    pid = _running(agent)
    assert pid is not None
    fd_ = os.open(journal, os.O_WRONLY | os.O_APPEND)
    answer: dict[str, int] = {}
    try:
        _append(fd_, f"round {round_}: before the pause", answer)
        assert answer["errno"] == 0
        answer.clear()
        daemon.send_signal(signal.SIGSTOP)
        paused = time.monotonic()
        try:
            writer = threading.Thread(target=_append, args=(fd_, f"round {round_}: queued in the pause", answer))
            writer.start()
            wait_until(lambda: "tid" in answer and _blocked_in_write(answer["tid"]),
                       "the append to wait on the paused daemon")
            assert "errno" not in answer
            time.sleep(max(0.0, paused + pause - time.monotonic()))  # (the pause itself: the stimulus)
        finally:
            daemon.send_signal(signal.SIGCONT)
        writer.join(HANG)
        assert answer.get("errno") == errno.EROFS, (round_, answer)
    finally:
        try:
            os.close(fd_)
        except OSError:
            pass  # (a close of a read-only agent's journal may report it again)
    wait_until(lambda: _gone(pid), "the agent's process stopped")
    text = journal.read_text()
    assert f"round {round_}: before the pause" in text and "queued in the pause" not in text


def test_a_daemon_paused_past_its_lease_deadline_refuses_the_first_write_after_it_resumes(
        tmp_path: Path, etcd_server: KillableEtcd, monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon is stopped (SIGSTOP) longer than its lease's run window with
    a journal append queued in the kernel; once it resumes (SIGCONT) that
    append fails with EROFS, nothing of it is in the journal, and the agent's
    process is stopped; with a new lease the agent runs and takes writes
    again. Which task trio runs first after the pause, the append's or the
    lease keeper's, is the scheduler's choice: the check before every write
    makes the answer the same, and three rounds give both orders a chance
    (tests/daemons/test_fleet_member.py checks the write-first order alone)."""
    timing = seams.lease_timing_seam(SHORT_LEASE)
    assert timing is not None
    pause = timing.run_window(timing.ttl) + timing.renew_every + timing.renew_timeout + 0.5  # (past any deadline)
    monkeypatch.setenv(seams.LEASE_TIMING_ENV, SHORT_LEASE)
    with serve() as (url, _stub):
        state = new_reference_agent(tmp_path, url)
        mnt = tmp_path / "mnt"
        with mounted(state, mnt, "--directory", etcd_server.spec, "--directory-prefix", PREFIX) as daemon:
            agent = mnt / "pilot"
            for round_ in range(3):
                _paused_round(daemon, agent, round_, pause)
            wait_until(lambda: _running(agent), "the agent to run again under a new lease")
            assert _write_memory(agent, "# notes\nafter the pauses\n") == 0


def test_a_held_agent_imported_under_a_lease_runs_only_once_the_directory_names_this_host(
        tmp_path: Path, etcd_server: KillableEtcd) -> None:
    state = tmp_path / "state"
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(SLEEPER))
    capsulefs("--state", str(state), "new", "bystander", "--spec", str(spec))
    me = load_or_create_identity(state).host_id
    fresh_id, taken_id = os.urandom(16).hex(), os.urandom(16).hex()
    fresh = export_of(tmp_path, "fresh", holder=me, agent_id=fresh_id)
    taken = export_of(tmp_path, "taken", holder=me, agent_id=taken_id)
    # the directory already names another host for "taken" (this copy is stale)
    _put_agent(etcd_server.spec, taken_id, fd.AgentEntry(host_id="host-b", epoch=9))
    mnt = tmp_path / "mnt"
    with mounted(state, mnt, "--directory", etcd_server.spec, "--directory-prefix", PREFIX):
        wait_until(lambda: _running(mnt / "bystander"), "the host's lease (its agent runs)")

        out = capsulefs("--state", str(state), "import", str(taken))
        assert "held" in out.stdout.splitlines()[1], out.stdout
        wait_until(lambda: "taken" in os.listdir(mnt), "the imported agent in the mount")
        wait_until(lambda: "the directory does not name this host at epoch"
                   in (agent_status(mnt / "taken")["run"].get("detail") or ""),
                   "the directory's answer about the stale import")
        st = agent_status(mnt / "taken")
        assert st["state"] == "frozen" and st["writable"] is False and _running(mnt / "taken") is None, st
        # a final answer, not a question asked again: it says whom the directory names
        refused = st["record"]["directory"]
        assert refused["state"] == "refused" and refused["tries"] == 1 and refused["retry_in"] is None, refused
        assert "it names host host-b at epoch 9" in refused["detail"] == st["run"]["detail"], st
        assert _write_memory(mnt / "taken", "written on the wrong host\n") == errno.EROFS
        table = capsulefs("--state", str(state), "status").stdout
        assert "taken: not running: fleet: the directory does not name this host at epoch" in table, table

        out = capsulefs("--state", str(state), "import", str(fresh))
        assert "held" in out.stdout.splitlines()[1], out.stdout
        wait_until(lambda: "fresh" in os.listdir(mnt) and _running(mnt / "fresh"), "the fresh import to run")
        # claimed: the directory names this host at the epoch its record holds
        rows = {r["agent_id"]: r for r in (json.loads(line) for line in capsulefs(
            "--state", str(state), "fleet", "ls", "--json").stdout.splitlines())}
        assert rows[fresh_id]["holder"] == me and rows[fresh_id]["state"] == "held", rows[fresh_id]
        assert rows[fresh_id]["epoch"] == HolderBook(state / "holders").get(fresh_id).epoch
        assert rows[taken_id]["holder"] == "host-b" and rows[taken_id]["epoch"] == 9, rows[taken_id]
        assert _write_memory(mnt / "fresh", "# notes\nmine\n") == 0
        assert "directory" not in agent_status(mnt / "fresh")["record"]
        # and the stale one still does not run, nor was it asked about again
        st = agent_status(mnt / "taken")
        assert _running(mnt / "taken") is None and st["state"] == "frozen"
        assert st["record"]["directory"]["tries"] == 1, st


def test_an_arrival_the_directory_does_not_answer_about_is_asked_again_with_a_growing_pause(
        tmp_path: Path, etcd_server: KillableEtcd, monkeypatch: pytest.MonkeyPatch) -> None:
    """etcd stopped while the host's lease still lives (a 60 s lease here, by
    the test seam): a held agent imported meanwhile stays read-only and
    stopped, its status says the directory did not answer, and it is asked
    again after 1, 2, 4 ... s; etcd started again, it is claimed and runs."""
    monkeypatch.setenv(seams.LEASE_TIMING_ENV, "60,1,1,2")  # (the daemon's: the lease outlives etcd's downtime)
    state = tmp_path / "state"
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(SLEEPER))
    capsulefs("--state", str(state), "new", "bystander", "--spec", str(spec))
    me = load_or_create_identity(state).host_id
    late_id = os.urandom(16).hex()
    late = export_of(tmp_path, "late", holder=me, agent_id=late_id)
    mnt = tmp_path / "mnt"
    with mounted(state, mnt, "--directory", etcd_server.spec, "--directory-prefix", PREFIX):
        wait_until(lambda: _running(mnt / "bystander"), "the host's lease (its agent runs)")
        etcd_server.kill()
        capsulefs("--state", str(state), "import", str(late))
        wait_until(lambda: "late" in os.listdir(mnt), "the imported agent in the mount")

        def asked_again() -> bool:
            directory = agent_status(mnt / "late")["record"].get("directory")
            return directory is not None and directory["state"] == "retrying" and directory["tries"] >= 3

        wait_until(asked_again, "the arrival asked about three times")
        st = agent_status(mnt / "late")
        waiting = st["record"]["directory"]
        assert waiting["pause"] == min(30, 2 ** (waiting["tries"] - 1)), waiting  # 1, 2, 4 ... s, at most 30
        assert waiting["last_error"] and waiting["epoch"] == 1 and waiting["retry_in"] is not None, waiting
        assert st["run"]["detail"].startswith("fleet: the directory did not answer about it"), st["run"]
        assert st["state"] == "frozen" and st["writable"] is False and _running(mnt / "late") is None, st
        assert _write_memory(mnt / "late", "written before the directory answered\n") == errno.EROFS
        assert _running(mnt / "bystander"), "the host's lease ended (the arrival's wait is not a lost lease's)"

        etcd_server.start()
        wait_until(lambda: _running(mnt / "late"), "the arrival to run once the directory answered")
        st = agent_status(mnt / "late")
        assert st["state"] == "active" and "directory" not in st["record"], st
        rows = {r["agent_id"]: r for r in (json.loads(line) for line in capsulefs(
            "--state", str(state), "fleet", "ls", "--json").stdout.splitlines())}
        assert rows[late_id]["holder"] == me and rows[late_id]["epoch"] == 1, rows[late_id]
        assert _write_memory(mnt / "late", "# notes\nafter the directory answered\n") == 0
