"""The provider-neutral plan: pairing, windowing and the digest of what was dropped.

Rules:
  * The journal is never rewritten. A plan is computed from it afresh on every
    render, and depends only on the events and the target (provider, model).
  * ``model_switch``, ``note``, ``memory_edit``, ``workspace_update`` and
    unknown kinds are never dialogue; ``system`` events feed the system prompt.
  * Every tool call is answered, right after the assistant step that made it:
    by its result, or, if none was ever recorded (the machine died
    mid-call), by an explicit error result saying the call was interrupted.
    A result answers the latest open call with its id before it, so a server
    that reuses call ids (``call_0`` in every reply) still pairs each call
    with its own result.
  * A result whose call is not in the journal (or a second result for an
    answered call) is never sent as a tool result; it becomes a user note so
    nothing is silently lost.
  * The window keeps the newest *units* that fit. A unit is indivisible: one
    user message, or one assistant step together with the results of all the
    calls it made (parallel calls move together). Dropped units are replaced by
    one deterministic digest line (counts, tools used, time span).

Theory of operation:
  :func:`plan` walks the events once and produces :class:`Unit` objects whose
  ``items`` are small tuples (see ``USER``..``RESULT``). Provider modules turn
  items into their own JSON; :func:`fit` chooses how many trailing units to
  keep by the provider's counter, then checks the final body against the
  budget and drops more if the estimate was short, so the budget always holds
  by the counter that was used.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import CapsuleError
from ..events import (
    AssistantMessage,
    Event,
    ModelSwitch,
    Reasoning,
    Record,
    System,
    ToolCall,
    ToolResult,
    UserMessage,
)

# Item tags. An item is a tuple whose first element is one of these.
USER = 0  # (USER, text)
TEXT = 1  # (TEXT, text)                          assistant-visible text
THINK = 2  # (THINK, Reasoning)                    kept only for the exact model
CALL = 3  # (CALL, call_id, name, arguments)       ids and names already made safe
RESULT = 4  # (RESULT, call_id, name, content, is_error)

INTERRUPTED = (
    "interrupted: this tool call did not return (the machine running it "
    "stopped mid-call); no result was recorded. Re-run it if it is still needed."
)
NO_CONVERSATION = "(No conversation yet.)"
CONTINUES = "(The conversation so far begins with an assistant turn.)"

_SAFE_ID = re.compile(r"[A-Za-z0-9_-]{1,40}")
_SAFE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,63}")
_BAD_NAME_CHAR = re.compile(r"[^A-Za-z0-9_-]")


class RenderError(CapsuleError):
    """The journal cannot be rendered as asked (no target model, unknown provider...)."""


class BudgetTooSmall(RenderError):
    """Even the system prompt and the digest alone exceed the token budget."""


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

    items: list[tuple] = field(default_factory=list)
    user: int = 0  # user messages in it
    assistant: int = 0  # assistant messages in it
    tools: list[str] = field(default_factory=list)  # tool names called in it
    first: str | None = None  # time of its first record, if known
    last: str | None = None  # time of its last record, if known


@dataclass(slots=True)
class Plan:
    system: list[str]  # texts of system events, in journal order
    units: list[Unit]
    target: tuple[str, str] | None  # the last model_switch (provider, model), if any
    models: dict[str, str] = field(default_factory=dict)  # provider -> model of its last model_switch


def _events(journal: Iterable[Record | Event]) -> list[tuple[Event, str | None]]:
    """(event, time) pairs in journal order. Records are sorted by (clock, machine, seq)."""
    entries = list(journal)
    if entries and isinstance(entries[0], Record):
        if any(not isinstance(r, Record) for r in entries):
            raise RenderError("a journal is a list of records or a list of events, not both")
        entries.sort(key=lambda r: (r.clock, r.machine, r.seq))
        return [(r.event, r.time) for r in entries]
    if any(not isinstance(e, Event) for e in entries):
        raise RenderError("a journal is a list of records or a list of events, not both")
    return [(e, None) for e in entries]


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
    for i, (ev, _) in enumerate(pairs):
        t = type(ev)
        if t is ToolCall:
            open_calls.setdefault(ev.call_id, []).append(i)
        elif t is ToolResult:
            waiting = open_calls.get(ev.call_id)
            if waiting:
                answers[waiting.pop()] = ev  # type: ignore[assignment]
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


def plan(journal: Iterable[Record | Event]) -> Plan:
    """Pair calls with results and cut the journal into units (see module rules)."""
    pairs = _events(journal)
    answers, stray = _pair(pairs)

    system: list[str] = []
    units: list[Unit] = []
    target: tuple[str, str] | None = None
    models: dict[str, str] = {}
    seen_ids: dict[str, int] = {}  # raw call id -> times seen
    step: Unit | None = None  # the open assistant step
    pending: list[tuple[int, str, str]] = []  # (index, safe id, safe name) of its calls

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
        pending.clear()
        step = None

    for index, (ev, when) in enumerate(pairs):
        t = type(ev)
        if t is UserMessage or t is ToolResult:
            close_step()
            if t is UserMessage:
                units.append(Unit(items=[(USER, ev.text)], user=1, first=when, last=when))
            elif index in stray:
                why = stray[index]
                flag = " (error)" if ev.is_error else ""
                text = f"[tool output{flag} {why}, call id {ev.call_id}]\n{ev.content}"
                units.append(Unit(items=[(USER, text)], first=when, last=when))
            continue
        if t is AssistantMessage or t is ToolCall or t is Reasoning:
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
                pending.append((index, cid, name))
            continue
        if t is System:
            system.append(ev.text)
        elif t is ModelSwitch:
            target = (ev.provider, ev.model)
            models[ev.provider] = ev.model
    close_step()
    return Plan(system=system, units=units, target=target, models=models)


def digest(dropped: Sequence[Unit]) -> str:
    """One deterministic line summarising dropped units; makes no model call."""
    user = sum(u.user for u in dropped)
    assistant = sum(u.assistant for u in dropped)
    tools: dict[str, int] = {}
    for u in dropped:
        for name in u.tools:
            tools[name] = tools.get(name, 0) + 1
    calls = sum(tools.values())
    parts = [f"{user} user message{'s' * (user != 1)}", f"{assistant} assistant message{'s' * (assistant != 1)}"]
    parts.append(f"{calls} tool call{'s' * (calls != 1)}")
    text = "[Earlier conversation omitted to fit the context window: " + ", ".join(parts)
    if tools:
        shown = sorted(tools, key=lambda n: (-tools[n], n))[:12]
        more = f" and {len(tools) - 12} more" if len(tools) > 12 else ""
        text += " (tools used: " + ", ".join(f"{n} ×{tools[n]}" for n in shown) + more + ")"
    times = [t for u in dropped for t in (u.first, u.last) if t]
    if times:
        text += f"; from {min(times)} to {max(times)}"
    return text + ".]"


def lead_in(units: Sequence[Unit], dropped: Sequence[Unit]) -> list[tuple]:
    """The items that open the request: the digest, or a user opener if one is needed.

    Every request starts with a user turn (Anthropic and Gemini require it), and
    is never empty.
    """
    if dropped:
        return [(USER, digest(dropped))]
    if not units:
        return [(USER, NO_CONVERSATION)]
    if units[0].items[0][0] != USER:
        return [(USER, CONTINUES)]
    return []


def items_of(units: Sequence[Unit], dropped: Sequence[Unit]) -> list[tuple]:
    out = lead_in(units, dropped)
    for u in units:
        out.extend(u.items)
    return out


def fit(
    units: list[Unit],
    budget: int | None,
    build: Callable[[list[tuple]], dict[str, Any]],
    cost: Callable[[list[tuple]], int],
    count: Callable[[dict[str, Any]], int],
) -> tuple[dict[str, Any], int]:
    """Build the body from the newest units that fit ``budget``; return (body, kept).

    ``cost`` estimates what some items add to a body; the final body is
    always measured with ``count``: more units are dropped until it fits,
    then older units are taken back while it still fits.
    Raises :class:`BudgetTooSmall` if even the digest-only body is too big.
    """
    if budget is None:
        return build(items_of(units, ())), len(units)
    opener = [(USER, NO_CONVERSATION)]
    room = budget - (count(build(opener)) - cost(opener))  # what the conversation may use
    start = len(units)
    costs: dict[int, int] = {}
    while start > 0:
        c = costs[start - 1] = cost(units[start - 1].items)
        if c > room:
            break
        room -= c
        start -= 1
    room -= cost(lead_in(units[start:], units[:start]))
    if start > 0:  # the digest replaces what was dropped; make room for it
        room += cost(lead_in(units[start:], units[:start])) - cost(lead_in((), units))
        while start < len(units) and room < 0:
            room += costs[start]
            start += 1
    while True:
        body = build(items_of(units[start:], units[:start]))
        over = count(body) - budget
        if over <= 0:
            break
        if start == len(units):
            # the digest can outweigh a few short units: sending them all may still fit
            body = build(items_of(units, ()))
            if count(body) <= budget:
                return body, len(units)
            raise BudgetTooSmall(
                f"a budget of {budget} tokens cannot hold even the system prompt and the digest "
                f"({over + budget} tokens by this provider's counter)"
            )
        # drop at least enough estimated cost to cover the overshoot
        while start < len(units) and over > 0:
            over -= costs.get(start) or cost(units[start].items)
            start += 1
    # estimates round up; take back older units while the real count still fits
    while start > 0:
        bigger = build(items_of(units[start - 1 :], units[: start - 1]))
        if count(bigger) > budget:
            break
        body = bigger
        start -= 1
    if start > 0 and _all_may_fit(units, start, costs, cost, budget - count(body) + cost(lead_in((), units[:start]))):
        full = build(items_of(units, ()))
        if count(full) <= budget:
            return full, len(units)
    return body, len(units) - start


#: How much a unit's estimate may exceed what it really adds to a body: the
#: brackets of its own fragment, and the message wrapper it saves when it
#: merges into its neighbour's message (Anthropic, Gemini).
_UNIT_SLACK = 48


def _all_may_fit(units: list[Unit], start: int, costs: dict[int, int], cost: Callable, slack: int) -> bool:
    """True if the dropped units may weigh no more than the digest plus the slack left.

    Stops summing as soon as they clearly weigh more, so this stays cheap.
    """
    total = 0
    for i in range(start):
        total += costs.get(i) or cost(units[i].items)
        if total > slack + _UNIT_SLACK * (i + 1):
            return False
    return True
