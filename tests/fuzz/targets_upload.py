"""Fuzz target: a file written into ``AGENT/artifacts/blobs/`` (an upload), as the view takes it.

The input is a name and the bytes written under it: byte 0 says how
(its low 7 bits: the name's length, taken from the bytes after it; its high
bit: name the file by the sha256 of the rest instead, the honest upload).
``run`` creates the file in a fresh store's agent, writes the rest in
pieces, closes it, and checks what a user relies on: a close succeeds only
if the bytes hash to the name, the blob is then in the store and listed,
and otherwise nothing is; nothing is left in the uploads area.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from pathlib import Path

from capsulefs.core.capsule import format as fmt
from capsulefs.core.errors import CapsuleError
from capsulefs.core.view.nodes import Kind, Node
from capsulefs.core.view.host import LiveHost
from capsulefs.core.store.host_store import HostStore

from . import Target

HOST_ID = "FUZZHOSTAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
AGENT_ID = "0123456789abcdef0123456789abcdef"


def _seeds() -> list[bytes]:
    png = b"\x89PNG\r\n\x1a\n" + bytes(64)
    return [b"\x80" + png, b"\x80", bytes([64]) + hashlib.sha256(png).hexdigest().encode() + png,
            bytes([7]) + b"pic.png" + png, bytes([3]) + b"../x"]


def _run(data: bytes, scratch: Path) -> None:
    if not data:
        return
    if data[0] & 0x80:
        body = data[1:]
        name = hashlib.sha256(body).hexdigest()
    else:
        n = data[0] & 0x7F
        name, body = os.fsdecode(data[1:1 + n]) or "x", data[1 + n:]
    store = HostStore.open(scratch / "state")
    store.create_agent("fuzz", host_id=HOST_ID, agent_id=AGENT_ID)
    ids = itertools.count(1)
    live = LiveHost(store, host_id=HOST_ID, work_dir=str(scratch / "work"), new_agent_id=lambda: AGENT_ID,
                    new_event_id=lambda: f"{next(ids):024x}", now_ns=lambda: 1_700_000_000_000_000_000)
    stored = False
    try:
        _node, handle = live.create(Node(Kind.DIR, AGENT_ID, fmt.BLOBS_DIR), name, 0o644, os.O_WRONLY | os.O_CREAT)
    except CapsuleError:
        assert not fmt.is_sha256(name), name
        return
    try:
        for off in range(0, len(body), 97):
            assert handle.write(off, body[off:off + 97]) == len(body[off:off + 97])
        try:
            handle.flush()
            stored = True
        except CapsuleError:
            pass
    finally:
        handle.release()
    good = hashlib.sha256(body).hexdigest() == name
    assert stored == good, (name, stored)
    listed = name in store.agent(AGENT_ID).manifest().blobs()
    assert listed == stored == store.has_blob(name)  # (the agent starts with no blobs)
    assert not os.listdir(live.uploads.root)
    assert live.failsafe is None


TARGETS = [Target("mount_upload", _seeds, _run)]
