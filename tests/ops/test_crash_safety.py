"""A writer killed with SIGKILL at random points leaves every file whole or absent."""

from __future__ import annotations

import hashlib
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from capsulefs.core.capsule import format as fmt
from capsulefs.core.store.host_store import HostStore

WRITER = r"""
import hashlib, os, sys
from capsulefs.core.fsutil import atomic_write
from capsulefs.core.store.host_store import HostStore
from capsulefs.core.capsule import format as fmt

root, seed = sys.argv[1], int(sys.argv[2])
store = HostStore.open(os.path.join(root, "state"))
agent = store.agent(sys.argv[3])
files = os.path.join(root, "files")
os.makedirs(files, exist_ok=True)
i = 0
print("ready", flush=True)
while True:
    i += 1
    body = (f"{seed}:{i}:".encode() * (1 + (i * 7919) % 20000))
    # A self-describing file: its last 64 bytes are the sha256 of the rest.
    atomic_write(os.path.join(files, f"f{i % 5}"), body + hashlib.sha256(body).hexdigest().encode())
    sha = store.put_blob(body)
    agent.write_files({fmt.WORKING_MEMORY: body[:1000]}, add_blobs=[sha])
"""


def _whole(data: bytes) -> bool:
    body, digest = data[:-64], data[-64:]
    return hashlib.sha256(body).hexdigest().encode() == digest


def test_sigkill_at_random_points_leaves_files_whole_or_absent(tmp_path: Path) -> None:
    rng = random.Random(1234)
    store = HostStore.open(tmp_path / "state")
    agent = store.create_agent("crashy", host_id="H", agent_id="c" * 32)
    for round_ in range(6):
        with subprocess.Popen(
            [sys.executable, "-c", WRITER, str(tmp_path), str(round_), agent.agent_id],
            stdout=subprocess.PIPE,
        ) as proc:
            assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
            time.sleep(rng.uniform(0.01, 0.3))  # a random kill point, not a timing assertion
            proc.send_signal(signal.SIGKILL)

        for f in (tmp_path / "files").iterdir():
            if f.name.startswith(".tmp-"):
                continue  # a temp file is never a file's real name
            assert _whole(f.read_bytes()), f"{f} was left half written"
        reopened = HostStore.open(tmp_path / "state")
        for sha in reopened.all_blobs():
            reopened.verify_blob(sha)  # every blob under its name is whole
        m = reopened.agent(agent.agent_id).manifest()  # the manifest parses
        for sha in m.blobs():
            assert reopened.has_blob(sha), "the manifest lists a blob that never landed"
        mem = reopened.agent(agent.agent_id).read(fmt.WORKING_MEMORY)
        # The kill may land before this round's first edit: then the last
        # whole edit of an earlier round is still there, never a mix.
        if mem:
            seed, i = mem.split(b":")[:2]
            assert int(seed) <= round_
            unit = seed + b":" + i + b":"
            assert mem == (unit * (1 + len(mem) // len(unit)))[: len(mem)], "working memory is a torn edit"
