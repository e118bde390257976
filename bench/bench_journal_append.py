"""Benchmark: durable journal appends per second against SQLite, side by side.

capsulefs: ``Journal.append`` of one event at a time on the journal of an
agent of a host store, opened as the store opens it (``open_agent_journal``,
with the agent's write-ahead ring): each append is stamped, written to the
journal with one O_APPEND write (not synced), made durable as one record
overwritten in place in the ring (one O_DIRECT|O_DSYNC write of the pages it
covers, or pwrite + fdatasync where the file system has no direct I/O), and
then acknowledged; when
the ring is full the journal itself is fdatasynced once and the ring starts
over (see ``capsulefs.core.journal.ring``); an append that follows
another within 2 ms finds the journal's flock still held (a lease, see
``capsulefs.core.journal.lease``) and skips the flock and the checks. Baseline: the "conversation in a database row": SQLite in WAL mode with
``synchronous=FULL``, one transaction (INSERT + COMMIT) per event, inserting
the same events (their canonical lines). Target: capsulefs >= 1.0x the
baseline's appends per second.

For context it also measures the file system's floor, without Python or
SQLite: a 300-byte write that grows a file + fdatasync (what every journal
append must do: the new size is metadata, so fdatasync writes the inode too)
against a 4 KiB overwrite in place + fdatasync (what SQLite's WAL does once
it has wrapped), alternating in turns like the main comparison; and a plain
journal without a ring (a capsule directory outside a store), whose every
append grows the file and fdatasyncs it.

    .venv/bin/python bench/bench_journal_append.py [--events 4000] [--batch 50]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sqlite3
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from capsulefs.core.journal.events import AssistantMessage, Event, ToolCall, ToolResult, UserMessage  # noqa: E402
from capsulefs.core.journal.file import open_agent_journal, open_journal  # noqa: E402
from capsulefs.core.journal.lines import verify_lines  # noqa: E402
from capsulefs.core.store.host_store import HostStore  # noqa: E402


#: SQLite checkpoints its WAL at 1000 pages (one page per event here) and then
#: overwrites it from the start: from there on its commits do not grow a file.
WAL_WRAP = 1000


def make_events(n: int) -> list[Event]:
    kinds = [
        lambda i: UserMessage(text=f"please look at file {i} and tell me what it does"),
        lambda i: AssistantMessage(text="Sure. " + "It parses the input and writes a report. " * 4, provider="anthropic", model="m"),
        lambda i: ToolCall(call_id=f"c{i}", name="read_file", arguments={"path": f"src/f{i}.py"}),
        lambda i: ToolResult(call_id=f"c{i}", content="def main():\n    return 0\n" * 3),
    ]
    return [kinds[i % 4](i) for i in range(n)]


def fs_floor(d: str, *, turns: int, batch: int) -> tuple[float, float, float]:
    """Median seconds of (grow a file by a line + fdatasync) and (overwrite
    4 KiB in place + fdatasync), alternating turns, and the median per-turn
    ratio overwrite/grow."""
    line = b"x" * 299 + b"\n"
    page = b"p" * 4096
    grow_fd = os.open(os.path.join(d, "floor-grow"), os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
    over_fd = os.open(os.path.join(d, "floor-over"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(over_fd, page * batch)
        os.fsync(over_fd)
        grow, over = [], []
        for _ in range(turns):
            t0 = time.perf_counter()
            for _ in range(batch):
                os.write(grow_fd, line)
                os.fdatasync(grow_fd)
            t1 = time.perf_counter()
            for i in range(batch):
                os.pwrite(over_fd, page, i * len(page))
                os.fdatasync(over_fd)
            t2 = time.perf_counter()
            grow.append((t1 - t0) / batch)
            over.append((t2 - t1) / batch)
    finally:
        os.close(grow_fd)
        os.close(over_fd)
    return statistics.median(grow), statistics.median(over), statistics.median(o / g for g, o in zip(grow, over))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=4000, help="appends on each side")
    ap.add_argument("--batch", type=int, default=50, help="appends per turn; the sides take turns")
    ap.add_argument("--dir", default=None, help="directory to write in (default: a temp dir on /var/tmp)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one round: does it run (CI), not a figure")
    args = ap.parse_args()
    # the context figures' sizes: group commits, plain-journal appends, file-system floor turns
    n_group, n_plain, floor_turns = 800, 1000, 20
    if args.smoke:
        args.events, args.batch = 100, 10
        n_group, n_plain, floor_turns = 40, 60, 2
    events = make_events(args.events)
    ids = itertools.count()
    base = args.dir or ("/var/tmp" if os.path.isdir("/var/tmp") else None)

    with tempfile.TemporaryDirectory(prefix="bench-append-", dir=base) as d:
        store = HostStore.open(os.path.join(d, "state"))
        agent = store.create_agent("bench", host_id="bench-host", agent_id="b" * 32)
        journal = open_agent_journal(agent, machine="bench-host", now=time.time, new_id=lambda: f"{next(ids):024x}")
        conn = sqlite3.connect(os.path.join(d, "events.db"), isolation_level=None)
        assert conn.execute("PRAGMA journal_mode=WAL").fetchone()[0] == "wal"
        conn.execute("PRAGMA synchronous=FULL")
        assert conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
        conn.execute("CREATE TABLE events (seq INTEGER PRIMARY KEY, id TEXT NOT NULL, line TEXT NOT NULL)")
        # Warm both up (file creation, first allocations) outside the timing.
        warm = make_events(50)
        for i, ev in enumerate(warm):
            rec = journal.append(ev)
            conn.execute("BEGIN")
            conn.execute("INSERT INTO events VALUES (?, ?, ?)", (-1 - i, rec.id, rec.line.decode()))
            conn.execute("COMMIT")

        # The sides take turns, a batch each, so both see the same machine noise.
        t_ours = t_sql = 0.0
        ratios = []
        phases = [[0.0, 0.0, 0], [0.0, 0.0, 0]]  # [ours_s, sqlite_s, events] before / after SQLite's WAL wraps
        phase_ratios: list[list[float]] = [[], []]  # per-turn ratios, before / after the wrap
        for lo in range(0, args.events, args.batch):
            batch = events[lo : lo + args.batch]
            t0 = time.perf_counter()
            recs = [journal.append(ev) for ev in batch]
            t1 = time.perf_counter()
            for rec in recs:
                conn.execute("BEGIN")
                conn.execute("INSERT INTO events VALUES (?, ?, ?)", (rec.seq, rec.id, rec.line.decode()))
                conn.execute("COMMIT")
            t2 = time.perf_counter()
            t_ours += t1 - t0
            t_sql += t2 - t1
            ratios.append((t2 - t1) / (t1 - t0))
            phase = 0 if lo < WAL_WRAP else 1
            phase_ratios[phase].append((t2 - t1) / (t1 - t0))
            phases[phase][0] += t1 - t0
            phases[phase][1] += t2 - t1
            phases[phase][2] += len(batch)
        # For context (not the target): group commit, 8 events per write and fdatasync.
        group = make_events(n_group)
        t0 = time.perf_counter()
        for lo in range(0, len(group), 8):
            journal.append_many(group[lo : lo + 8])
        t_group = time.perf_counter() - t0
        lines = journal.lines()
        checkpoints = journal.checkpoints
        leased, commits = journal.leased_commits, journal.commits
        direct = journal._ring is not None and journal._ring.direct  # how the ring's records were made durable
        journal.close()
        conn.close()
        floor = fs_floor(d, turns=floor_turns, batch=args.batch)
        # For context: the plain journal (no ring), alternating with the store's journal in turns.
        plain = open_journal(
            os.path.join(d, "plain.jsonl"), machine="bench-host", now=time.time,
            new_id=lambda: f"{next(ids):024x}", recovery_dir=os.path.join(d, "recovery"),
        )
        ringed = open_agent_journal(agent, machine="bench-host", now=time.time, new_id=lambda: f"{next(ids):024x}")
        plain_events = make_events(n_plain)
        for ev in plain_events[:20]:
            plain.append(ev)
            ringed.append(ev)
        t_plain = t_ringed = 0.0
        for lo in range(20, len(plain_events), args.batch):
            batch = plain_events[lo : lo + args.batch]
            t0 = time.perf_counter()
            for ev in batch:
                plain.append(ev)
            t1 = time.perf_counter()
            for ev in batch:
                ringed.append(ev)
            t2 = time.perf_counter()
            t_plain += t1 - t0
            t_ringed += t2 - t1
        n_plain = len(plain_events) - 20
        assert verify_lines(plain.lines()) == [] and verify_lines(ringed.lines()) == []
        plain.close()
        ringed.close()
        assert verify_lines(lines) == [], "the benchmark journal does not verify"
        assert len(lines) == args.events + len(warm) + len(group)

    n = args.events
    ours_rate, sql_rate = n / t_ours, n / t_sql
    ratio = ours_rate / sql_rate
    ratios.sort()
    print(f"{n} durable appends on each side, in alternating turns of {args.batch}")
    print(f"sqlite WAL synchronous=FULL, 1 txn/event: {sql_rate:8.0f} events/s")
    print(f"capsulefs journal append (durable ring record, "
          f"{'O_DIRECT|O_DSYNC' if direct else 'pwrite + fdatasync'}): {ours_rate:7.0f} events/s")
    print(f"per-turn ratios: min {ratios[0]:.2f}, median {ratios[len(ratios) // 2]:.2f}, max {ratios[-1]:.2f}")
    print(f"(context) group commit, 8 events per fdatasync: {len(group) / t_group:8.0f} events/s")
    print(f"(context) commits under a lease (the flock kept since the previous commit: no flock, statx or "
          f"ring header read): {leased} of {commits}")
    print(f"(context) checkpoints (fdatasync of the journal itself when the ring restarts): {checkpoints} "
          f"in {n + len(warm) + len(group) // 8} commits")
    print(f"(context) plain journal without a ring (grow + fdatasync per append): {n_plain / t_plain:6.0f} events/s, "
          f"vs the store's journal in the same turns {n_plain / t_ringed:6.0f} events/s "
          f"({t_plain / t_ringed:.2f}x)")
    for name, (o, q, k), pr in zip(("while SQLite's WAL grows", "after its WAL wraps (steady state)"), phases, phase_ratios):
        if k:
            print(f"(context) {name}: {k / o:6.0f} vs {k / q:6.0f} events/s, ratio {q / o:.2f}x, "
                  f"median per-turn ratio {statistics.median(pr):.2f}")
    print(f"(context) the file system alone (no Python, no SQLite): grow a file + fdatasync {floor[0] * 1e6:.0f} us, "
          f"overwrite in place + fdatasync {floor[1] * 1e6:.0f} us, ratio {floor[2]:.2f}x (median per-turn ratio)")
    print(f"ratio: {ratio:.2f}x SQLite's appends/s (target >= 1.0x): {'PASS' if ratio >= 1.0 else 'FAIL'}")
    o, q, k = phases[1]
    if k:  # a longer run weighs this more: say it as plainly as the whole run's figure
        steady = q / o
        print(f"steady state (after SQLite's WAL wraps, {k} events): {steady:.2f}x "
              f"(target >= 1.0x): {'PASS' if steady >= 1.0 else 'FAIL'}")
    return 0 if ratio >= 1.0 or args.smoke else 1


if __name__ == "__main__":
    sys.exit(main())
