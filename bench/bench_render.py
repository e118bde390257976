"""Benchmark: render a 100k-event journal for each provider; how full a budget's window is.

Speed: the ratio of render time to the baseline, which is json-parsing the
same journal's lines (``json.loads`` per line), in CPU time of this process
(the machines here are shared and loaded: wall time swings with the load,
CPU time much less), alternated, the median of the per-pair ratios. The
issue's target is a ratio of at most 3. Rendering starts from parsed
records (what core/journal/file.py hands over) and includes sorting them,
pairing, the provider's JSON and, with a budget, fitting and counting.
Render pauses the garbage collector (see ``render._collector_paused``), so
the ratio is also given against the parse with the collector paused.

Fill: for several budgets over long journals (short prose, and code read by
tools), the rendered body's tokens by a reference count independent of the
fitter's counter, as a share of the budget (fill) and how far over (overshoot).
For OpenAI the reference is OpenAI's documented way of counting a chat
request (the cookbook's ``num_tokens_from_messages`` and its tool formula)
with the exact tokenizer; Anthropic and Gemini publish none, so their rows
give the o200k count of the text and the range the real count lies in by
the published ratios (docs/render.md).

Attachments: a long history with many images (user screenshots and images
a tool attached) and some PDFs: per provider and budget, render time
against the JSON parse of the same journal, the window's fill, and how many
attachments the request sent and noted (limits and budget).

    .venv/bin/python bench/bench_render.py [--events N] [--repeat R] [--only speed|fill|attachments]
                                           [--attachment-events N]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import time

from capsulefs.core.journal.events import (
    AssistantMessage,
    Attachment,
    ModelSwitch,
    Note,
    Reasoning,
    System,
    ToolCall,
    ToolResult,
    UserMessage,
)
from capsulefs.core.journal.record import Record
from capsulefs.core.render import PROVIDERS, counter_info, render
from capsulefs.core.render._count import text_counter
from capsulefs.testing.render_reference import gemini_reference

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


def code_journal(units: int, seed: int = 2) -> list[Record]:
    """A long agent session over this repository: questions, file reads whose
    results are real source and docs, shell output, answers."""
    import glob
    import os

    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    texts = [open(f, encoding="utf-8").read() for f in sorted(glob.glob(f"{root}/core/**/*.py", recursive=True)
                                                                + glob.glob(f"{root}/docs/*.md"))]
    rng = random.Random(seed)
    events: list = [System(text="You are a careful engineer working on capsulefs. Answer briefly.")]
    for i in range(units):
        events.append(UserMessage(text=f"Step {i}: " + _text(rng, 5, 60)))
        for k in range(rng.choice((0, 1, 1, 2))):
            src = rng.choice(texts)
            start = rng.randrange(max(1, len(src) - 4000))
            cid = f"call_{i}_{k}"
            events.append(ToolCall(call_id=cid, name="read_file", arguments={"path": f"core/file{k}.py"}))
            events.append(ToolResult(call_id=cid, content=src[start:start + rng.randint(200, 4000)]))
        events.append(AssistantMessage(text=_text(rng, 10, 120)))
    return [Record(id=f"{i:024x}", machine="bench-host", seq=i, clock=i, prev=None,
                   time="2026-01-01T00:00:00.000Z", event=ev) for i, ev in enumerate(events, 1)]


def openai_reference(provider: str, body: dict, encoding: str = "o200k_base") -> int:
    """A request's tokens as OpenAI documents counting them: 3 per message
    plus its role and content, 3 to prime the reply (the cookbook's
    num_tokens_from_messages), the cookbook's formula for function
    definitions (gpt-4o), and for a tool call its name and arguments plus
    7 (the harmony format's markers around a call)."""
    tok = text_counter(encoding)
    n = 3

    def message(role: str, content) -> int:
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content)
        return 3 + tok(role) + tok(content or "")

    if provider == "openai-chat":
        for m in body["messages"]:
            n += message(m["role"], m.get("content"))
            for call in m.get("tool_calls") or ():
                n += 7 + tok(call["function"]["name"]) + tok(call["function"]["arguments"])
        tools = [t["function"] for t in body.get("tools", ())]
    else:
        if body.get("instructions"):
            n += message("system", body["instructions"])
        for item in body["input"]:
            kind = item.get("type")
            if kind == "message":
                n += message(item["role"], item["content"])
            elif kind == "function_call":
                n += 7 + tok(item["name"]) + tok(item["arguments"])
            elif kind == "function_call_output":
                n += message("tool", item["output"])
            elif kind == "reasoning":
                n += tok(item.get("encrypted_content") or "")
        tools = list(body.get("tools", ()))
    for f in tools:
        n += 7 + tok(f"{f['name']}:{f.get('description', '').rstrip('.')}")
        props = (f.get("parameters") or {}).get("properties") or {}
        if props:
            n += 3
            for key, p in props.items():
                n += 3 + tok(f"{key}:{p.get('type', '')}:{p.get('description', '').rstrip('.')}")
    return n + (12 if tools else 0)


def o200k_text(body) -> int:
    """Tokens of every string value in ``body`` by o200k, plus 3 per message
    (role markers, as OpenAI's format has): what the published ratios scale."""
    tok = text_counter("o200k_base")
    stack, n = [body], 0
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            n += tok(x)
        elif isinstance(x, dict):
            n += 3 if "role" in x else 0
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return n


#: Published ratios of real tokens to o200k tokens of the same text (docs/render.md).
RATIOS = {"anthropic": (1.16, 1.30)}
FILL_TARGETS = [("openai-chat", "gpt-4o"), ("openai-responses", "gpt-5"), ("openai-chat", "gpt-4"),
                ("anthropic", "claude-sonnet-4-5"), ("gemini", "gemini-2.5-pro")]


def fill(budgets: list[int], *, prose: int = 60_000, code: int = 3000) -> None:
    from capsulefs.agents.reference.tools import TOOLS

    journals = {"prose": [Record.from_line(x) for x in journal(prose, seed=5)], "code": code_journal(code)}
    print(f"{'journal':8} {'provider':17} {'model':18} {'budget':>7} {'counted':>8} {'reference':>9} "
          f"{'fill':>6} {'overshoot':>9}")
    for name, records in journals.items():
        for provider, model in FILL_TARGETS:
            info = counter_info(provider, model)
            for budget in budgets:
                out = render(records, provider=provider, model=model, budget=budget, tools=TOOLS,
                             working_memory="notes: keep answers short")
                if provider.startswith("openai") or provider == "gemini":
                    ref = (gemini_reference(out.body) if provider == "gemini"
                           else openai_reference(provider, out.body, info.encoding))
                    over = max(0, ref - budget)
                    print(f"{name:8} {provider:17} {model:18} {budget:7} {out.tokens:8} {ref:9} "
                          f"{ref / budget:6.1%} {over:9}")
                else:
                    lo, hi = RATIOS[provider]
                    text = o200k_text(out.body)
                    print(f"{name:8} {provider:17} {model:18} {budget:7} {out.tokens:8} {'o200k ' + str(text):>9} "
                          f"{text * lo / budget:6.1%}-{text * hi / budget:.1%} (at x{lo}-x{hi}; counter x{info.factor})")


def attachment_journal(n: int, seed: int = 3) -> tuple[list[bytes], dict[str, bytes]]:
    """``n`` journal lines of prose with tools where about one event in
    eight is an attachment (a user's screenshot before a question, or an
    image or PDF a tool's result carries), over 60 distinct blobs of 20-400
    KB (a screenshot sent again is the same blob); the blobs by sha256."""
    import hashlib

    rng = random.Random(seed)
    blobs: dict[str, bytes] = {}
    kinds: list[tuple[str, str, int]] = []  # (sha, media type, size)
    for i in range(60):
        if i % 10 == 9:
            pages = rng.randint(1, 6)
            data = b"%PDF-1.7\n" + b"<< /Type /Page >>\n" * pages + rng.randbytes(rng.randint(20_000, 200_000))
            kind = "application/pdf"
        else:
            data = b"\x89PNG\r\n\x1a\n" + rng.randbytes(rng.randint(20_000, 400_000))
            kind = "image/png"
        sha = hashlib.sha256(data).hexdigest()
        blobs[sha] = data
        kinds.append((sha, kind, len(data)))
    events: list = [ModelSwitch(provider="anthropic", model="claude-sonnet-4-5")]
    call = 0
    while len(events) < n:
        if rng.random() < 0.4:
            sha, kind, size = rng.choice(kinds)
            events.append(Attachment(blob=sha, media_type=kind, size=size, name=f"screen{len(events)}.png"))
        events.append(UserMessage(text=_text(rng, 5, 60)))
        for _ in range(rng.choice((0, 1, 1))):
            cid = f"call_{call}"
            call += 1
            events.append(ToolCall(call_id=cid, name="read_file", arguments={"path": f"shot{call}.png"}))
            if rng.random() < 0.5:
                sha, kind, size = rng.choice(kinds)
                events.append(Attachment(blob=sha, media_type=kind, size=size, name=f"shot{call}", call_id=cid))
                events.append(ToolResult(call_id=cid, content=f"shot{call}: {kind}, {size} bytes, attached"))
            else:
                events.append(ToolResult(call_id=cid, content=_text(rng, 5, 80)))
        events.append(AssistantMessage(text=_text(rng, 10, 80)))
    lines = [Record(id=f"{i:024x}", machine="bench-host", seq=i, clock=i, prev=None,
                    time="2026-01-01T00:00:00.000Z", event=ev).line for i, ev in enumerate(events[:n], 1)]
    return lines, blobs


def attachments(n: int, repeat: int) -> None:
    lines, blobs = attachment_journal(n)
    records = [Record.from_line(x) for x in lines]
    total = sum(1 for r in records if r.kind == "attachment")
    size = sum(len(x) + 1 for x in lines)
    print(f"attachment-heavy journal: {len(lines)} events, {size / 1e6:.1f} MB, {total} attachments "
          f"of {len(blobs)} blobs ({sum(map(len, blobs.values())) / 1e6:.1f} MB)")
    print(f"{'provider':17} {'model':18} {'budget':>7} {'counted':>8} {'fill':>6} {'sent':>5} {'noted':>5} "
          f"{'body MB':>8} {'CPU s':>8} {'x baseline':>18}")
    for provider, model in FILL_TARGETS:
        for budget in (32_000, 128_000, 200_000, None):
            ratios, times = [], []
            out = None
            for _ in range(repeat):
                base = cpu(lambda: [json.loads(x) for x in lines])
                t0 = time.process_time()
                out = render(records, provider=provider, model=model, budget=budget, read_blob=blobs.__getitem__)
                times.append(time.process_time() - t0)
                ratios.append(times[-1] / base)
            assert out is not None
            t = statistics.median(times)
            text = json.dumps(out.body)
            sent = sum(text.count(k) for k in ('"type": "image"', '"type": "document"', '"image_url": {', '"type": "file"',
                                               '"type": "input_image"', '"type": "input_file"', '"inlineData"'))
            noted = text.count("[attachment ")
            fill = f"{out.tokens / budget:6.1%}" if budget else f"{'-':>6}"
            print(f"{provider:17} {model:18} {budget or 'none':>7} {out.tokens or '-':>8} {fill} {sent:5} {noted:5} "
                  f"{len(text) / 1e6:8.1f} {t:8.3f} {spread(ratios):>18}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--budget", type=int, default=200_000, help="token budget of the fitted runs")
    parser.add_argument("--only", choices=("speed", "fill", "attachments"), help="run one part")
    parser.add_argument("--attachment-events", type=int, default=20_000,
                        help="events of the attachment-heavy journal")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one round: does it run (CI), not a figure")
    args = parser.parse_args()
    if args.smoke:
        args.events, args.repeat, args.budget, args.attachment_events = 2000, 1, 20_000, 200
    if args.only in (None, "fill"):
        if args.smoke:
            fill([8_000], prose=600, code=30)
        else:
            fill([8_000, 32_000, 128_000, 200_000])
    if args.only in (None, "attachments"):
        attachments(args.attachment_events, args.repeat)
    if args.only in ("fill", "attachments"):
        return
    lines = journal(args.events)
    size = sum(len(x) + 1 for x in lines)
    records = [Record.from_line(x) for x in lines]
    parse = lambda: [json.loads(x) for x in lines]  # noqa: E731
    print(f"journal: {len(lines)} events, {size / 1e6:.1f} MB; {os.cpu_count()} cpus, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("CPU time of this process (time.process_time), render and baseline alternated, median of the "
          "per-pair ratios (min-max);\nthe baseline is the JSON parse of the same lines as a caller runs it, "
          "and also with the garbage collector paused as render pauses it")
    print(f"{'provider':18} {'budget':>8} {'render s':>9} {'x baseline':>18} {'x baseline, no GC':>18}")
    for provider in PROVIDERS:
        for budget in (None, args.budget):
            ratios, ratios_nogc, times = [], [], []
            render(records, provider=provider, model="claude-a", budget=budget)  # (the tokenizer loads once)
            for _ in range(args.repeat):
                base = cpu(parse)
                gc.disable()
                base_nogc = cpu(parse)
                gc.enable()
                t = cpu(lambda: render(records, provider=provider, model="claude-a", budget=budget))  # noqa: B023 (called here)
                times.append(t)
                ratios.append(t / base)
                ratios_nogc.append(t / base_nogc)
            label = "none" if budget is None else str(budget)
            print(f"{provider:18} {label:>8} {statistics.median(times):9.3f} {spread(ratios):>18} "
                  f"{spread(ratios_nogc):>18}")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def cpu(fn) -> float:
    t = time.process_time()
    fn()
    return time.process_time() - t


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"

if __name__ == "__main__":
    main()
