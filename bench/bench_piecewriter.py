"""Benchmark: the move target's piece writer against plain direct writes.

capsulefs: ``PieceWriter`` given a payload of N pieces back to back, slab
by slab as the target's intake gives it (each slab's segments put into a
4 MiB buffer at the layout's offsets, as the receiver's decryption would,
then ``write_slab``), with ``precreate`` in a second thread: it hashes each
piece (sha256) while a disk thread writes each to its own file with
O_DIRECT from the same buffer. Baseline: the
same bytes written to the same number of new files with O_DIRECT from one
aligned buffer, no hashing, no cutting, in one thread: what the disk and
the file system charge for the bytes alone. No fsync on either side (the
intake's settler does that, separately). The sides alternate rounds in one
process, each in a fresh directory; the figure is the median of per-round
ratios of throughput (ours / baseline). Context: a writer that hashes and
writes in turn in one thread (what PieceWriter did before its disk thread).

    .venv/bin/python bench/bench_piecewriter.py [--mib 512] [--pieces 500] [--rounds 5] [--dir DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from capsulefs.move.pieces import BUFFER, Piece, PieceWriter  # noqa: E402

def ours(d: str, blobs: list[bytes], payload: bytes) -> float:
    writer = PieceWriter([Piece(hashlib.sha256(b).hexdigest(), len(b), os.path.join(d, str(i)))
                          for i, b in enumerate(blobs)])
    ahead = threading.Thread(target=writer.precreate)
    buf = mmap.mmap(-1, BUFFER)
    t = time.perf_counter()
    ahead.start()
    at = 0
    for slab in writer.slabs:
        for seg in slab:
            buf[seg.offset : seg.offset + seg.size] = payload[at : at + seg.size]
            at += seg.size
        writer.write_slab(buf)
    outcomes = writer.close()
    elapsed = time.perf_counter() - t
    ahead.join()
    assert all(o.intact for o in outcomes)
    return elapsed


def in_turn(d: str, blobs: list[bytes], payload: bytes) -> float:
    """Context: hash then write each buffer, in turn, in one thread."""
    return _one_thread(d, blobs, hashing=True)


def baseline(d: str, blobs: list[bytes], payload: bytes) -> float:
    return _one_thread(d, blobs, hashing=False)


def _one_thread(d: str, blobs: list[bytes], *, hashing: bool) -> float:
    """Each blob into its own new file with O_DIRECT through one aligned
    buffer, in one thread; with ``hashing``, each buffer hashed first."""
    buf = mmap.mmap(-1, BUFFER)
    t = time.perf_counter()
    for i, blob in enumerate(blobs):
        fd = os.open(os.path.join(d, str(i)), os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
        h = hashlib.sha256()
        for at in range(0, len(blob), BUFFER):
            part = blob[at : at + BUFFER]
            buf[: len(part)] = part
            with memoryview(buf) as whole, whole[: len(part)] as data:
                if hashing:
                    h.update(data)
                _write_direct(fd, data)
        os.close(fd)
    elapsed = time.perf_counter() - t
    buf.close()
    return elapsed


def _write_direct(fd: int, data: memoryview) -> None:
    import fcntl

    blocks = len(data) - len(data) % 4096
    if blocks:
        os.write(fd, data[:blocks])
    if blocks < len(data):  # a piece's last part block goes through the page cache
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        os.write(fd, data[blocks:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--pieces", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir under /var/tmp)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one round: does it run (CI), not a figure")
    args = ap.parse_args()
    if args.smoke:
        args.mib, args.pieces, args.rounds = 4, 8, 1
    size = (args.mib << 20) // args.pieces
    blobs = [os.urandom(size + (i % 7) * 100) for i in range(args.pieces)]  # not all whole blocks
    payload = b"".join(blobs)
    base = args.dir or ("/var/tmp" if os.path.isdir("/var/tmp") else None)
    results: dict[str, list[float]] = {"baseline": [], "ours": [], "in_turn": []}
    with tempfile.TemporaryDirectory(prefix="bench-pw-", dir=base) as root:
        for rnd in range(args.rounds):
            for name, fn in (("baseline", baseline), ("ours", ours), ("in_turn", in_turn)):
                d = os.path.join(root, f"{name}-{rnd}")
                os.mkdir(d)
                results[name].append(len(payload) / fn(d, blobs, payload) / 1e6)
                shutil.rmtree(d)
            print(f"round {rnd + 1}: " + ", ".join(f"{k} {v[-1]:.0f} MB/s" for k, v in results.items()), flush=True)
    ratio = statistics.median(o / b for o, b in zip(results["ours"], results["baseline"]))
    turn = statistics.median(o / b for o, b in zip(results["in_turn"], results["baseline"]))
    print(f"{args.mib} MiB in {args.pieces} pieces: PieceWriter (hash beside the direct write of each slab) / "
          f"plain direct writes: median {ratio:.2f}x")
    print(f"(context) hashing and writing in turn, one thread / plain direct writes: median {turn:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
