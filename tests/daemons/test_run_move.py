"""Moving a running agent mid-conversation between two real daemons: it carries on.

The reference agent runs on host A against stub providers (official SDKs);
after ``echo b > .control/move`` it runs on host B only, continues the same
conversation, and the journal lost and duplicated nothing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from helpers import reference_agent_spec
import pytest
from mount_kit import capsulefs, needs_fuse
from test_move_daemons import Host, hosts, start_all, wait_for, write_move  # noqa: F401 (hosts is a fixture)

from capsulefs.core.journal.record import Record
from capsulefs.core.store.holder import HolderState
from capsulefs.core.journal.lines import verify_lines
from capsulefs.testing.stub_provider import serve

pytestmark = [pytest.mark.fuse, needs_fuse]


def _records(h: Host, name: str) -> list[Record]:
    data = (h.mnt / name / "memory" / "timeline_events.jsonl").read_bytes()
    return [Record.from_line(line) for line in data.splitlines()]


def _say(h: Host, name: str, text: str) -> None:
    with open(h.mnt / name / "memory" / "timeline_events.jsonl", "a") as f:
        f.write(json.dumps({"kind": "user_message", "text": text}) + "\n")


def _replies(h: Host, name: str) -> int:
    return sum(r.kind == "assistant_message" for r in _records(h, name))


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_running_agent_moves_mid_conversation_and_carries_on(hosts: tuple[Host, Host], tmp_path: Path) -> None:
    a, b = hosts
    with serve() as (url, stub):
        spec = reference_agent_spec(tmp_path / "spec.json", url)
        for h in (a, b):
            for key in ("ANTHROPIC_API_KEY", "OPENAI_API_KEY"):
                capsulefs("--state", str(h.state), "secret", "set", key, input="stub-key\n")
        a.cli("new", "pilot", "--spec", str(spec))
        a.spawn(run=True)
        b.spawn(run=True)
        start_all(a, b)
        wait_for(lambda: a.status("pilot")["run"]["state"] == "running", "the agent to run on A")
        pid_a = a.status("pilot")["run"]["pid"]

        (a.mnt / "pilot" / ".control" / "model").write_text("anthropic:claude-a\n")
        _say(a, "pilot", "hello")
        wait_for(lambda: _replies(a, "pilot") >= 1, "a reply on A")
        _say(a, "pilot", 'call write_file {"path": "plan.md", "content": "carry on at B"}')
        wait_for(lambda: _replies(a, "pilot") >= 2, "the tool round trip on A")
        before = _records(a, "pilot")

        assert write_move(a.mnt, "pilot", "b\n") == 0
        assert not _alive(pid_a)  # stopped on A before B took over
        assert "pilot" not in os.listdir(a.mnt)
        agent_id = b.status("pilot")["agent_id"]
        assert a.holder(agent_id) is HolderState.RETIRED and b.holder(agent_id) is HolderState.HELD
        # B's keys are B's to give: the agent's spec asks for them, B has not granted them yet.
        wait_for(lambda: b.status("pilot")["run"]["state"] == "blocked", "the agent to wait for B's grant")
        detail = b.status("pilot")["run"]["detail"]
        assert f"capsulefs secret grant {agent_id} ANTHROPIC_API_KEY OPENAI_API_KEY" in detail, detail
        b.cli("secret", "grant", "pilot", "ANTHROPIC_API_KEY", "OPENAI_API_KEY")
        wait_for(lambda: b.status("pilot")["run"]["state"] == "running", "the agent to run on B")
        assert b.status("pilot")["run"]["pid"] != pid_a

        (b.mnt / "pilot" / ".control" / "model").write_text("openai-responses:gpt-r\n")
        _say(b, "pilot", "are you still there?")
        wait_for(lambda: _replies(b, "pilot") >= 3, "a reply on B")
        (b.mnt / "pilot" / ".control" / "model").write_text("anthropic:claude-a\n")
        _say(b, "pilot", "back to claude")
        wait_for(lambda: _replies(b, "pilot") >= 4, "another reply on B")
        assert stub.refused == []

        after = _records(b, "pilot")
        assert verify_lines([r.line for r in after]) == []
        assert [r.line for r in after[: len(before)]] == [r.line for r in before]  # nothing lost
        assert len({r.id for r in after}) == len(after)  # nothing duplicated
        kinds = [r.kind for r in after]
        assert kinds.count("workspace_update") == 1  # the freeze synced plan.md once
        sandbox_b = b.state / "sandboxes" / agent_id / "workspace" / "plan.md"
        assert sandbox_b.read_text() == "carry on at B"
        # Claude's reasoning from A went back to claude-a on B, verbatim; the stub checked its signature.
        last = [body for prov, model, body in stub.requests if model == "claude-a"][-1]
        assert any(blk.get("type") == "thinking" for m in last["messages"] if isinstance(m["content"], list)
                   for blk in m["content"])
        a.stop()
        b.stop()
