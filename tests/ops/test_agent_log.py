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
    last = tail(str(tmp_path), "a" * 32, 3)[0]
    assert [line.split(" ", 1)[1] for line in last] == ["line 1997", "line 1998", "line 1999"]
    # Oldest first, each file's lines in order: a continuous run.
    numbers = [int(line.rsplit(" ", 1)[1]) for line in tail(str(tmp_path), "a" * 32, 10_000)[0]]
    assert numbers == list(range(numbers[0], 2000))


def test_partial_lines_wait_for_their_end_and_long_ones_are_cut(tmp_path: Path) -> None:
    log = AgentLog(str(tmp_path), "b" * 32)
    log.feed(b"hel")
    assert tail(str(tmp_path), "b" * 32, 5)[0] == []
    log.feed(b"lo\r\n" + b"x" * (3 * LINE_MAX))
    log.flush()
    lines = [line.split(" ", 1)[1] for line in tail(str(tmp_path), "b" * 32, 5)[0]]
    assert lines[0] == "hello"
    assert lines[1] == "x" * LINE_MAX + " [line cut]"


def test_control_characters_are_escaped() -> None:
    assert clean_line(b"\x1b[2J\x07ok\tfine\xff") == "\\x1b[2J\\x07ok\tfine\ufffd"
    assert clean_line("\u009b31m".encode()) == "\\x9b31m"


def test_logs_follow_prints_new_lines_across_a_rotation(store, state_dir: Path) -> None:
    """``capsulefs logs AGENT -f``: the last lines, then each new one as it is
    written, also once the file rotated (no daemon needed)."""
    import select
    import subprocess
    import sys

    from helpers import HANG, make_agent

    agent = make_agent(store, "chatty")
    log = AgentLog(str(state_dir), agent.agent_id, max_bytes=100)
    log.feed(b"before\n")
    proc = subprocess.Popen([sys.executable, "-m", "capsulefs", "--state", str(state_dir), "logs", "chatty", "-f",
                             "-n", "1"], stdout=subprocess.PIPE, text=True)
    try:
        def next_line() -> str:
            ready, _, _ = select.select([proc.stdout], [], [], HANG)
            assert ready, "no line from capsulefs logs -f"
            return proc.stdout.readline().rstrip("\n")

        assert next_line().endswith(" before")
        for i in range(12):  # (100 bytes a file: it rotates every few lines)
            log.feed(f"line {i}\n".encode())
            assert next_line().endswith(f" line {i}")
        assert len(log_files(str(state_dir), agent.agent_id)) == LOG_FILES
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def test_follow_starts_where_tail_ended(tmp_path: Path) -> None:
    """A line written between the last lines printed and the follow's start
    is printed, not lost (and none twice)."""
    from capsulefs.agents.agent_log import follow

    log = AgentLog(str(tmp_path), "c" * 32)
    log.feed(b"one\n")
    lines, end = tail(str(tmp_path), "c" * 32, 10)
    assert [line.split(" ", 1)[1] for line in lines] == ["one"]
    log.feed(b"two\n")  # (before the follow began)
    following = follow(log.path, end)
    assert next(following).endswith(" two")
    log.feed(b"three\n")
    assert next(following).endswith(" three")
    following.close()
