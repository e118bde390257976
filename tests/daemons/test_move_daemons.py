"""Real daemons (tier: kernel + TLS): two ``capsulefs mount`` processes on loopback.

Each host is its own state directory and mount point, ``capsulefs init``'d,
with the other added as a peer. Moves are asked for the way a user does:
``echo B > MNT_A/agent/.control/move``. Daemons are killed with SIGKILL at
each durable step of a move (the test seam CAPSULEFS_TEST_CRASH_AT, see
capsulefs/testing/seams.py) and restarted; the end state must have exactly one
holder, no staging left, a capsule that verifies and a journal that lost
nothing. Every test unmounts and kills what it started, even on failure.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from capsulefs.core.store.holder import HolderBook, HolderState
from helpers import HANG
from mount_kit import CAPSULEFS, capsulefs, check_chains, needs_fuse
from mount_kit import status as agent_status
from prom_kit import parse, value

pytestmark = [pytest.mark.fuse, needs_fuse]

POLL = 0.05
WAIT = HANG  # seconds any one condition may take to come true (a bound on a hang)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_mounted(mnt: Path) -> bool:
    """In /proc/mounts (os.path.ismount misses a dead daemon's mount: ENOTCONN)."""
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == str(mnt) for line in f)


def force_unmount(mnt: Path) -> None:
    if is_mounted(mnt):
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)
    if is_mounted(mnt):
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def wait_for(cond, what: str, timeout: float = WAIT):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(POLL)
    raise AssertionError(f"timed out waiting for {what}")


def together(*argvs: list[str]) -> list[str]:
    """Run ``capsulefs ARGV`` for each argv side by side (each its own state
    directory: they share nothing), check each, and return their stdouts."""
    procs = [subprocess.Popen([CAPSULEFS, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              stdin=subprocess.DEVNULL) for argv in argvs]
    outs = [proc.communicate(timeout=WAIT) for proc in procs]
    for argv, proc, (out, err) in zip(argvs, procs, outs, strict=True):
        assert proc.returncode == 0, f"capsulefs {' '.join(argv)}: {proc.returncode}\n{out}\n{err}"
    return [out for out, _err in outs]


def start_all(*hosts: Host) -> None:
    """Start each host's daemon side by side (as ``Host.start()``), then wait
    until every one is up. A host :meth:`Host.spawn`'d with arguments is
    passed here to be waited for only."""
    for h in hosts:
        if h.proc is None:
            h.spawn()
    for h in hosts:
        h.wait_started()


class Host:
    """One host: state dir, mount point, listening port, and its daemon process."""

    def __init__(self, root: Path, name: str, *, said: str | None = None) -> None:
        self.name = name
        self.state = root / f"state-{name}"
        self.mnt = root / f"mnt-{name}"
        self.log = root / f"daemon-{name}.log"
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.extra: tuple[str, ...] = ()  # more `capsulefs mount` flags (the fleet tests)
        self.mnt.mkdir()
        if said is None:
            said = capsulefs("--state", str(self.state), "init").stdout  # "...: initialised; host id ID"
        self.host_id = said.split("host id ")[1].strip()  # (what `capsulefs id` prints: one process less)

    @classmethod
    def init_all(cls, root: Path, *names: str) -> list[Host]:
        """One host per name, their ``capsulefs init`` run side by side."""
        said = together(*(["--state", str(root / f"state-{name}"), "init"] for name in names))
        return [cls(root, name, said=out) for name, out in zip(names, said, strict=True)]

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return capsulefs("--state", str(self.state), *args, check=check)

    def start(self, crash_at: str | None = None, *, run: bool = False, cwd: Path | None = None) -> None:
        self.spawn(crash_at, run=run, cwd=cwd)
        self.wait_started()

    def spawn(self, crash_at: str | None = None, *, run: bool = False, cwd: Path | None = None) -> None:
        """Start the daemon without waiting for it (:meth:`wait_started`, or :func:`start_all`)."""
        env = dict(os.environ)
        env.pop("CAPSULEFS_TEST_CRASH_AT", None)
        if crash_at:
            env["CAPSULEFS_TEST_CRASH_AT"] = crash_at
        force_unmount(self.mnt)  # a killed daemon leaves a dead mount behind
        with open(self.log, "ab") as logf:
            self.proc = subprocess.Popen(
                [CAPSULEFS, "-v", "mount", str(self.mnt), "--state", str(self.state),
                 *([] if run else ["--no-run"]), "--listen", f"127.0.0.1:{self.port}", *self.extra],
                stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=cwd)

    def wait_started(self) -> None:
        """Until the daemon :meth:`spawn` started is mounted and its recovery done."""
        proc = self.proc
        assert proc is not None
        wait_for(lambda: os.path.ismount(self.mnt) or proc.poll() is not None, f"{self.name} to mount")
        assert proc.poll() is None, self.log.read_text()
        # This daemon's runtime file (written once its recovery is done), not one a killed daemon left.
        wait_for(lambda: self._runtime_pid() == proc.pid, f"{self.name}'s runtime file")

    def _runtime_pid(self) -> int | None:
        try:
            return json.loads((self.state / "mount" / "daemon.json").read_bytes())["pid"]
        except (FileNotFoundError, ValueError):
            return None

    def stop(self) -> None:
        """Unmount (the daemon exits once its mount is gone), wait for the
        daemon, kill it if it does not exit, and unmount what a dead one left."""
        if self.proc is not None and self.proc.poll() is None:
            force_unmount(self.mnt)
            try:
                self.proc.wait(timeout=WAIT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        force_unmount(self.mnt)
        self.proc = None

    def wait_killed(self) -> None:
        assert self.proc is not None
        self.proc.wait(timeout=WAIT)
        assert self.proc.returncode == 137, self.log.read_text()
        force_unmount(self.mnt)
        self.proc = None

    def holder(self, agent_id: str) -> HolderState | None:
        rec = HolderBook(self.state / "holders").get(agent_id)
        return None if rec is None else rec.state

    def staging(self) -> list[str]:
        d = self.state / "staging"
        return sorted(os.listdir(d)) if d.exists() else []

    def status(self, agent: str) -> dict:
        return agent_status(self.mnt / agent)


@contextmanager
def two_hosts(tmp_path: Path) -> Iterator[tuple[Host, Host]]:
    """Hosts a and b made (not started); at the end both stopped (and unmounted), and, after a test
    that passed, neither daemon's log has a traceback."""
    a, b = Host.init_all(tmp_path, "a", "b")
    try:
        yield a, b
    finally:
        for h in (a, b):
            h.stop()
    no_tracebacks(a, b)


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[tuple[Host, Host]]:
    """Two peer-to-peer hosts, each the other's pinned peer."""
    with two_hosts(tmp_path) as (a, b):
        together(["--state", str(a.state), "peer", "add", "b", f"127.0.0.1:{b.port}", b.host_id],
                 ["--state", str(b.state), "peer", "add", "a", f"127.0.0.1:{a.port}", a.host_id])
        yield a, b


def no_tracebacks(*hosts: Host) -> None:
    """After a test: no daemon's log holds a traceback."""
    for h in hosts:
        text = h.log.read_text(errors="replace") if h.log.exists() else ""
        assert "Traceback" not in text, text


def wait_holding(h: Host, name: str) -> None:
    """Until ``h`` has the evidence to run ``name`` (docs/move.md, "Checking before running")."""
    wait_for(lambda: h.status(name)["record"].get("standing") == "holding", f"{name} held with evidence on {h.name}")


def make_agent(a: Host, name: str = "walker", events: int = 5) -> str:
    (a.mnt / name).mkdir()
    add_messages(a, name, events)
    agent_id = a.status(name)["agent_id"]
    assert a.holder(agent_id) is HolderState.HELD  # mkdir recorded it
    return agent_id


def add_messages(a: Host, name: str, events: int) -> None:
    journal = a.mnt / name / "memory" / "timeline_events.jsonl"
    for i in range(events):
        with open(journal, "a") as f:
            f.write(json.dumps({"kind": "user_message", "text": f"hello {i}"}) + "\n")


def write_move(mnt: Path, agent: str, text: str) -> int:
    """``echo TEXT > MNT/agent/.control/move``: 0 or the errno it failed with."""
    try:
        fd = os.open(mnt / agent / ".control" / "move", os.O_WRONLY | os.O_TRUNC)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)
    except OSError as exc:
        return exc.errno or -1
    return 0


def verify_on(h: Host, name: str, tmp: Path, events: int) -> None:
    """tar the agent out of the mount, verify it, check the journal lost nothing."""
    out = tmp / f"{h.name}-{name}.tar"
    subprocess.run(["tar", "-C", str(h.mnt / name), "-cf", str(out), "."], check=True, capture_output=True)
    assert "OK" in h.cli("verify", str(out)).stdout
    with tarfile.open(out) as t:
        data = t.extractfile("./memory/timeline_events.jsonl").read()  # type: ignore[union-attr]
    recs = check_chains(data)
    texts = [getattr(r.event, "text", None) for r in recs if r.kind == "user_message"]
    assert texts == [f"hello {i}" for i in range(events)]


def test_echo_moves_an_agent_between_two_mounts(hosts: tuple[Host, Host], tmp_path: Path) -> None:
    a, b = hosts
    start_all(a, b)
    agent_id = make_agent(a)
    assert write_move(a.mnt, "walker", "nobody\n") == errno.EINVAL  # not a peer
    assert write_move(a.mnt, "walker", "b\nb\n") == errno.EINVAL  # not one line
    assert write_move(a.mnt, "walker", "b\n") == 0
    assert not (a.mnt / "walker").exists() and "walker" not in os.listdir(a.mnt)
    assert "walker" in os.listdir(b.mnt)
    assert a.holder(agent_id) is HolderState.RETIRED and b.holder(agent_id) is HolderState.HELD
    assert b.status("walker")["epoch"] == 2
    verify_on(b, "walker", tmp_path, 5)
    assert a.staging() == [] and b.staging() == []
    with open(b.mnt / "walker" / "memory" / "timeline_events.jsonl", "a") as f:  # writable on B
        f.write(json.dumps({"kind": "user_message", "text": "hello 5"}) + "\n")
    verify_on(b, "walker", tmp_path, 6)
    a.stop()
    b.stop()


def test_a_move_shows_in_both_hosts_metrics(hosts: tuple[Host, Host], tmp_path: Path) -> None:
    """MNT/.control/metrics on each side: the source counts a move done, the
    bytes it sent and each phase's time; the target counts an agent moved
    in and the bytes it received; the agent is active on the target only."""
    a, b = hosts
    start_all(a, b)
    make_agent(a)
    before_a, before_b = parse((a.mnt / ".control" / "metrics").read_bytes()), \
        parse((b.mnt / ".control" / "metrics").read_bytes())
    assert write_move(a.mnt, "walker", "b\n") == 0
    after_a, after_b = parse((a.mnt / ".control" / "metrics").read_bytes()), \
        parse((b.mnt / ".control" / "metrics").read_bytes())

    def moved(before: dict, after: dict, name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved(before_a, after_a, "capsulefs_moves_total", outcome="done", cause="moved") == 1
    assert moved(before_a, after_a, "capsulefs_move_bytes_total", direction="sent") > 0
    for phase in ("freezing", "offer", "verify", "prepare", "activate"):
        assert moved(before_a, after_a, "capsulefs_move_phase_seconds_count", phase=phase) == 1, phase
    assert value(after_a, "capsulefs_agents", state="active") == 0
    assert moved(before_b, after_b, "capsulefs_moves_in_total") == 1
    assert moved(before_b, after_b, "capsulefs_move_bytes_total", direction="received") > 0
    assert value(after_b, "capsulefs_agents", state="active") == 1
    assert moved(before_b, after_b, "capsulefs_moves_total", outcome="done", cause="moved") == 0
    a.stop()
    b.stop()


def test_a_move_to_a_dead_peer_fails_and_the_agent_stays(hosts: tuple[Host, Host], tmp_path: Path) -> None:
    a, b = hosts
    a.start()  # b never starts: nothing listens at its port
    agent_id = make_agent(a)
    assert write_move(a.mnt, "walker", "b\n") == errno.ECONNREFUSED
    assert a.holder(agent_id) is HolderState.HELD
    move = a.status("walker")["move"]
    assert move["outcome"] == "rolled_back" and move["cause"] == "connection-refused", move
    assert "cannot connect" in move["detail"]
    with open(a.mnt / "walker" / "memory" / "timeline_events.jsonl", "a") as f:  # still writable
        f.write(json.dumps({"kind": "user_message", "text": "hello 5"}) + "\n")
    verify_on(a, "walker", tmp_path, 6)
    a.stop()


#: (side, holder state after which the daemon dies, where the agent ends up)
CRASHES = [
    ("source", "frozen", "a"),
    ("source", "committing", "a"),  # activate never sent: the target answers "never"
    ("source", "retired", "b"),
    ("target", "offered", "a"),
    ("target", "verified", "a"),
    ("target", "prepared", "a"),
    ("target", "held", "b"),  # activated, the reply lost: in doubt until the target is back
]


@pytest.mark.parametrize(("side", "state", "ends_on"), CRASHES, ids=[f"{s}-{p}" for s, p, _ in CRASHES])
def test_a_daemon_killed_at_each_phase(hosts: tuple[Host, Host], tmp_path: Path, side: str, state: str,
                                       ends_on: str) -> None:
    a, b = hosts
    victim = a if side == "source" else b
    a.spawn(crash_at=f"{side}:{state}" if side == "source" else None)
    b.spawn(crash_at=f"{side}:{state}" if side == "target" else None)
    start_all(a, b)
    agent_id = make_agent(a)
    result: list[int] = []
    import threading

    writer = threading.Thread(target=lambda: result.append(write_move(a.mnt, "walker", "b\n")))
    writer.start()
    victim.wait_killed()
    # never two holders, even while one daemon is down
    assert [a.holder(agent_id), b.holder(agent_id)].count(HolderState.HELD) <= 1
    victim.start()
    writer.join(timeout=WAIT)
    assert not writer.is_alive()
    if victim is a:
        assert result and result[0] != 0  # the writer's daemon died under it
    holders = lambda: (a.holder(agent_id), b.holder(agent_id))  # noqa: E731
    settled = wait_for(lambda: holders().count(HolderState.HELD) == 1 and
                       all(s not in (HolderState.FROZEN, HolderState.COMMITTING, HolderState.OFFERED,
                                     HolderState.VERIFIED, HolderState.PREPARED) for s in holders()) and holders(),
                       "one holder")
    held = {"a": a, "b": b}[ends_on]
    assert settled[0 if ends_on == "a" else 1] is HolderState.HELD, settled
    wait_for(lambda: (held.mnt / "walker").exists(), f"walker shown on {held.name}")
    other = b if held is a else a
    assert "walker" not in os.listdir(other.mnt)
    assert a.staging() == [] and b.staging() == []
    verify_on(held, "walker", tmp_path, 5)
    a.stop()
    b.stop()


def test_a_refused_move_rolls_back_with_eperm(hosts: tuple[Host, Host], tmp_path: Path) -> None:
    a, b = hosts
    start_all(a, b)
    agent_id = make_agent(a)
    make_agent(b, "walker", events=0)  # another agent of that name: B's prepare refuses
    assert write_move(a.mnt, "walker", "b\n") == errno.EPERM
    move = a.status("walker")["move"]
    assert move["outcome"] == "rolled_back" and move["cause"] == "refused", move
    assert "another agent named" in move["detail"]
    assert a.holder(agent_id) is HolderState.HELD and b.holder(agent_id) is HolderState.REFUSED
    assert a.staging() == [] and b.staging() == []
    verify_on(a, "walker", tmp_path, 5)
    a.stop()
    b.stop()


def test_capsulefs_move_goes_through_the_daemon(hosts: tuple[Host, Host], tmp_path: Path) -> None:
    a, b = hosts
    start_all(a, b)
    agent_id = make_agent(a)
    moved = a.cli("move", "walker", "b")
    assert "moved to b (through the daemon" in moved.stdout
    assert b.holder(agent_id) is HolderState.HELD and "walker" in os.listdir(b.mnt)
    assert "walker" not in os.listdir(a.mnt)
    a.stop()
    b.stop()


def test_abandon_reaches_an_in_doubt_move_in_the_daemon(hosts: tuple[Host, Host], tmp_path: Path) -> None:
    import threading

    a, b = hosts
    b.spawn(crash_at="target:held")  # activated on B, the reply lost, and B stays down
    start_all(a, b)
    agent_id = make_agent(a)
    result: list[int] = []
    writer = threading.Thread(target=lambda: result.append(write_move(a.mnt, "walker", "b\n")))
    writer.start()
    b.wait_killed()
    wait_for(lambda: a.holder(agent_id) is HolderState.COMMITTING and
             a.status("walker")["move"].get("phase") == "in doubt", "the source in doubt")
    assert writer.is_alive()  # blocks while in doubt: no timer decides
    busy = a.cli("move", "walker", "b", check=False)
    assert busy.returncode == 1 and "already moving" in busy.stderr
    assert a.cli("move", "--abandon", "walker", check=False).returncode == 1  # no reason: refused
    assert "two hosts" in a.cli("move", "--abandon", "walker", "--why", "B's disk died").stdout
    writer.join(timeout=WAIT)
    assert result == [errno.ECANCELED]
    assert a.holder(agent_id) is HolderState.HELD
    move = a.status("walker")["move"]
    assert move["outcome"] == "abandoned" and "B's disk died" in move["detail"], move
    log = a.log.read_text()
    assert "abandons the move" in log and "two hosts" in log
    a.stop()


# -- a running agent process during moves (issue 7's invariant) -----------------------

TICKER = """\
import os, sys, time
label = os.path.basename(os.path.dirname(os.environ["CAPSULE_DIR"]))  # mnt-a or mnt-b
with open(sys.argv[1], "a") as f:
    f.write(f"start {os.getpid()} {label} {time.monotonic()}\\n")
while True:
    with open("ticks.txt", "a") as t:
        t.write(f"{label}\\n")
    with open(sys.argv[1], "a") as f:
        f.write(f"tick {os.getpid()} {label} {time.monotonic()}\\n")
    time.sleep(0.05)  # (pacing: a tick every 50 ms, the overlap's unit)
"""


def ticker_pids(script: Path) -> dict[int, str]:
    """pid -> host label of every live process running the ticker."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if str(script).encode() not in cmd:
                continue
            env = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        out[int(pid)] = os.path.basename(os.path.dirname(env.get(b"CAPSULE_DIR", b"?").decode()))
    return out


class Watcher:
    """Polls /proc in a thread; records any moment the ticker runs on both hosts."""

    def __init__(self, script: Path) -> None:
        import threading

        self.script = script
        self.seen: set[str] = set()
        self.both: list[dict[int, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            pids = ticker_pids(self.script)
            self.seen.update(pids.values())
            if len(set(pids.values())) > 1:
                self.both.append(pids)
            time.sleep(0.01)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=WAIT)


def new_ticker_agent(a: Host, tmp_path: Path) -> tuple[str, Path, Path]:
    """``capsulefs new walker --spec`` (A's daemon not yet started) with the
    ticker as its entrypoint: the daemon starts the ticker, never first the
    reference agent (a spec edited through the mount would reach only the
    agent's next start, and whether the daemon started it before the edit
    came depended on how fast the machine was)."""
    script, shared, spec = tmp_path / "ticker.py", tmp_path / "ticks.log", tmp_path / "ticker-spec.json"
    script.write_text(TICKER)
    shared.touch()
    shared.chmod(0o666)  # (as root each host runs the agent as a uid of its own)
    spec.write_text(json.dumps({"version": 1, "entrypoint": [sys.executable, str(script), str(shared)]}))
    assert a.proc is None
    a.cli("new", "walker", "--spec", str(spec))
    agent_id = next(r["agent_id"] for r in json.loads(a.cli("ls", "--json").stdout) if r["name"] == "walker")
    assert a.holder(agent_id) is HolderState.HELD
    return agent_id, script, shared


def tick_labels(shared: Path) -> list[str]:
    """The host label of every tick, in time order, runs of one host collapsed."""
    ticks = sorted((float(t), label) for kind, _pid, label, t in
                   (line.split() for line in shared.read_text().splitlines()) if kind == "tick")
    runs: list[str] = []
    for _, label in ticks:
        if not runs or runs[-1] != label:
            runs.append(label)
    return runs


@pytest.mark.parametrize("case", ["moved", "refused", "lost-activate-reply"])
def test_the_agent_process_never_runs_on_both_hosts(hosts: tuple[Host, Host], tmp_path: Path, case: str) -> None:
    import threading

    a, b = hosts
    agent_id, script, shared = new_ticker_agent(a, tmp_path)
    a.spawn(run=True)
    b.spawn(crash_at="target:held" if case == "lost-activate-reply" else None, run=case != "refused")
    start_all(a, b)
    wait_holding(a, "walker")  # (created before A started: it runs once B has said it holds no higher epoch)
    add_messages(a, "walker", 5)
    if case == "refused":
        make_agent(b, "walker", events=0)
    wait_for(lambda: "tick" in shared.read_text(), "the ticker running on a")
    watcher = Watcher(script)
    try:
        wait_for(lambda: "mnt-a" in watcher.seen, "the watcher to see the ticker on a")
        result: list[int] = []
        writer = threading.Thread(target=lambda: result.append(write_move(a.mnt, "walker", "b\n")))
        writer.start()
        if case == "lost-activate-reply":
            b.wait_killed()
            assert not ticker_pids(script)  # frozen on a, and b died before replying
            b.start(run=True)
        writer.join(timeout=WAIT)
        assert not writer.is_alive()
        ends_on = "mnt-a" if case == "refused" else "mnt-b"
        assert result == [errno.EPERM if case == "refused" else 0]
        wait_for(lambda: set(ticker_pids(script).values()) == {ends_on}, f"the ticker running on {ends_on}")
        n = len(shared.read_text().splitlines())
        wait_for(lambda: len(shared.read_text().splitlines()) > n + 3, "a few more ticks")
    finally:
        watcher.stop()
    assert watcher.both == [], watcher.both
    assert watcher.seen == {"mnt-a"} | ({"mnt-b"} if case != "refused" else set()), watcher.seen
    assert tick_labels(shared) == (["mnt-a"] if case == "refused" else ["mnt-a", "mnt-b"])
    holders = (a.holder(agent_id), b.holder(agent_id))
    assert holders.count(HolderState.HELD) == 1
    a.stop()
    b.stop()


def test_a_restored_host_keeps_what_it_appended_and_the_holder_merges_it(hosts: tuple[Host, Host],
                                                                          tmp_path: Path) -> None:
    """A's state directory is copied while A is stopped; A moves the agent to
    B (B holds epoch 2). A is stopped and its state replaced by the old copy:
    its record says held again, and an append is acknowledged there. A then
    learns that B holds the agent (here: at its start, from B; a move is then refused, and
    ``capsulefs move --learn`` through A's daemon). A gives the agent up but
    deletes nothing acknowledged: its copy is kept under recovery/, verifies,
    and is named in the record and the command's words. The documented merge
    on B (docs/move.md) brings A's event to B byte for byte, B's own lines
    unchanged."""
    import shutil

    a, b = hosts
    start_all(a, b)
    agent_id = make_agent(a, events=3)
    a.stop()
    backup = tmp_path / "backup-a"
    shutil.copytree(a.state, backup, symlinks=True)
    a.start()
    wait_holding(a, "walker")  # (a restarted daemon moves an agent once a peer has answered for it)
    assert write_move(a.mnt, "walker", "b\n") == 0
    assert b.holder(agent_id) is HolderState.HELD
    a.stop()
    shutil.rmtree(a.state)
    shutil.copytree(backup, a.state, symlinks=True)  # an operator restores a backup
    appended = a.cli("append", "walker", "--kind", "user_message", "--text", "acknowledged after the restore")
    line = appended.stdout.encode()  # the stamped line, as the journal holds it
    assert b"acknowledged after the restore" in line and line.endswith(b"\n")
    a.start()
    # A asks B at start (docs/move.md, "Checking before running"): B holds a
    # higher epoch, so A's record becomes unknown, and a move of an agent in doubt is refused
    wait_for(lambda: a.holder(agent_id) is HolderState.UNKNOWN, "A to learn at start that B holds the agent")
    assert write_move(a.mnt, "walker", "b\n") == errno.EPERM
    learned = a.cli("move", "walker", "--learn")  # through A's daemon
    rec = HolderBook(a.state / "holders").get(agent_id)
    assert rec is not None and rec.state is HolderState.RETIRED and rec.peer == b.host_id
    assert rec.kept and rec.kept.startswith(f"recovery/{agent_id}/kept-e1-"), rec
    assert f"what this host had is kept in {rec.kept}" in learned.stdout
    wait_for(lambda: "walker" not in os.listdir(a.mnt), "walker gone from A's mount")
    assert rec.kept in a.log.read_text()  # the log names the copy too
    kept = a.state / rec.kept
    assert "OK" in a.cli("verify", str(kept)).stdout
    assert line in (kept / "memory" / "timeline_events.jsonl").read_bytes()

    # docs/move.md, "Merging what a host kept": copy it to the holder, merge it in there.
    copy = tmp_path / "copy-on-b"
    shutil.copytree(kept, copy)
    before = (b.mnt / "walker" / "memory" / "timeline_events.jsonl").read_bytes()
    b.stop()
    merged = b.cli("merge", "walker", str(copy), "--into")
    assert "1 new" in merged.stdout, merged.stdout
    b.start()
    after = (b.mnt / "walker" / "memory" / "timeline_events.jsonl").read_bytes()
    lines = after.splitlines(keepends=True)
    assert line in lines  # A's event, byte for byte
    assert set(before.splitlines(keepends=True)) <= set(lines) and len(lines) == len(before.splitlines()) + 1
    check_chains(after)
    tar = tmp_path / "b-walker.tar"
    subprocess.run(["tar", "-C", str(b.mnt / "walker"), "-cf", str(tar), "."], check=True, capture_output=True)
    assert "OK" in b.cli("verify", str(tar)).stdout
    a.stop()
    b.stop()


def test_import_status_ls_and_log_tell_one_story(hosts: tuple[Host, Host], tmp_path: Path) -> None:
    """After an import of another host's export, and again after --learn,
    `import` (or `--learn`), `.control/status`, `capsulefs ls` and the
    daemon's log say the same state and the same next command, in the same
    words (story.story)."""
    a, b = hosts
    a.start()
    agent_id = make_agent(a, events=2)
    tar = tmp_path / "walker.tar"
    a.cli("export", "walker", "-o", str(tar))
    a.cli("rm", "walker")  # through A's daemon: A no longer holds it
    imported = b.cli("import", str(tar)).stdout.splitlines()[-1]
    assert imported.startswith("walker: in-doubt: ") and imported.endswith("next: capsulefs move walker --learn")
    b.start()

    def said(line: str) -> None:
        assert line == "walker: " + b.status("walker")["record"]["detail"]
        listed = json.loads(b.cli("ls", "--json").stdout)
        assert [f"{r['name']}: {r['line']}" for r in listed] == [line]
        wait_for(lambda: f"agent walker ({agent_id})" in b.log.read_text() and line[len("walker: "):]
                 in b.log.read_text(), "the log to say it")

    said(imported)
    learned = b.cli("move", "walker", "--learn").stdout.strip()  # through B's daemon
    assert learned == "walker: every peer answered and none holds it: held: this host holds it at epoch 1"
    said("walker: held: this host holds it at epoch 1")
    a.stop()
    b.stop()


def test_an_agent_imported_back_after_it_moved_away_is_shown_at_once(hosts: tuple[Host, Host],
                                                                       tmp_path: Path) -> None:
    """A's agent moved to B (A's record: retired), then B's export imported on
    A while A's daemon serves: an arrival, shown at once as its new record
    says (in doubt: read-only, not run), not hidden until a restart. A's own
    copy from before the move is refused in one line, and nothing is installed."""
    a, b = hosts
    start_all(a, b)
    agent_id = make_agent(a, events=2)
    before = tmp_path / "before.tar"
    a.cli("export", "walker", "-o", str(before))  # (A's own copy, at epoch 1)
    assert write_move(a.mnt, "walker", "b\n") == 0
    assert a.holder(agent_id) is HolderState.RETIRED and "walker" not in os.listdir(a.mnt)

    refused = a.cli("import", str(before), check=False)
    assert refused.returncode == 1 and refused.stdout == "", refused
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert f"this host handed it to host {b.host_id} at epoch 2" in refused.stderr, refused.stderr
    assert not (a.state / "agents" / agent_id).exists() and a.holder(agent_id) is HolderState.RETIRED
    assert "walker" not in os.listdir(a.mnt)

    from_b = tmp_path / "from-b.tar"
    b.cli("export", "walker", "-o", str(from_b))
    said = a.cli("import", str(from_b)).stdout.splitlines()[-1]
    assert said.startswith("walker: in-doubt: "), said
    wait_for(lambda: "walker" in os.listdir(a.mnt), "the import shown on A without a restart")
    st = a.status("walker")
    assert st["state"] == "frozen" and st["writable"] is False and st["record"]["state"] == "unknown", st
    assert "walker: " + st["record"]["detail"] == said
    with pytest.raises(OSError) as exc:
        with open(a.mnt / "walker" / "memory" / "timeline_events.jsonl", "a") as f:
            f.write(json.dumps({"kind": "user_message", "text": "written on A"}) + "\n")
    assert exc.value.errno == errno.EROFS
    # B still holds it and takes writes
    assert b.holder(agent_id) is HolderState.HELD and b.status("walker")["state"] == "active"
    a.stop()
    b.stop()
    # and a restart shows it the same way
    a.start()
    assert a.status("walker")["state"] == "frozen" and a.status("walker")["record"]["state"] == "unknown"
    a.stop()
