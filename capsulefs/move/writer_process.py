"""The helper process of a move's target (see capsulefs/move/writers.py): it
hashes and writes the slabs the daemon's event loop decrypted into shared
memory. Imports nothing but the standard library and the piece writer, so
that it starts in a few tens of milliseconds.

Run as ``python -I -m capsulefs.move.writer_process FD COUNT BUFFER``: FD is the shared
memory file of COUNT buffers of BUFFER bytes. Requests on stdin, one JSON
object per line; one reply per request, in order, on stdout:
  * ``{"op": "open", "w": ID, "pieces": [[sha256, size, path|null], ...]}``:
    a writer for one call; a thread starts creating its files ahead;
  * ``{"op": "slab", "w": ID, "buffer": I}``: write the writer's next slab
    from buffer I;
  * ``{"op": "close", "w": ID}``: the outcomes, ``[[sha256, written, intact], ...]``;
  * ``{"op": "abandon", "w": ID}``: remove what is not whole.
A reply is ``{"ok": true, "result": ...}`` or ``{"ok": false, "type":
"OSError"|"ValueError", "errno": N, "message": ...}``. Requests come
pipelined (the next slab may be queued before this one is answered), so
once a writer's open or slab has failed, each later slab and the close of
that writer fail the same way, without touching it: a piece must never be
reported written past a write that failed. Its abandon still removes what
is not whole. At the end of its stdin it abandons every writer still open
and exits; so it does when the daemon stops reading its answers.
"""

from __future__ import annotations

import json
import mmap
import os
import signal
import sys
import threading
from typing import Any

from capsulefs.move.pieces import Piece, PieceWriter

__all__ = ["serve"]


def _answer(out: Any, reply: dict[str, Any]) -> bool:
    """Write one answer; False if nobody reads them any more (the daemon
    closed its end): then stop, abandoning what is open."""
    try:
        out.write(json.dumps(reply).encode() + b"\n")
        out.flush()
    except (BrokenPipeError, ValueError):
        return False
    return True


def serve(fd: int, count: int, buffer: int) -> None:
    shared = mmap.mmap(fd, count * buffer)
    whole = memoryview(shared)
    views = [whole[i * buffer : (i + 1) * buffer] for i in range(count)]
    writers: dict[int, PieceWriter] = {}
    ahead: dict[int, threading.Thread] = {}
    failed: dict[int, dict[str, Any]] = {}  # writer -> the failure later slabs and its close repeat
    out = sys.stdout.buffer
    for line in sys.stdin.buffer:
        request = json.loads(line)
        op, wid = request["op"], request["w"]
        try:
            result: Any = None
            if op in ("slab", "close") and wid in failed:
                reply = failed[wid]
                if op == "close":
                    failed.pop(wid)
                if not _answer(out, reply):
                    break
                continue
            if op == "open":
                writer = writers[wid] = PieceWriter([Piece(sha, size, path) for sha, size, path in request["pieces"]],
                                                    buffer=buffer)
                if any(path is not None for _, _, path in request["pieces"]):
                    ahead[wid] = threading.Thread(target=writer.precreate, daemon=True)
                    ahead[wid].start()
            elif op == "slab":
                writers[wid].write_slab(views[request["buffer"]])
            elif op == "close":
                outcomes = writers.pop(wid).close()
                result = [[o.sha, o.written, o.intact] for o in outcomes]
            elif op == "abandon":
                dropped = writers.pop(wid, None)
                if dropped is not None:
                    dropped.abandon()
            else:
                raise ValueError(f"unknown request {op!r}")
            if op in ("close", "abandon") and wid in ahead:
                ahead.pop(wid).join()
            reply = {"ok": True, "result": result}
        except OSError as exc:
            reply = {"ok": False, "type": "OSError", "errno": exc.errno, "message": str(exc)}
        except (ValueError, KeyError) as exc:
            reply = {"ok": False, "type": "ValueError", "message": str(exc)}
        if not reply["ok"] and op in ("open", "slab"):
            failed[wid] = reply
        elif op == "abandon":
            failed.pop(wid, None)
        if not _answer(out, reply):
            break
    for writer in writers.values():  # the intake went away: leave nothing half written
        try:
            writer.abandon()
        except OSError:
            pass


if __name__ == "__main__":
    # A Ctrl-C at the daemon's terminal reaches this process too; the daemon
    # ends it by closing its stdin once the intake is done with it, so the
    # signal is not ours to act on (and must not print a traceback).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    serve(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
    # Every answer was flushed as it went and every writer is closed or
    # abandoned: nothing is left for the interpreter's exit to do but a
    # flush into a pipe that may be gone (the daemon's wait for this exit
    # is part of a move's activate).
    os._exit(0)
