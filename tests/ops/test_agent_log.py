"""An agent's log: capped and rotated, its hostile bytes kept as text."""

from __future__ import annotations

import os
from pathlib import Path

from capsulefs.agents.agent_log import LINE_MAX, LOG_FILES, AgentLog, clean_line, log_files, tail


def test_the_log_rotates_and_never_holds_more_than_its_cap(tmp_path: Path) -> None:
    log = AgentLog(str(tmp_path), "a" * 32, max_bytes=4096)
    for i in range(2000):
        log.feed(f"line {i}\n".encode())
    files = log_files(str(tmp_path), "a" * 32)
    assert len(files) == LOG_FILES
    assert all(os.path.getsize(f) <= 4096 for f in files)
    last = tail(str(tmp_path), "a" * 32, 3)
    assert [line.split(" ", 1)[1] for line in last] == ["line 1997", "line 1998", "line 1999"]
    # Oldest first, each file's lines in order: a continuous run.
    numbers = [int(line.rsplit(" ", 1)[1]) for line in tail(str(tmp_path), "a" * 32, 10_000)]
    assert numbers == list(range(numbers[0], 2000))


def test_partial_lines_wait_for_their_end_and_long_ones_are_cut(tmp_path: Path) -> None:
    log = AgentLog(str(tmp_path), "b" * 32)
    log.feed(b"hel")
    assert tail(str(tmp_path), "b" * 32, 5) == []
    log.feed(b"lo\r\n" + b"x" * (3 * LINE_MAX))
    log.flush()
    lines = [line.split(" ", 1)[1] for line in tail(str(tmp_path), "b" * 32, 5)]
    assert lines[0] == "hello"
    assert lines[1] == "x" * LINE_MAX + " [line cut]"


def test_control_characters_are_escaped() -> None:
    assert clean_line(b"\x1b[2J\x07ok\tfine\xff") == "\\x1b[2J\\x07ok\tfine\ufffd"
    assert clean_line("\u009b31m".encode()) == "\\x9b31m"
