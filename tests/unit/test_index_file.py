"""index.json as its readers take it (core/semantic/vectors.py's parse_index):
a document whose fields are not of their documented types is IndexCorrupt,
as a writer through the mount could compute its digest as well as we can."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from capsulefs.core.semantic.vectors import IndexCorrupt, parse_index
from fuzz.targets_index import _digested, _seeds

Doc = dict[str, Any]


def _index(change: Callable[[Doc], object]) -> bytes:
    doc = json.loads(_seeds()[-1])  # (an index with rows, without its digest)
    change(doc)
    return _digested(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())


def test_the_seed_parses() -> None:
    assert len(parse_index(_index(lambda d: None))) == 2


@pytest.mark.parametrize(("change", "words"), [
    (lambda d: d["journal"].__setitem__("last", 5), "journal last is not a sha256"),
    (lambda d: d["journal"].__setitem__("prefix", {"a": 1}), "journal prefix is not a sha256"),
    (lambda d: d["journal"].__setitem__("prefix", "AB" * 32), "journal prefix is not a sha256"),
    (lambda d: d["journal"]["heads"].__setitem__("m", [1, "zz"]), "index head of 'm' is not [seq, sha256]"),
    (lambda d: d["memory"].__setitem__("event", {"a": 1}), "memory is not {event, order"),
    (lambda d: d["memory"].__setitem__("order", [1, {"x": 1}, 1]), "memory is not {event, order"),
    (lambda d: d["memory"].__setitem__("order", "abc"), "memory is not {event, order"),
], ids=["last-int", "prefix-object", "prefix-upper-hex", "head-not-sha", "memory-event-object",
        "memory-machine-object", "memory-order-string"])
def test_fields_of_the_wrong_type_are_refused(change: Callable[[Doc], object], words: str) -> None:
    with pytest.raises(IndexCorrupt, match=words.replace("[", r"\[").replace("{", r"\{")):
        parse_index(_index(change))
