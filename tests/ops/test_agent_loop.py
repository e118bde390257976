"""The reference agent's loop over a real journal, tools in a real sandbox.

The provider is scripted here at the one seam the loop has for it (``call``);
tests/ops/test_agent_providers.py drives the same loop through the official SDKs
against stub servers on loopback.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from capsulefs.agents.reference.loop import Agent, dangling_calls, waits_on_model
from capsulefs.agents.reference.tools import Toolbox, ToolError
from capsulefs.agents.reference.ports import DirectPort
from capsulefs.core.journal import events as ev
from capsulefs.core.capsule import format as fmt
from capsulefs.core.journal.lines import verify_lines
from capsulefs.core.semantic.vectors import parse_index

MACHINE = "HOSTA"


def anthropic_reply(*blocks: dict) -> dict:
    return {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x",
            "content": list(blocks), "stop_reason": "end_turn", "usage": {"input_tokens": 1, "output_tokens": 1}}


@pytest.fixture
def capsule(tmp_path: Path) -> Path:
    d = tmp_path / "cap"
    (d / "memory").mkdir(parents=True)
    (d / fmt.JOURNAL).write_bytes(b"")
    (d / fmt.WORKING_MEMORY).write_text("the user likes short answers")
    return d


def test_tool_calls_run_in_the_sandbox_and_are_journaled_in_order(capsule: Path, tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    port = DirectPort(str(capsule), MACHINE)
    port.append([ev.ModelSwitch(provider="anthropic", model="claude-x"), ev.UserMessage(text="make a file")])
    bodies = []
    replies = iter([
        anthropic_reply(
            {"type": "thinking", "thinking": "plan", "signature": "sig-1"},
            {"type": "tool_use", "id": "t1", "name": "write_file", "input": {"path": "a.txt", "content": "A"}},
            {"type": "tool_use", "id": "t2", "name": "shell", "input": {"command": "cat a.txt; echo; ls"}},
        ),
        anthropic_reply({"type": "text", "text": "done"}),
    ])

    def call(provider: str, model: str, body: dict) -> dict:
        bodies.append((provider, body))
        return next(replies)

    agent = Agent(port, Toolbox(str(ws), str(capsule)), call=call)
    assert agent.step() and agent.step()
    assert not agent.step()  # nothing left to do
    kinds = [r.kind for r in port.records()]
    assert kinds == ["model_switch", "user_message", "tools", "reasoning", "tool_call", "tool_call",
                     "tool_result", "tool_result", "assistant_message"]  # the tools journaled once, before the first call
    offered = [t["name"] for t in port.records()[2].event.tools]
    assert offered == ["read_file", "write_file", "shell", "recall"]
    assert all([t["name"] for t in body["tools"]] == offered for _, body in bodies)
    results = [r.event for r in port.records() if r.kind == "tool_result"]
    assert results[0].content == "wrote 1 bytes to a.txt" and not results[0].is_error
    assert results[1].content.startswith("exit status 0\nA\na.txt")
    assert (ws / "a.txt").read_text() == "A"
    # The working memory is system context; the reasoning went back verbatim to the same model.
    assert "short answers" in json.dumps(bodies[0][1]["system"])
    second = json.dumps(bodies[1][1])
    assert '"signature": "sig-1"' in second
    assert verify_lines(port._j.lines()) == []


def test_dangling_calls_from_a_dead_run_get_error_results(capsule: Path, tmp_path: Path) -> None:
    port = DirectPort(str(capsule), MACHINE)
    port.append([
        ev.ModelSwitch(provider="anthropic", model="claude-x"),
        ev.UserMessage(text="run it"),
        ev.ToolCall(call_id="t9", name="shell", arguments={"command": "sleep 100"}),
    ])
    assert [c.call_id for c in dangling_calls(port.records())] == ["t9"]
    agent = Agent(port, Toolbox(str(tmp_path), str(capsule)), call=lambda p, m, b: anthropic_reply({"type": "text", "text": "ok"}))
    assert agent.answer_interrupted() == 1
    (result,) = [r.event for r in port.records() if r.kind == "tool_result"]
    assert result.call_id == "t9" and result.is_error and "interrupted" in result.content
    assert waits_on_model(port.records())
    assert agent.answer_interrupted() == 0  # answered once, never twice


def test_tools_cannot_leave_the_workspace(tmp_path: Path) -> None:
    box = Toolbox(str(tmp_path / "ws"), str(tmp_path))
    (tmp_path / "ws").mkdir()
    (tmp_path / "secret.txt").write_text("no")
    for bad in ("../secret.txt", "/etc/passwd", "sub/../../secret.txt"):
        with pytest.raises(ToolError, match="outside the workspace"):
            box.run("read_file", {"path": bad})
    with pytest.raises(ToolError, match="timed out"):
        box.run("shell", {"command": "sleep 5", "timeout": 0.2})
    with pytest.raises(ToolError, match="unknown tool"):
        box.run("rm_rf", {})


def test_stopping_leaves_remaining_calls_dangling_not_lost(capsule: Path, tmp_path: Path) -> None:
    port = DirectPort(str(capsule), MACHINE)
    port.append([ev.ModelSwitch(provider="anthropic", model="claude-x"), ev.UserMessage(text="two things")])
    agent = Agent(port, Toolbox(str(tmp_path), str(capsule)), call=lambda p, m, b: anthropic_reply(
        {"type": "tool_use", "id": "t1", "name": "shell", "input": {"command": "true"}},
        {"type": "tool_use", "id": "t2", "name": "shell", "input": {"command": "true"}},
    ))
    agent.stopping = True
    agent.step()
    assert [c.call_id for c in dangling_calls(port.records())] == ["t1", "t2"]


def test_recall_tool_finds_the_agents_own_history(capsule: Path, tmp_path: Path) -> None:
    port = DirectPort(str(capsule), MACHINE)
    port.append([
        ev.UserMessage(text="The staging database lives on port 5433, not the default."),
        ev.AssistantMessage(text="Noted: staging uses 5433."),
        ev.UserMessage(text="Lunch is at noon on Fridays."),
    ])
    (capsule / fmt.VECTOR_INDEX).parent.mkdir(parents=True, exist_ok=True)
    (capsule / fmt.VECTOR_INDEX).write_bytes(fmt.empty_vector_index())
    out = Toolbox(str(tmp_path), str(capsule)).run("recall", {"query": "which port does the staging database use", "k": 1})
    assert "5433" in out and "user_message" in out
    saved = parse_index((capsule / fmt.VECTOR_INDEX).read_bytes())  # the index it brought up to date is kept
    assert {e.event for e in saved.entries} == {r.id for r in port.records()}, saved.entries


def test_tool_results_never_carry_the_runs_secrets(capsule: Path, tmp_path: Path, monkeypatch) -> None:
    # The supervisor hands secrets to the agent process in its environment and
    # names them in CAPSULE_SECRETS. A model that runs `env` (or reads a file
    # the secret was written to) must not get the value into the journal.
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-live-0123456789")
    monkeypatch.setenv("CAPSULE_SECRETS", "ANTHROPIC_API_KEY")
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "leak.txt").write_text("key=sk-live-0123456789\n")
    port = DirectPort(str(capsule), MACHINE)
    port.append([ev.ModelSwitch(provider="anthropic", model="claude-x"), ev.UserMessage(text="debug")])
    replies = iter([
        anthropic_reply(
            {"type": "tool_use", "id": "t1", "name": "shell", "input": {"command": "env; echo \"[$ANTHROPIC_API_KEY]\""}},
            {"type": "tool_use", "id": "t2", "name": "read_file", "input": {"path": "leak.txt"}},
        ),
        anthropic_reply({"type": "text", "text": "done"}),
    ])
    agent = Agent(port, Toolbox(str(ws), str(capsule)), call=lambda p, m, b: next(replies))
    assert agent.step()
    results = [r.event for r in port.records() if r.kind == "tool_result"]
    assert len(results) == 2
    assert "[]" in results[0].content  # the shell does not see the secret at all
    assert "ANTHROPIC_API_KEY" in results[1].content  # a value found elsewhere is replaced by its name
    assert b"sk-live-0123456789" not in (capsule / fmt.JOURNAL).read_bytes()


@pytest.mark.expect_error_log
def test_a_newest_message_larger_than_the_budget_is_reported_not_sent(capsule: Path, tmp_path: Path) -> None:
    # It used to send the digest alone: the model was asked about nothing.
    port = DirectPort(str(capsule), MACHINE)
    port.append([ev.ModelSwitch(provider="anthropic", model="claude-x"), ev.UserMessage(text="hello"),
                 ev.AssistantMessage(text="hi"), ev.UserMessage(text="please read this: " + "lorem ipsum " * 2000)])
    status = tmp_path / "agent-status.json"
    calls = []
    agent = Agent(port, Toolbox(str(tmp_path), str(capsule)), call=lambda *a: calls.append(a) or {},
                  budget=2000, status_file=str(status))
    assert agent.attempt() is None and calls == []
    problem = json.loads(status.read_text())["problem"]
    assert "the newest user message alone is" in problem and "over the budget of 2000 tokens" in problem
    agent.budget = None  # (a bigger budget, or a shorter message): the next step goes through
    agent.call = lambda *a: anthropic_reply({"type": "text", "text": "read it"})
    assert agent.attempt() is True and not status.exists() and agent.problem is None


# -- attachments --------------------------------------------------------------------------------

#: The stub provider's endpoint for each provider (capsulefs.testing.stub_provider).
STUB_PATHS = {"anthropic": "/v1/messages", "openai-chat": "/v1/chat/completions",
              "openai-responses": "/v1/responses", "gemini": "/v1beta/models/{model}:generateContent"}


def stub_call(state):
    """The agent's ``call`` seam answered in process by the stub provider,
    which refuses (HTTP 400) any request that breaks the provider's rules."""
    from capsulefs.testing.stub_provider import handle

    def call(provider: str, model: str, body: dict) -> dict:
        status, reply = handle(state, STUB_PATHS[provider].format(model=model), body)
        assert status == 200, reply
        return reply

    return call


@pytest.mark.parametrize("provider", sorted(STUB_PATHS))
def test_read_file_on_an_image_shows_it_to_the_model_in_the_next_request(capsule: Path, tmp_path: Path,
                                                                         provider: str) -> None:
    import base64
    import hashlib

    from capsulefs.testing.stub_provider import StubState

    ws = tmp_path / "ws"
    ws.mkdir()
    png = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 8
    (ws / "chart.txt").write_bytes(png)  # the bytes tell what it is, not the name
    port = DirectPort(str(capsule), MACHINE)
    port.append([ev.ModelSwitch(provider=provider, model="gpt-4o"),
                 ev.UserMessage(text='look: call read_file {"path": "chart.txt"}')])
    state = StubState()
    agent = Agent(port, Toolbox(str(ws), str(capsule)), call=stub_call(state))
    assert agent.step()  # the model asks for the file; the tool attaches it
    sha = hashlib.sha256(png).hexdigest()
    (call,) = [r.event for r in port.records() if r.kind == "tool_call"]
    kinds = [r.kind for r in port.records()]
    assert kinds[-2:] == ["attachment", "tool_result"]  # one append: never one without the other
    attachment = port.records()[-2].event
    assert (attachment.blob, attachment.media_type, attachment.size, attachment.call_id) == \
        (sha, "image/png", len(png), call.call_id)
    assert (capsule / fmt.blob_path(sha)).read_bytes() == png
    assert len(state.requests) == 1 and base64.b64encode(png).decode() not in json.dumps(state.requests[0][2])
    assert agent.step()  # the next request carries the image, as the provider's own part
    assert state.refused == [] and len(state.requests) == 2
    body = json.dumps(state.requests[1][2])
    assert base64.b64encode(png).decode() in body
    part = {"anthropic": '"type": "image"', "openai-chat": '"type": "image_url"',
            "openai-responses": '"type": "input_image"', "gemini": '"inlineData"'}[provider]
    assert part in body


def test_read_file_does_not_attach_what_no_provider_takes(capsule: Path, tmp_path: Path) -> None:
    from capsulefs.core import render

    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "huge.pdf").write_bytes(b"%PDF-1.7\n" + bytes(render.MAX_ATTACHMENT))
    (ws / "notes.png").write_text("plain text, whatever the name says")
    box = Toolbox(str(ws), str(capsule))
    with pytest.raises(ToolError, match=f"larger than {render.MAX_ATTACHMENT} bytes"):
        box.call("read_file", {"path": "huge.pdf"})
    out = box.call("read_file", {"path": "notes.png"})
    assert out.files == () and out.text == "plain text, whatever the name says"
