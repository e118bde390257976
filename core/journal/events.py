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
import json
import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from ..errors import FormatError
from ..frozen import Frozen

if TYPE_CHECKING:
    from _hashlib import HASH
from ..capsule.format import check_relpath, check_sha256, has_control

EVENT_VERSION = 1
ENVELOPE = ("v", "id", "machine", "seq", "clock", "prev", "time", "kind")
_KIND_RE = re.compile(r"[a-z][a-z0-9_.]{0,63}")


_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)




def canonical_json(obj: Any) -> bytes:
    """The one canonical JSON encoding: sorted keys, no spaces, UTF-8.
    (One encoder for every call: ``json.dumps`` with options builds a new one each time.)"""
    return _CANONICAL.encode(obj).encode()


def _first_sha256(data: bytes) -> "HASH":
    """``hashlib.sha256``, imported when the first line is hashed: hashlib
    loads OpenSSL, which a command that hashes nothing (``capsulefs log``)
    need not wait for."""
    global _sha256
    from hashlib import sha256

    _sha256 = sha256
    return sha256(data)


_sha256: Callable[[bytes], "HASH"] = _first_sha256  # hashlib.sha256 from the first call on


def line_hash(line: bytes) -> str:
    """sha256 hex of a journal line's exact bytes, without its newline."""
    return _sha256(line).hexdigest()


def _need_str(value: object, what: str, *, empty: bool = True) -> str:
    if not isinstance(value, str):
        raise FormatError(f"{what} must be a string, not {type(value).__name__}")
    if not empty and not value:
        raise FormatError(f"{what} must not be empty")
    return value


def _need_opt_str(value: object, what: str) -> str | None:
    return None if value is None else _need_str(value, what)


# -- the kinds ---------------------------------------------------------------
# Each kind's fields are its __slots__, in order; its __init__ checks them
# (core/frozen.py: equality, hashing and repr as a frozen dataclass's).

_set = object.__setattr__


class Event(Frozen):
    """Base of every event kind. ``KIND`` is the value of the ``kind`` key."""

    __slots__ = ()
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
def _payload_fields(cls: type[Event]) -> tuple[tuple[str, bool], ...]:
    """(name, optional) of each field of an event class: optional if its
    default is None."""
    defaults = getattr(cls.__init__, "__kwdefaults__", None) or {}
    return tuple((name, name in defaults and defaults[name] is None) for name in cls._fields)


class UserMessage(Event):
    """What the user said."""

    __slots__ = ("text",)
    KIND: ClassVar[str] = "user_message"
    text: str  # what the user said

    def __init__(self, *, text: str) -> None:
        _set(self, "text", _need_str(text, "user_message.text"))


class AssistantMessage(Event):
    """The assistant's visible reply."""

    __slots__ = ("text", "provider", "model")
    KIND: ClassVar[str] = "assistant_message"
    text: str  # the visible reply
    provider: str | None  # which provider produced it, if known
    model: str | None  # which model produced it, if known

    def __init__(self, *, text: str, provider: str | None = None, model: str | None = None) -> None:
        _set(self, "text", _need_str(text, "assistant_message.text"))
        _set(self, "provider", _need_opt_str(provider, "assistant_message.provider"))
        _set(self, "model", _need_opt_str(model, "assistant_message.model"))


class Reasoning(Event):
    """Private reasoning. Only the exact provider and model may see it again."""

    __slots__ = ("provider", "model", "payload_format", "data", "text")
    KIND: ClassVar[str] = "reasoning"
    provider: str  # e.g. "anthropic", "openai", "gemini"
    model: str  # the exact model that produced it
    payload_format: str  # e.g. "anthropic.thinking", "openai.reasoning", "gemini.thought_signature"
    data: Mapping[str, Any]  # the opaque provider object, kept verbatim (signature, encrypted content...)
    text: str | None  # human-readable summary or thinking text, if the provider gave one

    def __init__(
        self, *, provider: str, model: str, payload_format: str, data: Mapping[str, Any], text: str | None = None
    ) -> None:
        _set(self, "provider", _need_str(provider, "reasoning.provider", empty=False))
        _set(self, "model", _need_str(model, "reasoning.model", empty=False))
        _set(self, "payload_format", _need_str(payload_format, "reasoning.payload_format", empty=False))
        if not isinstance(data, Mapping):
            raise FormatError("reasoning.data must be a JSON object")
        _set(self, "data", data)
        _set(self, "text", _need_opt_str(text, "reasoning.text"))


class ToolCall(Event):
    """The assistant called a tool."""

    __slots__ = ("call_id", "name", "arguments", "provider", "model")
    KIND: ClassVar[str] = "tool_call"
    call_id: str  # pairs the call with its tool_result
    name: str  # tool name
    arguments: Mapping[str, Any]  # JSON object of arguments
    provider: str | None
    model: str | None

    def __init__(
        self, *, call_id: str, name: str, arguments: Mapping[str, Any], provider: str | None = None,
        model: str | None = None,
    ) -> None:
        _set(self, "call_id", _need_str(call_id, "tool_call.call_id", empty=False))
        _set(self, "name", _need_str(name, "tool_call.name", empty=False))
        if not isinstance(arguments, Mapping):
            raise FormatError("tool_call.arguments must be a JSON object")
        _set(self, "arguments", arguments)
        _set(self, "provider", _need_opt_str(provider, "tool_call.provider"))
        _set(self, "model", _need_opt_str(model, "tool_call.model"))


class ToolResult(Event):
    """A tool's answer to a call."""

    __slots__ = ("call_id", "content", "is_error")
    KIND: ClassVar[str] = "tool_result"
    call_id: str  # the tool_call this answers
    content: str  # the tool's output as text
    is_error: bool

    def __init__(self, *, call_id: str, content: str, is_error: bool = False) -> None:
        _set(self, "call_id", _need_str(call_id, "tool_result.call_id", empty=False))
        _set(self, "content", _need_str(content, "tool_result.content"))
        if not isinstance(is_error, bool):
            raise FormatError("tool_result.is_error must be true or false")
        _set(self, "is_error", is_error)


class MemoryEdit(Event):
    """The new working memory: inline ``text``, or the sha256 of its blob."""

    __slots__ = ("text", "blob")
    KIND: ClassVar[str] = "memory_edit"
    text: str | None
    blob: str | None

    def __init__(self, *, text: str | None = None, blob: str | None = None) -> None:
        if (text is None) == (blob is None):
            raise FormatError("memory_edit needs exactly one of text or blob")
        _set(self, "text", _need_opt_str(text, "memory_edit.text"))
        if blob is not None:
            check_sha256(blob, "memory_edit.blob")
        _set(self, "blob", blob)


class WorkspaceUpdate(Event):
    """Workspace changes: path -> sha256 of its new blob, or None if deleted."""

    __slots__ = ("changes",)
    KIND: ClassVar[str] = "workspace_update"
    changes: Mapping[str, str | None]

    def __init__(self, *, changes: Mapping[str, str | None]) -> None:
        if not isinstance(changes, Mapping) or not changes:
            raise FormatError("workspace_update.changes must be a non-empty object")
        for path, sha in changes.items():
            check_relpath(path, "workspace_update path")
            if sha is not None:
                check_sha256(sha, f"workspace_update.changes[{path!r}]")
        _set(self, "changes", changes)


class ModelSwitch(Event):
    """The agent's model from here on."""

    __slots__ = ("provider", "model")
    KIND: ClassVar[str] = "model_switch"
    provider: str
    model: str

    def __init__(self, *, provider: str, model: str) -> None:
        _set(self, "provider", _need_str(provider, "model_switch.provider", empty=False))
        _set(self, "model", _need_str(model, "model_switch.model", empty=False))


class Note(Event):
    """A remark for people (operator notes, moves, recoveries). Never rendered as dialogue."""

    __slots__ = ("text",)
    KIND: ClassVar[str] = "note"
    text: str

    def __init__(self, *, text: str) -> None:
        _set(self, "text", _need_str(text, "note.text"))


class System(Event):
    """A system instruction for the model."""

    __slots__ = ("text",)
    KIND: ClassVar[str] = "system"
    text: str

    def __init__(self, *, text: str) -> None:
        _set(self, "text", _need_str(text, "system.text"))


_MEDIA_TYPE_RE = re.compile(r"[a-z0-9][a-z0-9!#$&^_.+-]{0,63}/[a-z0-9][a-z0-9!#$&^_.+-]{0,126}")


class Attachment(Event):
    """An image or document in the conversation: the sha256 of its bytes in
    ``artifacts/blobs/`` (the store keeps one copy however many agents hold it).

    With ``call_id`` it came with that tool call's result; without, the user
    sent it, with the user message next to it."""

    __slots__ = ("blob", "media_type", "size", "name", "call_id")
    KIND: ClassVar[str] = "attachment"
    blob: str  # sha256 hex of the bytes, listed in the manifest as artifacts/blobs/<sha256>
    media_type: str  # e.g. image/png, application/pdf (lowercase type/subtype)
    size: int  # bytes
    name: str | None  # a file name, for people and for providers that want one
    call_id: str | None  # the tool call whose result carries it

    def __init__(
        self, *, blob: str, media_type: str, size: int, name: str | None = None, call_id: str | None = None
    ) -> None:
        check_sha256(blob, "attachment.blob")
        if not isinstance(media_type, str) or not _MEDIA_TYPE_RE.fullmatch(media_type):
            raise FormatError(f"attachment.media_type {media_type!r} is not a lowercase type/subtype")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise FormatError(f"attachment.size {size!r} is not a number of bytes")
        _need_opt_str(name, "attachment.name")
        if call_id is not None:
            _need_str(call_id, "attachment.call_id", empty=False)
        for field, value in (("blob", blob), ("media_type", media_type), ("size", size), ("name", name),
                             ("call_id", call_id)):
            _set(self, field, value)


class ToolsOffered(Event):
    """The tools the agent offers the model from here on (replaces the last such event).

    Each is ``{"name": str, "description": str, "parameters": JSON schema
    object}`` (description and parameters optional); renderers send them as
    the provider's ``tools``, so a rendered request is self-contained."""

    __slots__ = ("tools",)
    KIND: ClassVar[str] = "tools"
    tools: tuple[Mapping[str, Any], ...] | list[Mapping[str, Any]]

    def __init__(self, *, tools: tuple[Mapping[str, Any], ...] | list[Mapping[str, Any]]) -> None:
        if not isinstance(tools, (list, tuple)):
            raise FormatError("tools.tools must be a list of tool definitions")
        names = set()
        for i, tool in enumerate(tools):
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
        _set(self, "tools", tools)


class UnknownEvent(Event):
    """A kind written by a newer version: kept, never dropped, never rendered."""

    __slots__ = ("unknown_kind", "fields_")
    unknown_kind: str
    fields_: Mapping[str, Any]

    def __init__(self, *, unknown_kind: str, fields_: Mapping[str, Any] | None = None) -> None:
        _set(self, "unknown_kind", unknown_kind)
        _set(self, "fields_", {} if fields_ is None else fields_)

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
    extra = set(payload).difference(cls._fields)
    if extra:
        if strict:
            raise FormatError(f"{kind}: unknown field(s) {', '.join(sorted(extra))}")
        return UnknownEvent(unknown_kind=kind, fields_=dict(payload))
    try:
        return cls(**payload)
    except TypeError as exc:
        missing = sorted(name for name in cls._fields if name not in payload)
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
