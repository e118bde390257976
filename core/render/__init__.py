"""Render the journal as one provider's request body; parse its replies back into events.

Rules:
  * Rendering is a pure function of (journal, target provider, target model,
    working memory, budget, counter, tools). The journal is never rewritten.
  * ``model_switch`` events choose the default target; rendering for a given
    target ignores them, so rendering for model A, then B, then A again gives
    A's request exactly as if no switch had happened.
  * Private reasoning goes back only to the exact provider and model that
    produced it, verbatim and in place; for any other target it is dropped.
  * Every tool call is answered (an interrupted one by an explicit error
    result); a result with no call is never sent as a tool result.
  * Requests are self-contained: the tools of the journal's last ``tools``
    event (or the caller's) go with the history, as the provider's ``tools``.
  * With a budget, the newest units that fit are kept and a deterministic
    digest of the rest opens the conversation; the body never exceeds the
    budget by the counter used (:class:`BudgetTooSmall` if even the system
    prompt and digest cannot fit, :class:`NewestTooLarge` if the newest unit
    cannot: it is never left out).

Providers and the reasoning each replays (``Reasoning.payload_format``, ``data``)::

    anthropic         Messages API        anthropic.thinking           the thinking block
                                          anthropic.redacted_thinking  the redacted_thinking block
    openai-chat       Chat Completions    (none: the API takes no reasoning back)
    openai-responses  Responses API       openai-responses.reasoning   the reasoning item
    gemini            generateContent     gemini.thought_signature     {"thoughtSignature": ...},
                                                                       rides on the next part
                                          gemini.thought               {"part": the thought part}

Theory of operation: :func:`._plan.plan` pairs and cuts the journal into
units once; a provider module (``PROVIDERS[id]``) turns the kept units into
its JSON; :func:`._plan.fit` chooses the window with the provider's counter.
Each provider module also parses its API's response body into events
(:func:`parse_response`) and checks a body against its pairing rules
(:func:`check_request`), which the tests and the stub server use.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ..journal.events import Event
from ..journal.record import Record
from ._base import Provider, ToolSpec, resolve, sniff_media_type
from ._count import Counter, CounterInfo, byte_upper_bound, counter_for, counter_info, encoding_counter, per_render
from ._plan import INTERRUPTED, BudgetTooSmall, Item, NewestTooLarge, RenderError, plan
from ._fit import fit
from .anthropic import PROVIDER as _ANTHROPIC
from .gemini import PROVIDER as _GEMINI
from .openai_chat import PROVIDER as _CHAT
from .openai_responses import PROVIDER as _RESPONSES

__all__ = [
    "INTERRUPTED",
    "MAX_ATTACHMENT",
    "PROVIDERS",
    "PROVIDER_ALIASES",
    "BudgetTooSmall",
    "NewestTooLarge",
    "Counter",
    "CounterInfo",
    "Provider",
    "RenderError",
    "Rendered",
    "ToolSpec",
    "byte_upper_bound",
    "check_request",
    "counter_for",
    "counter_info",
    "encoding_counter",
    "get_provider",
    "parse_response",
    "render",
    "sniff_media_type",
    "system_prompt",
]

#: Provider id -> its module's singleton. The ids are the journal's spelling.
PROVIDERS: dict[str, Provider] = {p.id: p for p in (_ANTHROPIC, _CHAT, _RESPONSES, _GEMINI)}
#: Short names people type (``echo openai:gpt-5 > .control/model``) -> the
#: provider id journaled for them. ``openai`` is the Responses API, OpenAI's
#: API for its reasoning models (their reasoning items go back to them).
PROVIDER_ALIASES: dict[str, str] = {"openai": _RESPONSES.id}
#: The largest attachment any provider takes (bytes): what an agent may
#: upload as a blob through the mount (``core.view.uploads``).
MAX_ATTACHMENT = max(size for p in PROVIDERS.values() for size in p.accepts.values())


@dataclass(frozen=True, slots=True)
class Rendered:
    body: dict[str, Any]  # the JSON body for the provider's HTTP API
    provider: str
    model: str  # also inside body, except for Gemini (where it is in the URL)
    tokens: int | None  # the counter's value for body, when a budget was given
    kept_units: int  # units of conversation sent
    dropped_units: int  # units replaced by the digest


def pdf_pages(data: bytes) -> int | None:
    """A PDF's page count by its page objects; None if it shows none."""
    n = data.count(b"/Type /Page") + data.count(b"/Type/Page") - data.count(b"/Type /Pages") - data.count(b"/Type/Pages")
    return n if n > 0 else None


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for one render (as Mercurial's
    ``util.nogc`` does around its large parses). A render makes hundreds of
    thousands of containers that live until it returns (units, items, the
    body); each few hundred made start a collection, and the full ones
    traverse the caller's whole heap, the journal's records included: over
    half of a long journal's render time, measured. A render makes no
    reference cycles that outlive it, so nothing waits for the collector;
    it is resumed on return (unless someone else had paused it). Used as
    a decorator on :func:`render`."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def get_provider(provider: str) -> Provider:
    try:
        return PROVIDERS[provider]
    except KeyError:
        raise RenderError(f"unknown provider {provider!r}; known: {', '.join(sorted(PROVIDERS))}") from None


def system_prompt(system: Sequence[str], working_memory: str | None) -> str | None:
    """The current system prompt (the plan's: the last system event), then
    the working memory in a marked section."""
    parts = [s for s in system if s]
    if working_memory:
        parts.append(f"<working_memory>\n{working_memory}\n</working_memory>")
    return "\n\n".join(parts) or None


@_collector_paused()
def render(
    journal: Iterable[Record | Event],
    *,
    provider: str | None = None,
    model: str | None = None,
    working_memory: str | None = None,
    budget: int | None = None,
    counter: Counter | None = None,
    tools: Sequence[ToolSpec] | None = None,
    max_output: int | None = None,
    read_blob: Callable[[str], bytes] | None = None,
) -> Rendered:
    """Render ``journal`` (records in any order, or events in order) for one target.

    ``provider``/``model`` default to the journal's last ``model_switch``; a
    ``provider`` given alone takes the model of its own last ``model_switch``.
    ``budget`` is in tokens by ``counter`` (default: the provider's
    tokenizer or calibrated estimate for ``model``, see :func:`counter_for`); ``None`` sends everything. ``max_output`` is the
    reply's token limit (required by Anthropic, default 4096 there).
    ``tools`` overrides the tools the journal's last ``tools`` event offers.
    ``read_blob(sha256) -> bytes`` gives the attachments' bytes (a
    :class:`RenderError` if the request holds one and it is missing).
    """
    p = plan(journal)
    if provider is not None and model is None:
        # that provider's own last model: the last switch may name another provider's
        get_provider(provider)
        model = p.models.get(provider)
        if model is None:
            raise RenderError(f"no model given for {provider} and the journal never switched to {provider}")
    elif provider is None or model is None:
        if p.target is None:
            raise RenderError("no provider/model given and the journal has no model_switch event")
        provider = provider or p.target[0]
        model = model or p.target[1]
    if budget is not None and budget < 1:
        raise RenderError(f"budget must be a positive number of tokens, not {budget}")
    if tools is None:  # the journal's: the last tools event
        tools = [ToolSpec(name=t["name"], description=t.get("description", ""),
                          parameters=t.get("parameters") or {"type": "object", "properties": {}})
                 for t in p.tools or ()]
    prov = get_provider(provider)
    read: dict[str, bytes] = {}  # PDFs read for their pages, until the body takes them

    def pages(sha: str) -> int | None:
        assert read_blob is not None
        data = read[sha] = read_blob(sha)
        return pdf_pages(data)

    if p.attachments:  # the newest that one request may carry; PDFs' pages read from the newest on
        prov.limit_attachments(p.units, pages if read_blob is not None else None)
    count = per_render(counter or (counter_for(provider, model) if budget is not None else byte_upper_bound))
    system = system_prompt(p.system, working_memory)

    def build(items: list[Item]) -> dict[str, Any]:
        return prov.body(items, model=model, system=system, tools=tools, max_output=max_output)

    def cost(items: list[Item]) -> int:
        return count(prov.fragment(items, model=model))

    body, kept, tokens = fit(p.units, budget, build, cost, count)
    if p.attachments:
        body = resolve(body, None if read_blob is None else lambda sha: read.pop(sha, None) or read_blob(sha))
    return Rendered(
        body=body,
        provider=provider,
        model=model,
        tokens=tokens,
        kept_units=kept,
        dropped_units=len(p.units) - kept,
    )


def parse_response(
    provider: str, response: Mapping[str, Any], *, model: str, new_id: Callable[[int], str] | None = None
) -> list[Event]:
    """The events one reply body of ``provider`` holds, in order, tagged with ``model``.

    ``model`` must be the model the request named (the one later renders
    will target), not a dated alias the reply may echo. ``new_id`` makes ids
    for calls the provider left without one (only Gemini does).
    """
    return get_provider(provider).parse(response, model=model, new_id=new_id)


def check_request(provider: str, body: Mapping[str, Any]) -> list[str]:
    """Every way ``body`` breaks ``provider``'s pairing rules; empty if it keeps them all."""
    return get_provider(provider).check(body)
