"""Running one agent's process for the supervisor: start it (as its own uid
and in its cgroup when isolated), pipe its output to its log, wait for it,
and stop it at a step boundary (SIGTERM, the grace period, SIGKILL), ending
its cgroup with it.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from collections.abc import Callable
from functools import partial

import trio

from capsulefs.agents.agent_log import pump_output
from capsulefs.agents.isolation import Isolation
from capsulefs.agents.process import Child, die_with_parent, pidfile, signal_group, why_not_started
from capsulefs.agents.run_state import RunState, Runner

log = logging.getLogger(__name__)


class Processes:
    """Starts, waits for and stops agents' processes (see the module's doc)."""

    def __init__(self, isolation: Isolation, sandbox_root: str, *, grace: float, clock: Callable[[], float]) -> None:
        self.isolation = isolation
        self.sandbox_root = sandbox_root
        self.grace = grace
        self._clock = clock

    async def terminate(self, r: Runner, proc: Child) -> None:
        """SIGTERM, the grace period, SIGKILL; the run's task reaps it and
        cleans up after it (as for a crash)."""
        if proc.returncode is not None:
            return
        signal_group(proc.pid, signal.SIGTERM)
        with trio.move_on_after(self.grace):
            await proc.wait()
        if proc.returncode is None:
            log.warning("agent %s ignored SIGTERM for %.0f s; killing it", r.agent_id, self.grace)
            # The leader and its group. (Once the leader has exited, reading
            # its returncode killed the rest of the group before reaping it:
            # a group id is never signalled after its leader was reaped,
            # when it may name another session.)
            signal_group(proc.pid, signal.SIGKILL)

    def note(self, r: Runner, text: str) -> None:
        """A line of the daemon's in the agent's log (never failing a run)."""
        if r.log is not None:
            try:
                r.log.note(text)
            except OSError as exc:
                log.warning("agent %s: cannot write its log %s: %s", r.agent_id, r.log.path, exc)

    async def run_child(self, r: Runner, argv: list[str], env: dict[str, str], cwd: str, *, what: str,
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

    async def _start_and_wait(self, r: Runner, argv: list[str], env: dict[str, str], cwd: str, *, what: str,
                              agent: bool, output: int | None) -> int | None:
        iso, kill_rest = self.isolation, None
        try:
            if iso.cgroups is not None:
                kill_rest = partial(iso.cgroups.kill, r.agent_id)
            preexec = iso.preexec(r.agent_id) if iso.enabled else die_with_parent
            proc = Child(argv, cwd=cwd, env=env, output=output, preexec=preexec, kill_rest=kill_rest)
        except (OSError, ValueError) as exc:
            r.status.detail = f"{what} could not start: {why_not_started(exc)}"
            await self.end_cgroup(r.agent_id)  # (made for it; the failed child is reaped)
            return None
        except subprocess.SubprocessError:  # (raised in preexec: joining the cgroup, dropping the uid)
            r.status.detail = f"{what} could not start: it could not enter its sandbox"
            log.warning("agent %s: %s", r.agent_id, r.status.detail)
            await self.end_cgroup(r.agent_id)
            return None
        r.process = proc
        with open(pidfile(self.sandbox_root, r.agent_id), "w") as f:  # (for reap_orphans)
            f.write(f"{proc.pid}\n")
        if agent:
            r.status.state, r.status.pid = RunState.RUNNING, proc.pid
            r.status.detail = "running"
            log.info("agent %s started as pid %d", r.agent_id, proc.pid)
            self.note(r, f"started as pid {proc.pid}: {' '.join(argv)}")
        try:
            return await proc.wait()
        finally:
            with trio.CancelScope(shield=True):
                if proc.returncode is None:
                    await self.stop_process(r)
                await self.end_cgroup(r.agent_id)

    async def stop_process(self, r: Runner) -> None:
        proc = r.process
        if proc is None or proc.returncode is not None:
            return
        await self.terminate(r, proc)
        await proc.wait()
        await self.end_cgroup(r.agent_id)
        r.process = None
        try:
            os.unlink(pidfile(self.sandbox_root, r.agent_id))
        except FileNotFoundError:
            pass

    async def end_cgroup(self, agent_id: str) -> None:
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
