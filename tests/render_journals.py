"""Journals for the render tests: a record builder and hypothesis strategies."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st

from capsulefs.core.journal.events import (
    AssistantMessage,
    Event,
    MemoryEdit,
    ModelSwitch,
    Note,
    Reasoning,
    System,
    ToolCall,
    ToolResult,
    ToolsOffered,
    UserMessage,
)
from capsulefs.core.journal.record import Record

MACHINE = "host-a"

#: Every (provider, model) pair the strategies produce reasoning for.
TARGETS = [
    ("anthropic", "claude-a"),
    ("anthropic", "claude-b"),
    ("openai-chat", "gpt-c"),
    ("openai-responses", "gpt-r"),
    ("openai-responses", "gpt-s"),
    ("gemini", "gem-a"),
    ("gemini", "gem-b"),
    ("gemini", "gemini-3-pro-preview"),  # insists on signed calls in the current turn
]


def records(events: Sequence[Event], *, machine: str = MACHINE, start: int = 1) -> list[Record]:
    """Records on one machine, one second apart, in the given order."""
    out = []
    for i, ev in enumerate(events, start):
        out.append(
            Record(
                id=f"{i:024x}",
                machine=machine,
                seq=i,
                clock=i,
                prev=None,
                time=f"2026-01-01T{i // 3600 % 24:02d}:{i // 60 % 60:02d}:{i % 60:02d}.000Z",
                event=ev,
            )
        )
    return out


def reasoning(provider: str, model: str, marker: str) -> Reasoning:
    """A reasoning event in the provider's own shape, carrying ``marker`` in its opaque data."""
    if provider == "anthropic":
        data = {"type": "thinking", "thinking": f"thinking {marker}", "signature": marker}
        fmt = "anthropic.thinking"
    elif provider == "openai-responses":
        data = {"type": "reasoning", "id": f"rs_{marker}", "summary": [], "encrypted_content": marker}
        fmt = "openai-responses.reasoning"
    elif provider == "gemini":
        data = {"thoughtSignature": marker}
        fmt = "gemini.thought_signature"
    else:  # Chat Completions has no reasoning to replay; record something opaque anyway
        data = {"opaque": marker}
        fmt = "openai-chat.reasoning"
    return Reasoning(provider=provider, model=model, payload_format=fmt, data=data)


_text = st.one_of(
    st.text(max_size=30),
    st.text(alphabet=st.characters(codec="utf-8"), min_size=200, max_size=3000),
    st.sampled_from(["", "   ", "\n"]),
)
_ids = st.sampled_from(["c1", "c2", "c3", "c4", "toolu_01AbC", "call with spaces/∂", "x" * 60])
_names = st.sampled_from(["read_file", "grep", "my.tool", "9lives", "run"])
_args = st.dictionaries(st.sampled_from(["path", "n", "q"]), st.one_of(st.integers(), st.text(max_size=20)), max_size=3)


@st.composite
def _reasoning(draw) -> Reasoning:
    provider, model = draw(st.sampled_from(TARGETS))
    return reasoning(provider, model, f"mk{draw(st.integers(0, 10**9)):010d}")


@st.composite
def _parallel_calls(draw) -> list[Event]:
    ids = draw(st.lists(_ids, min_size=2, max_size=4, unique=True))
    calls: list[Event] = [ToolCall(call_id=i, name=draw(_names), arguments=draw(_args)) for i in ids]
    answered = draw(st.lists(st.sampled_from(ids), unique=True))
    return calls + [ToolResult(call_id=i, content=draw(_text), is_error=draw(st.booleans())) for i in answered]


_single: st.SearchStrategy[Event] = st.one_of(
    st.builds(UserMessage, text=_text),
    st.builds(AssistantMessage, text=_text),
    _reasoning(),
    st.builds(ToolCall, call_id=_ids, name=_names, arguments=_args),
    st.builds(ToolResult, call_id=_ids, content=_text, is_error=st.booleans()),
    st.builds(ModelSwitch, provider=st.sampled_from([p for p, _ in TARGETS]), model=st.sampled_from(["claude-a", "gpt-r"])),
    st.builds(Note, text=_text),
    st.builds(System, text=st.text(max_size=40)),
    st.builds(MemoryEdit, text=st.text(max_size=20)),
    st.builds(ToolsOffered, tools=st.lists(st.sampled_from(["read_file", "grep", "run"]), unique=True).map(
        lambda names: [{"name": n, "description": f"{n} it"} for n in names])),
)


@st.composite
def journals(draw, max_size: int = 40) -> list[Event]:
    """Random journals: dangling, parallel and orphan calls, reasoning of many models, switches."""
    chunks = draw(st.lists(st.one_of(_single.map(lambda e: [e]), _parallel_calls()), max_size=max_size))
    return [e for chunk in chunks for e in chunk]
