"""Fuzz targets: what an agent process hands the daemon (hostile bytes).

  * agent_report: its ``$CAPSULE_STATUS`` file. Whatever it holds, reading
    it gives None or a failure whose texts are one printable line of at
    most 500 characters and whose times are finite; it never raises.
  * agent_log: its stdout and stderr. Whatever bytes, in whatever pieces,
    the log holds only whole lines of text (no control characters but
    tabs), each at most a cut line's length, and never more than its cap.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from capsulefs.agents.agent_log import LINE_MAX, AgentLog, log_files
from capsulefs.agents.reports import TEXT_MAX, read_agent_report

from . import Target


def _report_seeds() -> list[bytes]:
    return [json.dumps(d).encode() for d in (
        {"problem": "no model chosen", "at": 1.8e9, "retry_at": 1.8e9 + 4, "fix": "echo a:b > /m/x/.control/model"},
        {"problem": "x\n\x1b[2Jy", "at": "soon", "retry_at": 1e300, "fix": 3},
        {"problem": ""}, [], {"problem": None}, {"problem": "p", "at": True, "retry_at": -1},
    )] + [b'{"problem": "a", "at": NaN}', b"\xff\xfe", b"{" * 100]


def _report(data: bytes, tmp: Path) -> None:
    path = tmp / "agent-status.json"
    path.write_bytes(data)
    failure = read_agent_report(str(path), os.getuid())
    if failure is None:
        return
    for text in (failure.what, failure.fix or ""):
        assert len(text) <= TEXT_MAX and text.isprintable(), text
    assert failure.what
    for t in (failure.at, failure.retry_at):
        assert t is None or math.isfinite(t)
    json.dumps(failure.as_json("a" * 32))


def _log_seeds() -> list[bytes]:
    return [b"hello\nworld\n", b"\x1b[31mred\x1b[0m\r\n\x00\x07", b"x" * 10000 + b"\n", "\u009b\u202e".encode()]


def _log(data: bytes, tmp: Path) -> None:
    agent = "f" * 32
    log = AgentLog(str(tmp), agent, max_bytes=2048)
    step = 1 + (data[0] % 97 if data else 0)
    for i in range(0, len(data), step):
        log.feed(data[i:i + step])
    log.flush()
    for path in log_files(str(tmp), agent):
        body = Path(path).read_bytes()
        assert len(body) <= 2048
        text = body.decode()  # (valid UTF-8: what was not is replaced)
        assert text.endswith("\n") or not text
        for line in text.split("\n")[:-1]:
            assert not any(ord(c) < 0x20 and c != "\t" or 0x7f <= ord(c) <= 0x9f for c in line), repr(line)
            assert len(line) <= 4 * LINE_MAX + 64

TARGETS = [
    Target("agent_report", _report_seeds, _report),
    Target("agent_log", _log_seeds, _log),
]
