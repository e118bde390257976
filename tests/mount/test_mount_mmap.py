"""Real mounts: mmap of capsule files. Read-only files map; direct I/O files
(the journal, control files, a file open for writing) refuse a shared map
with ENODEV and take a private one. See ``core/view/handles.py`` for why the
journal stays direct I/O, and the test below that keeps it honest."""

from __future__ import annotations

import errno
import json
import mmap
import os
import threading
from pathlib import Path

import pytest

from capsulefs.core.capsule import format as fmt
from capsulefs.core.store.host_store import HostStore
from helpers import make_agent
from mount_kit import check_chains, mounted, needs_fuse

pytestmark = [pytest.mark.fuse, needs_fuse]


@pytest.fixture
def mnt(store: HostStore, state_dir: Path, tmp_path: Path):
    make_agent(store, "alice")
    m = tmp_path / "mnt"
    with mounted(state_dir, m):
        yield m / "alice"


def mapped(path: Path, flags: int = mmap.MAP_SHARED) -> bytes:
    """The whole file through a read-only map (shared: what `mmap.mmap(fd, 0)` does by default)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, flags=flags, prot=mmap.PROT_READ) as m:
        return m[:]


def append(agent: Path, text: str) -> None:
    with open(agent / fmt.JOURNAL, "ab") as f:
        f.write(json.dumps({"kind": "note", "text": text}).encode() + b"\n")


def test_read_only_files_map_and_direct_io_files_map_privately(mnt: Path) -> None:
    append(mnt, "first")
    os.mkdir(mnt / ".snapshots" / "s")
    blobs = sorted((mnt / fmt.BLOBS_DIR).iterdir())
    snap = mnt / ".snapshots" / "s"
    for p in [mnt / fmt.MANIFEST, mnt / fmt.WORKING_MEMORY, mnt / fmt.SPEC, mnt / fmt.SNAPSHOT, *blobs,
              snap / fmt.MANIFEST, snap / fmt.JOURNAL, snap / fmt.BLOBS_DIR / blobs[0].name]:
        assert mapped(p) == p.read_bytes(), p
    for p in [mnt / fmt.JOURNAL, mnt / ".control" / "status"]:
        with pytest.raises(OSError) as exc:
            mapped(p)
        assert exc.value.errno == errno.ENODEV, p
        assert mapped(p, mmap.MAP_PRIVATE)[:20] == p.read_bytes()[:20], p


def test_a_shared_map_of_a_file_open_for_writing_is_enodev(mnt: Path) -> None:
    # Writable files are direct I/O (a refused edit must not linger in the
    # page cache), and the kernel refuses shared maps of those.
    append(mnt, "something to map")
    for path, flags in [(mnt / fmt.WORKING_MEMORY, os.O_RDWR), (mnt / fmt.JOURNAL, os.O_RDWR | os.O_APPEND)]:
        fd = os.open(path, flags)
        try:
            with pytest.raises(OSError) as exc:
                mmap.mmap(fd, 0)
            assert exc.value.errno == errno.ENODEV, path
            with mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ) as m:
                assert m[:] == path.read_bytes()
        finally:
            os.close(fd)


def test_journal_readers_never_see_a_torn_line_while_it_is_appended_through_the_mount(mnt: Path) -> None:
    # Why the journal's readers stay direct I/O: read through the page cache
    # they saw lines cut where the kernel guessed the size after an append
    # (the offset plus the draft's length; the stored line is stamped, longer).
    journal = mnt / fmt.JOURNAL
    done = threading.Event()
    torn: list[str] = []

    def read_while_appended() -> None:
        with open(journal, "rb") as reader:
            while not done.is_set():
                reader.seek(0)
                for data in (reader.read(), journal.read_bytes()):  # one descriptor kept open, one new
                    if data and not data.endswith(b"\n"):
                        torn.append(data[-60:].decode(errors="replace"))

    readers = [threading.Thread(target=read_while_appended) for _ in range(3)]
    for t in readers:
        t.start()
    try:
        with open(journal, "ab", buffering=0) as f:  # one write per line, as the agent's port does
            for i in range(1500):
                f.write(json.dumps({"kind": "note", "text": f"line {i}"}).encode() + b"\n")
    finally:
        done.set()
        for t in readers:
            t.join()
    assert torn == []
    assert len(check_chains(journal.read_bytes())) == 1500
