"""Agent processes: forking one that dies with the daemon, waiting on it by
pidfd, signalling its process group, and reaping what an earlier daemon left.

Rules:
  * A run ends with its process: once it exits, what is left of its process
    group (tools it started) is killed before it is reaped (:class:`Child`).
  * ``capsulefs ...`` (the reference agent) runs isolated, ``python -I -m
    capsulefs``: nothing its tools write into the workspace is imported by it
    (:func:`ours_isolated`).
  * A process group is killed as an earlier daemon's leftover only if one of
    its processes still carries that agent's ``CAPSULE_AGENT_ID``
    (:func:`reap_orphans`): a reused pid is never hit.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
import logging

import trio

from capsulefs.agents.isolation import Cgroups

log = logging.getLogger(__name__)

PID_FILE = "pid"  # under sandboxes/<agent_id>/: the running process's group id (for reap_orphans)


def pidfile(sandbox_root: str, agent_id: str) -> str:
    return os.path.join(sandbox_root, agent_id, PID_FILE)


def signal_group(pgid: int, sig: int) -> bool:
    """Signal a process group; False if it is already gone."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True


def group_members(pgid: int) -> list[int]:
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


def environ_has(pid: int, entry: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return entry in f.read().split(b"\0")
    except OSError:
        return False


def why_not_started(exc: OSError | ValueError) -> str:
    """Why exec refused a process, without the values it was given (secrets)."""
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    return "an argument or environment value holds a NUL byte"  # (what else subprocess raises ValueError for here)


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


def die_with_parent() -> None:
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
    the process exits). Many tasks may wait; one of them watches the pidfd,
    and only it closes the pidfd once it is watched."""

    def __init__(self, argv: list[str], *, cwd: str, env: dict[str, str], output: int | None = None,
                 preexec: Callable[[], None] = die_with_parent, kill_rest: Callable[[], None] | None = None) -> None:
        """``preexec`` runs in the child before exec (it must set PDEATHSIG,
        as :func:`die_with_parent` does); ``kill_rest`` kills what is left of
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
            signal_group(self.pid, signal.SIGKILL)
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
        # Closed only with nobody watching it: a waiter that sees the exit
        # before the event loop has reported the pidfd readable (a busy
        # machine) would otherwise close it under the watcher, which the
        # kernel then drops from epoll: the watcher, the run's own task,
        # would never wake. It wakes (the pidfd stays readable) and closes it.
        if self._pidfd >= 0 and not self._waiting:
            os.close(self._pidfd)
            self._pidfd = -1
        return self._popen.returncode


def reap_orphans(sandbox_root: str, cgroups: Cgroups | None) -> list[int]:
    """Kill agent processes a previous daemon of this state dir left running.

    A daemon killed outright cannot stop its agents (they also die with
    it through PDEATHSIG, but their own children may not). Each run's
    process group id is kept in a pid file; a group is killed only if
    one of its processes (the leader, or once PDEATHSIG took it, a tool
    it started) still carries that agent's CAPSULE_AGENT_ID, so a reused
    pid is never hit (the kernel reuses no pid while a group bears it)."""
    killed: list[int] = []
    if not os.path.isdir(sandbox_root):
        return killed
    for agent_id in os.listdir(sandbox_root):
        path = pidfile(sandbox_root, agent_id)
        try:
            with open(path) as f:
                pgid = int(f.read().strip())
        except (OSError, ValueError):
            continue
        mark = f"CAPSULE_AGENT_ID={agent_id}".encode()
        mine = any(environ_has(pid, mark) for pid in group_members(pgid))
        if mine and signal_group(pgid, signal.SIGKILL):
            killed.append(pgid)
            log.warning("killed agent %s's process group %d, left by an earlier daemon", agent_id, pgid)
        os.unlink(path)
    if cgroups is None:
        return killed
    for agent_id in cgroups.leftovers():
        if cgroups.populated(agent_id):
            log.warning("killing what is left in agent %s's cgroup, left by an earlier daemon", agent_id)
            cgroups.kill(agent_id)
        cgroups.remove(agent_id)  # (still dying: removed after its next run)
    cgroups.close()  # (made again by the next run)
    return killed
