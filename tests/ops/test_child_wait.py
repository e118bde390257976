"""Waiting on an agent's process (capsulefs/agents/process.py ``Child``) from several tasks at once."""

from __future__ import annotations

import os
import sys

import trio

from capsulefs.agents.process import Child

from helpers import HANG


async def test_a_second_waiter_that_sees_the_exit_first_never_strands_the_one_watching_the_pidfd(tmp_path) -> None:
    """The run's task watches the pidfd while a stop (SIGTERM, then wait)
    waits beside it. On a busy machine the second one can see the exit
    before the event loop reports the pidfd readable; it must not close
    the pidfd under the watcher (the kernel then drops it from epoll and
    the watcher never wakes: the agent was never started again)."""
    child = Child([sys.executable, "-c", "import sys; sys.stdin.read()"], cwd=str(tmp_path), env=dict(os.environ))
    watcher_done = trio.Event()
    codes: list[int] = []

    async def watch() -> None:
        codes.append(await child.wait())
        watcher_done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        await trio.testing.wait_all_tasks_blocked()  # (the watcher is parked on the pidfd)
        os.kill(child.pid, 9)
        # The exit, seen without letting the event loop poll (as a busy loop would):
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
        codes.append(await child.wait())  # (the second waiter, finding it exited at once)
        with trio.fail_after(HANG):  # (bounds a hang: the watcher wakes as soon as the loop polls)
            await watcher_done.wait()
    assert codes == [-9, -9]
