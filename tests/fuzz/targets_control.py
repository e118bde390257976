"""Fuzz targets: one write to a ``.control`` file, parsed as the view parses it.

Each ``run`` takes the bytes of one ``write()`` and, when the view would
accept them, checks what a user relies on (an AssertionError is a finding,
like any exception that is not a CapsuleError):

  * model: what is accepted is a known provider (never an alias) and a
    model, and the line ``.control/model`` then shows reads back as the same
    switch; the event it appends is one the journal takes.
  * move, abandon: one line of text, no control character, no spaces
    around it, at most MAX_CONTROL_LINE bytes.
  * remove: accepted only for exactly the agent's id, with at most the
    newline ``echo`` adds: nothing else can remove an agent.
  * learn: the write goes through the handle the mount opens for
    ``.control/learn`` (MoveHandle) to a recording mover: accepted, it asks
    the mover to learn about this agent, once, and nothing else; refused, the
    mover is never called. What is accepted is one line as ``move`` takes.
"""

from __future__ import annotations

from collections.abc import Coroutine
from pathlib import Path
from typing import Any, cast

from capsulefs.core.journal.events import ModelSwitch
from capsulefs.core.view.control import (
    MAX_CONTROL_LINE,
    MoveHandle,
    check_removal,
    control_line,
    parse_model_line,
)
from capsulefs.core.render import PROVIDER_ALIASES, PROVIDERS

from . import Target

AGENT_ID = "0123456789abcdef0123456789abcdef"
HOST_ID = "FUZZHOSTAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"


def _model_seeds() -> list[bytes]:
    return [b"anthropic:claude-sonnet-4-5\n", b"openai:gpt-5\n", b" openai-chat:gpt-4o \r\n", b"gemini:gemini-2.5-pro",
            b"openai-responses:o3:high\n", "anthropic:claude-\u00e9\n".encode()]


def _run_model(data: bytes, scratch: Path) -> None:
    provider, model = parse_model_line(data)
    assert provider in PROVIDERS and provider not in PROVIDER_ALIASES, provider
    assert model and model == model.strip(" ")
    ev = ModelSwitch(provider=provider, model=model)  # the journal takes it
    shown = f"{ev.provider}:{ev.model}\n".encode()  # what .control/model reads back (LiveAgent.model_bytes)
    assert parse_model_line(shown) == (provider, model), shown


def _line_seeds() -> list[bytes]:
    return [b"laptop\n", HOST_ID.encode() + b"\n", b"the peer is gone for good\n", b" b \r\n"]


def _run_line(data: bytes, scratch: Path) -> None:
    for what in (".control/move", ".control/abandon"):
        text = control_line(data, what)
        assert text and text == text.strip(" ") and len(text.encode()) <= MAX_CONTROL_LINE
        assert not any(ord(c) < 32 or 0x7F <= ord(c) < 0xA0 for c in text), text


def _remove_seeds() -> list[bytes]:
    return [AGENT_ID.encode() + b"\n", AGENT_ID.encode()]


def _run_remove(data: bytes, scratch: Path) -> None:
    check_removal(data, AGENT_ID)
    assert data in (AGENT_ID.encode(), AGENT_ID.encode() + b"\n"), data


class _RecordingMover:
    """A Mover that records each call and returns at once (no trio: nothing awaits)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []

    async def move(self, agent_id: str, target: str) -> None:
        self.calls.append(("move", agent_id, target))

    async def abandon(self, agent_id: str, why: str) -> None:
        self.calls.append(("abandon", agent_id, why))

    async def learn(self, agent_id: str) -> None:
        self.calls.append(("learn", agent_id))


class _View:
    def check_lease(self) -> None:
        pass  # (a view without a write guard, as a peer-to-peer mount's)


class _Agent:
    agent_id = AGENT_ID
    host = _View()


def _complete(coro: Coroutine[Any, Any, int]) -> int:
    """Run a coroutine that never suspends (its awaits all return at once) to its end."""
    try:
        coro.send(None)
    except StopIteration as done:
        return cast(int, done.value)
    coro.close()
    raise AssertionError("the write suspended: a recording mover never waits")


def _learn_seeds() -> list[bytes]:
    return [b"learn\n", b"1\n", b"who holds it?\n", b"yes"]


def _run_learn(data: bytes, scratch: Path) -> None:
    mover = _RecordingMover()
    handle = MoveHandle(_Agent(), "learn", mover)  # type: ignore[arg-type]  # (it reads the agent's id and view only)
    try:
        written = _complete(handle.write_async(0, data))
    except BaseException:
        assert mover.calls == [], mover.calls  # refused: nothing was asked
        raise
    assert written == len(data)
    assert mover.calls == [("learn", AGENT_ID)], mover.calls
    text = control_line(data, ".control/learn")  # (accepted: one line, as move and abandon take it)
    assert text and len(text.encode()) <= MAX_CONTROL_LINE


TARGETS = [
    Target("control_model", _model_seeds, _run_model),
    Target("control_move_abandon", _line_seeds, _run_line),
    Target("control_remove", _remove_seeds, _run_remove),
    Target("control_learn", _learn_seeds, _run_learn),
]
