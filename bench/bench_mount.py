"""The FUSE mount against the files underneath it, ratios from one run.

1. Sequential read of a 256 MiB blob through the mount vs straight from the
   host store's object file: cold (page cache dropped before every read, if
   this process may write /proc/sys/vm/drop_caches) and warm.
   Targets: cold >= 0.5x, warm >= 0.9x.
2. ``stat`` of every file across 100 agents x 100 files vs the same tree on
   the native file system, warm (one pass first). Target: >= 0.3x.
3. Durable journal appends per second through the mount (one O_APPEND
   write per event, acknowledged after fdatasync) vs the journal API
   directly. Target: >= 0.5x.

A ratio is speed through the mount / speed of the baseline (1.0 = as fast).
Needs root and /dev/fuse. Run: .venv/bin/python bench/bench_mount.py
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from common import capsulefs_cmd, pairs, timed

from capsulefs.core.capsule import format as fmt
from capsulefs.core.journal.events import Note
from capsulefs.core.store.host_store import HostStore
from capsulefs.move.host import record_new_agent
from capsulefs.peer.identity import load_or_create_identity

HOST = "BENCHHOST"
READ_CHUNK = 1 << 20


@contextlib.contextmanager
def mounted(state: Path, mnt: Path) -> Iterator[None]:
    mnt.mkdir(exist_ok=True)
    proc = subprocess.Popen([*capsulefs_cmd(), "mount", str(mnt), "--state", str(state)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(1200):
            if os.path.ismount(mnt):
                break
            if proc.poll() is not None:
                raise SystemExit(f"the daemon exited with {proc.returncode}")
            time.sleep(0.025)
        else:
            raise SystemExit("the mount did not appear")
        yield
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def read_all(path: Path) -> int:
    n = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(READ_CHUNK)
        while got := f.readinto(buf):
            n += got
    return n


def make_big_agent(store: HostStore, size_mib: int) -> str:
    agent = store.create_agent("big", host_id=HOST, agent_id=secrets.token_hex(16))
    tmp = Path(store.root) / "big.bin"
    with open(tmp, "wb") as f:
        for _ in range(size_mib):
            f.write(os.urandom(1 << 20))
    with open(tmp, "rb") as f:
        sha, _ = store.put_blob_stream(f)
    tmp.unlink()
    with store.writing():
        agent.write_files({fmt.SNAPSHOT: fmt.snapshot_bytes({"big.bin": sha})}, add_blobs=[sha])
    return sha


def bench_read(tmp: Path, size_mib: int, rounds: int, *, cold: bool = True) -> None:
    store = HostStore.open(tmp / "state-read")
    sha = make_big_agent(store, size_mib)
    mnt = tmp / "mnt-read"
    direct = Path(store.blob_file(sha))
    with mounted(tmp / "state-read", mnt):
        through = mnt / "big" / fmt.blob_path(sha)
        can_drop = cold and drop_caches()
        first = timed(lambda: read_all(through))
        line = f"read {size_mib} MiB: first read through the mount (also verifies the blob): {size_mib / first:.0f} MiB/s"
        if can_drop:
            drop_caches()
            store_cold = timed(lambda: read_all(direct))
            line += f", cold store {size_mib / store_cold:.0f} MiB/s, ratio {store_cold / first:.2f}x"
        print(line)
        if can_drop:
            def cold(p: Path) -> None:
                drop_caches()
                read_all(p)
            # drop_caches inside the timing is the same for both sides; time it apart and subtract
            t_drop = statistics.median(timed(drop_caches) for _ in range(3))
            r = pairs(lambda: cold(through), lambda: cold(direct), rounds=rounds, warmup=0)
            c, b = r["candidate_s"] - t_drop, r["baseline_s"] - t_drop
            print(f"  cold: mount {size_mib / c:.0f} MiB/s, store {size_mib / b:.0f} MiB/s, "
                  f"ratio {r['speed_ratio']:.2f}x (target >= 0.5x; median of per-round ratios, drop_caches included)")
        else:
            print("  cold: skipped " + ("(cannot write /proc/sys/vm/drop_caches)" if cold else "(--smoke: the whole machine's page cache is not dropped)"))
        r = pairs(lambda: read_all(through), lambda: read_all(direct), rounds=rounds, warmup=1)
        print(f"  warm: mount {size_mib / r['candidate_s']:.0f} MiB/s, store {size_mib / r['baseline_s']:.0f} MiB/s, "
              f"ratio {r['speed_ratio']:.2f}x (target >= 0.9x)")
        # Why warm stays below 0.9x: no request reaches the daemon, but the kernel's
        # FUSE page cache holds 4 KiB pages while ext4 caches the store file in large
        # folios (1 MiB here). Context, not the target: the same comparison with the
        # store file re-read into 4 KiB pages.
        small_pages(direct)
        r = pairs(lambda: read_all(through), lambda: read_all(direct), rounds=rounds, warmup=0)
        print(f"  (context) warm, the store file cached in 4 KiB pages like the mount's: mount "
              f"{size_mib / r['candidate_s']:.0f} MiB/s, store {size_mib / r['baseline_s']:.0f} MiB/s, "
              f"ratio {r['speed_ratio']:.2f}x")


def small_pages(path: Path) -> None:
    """Drop a file from the page cache and read it back 4 KiB at a time
    without readahead, so that it is cached in 4 KiB pages."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        size = os.fstat(fd).st_size
        for off in range(0, size, 4096):
            os.pread(fd, 4096, off)
    finally:
        os.close(fd)


def bench_stat(tmp: Path, agents: int, files: int, rounds: int) -> None:
    store = HostStore.open(tmp / "state-stat")
    local = 5  # working memory, journal, index, snapshot, spec
    n_blobs = files - local - 1  # and the manifest
    blobs = [store.put_blob(f"blob {i}\n".encode()) for i in range(n_blobs)]
    for a in range(agents):
        agent = store.create_agent(f"agent{a:03d}", host_id=HOST, agent_id=f"{a:032x}")
        with store.writing():
            agent.write_files({fmt.SNAPSHOT: fmt.snapshot_bytes({f"f{i}": s for i, s in enumerate(blobs)})},
                              add_blobs=blobs)
    mnt = tmp / "mnt-stat"
    with mounted(tmp / "state-stat", mnt):
        rel = []
        for dirpath, _dirs, names in os.walk(mnt):
            rel += [os.path.relpath(os.path.join(dirpath, n), mnt) for n in names]
        assert len(rel) == agents * files, (len(rel), agents * files)
        native = tmp / "native"
        for r in rel:
            p = native / r
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(b"x")
        through = [str(mnt / r) for r in rel]
        plain = [str(native / r) for r in rel]

        def stat_all(paths: list[str]) -> None:
            for p in paths:
                os.stat(p)

        r = pairs(lambda: stat_all(through), lambda: stat_all(plain), rounds=rounds, warmup=1)
        n = len(rel)
        print(f"stat {n} files ({agents} agents x {files}), warm: mount {n / r['candidate_s']:.0f}/s, "
              f"native {n / r['baseline_s']:.0f}/s, ratio {r['speed_ratio']:.2f}x (target >= 0.3x)")


def bench_append(tmp: Path, n: int, rounds: int) -> None:
    store = HostStore.open(tmp / "state-append")
    # held here, as `capsulefs new` makes it (the manifest names this host, the record says held): writable
    store.create_agent("a", host_id=load_or_create_identity(store.root).host_id, agent_id=f"{1:032x}")
    record_new_agent(store.root, f"{1:032x}")
    direct_agent = store.create_agent("b", host_id=HOST, agent_id=f"{2:032x}")
    mnt = tmp / "mnt-append"
    line = b'{"kind":"note","text":"a note of moderate length, like most events"}\n'
    from capsulefs.core.view.journal_tail import open_appender

    appender = open_appender(direct_agent.path(fmt.JOURNAL), machine=HOST, new_id=lambda: secrets.token_hex(12),
                             now_ns=time.time_ns, recovery_dir=str(tmp / "recovery"))
    with mounted(tmp / "state-append", mnt):
        journal = mnt / "a" / fmt.JOURNAL

        def through() -> None:
            fd = os.open(journal, os.O_WRONLY | os.O_APPEND)
            try:
                for _ in range(n):
                    os.write(fd, line)
            finally:
                os.close(fd)

        def direct() -> None:
            for _ in range(n):
                appender.append(Note(text="a note of moderate length, like most events"))

        r = pairs(through, direct, rounds=rounds, warmup=1)
        print(f"durable appends, 1 writer: mount {n / r['candidate_s']:.0f}/s, journal API {n / r['baseline_s']:.0f}/s, "
              f"ratio {r['speed_ratio']:.2f}x (target >= 0.5x)")
    appender.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--agents", type=int, default=100)
    ap.add_argument("--files", type=int, default=100)
    ap.add_argument("--appends", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", choices=("read", "stat", "append"))
    ap.add_argument("--dir", default="/var/tmp", help="where to make the stores and mounts (default: /var/tmp)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes, one round, no cold reads: does it run (CI), not a figure")
    args = ap.parse_args()
    if args.smoke:
        args.size_mib, args.agents, args.files, args.appends, args.rounds = 4, 3, 10, 20, 1
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse") or not shutil.which("fusermount3"):
        raise SystemExit("bench_mount needs root, /dev/fuse and fusermount3")
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-mount-") as d:
        tmp = Path(d)
        if args.only in (None, "read"):
            bench_read(tmp, args.size_mib, args.rounds, cold=not args.smoke)
        if args.only in (None, "stat"):
            bench_stat(tmp, args.agents, args.files, args.rounds)
        if args.only in (None, "append"):
            bench_append(tmp, args.appends, args.rounds)


if __name__ == "__main__":
    main()
