"""Readahead of the mount's backing device info (bdi), set by the daemon.

The kernel gives each FUSE mount its own bdi, named ``MAJOR:MINOR`` after
the mount's device, with ``read_ahead_kb`` at 128. A cold sequential read of
a 256 MiB blob ran at 0.61-0.75x the store file with 128 and 0.80-0.94x
with 1024 (bench/bench_mount.py, medians of alternating rounds). Warm reads
are served from the page cache and do not change.

When: the kernel offers the bdi's readahead in FUSE_INIT and clamps the bdi
to the answer, so a value set before INIT is answered falls back to 128.
:func:`tune_read_ahead` runs in the daemon's nursery and first stat()s the
mountpoint from a worker thread: the kernel holds every request until INIT
is answered, so once that stat returns the setting sticks. The device is
found in /proc/self/mountinfo. Setting it needs root; anywhere else it is
skipped (a debug log line if it fails).
"""

from __future__ import annotations

import logging
import os

import trio

log = logging.getLogger(__name__)

#: read_ahead_kb for the mount's bdi.
READ_AHEAD_KB = 1024


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as \\ooo."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mount_device(mountinfo: str, mountpoint: str) -> str | None:
    """``MAJOR:MINOR`` of the mount on ``mountpoint`` in a mountinfo text: the
    last entry for that path, which is the mount on top."""
    found = None
    for line in mountinfo.splitlines():
        fields = line.split(" ")
        if len(fields) > 4 and _unescape(fields[4]) == mountpoint:
            found = fields[2]
    return found


def set_read_ahead(mountpoint: str, kb: int = READ_AHEAD_KB) -> bool:
    """Set read_ahead_kb of the bdi of the mount on ``mountpoint`` (best effort)."""
    try:
        with open("/proc/self/mountinfo") as f:
            dev = mount_device(f.read(), os.path.abspath(mountpoint))
        if dev is None:
            log.debug("no mount on %s in mountinfo; readahead left alone", mountpoint)
            return False
        with open(f"/sys/class/bdi/{dev}/read_ahead_kb", "w") as f:
            f.write(f"{kb}\n")
    except OSError as exc:
        log.debug("could not set readahead of the mount on %s: %s", mountpoint, exc)
        return False
    log.debug("readahead of the mount on %s (bdi %s): %d KiB", mountpoint, dev, kb)
    return True


async def tune_read_ahead(mountpoint: str, kb: int = READ_AHEAD_KB) -> None:
    """Set the mount's readahead once the kernel has its FUSE_INIT answer.
    Run it as a task of the daemon's nursery, once the session is served."""
    if os.geteuid() != 0:
        return
    await trio.to_thread.run_sync(os.stat, mountpoint, abandon_on_cancel=True)
    set_read_ahead(mountpoint, kb)
