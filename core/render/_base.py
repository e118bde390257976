"""What every provider module supplies, and the neutral tool description.

Rules:
  * A provider turns plan items (see :mod:`._plan`) into the exact JSON body
    its HTTP API takes, parses that API's response body back into journal
    events, and checks a body against its own pairing rules.
  * Reasoning items reach a provider only if their ``provider`` and ``model``
    equal the target's and their ``payload_format`` is one the provider
    replays; the provider then emits ``data`` verbatim, where it stood.
  * Bodies are plain dicts of JSON values; nothing is shared with the events
    (mutating a body never changes the journal).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import FormatError
from ..events import Event, Reasoning


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolSpec:
    """A tool the model may call, in neutral form."""

    name: str  # function name (letters, digits, _ and -)
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise FormatError("tool name must be a non-empty string")
        if not isinstance(self.parameters, Mapping):
            raise FormatError(f"tool {self.name}: parameters must be a JSON schema object")


class Provider:
    """Base of the provider modules' singletons. Subclasses fill every method."""

    id: str = ""
    replays: frozenset[str] = frozenset()  # reasoning payload formats it sends back

    def keeps(self, item: Reasoning, model: str) -> bool:
        """True if this reasoning goes back to the target ``model`` of this provider."""
        return item.provider == self.id and item.model == model and item.payload_format in self.replays

    def body(
        self,
        items: list[tuple],
        *,
        model: str,
        system: str | None,
        tools: Sequence[ToolSpec],
        max_output: int | None,
    ) -> dict[str, Any]:
        raise NotImplementedError

    def fragment(self, items: list[tuple], *, model: str) -> Any:
        """The JSON these items add to a body; the fitter counts it to estimate."""
        raise NotImplementedError

    def parse(self, response: Mapping[str, Any], *, model: str, new_id: Any = None) -> list[Event]:
        raise NotImplementedError

    def check(self, body: Mapping[str, Any]) -> list[str]:
        """Every way ``body`` breaks this provider's pairing rules; empty if none."""
        raise NotImplementedError


def error_text(content: str, is_error: bool) -> str:
    """A tool result as plain text for APIs with no error flag."""
    return f"[error] {content}" if is_error else content


def args_json(arguments: Mapping[str, Any]) -> str:
    return json.dumps(arguments, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def args_from_json(raw: Any) -> dict[str, Any]:
    """Tool arguments as the model sent them; unparsable text is kept under one key."""
    if isinstance(raw, Mapping):
        return dict(raw)
    try:
        value = json.loads(raw) if isinstance(raw, str) and raw.strip() else {}
    except json.JSONDecodeError:
        return {"_unparsed_arguments": raw}
    return value if isinstance(value, dict) else {"_unparsed_arguments": raw}


def verbatim(obj: Mapping[str, Any]) -> dict[str, Any]:
    """A provider object without the ``None`` fields SDK dumps add."""
    return {k: v for k, v in obj.items() if v is not None}
