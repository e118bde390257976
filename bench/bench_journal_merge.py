"""Benchmark: merge two 500k-event journals that share 50% of their events,
against ``sort -u`` of the same lines (LC_ALL=C), side by side in one run.

Both sides read the two files and write the merged file. Target: capsulefs
takes at most 3x the time of ``sort -u``.

    .venv/bin/python bench/bench_journal_merge.py [--events 500000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import mmap
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from journal_data import diverged_pair  # noqa: E402

from capsulefs.core.journal.envelope_index import merge_pieces  # noqa: E402
from capsulefs.core.journal.lines import join_lines, split_lines, verify_lines  # noqa: E402


_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def run_merge(a_path: str, b_path: str, out_path: str) -> None:
    """Read both journals (mapped), merge, write the result: what sort -u does."""
    with open(a_path, "rb") as fa, open(b_path, "rb") as fb:
        a = mmap.mmap(fa.fileno(), 0, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ)
        b = mmap.mmap(fb.fileno(), 0, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ)
    pieces = merge_pieces(a, b)
    with open(out_path, "wb") as f:
        f.writelines(pieces)
    del pieces
    a.close()
    b.close()


def run_sort(a_path: str, b_path: str, out_path: str) -> None:
    env = dict(os.environ, LC_ALL="C")
    subprocess.run(["sort", "-u", a_path, b_path, "-o", out_path], check=True, env=env)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=500_000, help="events per journal")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each side; the best is kept")
    ap.add_argument("--check", action="store_true", help="also verify the merged journal fully (slow)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes, one round, nothing kept: does it run (CI), not a figure")
    args = ap.parse_args()
    if args.smoke:
        args.events, args.repeat, args.check = 2000, 1, True
    with tempfile.TemporaryDirectory(prefix="bench-merge-") as d:
        cache = os.path.join(d, "journals") if args.smoke else \
            os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", f"journal-merge-{args.events}")
        ratio = compare(args, cache, d)
    return 0 if ratio <= 3.0 or args.smoke else 1


def compare(args: argparse.Namespace, cache: str, d: str) -> float:
    """Make (or reuse) the two journals in ``cache``; merge them both ways
    in ``d``; the ratio of the best times."""
    a_path, b_path = os.path.join(cache, "a.jsonl"), os.path.join(cache, "b.jsonl")
    if not (os.path.exists(a_path) and os.path.exists(b_path)):
        t0 = time.perf_counter()
        os.makedirs(cache, exist_ok=True)
        a, b = diverged_pair(args.events)
        for path, lines in ((a_path, a), (b_path, b)):
            with open(path + ".tmp", "wb") as f:
                f.write(join_lines(lines))
            os.replace(path + ".tmp", path)
        del a, b
        print(f"made two journals of {args.events} events in {time.perf_counter() - t0:.1f}s (kept in {cache})")
    mb = (os.path.getsize(a_path) + os.path.getsize(b_path)) / 1e6
    print(f"two journals of {args.events} events sharing 50%, {mb:.0f} MB together")

    ours, theirs = [], []
    for _ in range(args.repeat):
        t = time.perf_counter()
        run_sort(a_path, b_path, os.path.join(d, "sorted"))
        theirs.append(time.perf_counter() - t)
        t = time.perf_counter()
        run_merge(a_path, b_path, os.path.join(d, "merged"))
        ours.append(time.perf_counter() - t)
    with open(os.path.join(d, "sorted"), "rb") as f:
        sorted_n = f.read().count(b"\n")
    with open(os.path.join(d, "merged"), "rb") as f:
        n = f.read().count(b"\n")
    assert n == sorted_n, (n, sorted_n)
    if args.check:
        with open(os.path.join(d, "merged"), "rb") as f:
            problems = verify_lines(split_lines(f.read()))
        assert not problems, problems[:3]
    best_ours, best_sort = min(ours), min(theirs)
    ratio = best_ours / best_sort
    print(f"sort -u:          {best_sort:.2f}s  ({n} distinct lines)")
    print(f"capsulefs merge:  {best_ours:.2f}s  (verifies both inputs' chains)")
    print(f"ratio: {ratio:.2f}x the time of sort -u (target <= 3.0x): {'PASS' if ratio <= 3.0 else 'FAIL'}")
    return ratio


if __name__ == "__main__":
    sys.exit(main())
