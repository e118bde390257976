"""core/linuxfs.py's bulk durability: syncfs(2) and FileSystemSync, on real
files. The C library's syncfs is replaced only to make it fail (ENOSYS as
under a seccomp filter, EIO as after a write-back error), which a test
cannot make a real file system do on demand."""

from __future__ import annotations

import ctypes
import errno
import os
import subprocess

import pytest

from capsulefs.core import linuxfs
from capsulefs.core.linuxfs import SYNCFS_FILE_SYSTEMS, FileSystemSync, dirty_bytes, fs_magic, syncfs


def make_files(tmp_path, n: int) -> list[str]:
    paths = []
    for i in range(n):
        p = tmp_path / f"f{i}"
        p.write_bytes(os.urandom(100 + i))
        paths.append(str(p))
    return paths


class Fsyncs:
    """Counts os.fsync calls (and still makes them)."""

    def __init__(self, monkeypatch) -> None:
        self.calls = 0
        real = os.fsync

        def fsync(fd: int) -> None:
            self.calls += 1
            real(fd)

        monkeypatch.setattr(os, "fsync", fsync)


def calm() -> int:
    """A machine with nothing else dirty (the real reading varies)."""
    return 0


def ext4(path: str) -> int:
    """The file system type syncfs is trusted on (tmp_path may be on any)."""
    return 0xEF53


def counted_syncfs(monkeypatch) -> list[int]:
    """Count the real syncfs calls; returns the fds it was called with."""
    calls: list[int] = []
    ctypes_, real = linuxfs._syncfs

    def fn(fd: int) -> int:
        calls.append(fd)
        return real(fd)

    monkeypatch.setattr(linuxfs, "_syncfs", (ctypes_, fn))
    return calls


def failing_syncfs(monkeypatch, err: int) -> list[int]:
    """Make the C library's syncfs fail with ``err``; returns the fds it was called with."""
    calls: list[int] = []

    def fn(fd: int) -> int:
        calls.append(fd)
        ctypes.set_errno(err)
        return -1

    monkeypatch.setattr(linuxfs, "_syncfs", (ctypes, fn))
    return calls


def test_syncfs_returns_on_a_file_system_and_names_a_bad_descriptor(tmp_path) -> None:
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        syncfs(fd)
    finally:
        os.close(fd)
    with pytest.raises(OSError, match="syncfs") as bad:
        syncfs(-1)
    assert bad.value.errno == errno.EBADF


def test_many_files_are_made_durable_by_one_syncfs_not_an_fsync_each(tmp_path, monkeypatch) -> None:
    """One syncfs per call, closed by one fsync of the directory held (its
    device flush comes after syncfs's last write-back), instead of an
    fsync per path."""
    paths = make_files(tmp_path, 20)
    syncs = counted_syncfs(monkeypatch)
    fsyncs = Fsyncs(monkeypatch)
    with FileSystemSync(str(tmp_path), dirty=calm, magic=ext4) as sync:
        assert sync.whole
        sync.files(paths)
        assert len(syncs) == 1 and fsyncs.calls == 1
        sync.dirs([str(tmp_path), str(tmp_path.parent)])
        assert len(syncs) == 2 and fsyncs.calls == 2


@pytest.mark.parametrize("dirty", [lambda: 1 << 30, lambda: None], ids=["much-dirty", "unknown"])
def test_with_much_else_to_write_back_or_one_path_each_path_is_fsynced(tmp_path, monkeypatch, dirty) -> None:
    """syncfs would write back everything dirty on the file system: with
    more than the bound (or no way to tell), or for a single path, an
    fsync each is cheaper and bounded by the caller's own files."""
    paths = make_files(tmp_path, 4)
    calls = failing_syncfs(monkeypatch, errno.EIO)  # would fail the call if it were used
    fsyncs = Fsyncs(monkeypatch)
    with FileSystemSync(str(tmp_path), dirty=dirty, magic=ext4) as sync:
        sync.files(paths)
    with FileSystemSync(str(tmp_path), dirty=calm, magic=ext4) as sync:
        sync.files(paths[:1])
    assert calls == [] and fsyncs.calls == len(paths) + 1


def test_dirty_bytes_reads_the_machine(tmp_path) -> None:
    before = dirty_bytes()
    assert before is not None and before >= 0
    (tmp_path / "dirt").write_bytes(os.urandom(4 << 20))  # not synced: dirty now, unless written back already
    assert dirty_bytes() is not None


def test_where_syncfs_is_refused_each_path_is_fsynced_instead(tmp_path, monkeypatch) -> None:
    paths = make_files(tmp_path, 5)
    calls = failing_syncfs(monkeypatch, errno.ENOSYS)
    fsyncs = Fsyncs(monkeypatch)
    with FileSystemSync(str(tmp_path), dirty=calm, magic=ext4) as sync:
        sync.files(paths)
        assert not sync.whole  # refused once: not asked again
        sync.dirs([str(tmp_path), str(tmp_path.parent)])
    assert len(calls) == 1
    assert fsyncs.calls == len(paths) + 2


def test_without_syncfs_each_path_is_fsynced(tmp_path, monkeypatch) -> None:
    paths = make_files(tmp_path, 3)
    monkeypatch.setattr(linuxfs, "_syncfs", None)
    fsyncs = Fsyncs(monkeypatch)
    with FileSystemSync(str(tmp_path)) as sync:
        assert not sync.whole
        sync.files(paths)
    assert fsyncs.calls == len(paths)


def test_a_failed_syncfs_is_an_error_that_names_the_file_system(tmp_path, monkeypatch) -> None:
    """A write-back error: nothing may count as durable, and no fsync of
    each file may paper over it (Linux reports such an error once)."""
    paths = make_files(tmp_path, 3)
    failing_syncfs(monkeypatch, errno.EIO)
    fsyncs = Fsyncs(monkeypatch)
    with FileSystemSync(str(tmp_path), dirty=calm, magic=ext4) as sync:
        with pytest.raises(OSError) as failed:
            sync.files(paths)
        assert sync.whole  # still the bulk path: the next call asks the kernel again
    assert failed.value.errno == errno.EIO
    assert str(tmp_path) in str(failed.value)
    assert fsyncs.calls == 0


def test_a_file_system_sync_needs_a_directory_that_exists(tmp_path) -> None:
    with pytest.raises(FileNotFoundError):
        FileSystemSync(str(tmp_path / "missing"))


def test_the_file_system_type_is_read_as_stat_reports_it(tmp_path) -> None:
    out = subprocess.run(["stat", "-f", "-c", "%t", str(tmp_path)], capture_output=True, text=True, check=True)
    assert fs_magic(str(tmp_path)) == int(out.stdout, 16)
    assert fs_magic(str(tmp_path / "missing")) is None
    with FileSystemSync(str(tmp_path)) as sync:
        assert sync.whole == (fs_magic(str(tmp_path)) in SYNCFS_FILE_SYSTEMS)


@pytest.mark.parametrize("magic", [0x65735546, 0x6969, None], ids=["fuse", "nfs", "unknown"])
def test_on_a_file_system_whose_syncfs_is_not_trusted_each_path_is_fsynced(tmp_path, monkeypatch, magic) -> None:
    """FUSE's syncfs asks the server for nothing (unless virtiofs), so a
    state directory on sshfs, say, must keep an fsync per file."""
    paths = make_files(tmp_path, 4)
    calls = failing_syncfs(monkeypatch, errno.EIO)  # would fail the call if it were used
    fsyncs = Fsyncs(monkeypatch)
    with FileSystemSync(str(tmp_path), dirty=calm, magic=lambda path: magic) as sync:
        assert not sync.whole
        sync.files(paths)
    assert calls == [] and fsyncs.calls == len(paths)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A tmpfs of our own (root only), to remount read-only under a sync."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_a_file_system_gone_read_only_fails_the_sync(small_tmpfs) -> None:
    """Linux's syncfs returns 0 on a read-only file system without writing
    anything (as after ext4's errors=remount-ro): that must not count as
    durable."""
    paths = make_files(small_tmpfs, 3)
    with FileSystemSync(str(small_tmpfs), dirty=calm) as sync:
        assert sync.whole  # tmpfs is trusted
        sync.files(paths)
        subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True)
        with pytest.raises(OSError) as failed:
            sync.files(paths)
    assert failed.value.errno == errno.EROFS
    assert str(small_tmpfs) in str(failed.value)
