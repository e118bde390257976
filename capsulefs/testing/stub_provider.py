"""A local stand-in for the model providers' HTTP APIs, for tests and demos.

Rules:
  * Listens on loopback only. Speaks Anthropic Messages (``POST /v1/messages``),
    OpenAI Chat Completions (``POST /v1/chat/completions``), OpenAI Responses
    (``POST /v1/responses``) and Gemini (``POST /v1beta/models/M:generateContent``),
    so the official SDK clients can talk to it with ``base_url`` pointed here.
  * Every request is checked with :func:`capsulefs.core.render.check_request`
    (the provider's pairing rules) and every piece of replayed reasoning must
    carry this stub's signature *for the requested model*: a thinking block,
    reasoning item or thought signature minted for another model, or altered,
    is refused with HTTP 400 in the provider's error format, as the real APIs do.
  * Replies are deterministic. The stub looks at the last user-side turn:
    after tool results it reports them back in text; a user text with
    ``call NAME`` (one or more times) gets those tool calls, in parallel, with
    the JSON object written right after the name as arguments, or else
    ``{"text": <the user text>}`` (if the request offers that tool, or offers
    no tools); anything else is echoed. Anthropic and
    Responses replies open with signed reasoning; Gemini's first part carries a
    signed thought signature; Chat replies have none (the API has none).

Theory of operation: a stdlib ``ThreadingHTTPServer``; :func:`serve` runs it
in a daemon thread and is a context manager yielding the base URL, so a test
or the reference agent's demo can use it without any event loop. Run it on
its own with ``python -m capsulefs.testing.stub_provider --port N``.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import hmac
import json
import logging
import re
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from capsulefs.core.render import check_request

log = logging.getLogger(__name__)

_KEY = b"capsulefs-stub-provider"
_CALL_RE = re.compile(r"\bcall ([A-Za-z_][A-Za-z0-9_-]*)")
_GEMINI_RE = re.compile(r"^/v1beta/models/([^/:]+):generateContent$")


def sign(model: str, what: str) -> str:
    """This stub's signature of ``what`` for ``model`` (hex)."""
    return hmac.new(_KEY, f"{model}\x00{what}".encode(), hashlib.sha256).hexdigest()


class Refused(Exception):
    """The request breaks a rule; the message is what the API would say."""


@dataclass
class StubState:
    """What the stub has seen: (provider, model, body) of every accepted request."""

    requests: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)  # (provider, reason)
    lock: threading.Lock = field(default_factory=threading.Lock)
    counter: int = 0

    def next_id(self) -> int:
        with self.lock:
            self.counter += 1
            return self.counter


# -- what the conversation asks for (provider-neutral) --------------------------------


@dataclass
class Ask:
    """The last user-side turn: either tool results or a user text."""

    results: list[str]
    text: str
    tools: list[str] | None  # tool names offered, None if none were


def _arguments(text: str, end: int) -> dict[str, Any]:
    """The JSON object right after ``call NAME`` if there is one, else {"text": text}."""
    rest = text[end:].lstrip()
    if rest.startswith("{"):
        try:
            obj, _ = json.JSONDecoder().raw_decode(rest)
        except ValueError:
            obj = None
        if isinstance(obj, dict):
            return obj
    return {"text": text}


def _decide(ask: Ask) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
    """(reply text, tool calls as (name, arguments))."""
    if ask.results:
        return "Tool results: " + " | ".join(ask.results), []
    calls = [(m.group(1), _arguments(ask.text, m.end())) for m in _CALL_RE.finditer(ask.text)
             if ask.tools is None or m.group(1) in ask.tools]
    if calls:
        return "", calls
    return f"echo: {ask.text}", []


# -- Anthropic Messages ---------------------------------------------------------------------


def _anthropic(state: StubState, body: Mapping[str, Any]) -> dict[str, Any]:
    model = body["model"]
    for msg in body["messages"]:
        if msg["role"] != "assistant" or isinstance(msg["content"], str):
            continue
        for block in msg["content"]:
            if block.get("type") == "thinking" and block.get("signature") != sign(model, block.get("thinking", "")):
                raise Refused("messages: Invalid `signature` in `thinking` block")
            if block.get("type") == "redacted_thinking":
                raise Refused("messages: this stub never mints redacted_thinking blocks")
    last = body["messages"][-1]
    blocks = [{"type": "text", "text": last["content"]}] if isinstance(last["content"], str) else last["content"]
    tools = [t["name"] for t in body["tools"]] if body.get("tools") else None
    ask = Ask(
        results=[str(b.get("content")) for b in blocks if b.get("type") == "tool_result"] if last["role"] == "user" else [],
        text=" ".join(b.get("text", "") for b in blocks if b.get("type") == "text"),
        tools=tools,
    )
    text, calls = _decide(ask)
    n = state.next_id()
    thought = f"thinking about turn {n}"
    content: list[dict[str, Any]] = [{"type": "thinking", "thinking": thought, "signature": sign(model, thought)}]
    if text:
        content.append({"type": "text", "text": text})
    for i, (name, args) in enumerate(calls):
        content.append({"type": "tool_use", "id": f"toolu_stub{n}_{i}", "name": name, "input": args})
    return {
        "id": f"msg_stub{n}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": "tool_use" if calls else "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": len(json.dumps(body)) // 4, "output_tokens": 10},
    }


# -- OpenAI Chat Completions ---------------------------------------------------------------


def _chat(state: StubState, body: Mapping[str, Any]) -> dict[str, Any]:
    model = body["model"]
    messages = body["messages"]
    results: list[str] = []
    for msg in reversed(messages):
        if msg["role"] != "tool":
            break
        results.insert(0, str(msg["content"]))
    last = messages[-1]
    text_in = last["content"] if isinstance(last.get("content"), str) else ""
    tools = [t["function"]["name"] for t in body["tools"]] if body.get("tools") else None
    text, calls = _decide(Ask(results=results, text=text_in if last["role"] == "user" else "", tools=tools))
    n = state.next_id()
    message: dict[str, Any] = {"role": "assistant", "content": text or None, "refusal": None}
    if calls:
        message["tool_calls"] = [
            {"id": f"call_stub{n}_{i}", "type": "function",
             "function": {"name": name, "arguments": json.dumps(args)}}
            for i, (name, args) in enumerate(calls)
        ]
    return {
        "id": f"chatcmpl-stub{n}",
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if calls else "stop",
                     "logprobs": None}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


# -- OpenAI Responses ------------------------------------------------------------------------


def _responses(state: StubState, body: Mapping[str, Any]) -> dict[str, Any]:
    model = body["model"]
    items = body["input"] if isinstance(body["input"], list) else [{"role": "user", "content": body["input"]}]
    for item in items:
        if item.get("type") == "reasoning":
            enc = item.get("encrypted_content") or ""
            if enc != f"stub:{sign(model, item.get('id', ''))}":
                raise Refused("The encrypted content for item " + str(item.get("id")) + " could not be verified.")
    results: list[str] = []
    for item in reversed(items):
        if item.get("type") != "function_call_output":
            break
        results.insert(0, str(item["output"]))
    last = items[-1]
    content = last.get("content")
    text_in = content if last.get("role") == "user" and isinstance(content, str) else ""
    tools = [t["name"] for t in body["tools"]] if body.get("tools") else None
    text, calls = _decide(Ask(results=results, text=text_in, tools=tools))
    n = state.next_id()
    rid = f"rs_stub{n}"
    output: list[dict[str, Any]] = [{
        "type": "reasoning", "id": rid, "summary": [{"type": "summary_text", "text": f"thinking about turn {n}"}],
        "encrypted_content": f"stub:{sign(model, rid)}",
    }]
    if text:
        output.append({"type": "message", "id": f"msg_stub{n}", "role": "assistant", "status": "completed",
                       "content": [{"type": "output_text", "text": text, "annotations": []}]})
    for i, (name, args) in enumerate(calls):
        output.append({"type": "function_call", "id": f"fc_stub{n}_{i}", "call_id": f"call_stub{n}_{i}",
                       "name": name, "arguments": json.dumps(args), "status": "completed"})
    return {
        "id": f"resp_stub{n}", "object": "response", "created_at": 0, "model": model, "status": "completed",
        "output": output, "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
        "usage": {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2,
                  "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}},
    }


# -- Gemini generateContent --------------------------------------------------------------------


def _gemini_signature(model: str, n: int) -> str:
    return base64.b64encode(f"{n}:{sign(model, str(n))}".encode()).decode()


def _gemini(state: StubState, model: str, body: Mapping[str, Any]) -> dict[str, Any]:
    contents = body["contents"]
    for content in contents:
        for part in content.get("parts") or ():
            sig = part.get("thoughtSignature")
            if sig is None:
                continue
            try:
                n = int(base64.b64decode(sig, validate=True).decode().split(":", 1)[0])
            except (ValueError, UnicodeDecodeError):
                raise Refused("Corrupted thought signature.") from None
            if sig != _gemini_signature(model, n):
                raise Refused("Corrupted thought signature.")
    last = contents[-1]
    parts = last.get("parts") or []
    results = [json.dumps(p["functionResponse"].get("response")) for p in parts if "functionResponse" in p]
    text_in = " ".join(p.get("text", "") for p in parts if "text" in p)
    decls = [d["name"] for t in body.get("tools") or () for d in t.get("functionDeclarations") or ()]
    text, calls = _decide(Ask(results=results, text=text_in, tools=decls or None))
    n = state.next_id()
    out: list[dict[str, Any]] = []
    if text:
        out.append({"text": text})
    for i, (name, args) in enumerate(calls):
        out.append({"functionCall": {"id": f"gc_stub{n}_{i}", "name": name, "args": args}})
    out[0]["thoughtSignature"] = _gemini_signature(model, n)
    return {
        "candidates": [{"content": {"role": "model", "parts": out}, "finishReason": "STOP", "index": 0}],
        "modelVersion": model,
        "responseId": f"stub{n}",
    }


# -- HTTP ------------------------------------------------------------------------------------------

_ROUTES = {
    "/v1/messages": "anthropic",
    "/v1/chat/completions": "openai-chat",
    "/chat/completions": "openai-chat",
    "/v1/responses": "openai-responses",
    "/responses": "openai-responses",
}


def _error_body(provider: str, message: str) -> dict[str, Any]:
    if provider == "anthropic":
        return {"type": "error", "error": {"type": "invalid_request_error", "message": message}}
    if provider == "gemini":
        return {"error": {"code": 400, "message": message, "status": "INVALID_ARGUMENT"}}
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}


def handle(state: StubState, path: str, body: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
    """Answer one request: (HTTP status, JSON body). Pure apart from ``state``."""
    path = path.split("?", 1)[0]
    gemini = _GEMINI_RE.match(path)
    provider = "gemini" if gemini else _ROUTES.get(path)
    if provider is None:
        return 404, {"error": {"message": f"no such endpoint {path}"}}
    model = gemini.group(1) if gemini else str(body.get("model", ""))
    try:
        problems = check_request(provider, body)
        if problems:
            raise Refused("; ".join(problems))
        if provider == "anthropic":
            reply = _anthropic(state, body)
        elif provider == "openai-chat":
            reply = _chat(state, body)
        elif provider == "openai-responses":
            reply = _responses(state, body)
        else:
            reply = _gemini(state, model, body)
    except Refused as exc:
        with state.lock:
            state.refused.append((provider, str(exc)))
        log.info("stub %s refused: %s", provider, exc)
        return 400, _error_body(provider, str(exc))
    except (KeyError, TypeError, AttributeError, IndexError) as exc:
        with state.lock:
            state.refused.append((provider, f"malformed request: {exc!r}"))
        return 400, _error_body(provider, f"malformed request: {exc!r}")
    with state.lock:
        state.requests.append((provider, model, dict(body)))
    return 200, reply


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"

    def do_POST(self) -> None:  # noqa: N802 (stdlib name)
        length = int(self.headers.get("Content-Length") or 0)
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except json.JSONDecodeError:
            status, reply = 400, {"error": {"message": "body is not JSON"}}
        else:
            status, reply = handle(self.server.state, self.path, body)
        data = json.dumps(reply).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (stdlib signature)
        log.debug("stub: " + format, *args)  # noqa: G003 (format is the format string)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int, state: StubState) -> None:
        super().__init__(("127.0.0.1", port), _Handler)
        self.state = state


@contextlib.contextmanager
def serve(port: int = 0, state: StubState | None = None) -> Iterator[tuple[str, StubState]]:
    """Run the stub on 127.0.0.1 in a thread; yield (base URL, state); stop on exit."""
    state = state or StubState()
    server = _Server(port, state)
    thread = threading.Thread(target=server.serve_forever, name="stub_provider", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", state
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m capsulefs.testing.stub_provider", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8765, help="TCP port on 127.0.0.1 (default 8765)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="stub_provider: %(message)s")
    server = _Server(args.port, StubState())
    print(f"stub provider on http://127.0.0.1:{server.server_address[1]} "
          "(Anthropic: base_url=URL; OpenAI: base_url=URL/v1)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
