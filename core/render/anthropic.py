"""Anthropic Messages API (``POST /v1/messages``).

Rules this module guarantees for every body it renders:
  * Roles alternate user/assistant, starting with user: consecutive items of
    one side merge into one message.
  * Every ``tool_use`` is answered in the very next user message by a
    ``tool_result`` with the same id, and those results open that message;
    no ``tool_result`` appears anywhere else.
  * ``thinking`` / ``redacted_thinking`` blocks (payload formats
    ``anthropic.thinking`` / ``anthropic.redacted_thinking``) are sent back,
    verbatim and in place, only to the exact model that wrote them: their
    signatures are model-specific.
  * Text blocks are never empty or blank (the API refuses those): a blank
    text is not sent. Neither is a ``tool_result``'s content: a blank output
    is sent as :data:`NO_OUTPUT` (the API refuses an empty one flagged
    ``is_error``).
  * An assistant turn with thinking starts with it: thinking kept for this
    model that the journal has after a text or a call of the same turn (the
    model changed mid-step) moves up, after the thinking before it.
"""

from __future__ import annotations

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
    attachment_note,
    anthropic_image_tokens,
    attachment_tokens,
    verbatim,
)
from ._plan import ATTACH, CALL, CONTINUES, RESULT, TEXT, USER, Item

ID = "anthropic"
_THINKING = frozenset({"thinking", "redacted_thinking"})
#: What a tool_result says for a tool output that is empty or blank.
NO_OUTPUT = "(no output)"


class Anthropic(Provider):
    id = ID
    replays = frozenset({"anthropic.thinking", "anthropic.redacted_thinking"})
    # Sources: docs/render.md, "Limits and their sources". An image's limit is
    # 5 MiB of base64 (so 3.75 MiB of bytes), the request's 32 MB.
    accepts = {**{t: 5 * MB * 3 // 4 for t in IMAGES}, "application/pdf": 32 * MB}
    limits = RequestLimits(images=100, pdf_pages=100, encoded_bytes=32 * MB10 * 9 // 10)

    def _messages(self, items: list[Item], model: str) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        role = ""
        content: list[dict[str, Any]] = []
        for item in items:
            tag = item[0]
            if tag == USER or tag == TEXT:
                if not item[1].strip():
                    continue
                block: dict[str, Any] = {"type": "text", "text": item[1]}
                side = "user" if tag == USER else "assistant"
            elif tag == CALL:
                block = {"type": "tool_use", "id": item[1], "name": item[2], "input": dict(item[3])}
                side = "assistant"
            elif tag == ATTACH:
                block = self._attachment(item, model)
                side = "user"
            elif tag == RESULT:
                output = item[3] if item[3].strip() else NO_OUTPUT
                block = {"type": "tool_result", "tool_use_id": item[1], "content": output}
                if item[4]:
                    block["is_error"] = True
                side = "user"
            else:  # THINK
                if not self.keeps(item[1], model):
                    continue
                block = dict(item[1].data)
                side = "assistant"
            if side != role:
                content = [block]
                messages.append({"role": side, "content": content})
                role = side
            elif tag != CALL and tag != TEXT and side == "assistant" and any(
                    b["type"] not in _THINKING for b in content):
                # thinking after text or a call (the model changed mid-step): the turn starts with it
                at = next(i for i, b in enumerate(content) if b["type"] not in _THINKING)
                content.insert(at, block)
            else:
                content.append(block)
        return messages

    def _attachment(self, item: Item, model: str) -> dict[str, Any]:
        ev, pages = item[1], item[2]
        why = self.why_not(item)
        if why is not None:
            return {"type": "text", "text": attachment_note(ev, why)}
        source = {"type": "base64", "media_type": ev.media_type,
                  "data": BlobData(ev.blob, attachment_tokens(ev.media_type, ev.size, pages,
                                                              image=anthropic_image_tokens(model)))}
        return {"type": "image" if ev.media_type in IMAGES else "document", "source": source}

    def body(self, items: list[Item], *, model: str, system: str | None, tools: Sequence[ToolSpec],
             max_output: int | None) -> dict[str, Any]:
        messages = self._messages(items, model)
        if not messages or messages[0]["role"] != "user":
            messages.insert(0, {"role": "user", "content": [{"type": "text", "text": CONTINUES}]})
        body: dict[str, Any] = {"model": model, "max_tokens": max_output or 4096, "messages": messages}
        if system:
            body["system"] = system
        if tools:
            body["tools"] = [_tool(t) for t in tools]
        return body

    def fragment(self, items: list[Item], *, model: str) -> Any:
        return self._messages(items, model)

    def parse(self, response: Mapping[str, Any], *, model: str, new_id: Any = None) -> list[Event]:
        out: list[Event] = []
        for block in response.get("content") or ():
            kind = block.get("type")
            if kind == "text":
                out.append(AssistantMessage(text=block["text"], provider=ID, model=model))
            elif kind == "thinking":
                data = {"type": "thinking", "thinking": block["thinking"], "signature": block["signature"]}
                out.append(Reasoning(provider=ID, model=model, payload_format="anthropic.thinking", data=data,
                                     text=block["thinking"]))
            elif kind == "redacted_thinking":
                data = {"type": "redacted_thinking", "data": block["data"]}
                out.append(Reasoning(provider=ID, model=model, payload_format="anthropic.redacted_thinking",
                                     data=data))
            elif kind == "tool_use":
                out.append(ToolCall(call_id=block["id"], name=block["name"], arguments=dict(block.get("input") or {}),
                                    provider=ID, model=model))
            else:  # server tools and future kinds: keep them for this model only
                out.append(Reasoning(provider=ID, model=model, payload_format=f"anthropic.{kind}",
                                     data=verbatim(block)))
        return out

    def check(self, body: Mapping[str, Any]) -> list[str]:
        problems: list[str] = []
        messages = list(body.get("messages") or ())
        if not messages:
            return ["messages is empty"]
        seen: set[str] = set()
        open_calls: list[str] = []
        prev = ""
        for i, msg in enumerate(messages):
            role = msg.get("role")
            where = f"messages[{i}]"
            if role not in ("user", "assistant"):
                problems.append(f"{where}: role {role!r} is not user or assistant")
            if i == 0 and role != "user":
                problems.append(f"{where}: the first message must be a user message")
            if role == prev:
                problems.append(f"{where}: two {role} messages in a row (roles must alternate)")
            prev = role
            content = msg.get("content")
            blocks = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or ())
            if not blocks:
                problems.append(f"{where}: empty content")
            answered = [str(b.get("tool_use_id")) for b in blocks if b.get("type") == "tool_result"]
            if role == "user":
                if sorted(answered) != sorted(open_calls):
                    problems.append(f"{where}: tool results {sorted(answered)} do not answer "
                                    f"the previous turn's tool_use ids {sorted(open_calls)}")
                n = len(answered)
                if any(b.get("type") != "tool_result" for b in blocks[:n]):
                    problems.append(f"{where}: tool_result blocks must come first")
                open_calls = []
            else:
                if answered:
                    problems.append(f"{where}: tool_result in an assistant message")
                open_calls = [str(b.get("id")) for b in blocks if b.get("type") == "tool_use"]
                for cid in open_calls:
                    if cid in seen:
                        problems.append(f"{where}: tool_use id {cid!r} used twice")
                    seen.add(cid)
            if role == "assistant":
                kinds = [b.get("type") for b in blocks]
                if any(k in _THINKING for k in kinds) and kinds[0] not in _THINKING:
                    problems.append(f"{where}: an assistant turn with thinking must start with it")
            for b in blocks:
                if b.get("type") == "text" and not str(b.get("text", "")).strip():
                    problems.append(f"{where}: blank text block")
                if b.get("type") == "tool_result" and b.get("is_error") and not b.get("content"):
                    problems.append(f"{where}: tool_result content cannot be empty if is_error is true")
        if open_calls:
            problems.append(f"tool_use ids {open_calls} are never answered")
        return problems


def _tool(spec: ToolSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"name": spec.name, "input_schema": dict(spec.parameters)}
    if spec.description:
        out["description"] = spec.description
    return out


PROVIDER = Anthropic()
