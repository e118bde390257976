"""OpenAI Chat Completions (``POST /v1/chat/completions``).

Rules this module guarantees for every body it renders:
  * One assistant step becomes one assistant message: its texts as content
    (one text part each) and its calls as ``tool_calls``.
  * That message is followed at once by one ``tool`` message for every id in
    its ``tool_calls``, in call order; no ``tool`` message appears elsewhere.
  * ``function.arguments`` is a JSON string of an object.
  * A blank (empty or whitespace-only) user or assistant text is not sent;
    an assistant message left with neither text nor calls is not sent.
  * Chat Completions has no way to send private reasoning back, so reasoning
    is never sent; and no error flag on tool output, so an error result's
    text starts with ``[error]``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from ..journal.events import AssistantMessage, Event, ToolCall
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
)
from ._plan import ATTACH, CALL, RESULT, TEXT, USER, Item

ID = "openai-chat"


class OpenAIChat(Provider):
    id = ID
    replays = frozenset()
    accepts = {**{t: 20 * MB10 for t in IMAGES}, "application/pdf": 32 * MB}  # docs/render.md, "Limits and their sources"
    limits = RequestLimits(images=500, pdf_pages=100, image_bytes=50 * MB10, pdf_bytes=32 * MB10)

    def _attachment(self, item: Item, model: str) -> dict[str, Any]:
        ev, pages = item[1], item[2]
        why = self.why_not(item)
        if why is not None:
            return {"type": "text", "text": attachment_note(ev, why)}
        tokens = attachment_tokens(ev.media_type, ev.size, pages, image=openai_image_tokens(model))
        data = BlobData(ev.blob, tokens, f"data:{ev.media_type};base64,")
        if ev.media_type in IMAGES:
            return {"type": "image_url", "image_url": {"url": data}}
        return {"type": "file", "file": {"filename": ev.name or "document.pdf", "file_data": data}}

    def fragment(self, items: list[Item], *, model: str) -> Any:
        messages: list[dict[str, Any]] = []
        texts: list[str] = []
        calls: list[dict[str, Any]] = []

        def flush() -> None:
            if not texts and not calls:
                return
            msg: dict[str, Any] = {"role": "assistant"}
            if len(texts) == 1:
                msg["content"] = texts[0]
            elif texts:
                msg["content"] = [{"type": "text", "text": t} for t in texts]
            else:
                msg["content"] = None
            if calls:
                msg["tool_calls"] = list(calls)
            messages.append(msg)
            texts.clear()
            calls.clear()

        for item in items:
            tag = item[0]
            if tag == TEXT:
                if item[1].strip():
                    texts.append(item[1])
            elif tag == CALL:
                calls.append({"id": item[1], "type": "function",
                              "function": {"name": item[2], "arguments": args_json(item[3])}})
            elif tag == RESULT:
                flush()
                messages.append({"role": "tool", "tool_call_id": item[1], "content": error_text(item[3], item[4])})
            elif tag == USER:
                flush()
                if item[1].strip():
                    messages.append({"role": "user", "content": item[1]})
            elif tag == ATTACH:  # a user message of parts (tool messages take text only)
                flush()
                messages.append({"role": "user", "content": [self._attachment(item, model)]})
            # THINK: never sent to Chat Completions
        flush()
        return messages

    def body(self, items: list[Item], *, model: str, system: str | None, tools: Sequence[ToolSpec],
             max_output: int | None) -> dict[str, Any]:
        messages = self.fragment(items, model=model)
        if system:
            messages.insert(0, {"role": "system", "content": system})
        body: dict[str, Any] = {"model": model, "messages": messages}
        if max_output:
            body["max_completion_tokens"] = max_output
        if tools:
            body["tools"] = [_tool(t) for t in tools]
        return body

    def parse(self, response: Mapping[str, Any], *, model: str, new_id: Any = None) -> list[Event]:
        choices = response.get("choices") or ()
        if not choices:
            return []
        msg = choices[0].get("message") or {}
        out: list[Event] = []
        for key in ("content", "refusal"):
            text = msg.get(key)
            if isinstance(text, list):
                text = "".join(p.get("text") or p.get("refusal") or "" for p in text)
            if text:
                out.append(AssistantMessage(text=text, provider=ID, model=model))
        for call in msg.get("tool_calls") or ():
            fn = call.get("function") or {}
            out.append(ToolCall(call_id=call["id"], name=fn["name"], arguments=args_from_json(fn.get("arguments")),
                                provider=ID, model=model))
        return out

    def check(self, body: Mapping[str, Any]) -> list[str]:
        problems: list[str] = []
        waiting: list[str] = []  # ids the next messages must answer
        seen: set[str] = set()
        for i, msg in enumerate(body.get("messages") or ()):
            role = msg.get("role")
            where = f"messages[{i}]"
            if role == "tool":
                cid = msg.get("tool_call_id")
                if cid in waiting:
                    waiting.remove(cid)
                else:
                    problems.append(f"{where}: tool message for {cid!r} does not answer the assistant message before it")
                continue
            if waiting:
                problems.append(f"{where}: tool_calls {waiting} were not all answered before this message")
                waiting = []
            if role not in ("system", "developer", "user", "assistant"):
                problems.append(f"{where}: unknown role {role!r}")
            content = msg.get("content")
            if role in ("user", "assistant") and (isinstance(content, str) and not content.strip() or any(
                    isinstance(p, dict) and p.get("type") == "text" and not str(p.get("text", "")).strip()
                    for p in (content if isinstance(content, list) else ()))):
                problems.append(f"{where}: blank text in a {role} message")
            if role == "assistant":
                calls = msg.get("tool_calls") or []
                if msg.get("content") is None and not calls:
                    problems.append(f"{where}: assistant message with neither content nor tool_calls")
                for call in calls:
                    cid = call.get("id")
                    if cid in seen:
                        problems.append(f"{where}: tool call id {cid!r} used twice")
                    seen.add(cid)
                    waiting.append(cid)
                    try:
                        ok = isinstance(json.loads(call["function"]["arguments"]), dict)
                    except (KeyError, TypeError, ValueError, RecursionError):  # ValueError: JSONDecodeError, a huge number
                        ok = False
                    if not ok:
                        problems.append(f"{where}: arguments of {cid!r} are not a JSON object string")
        if waiting:
            problems.append(f"tool_calls {waiting} are never answered")
        return problems


def _tool(spec: ToolSpec) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": spec.name, "parameters": dict(spec.parameters)}
    if spec.description:
        fn["description"] = spec.description
    return {"type": "function", "function": fn}


PROVIDER = OpenAIChat()
