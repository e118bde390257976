"""OpenAI Responses API (``POST /v1/responses``), stateless.

Rules this module guarantees for every body it renders:
  * Every ``function_call`` item is followed (after the rest of its step) by
    exactly one ``function_call_output`` with the same ``call_id``; no output
    appears without its call.
  * ``reasoning`` items (payload format ``openai-responses.reasoning``) are
    sent back in place, with their ``id``, ``summary`` and ``encrypted_content``
    unchanged, only to the exact model that wrote them. The journal keeps the
    whole item; output-only keys (``status``, plaintext ``content``) are not
    sent, and an item without ``encrypted_content`` is not sent at all (with
    ``store: false`` the API could not resolve it).
  * The journal is the only state: bodies say ``store: false`` and ask for
    ``reasoning.encrypted_content`` so the next reply's reasoning can be
    journaled and replayed.
    A reasoning item goes only where the item it led to (an assistant
    message or a function_call) follows it: one whose reply was cut off
    during reasoning is not sent (the API refuses "reasoning without its
    required following item").
  * No error flag exists on tool output, so an error result's text starts
    with ``[error]``.
  * A blank (empty or whitespace-only) user or assistant text is not sent.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from ..journal.events import AssistantMessage, Event, Reasoning, ToolCall
from ._base import (
    IMAGES,
    MB,
    MB10,
    BlobData,
    Provider,
    RequestLimits,
    ToolSpec,
    args_from_json,
    args_json,
    attachment_note,
    attachment_tokens,
    openai_image_tokens,
    error_text,
    verbatim,
)
from ._plan import ATTACH, CALL, RESULT, TEXT, USER, Item

ID = "openai-responses"
#: The keys of a reasoning item the API takes back as input; output-only keys
#: (``status``, plaintext ``content``) are refused there, so they stay in the journal only.
_REASONING_INPUT_KEYS = ("type", "id", "summary", "encrypted_content")


class OpenAIResponses(Provider):
    id = ID
    replays = frozenset({"openai-responses.reasoning"})
    accepts = {**{t: 20 * MB10 for t in IMAGES}, "application/pdf": 32 * MB}  # docs/render.md, "Limits and their sources"
    limits = RequestLimits(images=500, pdf_pages=100, image_bytes=50 * MB10, pdf_bytes=32 * MB10)

    def _attachment(self, item: Item, model: str) -> dict[str, Any]:
        ev, pages = item[1], item[2]
        why = self.why_not(item)
        if why is not None:
            return {"type": "input_text", "text": attachment_note(ev, why)}
        tokens = attachment_tokens(ev.media_type, ev.size, pages, image=openai_image_tokens(model))
        data = BlobData(ev.blob, tokens, f"data:{ev.media_type};base64,")
        if ev.media_type in IMAGES:
            return {"type": "input_image", "image_url": data, "detail": "auto"}
        return {"type": "input_file", "filename": ev.name or "document.pdf", "file_data": data}

    def fragment(self, items: list[Item], *, model: str) -> Any:
        out: list[dict[str, Any]] = []
        for item in items:
            tag = item[0]
            if tag == USER:
                if item[1].strip():
                    out.append({"type": "message", "role": "user", "content": item[1]})
            elif tag == TEXT:
                if item[1].strip():
                    out.append({"type": "message", "role": "assistant", "content": item[1]})
            elif tag == ATTACH:
                out.append({"type": "message", "role": "user", "content": [self._attachment(item, model)]})
            elif tag == CALL:
                out.append({"type": "function_call", "call_id": item[1], "name": item[2],
                            "arguments": args_json(item[3])})
            elif tag == RESULT:
                out.append({"type": "function_call_output", "call_id": item[1],
                            "output": error_text(item[3], item[4])})
            elif self.keeps(item[1], model):
                data = item[1].data
                if data.get("encrypted_content"):  # without it a stateless request cannot carry it
                    sent = {k: data[k] for k in _REASONING_INPUT_KEYS if k in data}
                    sent.setdefault("summary", [])
                    out.append(sent)
        return [item for i, item in enumerate(out) if item.get("type") != "reasoning" or _followed(out, i)]

    def body(self, items: list[Item], *, model: str, system: str | None, tools: Sequence[ToolSpec],
             max_output: int | None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "input": self.fragment(items, model=model),
            "store": False,
            "include": ["reasoning.encrypted_content"],
        }
        if system:
            body["instructions"] = system
        if max_output:
            body["max_output_tokens"] = max_output
        if tools:
            body["tools"] = [_tool(t) for t in tools]
        return body

    def parse(self, response: Mapping[str, Any], *, model: str, new_id: Any = None) -> list[Event]:
        out: list[Event] = []
        for item in response.get("output") or ():
            kind = item.get("type")
            if kind == "reasoning":
                data = verbatim(item)
                summary = "\n\n".join(s.get("text", "") for s in item.get("summary") or ()) or None
                out.append(Reasoning(provider=ID, model=model, payload_format="openai-responses.reasoning",
                                     data=data, text=summary))
            elif kind == "message":
                for part in item.get("content") or ():
                    text = part.get("text") if part.get("type") == "output_text" else part.get("refusal")
                    if text:
                        out.append(AssistantMessage(text=text, provider=ID, model=model))
            elif kind == "function_call":
                out.append(ToolCall(call_id=item["call_id"], name=item["name"],
                                    arguments=args_from_json(item.get("arguments")), provider=ID, model=model))
        return out

    def check(self, body: Mapping[str, Any]) -> list[str]:
        problems: list[str] = []
        calls: dict[str, int] = {}  # call_id -> outputs seen
        items = list(body.get("input") or ())
        for i, item in enumerate(items):
            kind = item.get("type", "message")
            where = f"input[{i}]"
            content = item.get("content")
            if kind == "message" and isinstance(content, str) and not content.strip():
                problems.append(f"{where}: blank text in a {item.get('role')} message")
            if kind == "reasoning" and not _followed(items, i):
                problems.append(f"{where}: reasoning without its required following item")
            if kind == "function_call":
                cid = item.get("call_id")
                if cid in calls:
                    problems.append(f"{where}: call_id {cid!r} used twice")
                calls[cid] = 0
                try:
                    ok = isinstance(json.loads(item["arguments"]), dict)
                except (KeyError, TypeError, ValueError, RecursionError):  # ValueError: JSONDecodeError, a huge number
                    ok = False
                if not ok:
                    problems.append(f"{where}: arguments are not a JSON object string")
            elif kind == "function_call_output":
                cid = item.get("call_id")
                if cid not in calls:
                    problems.append(f"{where}: output for call_id {cid!r} with no function_call before it")
                else:
                    calls[cid] += 1
                    if calls[cid] > 1:
                        problems.append(f"{where}: second output for call_id {cid!r}")
        for cid, n in calls.items():
            if n == 0:
                problems.append(f"function_call {cid!r} has no function_call_output")
        return problems


def _produced(item: Mapping[str, Any]) -> bool:
    """Whether ``item`` is one a reasoning item can lead to."""
    return item.get("type") == "function_call" or (item.get("type") == "message" and item.get("role") == "assistant")


def _followed(items: list[dict[str, Any]], i: int) -> bool:
    """Whether the reasoning item ``items[i]`` is followed, after any more
    reasoning, by an item it led to."""
    for item in items[i + 1:]:
        if item.get("type") != "reasoning":
            return _produced(item)
    return False


def _tool(spec: ToolSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "function", "name": spec.name, "parameters": dict(spec.parameters), "strict": False}
    if spec.description:
        out["description"] = spec.description
    return out


PROVIDER = OpenAIResponses()
