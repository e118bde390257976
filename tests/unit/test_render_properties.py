"""Property tests: random journals, every provider, every budget.

Journals mix dangling calls, parallel calls, orphan and repeated results,
reasoning from several models, interleaved model switches, notes, system
events and messages from empty to a few kilobytes of any Unicode.
"""

from __future__ import annotations

import json

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from capsulefs.core.journal.events import (
    AssistantMessage,
    ModelSwitch,
    Reasoning,
    System,
    ToolCall,
    ToolResult,
    UserMessage,
)
from capsulefs.core.render import (
    PROVIDERS,
    BudgetTooSmall,
    NewestTooLarge,
    ToolSpec,
    check_request,
    counter_for,
    render,
    system_prompt,
)
from capsulefs.core.render._plan import plan
from capsulefs.core.render._fit import items_of
from render_journals import TARGETS, journals
from render_sdk import validate_request

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _markers(journal, keep) -> set[str]:
    out = set()
    for i, e in enumerate(journal):
        if isinstance(e, Reasoning) and keep(e, i):
            out.update(v for v in e.data.values() if isinstance(v, str) and v.startswith(("mk", "rs_mk")))
    return out


def _led_to_output(journal, i: int) -> bool:
    """Whether the reasoning at ``journal[i]`` is followed, before any other
    dialogue event, by the reply or call it led to (the Responses API takes
    reasoning back only then)."""
    prompt = next((e.text for e in reversed(journal[:i]) if isinstance(e, System)), "")
    for e in journal[i + 1:]:
        if isinstance(e, System):
            if e.text != prompt:
                return False  # the note of a changed system prompt stands between (rule 6)
            continue
        if isinstance(e, (UserMessage, ToolResult)):
            return False
        if isinstance(e, AssistantMessage) and not e.text.strip():
            continue  # a blank text is never sent (rule 5): what follows it is what the reasoning led to
        if isinstance(e, (AssistantMessage, ToolCall)):
            return True
    return False


@SETTINGS
@given(journal=journals(), target=st.sampled_from(TARGETS), budget=st.one_of(st.none(), st.integers(1, 60_000)))
def test_every_request_keeps_its_providers_rules(journal, target, budget) -> None:
    provider, model = target
    try:
        out = render(journal, provider=provider, model=model, budget=budget, working_memory="notes")
    except BudgetTooSmall as exc:
        # only when the newest unit (with the digest of the rest), or even the
        # digest-only request, does not fit
        p = plan(journal)
        prov = PROVIDERS[provider]
        system = system_prompt(p.system, "notes")
        count = counter_for(provider, model)
        tools = [ToolSpec(name=t["name"], description=t.get("description", "")) for t in p.tools or ()]
        minimal = prov.body(items_of((), p.units), model=model, system=system, tools=tools, max_output=None)
        assert budget is not None
        if isinstance(exc, NewestTooLarge):
            newest = prov.body(items_of(p.units[-1:], p.units[:-1]), model=model, system=system, tools=tools,
                               max_output=None)
            assert count(minimal) <= budget < count(newest) == exc.request_tokens
            assert f"over the budget of {budget} tokens" in str(exc)
        else:
            assert budget < count(minimal)
        return
    body = out.body
    assert check_request(provider, body) == []
    validate_request(provider, body)
    if budget is not None:
        assert out.tokens == counter_for(provider, model)(body) <= budget
    text = json.dumps(body)
    # reasoning: nothing of another model, everything of this one when nothing was dropped
    own = _markers(journal, lambda e, i: (e.provider, e.model) == target
                   and (provider != "openai-responses" or _led_to_output(journal, i)))
    foreign = _markers(journal, lambda e, i: (e.provider, e.model) != target) - own
    assert not any(m in text for m in foreign)
    if out.dropped_units == 0 and provider != "openai-chat":
        assert all(m in text for m in own)
    # switches never change a request for a given target
    plain = [e for e in journal if not isinstance(e, ModelSwitch)]
    assert render(plain, provider=provider, model=model, budget=budget, working_memory="notes").body == body


@settings(max_examples=25, deadline=None)
@given(journal=journals(max_size=25), target=st.sampled_from(TARGETS))
# (found by hypothesis: the newest unit and the digest fit, and so did every unit, which was not tried)
@example(journal=[UserMessage(text="\U00010000"), ToolResult(call_id="toolu_01AbC", content=""), UserMessage(text="0")],
         target=("anthropic", "claude-a"))
def test_more_budget_never_keeps_less(journal, target) -> None:
    provider, model = target
    full = render(journal, provider=provider, model=model, budget=10**8)
    assert full.dropped_units == 0 and full.body == render(journal, provider=provider, model=model).body
    kept = []
    for budget in (full.tokens // 8, full.tokens // 4, full.tokens // 2, full.tokens):
        try:
            kept.append(render(journal, provider=provider, model=model, budget=budget).kept_units)
        except BudgetTooSmall:
            kept.append(-1)
    assert kept == sorted(kept) and kept[-1] == full.kept_units


@settings(max_examples=25, deadline=None)
@given(journal=journals(max_size=25))
def test_every_call_is_answered_exactly_once_everywhere(journal) -> None:
    calls = sum(1 for e in journal if isinstance(e, ToolCall))
    for provider in PROVIDERS:
        text = json.dumps(render(journal, provider=provider, model="m").body)
        results = {
            "anthropic": text.count('"type": "tool_result"'),
            "openai-chat": text.count('"role": "tool"'),
            "openai-responses": text.count('"type": "function_call_output"'),
            "gemini": text.count('"functionResponse"'),
        }[provider]
        assert results == calls
