"""The reference agent: ``capsulefs agent``, the default entrypoint of a spec.

Theory of operation: a loop of steps, each ending at a journal append, so
the agent can be stopped between any two of them and resumed anywhere:

  1. Read the journal. Calls left without a result by an earlier run (the
     process was killed or moved mid-call) get an explicit error result.
  2. If the conversation waits on the model (its last dialogue event is a
     user message or a tool result), journal the tools it offers (a
     ``tools`` event, when they differ from the last), render the journal for the current
     provider and model (``.control/model``, i.e. the last model_switch),
     call the provider through its official SDK, and journal the reply:
     reasoning with its signature, text, tool calls.
  3. Run the tool calls in the sandbox (the working directory) and journal
     each result. Then repeat; with nothing to do, wait for new events.

Rules:
  * Every event goes through the journal port: appended as draft lines to
    ``$CAPSULE_DIR/memory/timeline_events.jsonl`` (the mount stamps them),
    or, outside a mount, through the journal API with ``$CAPSULE_MACHINE``.
  * A tool call is journaled before it runs and its result after, so a call
    interrupted by a crash or a move is visible as dangling and is answered
    with an error on resume: never run twice silently, never lost.
  * SIGTERM asks the loop to stop at the next step boundary.
  * Tools cannot reach outside the sandbox: paths are resolved and checked.
  * A step that fails (no model chosen, the provider down or refusing, the
    newest message too large for the budget) is reported in one place,
    :meth:`Agent.report`: logged, and written to ``$CAPSULE_STATUS`` with
    when, the next retry and the command that fixes it where there is one
    (:func:`fix_for`), which the daemon shows in ``.control/status`` as
    ``run.problem`` and ``run.last_error`` until a step succeeds. The model is never called with a request that lacks the
    newest message.
  * ``read_file`` on an image or a PDF (told by its first bytes, never its
    name) attaches it: the bytes are stored as a blob of the capsule
    (``artifacts/blobs/<sha256>``; through the mount, an upload checked at
    close), then an ``attachment`` event with the call's id is journaled
    with its result, in one append, so the next request shows it to the model.
  * The run's secrets (named in ``$CAPSULE_SECRETS``) are for the provider
    SDKs only: the shell tool runs without them, and any tool result or
    error holding a secret's value is journaled with ``[secret NAME]`` in
    its place.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from capsulefs.core.journal import events as ev
from capsulefs.core.journal.record import Record
from capsulefs.core.capsule import format as fmt
from capsulefs.core import render
from capsulefs.core.errors import CapsuleError
from capsulefs.core.fsutil import atomic_write
from capsulefs.core.capsule.spec import SECRETS_ENV, STATUS_ENV, redact_secrets, secrets_in

log = logging.getLogger(__name__)

MAX_TOOL_OUTPUT = 16_000
SHELL_TIMEOUT = 30.0
POLL_SECONDS = 0.2

TOOLS = (
    render.ToolSpec(
        name="read_file",
        description="Read a text file of the workspace; an image or a PDF is attached for you to see.",
        parameters={"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    ),
    render.ToolSpec(
        name="write_file",
        description="Create or replace a file of the workspace.",
        parameters={
            "type": "object",
            "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
            "required": ["path", "content"],
        },
    ),
    render.ToolSpec(
        name="shell",
        description="Run a shell command in the workspace; its output is returned.",
        parameters={
            "type": "object",
            "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}},
            "required": ["command"],
        },
    ),
    render.ToolSpec(
        name="recall",
        description="Search this agent's own history and working memory.",
        parameters={
            "type": "object",
            "properties": {"query": {"type": "string"}, "k": {"type": "integer"}},
            "required": ["query"],
        },
    ),
)


#: The tools as the journal's ``tools`` event records them.
TOOL_DEFS: list[Mapping[str, Any]] = [{"name": t.name, "description": t.description, "parameters": dict(t.parameters)} for t in TOOLS]


# -- what to do next (pure) ---------------------------------------------------------


def offered_tools(records: Sequence[Record]) -> list[dict[str, Any]] | None:
    """The definitions of the journal's last ``tools`` event, or None."""
    for r in reversed(records):
        if isinstance(r.event, ev.ToolsOffered):
            return [dict(t) for t in r.event.tools]
    return None


def dangling_calls(records: Sequence[Record]) -> list[ev.ToolCall]:
    answered = {r.event.call_id for r in records if isinstance(r.event, ev.ToolResult)}
    return [r.event for r in records if isinstance(r.event, ev.ToolCall) and r.event.call_id not in answered]


def waits_on_model(records: Sequence[Record]) -> bool:
    """True when the last dialogue event asks the model to speak."""
    for r in reversed(records):
        e = r.event
        if isinstance(e, (ev.UserMessage, ev.ToolResult)):
            return True
        if isinstance(e, (ev.AssistantMessage, ev.ToolCall, ev.Reasoning)):
            return False
    return False


def current_target(records: Sequence[Record]) -> tuple[str, str] | None:
    for r in reversed(records):
        if isinstance(r.event, ev.ModelSwitch):
            return r.event.provider, r.event.model
    return None


# -- the journal port -------------------------------------------------------------------


class JournalPort(Protocol):
    def records(self) -> list[Record]: ...

    def append(self, events: Sequence[ev.Event]) -> None: ...

    def working_memory(self) -> str: ...

    def size(self) -> int: ...

    def read_blob(self, sha256: str) -> bytes: ...

    def put_blob(self, data: bytes) -> str: ...


class CapsuleDirPort:
    """The agent's capsule directory in a capsulefs mount: appends are draft lines."""

    def __init__(self, capsule_dir: str) -> None:
        self.dir = capsule_dir
        self.journal = os.path.join(capsule_dir, fmt.JOURNAL)

    def records(self) -> list[Record]:
        with open(self.journal, "rb") as f:
            data = f.read()
        return [Record.from_line(line) for line in data.split(b"\n") if line]

    def append(self, events: Sequence[ev.Event]) -> None:
        lines = b"".join(ev.canonical_json({"kind": e.kind, **e.payload()}) + b"\n" for e in events)
        fd = os.open(self.journal, os.O_WRONLY | os.O_APPEND)
        try:
            view = memoryview(lines)
            while view:
                n = os.write(fd, view)
                view = view[n:]
        finally:
            os.close(fd)

    def working_memory(self) -> str:
        with open(os.path.join(self.dir, fmt.WORKING_MEMORY), encoding="utf-8", errors="replace") as f:
            return f.read()

    def size(self) -> int:
        return os.stat(self.journal).st_size

    def read_blob(self, sha256: str) -> bytes:
        """An attachment's bytes, as the capsule serves them."""
        with open(os.path.join(self.dir, fmt.blob_path(sha256)), "rb") as f:
            return f.read()

    def put_blob(self, data: bytes) -> str:
        """Store ``data`` as a blob of the capsule; its sha256. Through the
        mount: written to ``artifacts/blobs/<sha256>``, which the close
        checks and stores (OSError if refused, e.g. EFBIG past the limit)."""
        sha = hashlib.sha256(data).hexdigest()
        try:
            fd = os.open(os.path.join(self.dir, fmt.blob_path(sha)), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o444)
        except FileExistsError:
            return sha  # the capsule has it already
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # (the mount checks and stores the blob here)
        return sha


class DirectPort(CapsuleDirPort):
    """A capsule directory outside any mount: stamps events itself as ``machine``."""

    def __init__(self, capsule_dir: str, machine: str) -> None:
        super().__init__(capsule_dir)
        import secrets

        from capsulefs.core.journal.file import open_journal

        self._j = open_journal(
            self.journal, machine=machine, now=time.time, new_id=lambda: secrets.token_hex(12),
            recovery_dir=os.path.join(os.path.dirname(capsule_dir), ".recovery"),
        )

    def append(self, events: Sequence[ev.Event]) -> None:
        self._j.append_many(events)

    def put_blob(self, data: bytes) -> str:
        sha = hashlib.sha256(data).hexdigest()
        path = os.path.join(self.dir, fmt.blob_path(sha))
        if not os.path.exists(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            atomic_write(path, data, mode=0o444)
        return sha


# -- tools ----------------------------------------------------------------------------------


class ToolError(Exception):
    pass


@dataclass(frozen=True)
class ToolOutput:
    """What a tool returns: its text, and files to show the model."""

    text: str
    files: tuple[tuple[str, str, bytes], ...] = ()  # (name, media type, bytes) to attach


@dataclass
class Toolbox:
    root: str  # the sandbox workspace
    capsule_dir: str
    shell_timeout: float = SHELL_TIMEOUT
    # name -> value of the run's secrets: kept from the shell, redacted from results
    secrets: dict[str, str] = field(default_factory=lambda: secrets_in(os.environ))

    def _path(self, rel: object) -> str:
        if not isinstance(rel, str) or not rel:
            raise ToolError("path must be a non-empty string")
        full = os.path.realpath(os.path.join(self.root, rel))
        root = os.path.realpath(self.root)
        if full != root and not full.startswith(root + os.sep):
            raise ToolError(f"{rel} is outside the workspace")
        return full

    def run(self, name: str, args: Mapping[str, Any]) -> str:
        return self.call(name, args).text

    def call(self, name: str, args: Mapping[str, Any]) -> ToolOutput:
        """Run a tool; its text has the run's secrets redacted (ToolError if it failed)."""
        fn = getattr(self, f"tool_{name}", None)
        if fn is None:
            raise ToolError(f"unknown tool {name!r}")
        try:
            out = fn(args)
        except ToolError as exc:
            raise ToolError(redact_secrets(str(exc), self.secrets)) from None
        if isinstance(out, str):
            out = ToolOutput(out)
        return ToolOutput(redact_secrets(out.text, self.secrets), out.files)

    def tool_read_file(self, args: Mapping[str, Any]) -> str | ToolOutput:
        path = self._path(args.get("path"))
        rel = str(args.get("path"))
        try:
            with open(path, "rb") as f:
                media_type = render.sniff_media_type(f.read(16))
                if media_type is not None:
                    f.seek(0)
                    data = f.read(render.MAX_ATTACHMENT + 1)
                    if len(data) > render.MAX_ATTACHMENT:
                        raise ToolError(f"{rel} is a {media_type} file larger than {render.MAX_ATTACHMENT} bytes, "
                                        f"the most any provider takes: not attached")
                    return ToolOutput(f"{rel}: {media_type}, {len(data)} bytes, attached",
                                      ((os.path.basename(path), media_type, data),))
            with open(path, encoding="utf-8", errors="replace") as f:
                return f.read(MAX_TOOL_OUTPUT)
        except OSError as exc:
            raise ToolError(f"cannot read {rel}: {exc.strerror}") from None

    def tool_write_file(self, args: Mapping[str, Any]) -> str:
        path = self._path(args.get("path"))
        content = args.get("content")
        if not isinstance(content, str):
            raise ToolError("content must be a string")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = path + ".tmp-agent"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return f"wrote {len(content.encode())} bytes to {args['path']}"

    def tool_shell(self, args: Mapping[str, Any]) -> str:
        cmd = args.get("command")
        if not isinstance(cmd, str) or not cmd:
            raise ToolError("command must be a non-empty string")
        timeout = float(args.get("timeout") or self.shell_timeout)
        try:
            env = {k: v for k, v in os.environ.items() if k not in self.secrets and k != SECRETS_ENV}
            proc = subprocess.run(["/bin/sh", "-c", cmd], cwd=self.root, env=env, capture_output=True,
                                  timeout=min(timeout, 600))
        except subprocess.TimeoutExpired:
            raise ToolError(f"the command timed out after {timeout:.0f} s") from None
        out = (proc.stdout + proc.stderr).decode(errors="replace")[-MAX_TOOL_OUTPUT:]
        return f"exit status {proc.returncode}\n{out}"

    def tool_recall(self, args: Mapping[str, Any]) -> str:
        from capsulefs.core.semantic.index import search_capsule

        query = args.get("query")
        if not isinstance(query, str) or not query:
            raise ToolError("query must be a non-empty string")
        k = int(args.get("k") or 5)
        try:  # the index brought up to date is saved (atomically, through the mount), so the next start has it
            hits = search_capsule(self.capsule_dir, query, k, save=True)
        except OSError as exc:  # (frozen by a move, read-only, or larger than the mount takes): searched unsaved
            log.warning("recall: the semantic index could not be saved (%s); searching without saving", exc)
            hits = search_capsule(self.capsule_dir, query, k, save=False)
        return "\n".join(f"[{h.kind} {h.event} {h.time}] {h.snippet}" for h in hits) or "no matches"


# -- calling the provider -----------------------------------------------------------------------


def _dump(obj: Any) -> dict[str, Any]:
    return obj.model_dump(mode="json", exclude_none=True) if hasattr(obj, "model_dump") else dict(obj)


class ProviderClients:
    """The official SDK clients, made once per process.

    Keys and endpoints come from the SDKs' own environment variables
    (ANTHROPIC_API_KEY / ANTHROPIC_BASE_URL, OPENAI_API_KEY / OPENAI_BASE_URL),
    and GEMINI_API_KEY / GEMINI_BASE_URL for google-genai.
    """

    def __init__(self) -> None:
        self._clients: dict[str, Any] = {}

    def _client(self, name: str) -> Any:
        if name not in self._clients:
            if name == "anthropic":
                import anthropic

                self._clients[name] = anthropic.Anthropic(max_retries=2)
            elif name == "openai":
                import openai

                self._clients[name] = openai.OpenAI(max_retries=2)
            else:
                from google import genai
                from google.genai import types as gt

                base = os.environ.get("GEMINI_BASE_URL")
                opts = gt.HttpOptions(base_url=base, api_version="v1beta") if base else None
                self._clients[name] = genai.Client(api_key=os.environ.get("GEMINI_API_KEY"), http_options=opts)
        return self._clients[name]

    def __call__(self, provider: str, model: str, body: dict[str, Any]) -> dict[str, Any]:
        """Send one rendered body; return the reply as the provider's JSON."""
        if provider == "anthropic":
            return _dump(self._client("anthropic").messages.create(**body))
        if provider == "openai-chat":
            return _dump(self._client("openai").chat.completions.create(**body))
        if provider == "openai-responses":
            return _dump(self._client("openai").responses.create(**body))
        if provider == "gemini":
            return self._gemini(model, body)
        raise CapsuleError(f"the reference agent cannot call provider {provider!r}")

    def _gemini(self, model: str, body: dict[str, Any]) -> dict[str, Any]:
        import json as _json

        from google.genai import types as gt

        def typed(cls: Any, obj: Any) -> Any:  # REST JSON -> the SDK's typed objects
            return cls.model_validate_json(_json.dumps(obj))

        config = gt.GenerateContentConfig(
            system_instruction=typed(gt.Content, body["systemInstruction"]) if "systemInstruction" in body else None,
            tools=[typed(gt.Tool, t) for t in body.get("tools", ())] or None,
            max_output_tokens=body.get("generationConfig", {}).get("maxOutputTokens"),
            automatic_function_calling=gt.AutomaticFunctionCallingConfig(disable=True),
        )
        reply = self._client("gemini").models.generate_content(
            model=model, contents=[typed(gt.Content, c) for c in body["contents"]], config=config)
        return reply.model_dump(mode="json", exclude_none=True, by_alias=True)


# -- what fixes a failed step --------------------------------------------------------------------------

#: The prefix of each provider's SDK variables (``..._API_KEY``, ``..._BASE_URL``).
_VARS = {"anthropic": "ANTHROPIC", "openai-chat": "OPENAI", "openai-responses": "OPENAI", "gemini": "GEMINI"}
EXAMPLE_MODEL = "anthropic:claude-sonnet-4-5"


def fix_for(exc: BaseException, provider: str | None, *, capsule_dir: str, agent_id: str) -> str | None:
    """The one command that fixes a failed step, where there is one: a model
    to choose, a key to set and grant, an endpoint to correct."""
    text = str(exc).lower()
    name = type(exc).__name__
    model_file = os.path.join(capsule_dir, ".control", "model")
    if provider is None or provider not in _VARS:  # no model chosen, or one no SDK here calls
        if "no model chosen" in text or "provider" in text:
            return f"echo {EXAMPLE_MODEL} > {shlex.quote(model_file)}"  # (any of _VARS' providers)
        return None
    var = _VARS[provider]
    spec = os.path.join(capsule_dir, "environment", "spec.json")
    if name in ("AuthenticationError", "PermissionDeniedError") or "api_key" in text or "api key" in text \
            or "authentication" in text:
        return f"capsulefs secret set {var}_API_KEY && capsulefs secret grant {agent_id} {var}_API_KEY"
    if name in ("APIConnectionError", "APITimeoutError", "ConnectError", "ConnectTimeout") or "connect" in text:
        now = os.environ.get(f"{var}_BASE_URL") or "unset: the provider's public endpoint"
        return f"set {var}_BASE_URL in the env of {spec} to an address this host reaches (now {now})"
    if name == "NotFoundError" or "not found" in text or "model" in text and "does not exist" in text:
        return f"echo {provider}:MODEL > {shlex.quote(model_file)}"
    return None


# -- the loop ------------------------------------------------------------------------------------------


class Agent:
    def __init__(self, port: JournalPort, tools: Toolbox, *,
                 call: Callable[[str, str, dict[str, Any]], dict[str, Any]] | None = None,
                 default_target: tuple[str, str] | None = None, budget: int | None = None,
                 status_file: str | None = None, capsule_dir: str = "AGENT", agent_id: str = "AGENT") -> None:
        self.port, self.tools = port, tools
        self.call = call if call is not None else ProviderClients()
        self.default_target = default_target
        self.budget = budget
        self.status_file = status_file
        self.problem: str | None = None  # the last step's failure, None once a step succeeded
        self.capsule_dir, self.agent_id = capsule_dir, agent_id  # (for the commands a report names)
        self.provider: str | None = None  # the provider of the step under way
        self.stopping = False

    def report(self, problem: str | None, *, retry_in: float | None = None, fix: str | None = None) -> None:
        """Say how the last step went: the one place a step's failure is
        reported (logged, and written to the status file the daemon shows
        as ``run.problem`` and ``run.last_error``: what, when, the next
        retry, the fix); None clears it once a step succeeds."""
        if problem is None and self.problem is None:
            return
        if problem != self.problem and problem is not None:
            log.error("step failed: %s%s", problem, f" (fix: {fix})" if fix else "")
        self.problem = problem
        if self.status_file is None:
            return
        try:
            if problem is None:
                os.unlink(self.status_file)
            else:
                now = time.time()
                doc = {"problem": problem, "at": now, "fix": fix,
                       "retry_at": None if retry_in is None else now + retry_in}
                atomic_write(self.status_file, json.dumps(doc).encode(), mode=0o600)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("cannot write the status file %s: %s", self.status_file, exc)

    def answer_interrupted(self) -> int:
        """Journal an error result for every call an earlier run left dangling."""
        dangling = dangling_calls(self.port.records())
        if dangling:
            self.port.append([
                ev.ToolResult(call_id=c.call_id, content=render.INTERRUPTED, is_error=True) for c in dangling
            ])
        return len(dangling)

    def step(self) -> bool:
        """One model turn and its tool calls. False if there was nothing to do."""
        records = self.port.records()
        if not waits_on_model(records):
            return False
        target = current_target(records) or self.default_target
        if target is None:
            raise CapsuleError("no model chosen: write provider:model to .control/model")
        provider, model = target
        self.provider = provider
        if offered_tools(records) != TOOL_DEFS:  # the journal says what the requests offer
            self.port.append([ev.ToolsOffered(tools=TOOL_DEFS)])
            records = self.port.records()
        rendered = render.render(records, provider=provider, model=model, working_memory=self.port.working_memory(),
                                 budget=self.budget, read_blob=self.port.read_blob)
        reply = self.call(provider, model, rendered.body)
        events = render.parse_response(provider, reply, model=model)
        self.port.append(events)  # the calls are journaled before they run
        for call in [e for e in events if isinstance(e, ev.ToolCall)]:
            if self.stopping:
                break  # left dangling; answered as interrupted on resume
            try:
                out = self.tools.call(call.name, call.arguments)
                attached = [self.attach(call.call_id, *f) for f in out.files]
                text, is_error = out.text, False
            except ToolError as exc:
                attached, text, is_error = [], str(exc), True
            # one append: the attachment never without its result, nor the result without it
            self.port.append([*attached, ev.ToolResult(call_id=call.call_id, content=text, is_error=is_error)])
        return True

    def attach(self, call_id: str, name: str, media_type: str, data: bytes) -> ev.Attachment:
        """Store a file a tool attaches as a blob of the capsule; the event that shows it."""
        try:
            sha = self.port.put_blob(data)
        except OSError as exc:
            raise ToolError(f"cannot attach {name}: {exc.strerror or exc}") from None
        return ev.Attachment(blob=sha, media_type=media_type, size=len(data), name=name, call_id=call_id)

    def attempt(self, retry_in: float | None = None) -> bool | None:
        """One :meth:`step`, its outcome reported (:meth:`report`, with the
        wait before the next try): True if it did something, False if there
        was nothing to do, None if it failed."""
        self.provider = None
        try:
            stepped = self.step()
        except Exception as exc:  # noqa: BLE001 - the loop must survive any provider failure
            self.report(str(exc) or type(exc).__name__, retry_in=retry_in,
                        fix=fix_for(exc, self.provider, capsule_dir=self.capsule_dir, agent_id=self.agent_id))
            return None
        if stepped:
            self.report(None)
        return stepped

    def run_forever(self, poll: float = POLL_SECONDS, retry_max: float = 60.0) -> None:
        """Step until stopped. A failed step (no model chosen, provider down,
        a refused request) is logged and retried when the journal changes or
        after a backoff; it never crashes the loop."""
        self.answer_interrupted()
        backoff = 1.0
        while not self.stopping:
            size = self.port.size()
            stepped = self.attempt(retry_in=backoff)
            if stepped:
                backoff = 1.0
                continue
            wait = None
            if stepped is None:
                wait, backoff = backoff, min(backoff * 2, retry_max)
            deadline = None if wait is None else time.monotonic() + wait
            while not self.stopping and self.port.size() == size:
                if deadline is not None and time.monotonic() >= deadline:
                    break
                time.sleep(poll)


def main(args: Any = None) -> int:
    capsule_dir = os.environ.get("CAPSULE_DIR")
    if not capsule_dir:
        raise CapsuleError("CAPSULE_DIR is not set: the reference agent runs under the capsulefs daemon")
    machine = os.environ.get("CAPSULE_MACHINE")
    port: JournalPort = DirectPort(capsule_dir, machine) if machine else CapsuleDirPort(capsule_dir)
    default = os.environ.get("CAPSULE_MODEL")
    target = tuple(default.split(":", 1)) if default and ":" in default else None
    budget = int(os.environ["CAPSULE_BUDGET"]) if os.environ.get("CAPSULE_BUDGET") else None
    agent = Agent(port, Toolbox(os.getcwd(), capsule_dir), default_target=target, budget=budget,  # type: ignore[arg-type]
                  status_file=os.environ.get(STATUS_ENV) or None, capsule_dir=capsule_dir,
                  agent_id=os.environ.get("CAPSULE_AGENT_ID") or "AGENT")

    def stop(_sig: int, _frame: object) -> None:
        agent.stopping = True

    signal.signal(signal.SIGTERM, stop)
    logging.basicConfig(level=logging.INFO, format="capsulefs agent: %(levelname)s: %(message)s")
    agent.run_forever()
    return 0
