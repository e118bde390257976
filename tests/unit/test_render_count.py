"""Token counts: a budget means the provider's real tokens, not bytes.

OpenAI's and Gemini's tokenizers run offline (the splintr-rs package
compiles o200k_base, cl100k_base and Gemma's vocabulary in), so an OpenAI
request is counted within a few percent of the way OpenAI documents
counting a chat request, a Gemini request within a few percent of Google's
own offline count, and a budget's window is filled to at least 85% of it
and never past it. Anthropic publishes no tokenizer: its count is the o200k
count times a factor that stays above the published ratios. Without the
tokenizer package every count falls back to the byte bound.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from capsulefs.core.journal.events import AssistantMessage, System, ToolCall, ToolResult, UserMessage
from capsulefs.core.render import byte_upper_bound, counter_for, counter_info, render
from capsulefs.core.render._count import text_counter
from capsulefs.testing.render_reference import gemini_reference


def _journal(n: int) -> list:
    out = [System(text="You are terse.")]
    for i in range(n):
        out += [UserMessage(text=f"Question {i}: how does the journal keep its chain when two hosts write? " * 2),
                ToolCall(call_id=f"call_{i}", name="read_file", arguments={"path": f"docs/part{i}.md"}),
                ToolResult(call_id=f"call_{i}", content="The journal is hash-chained per machine. " * 12),
                AssistantMessage(text=f"Answer {i}: each machine chains its own lines; a merge is their union.")]
    return out


def reference(body: dict) -> int:
    """A Chat request's tokens as OpenAI's cookbook counts them: 3 per
    message, its role and content, 3 to prime the reply; a call's name and
    arguments plus 7 for its markers."""
    tok = text_counter("o200k_base")
    n = 3
    for m in body["messages"]:
        n += 3 + tok(m["role"]) + tok(m.get("content") or "")
        for call in m.get("tool_calls") or ():
            n += 7 + tok(call["function"]["name"]) + tok(call["function"]["arguments"])
    return n


def test_known_counts_of_the_offline_tokenizers() -> None:
    assert text_counter("cl100k_base")("tiktoken is great!") == 6  # OpenAI's cookbook example
    assert text_counter("o200k_base")("hello world") == 2
    japanese = "日本語のテキストを数える"
    assert text_counter("o200k_base")(japanese) < text_counter("cl100k_base")(japanese)  # o200k's larger vocabulary


@pytest.mark.parametrize("text,count", [
    ("The quick brown fox jumps over the lazy dog.", 10),  # ai.google.dev/api/tokens, gemini-2.0-flash
    ("What is your name?", 5),  # google-genai's LocalTokenizer.count_tokens docstring, gemini-2.5-flash
    ("hello world", 2), ("what's the weather today", 6),  # Vertex AI's local count sample: 2, then 2 + 6 = 8
])
def test_known_gemini_counts(text: str, count: int) -> None:
    assert text_counter("gemma")(text) == count
    assert counter_info("gemini", "gemini-2.5-pro") == counter_info("gemini", "gemini-3.5-flash")
    assert counter_info("gemini", "gemini-2.5-pro").exact


def test_a_gemini_request_is_counted_within_ten_percent_of_google_s_count() -> None:
    from capsulefs.agents.reference.tools import TOOLS

    body = render(_journal(40), provider="gemini", model="gemini-2.5-pro", tools=TOOLS).body
    ours, ref = counter_for("gemini", "gemini-2.5-pro")(body), gemini_reference(body)
    assert ref <= ours <= 1.1 * ref, (ours, ref)


@pytest.mark.parametrize("budget", [2_000, 10_000])
def test_a_gemini_window_is_filled_to_85_percent_and_never_past_it(budget: int) -> None:
    out = render(_journal(200), provider="gemini", model="gemini-2.5-pro", budget=budget)
    assert out.dropped_units > 0
    assert 0.85 * budget <= gemini_reference(out.body) <= out.tokens <= budget


@pytest.mark.parametrize("model,encoding,exact", [
    ("gpt-4o", "o200k_base", True), ("gpt-4.1-mini", "o200k_base", True), ("gpt-5", "o200k_base", True),
    ("o3-mini", "o200k_base", True), ("gpt-4", "cl100k_base", True), ("gpt-3.5-turbo", "cl100k_base", True),
    ("llama-3-70b", "cl100k_base", False),
])
def test_openai_models_get_their_own_encoding(model: str, encoding: str, exact: bool) -> None:
    info = counter_info("openai-chat", model)
    assert (info.encoding, info.exact) == (encoding, exact)


def test_an_openai_request_is_counted_within_ten_percent_of_the_documented_count() -> None:
    body = render(_journal(40), provider="openai-chat", model="gpt-4o").body
    ours, ref = counter_for("openai-chat", "gpt-4o")(body), reference(body)
    assert ref <= ours <= 1.1 * ref, (ours, ref)
    assert byte_upper_bound(body) > 3 * ref  # what the budget used to count


@pytest.mark.parametrize("budget", [2_000, 10_000])
def test_a_budget_window_is_filled_to_85_percent_and_never_past_it(budget: int) -> None:
    out = render(_journal(200), provider="openai-chat", model="gpt-4o", budget=budget)
    assert out.dropped_units > 0
    assert 0.85 * budget <= reference(out.body) <= out.tokens <= budget


@pytest.mark.parametrize("provider,model,factor", [
    ("anthropic", "claude-sonnet-4-5", 1.3), ("anthropic", "claude-opus-4-7", 1.75),
    ("anthropic", "claude-opus-5", 1.75),
])
def test_providers_without_a_public_tokenizer_get_a_safe_estimate(provider: str, model: str, factor: float) -> None:
    info = counter_info(provider, model)
    assert info.factor == factor and not info.exact
    body = render(_journal(20), provider=provider, model=model).body
    plain = counter_for("openai-chat", "gpt-4o")(body)
    assert counter_for(provider, model)(body) >= factor * (plain - 3)


def test_the_tokenizer_loads_only_when_a_budget_is_counted() -> None:
    code = ("import sys\n"
            "import capsulefs.cli\n"
            "from capsulefs.core.render import render\n"
            "from capsulefs.core.journal.events import UserMessage\n"
            "render([UserMessage(text='hi')], provider='openai-chat', model='gpt-4o')\n"
            "assert 'splintr' not in sys.modules\n"
            "render([UserMessage(text='hi')], provider='openai-chat', model='gpt-4o', budget=100)\n"
            "assert 'splintr' in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


_WITHOUT_TOKENIZER = r"""
import hashlib, sys
sys.modules["splintr"] = None  # import splintr raises ImportError
from capsulefs.core.journal.events import Attachment, AssistantMessage, UserMessage
from capsulefs.core.render import byte_upper_bound, render
png = b"\x89PNG\r\n\x1a\n" + bytes(200)
pdf = b"%PDF-1.4 /Type /Pages /Type /Page /Type /Page %%EOF"
blobs = {hashlib.sha256(b).hexdigest(): b for b in (png, pdf)}
sp, sd = blobs
plain = [UserMessage(text="what are these?"), AssistantMessage(text="a picture and a paper " * 20),
         UserMessage(text="and now?")]
journal = [Attachment(blob=sp, media_type="image/png", size=len(png)),
           Attachment(blob=sd, media_type="application/pdf", size=len(pdf))] + plain
for provider in ("anthropic", "openai-chat", "openai-responses", "gemini"):
    out = render(journal, provider=provider, model="gpt-4o", budget=100_000, read_blob=blobs.__getitem__)
    without = render(plain, provider=provider, model="gpt-4o", budget=100_000)
    assert without.tokens >= byte_upper_bound(without.body) > 0, provider
    assert out.tokens - without.tokens >= 1600 + 2 * 3000, (provider, out.tokens, without.tokens)
print("rendered")
"""


def test_without_the_tokenizer_package_budgets_are_counted_by_bytes() -> None:
    """A broken install (no splintr-rs: its import fails, in a process of its
    own) still renders every provider's budgeted request, attachments
    included (each counted by its provider's formula), by the byte bound,
    which never undercounts; it says so once."""
    run = subprocess.run([sys.executable, "-c", _WITHOUT_TOKENIZER], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout == "rendered\n", run.stderr
    assert run.stderr.count("the splintr-rs package is missing") == 1, run.stderr
