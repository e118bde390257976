"""Token counters: each provider's tokens, counted with a real tokenizer where one is public.

Rules:
  * A counter is a function from a JSON-able request (or a piece of one) to
    an int. The fitter trusts it: a fitted request never exceeds its budget
    *by the counter used*, so a budget means real tokens exactly as far as
    the counter matches the provider's.
  * OpenAI publishes its tokenizers: ``o200k_base`` (gpt-4o, gpt-4.1,
    gpt-4.5, gpt-5, the o-series, gpt-oss) and ``cl100k_base`` (gpt-4,
    gpt-3.5). Gemini's is the SentencePiece vocabulary of Gemma 3 (262k
    pieces; Gemma 4 has the same), ``gemma`` here. All three are counted
    exactly, offline: the ``splintr-rs`` package compiles the vocabularies
    into its binary (nothing is downloaded), through its public API.
  * A request's tokens are those of every string in it (values and keys:
    a tool's parameter names are keys), one per number, and one per JSON
    object, which stands for the role markers and separators the provider
    puts around each message (OpenAI documents 3 per message: the keys
    ``role`` and ``content`` and the object's own one), plus
    :data:`PER_REQUEST` for the reply's priming. OpenAI's and Gemini's
    counters skip call ids (:data:`ID_KEYS`), which their models never see;
    Gemini's counts its format's own keys as 0 (:data:`FORMAT_KEYS`), as
    Google's count does.
  * Anthropic publishes no tokenizer for its current models, so its count
    is a calibrated estimate: the o200k count of the same request times a
    factor (:data:`FACTORS`) chosen to stay above the real count
    (docs/render.md gives the sources and measurements). An unknown model
    of an OpenAI-compatible server gets cl100k times 1.1.
  * What the body does not show is added as a fixed allowance: the hidden
    system prompt Anthropic adds when tools are offered
    (:data:`HIDDEN_WITH_TOOLS`); an attachment's tokens are the provider's
    own formula for it, carried by its marker (``_base.BlobData.tokens``)
    and never multiplied by the factor.
  * Without the tokenizer package (it is a dependency; only a broken
    install lacks it), every counter falls back to the byte bound
    (:func:`byte_upper_bound`), which never undercounts: safe, but it fills
    only a quarter to a third of the window.

Theory of operation: the tokenizer is imported and its vocabulary loaded
(0.05-2 s: Gemma's is the slowest) the first time a budget is counted, never at
import. The fitter counts each unit it keeps once and the final body once
or twice, so the cost grows with the budget, not with the journal.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

Counter = Callable[[Any], int]

#: Tokens a provider adds to every request (OpenAI: the reply's priming, 3).
PER_REQUEST = 3

#: Tokens a provider adds to a request that offers tools, beyond the tools'
#: own JSON. Anthropic documents 313-346 for its tool-use system prompt.
HIDDEN_WITH_TOOLS = {"anthropic": 500}

#: The Claude models from 4.7 on (a tokenizer of their own; images up to
#: 3.75 megapixels, see _base.anthropic_image_tokens).
CLAUDE_4_7_ON = r"claude-(?:opus|sonnet|haiku)-(?:4-(?:[7-9]|\d\d)|[5-9]|\d\d)\b"

#: (provider, model pattern) -> (encoding, factor); the first match wins.
#: Sources and measurements: docs/render.md, "Token counting".
FACTORS: tuple[tuple[str, re.Pattern[str], str, float], ...] = (
    ("openai", re.compile(r"(?:.*/)?(?:gpt-4o|chatgpt-4o|gpt-4\.1|gpt-4\.5|gpt-5|gpt-oss|o1|o3|o4|codex)\b.*"),
     "o200k_base", 1.0),
    ("openai", re.compile(r"(?:.*/)?(?:gpt-4|gpt-3\.5|text-embedding)\b.*"), "cl100k_base", 1.0),
    ("openai", re.compile(r".*"), "cl100k_base", 1.1),
    # Claude Opus 4.7 and later: a new tokenizer, up to 1.35x the tokens of the one before
    ("anthropic", re.compile(CLAUDE_4_7_ON + ".*"), "o200k_base", 1.75),
    ("anthropic", re.compile(r".*"), "o200k_base", 1.3),
    ("gemini", re.compile(r".*"), "gemma", 1.0),
)

#: Keys of a provider's request format that its count does not include
#: (Google counts a Gemini request's texts, call names, arguments and
#: results, not the JSON around them): counted as 0 tokens. A key of the
#: same spelling inside a call's arguments is then not counted either; the
#: token each JSON object counts covers it.
FORMAT_KEYS = {"gemini": frozenset({
    "contents", "role", "parts", "text", "thought", "thoughtSignature", "functionCall", "functionResponse",
    "name", "args", "response", "id", "inlineData", "mimeType", "data", "systemInstruction", "tools",
    "functionDeclarations", "description", "parametersJsonSchema", "generationConfig", "maxOutputTokens"})}

#: Our encoding names -> the vocabulary bundled in splintr-rs. ``gemma`` is
#: splintr's Gemma 4 bundle (Apache-2.0): the same pieces and ids as Gemma
#: 3's (checked, docs/render.md), which Google's own local tokenizer uses
#: for Gemini 2.x and 3 (its Gemma 3 copy is under the Gemma Terms of Use).
VOCABULARIES = {"o200k_base": "o200k_base", "cl100k_base": "cl100k_base", "gemma": "gemma4"}


def byte_upper_bound(obj: Any) -> int:
    """Length of ``obj`` as compact ASCII JSON: never fewer than its tokens
    (every tokenizer spends at least one UTF-8 byte per text token). An
    attachment's marker counts as the provider's tokens for it, as in
    :func:`encoding_counter`, not as its base64."""
    fixed = 0

    def marker(x: Any) -> str:
        nonlocal fixed
        tokens = getattr(x, "tokens", None)
        if not isinstance(tokens, int):
            raise TypeError(f"{type(x).__name__} has no place in a request body")
        fixed += tokens
        return ""

    return len(json.JSONEncoder(ensure_ascii=True, separators=(",", ":"), default=marker).encode(obj)) + fixed


_ENCODERS: dict[str, Callable[[str], int] | None] = {}


@functools.cache
def _tokenizers() -> Any | None:
    """The splintr module, imported once; None if it is missing (logged once)."""
    try:
        import splintr
    except ImportError:
        log.warning("the splintr-rs package is missing: token budgets are counted by bytes "
                    "(safe, but they fill a quarter to a third of the window)")
        return None
    return splintr


def text_counter(encoding: str) -> Callable[[str], int] | None:
    """A function counting one string's tokens with ``encoding`` (a key of
    :data:`VOCABULARIES`), loaded once; None if the tokenizer package is
    missing."""
    if encoding not in _ENCODERS:
        splintr = _tokenizers()
        if splintr is None:
            _ENCODERS[encoding] = None
        else:
            encode = splintr.Tokenizer.from_pretrained(VOCABULARIES[encoding]).encode_ordinary

            def count(s: str) -> int:
                return len(encode(s))

            _ENCODERS[encoding] = count
    return _ENCODERS[encoding]


#: Keys whose values are call ids: OpenAI's models do not see them (its
#: chat format names a call by its function), nor does Google's count of a
#: Gemini request, so their counters skip them.
ID_KEYS = frozenset({"id", "call_id", "tool_call_id"})


class EncodingCounter:
    """A counter from a tokenizer (see :func:`encoding_counter`). Called, it
    counts a request; :meth:`memoized` gives a copy that remembers each
    string's tokens, for the many counts of one render (the fitter measures
    the same units several times; one render's strings, never kept longer)."""

    def __init__(self, encode: Callable[[str], Sequence[int] | int], *, factor: float = 1.0,
                 hidden_with_tools: int = 0, skip_ids: bool = False,
                 keys: dict[str, int] | None = None, memo: dict[str, int] | None = None) -> None:
        self.encode = encode
        self.factor = factor
        self.hidden_with_tools = hidden_with_tools
        self.skip_ids = skip_ids
        self.keys: dict[str, int] = {} if keys is None else keys  # JSON keys: few, counted once for good
        # (a provider's FORMAT_KEYS are in it as 0)
        self.memo = memo

    def memoized(self) -> "EncodingCounter":
        return EncodingCounter(self.encode, factor=self.factor, hidden_with_tools=self.hidden_with_tools,
                               skip_ids=self.skip_ids, keys=self.keys, memo={})

    def __call__(self, obj: Any) -> int:
        encode, keys, memo = self.encode, self.keys, self.memo
        skipped = ID_KEYS if self.skip_ids else frozenset()

        def tokens(s: str) -> int:
            n = encode(s)
            return n if isinstance(n, int) else len(n)

        total = 0
        fixed = 0  # provider-counted tokens (attachments): not scaled
        stack = [obj]
        pop, push, extend = stack.pop, stack.append, stack.extend
        while stack:
            x = pop()
            t = type(x)
            if t is str:
                if x:
                    if memo is None:
                        total += tokens(x)
                    else:
                        n = memo.get(x)
                        if n is None:
                            n = memo[x] = tokens(x)
                        total += n
            elif t is dict:
                total += 1
                for k, v in x.items():
                    n = keys.get(k)
                    if n is None:
                        n = keys[k] = tokens(k)
                    total += n
                    if k not in skipped:
                        push(v)
            elif t is list or t is tuple:
                extend(x)
            elif x is None:
                continue
            elif hasattr(x, "tokens"):  # an attachment's marker
                fixed += x.tokens
            else:
                total += 1  # numbers and booleans
        hidden = self.hidden_with_tools if type(obj) is dict and obj.get("tools") else 0
        return (math.ceil(total * self.factor) + fixed + hidden
                + (PER_REQUEST if type(obj) is dict and "model" in obj else 0))


def encoding_counter(encode: Callable[[str], Sequence[int] | int], *, factor: float = 1.0,
                     hidden_with_tools: int = 0, skip_ids: bool = False,
                     format_keys: frozenset[str] = frozenset()) -> EncodingCounter:
    """A counter from a tokenizer: ``encode`` returns a string's tokens (or
    their number); ``format_keys`` are JSON keys it counts as 0. See the
    module rules for what is counted."""
    return EncodingCounter(encode, factor=factor, hidden_with_tools=hidden_with_tools, skip_ids=skip_ids,
                           keys=dict.fromkeys(format_keys, 0))


def per_render(counter: Counter) -> Counter:
    """The counter one render uses: a tokenizer's remembers its strings'
    counts for that render (:meth:`EncodingCounter.memoized`); any other as it is."""
    return counter.memoized() if isinstance(counter, EncodingCounter) else counter


@dataclass(frozen=True, slots=True)
class CounterInfo:
    """How a provider's model is counted (for ``--stats`` and the docs)."""

    encoding: str
    factor: float
    exact: bool  # the provider's own tokenizer (counting the request as ours does), not an estimate


def counter_info(provider: str, model: str) -> CounterInfo:
    family = "openai" if provider.startswith("openai") else provider
    for fam, pattern, encoding, factor in FACTORS:
        if fam == family and pattern.fullmatch(model):
            return CounterInfo(encoding, factor, exact=factor == 1.0)
    return CounterInfo("o200k_base", 1.3, exact=False)


_COUNTERS: dict[tuple[str, str], Counter] = {}


def counter_for(provider: str, model: str = "") -> Counter:
    """The counter for ``provider``'s ``model`` (see the module rules)."""
    info = counter_info(provider, model)
    key = (provider, f"{info.encoding}*{info.factor}")
    counter = _COUNTERS.get(key)
    if counter is None:
        encode = text_counter(info.encoding)
        hidden = HIDDEN_WITH_TOOLS.get(provider, 0)
        if encode is None:
            counter = _bytes_with_hidden(hidden)
        else:
            counter = encoding_counter(encode, factor=info.factor, hidden_with_tools=hidden,
                                       skip_ids=provider.startswith("openai") or provider == "gemini",
                                       format_keys=FORMAT_KEYS.get(provider, frozenset()))
        _COUNTERS[key] = counter
    return counter


def _bytes_with_hidden(extra: int) -> Counter:
    def count(obj: Any) -> int:
        hidden = extra if isinstance(obj, dict) and obj.get("tools") else 0
        return byte_upper_bound(obj) + hidden

    return count
