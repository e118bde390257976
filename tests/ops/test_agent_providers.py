"""The reference agent through the official SDKs, against stub providers on loopback.

The stub enforces each provider's pairing rules and refuses reasoning that
was not minted for the requested model, so a conversation that survives a
switch to another provider and back proves nothing was lost or mangled.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from capsulefs.agents.reference.loop import Agent
from capsulefs.agents.reference.providers import ProviderClients
from capsulefs.agents.reference.tools import Toolbox
from capsulefs.agents.reference.ports import DirectPort
from capsulefs.core.journal import events as ev
from capsulefs.core.capsule import format as fmt
from capsulefs.core.journal.lines import verify_lines
from capsulefs.testing.stub_provider import serve

from helpers import HANG, wait_until

MACHINE = "HOSTA"


@pytest.fixture
def stub(monkeypatch: pytest.MonkeyPatch):
    with serve() as (url, state):
        for k, v in {
            "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "stub",
            "OPENAI_BASE_URL": url + "/v1", "OPENAI_API_KEY": "stub",
            "GEMINI_BASE_URL": url, "GEMINI_API_KEY": "stub",
        }.items():
            monkeypatch.setenv(k, v)
        yield url, state


@pytest.fixture
def capsule(tmp_path: Path) -> Path:
    d = tmp_path / "cap"
    (d / "memory" / "vector_index").mkdir(parents=True)
    (d / fmt.JOURNAL).write_bytes(b"")
    (d / fmt.WORKING_MEMORY).write_text("be brief")
    (d / fmt.VECTOR_INDEX).write_bytes(fmt.empty_vector_index())
    return d


def _run_until_idle(agent: Agent) -> int:
    steps = 0
    while agent.step():
        steps += 1
        assert steps < 10, "the conversation did not settle"
    return steps


def test_conversation_switches_provider_and_back_with_no_loss(stub, capsule: Path, tmp_path: Path) -> None:
    _url, state = stub
    port = DirectPort(str(capsule), MACHINE)
    clients = ProviderClients()
    agent = Agent(port, Toolbox(str(tmp_path), str(capsule)), call=clients)
    plan = [
        ("anthropic", "claude-a", "hello there"),
        ("anthropic", "claude-a", "please call read_file"),
        ("openai-responses", "gpt-r", "now on another provider, call shell"),
        ("openai-chat", "gpt-c", "and chat completions"),
        ("gemini", "gemini-g", "and gemini, call recall"),
        ("anthropic", "claude-a", "back to the first model"),
        ("anthropic", "claude-b", "another claude model must not see claude-a's reasoning"),
    ]
    for provider, model, text in plan:
        port.append([ev.ModelSwitch(provider=provider, model=model), ev.UserMessage(text=text)])
        assert _run_until_idle(agent) >= 1
    assert state.refused == []  # every request kept its provider's rules and signatures
    providers_seen = [p for p, _m, _b in state.requests]
    assert set(providers_seen) == {"anthropic", "openai-chat", "openai-responses", "gemini"}

    records = port.records()
    assert verify_lines([r.line for r in records]) == []
    ids = [r.id for r in records]
    assert len(ids) == len(set(ids))  # nothing duplicated
    kinds = Counter(r.kind for r in records)
    assert kinds["user_message"] == len(plan)
    assert kinds["tool_call"] == kinds["tool_result"] == 3
    assert kinds["reasoning"] >= 3  # anthropic and responses replies carry signed reasoning
    # Back on claude-a, its own earlier reasoning went back verbatim.
    back = [b for p, m, b in state.requests if m == "claude-a"][-1]
    assert any(block.get("type") == "thinking" for msg in back["messages"] if isinstance(msg["content"], list)
               for block in msg["content"])
    # claude-b got none of it.
    other = [b for p, m, b in state.requests if m == "claude-b"][-1]
    assert not any(block.get("type") in ("thinking", "redacted_thinking") for msg in other["messages"]
                   if isinstance(msg["content"], list) for block in msg["content"])


def test_agent_process_converses_and_stops_on_sigterm(stub, capsule: Path, tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    port = DirectPort(str(capsule), MACHINE)
    port.append([ev.ModelSwitch(provider="openai-chat", model="gpt-c")])
    env = dict(os.environ, CAPSULE_DIR=str(capsule), CAPSULE_MACHINE=MACHINE)
    with subprocess.Popen([sys.executable, "-m", "capsulefs", "agent"], cwd=ws, env=env,
                          stderr=subprocess.PIPE) as proc:
        try:
            port.append([ev.UserMessage(text="first question")])
            wait_until(lambda: any(r.kind == "assistant_message" for r in port.records()), "the first reply")
            port.append([ev.UserMessage(text="second, call write_file")])
            wait_until(lambda: sum(r.kind == "assistant_message" for r in port.records()) >= 2, "the second reply")
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=HANG) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
    records = port.records()
    assert verify_lines([r.line for r in records]) == []
    texts = [r.event.text for r in records if r.kind == "assistant_message"]
    assert texts[0] == "echo: first question"
    assert [r.kind for r in records][-3:] == ["tool_call", "tool_result", "assistant_message"]


def test_tool_call_with_arguments_runs_in_the_sandbox(stub, capsule: Path, tmp_path: Path) -> None:
    port = DirectPort(str(capsule), MACHINE)
    agent = Agent(port, Toolbox(str(tmp_path), str(capsule)), call=ProviderClients())
    port.append([ev.ModelSwitch(provider="openai-responses", model="gpt-r"),
                 ev.UserMessage(text='call write_file {"path": "notes/plan.md", "content": "step one"}')])
    _run_until_idle(agent)
    assert (tmp_path / "notes" / "plan.md").read_text() == "step one"
    (result,) = [r.event for r in port.records() if r.kind == "tool_result"]
    assert not result.is_error and result.content == "wrote 8 bytes to notes/plan.md"
