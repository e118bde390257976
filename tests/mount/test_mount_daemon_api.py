"""The daemon's API for the move driver, on a real mount served in this process.

The FUSE loop runs in this test's trio loop, so every file access goes
through a worker thread (a blocking call on our own mount from the loop's
thread would wait for itself).
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import trio

from capsulefs.core.capsule import format as fmt
from capsulefs.core.journal.events import Note
from capsulefs.core.view.nodes import AgentState
from capsulefs.core.view.journal_tail import open_appender
from capsulefs.core.store.host_store import HostStore
from capsulefs.daemon.root import MountConfig, compose
from helpers import HANG, make_agent
from mount_kit import force_unmount, needs_fuse

pytestmark = [pytest.mark.fuse, needs_fuse]


def _errno(fn, *args) -> int:  # type: ignore[no-untyped-def]
    try:
        fn(*args)
    except OSError as exc:
        return exc.errno or 0
    return 0


def _append(path: Path, line: bytes) -> None:
    with open(path, "ab") as f:
        f.write(line)


async def test_freeze_resume_retire_activate(store: HostStore, state_dir: Path, tmp_path: Path) -> None:
    agent = make_agent(store, "alice")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    sent: list[str] = []
    # The journal may run a helper process on its first append (to find
    # libc); a process must not fork while its own threads hold files open
    # on a mount it serves itself. Make that first append before mounting.
    warm = tmp_path / "warm.jsonl"
    warm.write_bytes(b"")
    open_appender(str(warm), machine="WARM", new_id=lambda: "0" * 24, now_ns=lambda: 1,
                  recovery_dir=str(tmp_path / "rec")).append(Note(text="warm"))
    service_ran: list[str] = []

    async def serve_other(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        service_ran.append("started")
        task_status.started()
        try:
            await trio.sleep_forever()
        finally:
            service_ran.append("stopped")

    m = compose(MountConfig(state_dir=str(state_dir), mountpoint=str(mnt), notify=lambda m: bool(sent.append(m)),
                            run_agents=False, services=(serve_other,)))
    daemon, agents = m.daemon, m.agents
    run = trio.to_thread.run_sync
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(daemon.serve)
            assert sent == ["READY=1"]
            assert service_ran == ["started"]
            wm = mnt / "alice" / fmt.WORKING_MEMORY
            journal = mnt / "alice" / fmt.JOURNAL
            line = b'{"kind":"note","text":"x"}\n'

            await agents.freeze(agent.agent_id)
            assert agents.state(agent.agent_id) is AgentState.FROZEN
            assert await run(_errno, wm.write_bytes, b"during move\n") == errno.EROFS
            assert await run(_errno, _append, journal, line) == errno.EROFS
            status = json.loads(await run((mnt / "alice" / ".control" / "status").read_bytes))
            assert status["state"] == "frozen" and status["writable"] is False
            agents.set_move_progress(agent.agent_id, {"phase": "copying", "bytes": 10, "total": 20})
            status = json.loads(await run((mnt / "alice" / ".control" / "status").read_bytes))
            assert status["move"]["phase"] == "copying"

            await agents.resume(agent.agent_id)
            await run(_append, journal, line)
            assert (await run(journal.read_bytes)).count(b"\n") == 1

            await agents.retire(agent.agent_id)
            assert await run(os.listdir, mnt) == []
            assert not await run((mnt / "alice").exists)
            await agents.activate(agent.agent_id)
            assert await run(os.listdir, mnt) == ["alice"]
            daemon.stop()
        assert sent[-1] == "STOPPING=1"
        assert service_ran == ["started", "stopped"]
        assert not os.path.ismount(mnt)
    finally:
        force_unmount(mnt)


async def test_a_signal_while_mounting_stops_the_daemon_once_it_can(store: HostStore, state_dir: Path,
                                                                     tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM arriving while the kernel mount is being made (before the
    signal watcher runs) is not lost, and does not kill the daemon midway:
    once the watcher runs it stops the agents, then unmounts, as for a
    signal at any later time."""
    import signal

    import pyfuse3

    from capsulefs.daemon import daemon as daemon_mod

    make_agent(store, "alice")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    init = pyfuse3.init

    def init_then_signal(*args: object) -> None:
        init(*args)
        os.kill(os.getpid(), signal.SIGTERM)  # delivered now, before serve starts its watcher

    monkeypatch.setattr(daemon_mod.pyfuse3, "init", init_then_signal)
    stopped: list[str] = []

    class Listener:
        async def on_shutdown(self) -> None:
            stopped.append("agents stopped")
            # the mount still serves while the agents stop (asked from a worker thread: see above)
            assert await trio.to_thread.run_sync(os.listdir, mnt) == ["alice"]

    daemon = compose(MountConfig(state_dir=str(state_dir), mountpoint=str(mnt), notify=lambda m: True,
                                 run_agents=False, stopping=(Listener(),))).daemon
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with trio.fail_after(HANG):
            async with trio.open_nursery() as nursery:
                await nursery.start(daemon.serve)
        assert stopped == ["agents stopped"]
        assert not os.path.ismount(mnt)
        assert signal.getsignal(signal.SIGTERM) == previous  # serve gave the handler back
    finally:
        force_unmount(mnt)
