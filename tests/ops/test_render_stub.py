"""Real SDK clients against the loopback stub provider, switching providers mid-conversation.

The official ``anthropic``, ``openai`` and ``google-genai`` clients send rendered bodies to
capsulefs.testing.stub_provider, which enforces the pairing rules and refuses any
reasoning not signed for the requested model. Replies are parsed back into
events and journaled; then the conversation moves to another provider and
back, and every request along the way must be accepted.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import openai
import pytest
from google import genai
from google.genai import types as gt

from capsulefs.testing import stub_provider
from capsulefs.core.journal.events import Event, ModelSwitch, Reasoning, ToolCall, ToolResult, UserMessage
from helpers import HANG
from capsulefs.core.render import ToolSpec, parse_response, render
from render_sdk import validate_request

TOOLS = [ToolSpec(name="lookup", description="look a word up",
                  parameters={"type": "object", "properties": {"text": {"type": "string"}}})]


@pytest.fixture
def stub() -> Iterator[tuple[str, stub_provider.StubState]]:
    with stub_provider.serve() as (url, state):
        yield url, state


class Conversation:
    """A journal plus the clients; ``turn`` renders, sends, parses and runs tools."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.journal: list[Event] = []
        self.anthropic = anthropic.Anthropic(base_url=url, api_key="stub", max_retries=0)
        self.openai = openai.OpenAI(base_url=url + "/v1", api_key="stub", max_retries=0)
        self.gemini = genai.Client(api_key="stub", http_options=gt.HttpOptions(base_url=url, api_version="v1beta"))

    def close(self) -> None:
        self.anthropic.close()
        self.openai.close()
        self.gemini.close()

    def send(self, provider: str, body: dict) -> dict:
        if provider == "anthropic":
            reply = self.anthropic.messages.create(**body)
        elif provider == "openai-chat":
            reply = self.openai.chat.completions.create(**body)
        elif provider == "openai-responses":
            reply = self.openai.responses.create(**body)
        else:  # the genai client takes typed objects: build them from the REST JSON, base64 and all
            def typed(cls, obj):
                return cls.model_validate_json(json.dumps(obj))

            config = gt.GenerateContentConfig(
                system_instruction=typed(gt.Content, body["systemInstruction"]),
                tools=[typed(gt.Tool, t) for t in body.get("tools", ())],
                max_output_tokens=body["generationConfig"]["maxOutputTokens"],
                automatic_function_calling=gt.AutomaticFunctionCallingConfig(disable=True),
            )
            reply = self.gemini.models.generate_content(
                model=self.model, contents=[typed(gt.Content, c) for c in body["contents"]], config=config)
            return reply.model_dump(mode="json", exclude_none=True, by_alias=True)
        return reply.model_dump(mode="json", exclude_none=True)

    def turn(self, text: str | None = None) -> list[Event]:
        """One user message (if any), then model turns until no tool is called."""
        if text is not None:
            self.journal.append(UserMessage(text=text))
        new: list[Event] = []
        for _ in range(4):
            out = render(self.journal, working_memory="stub notes", tools=TOOLS, max_output=512)
            self.model = out.model
            validate_request(out.provider, out.body)
            events = parse_response(out.provider, self.send(out.provider, out.body), model=out.model)
            self.journal += events
            new += events
            calls = [e for e in events if isinstance(e, ToolCall)]
            if not calls:
                return new
            for c in calls:
                result = ToolResult(call_id=c.call_id, content=f"{c.name} found {c.arguments['text']!r}")
                self.journal.append(result)
                new.append(result)
        raise AssertionError("the stub kept calling tools")

    def switch(self, provider: str, model: str) -> None:
        self.journal.append(ModelSwitch(provider=provider, model=model))


def test_switch_providers_mid_conversation_and_back(stub) -> None:
    url, state = stub
    conv = Conversation(url)
    try:
        conv.switch("anthropic", "claude-a")
        got = conv.turn("please call lookup on 'capsule'")
        assert [type(e).__name__ for e in got] == ["Reasoning", "ToolCall", "ToolResult", "Reasoning", "AssistantMessage"]
        assert got[-1].text == "Tool results: lookup found \"please call lookup on 'capsule'\""

        conv.switch("openai-responses", "gpt-r")
        got = conv.turn("now call lookup and call lookup again")
        calls = [e for e in got if isinstance(e, ToolCall)]
        assert len(calls) == 2  # parallel calls, answered together
        assert got[-1].text.startswith("Tool results: lookup found")

        conv.switch("openai-chat", "gpt-c")
        assert conv.turn("say something")[-1].text == "echo: say something"

        conv.switch("gemini", "gem-a")
        got = conv.turn("call lookup from gemini")
        assert any(isinstance(e, Reasoning) and e.payload_format == "gemini.thought_signature" for e in got)
        assert got[-1].text == 'Tool results: {"output": "lookup found \'call lookup from gemini\'"}'

        conv.switch("anthropic", "claude-b")  # a different Claude: claude-a's signatures must not go
        assert conv.turn("hello b")[-1].text == "echo: hello b"

        conv.switch("anthropic", "claude-a")  # back: its old thinking is replayed and verifies
        assert conv.turn("hello again")[-1].text == "echo: hello again"
        sent = state.requests[-1][2]
        replayed = [b for m in sent["messages"] if m["role"] == "assistant" for b in m["content"]
                    if b["type"] == "thinking"]
        # claude-a's two earlier turns come back (and verified); claude-b's one turn does not
        assert [b["thinking"] for b in replayed] == ["thinking about turn 1", "thinking about turn 2"]
        assert state.refused == []

        conv.switch("openai-responses", "gpt-r")
        assert conv.turn("and responses again")[-1].text == "echo: and responses again"
        items = state.requests[-1][2]["input"]
        assert sum(1 for i in items if i.get("type") == "reasoning") == 2
        assert state.refused == []
    finally:
        conv.close()


def test_stub_refuses_reasoning_of_another_model(stub) -> None:
    url, state = stub
    conv = Conversation(url)
    try:
        conv.switch("anthropic", "claude-a")
        conv.turn("hi")
        body = render(conv.journal, provider="anthropic", model="claude-a").body
        body["model"] = "claude-b"  # claude-a's thinking sent to claude-b, as a naive renderer would
        with pytest.raises(anthropic.BadRequestError, match="signature"):
            conv.send("anthropic", body)

        conv.switch("openai-responses", "gpt-r")
        conv.turn("hi")
        body = render(conv.journal, provider="openai-responses", model="gpt-r").body
        body["model"] = "gpt-s"
        with pytest.raises(openai.BadRequestError, match="could not be verified"):
            conv.send("openai-responses", body)

        conv.switch("gemini", "gem-a")
        conv.turn("hi")
        body = render(conv.journal, provider="gemini", model="gem-a", working_memory="m").body
        conv.model = "gem-b"  # gem-a's thought signatures sent to gem-b
        with pytest.raises(genai.errors.ClientError, match="thought signature"):
            conv.send("gemini", {**body, "generationConfig": {"maxOutputTokens": 64}})
        assert len(state.refused) == 3
    finally:
        conv.close()


def test_stub_refuses_broken_pairing(stub) -> None:
    url, state = stub
    conv = Conversation(url)
    try:
        body = {"model": "gpt-c", "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]},
            {"role": "user", "content": "where is the result?"}]}
        with pytest.raises(openai.BadRequestError, match="not all answered"):
            conv.send("openai-chat", body)
        body = {"model": "claude-a", "max_tokens": 10, "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "lookup", "input": {}}]},
            {"role": "user", "content": "no result"}]}
        with pytest.raises(anthropic.BadRequestError, match="do not answer"):
            conv.send("anthropic", body)
        assert len(state.refused) == 2 and state.requests == []
    finally:
        conv.close()


def test_stub_runs_as_a_program() -> None:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "capsulefs.testing.stub_provider", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        url = proc.stdout.readline().split()[3]
        assert url.startswith("http://127.0.0.1:")
        with openai.OpenAI(base_url=url + "/v1", api_key="stub", max_retries=0) as client:
            reply = client.chat.completions.create(model="gpt-c", messages=[{"role": "user", "content": "ping"}])
        assert reply.choices[0].message.content == "echo: ping"
    finally:
        proc.terminate()
        proc.wait(timeout=HANG)
        proc.stdout.close()
