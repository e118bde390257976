"""Validate rendered bodies against the official SDKs' request types.

pydantic's TypeAdapter over the SDKs' TypedDicts checks value types but lets
unknown keys through (TypedDicts take no ``extra='forbid'``), so a misspelt
key would pass. ``strict`` walks the same types and also refuses unknown keys
and missing required ones; a union passes if any member passes. Gemini's
types are pydantic models with ``extra='forbid'`` already.
"""

from __future__ import annotations

import collections.abc
import functools
import json
import types
import typing
from typing import Any

from anthropic.types.message_create_params import MessageCreateParamsNonStreaming
from google.genai import types as gt
from openai.types.chat.completion_create_params import CompletionCreateParamsNonStreaming
from openai.types.responses.response_create_params import ResponseCreateParamsNonStreaming
import typing_extensions
from pydantic import TypeAdapter

REQUEST_TYPES = {
    "anthropic": MessageCreateParamsNonStreaming,
    "openai-chat": CompletionCreateParamsNonStreaming,
    "openai-responses": ResponseCreateParamsNonStreaming,
}


@functools.cache
def _adapter(tp: Any) -> TypeAdapter:
    return TypeAdapter(tp)


@functools.cache
def _hints(tp: Any) -> dict[str, Any]:
    return typing_extensions.get_type_hints(tp)


def _strip(tp: Any) -> Any:
    wrappers = (typing_extensions.Required, typing_extensions.NotRequired, typing_extensions.ReadOnly, typing.Annotated)
    while typing_extensions.get_origin(tp) in wrappers:
        tp = typing_extensions.get_args(tp)[0]
    return tp


def strict(tp: Any, value: Any, path: str = "$") -> list[str]:
    """Problems of ``value`` against ``tp``; empty if it conforms, no unknown keys allowed."""
    tp = _strip(tp)
    if tp is Any or tp is object:
        return []
    if typing_extensions.is_typeddict(tp):
        if not isinstance(value, dict):
            return [f"{path}: expected object for {tp.__name__}"]
        hints = _hints(tp)
        errs = [f"{path}: unknown key {k!r} for {tp.__name__}" for k in value if k not in hints]
        errs += [f"{path}: missing {k!r} for {tp.__name__}" for k in tp.__required_keys__ if k not in value]
        for k, v in value.items():
            if k in hints:
                errs += strict(hints[k], v, f"{path}.{k}")
        return errs
    origin = typing_extensions.get_origin(tp)
    args = typing_extensions.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        results = [strict(a, value, path) for a in args]
        if any(not r for r in results):
            return []
        return min(results, key=len)
    if origin in (typing.Literal, typing_extensions.Literal):
        return [] if value in args else [f"{path}: {value!r} not in {args}"]
    if origin in (list, collections.abc.Iterable, collections.abc.Sequence) or (
        isinstance(origin, type) and origin.__name__ == "SequenceNotStr"
    ):
        if not isinstance(value, list):
            return [f"{path}: expected array"]
        return [e for i, v in enumerate(value) for e in strict(args[0] if args else Any, v, f"{path}[{i}]")]
    if origin in (dict, collections.abc.Mapping):
        return [] if isinstance(value, dict) else [f"{path}: expected object"]
    if tp is type(None):
        return [] if value is None else [f"{path}: expected null"]
    if isinstance(tp, type) and not typing_extensions.is_typeddict(tp):
        if tp is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        elif tp is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        else:
            ok = isinstance(value, tp)
        return [] if ok else [f"{path}: expected {tp.__name__}, got {type(value).__name__}"]
    if isinstance(tp, typing_extensions.TypeAliasType):
        return strict(tp.__value__, value, path)
    # a type we do not model (e.g. a typing_extensions alias): pydantic checks it
    return []


def validate_request(provider: str, body: dict[str, Any]) -> None:
    """Raise AssertionError unless ``body`` is a valid request of ``provider``'s SDK."""
    wire = json.loads(json.dumps(body))  # exactly what goes over the wire
    if provider == "gemini":
        for content in wire["contents"]:
            gt.Content.model_validate_json(json.dumps(content))
        if "systemInstruction" in wire:
            gt.Content.model_validate_json(json.dumps(wire["systemInstruction"]))
        for tool in wire.get("tools", ()):
            gt.Tool.model_validate_json(json.dumps(tool))
        if "generationConfig" in wire:
            gt.GenerationConfig.model_validate_json(json.dumps(wire["generationConfig"]))
        unknown = set(wire) - {"contents", "systemInstruction", "tools", "generationConfig"}
        assert not unknown, f"unknown gemini body keys {unknown}"
        return
    tp = REQUEST_TYPES[provider]
    _adapter(tp).validate_python(wire)
    problems = strict(tp, wire)
    assert not problems, "\n".join(problems[:10])
