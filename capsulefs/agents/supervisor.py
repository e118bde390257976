"""Supervision of agent processes: build the sandbox, run, restart, freeze.

Rules:
  * An agent runs only while this host holds it actively and its spec has an
    entrypoint. The daemon says which agents that is (:meth:`Supervisor.want`
    / :meth:`Supervisor.unwant`); the supervisor never decides it.
  * The sandbox is host-local (``<state>/sandboxes/<agent_id>/workspace``),
    materialised from the snapshot; the spec's setup steps run there, in
    order, before the entrypoint, each in its own process group, stopped
    and reaped as the agent's process is.
  * The process gets the spec's plain env, ``CAPSULE_DIR`` (the agent's
    directory in the mount) and the spec's secrets, fetched from the host
    keychain for that one run, and ``CAPSULE_SECRETS`` naming them (so the
    agent can keep them from its tools). A missing secret means no start;
    the status names it; it is tried again every few seconds, so it starts
    once the secret is set. Secret values are never logged, nor shown in
    the status (a failed setup step's output is redacted).
  * Stopping is at a step boundary: SIGTERM to the process group, a grace
    period, then SIGKILL. Freezing stops the process and syncs the sandbox's
    changes back into the capsule (:class:`Hooks.commit_workspace`) before
    it returns, so an offer carries them.
  * A sandbox may hold gigabytes, and the event loop serves the whole mount:
    building a sandbox, syncing it (the scan, hashing, storing its blobs)
    and discarding it run in a worker thread, never on the loop. One such
    job at a time per agent (its sandbox lock): a second freeze waits for
    the first's sync and then finds nothing new, and no process starts in a
    sandbox being scanned, built or removed. A cancelled job stops within a
    chunk (``trio.from_thread.check_cancelled``); a cancelled build removes
    what it wrote.
  * ``capsulefs ...`` (the reference agent) runs isolated, ``python -I -m
    capsulefs``: nothing its tools write into the workspace is imported by it
    (:func:`ours_isolated`).
  * A run ends with its process: once it exits (crashed, finished or
    stopped), what is left of its process group (tools it started) is killed.
  * As root, the agent's processes run as a uid of its own, in a cgroup of
    their own, and cannot read the state directory (capsulefs/agents/isolation.py);
    a run ends with that cgroup, so a process that left the process group
    goes too. Not root: isolation is off, and the status says so.
  * A running agent says how its steps go in one small file it writes,
    ``$CAPSULE_STATUS`` (in its HOME: ``agent-status.json``, ``{"problem":
    text, ...}``, removed once a step succeeds); the status shows it as
    ``problem`` and ``last_error`` (capsulefs/agents/reports.py, which reads
    it as hostile). It is removed before each start. What the daemon sees
    fail (no start, a setup step, a crash) is ``last_error`` too.
  * The agent process's stdout and stderr are a pipe the daemon reads into
    the agent's log (capsulefs/agents/agent_log.py), with the daemon's own
    lines about the run; a crash's last lines are in ``last_error``.
  * A change of the spec or of its grants restarts a running agent at its
    next step boundary (:meth:`Supervisor.restart`, asked by
    capsulefs/agents/steering.py): at once, not counted as a crash.
  * A crash (non-zero exit) is followed by a restart with exponential
    backoff, visible in the status. An exit with status 0 means the agent
    finished; it is not restarted until wanted again.

Theory of operation: one trio task per wanted agent, all in the
supervisor's nursery, each owning its process. Time comes from trio's clock,
so tests run it with MockClock and no real sleeps.
"""

from __future__ import annotations

import enum
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import trio

from capsulefs.agents import grants, keychain
from capsulefs.agents.agent_log import AgentLog, last_lines, pump_output
from capsulefs.agents.isolation import Isolation
from capsulefs.agents.reports import AGENT_STATUS, Failure, fix_for, read_agent_report
from capsulefs.agents.steering import spec_digest
from capsulefs.core import metrics
from capsulefs.core.capsule import format as fmt
from capsulefs.core.capsule import workspace
from capsulefs.core.errors import CapsuleError
from capsulefs.core.fsutil import remove_tree
from capsulefs.core.capsule.spec import SECRETS_ENV, STATUS_ENV, redact_secrets, secrets_in, validate_spec

log = logging.getLogger(__name__)

GRACE_SECONDS = 5.0
BACKOFF_FIRST = 1.0
BACKOFF_MAX = 60.0
BLOCKED_RETRY = 2.0  # how often an agent that cannot start (a missing secret) is tried again
BASE_ENV_KEYS = ("PATH", "LANG", "LC_ALL", "TZ")
#: The host-local sandboxes, under the state dir: ``sandboxes/<agent_id>/``
#: holds ``workspace/``, the running process's ``pid`` file and ``setup.log``.
SANDBOXES_DIR = "sandboxes"
SETUP_LOG = "setup.log"  # beside workspace/: the output of the last build's setup steps
CRASH_LINES = 5  # lines of its log a crash's last_error shows


def sandbox_root(state_dir: str) -> str:
    return os.path.join(state_dir, SANDBOXES_DIR)


def discard_sandbox(state_dir: str, agent_id: str) -> None:
    """Remove an agent's sandbox (its process must not run: stop it first)."""
    fmt.check_agent_id(agent_id)
    remove_tree(os.path.join(sandbox_root(state_dir), agent_id), ignore_errors=True)


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def read_agent_problem(path: str, owner: int) -> str | None:
    """The ``problem`` an agent wrote to its status file, as one line of at
    most 500 characters; None if there is none or the file is not one to
    trust (a link, not a regular file, another owner, too big, not JSON)."""
    report = read_agent_report(path, owner)
    return report.what if report is not None else None


def _signal_group(pgid: int, sig: int) -> bool:
    """Signal a process group; False if it is already gone."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True


class SandboxBuildError(CapsuleError):
    """The sandbox could not be made from the snapshot (a full disk, a
    snapshot whose paths collide)."""


def _group_members(pgid: int) -> list[int]:
    """The pids of process group ``pgid``'s processes (from /proc)."""
    members = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()  # (the command name may hold spaces)
        except (OSError, IndexError):
            continue  # gone meanwhile
        if len(fields) > 2 and int(fields[2]) == pgid:  # state, ppid, pgrp
            members.append(int(name))
    return members


def _environ_has(pid: int, entry: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return entry in f.read().split(b"\0")
    except OSError:
        return False


def _why_not_started(exc: OSError | ValueError) -> str:
    """Why exec refused a process, without the values it was given (secrets)."""
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    return "an argument or environment value holds a NUL byte"  # (what else subprocess raises ValueError for here)


def _last_line(path: str, start: int) -> str:
    """The last non-blank line written to ``path`` after offset ``start``."""
    with open(path, "rb") as f:
        f.seek(max(start, os.path.getsize(path) - 64 * 1024))
        lines = f.read().decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else ""


#: ``python -m capsulefs ...`` as a spec may spell it (any python: ``python3``, ``python3.11``, a path to one).
_PYTHON = re.compile(r"python[0-9.]*")


#: This interpreter's ``capsulefs`` script (its shebang runs python without -I).
_OUR_SCRIPT = os.path.realpath(os.path.join(os.path.dirname(sys.executable), "capsulefs"))


def ours_isolated(argv: list[str]) -> list[str]:
    """An entrypoint or setup step that runs capsulefs itself, made to run this
    host's capsulefs isolated: ``capsulefs ...`` (or the path of this
    interpreter's ``capsulefs`` script) becomes ``python -I -m capsulefs
    ...`` with this interpreter (wherever it is installed), and
    ``python -m capsulefs ...`` gains ``-I``. Without ``-I``, ``-m`` puts
    the working directory (the workspace, which the agent and its tools
    write) first on ``sys.path``, and a ``json.py`` planted there would run
    inside the process that holds the agent's secrets; ``-I`` also ignores
    ``PYTHON*`` variables and the user site (under the agent's ``HOME``).
    Any other program runs as the spec says (it is the spec's own code)."""
    if argv[0] == "capsulefs" or (os.path.isabs(argv[0]) and os.path.realpath(argv[0]) == _OUR_SCRIPT):
        return [sys.executable, "-I", "-m", "capsulefs", *argv[1:]]
    if argv[1:2] == ["-m"] and argv[2:3] and argv[2].partition(".")[0] == "capsulefs" \
            and _PYTHON.fullmatch(os.path.basename(argv[0])):
        return [argv[0], "-I", *argv[1:]]
    return argv


def _die_with_parent() -> None:
    """In the child before exec: die with SIGKILL when the daemon dies (Linux).

    The kernel sends it when the *thread* that forked the child ends, so the
    child must be forked by the daemon's main thread (see :class:`Child`),
    never by a worker thread that trio retires after some idle seconds."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class Child:
    """An agent process forked by the calling (main) thread, awaited via a pidfd.

    trio's ``open_process`` forks in a worker thread, which would make
    PDEATHSIG fire when that thread retires. Forking here takes a millisecond
    on the event loop; waiting costs nothing (the pidfd becomes readable when
    the process exits). Many tasks may wait; one of them watches the pidfd."""

    def __init__(self, argv: list[str], *, cwd: str, env: dict[str, str], output: int | None = None,
                 preexec: Callable[[], None] = _die_with_parent, kill_rest: Callable[[], None] | None = None) -> None:
        """``preexec`` runs in the child before exec (it must set PDEATHSIG,
        as :func:`_die_with_parent` does); ``kill_rest`` kills what is left of
        the run besides its process group (its cgroup) once the process exited."""
        self._popen = subprocess.Popen(argv, cwd=cwd, env=env, start_new_session=True, stdin=subprocess.DEVNULL,
                                       stdout=output, stderr=output, preexec_fn=preexec)
        self._kill_rest = kill_rest
        self.pid = self._popen.pid
        self._pidfd = os.pidfd_open(self.pid)
        self._waiting = False

    @property
    def returncode(self) -> int | None:
        """The exit status once the process exited. Before reaping it, the
        rest of its process group (the tools it started) is killed: a run
        ends with its process, and nothing of it is left unsupervised. (The
        unreaped leader still holds the group's id: no other group has it.)"""
        if self._popen.returncode is None and self._pidfd >= 0:
            try:
                exited = os.waitid(os.P_PIDFD, self._pidfd, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                exited = None
            if exited is None:
                return None
            _signal_group(self.pid, signal.SIGKILL)
            if self._kill_rest is not None:
                self._kill_rest()
        return self._popen.poll()

    async def wait(self) -> int:
        while self.returncode is None:
            if self._waiting:  # another task watches the pidfd (one watcher per fd)
                await trio.sleep(0.02)
                continue
            self._waiting = True
            try:
                await trio.lowlevel.wait_readable(self._pidfd)
            finally:
                self._waiting = False
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1
        return self._popen.returncode  # type: ignore[return-value]


class RunState(enum.Enum):
    STOPPED = "stopped"
    BUILDING = "building"
    RUNNING = "running"
    BACKOFF = "backoff"
    BLOCKED = "blocked"  # cannot start: missing secret, bad spec...
    FINISHED = "finished"
    FROZEN = "frozen"


class Hooks(Protocol):
    """What the supervisor needs from the daemon, per agent id."""

    def spec(self, agent_id: str) -> Mapping[str, Any]: ...

    def snapshot(self, agent_id: str) -> Mapping[str, str]: ...

    def read_blob(self, sha256: str): ...  # iterator of bytes

    def capsule_dir(self, agent_id: str) -> str: ...

    def commit_workspace(self, agent_id: str, scan: workspace.ScanResult) -> None:
        """Store the scan's changes in the capsule. Called in a worker thread
        (under the agent's sandbox lock); what must happen on the event loop
        goes there through ``trio.from_thread``."""
        ...


@dataclass
class RunStatus:
    state: RunState = RunState.STOPPED
    pid: int | None = None
    restarts: int = 0
    last_exit: int | None = None
    detail: str = ""  # words for .control/status
    next_start_in: float | None = None
    failure: Failure | None = None  # the daemon's last failure of this agent (reports.py)
    spec_digest: str | None = None  # of the spec the run started from (steering.py)
    secrets: list[str] = field(default_factory=list)  # the secret names it was given

    def as_json(self) -> dict[str, Any]:
        return {
            "state": self.state.value,
            "pid": self.pid,
            "restarts": self.restarts,
            "last_exit": self.last_exit,
            "detail": self.detail,
            "spec": {"digest": self.spec_digest, "secrets": self.secrets} if self.spec_digest else None,
        }


@dataclass
class _Runner:
    agent_id: str
    status: RunStatus = field(default_factory=RunStatus)
    # Made with the runner, entered by its task: a stop that comes before the
    # task has run at all still takes effect (trio keeps the cancel).
    cancel: trio.CancelScope = field(default_factory=trio.CancelScope)
    process: Child | None = None
    done: trio.Event = field(default_factory=trio.Event)
    log: AgentLog | None = None
    restart_why: str | None = None  # a restart was asked (restart()): why


class Supervisor:
    def __init__(self, state_dir: str, hooks: Hooks, *, grace: float = GRACE_SECONDS,
                 base_env: Mapping[str, str] | None = None, healthy: float = BACKOFF_MAX,
                 clock: Callable[[], float] = time.monotonic, isolation: Isolation | None = None) -> None:
        self.state_dir = state_dir
        #: How agents are kept from the daemon's files and each other
        #: (detected: on as root; see capsulefs/agents/isolation.py).
        self.isolation = isolation if isolation is not None else Isolation.detect(state_dir)
        #: A run that lasted this long (by ``clock``, real time: the wall of
        #: the agent's own work, not trio's) was healthy: the restart after
        #: its crash waits BACKOFF_FIRST again, not the delay earlier
        #: crashes had built up.
        self.healthy = healthy
        self._clock = clock
        self.sandbox_root = sandbox_root(state_dir)
        self.hooks = hooks
        self.grace = grace
        self.base_env = dict(base_env) if base_env is not None else {
            k: v for k, v in os.environ.items() if k in BASE_ENV_KEYS
        }
        self._runners: dict[str, _Runner] = {}
        #: Per agent: held while a worker thread builds, syncs or discards its
        #: sandbox (see the module's rules), never across a checkpoint elsewhere.
        self._sandbox_locks: dict[str, trio.Lock] = {}
        self._nursery: trio.Nursery | None = None
        self._stopping = False  # stop_all began: no agent starts again

    # -- lifecycle -----------------------------------------------------------
    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Own the agents' tasks; never returns until cancelled."""
        self.isolation.announce()
        if self.isolation.enabled:
            self.isolation.harden_state_dir()
        self.reap_orphans()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None
                self._stopping = True  # (a move's recovery, shielded, may still ask for an agent: no-op)
                with trio.CancelScope(shield=True):
                    for runner in list(self._runners.values()):
                        await self._stop_process(runner)
                    if self.isolation.cgroups is not None:
                        self.isolation.cgroups.close()

    def status(self, agent_id: str) -> RunStatus:
        r = self._runners.get(agent_id)
        return r.status if r else RunStatus()

    def sandbox(self, agent_id: str) -> str:
        return os.path.join(self.sandbox_root, agent_id, "workspace")

    def _sandbox_lock(self, agent_id: str) -> trio.Lock:
        return self._sandbox_locks.setdefault(agent_id, trio.Lock())

    def agent_problem(self, agent_id: str) -> str | None:
        """What the running agent last reported as its problem (see the
        module rules), or None: nothing reported, or not running."""
        r = self._runners.get(agent_id)
        if r is None or r.status.state is not RunState.RUNNING:
            return None
        report = self.agent_report(agent_id)
        return report.what if report is not None else None

    def agent_report(self, agent_id: str) -> Failure | None:
        """The failure the running agent reported (see reports.py), or None."""
        r = self._runners.get(agent_id)
        if r is None or r.status.state is not RunState.RUNNING:
            return None
        home = self.isolation.home(agent_id) if self.isolation.enabled else os.path.join(self.sandbox_root, agent_id)
        owner = self.isolation.ids_for(agent_id).uid if self.isolation.enabled else os.getuid()
        return read_agent_report(os.path.join(home, AGENT_STATUS), owner)

    def last_error(self, agent_id: str) -> Failure | None:
        """Why the agent does not answer, if it says or the daemon saw: what
        the running agent reports, else the daemon's last failure while it
        does not run because of it (blocked, or waiting to restart)."""
        report = self.agent_report(agent_id)
        if report is not None:
            return report
        st = self.status(agent_id)
        return st.failure if st.state in (RunState.BLOCKED, RunState.BACKOFF) else None

    def _failed(self, r: _Runner, what: str, *, retry_in: float | None, fix: str | None = None,
                output: tuple[str, ...] = ()) -> None:
        now = time.time()
        r.status.failure = Failure(what=what, at=now, retry_at=None if retry_in is None else now + retry_in,
                                   fix=fix, output=output)

    def _pidfile(self, agent_id: str) -> str:
        return os.path.join(self.sandbox_root, agent_id, "pid")

    def reap_orphans(self) -> list[int]:
        """Kill agent processes a previous daemon of this state dir left running.

        A daemon killed outright cannot stop its agents (they also die with
        it through PDEATHSIG, but their own children may not). Each run's
        process group id is kept in a pid file; a group is killed only if
        one of its processes (the leader, or once PDEATHSIG took it, a tool
        it started) still carries that agent's CAPSULE_AGENT_ID, so a reused
        pid is never hit (the kernel reuses no pid while a group bears it)."""
        killed = []
        if not os.path.isdir(self.sandbox_root):
            return killed
        for agent_id in os.listdir(self.sandbox_root):
            path = self._pidfile(agent_id)
            try:
                with open(path) as f:
                    pgid = int(f.read().strip())
            except (OSError, ValueError):
                continue
            mark = f"CAPSULE_AGENT_ID={agent_id}".encode()
            mine = any(_environ_has(pid, mark) for pid in _group_members(pgid))
            if mine and _signal_group(pgid, signal.SIGKILL):
                killed.append(pgid)
                log.warning("killed agent %s's process group %d, left by an earlier daemon", agent_id, pgid)
            os.unlink(path)
        cgroups = self.isolation.cgroups
        for agent_id in cgroups.leftovers() if cgroups is not None else ():
            if cgroups.populated(agent_id):
                log.warning("killing what is left in agent %s's cgroup, left by an earlier daemon", agent_id)
                cgroups.kill(agent_id)
            cgroups.remove(agent_id)  # (still dying: removed after its next run)
        if cgroups is not None:
            cgroups.close()  # (made again by the next run)
        return killed

    def want(self, agent_id: str) -> None:
        """Run this agent (no-op if it already runs)."""
        if self._stopping:
            return  # the daemon is shutting down
        if self._nursery is None:
            raise RuntimeError("supervisor is not serving")
        r = self._runners.get(agent_id)
        if r is not None and not r.done.is_set():
            return
        r = _Runner(agent_id, log=AgentLog(self.state_dir, agent_id))
        self._runners[agent_id] = r
        self._nursery.start_soon(self._run, r)

    def running_specs(self) -> list[tuple[str, str, list[str]]]:
        """(agent id, spec digest, secret names) of every running agent's run
        that no restart was asked of yet."""
        return [(r.agent_id, r.status.spec_digest, list(r.status.secrets)) for r in self._runners.values()
                if r.status.state is RunState.RUNNING and r.restart_why is None and r.status.spec_digest]

    def restart(self, agent_id: str, why: str) -> bool:
        """Stop the running agent at a step boundary (SIGTERM, the grace
        period, SIGKILL) and start it again at once, from its spec as it is
        then; False if it does not run."""
        r = self._runners.get(agent_id)
        if r is None or r.done.is_set() or r.process is None or r.status.state is not RunState.RUNNING \
                or self._nursery is None:
            return False
        if r.restart_why is None:
            r.restart_why = why
            r.status.detail = f"restarting at its next step boundary: {why}"
            self._note(r, r.status.detail)
            self._nursery.start_soon(self._terminate, r, r.process)
        return True

    async def _terminate(self, r: _Runner, proc: Child) -> None:
        """SIGTERM, the grace period, SIGKILL; the run's task reaps it and
        cleans up after it (as for a crash)."""
        if proc.returncode is not None:
            return
        _signal_group(proc.pid, signal.SIGTERM)
        with trio.move_on_after(self.grace):
            await proc.wait()
        if proc.returncode is None:
            log.warning("agent %s ignored SIGTERM for %.0f s; killing it", r.agent_id, self.grace)
            _signal_group(proc.pid, signal.SIGKILL)

    async def unwant(self, agent_id: str, *, sync: bool = True) -> None:
        """Stop the agent at a step boundary; with ``sync``, commit its
        workspace (also one this daemon never ran: an earlier one's work)."""
        r = self._runners.get(agent_id)
        if r is not None:
            r.cancel.cancel()
            await r.done.wait()
        if sync:
            await self.sync_workspace(agent_id)

    async def stop_all(self) -> None:
        """Stop every agent at a step boundary, all at once, and start none
        again: the first half of the daemon's shutdown, while the mount still
        serves the agents (an agent stopping may journal its last step).
        Returns when every process has exited (each within the grace period)."""
        self._stopping = True
        async with trio.open_nursery() as nursery:
            for agent_id in list(self._runners):
                nursery.start_soon(partial(self.unwant, agent_id, sync=False))

    def kill_all(self) -> None:
        """SIGKILL every agent's process group now: a second stop signal
        does not wait for step boundaries."""
        self._stopping = True
        for r in list(self._runners.values()):
            if r.process is not None and r.process.returncode is None:
                _signal_group(r.process.pid, signal.SIGKILL)
                if self.isolation.cgroups is not None:
                    self.isolation.cgroups.kill(r.agent_id)

    async def freeze(self, agent_id: str, *, sync: bool = True) -> None:
        """Stop the agent for a move; with ``sync``, commit its sandbox first
        (not for an agent this host may not hold: its capsule takes no write)."""
        await self.unwant(agent_id, sync=sync)
        r = self._runners.get(agent_id)
        if r is not None:
            r.status.state = RunState.FROZEN
            r.status.detail = "frozen for a move"

    async def sync_workspace(self, agent_id: str) -> workspace.ScanResult | None:
        """Commit the sandbox's changes (None if it has no sandbox here), in a
        worker thread: the event loop serves every other agent meanwhile.
        Cancelled, it stops within a chunk and commits nothing (blobs it
        stored are gc's), unless the commit's step on the loop began: that
        one completes."""
        async with self._sandbox_lock(agent_id):
            return await trio.to_thread.run_sync(self._sync_in_thread, agent_id)

    def _sync_in_thread(self, agent_id: str) -> workspace.ScanResult | None:
        sandbox = self.sandbox(agent_id)
        if not os.path.isdir(sandbox):  # (a scan of nothing would journal every file as deleted)
            return None
        scan = workspace.scan(sandbox, self.hooks.snapshot(agent_id), check=trio.from_thread.check_cancelled)
        if scan.changes:
            self.hooks.commit_workspace(agent_id, scan)
        return scan

    # -- one agent -----------------------------------------------------------------
    async def _run(self, r: _Runner) -> None:
        backoff = BACKOFF_FIRST
        try:
            with r.cancel:
                # A stop that came before this task ran: nothing below starts
                # the agent without passing a checkpoint first.
                await trio.lowlevel.checkpoint()
                while not self._stopping:
                    try:
                        argv, env, cwd, setup = await self._prepare(r)
                    except (CapsuleError, OSError) as exc:  # (OSError: a snapshot whose paths collide, a full disk)
                        if r.status.state is not RunState.BLOCKED or not r.status.detail.startswith(str(exc)):
                            log.warning("agent %s not started: %s", r.agent_id, exc)
                            self._note(r, f"not started: {exc}")
                        r.status.state, r.status.detail = RunState.BLOCKED, str(exc)
                        r.status.pid = None
                        wait = backoff if isinstance(exc, SandboxBuildError) else BLOCKED_RETRY
                        self._failed(r, f"not started: {exc}", retry_in=wait, fix=fix_for(exc, r.agent_id))
                        if isinstance(exc, SandboxBuildError):
                            # Building costs a whole workspace of writes (on a
                            # full disk, filling it again): back off as after a crash.
                            r.status.detail += f"; trying again in {backoff:.0f} s"
                            await trio.sleep(backoff)
                            backoff = min(backoff * 2, BACKOFF_MAX)
                        else:
                            await trio.sleep(BLOCKED_RETRY)  # (a secret set meanwhile: it starts)
                        continue
                    if argv is None:
                        r.status.state, r.status.detail = RunState.STOPPED, "the spec has no entrypoint"
                        return
                    r.status.state, r.status.detail = RunState.BUILDING, "running setup steps"
                    if not await self._setup(r, setup, env, cwd):
                        r.status.state = RunState.BACKOFF
                        self._failed(r, r.status.detail, retry_in=backoff)
                        self._note(r, f"{r.status.detail}; restarting in {backoff:.0f} s")
                    else:
                        began = self._clock()
                        code = await self._run_process(r, argv, env, cwd)
                        if self._clock() - began >= self.healthy:
                            backoff = BACKOFF_FIRST
                        r.status.pid = None  # (gone: its pid may be another process's soon)
                        if r.restart_why is not None and code is not None:  # asked: not a crash, no backoff
                            r.status.last_exit = code
                            self._note(r, f"exited with status {code}; starting again: {r.restart_why}")
                            r.restart_why = None
                            r.status.restarts += 1
                            await trio.lowlevel.checkpoint()
                            continue
                        r.restart_why = None
                        output: tuple[str, ...] = ()
                        if code is None:  # it could not start: the detail says why
                            why = r.status.detail
                        else:
                            r.status.last_exit = code
                            self._note(r, f"exited with status {code}")
                            if code == 0:
                                r.status.state, r.status.detail = RunState.FINISHED, "the entrypoint exited with status 0"
                                return
                            why = f"the entrypoint exited with status {code}"
                            output = self._last_output(r, secrets_in(env))
                        r.status.state = RunState.BACKOFF
                        r.status.detail = f"{why}; restarting in {backoff:.0f} s"
                        if output:
                            r.status.detail = f"{why}: {output[-1][:200]}; restarting in {backoff:.0f} s"
                        self._failed(r, why, retry_in=backoff, output=output)
                        self._note(r, f"restarting in {backoff:.0f} s")
                        log.warning("agent %s: %s", r.agent_id, r.status.detail)
                    r.status.restarts += 1
                    metrics.AGENT_RESTARTS.inc()
                    r.status.next_start_in = backoff
                    await trio.sleep(backoff)
                    backoff = min(backoff * 2, BACKOFF_MAX)
        finally:
            with trio.CancelScope(shield=True):
                await self._stop_process(r)
            if r.status.state in (RunState.RUNNING, RunState.BUILDING, RunState.BACKOFF, RunState.BLOCKED):
                r.status.state, r.status.detail = RunState.STOPPED, "stopped"
            r.status.pid = None
            r.done.set()

    async def _prepare(self, r: _Runner) -> tuple[list[str] | None, dict[str, str], str, list[list[str]]]:
        # Checked here, not only where the mount takes a write: a spec can
        # arrive with a move or an import, and one that breaks the rules
        # must block its agent, never crash the supervisor (SpecError).
        spec = validate_spec(self.hooks.spec(r.agent_id))
        entry = spec.get("entrypoint")
        if not entry:
            return None, {}, "", []
        grants.check(self.state_dir, r.agent_id, spec.get("secrets", []))  # (a spec only asks)
        secrets = keychain.fetch(self.state_dir, spec.get("secrets", []))
        r.status.spec_digest, r.status.secrets = spec_digest(spec), sorted(secrets)
        cwd = self.sandbox(r.agent_id)
        # (under the sandbox lock: never into a sandbox a sync is still
        # scanning or a discard is still removing)
        capsule_dir = self.hooks.capsule_dir(r.agent_id)
        home = os.path.dirname(cwd)
        if self.isolation.enabled:
            self.isolation.ids_for(r.agent_id)  # (on the loop: a new owner is told to the mount from here)
            home = self.isolation.home(r.agent_id)
        async with self._sandbox_lock(r.agent_id):
            await trio.to_thread.run_sync(self._build_sandbox, r.agent_id, cwd)
            if self.isolation.enabled:
                # Giving a whole workspace to the agent's uid walks it: off the
                # loop too. (The mount point, not the capsule dir: a stat
                # there would wait on this very daemon.)
                await trio.to_thread.run_sync(partial(self.isolation.prepare, r.agent_id, cwd,
                                                      reach=[cwd, os.path.dirname(capsule_dir)]))
        env = dict(self.base_env)
        env.setdefault("PATH", os.defpath)
        env.update(spec.get("env", {}))
        env["HOME"] = home
        env[STATUS_ENV] = os.path.join(home, AGENT_STATUS)
        _remove_quietly(env[STATUS_ENV])  # (an earlier run's problem is not this one's)
        env["CAPSULE_DIR"] = capsule_dir
        env["CAPSULE_AGENT_ID"] = r.agent_id
        env.update(secrets)
        env[SECRETS_ENV] = ",".join(sorted(secrets))
        argv = ours_isolated(list(entry))
        if self.isolation.enabled:  # (an interpreter under /root, say: say so, not just EACCES)
            program = shutil.which(argv[0], path=env["PATH"]) if os.sep not in argv[0] else os.path.join(cwd, argv[0])
            if program is not None:
                self.isolation.check_reachable(r.agent_id, os.path.realpath(program))
        return argv, env, cwd, [ours_isolated(list(step)) for step in spec.get("setup", [])]

    def _build_sandbox(self, agent_id: str, cwd: str) -> None:
        """Materialise the sandbox from the snapshot unless it exists (in a
        worker thread)."""
        if os.path.isdir(cwd):
            return
        try:
            workspace.materialize(self.hooks.snapshot(agent_id), self.hooks.read_blob, cwd,
                                  check=trio.from_thread.check_cancelled)
        except BaseException as exc:
            # Never leave half a workspace (also not when cancelled): the next
            # try would run the agent in it, and the next sync would delete
            # what is missing.
            remove_tree(cwd, ignore_errors=True)
            if isinstance(exc, (CapsuleError, OSError)):
                raise SandboxBuildError(f"its sandbox could not be built from the snapshot: {exc}") from None
            raise

    async def _setup(self, r: _Runner, setup: list[list[str]], env: dict[str, str], cwd: str) -> bool:
        """Run the spec's setup steps in order, each supervised as the agent
        is (its own process group, stopped and reaped with what it started),
        their output in ``sandboxes/<agent_id>/setup.log``."""
        with open(os.path.join(self.sandbox_root, r.agent_id, SETUP_LOG), "wb") as out:
            for i, step in enumerate(setup):
                what = f"setup step {i + 1} ({step[0]})"
                start = out.tell()
                code = await self._run_child(r, list(step), env, cwd, what=what, output=out.fileno())
                if code is None:
                    return False
                if code != 0:
                    last = redact_secrets(_last_line(out.name, start), secrets_in(env))
                    r.status.detail = f"{what} failed with status {code}: {last}"
                    log.warning("agent %s: %s", r.agent_id, r.status.detail)
                    return False
        return True

    async def _run_process(self, r: _Runner, argv: list[str], env: dict[str, str], cwd: str) -> int | None:
        """Run the agent's process; its exit status, or None (the reason in
        the status' detail) if it could not start."""
        return await self._run_child(r, argv, env, cwd, what=f"the entrypoint {argv[0]}", agent=True)

    def _last_output(self, r: _Runner, secrets: Mapping[str, str]) -> tuple[str, ...]:
        """The last lines the process wrote (its log's, not the daemon's
        own), without the run's secret values, as a setup step's output."""
        if r.log is None:
            return ()
        texts = [line.partition(" ")[2] for line in last_lines(r.log.path, 4 * CRASH_LINES)]
        mine = [redact_secrets(t, secrets) for t in texts if not t.startswith("capsulefs: ")]
        return tuple(mine[-CRASH_LINES:])

    def _note(self, r: _Runner, text: str) -> None:
        """A line of the daemon's in the agent's log (never failing a run)."""
        if r.log is not None:
            try:
                r.log.note(text)
            except OSError as exc:
                log.warning("agent %s: cannot write its log %s: %s", r.agent_id, r.log.path, exc)

    async def _run_child(self, r: _Runner, argv: list[str], env: dict[str, str], cwd: str, *, what: str,
                         agent: bool = False, output: int | None = None) -> int | None:
        if agent and r.log is not None:
            read_end, output = os.pipe2(os.O_CLOEXEC)  # (the child's stdout and stderr: the agent's log)
            try:
                async with trio.open_nursery() as nursery:
                    pumped = trio.Event()
                    nursery.start_soon(pump_output, trio.lowlevel.FdStream(read_end), r.log, pumped)
                    try:
                        return await self._start_and_wait(r, argv, env, cwd, what=what, agent=agent, output=output)
                    finally:
                        os.close(output)
                        # What the process wrote before it exited is in the
                        # pipe; a tool it left holding the pipe open (that
                        # left its group and cgroup) does not hold the run.
                        with trio.move_on_after(1.0, shield=True):
                            await pumped.wait()
                        nursery.cancel_scope.cancel()
            finally:
                r.log.flush()
        return await self._start_and_wait(r, argv, env, cwd, what=what, agent=agent, output=output)

    async def _start_and_wait(self, r: _Runner, argv: list[str], env: dict[str, str], cwd: str, *, what: str,
                              agent: bool, output: int | None) -> int | None:
        iso, kill_rest = self.isolation, None
        try:
            if iso.cgroups is not None:
                kill_rest = partial(iso.cgroups.kill, r.agent_id)
            preexec = iso.preexec(r.agent_id) if iso.enabled else _die_with_parent
            proc = Child(argv, cwd=cwd, env=env, output=output, preexec=preexec, kill_rest=kill_rest)
        except (OSError, ValueError) as exc:
            r.status.detail = f"{what} could not start: {_why_not_started(exc)}"
            await self._end_cgroup(r.agent_id)  # (made for it; the failed child is reaped)
            return None
        except subprocess.SubprocessError:  # (raised in preexec: joining the cgroup, dropping the uid)
            r.status.detail = f"{what} could not start: it could not enter its sandbox"
            log.warning("agent %s: %s", r.agent_id, r.status.detail)
            await self._end_cgroup(r.agent_id)
            return None
        r.process = proc
        with open(self._pidfile(r.agent_id), "w") as f:  # (for reap_orphans)
            f.write(f"{proc.pid}\n")
        if agent:
            r.status.state, r.status.pid = RunState.RUNNING, proc.pid
            r.status.detail = "running"
            log.info("agent %s started as pid %d", r.agent_id, proc.pid)
            self._note(r, f"started as pid {proc.pid}: {' '.join(argv)}")
        try:
            return await proc.wait()
        finally:
            with trio.CancelScope(shield=True):
                if proc.returncode is None:
                    await self._stop_process(r)
                await self._end_cgroup(r.agent_id)

    async def _stop_process(self, r: _Runner) -> None:
        proc = r.process
        if proc is None or proc.returncode is not None:
            return
        _signal_group(proc.pid, signal.SIGTERM)
        with trio.move_on_after(self.grace):
            await proc.wait()
        if proc.returncode is None:
            log.warning("agent %s ignored SIGTERM for %.0f s; killing it", r.agent_id, self.grace)
            # The leader and its group. (Once the leader has exited, reading
            # its returncode killed the rest of the group before reaping it:
            # a group id is never signalled after its leader was reaped,
            # when it may name another session.)
            _signal_group(proc.pid, signal.SIGKILL)
        await proc.wait()
        await self._end_cgroup(r.agent_id)
        r.process = None
        try:
            os.unlink(self._pidfile(r.agent_id))
        except FileNotFoundError:
            pass

    async def _end_cgroup(self, agent_id: str) -> None:
        """Once the run's process was reaped: kill everything left in its
        cgroup (what left the process group: ``setsid``), wait until the
        cgroup is empty and remove it."""
        cgroups = self.isolation.cgroups
        if cgroups is None:
            return
        cgroups.kill(agent_id)
        began = self._clock()
        while cgroups.populated(agent_id) and self._clock() - began < self.grace + 5.0:
            await trio.sleep(0.01)
        if not cgroups.remove(agent_id):
            log.warning("agent %s: its cgroup still holds processes after cgroup.kill", agent_id)

    async def discard_sandbox(self, agent_id: str) -> None:
        """Remove the agent's sandbox (its process stopped), in a worker thread."""
        async with self._sandbox_lock(agent_id):
            await trio.to_thread.run_sync(discard_sandbox, self.state_dir, agent_id)
        self.isolation.forget(agent_id)
