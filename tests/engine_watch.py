"""The watcher of one engine a test fixture started (tests/fleet_kit.py: etcd, weed).

Usage (by fleet_kit only): ``python -I engine_watch.py PIPE_FD PIDFD [PATH...]``,
in a session of its own (a Ctrl-C or a signal to the test's process group
does not reach it), with two descriptors inherited: the read end of a pipe
whose write end only the test process holds, and a pidfd of the engine.

  * The fixture, done with the engine (stopped and cleaned by itself), writes
    one byte and closes the pipe: the watcher exits and touches nothing.
  * The pipe closes without that byte: the test process is gone (SIGKILL,
    SIGTERM, a crash). The watcher kills the engine through its pidfd (never
    a pid the system may have given to another process since), waits for it
    to end, removes each PATH (the engine's data directory, sockets it leaves
    in /tmp) and exits.

A pipe and not PR_SET_PDEATHSIG: that signal follows the parent *thread*,
so an engine started from a worker thread would die with the thread.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import sys

RELEASED = b"d"
ENGINE_EXIT_WAIT = 30.0  # seconds a SIGKILLed engine may take to be gone


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def main(argv: list[str]) -> int:
    pipe_fd, pid_fd, paths = int(argv[1]), int(argv[2]), argv[3:]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (the fixture or the pipe decides, not a stray Ctrl-C)
    data = os.read(pipe_fd, 1)  # until the fixture releases us or the test process is gone (b"": EOF)
    if data == RELEASED:
        return 0
    try:
        signal.pidfd_send_signal(pid_fd, signal.SIGKILL)
    except ProcessLookupError:
        pass  # (it ended already)
    poller = select.poll()
    poller.register(pid_fd, select.POLLIN)
    poller.poll(ENGINE_EXIT_WAIT * 1000)
    for path in paths:
        _remove(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
