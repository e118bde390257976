"""Synthetic journals for the journal benchmarks: realistic event mixes, fast to make."""

from __future__ import annotations

import hashlib
import json
import random

_TEXT = "the quick brown fox jumps over the lazy dog and keeps on running through the field "


def _dumps(doc: dict) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def payload(rng: random.Random) -> dict:
    """The fields of one event of a plausible kind (about 300 bytes a line)."""
    r = rng.random()
    text = _TEXT * rng.randint(1, 4)
    if r < 0.3:
        return {"kind": "user_message", "text": text[: rng.randint(20, 200)]}
    if r < 0.6:
        return {"kind": "assistant_message", "text": text, "provider": "anthropic", "model": "claude-x"}
    if r < 0.75:
        return {"kind": "tool_call", "call_id": f"c{rng.getrandbits(32):x}", "name": "shell",
                "arguments": {"cmd": "ls -la /tmp", "timeout": 30}}
    if r < 0.9:
        return {"kind": "tool_result", "call_id": f"c{rng.getrandbits(32):x}", "content": text[:150], "is_error": False}
    if r < 0.95:
        return {"kind": "workspace_update", "changes": {f"src/f{rng.randint(0, 99)}.py": hashlib.sha256(text.encode()).hexdigest()}}
    return {"kind": "note", "text": "checkpoint"}


class Writer:
    """Stamps lines for one machine on top of a shared Lamport clock view."""

    def __init__(self, machine: str, rng: random.Random) -> None:
        self.machine, self.rng = machine, rng
        self.seq, self.prev = 0, None

    def line(self, clock: int) -> bytes:
        self.seq += 1
        doc = payload(self.rng)
        doc.update(v=1, id=f"{self.rng.getrandbits(96):024x}", machine=self.machine, seq=self.seq,
                   clock=clock, prev=self.prev, time="2026-12-02T14:00:00.000Z")
        out = _dumps(doc)
        self.prev = hashlib.sha256(out).hexdigest()
        return out


def diverged_pair(n: int, shared: float = 0.5, seed: int = 1) -> tuple[list[bytes], list[bytes]]:
    """Two journals of ``n`` lines each sharing ``shared`` of them: a common
    history written by two machines, then each side goes on offline."""
    rng = random.Random(seed)
    common_n = int(n * shared)
    wa, wb = Writer("host-alpha", rng), Writer("host-bravo", rng)
    common = []
    for clock in range(1, common_n + 1):
        common.append((wa if clock % 2 else wb).line(clock))
    a = common + [wa.line(common_n + k) for k in range(1, n - common_n + 1)]
    b = common + [wb.line(common_n + k) for k in range(1, n - common_n + 1)]
    return a, b
