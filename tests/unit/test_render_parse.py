"""Provider replies parse into events that render back verbatim for the same model.

Each sample reply is first validated as the SDK's own response type, so the
samples are shapes the real APIs return.
"""

from __future__ import annotations

import json

import pytest
from anthropic.types import Message
from google.genai import types as gt
from openai.types.chat import ChatCompletion
from openai.types.responses import Response

from capsulefs.core.journal.events import AssistantMessage, Reasoning, ToolCall, ToolResult, UserMessage
from capsulefs.core.render import check_request, parse_response, render
from render_sdk import validate_request

ANTHROPIC = {
    "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x-20260101",
    "stop_reason": "tool_use", "stop_sequence": None, "usage": {"input_tokens": 5, "output_tokens": 5},
    "content": [
        {"type": "thinking", "thinking": "let me look", "signature": "SIG1"},
        {"type": "redacted_thinking", "data": "REDACTED1"},
        {"type": "text", "text": "Looking."},
        {"type": "tool_use", "id": "toolu_1", "name": "ls", "input": {"path": "/"}},
        {"type": "tool_use", "id": "toolu_2", "name": "cat", "input": {}},
    ],
}
CHAT = {
    "id": "c1", "object": "chat.completion", "created": 0, "model": "gpt-x",
    "choices": [{"index": 0, "finish_reason": "tool_calls", "logprobs": None, "message": {
        "role": "assistant", "content": "On it.", "refusal": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "ls", "arguments": "{\"path\": \"/\"}"}},
            {"id": "call_2", "type": "function", "function": {"name": "cat", "arguments": "{not json"}}]}}],
}
RESPONSES = {
    "id": "resp_1", "object": "response", "created_at": 0, "model": "gpt-r", "status": "completed",
    "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
    "output": [
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "plan"}],
         "encrypted_content": "ENC1", "status": "completed"},
        {"type": "function_call", "id": "fc_1", "call_id": "call_9", "name": "ls", "arguments": "{\"path\":\"/\"}",
         "status": "completed"},
        {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Done.", "annotations": []}]},
    ],
}
GEMINI = {
    "responseId": "r1", "modelVersion": "gem-x",
    "candidates": [{"index": 0, "finishReason": "STOP", "content": {"role": "model", "parts": [
        {"text": "I thought about it", "thought": True, "thoughtSignature": "VEhPVUdIVA=="},
        {"functionCall": {"name": "ls", "args": {"path": "/"}}, "thoughtSignature": "U0lHMQ=="},
        {"text": "Listing."},
        {"text": "", "thoughtSignature": "U0lHMg=="},
    ]}}],
}


def test_samples_are_real_response_shapes() -> None:
    Message.model_validate(ANTHROPIC)
    ChatCompletion.model_validate(CHAT)
    Response.model_validate(RESPONSES)
    gt.GenerateContentResponse.model_validate_json(json.dumps(GEMINI))


def test_anthropic_reply_round_trips() -> None:
    events = parse_response("anthropic", ANTHROPIC, model="claude-x")
    assert [type(e) for e in events] == [Reasoning, Reasoning, AssistantMessage, ToolCall, ToolCall]
    assert events[0].data == ANTHROPIC["content"][0] and events[0].text == "let me look"
    assert events[1].payload_format == "anthropic.redacted_thinking"
    assert all(getattr(e, "model", None) == "claude-x" for e in events)  # the requested model, not the alias
    journal = [UserMessage(text="go"), *events, ToolResult(call_id="toolu_1", content="a b"),
               ToolResult(call_id="toolu_2", content="x")]
    body = render(journal, provider="anthropic", model="claude-x").body
    validate_request("anthropic", body)
    assert body["messages"][1]["content"] == ANTHROPIC["content"]  # verbatim, same order


def test_chat_reply_keeps_unparsable_arguments() -> None:
    events = parse_response("openai-chat", CHAT, model="gpt-x")
    assert events[0] == AssistantMessage(text="On it.", provider="openai-chat", model="gpt-x")
    assert events[1].arguments == {"path": "/"}
    assert events[2].arguments == {"_unparsed_arguments": "{not json"}
    body = render([UserMessage(text="go"), *events], provider="openai-chat", model="gpt-x").body
    assert check_request("openai-chat", body) == []


def test_responses_reply_round_trips() -> None:
    events = parse_response("openai-responses", RESPONSES, model="gpt-r")
    assert [type(e) for e in events] == [Reasoning, ToolCall, AssistantMessage]
    assert events[0].text == "plan" and events[0].data["encrypted_content"] == "ENC1"
    journal = [UserMessage(text="go"), *events, ToolResult(call_id="call_9", content="a")]
    body = render(journal, provider="openai-responses", model="gpt-r").body
    validate_request("openai-responses", body)
    reasoning = {k: v for k, v in RESPONSES["output"][0].items() if k != "status"}
    assert body["input"][1] == reasoning and body["input"][2]["call_id"] == "call_9"


def test_gemini_reply_round_trips_signatures_on_their_parts() -> None:
    events = parse_response("gemini", GEMINI, model="gem-x")
    kinds = [(type(e).__name__, getattr(e, "payload_format", None)) for e in events]
    assert kinds == [("Reasoning", "gemini.thought"), ("Reasoning", "gemini.thought_signature"), ("ToolCall", None),
                     ("AssistantMessage", None), ("Reasoning", "gemini.thought_signature"), ("AssistantMessage", None)]
    assert events[2].call_id == parse_response("gemini", GEMINI, model="gem-x")[2].call_id  # stable id
    journal = [UserMessage(text="go"), *events, ToolResult(call_id=events[2].call_id, content="a")]
    body = render(journal, provider="gemini", model="gem-x").body
    validate_request("gemini", body)
    parts = body["contents"][1]["parts"]
    expected = [dict(p) for p in GEMINI["candidates"][0]["content"]["parts"]]
    expected[1]["functionCall"] = {"id": events[2].call_id, **expected[1]["functionCall"]}
    assert parts == expected
    other = render(journal, provider="gemini", model="gem-y").body
    assert "thoughtSignature" not in json.dumps(other) and "I thought about it" not in json.dumps(other)


@pytest.mark.parametrize("provider", ["anthropic", "openai-chat", "openai-responses", "gemini"])
def test_empty_reply_parses_to_nothing(provider: str) -> None:
    assert parse_response(provider, {}, model="m") == []


def test_responses_reasoning_sends_only_what_the_input_takes() -> None:
    item = {"type": "reasoning", "id": "rs_2", "summary": [], "encrypted_content": "ENC2", "status": "completed",
            "content": [{"type": "reasoning_text", "text": "raw"}]}
    bare = {"type": "reasoning", "id": "rs_3", "summary": []}  # no encrypted_content: not replayable statelessly
    reply = dict(RESPONSES, output=[item, bare, RESPONSES["output"][2]])
    events = parse_response("openai-responses", reply, model="gpt-r")
    assert events[0].data == item  # the journal keeps the whole item
    body = render([UserMessage(text="go"), *events], provider="openai-responses", model="gpt-r").body
    validate_request("openai-responses", body)
    assert body["input"][1] == {"type": "reasoning", "id": "rs_2", "summary": [], "encrypted_content": "ENC2"}
    assert "rs_3" not in json.dumps(body)
