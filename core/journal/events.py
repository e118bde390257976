"""Journal events: the provider-neutral record of what happened to an agent.

Theory of operation:
  * A journal line is one :class:`~capsulefs.core.journal.record.Record`: an envelope (who wrote it, where it
    sits in that writer's hash chain, its Lamport clock) around one typed
    event. Events say what happened ("the assistant called tool X with these
    arguments"), never how one vendor spells it; renderers translate.
  * A line is canonical JSON (sorted keys, no spaces, UTF-8), so its sha256
    is its identity and the next line of the same machine chains to it.
  * Kinds this version does not know (written by a newer capsulefs) parse as
    :class:`UnknownEvent` and are re-serialised byte for byte: never dropped.
  * Events are frozen, slotted, keyword-only, and validate in their
    constructor; an invalid one cannot exist.

A line is one :class:`~capsulefs.core.journal.record.Record` (its layout is there).
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from ..errors import FormatError
from ..capsule.format import check_relpath, check_sha256, has_control

EVENT_VERSION = 1
ENVELOPE = ("v", "id", "machine", "seq", "clock", "prev", "time", "kind")
_KIND_RE = re.compile(r"[a-z][a-z0-9_.]{0,63}")


_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)




def canonical_json(obj: Any) -> bytes:
    """The one canonical JSON encoding: sorted keys, no spaces, UTF-8.
    (One encoder for every call: ``json.dumps`` with options builds a new one each time.)"""
    return _CANONICAL.encode(obj).encode()


def line_hash(line: bytes) -> str:
    """sha256 hex of a journal line's exact bytes, without its newline."""
    return hashlib.sha256(line).hexdigest()


def _need_str(value: object, what: str, *, empty: bool = True) -> str:
    if not isinstance(value, str):
        raise FormatError(f"{what} must be a string, not {type(value).__name__}")
    if not empty and not value:
        raise FormatError(f"{what} must not be empty")
    return value


def _need_opt_str(value: object, what: str) -> str | None:
    return None if value is None else _need_str(value, what)


# -- the kinds ---------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """Base of every event kind. ``KIND`` is the value of the ``kind`` key."""

    KIND: ClassVar[str] = ""

    @property
    def kind(self) -> str:
        return self.KIND

    def payload(self) -> dict[str, Any]:
        """The kind's own fields as JSON (without the envelope)."""
        out: dict[str, Any] = {}
        for name, optional in _payload_fields(type(self)):  # type: ignore[arg-type]  # a class is hashable
            value = getattr(self, name)
            if value is None and optional:
                continue  # optional fields are omitted when unset
            out[name] = value
        return out


@functools.cache
def _payload_fields(cls: type) -> tuple[tuple[str, bool], ...]:
    """(name, optional) of each field of an event class: fields() is slow."""
    return tuple((f.name, f.default is None) for f in fields(cls))




@dataclass(frozen=True, slots=True, kw_only=True)
class UserMessage(Event):
    KIND: ClassVar[str] = "user_message"
    text: str  # what the user said

    def __post_init__(self) -> None:
        _need_str(self.text, "user_message.text")


@dataclass(frozen=True, slots=True, kw_only=True)
class AssistantMessage(Event):
    KIND: ClassVar[str] = "assistant_message"
    text: str  # the visible reply
    provider: str | None = None  # which provider produced it, if known
    model: str | None = None  # which model produced it, if known

    def __post_init__(self) -> None:
        _need_str(self.text, "assistant_message.text")
        _need_opt_str(self.provider, "assistant_message.provider")
        _need_opt_str(self.model, "assistant_message.model")


@dataclass(frozen=True, slots=True, kw_only=True)
class Reasoning(Event):
    """Private reasoning. Only the exact provider and model may see it again."""

    KIND: ClassVar[str] = "reasoning"
    provider: str  # e.g. "anthropic", "openai", "gemini"
    model: str  # the exact model that produced it
    payload_format: str  # e.g. "anthropic.thinking", "openai.reasoning", "gemini.thought_signature"
    data: Mapping[str, Any]  # the opaque provider object, kept verbatim (signature, encrypted content...)
    text: str | None = None  # human-readable summary or thinking text, if the provider gave one

    def __post_init__(self) -> None:
        _need_str(self.provider, "reasoning.provider", empty=False)
        _need_str(self.model, "reasoning.model", empty=False)
        _need_str(self.payload_format, "reasoning.payload_format", empty=False)
        if not isinstance(self.data, Mapping):
            raise FormatError("reasoning.data must be a JSON object")
        _need_opt_str(self.text, "reasoning.text")


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCall(Event):
    KIND: ClassVar[str] = "tool_call"
    call_id: str  # pairs the call with its tool_result
    name: str  # tool name
    arguments: Mapping[str, Any]  # JSON object of arguments
    provider: str | None = None
    model: str | None = None

    def __post_init__(self) -> None:
        _need_str(self.call_id, "tool_call.call_id", empty=False)
        _need_str(self.name, "tool_call.name", empty=False)
        if not isinstance(self.arguments, Mapping):
            raise FormatError("tool_call.arguments must be a JSON object")
        _need_opt_str(self.provider, "tool_call.provider")
        _need_opt_str(self.model, "tool_call.model")


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolResult(Event):
    KIND: ClassVar[str] = "tool_result"
    call_id: str  # the tool_call this answers
    content: str  # the tool's output as text
    is_error: bool = False

    def __post_init__(self) -> None:
        _need_str(self.call_id, "tool_result.call_id", empty=False)
        _need_str(self.content, "tool_result.content")
        if not isinstance(self.is_error, bool):
            raise FormatError("tool_result.is_error must be true or false")


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryEdit(Event):
    """The new working memory: inline ``text``, or the sha256 of its blob."""

    KIND: ClassVar[str] = "memory_edit"
    text: str | None = None
    blob: str | None = None

    def __post_init__(self) -> None:
        if (self.text is None) == (self.blob is None):
            raise FormatError("memory_edit needs exactly one of text or blob")
        _need_opt_str(self.text, "memory_edit.text")
        if self.blob is not None:
            check_sha256(self.blob, "memory_edit.blob")


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkspaceUpdate(Event):
    """Workspace changes: path -> sha256 of its new blob, or None if deleted."""

    KIND: ClassVar[str] = "workspace_update"
    changes: Mapping[str, str | None]

    def __post_init__(self) -> None:
        if not isinstance(self.changes, Mapping) or not self.changes:
            raise FormatError("workspace_update.changes must be a non-empty object")
        for path, sha in self.changes.items():
            check_relpath(path, "workspace_update path")
            if sha is not None:
                check_sha256(sha, f"workspace_update.changes[{path!r}]")


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSwitch(Event):
    KIND: ClassVar[str] = "model_switch"
    provider: str
    model: str

    def __post_init__(self) -> None:
        _need_str(self.provider, "model_switch.provider", empty=False)
        _need_str(self.model, "model_switch.model", empty=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class Note(Event):
    """A remark for people (operator notes, moves, recoveries). Never rendered as dialogue."""

    KIND: ClassVar[str] = "note"
    text: str

    def __post_init__(self) -> None:
        _need_str(self.text, "note.text")


@dataclass(frozen=True, slots=True, kw_only=True)
class System(Event):
    """A system instruction for the model."""

    KIND: ClassVar[str] = "system"
    text: str

    def __post_init__(self) -> None:
        _need_str(self.text, "system.text")


_MEDIA_TYPE_RE = re.compile(r"[a-z0-9][a-z0-9!#$&^_.+-]{0,63}/[a-z0-9][a-z0-9!#$&^_.+-]{0,126}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Attachment(Event):
    """An image or document in the conversation: the sha256 of its bytes in
    ``artifacts/blobs/`` (the store keeps one copy however many agents hold it).

    With ``call_id`` it came with that tool call's result; without, the user
    sent it, with the user message next to it."""

    KIND: ClassVar[str] = "attachment"
    blob: str  # sha256 hex of the bytes, listed in the manifest as artifacts/blobs/<sha256>
    media_type: str  # e.g. image/png, application/pdf (lowercase type/subtype)
    size: int  # bytes
    name: str | None = None  # a file name, for people and for providers that want one
    call_id: str | None = None  # the tool call whose result carries it

    def __post_init__(self) -> None:
        check_sha256(self.blob, "attachment.blob")
        if not isinstance(self.media_type, str) or not _MEDIA_TYPE_RE.fullmatch(self.media_type):
            raise FormatError(f"attachment.media_type {self.media_type!r} is not a lowercase type/subtype")
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size < 0:
            raise FormatError(f"attachment.size {self.size!r} is not a number of bytes")
        _need_opt_str(self.name, "attachment.name")
        if self.call_id is not None:
            _need_str(self.call_id, "attachment.call_id", empty=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolsOffered(Event):
    """The tools the agent offers the model from here on (replaces the last such event).

    Each is ``{"name": str, "description": str, "parameters": JSON schema
    object}`` (description and parameters optional); renderers send them as
    the provider's ``tools``, so a rendered request is self-contained."""

    KIND: ClassVar[str] = "tools"
    tools: tuple[Mapping[str, Any], ...] | list[Mapping[str, Any]]

    def __post_init__(self) -> None:
        if not isinstance(self.tools, (list, tuple)):
            raise FormatError("tools.tools must be a list of tool definitions")
        names = set()
        for i, tool in enumerate(self.tools):
            what = f"tools.tools[{i}]"
            if not isinstance(tool, Mapping):
                raise FormatError(f"{what} must be an object")
            extra = set(tool) - {"name", "description", "parameters"}
            if extra:
                raise FormatError(f"{what}: unknown field(s) {', '.join(sorted(map(str, extra)))}")
            name = _need_str(tool.get("name"), f"{what}.name", empty=False)
            if name in names:
                raise FormatError(f"{what}: tool {name!r} is offered twice")
            names.add(name)
            _need_str(tool.get("description", ""), f"{what}.description")
            if not isinstance(tool.get("parameters", {}), Mapping):
                raise FormatError(f"{what}.parameters must be a JSON schema object")


@dataclass(frozen=True, slots=True, kw_only=True)
class UnknownEvent(Event):
    """A kind written by a newer version: kept, never dropped, never rendered."""

    unknown_kind: str
    fields_: Mapping[str, Any] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return self.unknown_kind

    def payload(self) -> dict[str, Any]:
        return dict(self.fields_)


KINDS: dict[str, type[Event]] = {
    cls.KIND: cls
    for cls in (
        UserMessage,
        AssistantMessage,
        Reasoning,
        ToolCall,
        ToolResult,
        MemoryEdit,
        WorkspaceUpdate,
        ModelSwitch,
        Note,
        System,
        ToolsOffered,
        Attachment,
    )
}


def event_from_fields(kind: str, payload: Mapping[str, Any], *, strict: bool = True) -> Event:
    """Build the typed event of ``kind`` from its own fields.

    ``strict`` refuses unknown kinds and unknown fields (for input people
    type); non-strict keeps them as :class:`UnknownEvent` (for lines read from
    a journal, which a newer version may have written).
    """
    if not isinstance(kind, str) or not _KIND_RE.fullmatch(kind):
        raise FormatError(f"kind {kind!r} is not a valid event kind")
    cls = KINDS.get(kind)
    if cls is None:
        if strict:
            raise FormatError(f"unknown event kind {kind!r}; known kinds: {', '.join(sorted(KINDS))}")
        return UnknownEvent(unknown_kind=kind, fields_=dict(payload))
    names = {f.name for f in fields(cls)}
    extra = set(payload) - names
    if extra:
        if strict:
            raise FormatError(f"{kind}: unknown field(s) {', '.join(sorted(extra))}")
        return UnknownEvent(unknown_kind=kind, fields_=dict(payload))
    try:
        return cls(**payload)
    except TypeError as exc:
        missing = sorted(f.name for f in fields(cls) if f.name not in payload)
        raise FormatError(f"{kind}: missing field(s) {', '.join(missing) or '?'} ({exc})") from None


def parse_draft(obj: object) -> Event:
    """Validate one event as a user or script submits it: kind + its fields.

    Envelope fields are stamped by the journal; supplying them is an error.
    """
    if not isinstance(obj, dict):
        raise FormatError("an event must be a JSON object")
    stamped = sorted(set(obj) & (set(ENVELOPE) - {"kind"}))
    if stamped:
        raise FormatError(f"field(s) {', '.join(stamped)} are stamped by capsulefs; leave them out")
    if "kind" not in obj:
        raise FormatError("an event needs a 'kind'")
    try:
        canonical_json(obj)  # what the journal will write: UTF-8, within the encoder's depth
    except UnicodeEncodeError:
        raise FormatError("an event's text must be valid Unicode (it holds a lone UTF-16 surrogate)") from None
    except RecursionError:
        raise FormatError("an event is nested too deeply") from None
    except ValueError:  # NaN or an infinity, from a caller that did not parse JSON with load_json
        raise FormatError("an event's numbers must be finite (JSON has no NaN or Infinity)") from None
    payload = {k: v for k, v in obj.items() if k != "kind"}
    event = event_from_fields(obj["kind"], payload, strict=True)
    if isinstance(event, ModelSwitch):
        _check_model_names(event)
    return event


def _check_model_names(ev: ModelSwitch) -> None:
    """A model switch someone submits must read back from ``.control/model``
    as it was written: one line ``provider:model``, split at its first ':'.
    (Only drafts are checked: a journal line that breaks this is still read.)"""
    if ":" in ev.provider:
        raise FormatError(f"model_switch.provider {ev.provider!r} must not contain ':'")
    for what, value in (("provider", ev.provider), ("model", ev.model)):
        if has_control(value) or "\x7f" in value:
            raise FormatError(f"model_switch.{what} {value[:64]!r} must not contain control characters or newlines")
