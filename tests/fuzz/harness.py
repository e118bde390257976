"""A mutation fuzzer for the targets of ``tests/fuzz`` (pure Python).

Run from tests/: ``python -m fuzz.harness --seconds 600`` (scripts/fuzz.sh),
or ``--inputs N``, ``--only archive.verify``; ``--save DIR`` keeps each
finding's first input. tests/fuzz/test_fuzz.py runs a short pass of every target.

Theory of operation: each target's seeds, plus every input it has accepted
so far, form its pool. An input is one to four mutations of a pool entry:
byte flips, interesting bytes, inserts, deletions, truncations, splices with
another entry, and, where the entry parses as a tar, tar-aware ones: header
fields rewritten with a valid checksum (sizes in octal, GNU base-256 and pax,
types, names 2,000 directories deep, links), pax and GNU long-name headers,
members moved, dropped, duplicated, thousands of tiny members appended,
member data changed, the end of the archive cut or followed by garbage.
Each input runs in a fresh scratch directory (on /dev/shm when there is
one) under a watchdog; a ``CapsuleError`` is a refusal, anything else a
finding, counted once per (type, innermost frame). The report gives
inputs/s, refusals, acceptances, findings, leftovers (a non-empty
``staging/`` under the scratch directory), peak RSS and the load average.

atheris was not used: its coverage guidance needs libFuzzer's loop, which
stops at the first finding and owns the process, while this harness must
count every finding and check the scratch directory after each input; the
tar-aware mutations above reach the parser's branches that matter here.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import resource
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from capsulefs.core.errors import CapsuleError
from capsulefs.core.fsutil import remove_tree

from . import Target, all_targets

BLOCK = 512
ZERO = b"\0" * BLOCK
MAX_INPUT = 4 << 20
POOL_MAX = 256
#: Accepted inputs larger than this are not kept to mutate further (they
#: would grow, and slow every input after them).
POOL_ENTRY_MAX = 256 << 10
SHA = "ab" * 32

# -- interesting values ------------------------------------------------------------------------

SIZES = [0, 1, 6, 26, 511, 512, 513, 4096, 65536, 8**11 - 1, 8**11, 2**33, 10 << 30, (64 << 30) + 1,
         2**63 - 1, 2**64, 10**30]
TYPES = b"0123456789xgLKSVMDAN\0 "
NAMES = [
    "manifest.json", "manifest.sig", "memory/working_memory.md", "memory/timeline_events.jsonl",
    "memory/vector_index/index.json", "artifacts/snapshot.json", "environment/spec.json",
    f"artifacts/blobs/{SHA}", "artifacts/blobs/not-a-sha", "memory", "artifacts/blobs", "environment",
    "./manifest.json", ".", "./", "", "../escape", "/tmp/capsulefs-fuzz-abs", "memory/../../x", "memory//x",
    "memory/./x", "memory\\x", "memory/x\nOK: forged line", "memory/\x1b[31mred", "mémoire/x",
    "memory/" + "d/" * 2040 + "f", "x" * 300, "memory/" + "y" * 255, "manifest.json/",
    "artifacts/blobs/" + SHA + "/x", "memory/vector_index/index.json/..",
]
PAX_KEYS = ["size", "path", "linkpath", "mtime", "uid", "gid", "uname", "atime", "hdrcharset",
            "GNU.sparse.size", "GNU.sparse.map", "GNU.sparse.major", "GNU.sparse.minor", "GNU.sparse.realsize",
            "GNU.sparse.name", "comment"]
PAX_VALUES = ["0", "1", "-1", "6", "1e400", "nan", "abc", "", "BINARY", "9" * 5000, str(10**30), str(2**63 - 1),
              "0,1,2", "1.0", *NAMES[:12]]
BYTES = [0x00, 0xFF, 0x7F, 0x80, 0x30, 0x37, 0x38, 0x20, 0x0A, 0x2F, 0x2E]


# -- a tolerant walk over tar headers ----------------------------------------------------------


@dataclass(frozen=True)
class Hdr:
    at: int  # offset of the header block
    size: int  # its size field
    end: int  # offset after its data


def _number(field_: bytes) -> int | None:
    if field_[:1] in (b"\x80", b"\xff"):
        n = int.from_bytes(field_[1:], "big")
        return n if field_[:1] == b"\x80" else n - 256 ** (len(field_) - 1)
    text = field_.split(b"\0", 1)[0].strip()
    try:
        return int(text or b"0", 8)
    except ValueError:
        return None


def headers(data: bytes) -> tuple[list[Hdr], int]:
    """The header blocks of a plain tar (pax and long-name ones included) up
    to its end or the first that does not parse; and where that is."""
    out: list[Hdr] = []
    at = 0
    while at + BLOCK <= len(data) and len(out) < 600:  # (mutations pick among the first 600)
        blk = data[at:at + BLOCK]
        if blk == ZERO:
            break
        size = _number(blk[124:136])
        if size is None or size < 0 or size > len(data):
            break
        end = at + BLOCK + -(-size // BLOCK) * BLOCK
        out.append(Hdr(at, size, end))
        at = end
    return out, at


def checksum(blk: bytes | bytearray) -> bytes:
    h = bytearray(blk[:BLOCK])
    h[148:156] = b" " * 8
    h[148:156] = b"%06o\0 " % sum(h)
    return bytes(h)


def header(name: str, size: int, kind: bytes = b"0", linkname: str = "") -> bytes:
    """A header block, preceded by a GNU long-name header for a long name."""
    raw = name.encode("utf-8", "surrogateescape")
    pre = b""
    if len(raw) > 100:
        pre = header("././@LongLink", len(raw) + 1, b"L") + raw + b"\0" + b"\0" * (-(len(raw) + 1) % BLOCK)
        raw = raw[:99]
    h = bytearray(BLOCK)
    h[0:len(raw)] = raw
    h[100:108] = b"0000644\0"
    h[108:116] = h[116:124] = b"0000000\0"
    h[124:136] = b"%011o\0" % size if size < 8**11 else b"\x80" + (size % 256**11).to_bytes(11, "big")
    h[136:148] = b"%011o\0" % 1_700_000_000
    h[156:157] = kind[:1]
    link = linkname.encode()[:100]
    h[157:157 + len(link)] = link
    h[257:265] = b"ustar\x0000"
    return pre + checksum(h)


def pax(records: list[bytes]) -> bytes:
    data = b"".join(records)
    return header("././@PaxHeader", len(data), b"x") + data + b"\0" * (-len(data) % BLOCK)


def pax_record(key: str, value: str) -> bytes:
    rec = f" {key}={value}\n".encode("utf-8", "surrogateescape")
    n = p = 0
    while True:
        n = len(rec) + len(str(p))
        if n == p:
            return str(n).encode() + rec
        p = n


# -- mutations -------------------------------------------------------------------------------------

Mutation = Callable[[bytes, random.Random, list[bytes]], bytes]


def flip_bits(d: bytes, r: random.Random, _p: list[bytes]) -> bytes:
    if not d:
        return d
    b = bytearray(d)
    for _ in range(r.randint(1, 8)):
        b[r.randrange(len(b))] ^= 1 << r.randrange(8)
    return bytes(b)


def set_bytes(d: bytes, r: random.Random, _p: list[bytes]) -> bytes:
    if not d:
        return d
    b = bytearray(d)
    for _ in range(r.randint(1, 4)):
        b[r.randrange(len(b))] = r.choice(BYTES) if r.random() < 0.7 else r.randrange(256)
    return bytes(b)


def insert_bytes(d: bytes, r: random.Random, _p: list[bytes]) -> bytes:
    at = r.randint(0, len(d))
    if d and r.random() < 0.5:
        i = r.randrange(len(d))
        chunk = d[i:i + r.randint(1, 4096)]
    else:
        chunk = bytes(r.randrange(256) for _ in range(r.randint(1, 64)))
    return d[:at] + chunk + d[at:]


def delete_bytes(d: bytes, r: random.Random, _p: list[bytes]) -> bytes:
    if not d:
        return d
    at = r.randrange(len(d))
    return d[:at] + d[at + r.randint(1, 2048):]


def truncate(d: bytes, r: random.Random, _p: list[bytes]) -> bytes:
    if not d:
        return d
    at = r.randrange(len(d))
    return d[:at - at % BLOCK if r.random() < 0.5 else at]


def splice(d: bytes, r: random.Random, pool: list[bytes]) -> bytes:
    other = r.choice(pool)
    if not d or not other:
        return d + other
    i, j = r.randrange(len(d)), r.randrange(len(other))
    if r.random() < 0.5:
        i, j = i - i % BLOCK, j - j % BLOCK
    return d[:i] + other[j:]


def _tar(d: bytes) -> tuple[list[Hdr], int] | None:
    hs, end = headers(d)
    return (hs, end) if hs else None


def rewrite_field(d: bytes, r: random.Random, _p: list[bytes]) -> bytes:
    """A header field rewritten with a valid checksum (mostly)."""
    t = _tar(d)
    if t is None:
        return set_bytes(d, r, _p)
    h = r.choice(t[0])
    blk = bytearray(d[h.at:h.at + BLOCK])
    what = r.choice(["size", "size", "size", "type", "name", "mode", "mtime", "uid", "magic", "link"])
    if what == "size":
        n = r.choice(SIZES + [max(h.size - 1, 0), h.size + 1, h.size * 2 + 1])
        if r.random() < 0.3:
            n = -n
        if 0 <= n < 8**11 and r.random() < 0.7:
            blk[124:136] = b"%011o\0" % n
        else:
            blk[124:136] = (b"\x80" if n >= 0 else b"\xff") + (n % 256**11).to_bytes(11, "big")
    elif what == "type":
        blk[156] = r.choice(TYPES)
    elif what == "name":
        raw = r.choice(NAMES).encode("utf-8", "surrogateescape")[:100]
        blk[0:100] = raw.ljust(100, b"\0")
    elif what == "mode":
        blk[100:108] = r.choice([b"7777777\0", b"0000000\0", b"\xff" * 8, b"0004755\0"])
    elif what == "mtime":
        blk[136:148] = r.choice([b"\x80" + b"\xff" * 11, b"\xff" * 12, b"77777777777\0", b"zzzzzzzzzzz\0"])
    elif what == "uid":
        blk[108:116] = r.choice([b"\x80\xff\xff\xff\xff\xff\xff\xff", b"7777777\0", b"abc\0\0\0\0\0"])
    elif what == "magic":
        blk[257:265] = r.choice([b"ustar  \0", b"ustar\x0000", b"garbage!", b"\0" * 8])
    else:
        blk[157:257] = r.choice(NAMES).encode("utf-8", "surrogateescape")[:100].ljust(100, b"\0")
        blk[156] = r.choice(b"12")
    out = checksum(blk) if r.random() < 0.9 else bytes(blk)
    return d[:h.at] + out + d[h.at + BLOCK:]


def pax_before(d: bytes, r: random.Random, _p: list[bytes]) -> bytes:
    """A pax header (well formed or not) before a member."""
    t = _tar(d)
    at = r.choice(t[0]).at if t else 0
    if r.random() < 0.8:
        recs = [pax_record(r.choice(PAX_KEYS), r.choice(PAX_VALUES)) for _ in range(r.randint(1, 3))]
    else:
        recs = [r.choice([b"99999999999999999999 size=1\n", b"9" * 5000 + b" size=1\n", b"0 x=\n", b"abc",
                          b"5 a=\n", b"12 size=\xff\xfe\n", b"30 size=100000000000000000000\n"])]
    block = pax(recs)
    if r.random() < 0.2:  # a pax header whose own size claim is huge
        block = header("././@PaxHeader", r.choice(SIZES[6:]), b"x") + block[BLOCK:]
    return d[:at] + block + d[at:]


def long_name_before(d: bytes, r: random.Random, _p: list[bytes]) -> bytes:
    """A GNU long name (or link name) for the next member: 2,040 directories deep, or odd."""
    t = _tar(d)
    at = r.choice(t[0]).at if t else 0
    name = r.choice(["memory/" + "d/" * 2040 + "f", "artifacts/blobs/" + SHA, "x" * 5000, "../" * 50 + "etc"])
    raw = name.encode()
    size = len(raw) + 1 if r.random() < 0.8 else r.choice(SIZES)
    kind = r.choice([b"L", b"K"])
    blk = header("././@LongLink", size, kind)
    data = raw + b"\0"
    return d[:at] + blk + data + b"\0" * (-len(data) % BLOCK) + d[at:]


def members_shuffle(d: bytes, r: random.Random, _p: list[bytes]) -> bytes:
    """Members moved, dropped or duplicated (a header and its data as one piece)."""
    t = _tar(d)
    if t is None or len(t[0]) < 2:
        return truncate(d, r, _p)
    hs, end = t
    pieces = [d[h.at:h.end] for h in hs]
    op = r.choice(["last", "swap", "drop", "dup"])
    i = r.randrange(len(pieces))
    if op == "last":
        pieces.append(pieces.pop(i))
    elif op == "swap":
        j = r.randrange(len(pieces))
        pieces[i], pieces[j] = pieces[j], pieces[i]
    elif op == "drop":
        pieces.pop(i)
    else:
        pieces.insert(r.randrange(len(pieces) + 1), pieces[i])
    return b"".join(pieces) + d[end:]


def many_members(d: bytes, r: random.Random, _p: list[bytes]) -> bytes:
    """Up to 2,000 tiny members appended before the end of the archive."""
    t = _tar(d)
    end = t[1] if t else len(d)
    return d[:end] + _tiny_members(r.choice(["blobs", "outside", "same", "dirs"]), r.choice([2, 10, 100, 2000])) + d[end:]


@functools.cache
def _tiny_members(kind: str, n: int) -> bytes:
    if kind == "blobs":
        names = [f"artifacts/blobs/{i:064x}" for i in range(n)]
    elif kind == "outside":
        names = [f"x{i}" for i in range(n)]
    elif kind == "same":
        names = ["memory/working_memory.md"] * n
    else:
        names = ["memory/" + "/".join(["d"] * (i % 50 + 1)) for i in range(n)]
    return b"".join(header(nm, 0, b"5" if kind == "dirs" else b"0") for nm in names)


def change_data(d: bytes, r: random.Random, _p: list[bytes]) -> bytes:
    """A member's data changed, its size kept (a tampered file)."""
    t = _tar(d)
    if t is None:
        return flip_bits(d, r, _p)
    files = [h for h in t[0] if h.size and h.at + BLOCK + h.size <= len(d)]
    if not files:
        return flip_bits(d, r, _p)
    h = r.choice(files)
    b = bytearray(d)
    i = h.at + BLOCK + r.randrange(h.size)
    b[i] = (b[i] + r.randint(1, 255)) % 256
    return bytes(b)


def end_of_archive(d: bytes, r: random.Random, _p: list[bytes]) -> bytes:
    t = _tar(d)
    end = t[1] if t else len(d)
    op = r.choice(["cut", "garbage", "zeros", "one-block"])
    if op == "cut":
        return d[:end]
    if op == "garbage":
        return d[:end] + bytes(r.randrange(256) for _ in range(r.randint(1, 2048))) + d[end:]
    if op == "zeros":  # (past 1 MiB: over what a compressed tar may hold after its end)
        return d + b"\0" * (r.choice([512, 10240, 65536]) if r.random() < 0.9 else (1 << 20) + BLOCK)
    return d[:end] + ZERO


BYTE_LEVEL: list[Mutation] = [flip_bits, set_bytes, insert_bytes, delete_bytes, truncate, splice]
TAR_AWARE: list[Mutation] = [rewrite_field, rewrite_field, rewrite_field, pax_before, long_name_before,
                             members_shuffle, many_members, change_data, change_data, end_of_archive]


def mutate(seed: bytes, r: random.Random, pool: list[bytes]) -> bytes:
    d = seed
    for _ in range(r.choice([1, 1, 1, 2, 2, 3, 4])):
        fns = TAR_AWARE if r.random() < 0.6 else BYTE_LEVEL
        d = r.choice(fns)(d, r, pool)
        if len(d) > MAX_INPUT:
            d = d[:MAX_INPUT]
    return d


# -- running ----------------------------------------------------------------------------------


class Hang(Exception):
    """An input ran past the watchdog."""


@dataclass
class Finding:
    key: str  # exception type and innermost frame
    message: str
    count: int = 0
    example: bytes = b""


@dataclass
class Report:
    target: str
    inputs: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    refused: int = 0
    accepted: int = 0
    leftovers: int = 0
    findings: dict[str, Finding] = field(default_factory=dict)
    peak_rss_mib: float = 0.0

    @property
    def rate(self) -> float:
        return self.inputs / self.seconds if self.seconds else 0.0

    @property
    def cpu_rate(self) -> float:
        return self.inputs / self.cpu_seconds if self.cpu_seconds else 0.0

    def summary(self) -> dict[str, object]:
        return {"target": self.target, "inputs": self.inputs, "seconds": round(self.seconds, 1),
                "inputs_per_s": round(self.rate, 1), "inputs_per_cpu_s": round(self.cpu_rate, 1),
                "refused": self.refused, "accepted": self.accepted,
                "leftovers": self.leftovers, "findings": {k: f.count for k, f in self.findings.items()},
                "peak_rss_mib": round(self.peak_rss_mib, 1)}


def _frame(exc: BaseException) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    if not tb:
        return "?"
    top = tb[-1]
    return f"{os.path.basename(top.filename)}:{top.lineno} in {top.name}"


def _leftovers(scratch: Path) -> list[str]:
    """Entries of any staging/ directory under scratch (a state directory a target made)."""
    found = []
    for staging in scratch.glob("*/staging"):
        found += [f"{staging}/{n}" for n in os.listdir(staging)]
    return found


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def scratch_root() -> str:
    """Where inputs run: /dev/shm if this host has it (fsync is free there)."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()


def fuzz_target(target: Target, *, seconds: float, inputs: int | None = None, seed: int = 0,
                watchdog: float = 20.0, root: str | None = None) -> Report:
    """Fuzz one target for ``seconds`` (or ``inputs`` inputs, whichever ends first)."""
    r = random.Random(f"{seed}:{target.name}")
    report = Report(target.name)
    pool = [s for s in target.seeds() if len(s) <= MAX_INPUT]
    seeds = list(pool)
    base = Path(tempfile.mkdtemp(prefix="capsulefs-fuzz-", dir=root or scratch_root()))

    def on_alarm(_sig: int, _frame: object) -> None:
        raise Hang(f"an input ran for more than {watchdog} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    outer, _ = signal.setitimer(signal.ITIMER_REAL, 0)  # (pytest-timeout's alarm, given back below)
    start, cpu = time.monotonic(), time.process_time()
    try:
        while time.monotonic() - start < seconds and (inputs is None or report.inputs < inputs):
            n = report.inputs
            if n < len(seeds):
                data = seeds[n]
            else:
                data = mutate(r.choice(seeds if r.random() < 0.3 else pool), r, pool)
            scratch = base / str(n)
            scratch.mkdir()
            signal.setitimer(signal.ITIMER_REAL, watchdog)
            try:
                target.run(data, scratch)
            except CapsuleError:
                report.refused += 1
            except Exception as exc:  # noqa: BLE001 - anything that is not ours is what we look for
                key = f"{type(exc).__name__} at {_frame(exc)}"
                f = report.findings.setdefault(key, Finding(key, str(exc)[:300], example=data))
                f.count += 1
            else:
                report.accepted += 1
                if len(data) > POOL_ENTRY_MAX:
                    pass
                elif len(pool) < POOL_MAX:
                    pool.append(data)
                else:
                    pool[r.randrange(len(seeds), POOL_MAX)] = data
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            if _leftovers(scratch):
                report.leftovers += 1
            remove_tree(scratch, ignore_errors=True)
            report.inputs += 1
    finally:
        signal.signal(signal.SIGALRM, old)
        report.seconds = time.monotonic() - start
        report.cpu_seconds = time.process_time() - cpu
        if outer:
            signal.setitimer(signal.ITIMER_REAL, max(outer - report.seconds, 0.001))
        report.peak_rss_mib = _peak_rss_mib()
        remove_tree(base, ignore_errors=True)
    return report


def select(only: str | None) -> list[Target]:
    targets = all_targets()
    if only:
        words = only.split(",")
        targets = [t for t in targets if any(w in t.name for w in words)]
    return targets


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fuzz.harness", description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=600.0, help="in all, shared equally by the targets")
    ap.add_argument("--inputs", type=int, default=None, help="at most this many inputs per target")
    ap.add_argument("--only", help="comma-separated parts of target names")
    ap.add_argument("--seed", type=int, default=int(time.time()))
    ap.add_argument("--save", help="a directory to keep each finding's first input in")
    ap.add_argument("--json", action="store_true", help="print the report as JSON too")
    args = ap.parse_args(argv)
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # a runaway input is a MemoryError, a finding
    targets = select(args.only)
    if not targets:
        print("no target matches", file=sys.stderr)
        return 2
    share = args.seconds / len(targets)
    print(f"fuzzing {len(targets)} targets, {share:.0f} s each, seed {args.seed}", flush=True)
    reports = []
    for t in targets:
        rep = fuzz_target(t, seconds=share, inputs=args.inputs, seed=args.seed)
        reports.append(rep)
        print(f"{rep.target:28} {rep.inputs:7} inputs {rep.rate:6.1f}/s ({rep.cpu_rate:6.1f}/cpu-s)  "
              f"refused {rep.refused:7}  "
              f"accepted {rep.accepted:6}  findings {len(rep.findings):3}  leftovers {rep.leftovers}", flush=True)
        for f in rep.findings.values():
            print(f"    {f.count:6} x {f.key}: {f.message}", flush=True)
            if args.save:
                os.makedirs(args.save, exist_ok=True)
                name = f"{rep.target}-{abs(hash(f.key)) % 10**8:08d}.bin"
                with open(os.path.join(args.save, name), "wb") as out:
                    out.write(f.example)
    verify = sum(r.inputs for r in reports if "verify" in r.target)
    imports = sum(r.inputs for r in reports if "import" in r.target)
    findings = sum(len(r.findings) for r in reports)
    leftovers = sum(r.leftovers for r in reports)
    load = os.getloadavg()
    print(f"total: {sum(r.inputs for r in reports)} inputs ({verify} verify, {imports} import) in "
          f"{sum(r.seconds for r in reports):.0f} s; distinct foreign exceptions {findings}; leftovers {leftovers}; "
          f"peak RSS {_peak_rss_mib():.0f} MiB; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    if args.json:
        print(json.dumps([r.summary() for r in reports], indent=1))
    return 1 if findings or leftovers else 0


if __name__ == "__main__":
    sys.exit(main())
