"""The agent-process sampler of test_stale_run.py, as a process of its own
(so the test's own work never delays a sample): ``python sampler_process.py
OUT`` (SCRIPT in $SAMPLE_SCRIPT, so that this process is not one of them)
appends ``TIME LABEL,LABEL`` to OUT every few ms, one line per sample, each
label the host (mount) of a live process running SCRIPT (with $SAMPLE_AGENTS
set, ``HOST/AGENT``), until its stdin closes. As root it runs real-time
(SCHED_FIFO 1; it sleeps between samples).

A process seen not to run SCRIPT once it is a few seconds old is not looked
at again (a young one may still exec into it), and only a python's command
line is read, so a sample costs one listing of /proc and a read of the young
processes' and the tickers' stat."""

from __future__ import annotations

import os
import select
import sys
import time

SETTLED = 5.0


def label_of(script: bytes, pid: str) -> str | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if script not in f.read().split(b"\0"):
                return None
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    except OSError:
        return None
    capsule = env.get(b"CAPSULE_DIR", b"?").decode()
    host = os.path.basename(os.path.dirname(capsule))
    return f"{host}/{os.path.basename(capsule)}" if os.environ.get("SAMPLE_AGENTS") else host


def comm_of(pid: str) -> bytes | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        return data[data.index(b"(") + 1:data.rindex(b")")]
    except (OSError, ValueError):
        return None


def stat_fields(pid: str) -> list[bytes] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def main() -> None:
    script = os.environ["SAMPLE_SCRIPT"].encode()
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    except (PermissionError, AttributeError):
        pass
    tick = os.sysconf("SC_CLK_TCK")
    others: set[str] = set()
    tickers: dict[str, str] = {}
    if True:
        while not select.select([sys.stdin], [], [], 0.004)[0]:
            live = set(filter(str.isdigit, os.listdir("/proc")))
            with open("/proc/uptime", "rb") as u:
                now = float(u.read().split()[0])
            for pid in live - others - set(tickers):
                # (stat first: reading a process's cmdline waits for its memory map's lock,
                # which a process that forks or execs holds; stat does not)
                comm = comm_of(pid)
                if comm is not None and comm.startswith(b"python"):
                    label = label_of(script, pid)
                    if label is not None:
                        tickers[pid] = label
                        continue
                fields = stat_fields(pid)
                if fields is not None and now - int(fields[19]) / tick > SETTLED:
                    others.add(pid)
            labels = set()
            for pid, label in list(tickers.items()):
                fields = stat_fields(pid) if pid in live else None
                if fields is not None and fields[0] != b"Z":
                    labels.add(label)
                else:
                    del tickers[pid]
            others &= live
            os.write(1, f"{time.monotonic()} {','.join(sorted(labels))}\n".encode())


if __name__ == "__main__":
    main()
