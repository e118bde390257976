"""Benchmark: render a 100k-event journal for each provider.

Prints events/second per provider and the ratio of render time to the
baseline, which is json-parsing the same journal's lines (``json.loads`` per
line). The issue's target is a ratio of at most 3. Rendering starts from
parsed records (what core/journal.py hands over) and includes sorting them,
pairing, the provider's JSON and, with a budget, fitting and counting.

    .venv/bin/python bench/bench_render.py [--events N] [--repeat R]
"""

from __future__ import annotations

import argparse
import json
import random
import time

from capsulefs.core.events import (
    AssistantMessage,
    ModelSwitch,
    Note,
    Reasoning,
    Record,
    ToolCall,
    ToolResult,
    UserMessage,
)
from capsulefs.core.render import PROVIDERS, render

_WORDS = "the quick brown fox jumps over the lazy dog while the journal keeps every step".split()


def _text(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choices(_WORDS, k=rng.randint(lo, hi)))


def journal(n: int, seed: int = 1) -> list[bytes]:
    """``n`` canonical journal lines: conversation with tools, reasoning and switches."""
    rng = random.Random(seed)
    events = []
    targets = [("anthropic", "claude-a"), ("openai-responses", "gpt-r"), ("gemini", "gem-a"), ("openai-chat", "gpt-c")]
    target = targets[0]
    call = 0
    while len(events) < n:
        r = rng.random()
        if r < 0.02:
            target = rng.choice(targets)
            events.append(ModelSwitch(provider=target[0], model=target[1]))
            continue
        events.append(UserMessage(text=_text(rng, 5, 60)))
        p, m = target
        if p == "anthropic":
            events.append(Reasoning(provider=p, model=m, payload_format="anthropic.thinking",
                                    data={"type": "thinking", "thinking": _text(rng, 10, 40), "signature": "S" * 80},
                                    text=None))
        elif p == "openai-responses":
            events.append(Reasoning(provider=p, model=m, payload_format="openai-responses.reasoning",
                                    data={"type": "reasoning", "id": f"rs_{call}", "summary": [],
                                          "encrypted_content": "E" * 120}))
        for _ in range(rng.choice((0, 1, 1, 2))):  # tool steps, sometimes parallel calls
            ids = [f"call_{call + i}" for i in range(rng.choice((1, 1, 2)))]
            call += len(ids)
            events += [ToolCall(call_id=i, name=rng.choice(("shell", "read_file", "grep")),
                                arguments={"command": _text(rng, 2, 8)}, provider=p, model=m) for i in ids]
            events += [ToolResult(call_id=i, content=_text(rng, 5, 80)) for i in ids]
        events.append(AssistantMessage(text=_text(rng, 10, 80), provider=p, model=m))
        if rng.random() < 0.05:
            events.append(Note(text="checkpoint"))
    lines = []
    for i, ev in enumerate(events[:n], 1):
        rec = Record(id=f"{i:024x}", machine="bench-host", seq=i, clock=i, prev=None,
                     time=f"2026-01-01T00:00:00.{i % 1000:03d}Z", event=ev)
        lines.append(rec.line)
    return lines


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--budget", type=int, default=200_000, help="token budget of the fitted runs")
    args = parser.parse_args()
    lines = journal(args.events)
    size = sum(len(x) + 1 for x in lines)
    records = [Record.from_line(x) for x in lines]
    baseline = best(lambda: [json.loads(x) for x in lines], args.repeat)
    print(f"journal: {len(lines)} events, {size / 1e6:.1f} MB; json-parse baseline {baseline:.3f} s "
          f"({len(lines) / baseline:,.0f} events/s)")
    print("each row re-measures the baseline next to the render (best of both), so load on the machine cancels out")
    print(f"{'provider':18} {'budget':>8} {'seconds':>8} {'events/s':>12} {'x baseline':>10}")
    for provider in PROVIDERS:
        for budget in (None, args.budget):
            base, t = float("inf"), float("inf")
            for _ in range(args.repeat):
                base = min(base, best(lambda: [json.loads(x) for x in lines], 1))
                t = min(t, best(lambda: render(records, provider=provider, model="claude-a", budget=budget), 1))
            label = "none" if budget is None else str(budget)
            print(f"{provider:18} {label:>8} {t:8.3f} {len(lines) / t:12,.0f} {t / base:10.2f}")


if __name__ == "__main__":
    main()
