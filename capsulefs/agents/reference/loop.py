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

Rules (each module of this package states its own: ports, tools, providers):
  * Every event goes through the journal port (:mod:`.ports`).
  * A tool call is journaled before it runs and its result after, so a call
    interrupted by a crash or a move is visible as dangling and is answered
    with an error on resume: never run twice silently, never lost.
  * SIGTERM asks the loop to stop at the next step boundary.
  * Tools cannot reach outside the sandbox (:mod:`.tools`).
  * A step that fails (no model chosen, the provider down or refusing, the
    newest message too large for the budget) is reported in one place,
    :meth:`Agent.report`: logged, and written to ``$CAPSULE_STATUS`` with
    when, the next retry and the command that fixes it where there is one
    (:func:`fix_for`), which the daemon shows in ``.control/status`` as
    ``run.problem`` and ``run.last_error`` until a step succeeds. The model
    is never called with a request that lacks the newest message.
  * ``read_file`` on an image or a PDF attaches it (:mod:`.tools`).
  * The run's secrets (named in ``$CAPSULE_SECRETS``) are for the provider
    SDKs only: the shell tool runs without them, and any tool result or
    error holding a secret's value is journaled with ``[secret NAME]`` in
    its place.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import time
from collections.abc import Callable, Sequence
from typing import Any

from capsulefs.core.journal import events as ev
from capsulefs.core.journal.record import Record
from capsulefs.core import render
from capsulefs.core.errors import CapsuleError
from capsulefs.core.fsutil import atomic_write
from capsulefs.core.capsule.spec import STATUS_ENV

from .ports import CapsuleDirPort, DirectPort, JournalPort
from .providers import ProviderClients
from .tools import TOOL_DEFS, ToolError, Toolbox

log = logging.getLogger(__name__)
POLL_SECONDS = 0.2


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
