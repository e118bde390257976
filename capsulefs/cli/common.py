"""Helpers shared by the CLI command modules."""

from __future__ import annotations

import argparse
import os
import re
import stat
import time

from capsulefs.cli import UsageError
from capsulefs.core.store.agent import AgentHandle
from capsulefs.core.store.host_store import HostStore, default_state_dir


def state_dir(args: argparse.Namespace) -> str:
    return getattr(args, "state", None) or os.environ.get("CAPSULEFS_STATE") or default_state_dir()


def open_store(args: argparse.Namespace) -> HostStore:
    from capsulefs.agents import grants

    store = HostStore.open(state_dir(args))
    grants.ensure(state_dir(args), store)  # (before this command adds an agent: see grants)
    return store


def host_id(args: argparse.Namespace) -> str:
    from capsulefs.peer.identity import load_or_create_identity

    return load_or_create_identity(state_dir(args)).host_id


def find_agent(args: argparse.Namespace, name_or_id: str) -> AgentHandle:
    return open_store(args).find(name_or_id)


def new_agent_id() -> str:
    return os.urandom(16).hex()


def now_seconds() -> int:
    return int(time.time())


def read_input_file(path: str, what: str, limit: int) -> bytes:
    """The bytes of a file named on the command line: a regular file, or a
    pipe (``/dev/stdin``, ``<(...)``) read to its end, at most ``limit``
    bytes. A device (``/dev/zero``), a larger file, or a FIFO nobody writes
    to is a UsageError naming it; nothing here waits for a writer that may
    never come."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO without a writer opens at once
    try:
        st = os.fstat(fd)
        fifo = stat.S_ISFIFO(st.st_mode)
        if stat.S_ISDIR(st.st_mode):
            raise UsageError(f"{what} {path}: is a directory")
        if not fifo and not stat.S_ISREG(st.st_mode):
            raise UsageError(f"{what} {path}: not a regular file")
        if st.st_size > limit:
            raise UsageError(f"{what} {path}: larger than {limit} bytes")
        os.set_blocking(fd, True)  # a pipe with a writer: wait for its bytes; without one: EOF at once
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read(limit + 1)
        except OSError as exc:  # (EIO...) named by the file, not the descriptor
            raise OSError(exc.errno, exc.strerror, path) from None
    if len(data) > limit:
        raise UsageError(f"{what} {path}: larger than {limit} bytes")
    if not data:
        raise UsageError(f"{what} {path}: empty" + (" (a FIFO nobody writes to?)" if fifo else ""))
    return data


#: What a terminal acts on rather than shows: C0 controls (ESC, CR, BS,
#: newline...), DEL, the C1 controls (CSI U+009B...), and the line separators
#: and bidirectional overrides that move text around on screen.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def shown(line: str) -> str:
    """``line`` for a terminal: each control character written as an escape
    (``\\x1b``, ``\\u009b``), so text from a journal stays on its one line
    and drives nothing in the terminal it is printed to."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m[0]):02x}" if m[0] < "\x80" else f"\\u{ord(m[0]):04x}", line)
