"""Benchmark: what an agent's history costs, at 1k, 100k and 1M events.

For each history length (``--events``, default 1000,100000,1000000) it
builds one agent of a host store whose journal holds that many events (a
plausible mix, 1% failed tool results, a model switch now and then, one
second apart), and measures, in this process (median of ``--runs``):

  * opening the journal for appending (``open_agent_journal``; the first
    open, which writes the journal's tip, reported on its own), and one
    durable append through it;
  * reading the last 100 events (``timeline.last_lines``);
  * a daemon's first look at the agent: ``.control/status`` and
    ``manifest.json`` from a fresh ``LiveHost`` (its journal digest);
  * the timeline index: building it (the first query), then queries by
    kind and failure, by a one-hour window, by a --grep literal.

The target of each is to cost the same at 1M events as at 1k (within 2x):
the ``x1k`` column.

Then, whole processes side by side, in turns: ``capsulefs log AGENT --tail
100`` against AgentFS (``agentfs-sdk`` 0.6.4 from PyPI, installed in a venv
of its own under a temporary directory) opening the same history and
reading its last 100 (``tools.get_recent(0, limit=100)``, its tool-call
table with its index on the start time). The AgentFS database is built with
Python's sqlite3 in AgentFS's own schema (its tool_calls table), the same
events as JSON. Target: capsulefs <= 1.0x AgentFS's wall time. capsulefs
runs twice: as ``scripts/setup.sh`` installs it (editable: an import finder
loads at every start) and as a user installs it (a wheel, in a venv of its
own whose dependencies come from .venv). If AgentFS cannot be installed (no
network), the reason is printed and that part skipped.

    .venv/bin/python bench/bench_history.py [--events 1000,100000,1000000] [--runs 7]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import resource
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import REPO  # noqa: E402

from capsulefs.core.capsule import format as fmt  # noqa: E402
from capsulefs.core.journal import query, timeline  # noqa: E402
from capsulefs.core.journal.events import Note  # noqa: E402
from capsulefs.core.journal.file import open_agent_journal  # noqa: E402
from capsulefs.core.view.host import LiveHost  # noqa: E402
from capsulefs.core.store.agent import AgentHandle  # noqa: E402
from capsulefs.core.store.host_store import HostStore  # noqa: E402

HOST = "BENCHHOST" + "A" * 43
AGENT = "hist"
T0 = 1_796_000_000  # 2026-12-01, one event a second from here
AFS_VERSION = "0.6.4"
_TEXT = "the quick brown fox jumps over the lazy dog and keeps on running through the field "


def _dumps(doc: dict) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _payloads(rng: random.Random) -> list[dict]:
    """A few hundred event bodies to draw from (stamping varies the rest)."""
    out = []
    for i in range(500):
        text = _TEXT * rng.randint(1, 3) + f" item {i}"
        r = rng.random()
        if r < 0.3:
            out.append({"kind": "user_message", "text": text[: rng.randint(20, 200)]})
        elif r < 0.55:
            out.append({"kind": "assistant_message", "text": text, "provider": "anthropic", "model": "claude-x"})
        elif r < 0.75:
            out.append({"kind": "tool_call", "call_id": f"c{i}", "name": "shell",
                        "arguments": {"cmd": f"ls -la /tmp/d{i}", "timeout": 30}})
        elif r < 0.95:
            out.append({"kind": "tool_result", "call_id": f"c{i}", "content": text[:150], "is_error": False})
        else:
            out.append({"kind": "note", "text": f"checkpoint {i}"})
    return out


def journal_lines(n: int, machine: str = HOST, seed: int = 7):
    """``n`` stamped, chained lines of one machine; 1% failed tool results,
    a model switch every 10,000 events."""
    rng = random.Random(seed)
    bodies = _payloads(rng)
    prev = None
    for seq in range(1, n + 1):
        if seq % 10_000 == 0:
            doc = {"kind": "model_switch", "provider": "openai", "model": f"gpt-{seq // 10_000}"}
        elif seq % 100 == 50:
            doc = {"kind": "tool_result", "call_id": f"f{seq}", "content": f"error: command {seq} failed: exit 2",
                   "is_error": True}
        else:
            doc = dict(bodies[seq % len(bodies)])
        when = time.gmtime(T0 + seq)
        doc.update(v=1, id=f"{seq:024x}", machine=machine, seq=seq, clock=seq, prev=prev,
                   time=time.strftime("%Y-%m-%dT%H:%M:%S", when) + ".000Z")
        line = _dumps(doc)
        prev = hashlib.sha256(line).hexdigest()
        yield seq, doc, line


def build(root: Path, n: int) -> tuple[Path, Path]:
    """A state directory with agent ``hist`` of ``n`` events, and an AgentFS
    database of the same events."""
    state = root / f"state-{n}"
    store = HostStore.open(state)
    agent = store.create_agent(AGENT, host_id=HOST, agent_id=hashlib.md5(str(n).encode()).hexdigest())
    db_path = root / f"agentfs-{n}.db"
    db = sqlite3.connect(db_path)
    db.execute("PRAGMA journal_mode=WAL")
    db.executescript("""
        CREATE TABLE IF NOT EXISTS tool_calls (
            id INTEGER PRIMARY KEY AUTOINCREMENT, name TEXT NOT NULL, parameters TEXT, result TEXT,
            error TEXT, status TEXT NOT NULL DEFAULT 'pending', started_at INTEGER NOT NULL,
            completed_at INTEGER, duration_ms INTEGER);
        CREATE INDEX IF NOT EXISTS idx_tool_calls_name ON tool_calls(name);
        CREATE INDEX IF NOT EXISTS idx_tool_calls_started_at ON tool_calls(started_at);
    """)
    rows = []
    with open(agent.path(fmt.JOURNAL), "ab") as f:
        batch = []
        for seq, doc, line in journal_lines(n):
            batch.append(line)
            payload = {k: v for k, v in doc.items() if k not in ("v", "id", "machine", "seq", "clock", "prev", "time")}
            err = payload.get("content") if payload.get("is_error") else None
            rows.append((doc["kind"], json.dumps(payload), None if err else json.dumps("ok"), err,
                         "error" if err else "success", T0 + seq, T0 + seq, 0))
            if len(batch) >= 10_000:
                f.write(b"\n".join(batch) + b"\n")
                batch = []
                db.executemany("INSERT INTO tool_calls(name, parameters, result, error, status, started_at, "
                               "completed_at, duration_ms) VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)
                rows = []
        if batch:
            f.write(b"\n".join(batch) + b"\n")
        db.executemany("INSERT INTO tool_calls(name, parameters, result, error, status, started_at, "
                       "completed_at, duration_ms) VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)
        os.fsync(f.fileno())
    db.commit()
    db.close()
    return state, db_path


def median_ms(fn: Callable[[], object], runs: int) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def in_process(state: Path, n: int, runs: int) -> dict[str, float]:
    store = HostStore.open(state)
    agent = store.find(AGENT)
    ids = iter(range(1 << 40, 1 << 41))
    out: dict[str, float] = {}

    def open_close() -> None:
        open_agent_journal(agent, machine=HOST, now=time.time, new_id=lambda: f"{next(ids):024x}").close()

    t = time.perf_counter()
    open_close()  # the first open: reads the whole journal and writes its tip
    out["first open for append (writes the tip)"] = (time.perf_counter() - t) * 1000
    out["open for append"] = median_ms(open_close, runs)
    with open_agent_journal(agent, machine=HOST, now=time.time, new_id=lambda: f"{next(ids):024x}") as j:
        out["durable append"] = median_ms(lambda: j.append(Note(text="one more")), runs)

    def last_100() -> None:
        snap = timeline.open_snapshot(agent.path(fmt.JOURNAL))
        try:
            assert len(timeline.last_lines(snap, 100) or []) == 100
        finally:
            os.close(snap.fd)

    out["last 100 events"] = median_ms(last_100, runs)

    def fresh_daemon(what: str) -> Callable[[], None]:
        def look() -> None:
            host = LiveHost(store, host_id=HOST, work_dir=str(state / "mount"), new_agent_id=lambda: "0" * 32,
                            new_event_id=lambda: "0" * 24, now_ns=time.time_ns)
            a = host.agent(agent.agent_id)
            a.status_bytes() if what == "status" else a.manifest_bytes()
        return look

    out["status, fresh daemon"] = median_ms(fresh_daemon("status"), runs)
    out["manifest, fresh daemon"] = median_ms(fresh_daemon("manifest"), runs)

    index = timeline.TimelineIndex(os.path.join(timeline.timeline_dir(str(state), agent.agent_id),
                                                timeline.INDEX_NAME), agent.path(fmt.JOURNAL))

    def ask(q: query.Query, expect: Callable[[int], bool] = lambda k: True) -> Callable[[], None]:
        def go() -> None:
            snap = timeline.open_snapshot(agent.path(fmt.JOURNAL))
            try:
                got = timeline.query_index(index, snap, q)
                assert expect(len(got)), (q, len(got))
            finally:
                os.close(snap.fd)
        return go

    t = time.perf_counter()
    ask(query.Query(kinds=("note",), tail=1))()
    out["timeline index: build"] = (time.perf_counter() - t) * 1000
    hour = (T0 + n // 2) * 1000
    out["query: --failed --tail 100"] = median_ms(ask(query.Query(failed=True, tail=100)), runs)
    out["query: --kind model_switch"] = median_ms(ask(query.Query(kinds=("model_switch",))), runs)
    out["query: 1-hour window, tool calls"] = median_ms(
        ask(query.Query(kinds=("tool_call",), since_ms=hour, until_ms=hour + 3_600_000)), runs)
    out["query: --grep 'command 4\\d+ failed' --tail 10"] = median_ms(
        ask(query.Query(grep=r"command 4\d+ failed", tail=10)), runs)
    return out


def agentfs_venv(root: Path) -> tuple[Path | None, str]:
    venv = root / "agentfs-venv"
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=300)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", f"agentfs-sdk=={AFS_VERSION}"],
                       check=True, capture_output=True, timeout=600, text=True)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        return None, f"could not install agentfs-sdk {AFS_VERSION}: {detail.strip().splitlines()[-1:]}"
    return venv / "bin" / "python", ""


AFS_READER = """
import asyncio, sys
from agentfs_sdk import AgentFS, AgentFSOptions

async def main():
    agent = await AgentFS.open(AgentFSOptions(path=sys.argv[1]))
    calls = await agent.tools.get_recent(0, limit=int(sys.argv[2]))
    for c in calls:
        sys.stdout.write(f"{c.started_at} {c.name} {c.status} {str(c.parameters)[:100]}\\n")
    await agent.close()

asyncio.run(main())
"""


def installed_capsulefs(root: Path) -> tuple[Path | None, str]:
    """capsulefs installed as a wheel (as a user gets it), not editable:
    setup.sh's editable install loads an import finder at every start (about
    15 ms of CPU here). Its dependencies come from .venv (a .pth file)."""
    venv = root / "capsulefs-venv"
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=300)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--no-deps", str(REPO)],
                       check=True, capture_output=True, timeout=600, text=True)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        return None, f"could not install capsulefs as a wheel: {detail.strip().splitlines()[-1:]}"
    deps = REPO / ".venv" / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    site = next((venv / "lib").glob("python*/site-packages"))
    (site / "zz-capsulefs-deps.pth").write_text(f"{deps}\n")  # (a path: .pth files inside it are not read)
    return venv / "bin" / "capsulefs", ""


def processes(state: Path, db: Path, afs_python: Path, reader: Path, runs: int,
              capsulefs: Path | None = None) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}  # as users run it: with .pyc
    ours = [str(capsulefs or REPO / ".venv" / "bin" / "capsulefs"), "--state", str(state), "log", AGENT, "--tail", "100"]
    theirs = [str(afs_python), str(reader), str(db), "100"]
    how = "installed" if capsulefs else "editable"

    def once(argv: list[str]) -> tuple[float, float]:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        proc = subprocess.run(argv, capture_output=True, env=env, timeout=600)
        wall = time.perf_counter() - t
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode != 0 or len(proc.stdout.splitlines()) != 100:
            raise RuntimeError(f"{argv[0]} failed ({proc.returncode}): {proc.stderr.decode()[-500:]}")
        return wall, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)

    for argv in (ours, theirs):  # warm-up: .pyc files, page cache
        once(argv)
    walls: dict[str, list[float]] = {"capsulefs": [], "agentfs": []}
    cpus: dict[str, list[float]] = {"capsulefs": [], "agentfs": []}
    ratios, cpu_ratios = [], []
    for _ in range(runs):
        a, ca = once(ours)
        b, cb = once(theirs)
        walls["capsulefs"].append(a)
        walls["agentfs"].append(b)
        cpus["capsulefs"].append(ca)
        cpus["agentfs"].append(cb)
        ratios.append(a / b)
        cpu_ratios.append(ca / cb if cb else float("nan"))
    return {f"capsulefs log --tail 100, {how} (process wall)": statistics.median(walls["capsulefs"]) * 1000,
            f"AgentFS open + last 100 (process wall, vs {how})": statistics.median(walls["agentfs"]) * 1000,
            f"capsulefs log --tail 100, {how} (process cpu)": statistics.median(cpus["capsulefs"]) * 1000,
            f"AgentFS open + last 100 (process cpu, vs {how})": statistics.median(cpus["agentfs"]) * 1000,
            f"wall ratio capsulefs ({how})/AgentFS, median of pairs": statistics.median(ratios),
            f"cpu ratio capsulefs ({how})/AgentFS, median of pairs": statistics.median(cpu_ratios)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", default="1000,100000,1000000", help="history lengths, comma-separated")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--no-agentfs", action="store_true", help="skip the side-by-side with AgentFS")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes, one run, no AgentFS: does it run (CI), not a figure")
    args = ap.parse_args()
    if args.smoke:
        args.events, args.runs, args.no_agentfs = "300", 1, True
    sizes = [int(x) for x in args.events.split(",")]
    root = Path(tempfile.mkdtemp(prefix="bench-history-"))
    try:
        afs_python, why = (None, "skipped (--no-agentfs)") if args.no_agentfs else agentfs_venv(root)
        wheel, wheel_why = installed_capsulefs(root) if afs_python is not None else (None, "")
        if wheel_why:
            print(f"capsulefs as a wheel: {wheel_why}")
        reader = root / "afs_read.py"
        reader.write_text(AFS_READER)
        table: dict[int, dict[str, float]] = {}
        for n in sizes:
            t = time.perf_counter()
            state, db = build(root, n)
            print(f"built {n} events in {time.perf_counter() - t:.1f} s "
                  f"({os.path.getsize(AgentHandle(HostStore(str(state)), hashlib.md5(str(n).encode()).hexdigest()).path(fmt.JOURNAL)) >> 20} MiB journal)",
                  flush=True)
            table[n] = in_process(state, n, args.runs)
            if afs_python is not None:
                table[n].update(processes(state, db, afs_python, reader, args.runs))
                if wheel is not None:
                    table[n].update(processes(state, db, afs_python, reader, args.runs, wheel))
            shutil.rmtree(state)
            for f in root.glob(f"agentfs-{n}.db*"):
                f.unlink()
        if afs_python is None:
            print(f"AgentFS side by side: {why}")
        names = list(next(iter(table.values())))
        print(f"\n{'ms (median)':<60}" + "".join(f"{n:>12,}" for n in sizes) + f"{'x' + str(sizes[0]):>10}")
        for name in names:
            row = [table[n].get(name, float('nan')) for n in sizes]
            growth = row[-1] / row[0] if row[0] else float("nan")
            print(f"{name:<60}" + "".join(f"{v:>12.2f}" for v in row) + f"{growth:>9.2f}x")
        print(f"(load: {os.getloadavg()[0]:.2f})")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
