"""A running agent in a real mount: the reference agent talks to stub providers
through the official SDKs while a person edits its memory and switches its model
through the mount's files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from mount_kit import capsulefs, mounted, needs_fuse

from capsulefs.core.events import Record
from capsulefs.core.journal import verify_lines
from capsulefs.stubprovider import serve

from helpers import reference_agent_spec, wait_until

pytestmark = [needs_fuse]


def _records(agent_dir: Path) -> list[Record]:
    data = (agent_dir / "memory" / "timeline_events.jsonl").read_bytes()
    return [Record.from_line(line) for line in data.splitlines()]


def _say(agent_dir: Path, text: str) -> None:
    with open(agent_dir / "memory" / "timeline_events.jsonl", "a") as f:
        f.write(json.dumps({"kind": "user_message", "text": text}) + "\n")


def _replies(agent_dir: Path) -> list[str]:
    return [r.event.text for r in _records(agent_dir) if r.kind == "assistant_message"]


def test_running_agent_converses_through_the_mount(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with serve() as (url, stub):
        spec = reference_agent_spec(tmp_path / "spec.json", url)
        capsulefs("--state", str(state), "new", "pilot", "--spec", str(spec))
        for name in ("ANTHROPIC_API_KEY", "OPENAI_API_KEY"):
            capsulefs("--state", str(state), "secret", "set", name, input="stub-key\n")
        mnt = tmp_path / "mnt"
        with mounted(state, mnt):
            agent = mnt / "pilot"
            status = lambda: json.loads((agent / ".control" / "status").read_text())  # noqa: E731
            wait_until(lambda: status()["run"]["state"] == "running", "the agent process to run")
            pid = status()["run"]["pid"]

            (agent / ".control" / "model").write_text("anthropic:claude-a\n")
            _say(agent, "hello")
            wait_until(lambda: len(_replies(agent)) >= 1, "the first reply")
            assert _replies(agent)[0] == "echo: hello"

            # A person edits working memory the way editors do: temp file, rename.
            tmp = agent / "memory" / ".working_memory.md.swp"
            tmp.write_text("# notes\nthe user's favourite colour is blue\n")
            os.replace(tmp, agent / "memory" / "working_memory.md")
            _say(agent, "what do you remember?")
            wait_until(lambda: len(_replies(agent)) >= 2, "the second reply")
            assert "favourite colour is blue" in json.dumps(stub.requests[-1][2])

            # Switch provider mid-conversation and back.
            (agent / ".control" / "model").write_text("openai-chat:gpt-c\n")
            _say(agent, "now on chat completions, call write_file")
            wait_until(lambda: len(_replies(agent)) >= 3, "the reply on openai-chat")
            (agent / ".control" / "model").write_text("anthropic:claude-a\n")
            _say(agent, "and back")
            wait_until(lambda: len(_replies(agent)) >= 4, "the reply after switching back")
            assert stub.refused == []
            assert [p for p, _m, _b in stub.requests][-1] == "anthropic"
            assert status()["model"] == "claude-a"

            recs = _records(agent)
            assert verify_lines([r.line for r in recs]) == []
            assert len({r.id for r in recs}) == len(recs)
            kinds = [r.kind for r in recs]
            assert kinds.count("memory_edit") == 1 and kinds.count("model_switch") == 3
            assert kinds.count("tool_call") == kinds.count("tool_result") == 1
        with pytest.raises(ProcessLookupError):  # unmounting stopped the agent
            os.kill(pid, 0)
        for f in tmp_path.rglob("*"):  # the store, the daemon's log, the sandbox
            if f.is_file() and f.name != "secrets.json":
                assert b"stub-key" not in f.read_bytes(), f
