"""Google Gemini ``generateContent`` (REST JSON, camelCase).

Rules this module guarantees for every body it renders:
  * ``contents`` alternate ``user`` / ``model``, starting with ``user``;
    consecutive items of one side merge into one content.
  * ``functionCall.args`` is an object; every call is answered in the next
    ``user`` content by a ``functionResponse`` with the same id and name,
    whose ``response`` is ``{"output": text}`` or ``{"error": text}``.
  * Thought signatures (payload format ``gemini.thought_signature``, data
    ``{"thoughtSignature": ...}``) are journaled as a reasoning event just
    before the part that carried them, and re-attached to that part only for
    the exact model that wrote them. Thought parts (``gemini.thought``, data
    ``{"part": {...}}``) come back verbatim for that model only.
  * A blank (empty or whitespace-only) text is not sent, except on a model
    part that carries a thought signature (Gemini itself returns such
    parts: ``{"text": "", "thoughtSignature": ...}``).
  * Gemini 3 and later refuse a request whose current turn (everything
    after the last user text) has a step of function calls without a
    signature: when another model made that step, or its signature was
    never journaled, the first call of the step carries Google's documented
    placeholder, ``skip_thought_signature_validator``. Earlier turns and
    earlier models are sent without one.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..journal.events import AssistantMessage, Event, Reasoning, ToolCall
from ._base import (
    MB,
    MB10,
    BlobData,
    Provider,
    RequestLimits,
    ToolSpec,
    args_from_json,
    attachment_note,
    attachment_tokens,
)
from ._plan import ATTACH, CALL, CONTINUES, RESULT, TEXT, USER, Item

ID = "gemini"
SIGNATURE = "gemini.thought_signature"
THOUGHT = "gemini.thought"
#: What Gemini 3 takes in place of a signature it never gave (its docs name it).
SKIP_SIGNATURE = "skip_thought_signature_validator"
_VERSION = re.compile(r"(?:models/)?gemini-(\d+)")


class Gemini(Provider):
    id = ID
    replays = frozenset({SIGNATURE, THOUGHT})
    # Sources and what could not be confirmed: docs/render.md, "Limits and their sources".
    # Inline data: 100 MB of base64 a request (was 20 MB), PDFs at most 50 MB.
    accepts = {**{t: 20 * MB for t in ("image/png", "image/jpeg", "image/webp", "image/heic", "image/heif",
                                       "text/plain")}, "application/pdf": 50 * MB10}
    limits = RequestLimits(images=3000, pdf_pages=1000, encoded_bytes=100 * MB10 * 9 // 10)

    def fragment(self, items: list[Item], *, model: str) -> Any:
        contents: list[dict[str, Any]] = []
        role = ""
        parts: list[dict[str, Any]] = []
        signature: Any = None  # waiting for the next model part

        def add(side: str, part: dict[str, Any]) -> None:
            nonlocal role, parts
            if side != role:
                parts = [part]
                contents.append({"role": side, "parts": parts})
                role = side
            else:
                parts.append(part)

        for item in items:
            tag = item[0]
            if tag != USER and tag != RESULT and tag != ATTACH:
                if tag == TEXT:
                    if not item[1].strip() and signature is None:
                        continue
                    part: dict[str, Any] = {"text": item[1]}
                elif tag == CALL:
                    part = {"functionCall": {"id": item[1], "name": item[2], "args": dict(item[3])}}
                else:  # THINK
                    ev = item[1]
                    if not self.keeps(ev, model):
                        continue
                    if ev.payload_format == SIGNATURE:
                        if signature is not None:
                            add("model", {"text": "", "thoughtSignature": signature})
                        signature = ev.data.get("thoughtSignature")
                        continue
                    part = dict(ev.data.get("part") or {})
                    if not part:
                        continue
                if signature is not None:
                    part["thoughtSignature"] = signature
                    signature = None
                add("model", part)
                continue
            if signature is not None:  # a signature whose part never came
                add("model", {"text": "", "thoughtSignature": signature})
                signature = None
            if tag == USER:
                if item[1].strip():
                    add("user", {"text": item[1]})
            elif tag == ATTACH:
                ev = item[1]
                why = self.why_not(item)
                if why is not None:
                    add("user", {"text": attachment_note(ev, why)})
                else:
                    add("user", {"inlineData": {"mimeType": ev.media_type, "data": BlobData(
                        ev.blob, attachment_tokens(ev.media_type, ev.size, item[2]))}})
            else:
                key = "error" if item[4] else "output"
                add("user", {"functionResponse": {"id": item[1], "name": item[2], "response": {key: item[3]}}})
        if signature is not None:
            add("model", {"text": "", "thoughtSignature": signature})
        return contents

    def body(self, items: list[Item], *, model: str, system: str | None, tools: Sequence[ToolSpec],
             max_output: int | None) -> dict[str, Any]:
        contents = self.fragment(items, model=model)
        if not contents or contents[0]["role"] != "user":
            contents.insert(0, {"role": "user", "parts": [{"text": CONTINUES}]})
        if signs_calls(model):
            _sign_current_turn(contents)
        body: dict[str, Any] = {"contents": contents}
        if system:
            body["systemInstruction"] = {"parts": [{"text": system}]}
        if tools:
            body["tools"] = [{"functionDeclarations": [_tool(t) for t in tools]}]
        if max_output:
            body["generationConfig"] = {"maxOutputTokens": max_output}
        return body

    def parse(
        self, response: Mapping[str, Any], *, model: str, new_id: Callable[[int], str] | None = None
    ) -> list[Event]:
        """Events of the first candidate. Calls without an id get ``new_id(index)``.

        The default id is a hash of the response and the part's index, so a
        re-parse of the same body gives the same ids.
        """
        candidates = response.get("candidates") or ()
        if not candidates:
            return []
        parts = (candidates[0].get("content") or {}).get("parts") or ()
        if new_id is None:
            seed = hashlib.sha256(json.dumps(response, sort_keys=True, default=str).encode()).hexdigest()[:16]
            new_id = lambda i: f"gc_{seed}_{i}"  # noqa: E731
        out: list[Event] = []
        for i, part in enumerate(parts):
            signature = part.get("thoughtSignature") or part.get("thought_signature")
            if part.get("thought"):
                out.append(Reasoning(provider=ID, model=model, payload_format=THOUGHT, data={"part": dict(part)},
                                     text=part.get("text")))
                continue
            if signature is not None:
                out.append(Reasoning(provider=ID, model=model, payload_format=SIGNATURE,
                                     data={"thoughtSignature": signature}))
            call = part.get("functionCall") or part.get("function_call")
            if call is not None:
                out.append(ToolCall(call_id=call.get("id") or new_id(i), name=call["name"],
                                    arguments=args_from_json(call.get("args") or {}), provider=ID, model=model))
            elif "text" in part:
                out.append(AssistantMessage(text=part["text"] or "", provider=ID, model=model))
        return out

    def check(self, body: Mapping[str, Any]) -> list[str]:
        problems: list[str] = []
        contents = list(body.get("contents") or ())
        if not contents:
            return ["contents is empty"]
        open_calls: list[tuple[str | None, str]] = []
        prev = ""
        for i, content in enumerate(contents):
            role = content.get("role")
            where = f"contents[{i}]"
            if role not in ("user", "model"):
                problems.append(f"{where}: role {role!r} is not user or model")
            if i == 0 and role != "user":
                problems.append(f"{where}: the first content must be a user turn")
            if role == prev:
                problems.append(f"{where}: two {role} turns in a row")
            prev = role
            parts = list(content.get("parts") or ())
            if not parts:
                problems.append(f"{where}: no parts")
            answers = []
            for part in parts:
                if "text" in part and not str(part["text"]).strip() and "thoughtSignature" not in part:
                    problems.append(f"{where}: blank text part")
                if "functionResponse" in part:
                    fr = part["functionResponse"]
                    answers.append((fr.get("id"), fr.get("name")))
                    if not isinstance(fr.get("response"), dict):
                        problems.append(f"{where}: functionResponse.response is not an object")
            if role == "user":
                if sorted(answers, key=str) != sorted(open_calls, key=str):
                    problems.append(f"{where}: function responses {answers} do not answer "
                                    f"the previous turn's calls {open_calls}")
                open_calls = []
            else:
                if answers:
                    problems.append(f"{where}: functionResponse in a model turn")
                open_calls = []
                for part in parts:
                    if "functionCall" in part:
                        fc = part["functionCall"]
                        if not isinstance(fc.get("args"), dict):
                            problems.append(f"{where}: functionCall.args is not an object")
                        open_calls.append((fc.get("id"), fc.get("name")))
        if open_calls:
            problems.append(f"function calls {open_calls} are never answered")
        return problems


def signs_calls(model: str) -> bool:
    """Whether ``model`` (Gemini 3 or later) insists on a signature for
    every step of calls in the current turn."""
    m = _VERSION.match(model)
    return m is not None and int(m.group(1)) >= 3


def _sign_current_turn(contents: list[dict[str, Any]]) -> None:
    """Give each step of calls after the last user text a signature, the
    placeholder where none was journaled for this model. Only a step's first
    call takes one (parallel calls share it); a real signature is never
    replaced. ``contents`` is fresh from :meth:`Gemini.fragment`."""
    start = 0
    for i, content in enumerate(contents):
        if content["role"] == "user" and any("text" in part for part in content["parts"]):
            start = i + 1
    for content in contents[start:]:
        if content["role"] != "model":
            continue
        calls = [part for part in content["parts"] if "functionCall" in part]
        if calls and not any("thoughtSignature" in part for part in calls):
            calls[0]["thoughtSignature"] = SKIP_SIGNATURE


def _tool(spec: ToolSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"name": spec.name, "parametersJsonSchema": dict(spec.parameters)}
    if spec.description:
        out["description"] = spec.description
    return out


PROVIDER = Gemini()
