"""Frozen, slotted value classes that cost nothing to define.

Rules:
  * A subclass lists its fields in ``__slots__`` (a tuple), in order, and sets each
    once in its own keyword-only ``__init__`` with ``object.__setattr__``,
    after checking it: an instance is valid when it exists and never changes.
  * Equality, hashing, repr, copying and pickling are those of
    ``@dataclass(frozen=True, slots=True, kw_only=True)``: equal when of the
    same class with equal fields in order; the hash of the fields' tuple;
    ``Name(field=value, ...)``; assigning or deleting a field raises
    ``dataclasses.FrozenInstanceError`` (an AttributeError).
    tests/unit/test_events_classes.py holds them equal.

Theory of operation: ``@dataclass`` writes and compiles five or six
functions per class as its module is imported; the journal's classes are
imported by every ``capsulefs`` command, whose start is measured against
other tools' (docs/journal.md). Here the methods are written once, read the
class's ``_fields`` (computed from the ``__slots__`` of its class and bases
when it is defined), and each class writes its ``__init__``, where its
checks are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, dataclass_transform


@dataclass_transform(frozen_default=True, kw_only_default=True)
class Frozen:
    """Base of a frozen value class (see the module's rules)."""

    __slots__ = ()
    __match_args__: ClassVar[tuple[str, ...]] = ()  # keyword patterns only, as kw_only dataclasses
    _fields: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        names: list[str] = []
        for klass in reversed(cls.__mro__):
            names += [name for name in klass.__dict__.get("__slots__", ()) if name not in names]
        cls._fields = tuple(names)

    def _values(self) -> tuple[Any, ...]:
        return tuple([getattr(self, name) for name in self._fields])

    def __repr__(self) -> str:
        inner = ", ".join([f"{name}={getattr(self, name)!r}" for name in self._fields])
        return f"{type(self).__qualname__}({inner})"

    def __eq__(self, other: object) -> bool:
        if other.__class__ is self.__class__:
            return self._values() == other._values()
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._values())

    if not TYPE_CHECKING:  # (hidden from mypy, which then flags an assignment to a field as the dataclasses' own)

        def __setattr__(self, name: str, value: object) -> None:
            from dataclasses import FrozenInstanceError  # (only on this error: its module is slow to import)

            raise FrozenInstanceError(f"cannot assign to field {name!r}")

        def __delattr__(self, name: str) -> None:
            from dataclasses import FrozenInstanceError

            raise FrozenInstanceError(f"cannot delete field {name!r}")

    def __getstate__(self) -> list[Any]:
        return list(self._values())

    def __setstate__(self, state: list[Any]) -> None:
        for name, value in zip(self._fields, state):
            object.__setattr__(self, name, value)
