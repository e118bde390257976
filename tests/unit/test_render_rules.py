"""The issue's rules, one example at a time, for every provider.

Each body is also checked against its provider's pairing rules
(check_request) and the official SDK request types (render_sdk).
"""

from __future__ import annotations

import json
import random

import pytest

from capsulefs.core.journal.events import AssistantMessage, ModelSwitch, Note, System, ToolCall, ToolResult, UserMessage
from capsulefs.core.render import (
    PROVIDERS,
    BudgetTooSmall,
    NewestTooLarge,
    RenderError,
    ToolSpec,
    byte_upper_bound,
    check_request,
    counter_for,
    encoding_counter,
    render,
)
from capsulefs.core.render._plan import INTERRUPTED

from render_journals import records, reasoning
from render_sdk import validate_request

ALL = sorted(PROVIDERS)


def rendered(journal, provider, model="m-1", **kw):
    out = render(journal, provider=provider, model=model, **kw)
    assert check_request(provider, out.body) == []
    validate_request(provider, out.body)
    return out.body


def dumped(body) -> str:
    return json.dumps(body, ensure_ascii=False)


# -- rule 1: private reasoning only for the exact provider and model -----------------


@pytest.mark.parametrize("provider", ["anthropic", "openai-responses", "gemini"])
def test_reasoning_goes_back_only_to_its_own_model(provider: str) -> None:
    journal = [
        UserMessage(text="list the files"),
        reasoning(provider, "model-a", "SIGA"),
        ToolCall(call_id="c1", name="ls", arguments={"path": "."}),
        ToolResult(call_id="c1", content="a.txt"),
        reasoning(provider, "model-b", "SIGB"),
        AssistantMessage(text="there is a.txt"),
    ]
    for model, mine, other in [("model-a", "SIGA", "SIGB"), ("model-b", "SIGB", "SIGA")]:
        body = dumped(rendered(journal, provider, model))
        assert mine in body and other not in body
    for elsewhere in ALL:
        if elsewhere != provider:
            body = dumped(rendered(journal, elsewhere, "model-a"))
            assert "SIGA" not in body and "SIGB" not in body


def test_anthropic_thinking_is_verbatim_and_in_place() -> None:
    think = reasoning("anthropic", "claude-x", "SIG")
    journal = [UserMessage(text="hi"), think, ToolCall(call_id="c1", name="ls", arguments={}),
               ToolResult(call_id="c1", content="ok")]
    body = rendered(journal, "anthropic", "claude-x")
    assert body["messages"][1] == {
        "role": "assistant",
        "content": [dict(think.data), {"type": "tool_use", "id": "c1", "name": "ls", "input": {}}],
    }


def test_responses_reasoning_item_precedes_its_call() -> None:
    think = reasoning("openai-responses", "gpt-x", "ENC")
    journal = [UserMessage(text="hi"), think, ToolCall(call_id="c1", name="ls", arguments={}),
               ToolResult(call_id="c1", content="ok")]
    items = rendered(journal, "openai-responses", "gpt-x")["input"]
    assert items[1] == dict(think.data) and items[2]["type"] == "function_call"


def test_gemini_signature_rides_on_the_following_part() -> None:
    journal = [UserMessage(text="hi"), reasoning("gemini", "gem", "U0lH"),
               ToolCall(call_id="c1", name="ls", arguments={"p": 1}), ToolResult(call_id="c1", content="ok")]
    contents = rendered(journal, "gemini", "gem")["contents"]
    assert contents[1] == {"role": "model", "parts": [
        {"functionCall": {"id": "c1", "name": "ls", "args": {"p": 1}}, "thoughtSignature": "U0lH"}]}
    other = rendered(journal, "gemini", "gem-2")["contents"]
    assert "thoughtSignature" not in dumped(other)


def _signatures(contents) -> list[list]:
    """Per model content: the thoughtSignature of each functionCall part (None if it has none)."""
    return [[p.get("thoughtSignature") for p in c["parts"] if "functionCall" in p]
            for c in contents if c["role"] == "model"]


def test_gemini_3_gets_a_placeholder_for_calls_of_other_models_in_the_current_turn() -> None:
    # Gemini 3 answers 400 "Function call is missing a thought_signature" for a
    # step of the current turn without one: e.g. right after a switch from Claude.
    journal = [UserMessage(text="old question"), ToolCall(call_id="a1", name="ls", arguments={}),
               ToolResult(call_id="a1", content="x"), AssistantMessage(text="old answer"),
               UserMessage(text="new question"),
               reasoning("anthropic", "claude-x", "CLAUDESIG"), ToolCall(call_id="b1", name="ls", arguments={}),
               ToolCall(call_id="b2", name="cat", arguments={}),
               ToolResult(call_id="b1", content="y"), ToolResult(call_id="b2", content="z"),
               reasoning("gemini", "gemini-3-pro-preview", "T1dOU0lH"), ToolCall(call_id="c1", name="ls", arguments={}),
               ToolResult(call_id="c1", content="w")]
    contents = rendered(journal, "gemini", "gemini-3-pro-preview")["contents"]
    skip = "skip_thought_signature_validator"
    # earlier turn: untouched; parallel calls: only the first; a real signature is kept
    assert _signatures(contents) == [[None], [], [skip, None], ["T1dOU0lH"]]
    assert "CLAUDESIG" not in dumped(contents)
    for older in ("gemini-2.5-pro", "gem-a"):
        assert skip not in dumped(rendered(journal, "gemini", older))
    assert _signatures(rendered(journal, "gemini", "models/gemini-3.1-flash")["contents"])[2] == [skip, None]


# -- rule 2: interrupted calls, orphan results -------------------------------------


@pytest.mark.parametrize("provider", ALL)
def test_dangling_call_gets_an_explicit_interrupted_error(provider: str) -> None:
    journal = [UserMessage(text="run it"), ToolCall(call_id="c1", name="run", arguments={}),
               ToolCall(call_id="c2", name="run", arguments={}), ToolResult(call_id="c1", content="fine")]
    body = rendered(journal, provider)
    text = dumped(body)
    assert "interrupted" in INTERRUPTED and INTERRUPTED in text
    if provider == "anthropic":
        results = body["messages"][2]["content"]
        assert results[1] == {"type": "tool_result", "tool_use_id": "c2", "content": INTERRUPTED, "is_error": True}
        assert "is_error" not in results[0]
    elif provider == "openai-chat":
        assert body["messages"][-1] == {"role": "tool", "tool_call_id": "c2", "content": "[error] " + INTERRUPTED}
    elif provider == "openai-responses":
        assert body["input"][-1] == {"type": "function_call_output", "call_id": "c2", "output": "[error] " + INTERRUPTED}
    else:
        part = body["contents"][-1]["parts"][-1]
        assert part == {"functionResponse": {"id": "c2", "name": "run", "response": {"error": INTERRUPTED}}}


def test_anthropic_error_result_with_no_output_still_has_content() -> None:
    # The Messages API refuses "tool_result: content cannot be empty if `is_error` is true":
    # a failing command with no output made every later request of the agent fail.
    journal = [UserMessage(text="run it"), ToolCall(call_id="c1", name="run", arguments={}),
               ToolResult(call_id="c1", content="", is_error=True),
               ToolCall(call_id="c2", name="run", arguments={}), ToolResult(call_id="c2", content="\n")]
    body = rendered(journal, "anthropic")
    first, second = body["messages"][2]["content"][0], body["messages"][4]["content"][0]
    assert first["is_error"] is True and first["content"].strip()
    assert second["content"].strip() and "is_error" not in second
    broken = {"model": "m", "max_tokens": 1, "messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "run", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "", "is_error": True}]},
    ]}
    assert any("content cannot be empty" in p for p in check_request("anthropic", broken))


@pytest.mark.parametrize("provider", ALL)
def test_result_without_call_is_never_a_tool_result(provider: str) -> None:
    journal = [UserMessage(text="hi"), ToolResult(call_id="ghost", content="ORPHAN OUTPUT"), AssistantMessage(text="ok")]
    body = rendered(journal, provider)
    text = dumped(body)
    assert "ORPHAN OUTPUT" in text  # kept as a note in a user turn, not lost
    for marker in ('"tool_result"', '"role": "tool"', "function_call_output", "functionResponse"):
        assert marker not in text


@pytest.mark.parametrize("provider", ALL)
def test_late_result_is_moved_next_to_its_call(provider: str) -> None:
    journal = [UserMessage(text="go"), ToolCall(call_id="c1", name="slow", arguments={}),
               UserMessage(text="are you there?"), ToolResult(call_id="c1", content="LATE")]
    body = rendered(journal, provider)
    text = dumped(body)
    assert text.index("LATE") < text.index("are you there?")
    assert INTERRUPTED not in text


@pytest.mark.parametrize("provider", ALL)
def test_call_ids_reused_by_a_server_pair_each_call_with_its_own_result(provider: str) -> None:
    # Some OpenAI-compatible servers number calls per reply: every step's call is "call_0".
    journal = [UserMessage(text="go"),
               ToolCall(call_id="call_0", name="ls", arguments={}), ToolResult(call_id="call_0", content="FIRST"),
               ToolCall(call_id="call_0", name="cat", arguments={}), ToolResult(call_id="call_0", content="SECOND"),
               AssistantMessage(text="done")]
    body = rendered(journal, provider)
    text = dumped(body)
    assert INTERRUPTED not in text and "repeating an answered call" not in text
    assert text.index("FIRST") < text.index('"cat"') < text.index("SECOND")


@pytest.mark.parametrize("provider", ALL)
def test_a_call_interrupted_by_a_crash_does_not_take_the_retry_s_result(provider: str) -> None:
    journal = [UserMessage(text="go"), ToolCall(call_id="call_0", name="ls", arguments={}),
               UserMessage(text="(restarted)"),
               ToolCall(call_id="call_0", name="ls", arguments={}), ToolResult(call_id="call_0", content="AFTER")]
    text = dumped(rendered(journal, provider))
    assert text.index(INTERRUPTED) < text.index("(restarted)") < text.index("AFTER")


@pytest.mark.parametrize("provider", ALL)
def test_a_repeated_result_never_answers_a_later_call_cut_off_by_a_crash(provider: str) -> None:
    journal = [UserMessage(text="go"), ToolCall(call_id="call_0", name="ls", arguments={}),
               ToolResult(call_id="call_0", content="ONE"), ToolResult(call_id="call_0", content="AGAIN"),
               UserMessage(text="next"), ToolCall(call_id="call_0", name="cat", arguments={})]
    text = dumped(rendered(journal, provider))
    assert "repeating an answered call" in text and text.index("AGAIN") < text.index("next")
    assert text.index('"cat"') < text.rindex(INTERRUPTED)


@pytest.mark.parametrize("provider", ALL)
def test_a_second_result_for_one_call_stays_a_note(provider: str) -> None:
    journal = [UserMessage(text="go"), ToolCall(call_id="c1", name="ls", arguments={}),
               ToolResult(call_id="c1", content="ONE"), ToolResult(call_id="c1", content="AGAIN")]
    text = dumped(rendered(journal, provider))
    assert "repeating an answered call" in text and text.index("ONE") < text.index("AGAIN")


@pytest.mark.parametrize("provider", ALL)
def test_unsafe_ids_and_names_are_made_safe_consistently(provider: str) -> None:
    journal = [UserMessage(text="go"), ToolCall(call_id="id with spaces/∂" * 3, name="my.tool", arguments={}),
               ToolResult(call_id="id with spaces/∂" * 3, content="done")]
    body = rendered(journal, provider)
    text = dumped(body)
    assert "∂" not in text and "my.tool" not in text and "my_tool" in text
    assert rendered(journal, provider) == body  # deterministic


# -- rule 3: window fitting and the digest ----------------------------------------


def _long_journal(n: int) -> list:
    out = [System(text="be brief")]
    for i in range(n):
        out += [UserMessage(text=f"question {i} " + "x" * 50),
                ToolCall(call_id=f"a{i}", name="grep", arguments={"q": i}),
                ToolCall(call_id=f"b{i}", name="read_file", arguments={"i": i}),
                ToolResult(call_id=f"a{i}", content="hit " * 10),
                ToolResult(call_id=f"b{i}", content="body " * 10),
                AssistantMessage(text=f"answer {i}")]
    return out


@pytest.mark.parametrize("provider", ALL)
def test_budget_keeps_the_newest_units_and_digests_the_rest(provider: str) -> None:
    journal = records(_long_journal(30))
    full = render(journal, provider=provider, model="m-1", budget=10**9)
    assert full.dropped_units == 0
    for budget in (full.tokens // 2, full.tokens // 5, 2000):
        out = render(journal, provider=provider, model="m-1", budget=budget)
        assert out.tokens <= budget and counter_for(provider, "m-1")(out.body) == out.tokens
        assert out.dropped_units > 0 and check_request(provider, out.body) == []
        validate_request(provider, out.body)
        text = dumped(out.body)
        assert "answer 29" in text and "be brief" in text  # newest kept, system always
        assert "[Earlier conversation omitted to fit the context window:" in text
        assert "tools used: grep ×" in text and "read_file ×" in text
        assert "from 2026-01-01T00:00:02.000Z to " in text
        # parallel calls and their results travel together
        for i in range(30):
            present = [f'"a{i}"' in text, f'"b{i}"' in text]
            assert all(present) or not any(present)


def test_digest_counts_what_was_dropped() -> None:
    journal = _long_journal(10)
    out = render(journal, provider="openai-chat", model="m", budget=500)
    digest = out.body["messages"][1]["content"]
    dropped_questions = sum(1 for i in range(10) if f"question {i} " not in dumped(out.body))
    assert digest.startswith(f"[Earlier conversation omitted to fit the context window: {dropped_questions} user messages")
    assert f"{2 * dropped_questions} tool calls" in digest
    assert "from" not in digest  # plain events carry no time


@pytest.mark.parametrize("provider", ALL)
def test_budget_too_small_for_the_system_prompt(provider: str) -> None:
    with pytest.raises(BudgetTooSmall):
        render([UserMessage(text="hi")], provider=provider, model="m", budget=50, working_memory="m" * 500)


@pytest.mark.parametrize("provider", ALL)
def test_newest_message_too_big_for_the_budget_is_an_error_naming_both_sizes(provider: str) -> None:
    # It used to render only the digest: the model was called without the question.
    journal = [UserMessage(text="small"), AssistantMessage(text="ok"), UserMessage(text="y " * 5000)]
    with pytest.raises(NewestTooLarge) as caught:
        render(journal, provider=provider, model="m", budget=1000)
    exc = caught.value
    assert exc.unit_tokens > 1000 and exc.budget == 1000
    assert f"the newest user message alone is {exc.unit_tokens} tokens" in str(exc)
    assert "over the budget of 1000 tokens" in str(exc)
    fits = render(journal, provider=provider, model="m", budget=exc.request_tokens)
    assert fits.tokens <= exc.request_tokens and "y y y" in dumped(fits.body)


def test_precise_counter_plugs_in() -> None:
    words = encoding_counter(lambda s: s.split())
    journal = _long_journal(20)
    out = render(journal, provider="anthropic", model="m", budget=400, counter=words)
    assert out.tokens == words(out.body) <= 400 < byte_upper_bound(out.body)
    assert out.dropped_units > 0


def test_byte_bound_never_undercounts_utf8_text() -> None:
    for text in ["plain", "ünïcödé", "日本語のテキスト", "emoji 🎉🎉", "\x00\x01"]:
        assert byte_upper_bound({"t": text}) >= len(text.encode())


# -- rule 5: switching --------------------------------------------------------


@pytest.mark.parametrize("provider_a,model_a,provider_b,model_b", [
    ("anthropic", "claude-a", "anthropic", "claude-b"),
    ("anthropic", "claude-a", "openai-responses", "gpt-r"),
    ("openai-responses", "gpt-r", "gemini", "gem-a"),
    ("gemini", "gem-a", "openai-chat", "gpt-c"),
])
def test_switching_away_and_back_loses_nothing(provider_a, model_a, provider_b, model_b) -> None:
    journal = [
        ModelSwitch(provider=provider_a, model=model_a),
        UserMessage(text="start"),
        reasoning(provider_a, model_a, "SIGAONEE"),
        ToolCall(call_id="c1", name="ls", arguments={}),
        ToolResult(call_id="c1", content="x"),
        AssistantMessage(text="A says hi", provider=provider_a, model=model_a),
        ModelSwitch(provider=provider_b, model=model_b),
        UserMessage(text="continue"),
        reasoning(provider_b, model_b, "SIGBONEE"),
        AssistantMessage(text="B says hi", provider=provider_b, model=model_b),
        ModelSwitch(provider=provider_a, model=model_a),
        UserMessage(text="and again"),
    ]
    as_a = render(journal)  # the last switch chooses A
    assert (as_a.provider, as_a.model) == (provider_a, model_a)
    never_switched = [e for e in journal if not isinstance(e, ModelSwitch)]
    assert as_a.body == render(never_switched, provider=provider_a, model=model_a).body
    text = dumped(as_a.body)
    assert "B says hi" in text and "SIGBONEE" not in text
    assert ("SIGAONEE" in text) == (provider_a != "openai-chat")
    as_b = render(journal, provider=provider_b, model=model_b)
    assert "SIGAONEE" not in dumped(as_b.body)
    for p in (provider_a, provider_b):
        assert check_request(p, render(journal, provider=p, model=model_a).body) == []


# -- journal handling -----------------------------------------------------------


def test_records_are_ordered_by_clock_machine_seq() -> None:
    journal = records(_long_journal(5))
    shuffled = list(journal)
    random.Random(7).shuffle(shuffled)
    assert render(shuffled, provider="gemini", model="m").body == render(journal, provider="gemini", model="m").body


def test_non_dialogue_events_are_not_rendered() -> None:
    journal = [UserMessage(text="hi"), Note(text="NOTE-TEXT"), ModelSwitch(provider="gemini", model="g")]
    for p in ALL:
        assert "NOTE-TEXT" not in dumped(render(journal, provider=p, model="m").body)


@pytest.mark.parametrize("provider,model", [("openai-chat", "gpt-c"), ("anthropic", "claude-a")])
def test_provider_alone_takes_that_providers_last_model(provider: str, model: str) -> None:
    # `capsulefs render AGENT --provider P` sent P the model of the last switch, even one of
    # another provider (an OpenAI body naming a Claude model: refused by the API).
    journal = [ModelSwitch(provider="openai-chat", model="gpt-c"), ModelSwitch(provider="anthropic", model="claude-a"),
               ModelSwitch(provider="gemini", model="gem-a"), UserMessage(text="hi")]
    out = render(journal, provider=provider)
    assert (out.provider, out.model) == (provider, model)
    with pytest.raises(RenderError, match="no model given for openai-responses"):
        render(journal, provider="openai-responses")


def test_errors_name_the_problem() -> None:
    with pytest.raises(RenderError, match="no model_switch"):
        render([UserMessage(text="hi")])
    with pytest.raises(RenderError, match="unknown provider 'nope'"):
        render([UserMessage(text="hi")], provider="nope", model="m")


@pytest.mark.parametrize("provider", ALL)
def test_empty_journal_renders_a_valid_request(provider: str) -> None:
    rendered([], provider)
    rendered([AssistantMessage(text="I start")], provider)


@pytest.mark.parametrize("provider", ALL)
def test_system_working_memory_and_tools(provider: str) -> None:
    tools = [ToolSpec(name="grep", description="search", parameters={"type": "object", "properties": {"q": {"type": "string"}}})]
    body = rendered([System(text="SYS"), UserMessage(text="hi")], provider, working_memory="MEMO", tools=tools,
                    max_output=256)
    text = dumped(body)
    assert "SYS" in text and "<working_memory>\\nMEMO\\n</working_memory>" in text and "grep" in text


# -- the rule checkers can fail ---------------------------------------------------


BROKEN = {
    "anthropic": {"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "x", "input": {}}]},
        {"role": "user", "content": "no result"}]},
    "openai-chat": {"model": "m", "messages": [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "x", "arguments": "{}"}}]},
        {"role": "user", "content": "no result"}]},
    "openai-responses": {"model": "m", "input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]},
    "gemini": {"contents": [{"role": "user", "parts": [{"text": "hi"}]},
                            {"role": "model", "parts": [{"functionCall": {"name": "x", "args": "[]"}}]}]},
}


@pytest.mark.parametrize("provider", ALL)
def test_checkers_reject_broken_pairing(provider: str) -> None:
    assert check_request(provider, BROKEN[provider])


@pytest.mark.parametrize("provider", ALL)
def test_megabyte_messages(provider: str) -> None:
    big = "ä" * 1_000_000
    journal = [UserMessage(text="first"), AssistantMessage(text="ok"), UserMessage(text=big),
               AssistantMessage(text="that was long"), UserMessage(text="and now?")]
    assert big in dumped(rendered(journal, provider))
    fitted = render(journal, provider=provider, model="m", budget=100_000)
    text = dumped(fitted.body)
    assert fitted.tokens <= 100_000 and big not in text
    assert "that was long" in text and "and now?" in text and ": 2 user messages, 1 assistant message," in text


def test_anthropic_counter_pays_for_the_hidden_tool_prompt() -> None:
    tools = [ToolSpec(name="grep")]
    journal = _long_journal(10)
    plain = render(journal, provider="anthropic", model="m", budget=1600)
    with_tools = render(journal, provider="anthropic", model="m", budget=1600, tools=tools)
    count = counter_for("anthropic", "m")
    assert with_tools.tokens == count(with_tools.body) <= 1600
    assert count(with_tools.body) - count({k: v for k, v in with_tools.body.items() if k != "tools"}) > 500
    assert plain.tokens == count(plain.body)
    assert with_tools.kept_units < plain.kept_units


def test_responses_reasoning_cut_off_before_its_output_is_not_sent() -> None:
    """A reply cut off while the model was reasoning leaves a reasoning item
    with nothing after it in its step. The Responses API refuses a reasoning
    item not followed by the item it led to, so every later request of that
    agent failed; it is now left out (the journal keeps it), and the check
    (so the stub provider too) reports one."""
    journal = [
        ModelSwitch(provider="openai-responses", model="gpt-r"),
        UserMessage(text="hi"),
        reasoning("openai-responses", "gpt-r", "CUTOFFSIG"),
        UserMessage(text="again"),
        reasoning("openai-responses", "gpt-r", "KEPTSIG"),
        AssistantMessage(text="hello", provider="openai-responses", model="gpt-r"),
    ]
    body = render(journal).body
    text = dumped(body)
    assert "CUTOFFSIG" not in text and "KEPTSIG" in text
    assert check_request("openai-responses", body) == []
    broken = dict(body, input=[body["input"][0], {"type": "reasoning", "id": "r", "summary": [],
                                                  "encrypted_content": "x"}, body["input"][1]])
    assert any("required following item" in p for p in check_request("openai-responses", broken))


# -- system prompts in time ------------------------------------------------------


@pytest.mark.parametrize("provider", ALL)
def test_a_changed_system_prompt_replaces_the_old_one_and_marks_where(provider: str) -> None:
    # Both versions used to open the request, concatenated: the old instruction still held.
    journal = [System(text="OLD: answer in French."), UserMessage(text="first question"),
               ToolCall(call_id="c1", name="ls", arguments={}), System(text="NEW: answer in English."),
               ToolResult(call_id="c1", content="a.txt"), AssistantMessage(text="premier"),
               UserMessage(text="second question")]
    body = rendered(journal, provider)
    text = dumped(body)
    assert "OLD:" not in text and text.count("NEW: answer in English.") == 1
    marker = "[The system prompt was changed at this point"
    assert text.index("first question") < text.index("a.txt") < text.index(marker) < text.index("second question")
    # the same prompt again, or set before the conversation, leaves no marker
    quiet = [System(text="A"), System(text="B"), UserMessage(text="q"), System(text="B"), AssistantMessage(text="x")]
    assert marker not in dumped(rendered(quiet, provider))
    # nor does a blank prompt where there was none: still no prompt (it split an assistant step before)
    blank = [UserMessage(text="q"), AssistantMessage(text="thinking..."), System(text=""), AssistantMessage(text="x")]
    assert marker not in dumped(rendered(blank, provider))


# -- blank texts and block order -------------------------------------------------------


@pytest.mark.parametrize("provider", ALL)
def test_blank_texts_are_never_sent(provider: str) -> None:
    # One renderer dropped them and the others sent them; Anthropic refuses blank text blocks.
    journal = [UserMessage(text="hi"), AssistantMessage(text="  \n"), UserMessage(text=""),
               UserMessage(text="again"), AssistantMessage(text=""), ToolCall(call_id="c1", name="ls", arguments={}),
               ToolResult(call_id="c1", content="x"), AssistantMessage(text="done")]
    body = rendered(journal, provider)
    texts = []
    stack = [body]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            texts += [v for k, v in x.items() if k in ("text", "content") and isinstance(v, str)]
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    assert texts and all(t.strip() for t in texts), texts


def test_anthropic_turn_with_thinking_starts_with_it() -> None:
    # The model changed mid-step: claude-x's text, then claude-y's thinking and call, in one turn.
    journal = [UserMessage(text="go"), AssistantMessage(text="let me look", model="claude-x"),
               reasoning("anthropic", "claude-y", "SIGY"), ToolCall(call_id="c1", name="ls", arguments={}),
               ToolResult(call_id="c1", content="x")]
    turn = rendered(journal, "anthropic", "claude-y")["messages"][1]["content"]
    assert [b["type"] for b in turn] == ["thinking", "text", "tool_use"]
    broken = {"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "text", "text": "t"}, dict(reasoning("anthropic", "m", "S").data)]}]}
    assert any("must start with it" in p for p in check_request("anthropic", broken))


@pytest.mark.parametrize("provider,body", [
    ("openai-chat", {"model": "m", "messages": [{"role": "user", "content": " "}]}),
    ("openai-responses", {"model": "m", "input": [{"type": "message", "role": "user", "content": ""}]}),
    ("gemini", {"contents": [{"role": "user", "parts": [{"text": "\n"}]}]}),
    ("anthropic", {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]}),
])
def test_the_checks_and_so_the_stub_refuse_blank_texts(provider: str, body: dict) -> None:
    assert any("blank text" in p for p in check_request(provider, body))


# -- self-contained requests: the tools the journal offers ---------------------------------


@pytest.mark.parametrize("provider", ALL)
def test_the_journal_s_last_tools_event_is_sent_with_the_history(provider: str) -> None:
    # No tools array was sent, and Anthropic refuses tool_use blocks without one.
    from capsulefs.core.journal.events import ToolsOffered

    grep = {"name": "grep", "description": "search", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}
    journal = [ToolsOffered(tools=[{"name": "old_tool"}]), UserMessage(text="find x"),
               ToolsOffered(tools=[grep, {"name": "ls"}]), ToolCall(call_id="c1", name="grep", arguments={"q": "x"}),
               ToolResult(call_id="c1", content="x.txt")]
    body = rendered(journal, provider)
    text = dumped(body)
    assert '"grep"' in text and '"ls"' in text and "old_tool" not in text and "search" in text
    mine = rendered(journal, provider, tools=[ToolSpec(name="mine")])
    assert "mine" in dumped(mine) and '"ls"' not in dumped(mine)
    assert "tools" not in rendered(journal, provider, tools=[])


@pytest.mark.parametrize("tools", [{"name": "x"}, [{"name": ""}], [{"name": "a"}, {"name": "a"}],
                                   [{"name": "a", "parameters": []}], [{"name": "a", "extra": 1}], ["a"]])
def test_a_tools_event_is_checked(tools) -> None:
    from capsulefs.core.errors import FormatError
    from capsulefs.core.journal.events import parse_draft

    with pytest.raises(FormatError):
        parse_draft({"kind": "tools", "tools": tools})


# -- attachments ----------------------------------------------------------------------


def _attachment_journal():
    import hashlib

    from capsulefs.core.journal.events import Attachment

    png = b"\x89PNG\r\n\x1a\n" + bytes(200)
    pdf = b"%PDF-1.4 /Type /Pages /Type /Page /Type /Page %%EOF"
    blobs = {hashlib.sha256(b).hexdigest(): b for b in (png, pdf)}
    sp, sd = hashlib.sha256(png).hexdigest(), hashlib.sha256(pdf).hexdigest()
    journal = [Attachment(blob=sp, media_type="image/png", size=len(png), name="a.png"), UserMessage(text="what is this?"),
               ToolCall(call_id="c1", name="read_file", arguments={"path": "doc.pdf"}),
               Attachment(blob=sd, media_type="application/pdf", size=len(pdf), name="doc.pdf", call_id="c1"),
               ToolResult(call_id="c1", content="attached doc.pdf"),
               Attachment(blob=sp, media_type="image/svg+xml", size=10, name="x.svg"), AssistantMessage(text="ok")]
    return journal, blobs


@pytest.mark.parametrize("provider", ALL)
def test_attachments_are_each_provider_s_native_parts(provider: str) -> None:
    import base64

    journal, blobs = _attachment_journal()
    body = rendered(journal, provider, "gpt-4o", read_blob=blobs.__getitem__)  # SDK types and pairing checked
    text = dumped(body)
    for data in blobs.values():
        assert base64.b64encode(data).decode() in text
    native = {"anthropic": ('"type": "image"', '"type": "document"'), "openai-chat": ('"image_url"', '"file_data"'),
              "openai-responses": ('"input_image"', '"input_file"'), "gemini": ('"inlineData"', '"application/pdf"')}
    assert all(marker in text for marker in native[provider])
    # a type the provider does not take is dropped with a note, never sent
    assert "[attachment x.svg (image/svg+xml, 10 bytes) not sent:" in text
    # the image goes with the user's question, the PDF after its call's result
    image, doc = (base64.b64encode(b).decode()[:40] for b in blobs.values())
    assert text.index(image) < text.index("what is this?") < text.index("attached doc.pdf") < text.index(doc)


@pytest.mark.parametrize("provider", ALL)
def test_the_budget_counts_attachments_by_the_provider_s_formula(provider: str) -> None:
    journal, blobs = _attachment_journal()
    out = render(journal, provider=provider, model="gpt-4o", budget=100_000, read_blob=blobs.__getitem__)
    plain = [e for e in journal if type(e).__name__ != "Attachment"]
    without = render(plain, provider=provider, model="gpt-4o", budget=100_000)
    assert out.tokens - without.tokens >= 1600 + 2 * 3000  # an image, a two-page PDF
    with pytest.raises(NewestTooLarge):
        render(journal[:2], provider=provider, model="gpt-4o", budget=1000, read_blob=blobs.__getitem__)
    with pytest.raises(RenderError, match="needs the capsule's blobs"):
        render(journal, provider=provider, model="gpt-4o")


@pytest.mark.parametrize(("provider", "model", "per_image"), [
    ("openai-chat", "gpt-4o", 1600), ("openai-responses", "gpt-4.1", 1600), ("openai-chat", "gpt-5", 1600),
    ("openai-chat", "gpt-4.1-mini", 3779), ("openai-responses", "gpt-4.1-nano-2025-04-14", 3779),
    ("openai-responses", "o4-mini", 3779), ("openai-chat", "some-new-model", 3779),
    ("openai-chat", "gpt-4o-mini", 2833 + 8 * 5667), ("openai-responses", "openai/gpt-4o-mini", 2833 + 8 * 5667),
    ("anthropic", "claude-sonnet-4-5", 1600), ("anthropic", "claude-opus-4-7", 5000),
    ("anthropic", "claude-opus-5", 5000), ("gemini", "gemini-2.5-pro", 1600)])
def test_an_image_counts_the_model_s_own_upper_bound(provider: str, model: str, per_image: int) -> None:
    """The budget is never over the real count: an image costs what the
    model's provider documents at most for it (OpenAI's small models multiply
    their patches, gpt-4o-mini counts 5,667 a tile, Claude Opus 4.7 takes
    3.75 megapixels), not one figure for every model."""
    journal, blobs = _attachment_journal()
    image_only = [journal[0], journal[1]]
    out = render(image_only, provider=provider, model=model, budget=100_000, read_blob=blobs.__getitem__)
    without = render(image_only[1:], provider=provider, model=model, budget=100_000)
    extra = out.tokens - without.tokens
    assert per_image <= extra < per_image + 100  # the image's bound and its part's few tokens of JSON


def test_attachment_events_are_checked_and_their_blobs_travel() -> None:
    from capsulefs.core.errors import FormatError
    from capsulefs.core.journal.events import parse_draft
    from capsulefs.core.journal.projections import referenced_blobs

    sha = "a" * 64
    for bad in ({"blob": "x", "media_type": "image/png", "size": 1}, {"blob": sha, "media_type": "PNG", "size": 1},
                {"blob": sha, "media_type": "image/png", "size": -1}, {"blob": sha, "media_type": "image/png", "size": True},
                {"blob": sha, "media_type": "image/png", "size": 1, "call_id": ""}):
        with pytest.raises(FormatError):
            parse_draft({"kind": "attachment", **bad})
    journal = records([parse_draft({"kind": "attachment", "blob": sha, "media_type": "image/png", "size": 1})])
    assert referenced_blobs([r.line for r in journal]) == {sha}


def _many(kind: str, n: int, size: int, pages: int = 0):
    """``n`` user turns, each an attachment and a question; the blobs' bytes
    (small: a render trusts the event's size, which append checked)."""
    import hashlib

    from capsulefs.core.journal.events import Attachment

    journal, blobs = [], {}
    for i in range(n):
        data = (b"%PDF-1.4 " + b"/Type /Page " * pages if kind == "application/pdf" else b"\x89PNG\r\n\x1a\n") + \
            str(i).encode()
        sha = hashlib.sha256(data).hexdigest()
        blobs[sha] = data
        journal += [Attachment(blob=sha, media_type=kind, size=size, name=f"f{i}"), UserMessage(text=f"look at {i}")]
    return journal, blobs


def _sent_and_noted(text: str, n: int) -> tuple[list[int], list[int]]:
    noted = [i for i in range(n) if f"[attachment f{i} (" in text]
    return [i for i in range(n) if i not in noted], noted


@pytest.mark.parametrize("provider", ALL)
def test_a_request_carries_at_most_its_provider_s_count_of_images_the_newest(provider: str) -> None:
    limit = PROVIDERS[provider].limits.images
    journal, blobs = _many("image/png", limit + 3, 100)
    body = rendered(journal, provider, "gpt-4o", read_blob=blobs.__getitem__)
    sent, noted = _sent_and_noted(dumped(body), limit + 3)
    assert noted == [0, 1, 2] and len(sent) == limit  # the oldest go, each with a note in its place
    assert f"takes at most {limit} images in a request; newer attachments are sent" in dumped(body)


@pytest.mark.parametrize("provider, kind, size, sent", [
    ("anthropic", "image/png", 5 * 2**20 * 3 // 4, True),  # 5 MiB once in base64: Anthropic's limit
    ("anthropic", "image/png", 5 * 2**20 * 3 // 4 + 1, False),
    ("gemini", "application/pdf", 50 * 10**6, True),  # Gemini takes PDFs of 50 MB inline
    ("gemini", "application/pdf", 50 * 10**6 + 1, False),
])
def test_an_attachment_s_size_limit_is_its_provider_s(provider: str, kind: str, size: int, sent: bool) -> None:
    journal, blobs = _many(kind, 1, size, 1)
    text = dumped(render(journal, provider=provider, model="gpt-4o", read_blob=blobs.__getitem__).body)
    assert ("[attachment f0 (" not in text) == sent
    if not sent:
        assert f"{provider} takes attachments of at most {size - 1} bytes" in text


@pytest.mark.parametrize("provider, kind, size, pages, fits", [
    ("anthropic", "image/png", 5 * 2**20 * 3 // 4, 0, 5),  # 32 MB request: base64 of 5 such images, not 6
    ("anthropic", "application/pdf", 1000, 40, 2),  # 100 pages
    ("openai-chat", "image/png", 19 * 2**20, 0, 2),  # 50 MB of images
    ("openai-responses", "application/pdf", 15 * 2**20, 1, 2),  # 32 MB of PDFs
    ("openai-responses", "application/pdf", 1000, 60, 1),  # 100 pages
    ("gemini", "image/png", 20 * 2**20, 0, 3),  # 100 MB of inline data (base64) a request
    ("gemini", "application/pdf", 40 * 10**6, 1, 1),  # a PDF up to 50 MB; 100 MB of inline data
    ("gemini", "application/pdf", 1000, 400, 2),  # 1,000 pages
])
def test_a_request_keeps_its_provider_s_size_and_page_limits(provider: str, kind: str, size: int, pages: int,
                                                              fits: int) -> None:
    journal, blobs = _many(kind, fits + 2, size, pages)
    out = render(journal, provider=provider, model="gpt-4o", budget=10**9, read_blob=blobs.__getitem__)
    assert check_request(provider, out.body) == []
    sent, noted = _sent_and_noted(dumped(out.body), fits + 2)
    assert noted == [0, 1] and len(sent) == fits
    # the budget counts what is sent: the notes, not the dropped attachments' tokens
    per = 1600 if kind.startswith("image/") else 3000 * pages
    assert out.tokens < (fits + 1) * per


def test_old_pdfs_beyond_the_page_limit_are_never_read() -> None:
    journal, blobs = _many("application/pdf", 300, 1000, pages=1)
    reads: list[str] = []

    def read_blob(sha: str) -> bytes:
        reads.append(sha)
        return blobs[sha]

    body = rendered(journal, "anthropic", "claude-x", read_blob=read_blob)
    sent, noted = _sent_and_noted(dumped(body), 300)
    assert len(sent) == 100 and noted == list(range(200))
    assert len(reads) == len(set(reads)) == 100  # each sent PDF read once (its pages, then its bytes)


def test_render_leaves_the_garbage_collector_as_it_found_it() -> None:
    import gc

    journal = [UserMessage(text="hi"), AssistantMessage(text="hello")]
    during: list[bool] = []

    def counter(body) -> int:
        during.append(gc.isenabled())
        return byte_upper_bound(body)

    assert gc.isenabled()
    render(journal, provider="anthropic", model="m", budget=1000, counter=counter)
    assert during and not any(during)  # paused while it renders (a long journal's render: over half its time)
    assert gc.isenabled()
    gc.disable()
    try:
        render(journal, provider="anthropic", model="m", budget=1000)
        assert not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(RenderError):
        render(journal, provider="nobody", model="m")
    assert gc.isenabled()  # resumed when a render fails too
