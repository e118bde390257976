"""A short fuzz pass of the JSON parsers' targets (tests/fuzz/targets_parsers.py)
and of the same hostile variants written through the mount.

Every target takes its seeds, and a few hundred mutations of them (bytes
flipped, cut or inserted; numbers blown up; nesting past the limit; keys
twice; UTF-16; lines dropped, repeated or swapped) let only CapsuleError
escape. Through ``Operations`` the same mutations of journal drafts and of
spec.json are accepted or refused with an errno, the mount never goes
failsafe, and the agent still exports a capsule that verifies.
"""

from __future__ import annotations

import errno
import os
import random
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol, TypeVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capsulefs.core.capsule import archive
from capsulefs.core.capsule import format as fmt
from capsulefs.core.errors import CapsuleError
from capsulefs.core.journal.lines import check_journal_bytes
from capsulefs.core.store.host_store import HostStore
from capsulefs.mount.ops import Operations
from fuzz import Target
from fuzz.targets_parsers import TARGETS
from helpers import make_agent
from ops_kit import Client, FakeKernel, _reply, errno_of, make_live

T = TypeVar("T")


class Rng(Protocol):
    def randint(self, a: int, b: int) -> int: ...
    def choice(self, seq: Sequence[T]) -> T: ...


# -- mutations ---------------------------------------------------------------------

_NUMBER = re.compile(rb"-?[0-9]+(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_KEY = re.compile(rb'[{,]\s*("[^"\\]{1,40}")\s*:')
NUMBERS = [b"9" * 5000, b"-" + b"9" * 4400, b"9" * 4300, b"9007199254740992", b"9007199254740991", b"0", b"-1",
           b"1e999", b"-1e400", b"1.5", b"true", b"null", b"NaN", b"Infinity", b"1" + b"0" * 400 + b".0",
           b"123456789012345678901234567890", b"01", b'"7"']
INSERTS = [b"{", b"[", b"]", b"}", b'"', b",", b":", b"\\", b"\0", b"\n", b"\xff", b"\xed\xa0\x80", b"\\ud800",
           b'"a":1,', b"\xef\xbb\xbf", b" "]
DEPTHS = [63, 64, 65, 200, 5000]


def _flip(r: Rng, data: bytes) -> bytes:
    if not data:
        return b"\0"
    i = r.randint(0, len(data) - 1)
    return data[:i] + bytes([data[i] ^ r.randint(1, 255)]) + data[i + 1:]


def _cut(r: Rng, data: bytes) -> bytes:
    i = r.randint(0, len(data))
    return data[:i] if r.randint(0, 1) else data[i:]


def _insert(r: Rng, data: bytes) -> bytes:
    i = r.randint(0, len(data))
    return data[:i] + r.choice(INSERTS) + data[i:]


def _blow_number(r: Rng, data: bytes) -> bytes:
    found = list(_NUMBER.finditer(data))
    if not found:
        return _insert(r, data)
    m = r.choice(found)
    return data[:m.start()] + r.choice(NUMBERS) + data[m.end():]


def _nest(r: Rng, data: bytes) -> bytes:
    n = r.choice(DEPTHS)
    found = list(_NUMBER.finditer(data))
    if found and r.randint(0, 1):  # a value deep inside the document
        m = r.choice(found)
        return data[:m.start()] + b"[" * n + m.group() + b"]" * n + data[m.end():]
    opener, closer = (b"[", b"]") if r.randint(0, 1) else (b'{"k":', b"}")
    body = data.rstrip(b"\n")
    return opener * n + body + closer * n + data[len(body):]


def _dup_key(r: Rng, data: bytes) -> bytes:
    found = list(_KEY.finditer(data))
    if not found:
        return _insert(r, data)
    m = r.choice(found)
    value = r.choice([b"0", b"null", b'"x"', b"{}", m.group(1)])
    return data[:m.end()] + b" " + value + b"," + m.group(1) + b":" + data[m.end():]


def _encoding(r: Rng, data: bytes) -> bytes:
    text = data.decode("utf-8", "replace")
    return r.choice([lambda: text.encode("utf-16"), lambda: text.encode("utf-16-le"), lambda: text.encode("utf-32"),
                     lambda: b"\xef\xbb\xbf" + data, lambda: text.encode("latin-1", "replace")])()


def _lines(r: Rng, data: bytes) -> bytes:
    lines = data.split(b"\n")
    if len(lines) < 2:
        return _flip(r, data)
    i, j = r.randint(0, len(lines) - 1), r.randint(0, len(lines) - 1)
    match r.randint(0, 2):
        case 0:
            del lines[i]
        case 1:
            lines.insert(j, lines[i])
        case _:
            lines[i], lines[j] = lines[j], lines[i]
    return b"\n".join(lines)


MUTATIONS: list[Callable[[Rng, bytes], bytes]] = [_flip, _cut, _insert, _blow_number, _nest, _dup_key, _encoding,
                                                  _lines]


def mutate(r: Rng, data: bytes) -> bytes:
    for _ in range(r.randint(1, 3)):
        data = r.choice(MUTATIONS)(r, data)
    return data


class _Draws:
    """Hypothesis's ``draw`` behind the Rng interface, so that it shrinks."""

    def __init__(self, draw: st.DrawFn) -> None:
        self.draw = draw

    def randint(self, a: int, b: int) -> int:
        return self.draw(st.integers(a, b))

    def choice(self, seq: Sequence[T]) -> T:
        return self.draw(st.sampled_from(seq))


@st.composite
def hostile(draw: st.DrawFn, seeds: list[bytes]) -> bytes:
    r = _Draws(draw)
    return mutate(r, r.choice(seeds))


# -- the targets ---------------------------------------------------------------------


def test_the_parsers_targets_are_registered() -> None:
    from fuzz import all_targets

    names = {t.name for t in all_targets()}
    assert {t.name for t in TARGETS} <= names
    assert {"manifest", "spec", "journal_line", "journal_file", "journal_merge"} <= names


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.name)
def test_every_seed_is_accepted(target: Target, tmp_path: Path) -> None:
    for seed in target.seeds():
        target.run(seed, tmp_path)
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.name)
def test_only_capsule_errors_escape(target: Target, tmp_path: Path) -> None:
    seeds = target.seeds()

    @settings(max_examples=200, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(hostile(seeds))
    def run(data: bytes) -> None:
        try:
            target.run(data, tmp_path)
        except CapsuleError:
            pass

    run()
    assert not os.listdir(tmp_path)


# -- the same, written through the mount -------------------------------------------------


@pytest.fixture
def c(store: HostStore, tmp_path: Path) -> Client:
    make_agent(store, "alice")
    make_agent(store, "bob")
    return Client(Operations(make_live(store, tmp_path / "work"), kernel=FakeKernel(), readdir_reply=_reply,
                             uid=0, gid=0))


async def test_no_mutation_written_through_the_mount_sends_it_failsafe(
        c: Client, store: HostStore, tmp_path: Path) -> None:
    rng = random.Random(25)
    drafts = next(t for t in TARGETS if t.name == "journal_draft").seeds()
    specs = next(t for t in TARGETS if t.name == "spec").seeds()
    journal, spec = "alice/memory/timeline_events.jsonl", "alice/environment/spec.json"
    taken: dict[str, int] = {}
    for i in range(300):
        data = mutate(rng, rng.choice(drafts))
        code = await errno_of(c.write(journal, data, append=True))
        assert code in (0, errno.EINVAL), (i, code, data[:80])
        assert c.ops.live.failsafe is None, (i, data[:80])
        taken["journal"] = taken.get("journal", 0) + (code == 0)
    for i in range(100):
        data = mutate(rng, rng.choice(specs))
        code = await errno_of(c.write(spec, data))
        assert code in (0, errno.EINVAL), (i, code, data[:80])
        assert c.ops.live.failsafe is None, (i, data[:80])
        taken["spec"] = taken.get("spec", 0) + (code == 0)
    assert taken["journal"] > 0 and taken["spec"] > 0, taken  # some mutations are still valid
    await c.write("bob/memory/timeline_events.jsonl", b'{"kind":"note","text":"unharmed"}\n', append=True)
    for name in ("alice", "bob"):
        agent = store.find(name)
        assert check_journal_bytes(agent.read(fmt.JOURNAL)) == []
        archive.export_agent(agent, str(tmp_path / f"{name}.tar"), mtime=1_700_000_000)
        assert archive.verify_capsule(str(tmp_path / f"{name}.tar"))[1] == []
