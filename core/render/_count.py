"""Token counters: pluggable per provider, conservative unless a real encoding is given.

Rules:
  * A counter is a function from a JSON-able request (or a piece of one) to
    an int. The fitter trusts it: a fitted request never exceeds its budget
    *by the counter used*.
  * The default counter never undercounts. Every tokenizer the four providers
    use (byte-level BPE for OpenAI and Anthropic, SentencePiece with byte
    fallback for Gemini) spends at least one UTF-8 byte per text token, so the
    text's byte length bounds its tokens. We measure the JSON encoding of the
    whole request with non-ASCII escaped (``\\uXXXX`` is longer than the
    character's UTF-8 bytes), which also pays for the role markers and
    separators a provider adds around each message: they are fewer tokens
    than the JSON punctuation and keys that wrap the same message.
  * A provider may add text the body does not show: Anthropic prepends a
    tool-use system prompt (a few hundred tokens, per its docs) whenever
    tools are offered. Such hidden prompts are added as a fixed allowance
    (:data:`HIDDEN_WITH_TOOLS`) by the provider's default counter.
  * No tokenizer file can be fetched at run time here (network reaches only
    package registries) and none ships offline, so precise counting is opt-in:
    :func:`encoding_counter` turns any tokenizer's ``encode`` into a counter.

Theory of operation:
  ``json.dumps`` is C code; counting the whole 100k-event body costs about as
  much as serialising it once. The fitter calls the counter on single units
  (to estimate) and on the final body (to check).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

Counter = Callable[[Any], int]

#: Tokens a provider adds around one message (role markers, separators), used
#: by :func:`encoding_counter`. Generous: OpenAI documents 3-4.
MESSAGE_OVERHEAD = 8

_dumps = json.JSONEncoder(ensure_ascii=True, separators=(",", ":")).encode


def byte_upper_bound(obj: Any) -> int:
    """Length of ``obj`` as compact ASCII JSON: never fewer than its tokens."""
    return len(_dumps(obj))


def encoding_counter(encode: Callable[[str], Sequence[int]]) -> Counter:
    """A counter from a real tokenizer: tokens of every string plus per-object overhead.

    Strings are counted with ``encode``; each JSON object (a message, a block)
    adds :data:`MESSAGE_OVERHEAD`, which covers keys and role markers.
    """

    def count(obj: Any) -> int:
        total = 0
        stack = [obj]
        while stack:
            x = stack.pop()
            if isinstance(x, str):
                total += len(encode(x))
            elif isinstance(x, dict):
                total += MESSAGE_OVERHEAD
                stack.extend(x.values())
            elif isinstance(x, (list, tuple)):
                stack.extend(x)
            elif x is not None:
                total += 1  # numbers and booleans
        return total

    return count


#: Tokens a provider adds to a request that offers tools, beyond the tools'
#: own JSON. Anthropic documents 313-346 for its tool-use system prompt.
HIDDEN_WITH_TOOLS = {"anthropic": 500}


def _with_hidden_prompt(extra: int) -> Counter:
    def count(obj: Any) -> int:
        hidden = extra if isinstance(obj, dict) and obj.get("tools") else 0
        return byte_upper_bound(obj) + hidden

    return count


#: The counter each provider uses unless the caller passes one.
DEFAULT_COUNTERS: dict[str, Counter] = {
    "anthropic": _with_hidden_prompt(HIDDEN_WITH_TOOLS["anthropic"]),
    "openai-chat": byte_upper_bound,
    "openai-responses": byte_upper_bound,
    "gemini": byte_upper_bound,
}


def counter_for(provider: str) -> Counter:
    return DEFAULT_COUNTERS.get(provider, byte_upper_bound)
