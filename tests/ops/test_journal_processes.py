"""Journal appends across processes: SIGKILL at random points, concurrent appenders.

Each child appends events and prints an event's id only after ``append``
returned (after fdatasync): what the parent read is what was acknowledged.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

from capsulefs.core.journal.record import Record
from capsulefs.core.journal.lines import split_lines, verify_lines

CHILD = r"""
import itertools, os, sys
from capsulefs.core.journal.events import Note
from capsulefs.core.journal.file import open_journal
path, machine, count, big, tag = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
ids = itertools.count(1)
j = open_journal(path, machine=machine, now=lambda: 1764684000.0,
                 new_id=lambda: f"{os.getpid():08x}{next(ids):016x}",
                 recovery_dir=os.path.join(os.path.dirname(path), "recovery"))
print("ready", flush=True)
for i in range(count):
    # Every 3rd event is large, so a kill often lands inside a write.
    text = f"{tag}-{i} " + ("x" * big if i % 3 == 2 else "")
    if i % 5 == 4:
        recs = j.append_many([Note(text=text), Note(text=text + "/b")])
    else:
        recs = [j.append(Note(text=text))]
    print(" ".join(r.id for r in recs), flush=True)
"""


def _spawn(path: Path, machine: str, count: int, big: int, tag: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path), machine, str(count), str(big), tag],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _check(path: Path) -> list[Record]:
    data = path.read_bytes()
    assert data == b"" or data.endswith(b"\n"), "after recovery the file holds only whole lines"
    lines = split_lines(data)
    assert verify_lines(lines) == []
    return [Record.from_line(x) for x in lines]


def test_sigkill_at_random_points_loses_no_acknowledged_event(tmp_path: Path) -> None:
    rng = random.Random(20261202)
    path = tmp_path / "timeline_events.jsonl"
    acked: set[str] = set()
    for round_ in range(6):
        child = _spawn(path, "host-a", 10_000, rng.choice([50_000, 400_000, 2_000_000]), f"r{round_}")
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        for _ in range(rng.randint(1, 25)):
            line = child.stdout.readline()
            assert line, child.stderr.read() if child.stderr else ""
            acked.update(line.split())
        child.send_signal(signal.SIGKILL)
        # Whatever it printed before dying was acknowledged too.
        rest, _err = child.communicate()
        for line in rest.splitlines():
            acked.update(line.split())
        assert child.returncode == -signal.SIGKILL
        # Reopen (this is where a torn tail is moved aside) and check.
        from journal_helpers import open_test_journal

        open_test_journal(path).close()
        ids = {r.id for r in _check(path)}
        assert acked <= ids, f"round {round_}: lost acknowledged events {sorted(acked - ids)[:3]}"
    recovered = tmp_path / "recovery"
    for name in os.listdir(recovered) if recovered.exists() else []:
        assert name.startswith("timeline_events.jsonl.torn-")


def test_concurrent_appenders_lose_and_interleave_nothing(tmp_path: Path) -> None:
    path = tmp_path / "timeline_events.jsonl"
    children = [_spawn(path, "host-a", 200, 3000, f"w{k}") for k in range(4)]
    acked: list[str] = []
    for child in children:
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
        acked += [i for line in out.splitlines()[1:] for i in line.split()]
    records = _check(path)
    # 200 appends each, every 5th a pair: 240 events per writer.
    assert len(records) == len(acked) == 4 * 240
    assert sorted(r.id for r in records) == sorted(acked)
    assert [r.seq for r in records] == list(range(1, 961))
    assert [r.clock for r in records] == list(range(1, 961))
    per_writer: dict[str, list[int]] = {}
    for r in records:
        tag, i = r.event.text.split()[0].split("-")[:2]  # type: ignore[attr-defined]
        per_writer.setdefault(tag, []).append(int(i.split("/")[0]))
    for tag, seen in per_writer.items():
        assert seen == sorted(seen), f"writer {tag}'s events are out of its own order"


def test_concurrent_appenders_of_two_machines(tmp_path: Path) -> None:
    path = tmp_path / "timeline_events.jsonl"
    children = [_spawn(path, machine, 100, 100, machine) for machine in ("host-a", "host-b")]
    for child in children:
        _out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
    records = _check(path)
    assert len(records) == 2 * 120
    by = {m: [r.seq for r in records if r.machine == m] for m in ("host-a", "host-b")}
    assert by == {"host-a": list(range(1, 121)), "host-b": list(range(1, 121))}
    assert json.loads(records[-1].line)["clock"] == 240


FORKED_CHILD = r"""
import os, sys
from capsulefs.core.journal.events import Note
from capsulefs.core.journal.file import open_journal
path = sys.argv[1]
j = open_journal(path, machine="host-a", now=lambda: 1764684000.0,
                 new_id=iter(f"{k:024x}" for k in range(1, 10**6)).__next__,
                 recovery_dir=os.path.join(os.path.dirname(path), "recovery"))
j.append(Note(text="parent, before the fork"))
child = os.fork()
if child == 0:
    for use in (lambda: j.append(Note(text="child")), lambda: j.append_many([Note(text="child")]), j.refresh):
        try:
            use()
        except Exception as exc:
            print(type(exc).__name__, exc, flush=True)
        else:
            print("used", flush=True)
    j.close()  # closing is allowed, and frees nothing of the parent's
    os._exit(0)
os.waitpid(child, 0)
j.append(Note(text="parent, after the fork"))
print("parent appended", flush=True)
"""


def test_a_forked_child_cannot_use_the_parents_journal(tmp_path: Path) -> None:
    """flock belongs to the open file description, which a forked child
    shares with its parent: both would "hold" the lock and could interleave
    appends. The child's use of the inherited Journal is refused, naming
    the problem; the parent goes on."""
    path = tmp_path / "j.jsonl"
    out = subprocess.run([sys.executable, "-c", FORKED_CHILD, str(path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[-1] == "parent appended"
    child = lines[:-1]
    assert len(child) == 3 and all(x.startswith("JournalForked ") and "fork" in x and "open the journal again" in x
                                   for x in child), child
    data = path.read_bytes()
    assert verify_lines(split_lines(data)) == []
    assert [Record.from_line(x).event.text for x in split_lines(data)] == [  # type: ignore[attr-defined]
        "parent, before the fork", "parent, after the fork"]
