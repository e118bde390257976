"""``capsulefs mcp AGENT``, end to end: the official MCP SDK's own client
talks to a real ``capsulefs mcp`` subprocess over stdio."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from capsulefs.core.capsule import format as fmt
from capsulefs.core.store.holder import HolderBook, HolderState
from capsulefs.core.store.host_store import HostStore
from capsulefs.move.host import holders_dir
from cli_kit import REPO, run_cli

pytest.importorskip("mcp")

from mcp import ClientSession  # noqa: E402
from mcp.client.stdio import StdioServerParameters, stdio_client  # noqa: E402

TOOLS = {"timeline", "search", "read_memory", "edit_memory", "append", "list_files", "read_file", "status"}


def _session(state: Path, agent: str, body: Callable[[ClientSession], Awaitable[None]]) -> None:
    """Run ``body`` against a ``capsulefs mcp`` subprocess, under asyncio (the
    SDK's client needs anyio; pytest runs this test synchronously)."""

    async def main() -> None:
        params = StdioServerParameters(command=sys.executable,
                                       args=["-m", "capsulefs", "--state", str(state), "mcp", agent],
                                       cwd=str(REPO), env={"PYTHONPATH": os.environ.get("PYTHONPATH", "")})
        with anyio.fail_after(120):  # (bounds a hang only)
            async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
                await session.initialize()
                await body(session)

    anyio.run(main, backend="asyncio")


async def _call(session: ClientSession, tool: str, **args: Any) -> str:
    result = await session.call_tool(tool, args)
    text = "".join(getattr(c, "text", "") for c in result.content)
    if result.is_error:
        raise ToolFailed(text)
    return text


class ToolFailed(Exception):
    pass


def test_an_mcp_client_reads_and_writes_an_agent(state_dir: Path) -> None:
    """Every tool, through the SDK's client; the capsule verifies after."""
    run_cli("new", "ada", state=state_dir, check=True)
    store = HostStore.open(state_dir)
    agent = store.find("ada")
    body = b"print('hello from the workspace')\n"
    sha = store.put_blob(body)
    run_cli("append", "ada", "--kind", "workspace_update", "--json", json.dumps({"changes": {"src/hi.py": sha}}),
            "-q", state=state_dir, check=True)
    run_cli("append", "ada", "--kind", "tool_result", "--json",
            json.dumps({"call_id": "c1", "content": "exit 2: no such file", "is_error": True}), "-q",
            state=state_dir, check=True)

    async def body_(s: ClientSession) -> None:
        assert {t.name for t in (await s.list_tools()).tools} == TOOLS
        line = json.loads(await _call(s, "append", text="hello from an MCP client"))
        assert line["kind"] == "user_message" and line["seq"] == 3
        note = json.loads(await _call(s, "append", kind="note", text="a note"))
        assert note["kind"] == "note"
        shown = await _call(s, "timeline", grep="MCP client")
        assert "user_message" in shown and "hello from an MCP client" in shown and "a note" not in shown
        raw = (await _call(s, "timeline", failed=True, raw=True)).splitlines()
        assert [json.loads(x)["content"] for x in raw] == ["exit 2: no such file"]
        assert len((await _call(s, "timeline", tail=2, raw=True)).splitlines()) == 2
        await _call(s, "edit_memory", text="remember: the build needs --release\n")
        assert await _call(s, "read_memory") == "remember: the build needs --release\n"
        assert json.loads(await _call(s, "list_files")) == {"src/hi.py": sha}
        assert await _call(s, "read_file", path="src/hi.py") == body.decode()
        status = json.loads(await _call(s, "status"))
        assert status["name"] == "ada" and status["state"] == "held" and status["events"] == 5
        hits = json.loads(await _call(s, "search", query="build needs release"))
        assert hits and any("release" in h["snippet"] for h in hits)
        for tool, args, says in (("read_file", {"path": "nope"}, "no file"),
                                 ("timeline", {"tail": 0}, "between 1 and"),
                                 ("timeline", {"grep": "("}, "not a regular expression"),
                                 ("timeline", {"since": "soon"}, "not a date"),
                                 ("append", {"kind": "model_switch", "text": "x"}, "user_message or note")):
            with pytest.raises(ToolFailed, match=says):
                await _call(s, tool, **args)

    _session(state_dir, "ada", body_)
    lines = Path(agent.path(fmt.JOURNAL)).read_bytes().splitlines()
    assert [json.loads(x)["kind"] for x in lines] == ["workspace_update", "tool_result", "user_message", "note",
                                                      "memory_edit"]
    assert Path(agent.path(fmt.WORKING_MEMORY)).read_text() == "remember: the build needs --release\n"
    out = state_dir.parent / "ada.tar"
    run_cli("export", "ada", "-o", str(out), state=state_dir, check=True)
    run_cli("verify", str(out), check=True)


def test_mcp_writes_are_refused_where_this_host_does_not_hold_the_agent(state_dir: Path) -> None:
    run_cli("new", "ada", state=state_dir, check=True)
    store = HostStore.open(state_dir)
    agent = store.find("ada")
    holders = HolderBook(holders_dir(str(state_dir)))
    held = holders.get(agent.agent_id)
    assert held is not None
    holders.put(held.with_(state=HolderState.RETIRED, epoch=held.epoch + 1, peer="P" * 52, note="moved away",
                           held_epoch=None))
    before = agent.read(fmt.JOURNAL)

    async def body_(s: ClientSession) -> None:
        for tool, args in (("append", {"text": "lost?"}), ("edit_memory", {"text": "lost too?"})):
            with pytest.raises(ToolFailed, match="cannot append to agent ada.*no longer holds it"):
                await _call(s, tool, **args)
        assert json.loads(await _call(s, "status"))["state"] == "retired"

    _session(state_dir, "ada", body_)
    assert agent.read(fmt.JOURNAL) == before
