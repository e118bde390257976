"""Why an agent does not answer: one record of its last failure, for its status.

Rules:
  * A failure says what failed, when, when it is tried again, and, where
    one command fixes it, that command (``fix``); ``log`` is the command
    that shows the agent's log. ``.control/status`` shows it as
    ``run.last_error``; ``capsulefs status`` lists it for every agent.
  * Two sources, one record: the daemon's (the agent could not start, a
    setup step failed, the process exited non-zero: then with the last
    lines of its log) and the agent's own. A running agent reports a failed
    step in ``$CAPSULE_STATUS`` (in its HOME), a JSON object:
    ``{"problem": text, "at": unix seconds, "retry_at": unix seconds,
    "fix": text}``, only ``problem`` required, removed (or ``problem``
    empty) once a step succeeds. Any agent program may write it; the
    reference agent does (capsulefs/agents/reference/loop.py).
  * That file is the agent's, so it is read as hostile: not followed if a
    link, only a regular file of the agent's own uid, 4 KiB at most; texts
    are kept as one line of printable characters (500 at most), times
    only if they are finite numbers.
"""

from __future__ import annotations

import math
import os
import stat
import time
from dataclasses import dataclass, field
from typing import Any

from capsulefs.core.capsule import format as fmt
from capsulefs.core.errors import CapsuleError

#: The agent's report file, in its HOME; ``$CAPSULE_STATUS`` names it.
AGENT_STATUS = "agent-status.json"
AGENT_STATUS_MAX = 4096
TEXT_MAX = 500


def one_line(text: str, limit: int = TEXT_MAX) -> str:
    return " ".join("".join(c if c.isprintable() else " " for c in text).split())[:limit]


def iso(t: float | None) -> str | None:
    if t is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


@dataclass(frozen=True)
class Failure:
    what: str
    at: float  # unix time
    retry_at: float | None = None  # None: not by itself (it waits for a change)
    fix: str | None = None
    output: tuple[str, ...] = field(default=())  # the last lines of its log (a crash)
    by: str = "daemon"  # or "agent": who reported it

    def as_json(self, agent_id: str) -> dict[str, Any]:
        return {
            "what": self.what, "at": iso(self.at), "next_retry": iso(self.retry_at), "fix": self.fix,
            "by": self.by, "output": list(self.output), "log": f"capsulefs logs {agent_id}",
        }


def _time(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value) if 0 <= value < 1e11 else None


def read_agent_report(path: str, owner: int) -> Failure | None:
    """The failure an agent reported in its status file (see the rules), or
    None: none reported, or not a file to trust."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != owner or st.st_size > AGENT_STATUS_MAX:
            return None
        data = os.read(fd, AGENT_STATUS_MAX + 1)
    finally:
        os.close(fd)
    try:
        doc = fmt.load_json(data, AGENT_STATUS)
    except CapsuleError:
        return None
    if not isinstance(doc, dict):
        return None
    problem = doc.get("problem")
    if not isinstance(problem, str) or not problem.strip():
        return None
    fix = doc.get("fix")
    at = _time(doc.get("at"))
    return Failure(what=one_line(problem), at=at if at is not None else st.st_mtime, retry_at=_time(doc.get("retry_at")),
                   fix=one_line(fix) if isinstance(fix, str) and fix.strip() else None, by="agent")


def fix_for(exc: BaseException, agent_id: str) -> str | None:
    """The one command that fixes why an agent could not start, if there is one."""
    from capsulefs.agents.grants import UngrantedSecret
    from capsulefs.agents.keychain import MissingSecret

    if isinstance(exc, MissingSecret):
        return f"capsulefs secret set {exc.names[0]}"  # (the value on stdin)
    if isinstance(exc, UngrantedSecret):
        return f"capsulefs secret grant {agent_id} {' '.join(exc.names)}"
    return None
