"""The provider-neutral plan: the events paired and cut into units (the
window over them is :mod:`capsulefs.core.render._fit`'s).

Rules:
  * The journal is never rewritten. A plan is computed from it afresh on every
    render, and depends only on the events and the target (provider, model).
  * ``model_switch``, ``note``, ``memory_edit``, ``workspace_update`` and
    unknown kinds are never dialogue; the last ``tools`` event gives the
    tools offered (every request carries them). The system prompt is a projection, like
    working memory: the last ``system`` event's text. One that changes it
    after the conversation began leaves a marker there (:data:`SYSTEM_CHANGED`,
    a user-side note between units), so the turns before it read as having
    run under other instructions; the earlier texts are not sent.
  * Every tool call is answered, right after the assistant step that made it:
    by its result, or, if none was ever recorded (the machine died
    mid-call), by an explicit error result saying the call was interrupted.
    A result answers the latest open call with its id before it, so a server
    that reuses call ids (``call_0`` in every reply) still pairs each call
    with its own result.
  * A result whose call is not in the journal (or a second result for an
    answered call) is never sent as a tool result; it becomes a user note so
    nothing is silently lost.
  * A unit is indivisible: one user message, or one assistant step together
    with the results of all the calls it made (parallel calls move
    together). The window (:mod:`capsulefs.core.render._fit`) keeps the
    newest units that fit.

Theory of operation:
  :func:`plan` walks the events once and produces :class:`Unit` objects whose
  ``items`` are small tuples (see ``USER``..``RESULT``). Provider modules turn
  items into their own JSON.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..errors import CapsuleError
from ..journal.events import (
    AssistantMessage,
    Attachment,
    Event,
    ModelSwitch,
    Reasoning,
    System,
    ToolCall,
    ToolResult,
    ToolsOffered,
    UserMessage,
)
from ..journal.record import Record

# Item tags. An item is a tuple whose first element is one of these.
USER = 0  # (USER, text)
TEXT = 1  # (TEXT, text)                          assistant-visible text
THINK = 2  # (THINK, Reasoning)                    kept only for the exact model
CALL = 3  # (CALL, call_id, name, arguments)       ids and names already made safe
RESULT = 4  # (RESULT, call_id, name, content, is_error)
ATTACH = 5  # (ATTACH, Attachment, pages or None)         user side: after the results of its call, or the user's

#: One item of a unit: a tuple whose first member is one of the kinds above.
Item = tuple[Any, ...]

INTERRUPTED = (
    "interrupted: this tool call did not return (the machine running it "
    "stopped mid-call); no result was recorded. Re-run it if it is still needed."
)
NO_CONVERSATION = "(No conversation yet.)"
CONTINUES = "(The conversation so far begins with an assistant turn.)"
SYSTEM_CHANGED = ("[The system prompt was changed at this point of the conversation; "
                  "the one given now is the current version, and the turns before this ran under an earlier one.]")

_SAFE_ID = re.compile(r"[A-Za-z0-9_-]{1,40}")
_SAFE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,63}")
_BAD_NAME_CHAR = re.compile(r"[^A-Za-z0-9_-]")


class RenderError(CapsuleError):
    """The journal cannot be rendered as asked (no target model, unknown provider...)."""


class BudgetTooSmall(RenderError):
    """Even the system prompt and the digest alone exceed the token budget."""


class NewestTooLarge(BudgetTooSmall):
    """The newest unit (the message the model is to answer) does not fit the
    budget even alone: a request without it would ask about something else."""

    def __init__(self, message: str, *, unit_tokens: int, request_tokens: int, budget: int) -> None:
        super().__init__(message)
        self.unit_tokens = unit_tokens
        self.request_tokens = request_tokens
        self.budget = budget


def safe_call_id(raw: str, nth: int = 0) -> str:
    """A call id every provider accepts: kept if already safe, else a stable hash.

    ``nth`` > 0 marks a repeated id in the journal, which must get its own id.
    """
    if nth == 0 and _SAFE_ID.fullmatch(raw):
        return raw
    return "call_" + hashlib.sha256(f"{raw}\x00{nth}".encode()).hexdigest()[:24]


def safe_tool_name(raw: str) -> str:
    """A function name every provider accepts (letters, digits, _ and -, ≤ 64)."""
    if _SAFE_NAME.fullmatch(raw):
        return raw
    name = _BAD_NAME_CHAR.sub("_", raw)
    if not (name[0].isascii() and (name[0].isalpha() or name[0] == "_")):
        name = "_" + name
    return name[:64]


@dataclass(slots=True)
class Unit:
    """An indivisible piece of the conversation, with what the digest needs."""

    items: list[Item] = field(default_factory=list)
    user: int = 0  # user messages in it
    assistant: int = 0  # assistant messages in it
    tools: list[str] = field(default_factory=list)  # tool names called in it
    first: str | None = None  # time of its first record, if known
    last: str | None = None  # time of its last record, if known


@dataclass(slots=True)
class Plan:
    system: list[str]  # the current system prompt (the last system event's text), or none
    units: list[Unit]
    target: tuple[str, str] | None  # the last model_switch (provider, model), if any
    models: dict[str, str] = field(default_factory=dict)  # provider -> model of its last model_switch
    tools: list[dict[str, Any]] | None = None  # the last ``tools`` event's definitions, if any
    attachments: bool = False  # whether any unit holds an attachment


def _events(journal: Iterable[Record | Event]) -> list[tuple[Event, str | None]]:
    """(event, time) pairs in journal order. Records are sorted by (clock, machine, seq)."""
    entries = list(journal)
    if entries and isinstance(entries[0], Record):
        records = [r for r in entries if isinstance(r, Record)]
        if len(records) != len(entries):
            raise RenderError("a journal is a list of records or a list of events, not both")
        records.sort(key=lambda r: (r.clock, r.machine, r.seq))
        return [(r.event, r.time) for r in records]
    events = [e for e in entries if isinstance(e, Event)]
    if len(events) != len(entries):
        raise RenderError("a journal is a list of records or a list of events, not both")
    return [(e, None) for e in events]


def _pair(pairs: list[tuple[Event, str | None]]) -> tuple[dict[int, ToolResult], dict[int, str]]:
    """Which result answers which call, by position in ``pairs``.

    A result answers the latest call with its id that precedes it and is
    still open: servers that number their calls per response (``call_0``
    in every reply) reuse ids, and each reuse is its own call. A result
    whose id no call before it had is taken by the earliest open call with
    its id after it (journals merged out of causal order); one whose calls
    before it are all answered repeats an answer, and never takes a later
    call (a reused id's call that a crash cut off stays interrupted). What
    is left over is a stray, with the reason it is one.
    """
    answers: dict[int, ToolResult] = {}  # index of a call -> its result
    open_calls: dict[str, list[int]] = {}  # call id -> indices of its calls still unanswered
    early: list[int] = []  # results whose id no call before them had
    stray: dict[int, str] = {}
    ev: Any  # dispatched on its exact type, t (mypy does not narrow ``t is ToolCall``)
    for i, (ev, _) in enumerate(pairs):
        t = type(ev)
        if t is ToolCall:
            open_calls.setdefault(ev.call_id, []).append(i)
        elif t is ToolResult:
            waiting = open_calls.get(ev.call_id)
            if waiting:
                answers[waiting.pop()] = ev
            elif waiting is None:
                early.append(i)
            else:
                stray[i] = "repeating an answered call"
    for i in early:
        waiting = open_calls.get(pairs[i][0].call_id)  # type: ignore[attr-defined]
        if waiting:
            answers[waiting.pop(0)] = pairs[i][0]  # type: ignore[assignment]
        else:
            stray[i] = "with no matching call"
    return answers, stray


def plan(journal: Iterable[Record | Event], pages: Callable[[str], int | None] | None = None) -> Plan:
    """Pair calls with results and cut the journal into units (see module rules).
    ``pages`` tells a PDF blob's page count (for its tokens), if known."""
    pairs = _events(journal)
    answers, stray = _pair(pairs)

    system: list[str] = []
    units: list[Unit] = []
    target: tuple[str, str] | None = None
    models: dict[str, str] = {}
    tools: list[dict[str, Any]] | None = None
    seen_ids: dict[str, int] = {}  # raw call id -> times seen
    step: Unit | None = None  # the open assistant step
    pending: list[tuple[int, str, str]] = []  # (index, safe id, safe name) of its calls
    step_files: list[Item] = []  # attachments of its calls' results
    call_unit: dict[str, Unit] = {}  # raw call id -> the step unit of its latest call
    user_unit: Unit | None = None  # the user-side unit still taking attachments and a message

    def close_step() -> None:
        nonlocal step
        if step is None:
            return
        for index, cid, name in pending:
            res = answers.get(index)
            if res is None:
                step.items.append((RESULT, cid, name, INTERRUPTED, True))
            else:
                step.items.append((RESULT, cid, name, res.content, res.is_error))
        step.items.extend(step_files)
        step_files.clear()
        pending.clear()
        step = None

    ev: Any  # dispatched on its exact type, t (mypy does not narrow ``t is ToolCall``)
    for index, (ev, when) in enumerate(pairs):
        t = type(ev)
        if t is Attachment:
            item = (ATTACH, ev, pages(ev.blob) if pages is not None and ev.media_type == "application/pdf" else None)
            owner = call_unit.get(ev.call_id) if ev.call_id is not None else None
            if owner is not None:  # with its call's results
                if owner is step:
                    step_files.append(item)
                else:
                    owner.items.append(item)
                continue
            close_step()
            if user_unit is None:
                user_unit = Unit(first=when)
                units.append(user_unit)
            user_unit.items.append(item)
            user_unit.last = when
            continue
        if t is UserMessage or t is ToolResult:
            close_step()
            if t is UserMessage:
                if user_unit is not None and not user_unit.user:  # the attachments it came with
                    user_unit.items.append((USER, ev.text))
                    user_unit.user, user_unit.last = 1, when
                else:
                    user_unit = Unit(items=[(USER, ev.text)], user=1, first=when, last=when)
                    units.append(user_unit)
            else:
                user_unit = None
            if t is ToolResult and index in stray:
                why = stray[index]
                flag = " (error)" if ev.is_error else ""
                text = f"[tool output{flag} {why}, call id {ev.call_id}]\n{ev.content}"
                units.append(Unit(items=[(USER, text)], first=when, last=when))
            continue
        if t is AssistantMessage or t is ToolCall or t is Reasoning:
            user_unit = None
            if step is None:
                step = Unit(first=when)
                units.append(step)
            step.last = when
            if t is AssistantMessage:
                step.items.append((TEXT, ev.text))
                step.assistant += 1
            elif t is Reasoning:
                step.items.append((THINK, ev))
            else:
                nth = seen_ids.get(ev.call_id, 0)
                seen_ids[ev.call_id] = nth + 1
                cid = safe_call_id(ev.call_id, nth)
                name = safe_tool_name(ev.name)
                step.items.append((CALL, cid, name, ev.arguments))
                step.tools.append(ev.name)
                call_unit[ev.call_id] = step
                pending.append((index, cid, name))
            continue
        if t is System:
            if (system[0] if system else "") == ev.text:
                continue  # the same prompt again (a blank one where there was none: no prompt still)
            if units:  # a change mid-conversation: the old prompt goes, its place is marked
                close_step()
                units.append(Unit(items=[(USER, SYSTEM_CHANGED)], first=when, last=when))
                user_unit = None
            system[:] = [ev.text]
        elif t is ModelSwitch:
            target = (ev.provider, ev.model)
            models[ev.provider] = ev.model
        elif t is ToolsOffered:
            tools = [dict(x) for x in ev.tools]
    close_step()
    return Plan(system=system, units=units, target=target, models=models, tools=tools,
                attachments=any(type(e) is Attachment for e, _ in pairs))
