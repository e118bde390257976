"""Each agent process's output, in a size-capped, rotated log of the host.

Rules:
  * The log is host-local, never part of a capsule:
    ``STATE/logs/<agent_id>/agent.log``, rotated to ``agent.log.1`` and
    ``agent.log.2`` once it reaches :data:`LOG_MAX` bytes, so an agent's
    logs never take more than :data:`LOG_FILES` x :data:`LOG_MAX` bytes.
  * The daemon writes it, from the process's stdout and stderr pipes: the
    agent is untrusted (as root it runs as a uid of its own) and can neither
    write it nor grow it past the cap. Its bytes are hostile: every line is
    cut at :data:`LINE_MAX` bytes, decoded as UTF-8 (errors replaced), and
    control characters (terminal escapes) are written as ``\\xNN``, so that
    ``capsulefs logs`` on a terminal shows text only.
  * Each line starts with the UTC time the daemon read it; the daemon's own
    lines about the run (started, exited, restarting) say ``capsulefs:``.
  * Reading it (``capsulefs logs``) needs no daemon: it is plain files.

Theory of operation: the supervisor gives each agent process one pipe for
stdout and stderr and runs :func:`pump_output` on its read end in the
agent's task; :meth:`AgentLog.note` adds the daemon's lines. Writes are
appends of whole lines (no fsync: a log, not state), rotation renames.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections import deque
from collections.abc import Iterator

import trio

from capsulefs.core.capsule import format as fmt
from capsulefs.core.store.layout import LOGS_DIR

LOG_NAME = "agent.log"
LOG_MAX = 1 << 20  # bytes per file
LOG_FILES = 3  # agent.log, agent.log.1, agent.log.2
LINE_MAX = 4096  # bytes of one line kept; the rest of it is dropped, marked
log = logging.getLogger(__name__)
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def log_dir(state_dir: str, agent_id: str) -> str:
    fmt.check_agent_id(agent_id)
    return os.path.join(state_dir, LOGS_DIR, agent_id)


def log_files(state_dir: str, agent_id: str) -> list[str]:
    """The agent's log files, oldest first (only those that exist)."""
    base = os.path.join(log_dir(state_dir, agent_id), LOG_NAME)
    names = [f"{base}.{i}" for i in range(LOG_FILES - 1, 0, -1)] + [base]
    return [p for p in names if os.path.isfile(p)]


def clean_line(raw: bytes) -> str:
    """One line of an agent's output as the log keeps it: at most
    :data:`LINE_MAX` bytes, UTF-8, no control characters but tabs."""
    cut = len(raw) > LINE_MAX
    text = raw[:LINE_MAX].decode(errors="replace")
    text = _CONTROL.sub(lambda m: f"\\x{ord(m[0]):02x}", text)
    return text + (" [line cut]" if cut else "")


def stamp(now: float | None = None) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() if now is None else now))


class AgentLog:
    """The log of one agent (opened per write: a removed directory is made again)."""

    def __init__(self, state_dir: str, agent_id: str, *, max_bytes: int = LOG_MAX) -> None:
        self.dir = log_dir(state_dir, agent_id)
        self.path = os.path.join(self.dir, LOG_NAME)
        self.max_bytes = max_bytes
        self._partial = b""  # a line not ended yet

    def _write(self, lines: list[str]) -> None:
        if not lines:
            return
        data = "".join(f"{stamp()} {line}\n" for line in lines).encode()
        if len(data) > self.max_bytes:  # (more than a whole file at once: its last whole lines)
            data = data[-self.max_bytes:]
            data = data[data.find(b"\n") + 1:] if b"\n" in data[:-1] else data.decode(errors="ignore").encode()
        os.makedirs(os.path.dirname(self.dir), mode=0o700, exist_ok=True)  # (logs/: the daemon's alone)
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        try:
            size = os.path.getsize(self.path)
        except FileNotFoundError:
            size = 0
        if size and size + len(data) > self.max_bytes:
            self._rotate()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)

    def _rotate(self) -> None:
        for i in range(LOG_FILES - 1, 0, -1):
            older = f"{self.path}.{i - 1}" if i > 1 else self.path
            try:
                os.replace(older, f"{self.path}.{i}")
            except FileNotFoundError:
                pass

    def note(self, text: str) -> None:
        """A line of the daemon's own about this agent's run."""
        self._write([f"capsulefs: {clean_line(text.encode())}"])

    def feed(self, data: bytes) -> None:
        """Bytes the agent wrote: whole lines are logged, the rest kept for
        the next feed (at most :data:`LINE_MAX` of it; a longer line is cut)."""
        buf = self._partial + data
        *lines, rest = buf.split(b"\n")
        if len(rest) > LINE_MAX:
            lines.append(rest)
            rest = b""
        self._partial = rest
        self._write([clean_line(line.rstrip(b"\r")) for line in lines])

    def flush(self) -> None:
        """The process's output ended: log what is left of its last line."""
        if self._partial:
            rest, self._partial = self._partial, b""
            self._write([clean_line(rest)])


async def pump_output(stream: trio.lowlevel.FdStream, agent_log: AgentLog, done: trio.Event) -> None:
    """Copy a process's output (the read end of its pipe) into its log until
    the pipe ends; ``done`` is set then. A log that cannot be written (a full
    disk) drops the output, never blocks the process on a full pipe."""
    try:
        async with stream:
            while chunk := await stream.receive_some(65536):
                try:
                    agent_log.feed(chunk)
                except OSError as exc:
                    log.warning("cannot write %s: %s", agent_log.path, exc)
    finally:
        done.set()


def tail(state_dir: str, agent_id: str, n: int) -> tuple[list[str], tuple[int, int] | None]:
    """The last ``n`` lines of the agent's log (across its rotated files),
    and where the reading ended: (inode, offset) of ``agent.log``, or None
    if there is none (for :func:`follow`)."""
    last: deque[str] = deque(maxlen=max(n, 0))
    end = None
    for path in log_files(state_dir, agent_id):
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            continue  # (rotated away meanwhile)
        with f:
            data = f.read()
            if path.endswith(LOG_NAME):
                data = data[: data.rfind(b"\n") + 1]  # (a line still being written: follow prints it)
                end = (os.fstat(f.fileno()).st_ino, len(data))
        for line in data.splitlines():
            last.append(line.decode(errors="replace"))
    return list(last), end


def last_lines(path: str, n: int, *, limit: int = 64 * 1024) -> list[str]:
    """The last ``n`` non-blank lines of ``path``, reading at most its last ``limit`` bytes."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - limit))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return []
    return [line for line in lines if line.strip()][-n:] if n > 0 else []


def follow(path: str, start: tuple[int, int] | None = None, *, poll: float = 0.2) -> Iterator[str]:
    """Lines written to ``path`` after ``start`` ((inode, offset), as
    :func:`tail` gives it; None: from its end now), across rotations: a new
    file at the path is read from its start. Never ends."""
    f = None
    ino = None
    pending = b""
    try:
        while True:
            if f is None:
                try:
                    f = open(path, "rb")
                except FileNotFoundError:
                    start = (-1, 0)  # (the file that comes is all new)
                    time.sleep(poll)
                    continue
                ino = os.fstat(f.fileno()).st_ino
                if start is None:
                    f.seek(0, os.SEEK_END)
                elif start[0] == ino:
                    f.seek(start[1])
            chunk = f.read()
            if chunk:
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    yield line.decode(errors="replace")
                continue
            try:
                moved = os.stat(path).st_ino != ino
            except FileNotFoundError:
                moved = False
            if moved:  # rotated: what was left in the old file was read above; the new one from its start
                f.close()
                f, start, pending = None, (-1, 0), b""
                continue
            time.sleep(poll)
    finally:
        if f is not None:
            f.close()
