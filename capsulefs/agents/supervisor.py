"""Supervision of agent processes: build the sandbox, run, restart, freeze.

Rules:
  * An agent runs only while this host holds it actively and its spec has an
    entrypoint. The daemon says which agents that is (:meth:`Supervisor.want`
    / :meth:`Supervisor.unwant`); the supervisor never decides it.
  * The sandbox (capsulefs/agents/sandbox_dir.py) is materialised from the
    snapshot; the spec's setup steps run there, in order, before the
    entrypoint, each in its own process group, stopped and reaped as the
    agent's process is (capsulefs/agents/process.py).
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

import logging
import os
import shutil
import signal
import time
from collections.abc import Callable, Mapping
from functools import partial

import trio

from capsulefs.agents import grants, keychain
from capsulefs.agents.agent_log import AgentLog, last_lines
from capsulefs.agents.isolation import Isolation
from capsulefs.agents.runs import Processes
from capsulefs.agents.run_state import Hooks, RunState, RunStatus, Runner
from capsulefs.agents.process import ours_isolated, pidfile, reap_orphans, signal_group
from capsulefs.agents.sandbox_dir import SETUP_LOG, SandboxBuildError, build_sandbox, discard_sandbox, last_line, \
    remove_quietly, sandbox_root, workspace_dir
from capsulefs.agents.reports import AGENT_STATUS, Failure, fix_for, read_agent_report
from capsulefs.agents.steering import spec_digest
from capsulefs.core import metrics
from capsulefs.core.capsule import workspace
from capsulefs.core.errors import CapsuleError
from capsulefs.core.capsule.spec import SECRETS_ENV, STATUS_ENV, redact_secrets, secrets_in, validate_spec

log = logging.getLogger(__name__)

GRACE_SECONDS = 5.0
BACKOFF_FIRST = 1.0
BACKOFF_MAX = 60.0
BLOCKED_RETRY = 2.0  # how often an agent that cannot start (a missing secret) is tried again
BASE_ENV_KEYS = ("PATH", "LANG", "LC_ALL", "TZ")
CRASH_LINES = 5  # lines of its log a crash's last_error shows


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
        self._runners: dict[str, Runner] = {}
        #: Per agent: held while a worker thread builds, syncs or discards its
        #: sandbox (see the module's rules), never across a checkpoint elsewhere.
        self._sandbox_locks: dict[str, trio.Lock] = {}
        self._nursery: trio.Nursery | None = None
        self._stopping = False  # stop_all began: no agent starts again
        self.processes = Processes(self.isolation, self.sandbox_root, grace=grace, clock=clock)

    # -- lifecycle -----------------------------------------------------------
    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
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
                        await self.processes.stop_process(runner)
                    if self.isolation.cgroups is not None:
                        self.isolation.cgroups.close()

    def status(self, agent_id: str) -> RunStatus:
        r = self._runners.get(agent_id)
        return r.status if r else RunStatus()

    def sandbox(self, agent_id: str) -> str:
        return workspace_dir(self.sandbox_root, agent_id)

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

    def _failed(self, r: Runner, what: str, *, retry_in: float | None, fix: str | None = None,
                output: tuple[str, ...] = ()) -> None:
        now = time.time()
        r.status.failure = Failure(what=what, at=now, retry_at=None if retry_in is None else now + retry_in,
                                   fix=fix, output=output)

    def _pidfile(self, agent_id: str) -> str:
        return pidfile(self.sandbox_root, agent_id)

    def reap_orphans(self) -> list[int]:
        """Kill agent processes a previous daemon of this state dir left running (process.reap_orphans)."""
        return reap_orphans(self.sandbox_root, self.isolation.cgroups)

    def want(self, agent_id: str) -> None:
        """Run this agent (no-op if it already runs)."""
        if self._stopping:
            return  # the daemon is shutting down
        if self._nursery is None:
            raise RuntimeError("supervisor is not serving")
        r = self._runners.get(agent_id)
        if r is not None and not r.done.is_set():
            return
        r = Runner(agent_id, log=AgentLog(self.state_dir, agent_id))
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
            self.processes.note(r, r.status.detail)
            self._nursery.start_soon(self.processes.terminate, r, r.process)
        return True

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
                signal_group(r.process.pid, signal.SIGKILL)
                if self.isolation.cgroups is not None:
                    self.isolation.cgroups.kill(r.agent_id)

    def kill(self, agent_id: str) -> None:
        """SIGKILL one agent's process group now (a stop that cannot wait for its grace period)."""
        r = self._runners.get(agent_id)
        if r is not None and r.process is not None and r.process.returncode is None:
            signal_group(r.process.pid, signal.SIGKILL)
            if self.isolation.cgroups is not None:
                self.isolation.cgroups.kill(agent_id)

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
    async def _run(self, r: Runner) -> None:
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
                            self.processes.note(r, f"not started: {exc}")
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
                        self.processes.note(r, f"{r.status.detail}; restarting in {backoff:.0f} s")
                    else:
                        began = self._clock()
                        code = await self._run_process(r, argv, env, cwd)
                        if self._clock() - began >= self.healthy:
                            backoff = BACKOFF_FIRST
                        r.status.pid = None  # (gone: its pid may be another process's soon)
                        if r.restart_why is not None and code is not None:  # asked: not a crash, no backoff
                            r.status.last_exit = code
                            self.processes.note(r, f"exited with status {code}; starting again: {r.restart_why}")
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
                            self.processes.note(r, f"exited with status {code}")
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
                        self.processes.note(r, f"restarting in {backoff:.0f} s")
                        log.warning("agent %s: %s", r.agent_id, r.status.detail)
                    r.status.restarts += 1
                    metrics.AGENT_RESTARTS.inc()
                    r.status.next_start_in = backoff
                    await trio.sleep(backoff)
                    backoff = min(backoff * 2, BACKOFF_MAX)
        finally:
            with trio.CancelScope(shield=True):
                await self.processes.stop_process(r)
            if r.status.state in (RunState.RUNNING, RunState.BUILDING, RunState.BACKOFF, RunState.BLOCKED):
                r.status.state, r.status.detail = RunState.STOPPED, "stopped"
            r.status.pid = None
            r.done.set()

    async def _prepare(self, r: Runner) -> tuple[list[str] | None, dict[str, str], str, list[list[str]]]:
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
            snapshot = self.hooks.snapshot(r.agent_id)
            async with self.hooks.blobs_for_build(r.agent_id, snapshot):
                await trio.to_thread.run_sync(build_sandbox, snapshot, self.hooks.read_blob, cwd)
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
        remove_quietly(env[STATUS_ENV])  # (an earlier run's problem is not this one's)
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

    async def _setup(self, r: Runner, setup: list[list[str]], env: dict[str, str], cwd: str) -> bool:
        """Run the spec's setup steps in order, each supervised as the agent
        is (its own process group, stopped and reaped with what it started),
        their output in ``sandboxes/<agent_id>/setup.log``."""
        with open(os.path.join(self.sandbox_root, r.agent_id, SETUP_LOG), "wb") as out:
            for i, step in enumerate(setup):
                what = f"setup step {i + 1} ({step[0]})"
                start = out.tell()
                code = await self.processes.run_child(r, list(step), env, cwd, what=what, output=out.fileno())
                if code is None:
                    return False
                if code != 0:
                    last = redact_secrets(last_line(out.name, start), secrets_in(env))
                    r.status.detail = f"{what} failed with status {code}: {last}"
                    log.warning("agent %s: %s", r.agent_id, r.status.detail)
                    return False
        return True

    async def _run_process(self, r: Runner, argv: list[str], env: dict[str, str], cwd: str) -> int | None:
        """Run the agent's process; its exit status, or None (the reason in
        the status' detail) if it could not start."""
        return await self.processes.run_child(r, argv, env, cwd, what=f"the entrypoint {argv[0]}", agent=True)

    def _last_output(self, r: Runner, secrets: Mapping[str, str]) -> tuple[str, ...]:
        """The last lines the process wrote (its log's, not the daemon's
        own), without the run's secret values, as a setup step's output."""
        if r.log is None:
            return ()
        texts = [line.partition(" ")[2] for line in last_lines(r.log.path, 4 * CRASH_LINES)]
        mine = [redact_secrets(t, secrets) for t in texts if not t.startswith("capsulefs: ")]
        return tuple(mine[-CRASH_LINES:])

    async def discard_sandbox(self, agent_id: str) -> None:
        """Remove the agent's sandbox (its process stopped), in a worker thread."""
        async with self._sandbox_lock(agent_id):
            await trio.to_thread.run_sync(discard_sandbox, self.state_dir, agent_id)
        self.isolation.forget(agent_id)
