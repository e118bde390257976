"""A short fuzz pass of the control-file targets (tests/fuzz/targets_control.py).

Each target takes its seeds, and a few hundred mutations of them (bytes
flipped, cut, repeated or inserted: newlines, CR, tabs, NUL, DEL, C1 and
Unicode spaces, invalid UTF-8, colons, providers swapped, lines past the
limit): only CapsuleError may escape, and what is accepted keeps the
target's promises. scripts/fuzz.sh runs the long pass.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capsulefs.core.errors import CapsuleError
from capsulefs.core.view.control import MAX_CONTROL_LINE
from fuzz import Target, all_targets
from fuzz.targets_control import AGENT_ID, TARGETS

INSERTS = [b"\n", b"\r", b"\r\n", b"\t", b"\0", b"\x7f", "\x85".encode(), "\u00a0".encode(), "\u2028".encode(),
           b"\xff", b"\xed\xa0\x80", b"\xc3", b" ", b":", b"::", b"openai", b"evilprov", b"Anthropic", b"-chat",
           AGENT_ID.encode(), AGENT_ID.upper().encode(), b"\xef\xbb\xbf"]


@st.composite
def mutations(draw: st.DrawFn, seeds: list[bytes]) -> bytes:
    data = draw(st.sampled_from(seeds))
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(data)))
        match draw(st.integers(0, 5)):
            case 0:  # insert
                data = data[:at] + draw(st.sampled_from(INSERTS)) + data[at:]
            case 1:  # cut
                data = data[:at] + data[draw(st.integers(at, len(data))):]
            case 2:  # flip a byte
                if data:
                    i = min(at, len(data) - 1)
                    data = data[:i] + bytes([data[i] ^ draw(st.integers(1, 255))]) + data[i + 1:]
            case 3:  # past the limit, or just under it
                data = data * (MAX_CONTROL_LINE // max(1, len(data)) + draw(st.integers(0, 1)))
            case 4:  # another case
                data = data.upper() if draw(st.booleans()) else data.swapcase()
            case _:  # anything at all
                data = draw(st.binary(max_size=64))
    return data


def _run(target: Target, data: bytes, scratch: Path) -> bool:
    """Whether ``target`` accepted ``data``; only a CapsuleError may say no."""
    try:
        target.run(data, scratch)
    except CapsuleError:
        return False
    return True


def test_the_control_targets_are_registered() -> None:
    assert {t.name for t in TARGETS} <= {t.name for t in all_targets()}


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.name)
def test_every_seed_is_accepted(target: Target, tmp_path: Path) -> None:
    for seed in target.seeds():
        assert _run(target, seed, tmp_path), seed


MODEL, LINE, REMOVE, LEARN = TARGETS
BAD = [
    (MODEL, b"evilprov:x\n"), (MODEL, b"openai\n"), (MODEL, b"anthropic:\n"), (MODEL, b"anthropic:x\n\n"),
    (MODEL, b"anthropic:x\x85\n"), (MODEL, b"Anthropic:x\n"),
    (LINE, b"\n"), (LINE, b"a\nb\n"), (LINE, b"a\tb"), (LINE, b"x" * (MAX_CONTROL_LINE + 1)),
    (REMOVE, AGENT_ID.encode() + b" \n"), (REMOVE, AGENT_ID.encode() + b"\r\n"), (REMOVE, b" " + AGENT_ID.encode()),
    (REMOVE, AGENT_ID.encode() + b"\n\n"), (REMOVE, AGENT_ID.upper().encode() + b"\n"), (REMOVE, b"yes\n"),
    (LEARN, b"\n"), (LEARN, b""), (LEARN, b"a\nb\n"), (LEARN, b"\xff\n"), (LEARN, b"x" * (MAX_CONTROL_LINE + 1)),
]


@pytest.mark.parametrize(("target", "data"), BAD, ids=[f"{t.name}:{d[:40]!r}" for t, d in BAD])
def test_bad_writes_are_refused(target: Target, data: bytes, tmp_path: Path) -> None:
    assert not _run(target, data, tmp_path)


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.name)
def test_only_capsule_errors_escape(target: Target, tmp_path: Path) -> None:
    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(data=mutations(target.seeds()))
    def check(data: bytes) -> None:
        _run(target, data, tmp_path)

    check()
