"""The window: which units of a plan fit the budget, and the digest of those
dropped.

Rules:
  * The window keeps the newest *units* that fit. A unit is indivisible: one
    user message, or one assistant step together with the results of all the
    calls it made (parallel calls move together). Dropped units are replaced by
    one deterministic digest line (counts, tools used, time span).

Theory of operation:
  :func:`fit` chooses how many trailing units to keep by the provider's
  counter, then checks the final body against the budget and drops more if
  the estimate was short, so the budget always holds by the counter that
  was used. The digest of the dropped units is one line, the same for the
  same units (counts, tools used, time span): no model call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ._plan import ATTACH, CONTINUES, NO_CONVERSATION, USER, BudgetTooSmall, Item, NewestTooLarge, Unit


def _digest_text(user: int, assistant: int, tools: dict[str, int], first: str | None, last: str | None) -> str:
    calls = sum(tools.values())
    parts = [f"{user} user message{'s' * (user != 1)}", f"{assistant} assistant message{'s' * (assistant != 1)}"]
    parts.append(f"{calls} tool call{'s' * (calls != 1)}")
    text = "[Earlier conversation omitted to fit the context window: " + ", ".join(parts)
    counted = {n: c for n, c in tools.items() if c}
    if counted:
        shown = sorted(counted, key=lambda n: (-counted[n], n))[:12]
        more = f" and {len(counted) - 12} more" if len(counted) > 12 else ""
        text += " (tools used: " + ", ".join(f"{n} ×{counted[n]}" for n in shown) + more + ")"
    if first is not None and last is not None:
        text += f"; from {first} to {last}"
    return text + ".]"


def digest(dropped: Sequence[Unit]) -> str:
    """One deterministic line summarising dropped units; makes no model call."""
    tools: dict[str, int] = {}
    for u in dropped:
        for name in u.tools:
            tools[name] = tools.get(name, 0) + 1
    times = [t for u in dropped for t in (u.first, u.last) if t]
    return _digest_text(sum(u.user for u in dropped), sum(u.assistant for u in dropped), tools,
                        min(times) if times else None, max(times) if times else None)


class _Digests:
    """``digest(units[:start])`` for any ``start``, each in time proportional
    to how far ``start`` moved since the last one: the fitter tries starts
    next to each other, and the dropped part can be most of a long journal."""

    def __init__(self, units: Sequence[Unit]) -> None:
        self.units = units
        self.at = 0  # the counts below are of units[:at]
        self.user = self.assistant = 0
        self.tools: dict[str, int] = {}
        self.cache: dict[int, str] = {}
        self.lo: list[str | None] | None = None  # lo[i], hi[i]: earliest, latest time in units[:i]
        self.hi: list[str | None] = []

    def _times(self) -> None:
        lo: list[str | None] = [None]
        hi: list[str | None] = [None]
        for u in self.units:
            a, b = lo[-1], hi[-1]
            for t in (u.first, u.last):
                if t:
                    a = t if a is None or t < a else a
                    b = t if b is None or t > b else b
            lo.append(a)
            hi.append(b)
        self.lo, self.hi = lo, hi

    def __call__(self, start: int) -> str:
        text = self.cache.get(start)
        if text is not None:
            return text
        tools = self.tools
        while self.at < start:
            u = self.units[self.at]
            self.user += u.user
            self.assistant += u.assistant
            for name in u.tools:
                tools[name] = tools.get(name, 0) + 1
            self.at += 1
        while self.at > start:
            self.at -= 1
            u = self.units[self.at]
            self.user -= u.user
            self.assistant -= u.assistant
            for name in u.tools:
                tools[name] -= 1
        if self.lo is None:
            self._times()
        assert self.lo is not None
        text = self.cache[start] = _digest_text(self.user, self.assistant, tools, self.lo[start], self.hi[start])
        return text


def lead_in(units: Sequence[Unit], dropped: Sequence[Unit], summary: str | None = None) -> list[Item]:
    """The items that open the request: the digest, or a user opener if one is needed.

    Every request starts with a user turn (Anthropic and Gemini require it), and
    is never empty. ``summary`` is the digest of ``dropped``, if already made.
    """
    if dropped:
        return [(USER, summary if summary is not None else digest(dropped))]
    if not units:
        return [(USER, NO_CONVERSATION)]
    if units[0].items[0][0] not in (USER, ATTACH):
        return [(USER, CONTINUES)]
    return []


def items_of(units: Sequence[Unit], dropped: Sequence[Unit], summary: str | None = None) -> list[Item]:
    out = lead_in(units, dropped, summary)
    for u in units:
        out.extend(u.items)
    return out


def describe(unit: Unit) -> str:
    """What a unit is, in a few words, for an error."""
    if unit.user and not unit.assistant and not unit.tools:
        return "user message"
    if unit.tools:
        n = len(unit.tools)
        return f"assistant step ({n} tool call{'s' * (n != 1)} with their results)"
    if unit.assistant:
        return "assistant message"
    return "message"


def fit(
    units: list[Unit],
    budget: int | None,
    build: Callable[[list[Item]], dict[str, Any]],
    cost: Callable[[list[Item]], int],
    count: Callable[[dict[str, Any]], int],
) -> tuple[dict[str, Any], int, int | None]:
    """Build the body from the newest units that fit ``budget``; return
    (body, units kept, its count, or None without a budget).

    ``cost`` estimates what some items add to a body; the final body is
    always measured with ``count``: more units are dropped until it fits,
    then older units are taken back while it still fits.
    Raises :class:`NewestTooLarge` if the newest unit alone does not fit,
    :class:`BudgetTooSmall` if even the digest-only body does not.
    """
    if budget is None:
        return build(items_of(units, ())), len(units), None
    n = len(units)
    digests = _Digests(units)

    def measure(start: int) -> tuple[dict[str, Any], int]:
        body = build(items_of(units[start:], units[:start], digests(start) if start else None))
        return body, count(body)

    opener = [(USER, NO_CONVERSATION)]
    room = budget - (count(build(opener)) - cost(opener))  # what the conversation may use
    start = n
    costs: dict[int, int] = {}
    while start > 0:
        c = costs[start - 1] = cost(units[start - 1].items)
        if c > room:
            break
        room -= c
        start -= 1
    if 0 < start < n:  # the digest replaces what was dropped; make room for it
        room -= cost([(USER, digests(start))])
        while start < n and room < 0:
            room += costs[start]
            start += 1
    while True:
        if start == n and n:
            return _newest_or_all(units, budget, measure, costs, cost)
        body, total = measure(start)
        over = total - budget
        if over <= 0:
            break
        if start == n:  # no conversation at all, and the system prompt alone is too big
            raise BudgetTooSmall(f"a budget of {budget} tokens cannot hold even the system prompt "
                                 f"({total} tokens by this provider's counter)")
        # drop at least enough estimated cost to cover the overshoot
        while start < n - 1 and over > 0:
            over -= costs.get(start) or cost(units[start].items)
            start += 1
        if over > 0:
            start = n
    # estimates round up; take back older units while the real count still fits
    while start > 0:
        bigger, more = measure(start - 1)
        if more > budget:
            break
        body, total = bigger, more
        start -= 1
    if start > 0 and _all_may_fit(units, start, costs, cost, budget - total + cost(lead_in((), units[:start],
                                                                                           digests(start)))):
        full, everything = measure(0)
        if everything <= budget:
            return full, n, everything
    return body, n - start, total


def _newest_or_all(units: list[Unit], budget: int, measure: Callable[[int], tuple[dict[str, Any], int]],
                   costs: dict[int, int], cost: Callable[[list[Item]], int]) -> tuple[dict[str, Any], int, int]:
    """The body when not even the newest unit fits by the estimates: that
    unit and the digest of the rest if they fit after all, or every unit
    (the digest can outweigh a few short ones); else the error that says
    why, naming the sizes. The newest unit is never left out silently: a
    request without it would ask the model about something else."""
    n = len(units)
    if n > 1:  # (first: the newest unit with a digest may fit where every unit fits too)
        full, everything = measure(0)
        if everything <= budget:
            return full, n, everything
    body, total = measure(n - 1)
    if total <= budget:
        return body, 1, total
    _, minimal = measure(n)
    if minimal > budget:
        raise BudgetTooSmall(f"a budget of {budget} tokens cannot hold even the system prompt and the digest "
                             f"({minimal} tokens by this provider's counter)")
    own = costs.get(n - 1) or cost(units[n - 1].items)
    raise NewestTooLarge(f"the newest {describe(units[-1])} alone is {own} tokens, a request of {total} tokens "
                         f"with the system prompt and tools, over the budget of {budget} tokens: "
                         f"it is not sent without it", unit_tokens=own, request_tokens=total, budget=budget)


#: How much a unit's estimate may exceed what it really adds to a body: the
#: brackets of its own fragment, and the message wrapper it saves when it
#: merges into its neighbour's message (Anthropic, Gemini).
_UNIT_SLACK = 48


def _all_may_fit(units: list[Unit], start: int, costs: dict[int, int], cost: Callable[[list[Item]], int], slack: int) -> bool:
    """True if the dropped units may weigh no more than the digest plus the slack left.

    Stops summing as soon as they clearly weigh more, so this stays cheap.
    """
    total = 0
    for i in range(start):
        total += costs.get(i) or cost(units[i].items)
        if total > slack + _UNIT_SLACK * (i + 1):
            return False
    return True
