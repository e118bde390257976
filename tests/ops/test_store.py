"""The host store: dedup, gc (and its lock), corrupt blobs, layout version."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from capsulefs.core.capsule import archive
from capsulefs.core.capsule import format as fmt
from capsulefs.core.errors import CorruptBlobError, ExistsError, NotFoundError, StoreError
from capsulefs.core.store.host_store import STAGING_KEEP, HostStore

from helpers import HOST, make_agent


def test_blob_shared_by_agents_is_stored_once(store: HostStore) -> None:
    shared = {"lib.py": b"shared" * 1000}
    for i in range(10):
        make_agent(store, f"a{i}", workspace=dict(shared, **{f"own{i}": f"own {i}".encode()}))
    assert len(list(store.all_blobs())) == 11
    (sha,) = [s for s in store.all_blobs() if store.read_blob(s) == shared["lib.py"]]
    assert os.stat(store.blob_file(sha)).st_nlink == 1
    assert oct(os.stat(store.blob_file(sha)).st_mode & 0o777) == "0o444"


def test_gc_removes_only_unreferenced_blobs(store: HostStore) -> None:
    a = make_agent(store, "a", workspace={"x": b"keep me"})
    orphan = store.put_blob(b"nobody uses me")
    report = store.gc()
    assert (report.removed, report.kept) == (1, 1)
    assert not store.has_blob(orphan)
    snap = fmt.parse_snapshot(a.read(fmt.SNAPSHOT))
    assert store.read_blob(snap["x"]) == b"keep me"


def test_rm_frees_blobs_only_that_agent_used(store: HostStore) -> None:
    make_agent(store, "a", workspace={"common": b"c", "mine": b"a-only"})
    b = make_agent(store, "b", workspace={"common": b"c"})
    store.remove_agent(store.find("a").agent_id)
    store.gc()
    assert store.agent_ids() == [b.agent_id]
    assert [store.read_blob(s) for s in store.all_blobs()] == [b"c"]


GC_IN_ANOTHER_PROCESS = """
import sys
from capsulefs.core.store.host_store import HostStore
print(HostStore.open(sys.argv[1]).gc().removed, flush=True)
"""


def test_gc_waits_for_a_writer_between_blob_and_reference(store: HostStore) -> None:
    """A blob written but not yet referenced survives a concurrent gc."""
    agent = make_agent(store, "w", workspace={})
    gc: subprocess.Popen | None = None
    try:
        with store.writing():
            sha = store.put_blob(b"new content")
            gc = subprocess.Popen([sys.executable, "-c", GC_IN_ANOTHER_PROCESS, store.root], stdout=subprocess.PIPE, text=True)
            # gc must be blocked on the lock: it cannot finish while we hold it.
            with pytest.raises(subprocess.TimeoutExpired):
                gc.wait(timeout=0.5)
            agent.write_files({fmt.SNAPSHOT: fmt.snapshot_bytes({"f": sha})}, add_blobs=[sha])
        out, _ = gc.communicate(timeout=60)
    finally:
        if gc is not None:
            gc.kill()
            gc.wait()
            gc.stdout.close()
    assert out.strip() == "0"
    assert store.has_blob(sha)


@pytest.mark.expect_error_log
@pytest.mark.capsule_left_broken("a blob is corrupted (and quarantined) on purpose")
def test_corrupt_blob_is_never_exported_as_good(store: HostStore, tmp_path: Path) -> None:
    agent = make_agent(store, "c", workspace={"f": b"precious data"})
    (sha,) = fmt.parse_snapshot(agent.read(fmt.SNAPSHOT)).values()
    path = store.blob_file(sha)
    os.chmod(path, 0o644)
    Path(path).write_bytes(b"precious dato")
    out = tmp_path / "c.tar"
    with pytest.raises(CorruptBlobError) as exc:
        archive.export_agent(agent, str(out), mtime=0)
    assert path in str(exc.value)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")] == []
    with pytest.raises(CorruptBlobError):
        store.read_blob(sha)
    with pytest.raises(NotFoundError, match="quarantined"):  # (see the quarantine test)
        store.verify_blob(sha)


def test_unknown_layout_is_refused(state_dir: Path) -> None:
    HostStore.open(state_dir)
    (state_dir / "store.json").write_text(json.dumps({"layout": 99}))
    with pytest.raises(StoreError, match="layout 99 is not supported"):
        HostStore.open(state_dir)


def test_put_blob_with_wrong_expected_digest_lands_nothing(store: HostStore) -> None:
    with pytest.raises(CorruptBlobError):
        store.put_blob(b"abc", expect="0" * 64)
    assert list(store.all_blobs()) == []
    assert [n for n in os.listdir(store.objects_dir) if n.startswith(".tmp-")] == []


def test_names_are_unique_and_agents_keyed_by_id(store: HostStore) -> None:
    a = make_agent(store, "same")
    with pytest.raises(ExistsError):
        store.create_agent("same", host_id="h", agent_id="1" * 32)
    assert store.find("same").agent_id == a.agent_id
    assert store.find(a.agent_id).agent_id == a.agent_id


def test_staging_left_by_a_crash_is_swept(state_dir: Path) -> None:
    store = HostStore.open(state_dir)
    leftover = Path(store.staging_dir) / "import-dead"
    leftover.mkdir()
    (leftover / "half").write_bytes(b"x")
    HostStore.open(state_dir)
    assert not leftover.exists()


def test_a_kept_staging_area_left_by_a_crash_is_spared_then_removed(state_dir: Path) -> None:
    """A move prepared in the fleet mode (the directory may name this host
    already) marks its staging area kept: a restart's sweep spares it (and
    only it) until its owner removes it."""
    store = HostStore.open(state_dir)
    kept = Path(store.staging_dir) / "move-dead-2-abc"
    (kept / "capsule").mkdir(parents=True)
    (kept / STAGING_KEEP).write_bytes(b"")
    plain = Path(store.staging_dir) / "move-dead-3-abc"
    plain.mkdir()
    store = HostStore.open(state_dir)
    assert kept.is_dir() and not plain.exists()
    assert store.kept_staging() == [str(kept)]
    store.remove_kept(str(kept))
    assert not kept.exists() and store.kept_staging() == []
    with pytest.raises(StoreError):
        store.remove_kept(str(state_dir))


def test_adopted_files_become_blobs_and_their_directories_are_synced_once(store: HostStore, tmp_path: Path) -> None:
    """adopt_blob_files: each file lands under its digest, a duplicate is
    dropped, and the directories it renamed into are handed to sync_dirs
    once, together (the move service syncs the whole file system then)."""
    import hashlib

    present = store.put_blob(b"already here")
    items = []
    for data in (b"one", b"two", b"already here"):
        path = tmp_path / hashlib.sha256(data).hexdigest()
        path.write_bytes(data)
        items.append((str(path), hashlib.sha256(data).hexdigest()))
    synced: list[list[str]] = []
    store.adopt_blob_files(items, sync_dirs=lambda dirs: synced.append(list(dirs)))
    for path, sha in items:
        assert not os.path.exists(path)
        with open(store.blob_file(sha), "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == sha
    new = {os.path.dirname(store.blob_file(sha)) for _, sha in items if sha != present}
    assert synced == [sorted(new)]
    # Nothing renamed (all present already): nothing to sync.
    again = tmp_path / present
    again.write_bytes(b"already here")
    store.adopt_blob_files([(str(again), present)], sync_dirs=lambda dirs: synced.append(list(dirs)))
    assert len(synced) == 1 and not again.exists()


class _Crash(Exception):
    """Stands for the process dying at this point."""


def test_a_crash_before_the_manifest_is_written_loses_no_blob(store: HostStore, monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path) -> None:
    """write_files replaces snapshot.json, then the manifest: a crash between
    the two must not leave blobs the snapshot names unlisted, for gc to take."""
    import capsulefs.core.store.agent as store_mod

    agent = make_agent(store, "w", workspace={"old": b"old"})
    real = store_mod.atomic_write
    written: list[str] = []

    def dies_at_the_manifest(path, data, mode=0o644):  # type: ignore[no-untyped-def]
        if os.path.basename(path) == fmt.MANIFEST and agent.path(fmt.SNAPSHOT) in written:
            raise _Crash()
        real(path, data, mode)
        written.append(path)

    with store.writing():
        sha = store.put_blob(b"new work")
        monkeypatch.setattr(store_mod, "atomic_write", dies_at_the_manifest)
        with pytest.raises(_Crash):
            agent.write_files({fmt.SNAPSHOT: fmt.snapshot_bytes({"new": sha})}, add_blobs=[sha])
    monkeypatch.undo()
    assert fmt.parse_snapshot(agent.read(fmt.SNAPSHOT)) == {"new": sha}  # the snapshot landed
    store.gc()
    assert store.read_blob(sha) == b"new work"
    archive.export_agent(agent, str(tmp_path / "w.tar"), mtime=1)
    assert archive.verify_capsule(str(tmp_path / "w.tar"))[1] == []


def test_gc_keeps_the_blobs_a_staging_area_manifest_names_and_refuses_a_damaged_one(store: HostStore) -> None:
    """An incoming move's blobs are in objects/ before any agent lists
    them: gc keeps those its staging area's manifest names, and collects
    nothing (naming the file) when that manifest does not parse."""
    kept, loose = store.put_blob(b"a blob a move received"), store.put_blob(b"a blob nobody needs")
    manifest = fmt.Manifest(agent_id="c" * 32, name="incoming", holder=fmt.Holder(host=HOST, epoch=2),
                            files={fmt.blob_path(kept): fmt.FileEntry(sha256=kept, size=22)})
    with store.staging("move-x-2") as area:
        (Path(area) / fmt.MANIFEST).write_bytes(manifest.to_bytes())
        assert store.gc().removed == 1
        assert store.has_blob(kept) and not store.has_blob(loose)
        (Path(area) / fmt.MANIFEST).write_bytes(b'{"truncated')
        with pytest.raises(StoreError, match=r"move-x-2.*manifest.json is damaged"):
            store.gc()
        assert store.has_blob(kept)
    assert store.gc().removed == 1 and not store.has_blob(kept)


@pytest.mark.expect_error_log
def test_a_damaged_blob_is_quarantined_and_putting_its_bytes_again_repairs_the_store(store: HostStore) -> None:
    """A blob that rotted in objects/ used to stay there for good: putting
    its good bytes again (importing a good export, a move) deduplicated
    against the damaged copy. A read that finds it damaged now moves it to
    objects/.corrupt/, so the next put places the good bytes; a copy of the
    wrong size is replaced by the next put without a read."""
    good = b"the bytes a workspace file had\n" * 100
    sha = store.put_blob(good)
    path = Path(store.blob_file(sha))
    path.chmod(0o644)
    path.write_bytes(good[:-1] + b"?")  # one byte rotted
    with pytest.raises(CorruptBlobError):
        store.read_blob(sha)
    assert not store.has_blob(sha)
    (kept,) = (Path(store.objects_dir) / ".corrupt").iterdir()
    assert kept.name.startswith(sha) and kept.read_bytes() == good[:-1] + b"?"
    assert store.put_blob(good) == sha and store.read_blob(sha) == good
    path.chmod(0o644)
    path.write_bytes(good[: len(good) // 2])  # cut short
    assert store.put_blob(good) == sha and store.read_blob(sha) == good
    assert len(list((Path(store.objects_dir) / ".corrupt").iterdir())) == 2
    assert sha in set(store.all_blobs()) and store.gc().removed == 1  # .corrupt is not a blob directory


@pytest.mark.expect_error_log
def test_a_good_copy_placed_while_a_damaged_one_was_read_is_not_quarantined(store: HostStore) -> None:
    """Two readers find the same blob damaged; the first quarantines it and
    an import places the good bytes before the second is done: the second
    must not move the good copy away (it quarantines only the file it read)."""
    good = b"bytes two readers share\n" * 50
    sha = store.put_blob(good)
    path = Path(store.blob_file(sha))
    path.chmod(0o644)
    path.write_bytes(good[:-1] + b"!")
    second = store.iter_blob(sha)
    next(second)  # the second reader has the damaged file open
    with pytest.raises(CorruptBlobError):
        store.read_blob(sha)  # the first reader: quarantined
    assert store.put_blob(good) == sha  # the good bytes come back
    with pytest.raises(CorruptBlobError):
        list(second)
    assert store.read_blob(sha) == good
