"""Operations without a kernel: what the mount shows, and its guards."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from capsulefs.core.capsule import archive
from capsulefs.core.capsule import format as fmt
from capsulefs.core.errors import CorruptBlobError
from capsulefs.core.journal.record import Record
from capsulefs.core.view.nodes import CONTROL, SNAPSHOTS, XATTR_AGENT_ID, XATTR_EPOCH, XATTR_SHA256
from capsulefs.core.store.host_store import HostStore
from capsulefs.mount.ops import IMMUTABLE_TIMEOUT, Operations
from helpers import make_agent
from ops_kit import Client, Ctx, FakeKernel, errno_of, make_live


@pytest.fixture
def kernel() -> FakeKernel:
    return FakeKernel()


@pytest.fixture
def ops(store: HostStore, tmp_path: Path, kernel: FakeKernel) -> Operations:
    make_agent(store, "alice")
    from ops_kit import _reply
    return Operations(make_live(store, tmp_path / "work"), kernel=kernel, readdir_reply=_reply, uid=0, gid=0)


@pytest.fixture
def c(ops: Operations) -> Client:
    return Client(ops)


def journal_records(store: HostStore, name: str = "alice") -> list[Record]:
    data = store.find(name).read(fmt.JOURNAL)
    return [Record.from_line(line) for line in data.splitlines()]


async def test_root_lists_agents_by_name_and_hides_nothing_else(c: Client, store: HostStore) -> None:
    make_agent(store, "bob", workspace={})
    assert await c.listdir("") == ["alice", "bob"]
    assert await c.listdir("alice") == ["artifacts", "environment", "manifest.json", "memory"]
    assert await c.listdir("alice/memory") == ["timeline_events.jsonl", "vector_index", "working_memory.md"]


async def test_hidden_dirs_are_reachable_but_not_listed(c: Client) -> None:
    assert CONTROL not in await c.listdir("alice")
    assert SNAPSHOTS not in await c.listdir("alice")
    assert await c.listdir(f"alice/{CONTROL}") == ["abandon", "learn", "model", "move", "remove", "status"]
    assert await c.listdir(f"alice/{SNAPSHOTS}") == []


async def test_every_directory_lists_dot_and_dotdot_with_their_inodes(c: Client) -> None:
    """``.`` is the directory, ``..`` the one that holds it (the root's own
    at the root), listed first; they take no lookup reference (the kernel
    takes none for them in readdirplus), so they never need a forget."""
    root = 1
    cases = {"": root, "alice": root, "alice/memory": "alice", "alice/artifacts/blobs": "alice/artifacts",
             f"alice/{CONTROL}": "alice", f"alice/{SNAPSHOTS}": "alice"}
    for path, up in cases.items():
        here = await c.lookup(path)
        parent = up if isinstance(up, int) else await c.lookup(up)
        counts = c.ops.inodes.lookups(here), c.ops.inodes.lookups(parent)
        fh = await c.ops.opendir(here, c.ctx)
        token: list[tuple[str, Any]] = []
        await c.ops.readdir(fh, 0, token)  # type: ignore[arg-type]
        await c.ops.releasedir(fh)
        entries = [(n, a.st_ino) for n, a in token]
        assert entries[:2] == [(".", here), ("..", parent)], path
        assert not {".", ".."} & {n for n, _ in entries[2:]}, path
        assert (c.ops.inodes.lookups(here), c.ops.inodes.lookups(parent)) == counts, path


async def test_the_roots_control_holds_only_the_metrics_read_only(c: Client) -> None:
    """MNT/.control/: hidden from the root's listing, reachable by name, one
    read-only file; nothing can be made, removed or renamed in it."""
    assert await c.listdir("") == ["alice"]
    assert await c.listdir(CONTROL) == ["metrics"]
    assert (await c.read(f"{CONTROL}/metrics")).startswith(b"# HELP capsulefs_")
    st = await c.stat(f"{CONTROL}/metrics")
    assert st.st_mode & 0o777 == 0o444
    for attempt in (c.write(f"{CONTROL}/metrics", b"x\n"), c.unlink(f"{CONTROL}/metrics"),
                    c.rename(f"{CONTROL}/metrics", f"{CONTROL}/m2"), c.create(f"{CONTROL}/new", b""),
                    c.mkdir(f"{CONTROL}/d"), c.rmdir(CONTROL)):
        assert await errno_of(attempt) in (errno.EPERM, errno.ENOTEMPTY)
    assert await c.listdir(CONTROL) == ["metrics"]


async def test_agent_dir_is_a_capsule_that_verifies(c: Client, tmp_path: Path) -> None:
    await c.copy_tree("alice", tmp_path / "copy")
    manifest, problems = archive.verify_capsule(str(tmp_path / "copy"))
    assert problems == []
    assert manifest is not None and manifest.name == "alice"
    assert len(manifest.blobs()) == 2


async def test_blobs_are_read_only_cached_and_long_lived(c: Client, store: HostStore) -> None:
    sha = next(iter(store.find("alice").manifest().blobs()))
    path = f"alice/{fmt.blob_path(sha)}"
    st = await c.stat(path)
    assert st.st_mode & 0o777 == 0o444
    assert st.attr_timeout == IMMUTABLE_TIMEOUT
    fi = await c.open(path)
    assert fi.keep_cache and not fi.direct_io
    await c.ops.release(fi.fh)
    # writing it is an upload of the same bytes (uploads): other bytes are refused at close
    fi = await c.open(path, os.O_WRONLY)
    await c.ops.write(fi.fh, 0, b"other bytes")
    assert await errno_of(c.ops.flush(fi.fh)) == errno.EINVAL
    await c.ops.release(fi.fh)
    assert await errno_of(c.open("alice/manifest.json", os.O_WRONLY)) == errno.EPERM
    assert await c.read(path) in (b"print('hi')\n", b"hello\n")


@pytest.mark.expect_error_log
@pytest.mark.capsule_left_broken("a blob is corrupted (and quarantined) on purpose")
async def test_corrupt_blob_gives_eio_and_the_mount_stays_up(c: Client, store: HostStore, kernel: FakeKernel,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    sha = next(iter(store.find("alice").manifest().blobs()))
    obj = store.blob_file(sha)
    os.chmod(obj, 0o644)
    data = Path(obj).read_bytes()
    Path(obj).write_bytes(bytes([data[0] ^ 1]) + data[1:])
    path = f"alice/{fmt.blob_path(sha)}"
    assert await errno_of(c.read(path)) == errno.EIO
    assert any("corrupt blob" in r.getMessage() for r in caplog.records)
    assert kernel.inodes, "cached pages of the bad blob must be dropped"
    assert await errno_of(c.open(path)) == errno.EIO  # stays bad
    assert b"remember the milk" in await c.read("alice/memory/working_memory.md")
    assert c.ops.live.failsafe is None
    # A reader of the store (export, verify, a move) quarantines it: still EIO,
    # and the log says where the damaged copy went and how to repair the store.
    with pytest.raises(CorruptBlobError):
        store.verify_blob(sha)
    caplog.clear()
    assert not os.path.exists(obj) and await errno_of(c.open(path)) == errno.EIO
    assert any("quarantined in" in r.getMessage() and "repairs the store" in r.getMessage() for r in caplog.records)


@pytest.mark.expect_error_log
@pytest.mark.capsule_left_broken("a blob is corrupted (and quarantined) on purpose")
async def test_a_blob_quarantined_while_open_reads_eio_not_enoent(c: Client, store: HostStore) -> None:
    # A reader of the store (the supervisor building a sandbox) finds the blob
    # damaged and moves it aside while `cat` has it open: cat's read that
    # reaches the end must judge the bytes it is served, and fail with EIO.
    # (Issue 32: under load the judging re-opened the object by name and the
    # read failed with ENOENT, "No such file or directory".)
    agent = make_agent(store, "bob", workspace={"big": b"B" * 300_000})
    sha = next(iter(agent.manifest().blobs()))
    obj = store.blob_file(sha)
    os.chmod(obj, 0o644)
    data = Path(obj).read_bytes()
    Path(obj).write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    fi = await c.open(f"bob/{fmt.blob_path(sha)}")
    try:
        with pytest.raises(CorruptBlobError):
            store.verify_blob(sha)  # quarantined: its name is gone from objects/
        assert not os.path.exists(obj)
        # out of order, as readahead and `tail` read: the last read judges the whole blob
        assert await errno_of(c.ops.read(fi.fh, len(data) - 10, 10)) == errno.EIO
        assert await errno_of(c.ops.read(fi.fh, 0, 10)) == errno.EIO  # and it stays bad
    finally:
        await c.ops.release(fi.fh)


async def test_mkdir_creates_an_agent_rmdir_refuses(c: Client, store: HostStore) -> None:
    await c.mkdir("/carol")
    assert "carol" in await c.listdir("")
    assert store.find("carol").manifest().holder.epoch == 1
    assert await errno_of(c.rmdir("/carol")) == errno.ENOTEMPTY
    assert await errno_of(c.mkdir("/carol")) == errno.EEXIST
    assert await errno_of(c.mkdir("/.hidden")) == errno.EINVAL
    assert await errno_of(c.mkdir("/alice/memory/x")) == errno.EPERM
    assert await errno_of(c.rmdir("/alice/memory")) == errno.ENOTEMPTY


async def test_in_place_edit_is_one_memory_edit_event(c: Client, store: HostStore, tmp_path: Path) -> None:
    await c.write("alice/memory/working_memory.md", b"new notes\n", fsync=True)
    assert store.find("alice").read(fmt.WORKING_MEMORY) == b"new notes\n"
    recs = journal_records(store)
    assert [r.kind for r in recs] == ["memory_edit"]
    assert recs[0].event.text == "new notes\n"  # type: ignore[attr-defined]
    assert await c.read("alice/memory/working_memory.md") == b"new notes\n"
    await c.copy_tree("alice", tmp_path / "copy")
    assert archive.verify_capsule(str(tmp_path / "copy"))[1] == []


async def test_editor_temp_file_renamed_over_memory(c: Client, store: HostStore, tmp_path: Path) -> None:
    await c.create("alice/memory/.wm.swp", b"swap")
    await c.create("alice/memory/sedAbC123", b"edited by sed\n")
    assert await c.listdir("alice/memory") == ["timeline_events.jsonl", "vector_index", "working_memory.md"]
    await c.rename("alice/memory/sedAbC123", "alice/memory/working_memory.md")
    assert store.find("alice").read(fmt.WORKING_MEMORY) == b"edited by sed\n"
    assert [r.kind for r in journal_records(store)] == ["memory_edit"]
    assert await errno_of(c.lookup("alice/memory/sedAbC123")) == errno.ENOENT
    assert await c.read("alice/memory/.wm.swp") == b"swap"
    await c.unlink("alice/memory/.wm.swp")
    manifest = json.loads(await c.read("alice/manifest.json"))
    assert not any("swp" in p or "sed" in p for p in manifest["files"])
    await c.copy_tree("alice", tmp_path / "copy")
    assert archive.verify_capsule(str(tmp_path / "copy"))[1] == []


async def test_backup_by_rename_keeps_the_memory(c: Client, store: HostStore) -> None:
    # vim/emacs: rename the file to a backup, create it anew, write, delete the backup
    await c.rename("alice/memory/working_memory.md", "alice/memory/working_memory.md~")
    assert await c.read("alice/memory/working_memory.md~") == b"# notes\nremember the milk\n"
    parent = await c.lookup("alice/memory")
    fi, _ = await c.ops.create(parent, b"working_memory.md", 0o644, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, c.ctx)
    await c.ops.write(fi.fh, 0, b"rewritten\n")
    await c.ops.flush(fi.fh)
    await c.ops.release(fi.fh)
    await c.unlink("alice/memory/working_memory.md~")
    assert store.find("alice").read(fmt.WORKING_MEMORY) == b"rewritten\n"
    assert [r.kind for r in journal_records(store)] == ["memory_edit"]


async def test_unchanged_save_makes_no_event(c: Client, store: HostStore) -> None:
    await c.write("alice/memory/working_memory.md", b"# notes\nremember the milk\n")
    assert journal_records(store) == []


async def test_memory_must_be_utf8(c: Client, store: HostStore) -> None:
    assert await errno_of(c.write("alice/memory/working_memory.md", b"\xff\xfe")) == errno.EINVAL
    assert store.find("alice").read(fmt.WORKING_MEMORY) == b"# notes\nremember the milk\n"


async def test_large_memory_goes_to_a_blob(c: Client, store: HostStore, tmp_path: Path) -> None:
    big = ("x" * 99 + "\n").encode() * 1000
    await c.write("alice/memory/working_memory.md", big)
    rec = journal_records(store)[-1]
    assert rec.event.blob is not None  # type: ignore[attr-defined]
    assert store.read_blob(rec.event.blob) == big  # type: ignore[attr-defined]
    await c.copy_tree("alice", tmp_path / "copy")
    assert archive.verify_capsule(str(tmp_path / "copy"))[1] == []


async def test_journal_append_is_validated_and_stamped(c: Client, store: HostStore) -> None:
    j = "alice/memory/timeline_events.jsonl"
    await c.write(j, b'{"kind":"user_message","text":"hi"}\n{"kind":"note","text":"n"}\n', append=True)
    recs = journal_records(store)
    assert [r.kind for r in recs] == ["user_message", "note"]
    assert recs[1].prev == recs[0].digest and recs[1].seq == 2
    before = store.find("alice").read(fmt.JOURNAL)
    for bad in (b"not json\n", b'{"kind":"nope"}\n', b'{"kind":"user_message","text":"x"}',
                b'{"kind":"user_message","text":"ok"}\n{"kind":"user_message"}\n',
                b'{"kind":"note","text":"x","seq":3}\n', b"\n"):
        assert await errno_of(c.write(j, bad, append=True)) == errno.EINVAL, bad
    assert store.find("alice").read(fmt.JOURNAL) == before
    assert await c.read(j) == before


async def test_journal_lines_may_arrive_in_pieces(c: Client, store: HostStore) -> None:
    fi = await c.open("alice/memory/timeline_events.jsonl", os.O_WRONLY | os.O_APPEND)
    line = b'{"kind":"note","text":"split across writes"}\n'
    assert await c.ops.write(fi.fh, 0, line[:10]) == 10
    assert journal_records(store) == []
    assert await c.ops.write(fi.fh, 0, line[10:] + line[:5]) == len(line) - 5
    assert [r.kind for r in journal_records(store)] == ["note"]
    assert await errno_of(c.ops.flush(fi.fh)) == errno.EINVAL  # 5 bytes of a line never finished
    await c.ops.release(fi.fh)
    assert len(journal_records(store)) == 1


async def test_journal_cannot_be_overwritten_truncated_or_renamed(c: Client) -> None:
    j = "alice/memory/timeline_events.jsonl"
    assert await errno_of(c.open(j, os.O_WRONLY)) == errno.EPERM
    assert await errno_of(c.open(j, os.O_RDWR)) == errno.EPERM
    assert await errno_of(c.write(j, b"", append=False)) == errno.EPERM
    from ops_kit import Fields
    import pyfuse3
    attr = pyfuse3.EntryAttributes()
    attr.st_size = 0
    assert await errno_of(c.ops.setattr(await c.lookup(j), attr, Fields(update_size=True), None, c.ctx)) == errno.EPERM
    assert await errno_of(c.rename(j, "alice/memory/x")) == errno.EPERM
    await c.create("alice/memory/tmp", b"")
    assert await errno_of(c.rename("alice/memory/tmp", j)) == errno.EPERM
    assert await errno_of(c.unlink(j)) == errno.EPERM


async def test_spec_edits_are_validated(c: Client, store: HostStore) -> None:
    spec = "alice/environment/spec.json"
    old = store.find("alice").read(fmt.SPEC)
    bad = json.dumps({"version": 1, "env": {"API_TOKEN": "x"}}).encode()
    assert await errno_of(c.write(spec, bad)) == errno.EINVAL
    assert store.find("alice").read(fmt.SPEC) == old
    assert await c.read(spec) == old
    await c.create("alice/environment/spec.json.tmp", bad)
    assert await errno_of(c.rename("alice/environment/spec.json.tmp", spec)) == errno.EINVAL
    assert store.find("alice").read(fmt.SPEC) == old
    good = json.dumps({"version": 1, "entrypoint": ["python", "agent.py"], "env": {"MODE": "x"}}).encode()
    await c.write(spec, good)
    assert store.find("alice").read(fmt.SPEC) == good


async def test_control_model_and_status(c: Client, store: HostStore) -> None:
    assert await c.read(f"alice/{CONTROL}/model") == b""
    fi = await c.open(f"alice/{CONTROL}/model", os.O_WRONLY)
    assert fi.direct_io
    assert await c.ops.write(fi.fh, 0, b"anthropic:claude-sonnet-4-5\n") > 0
    assert await errno_of(c.ops.write(fi.fh, 0, b"no-colon\n")) == errno.EINVAL
    await c.ops.release(fi.fh)
    assert await c.read(f"alice/{CONTROL}/model") == b"anthropic:claude-sonnet-4-5\n"
    assert [r.kind for r in journal_records(store)] == ["model_switch"]
    status = json.loads(await c.read(f"alice/{CONTROL}/status"))
    assert status["state"] == "active" and status["epoch"] == 1
    assert status["provider"] == "anthropic" and status["model"] == "claude-sonnet-4-5"
    assert status["move"]["available"] is False


@pytest.mark.parametrize("line", [b"evilprov:x\n", b"Anthropic:claude\n", b"openai-chat-x:gpt\n", b"claude:sonnet\n",
                                  b"openrouter:meta/llama-3:70b\n"])
async def test_control_model_refuses_a_provider_no_renderer_knows(c: Client, store: HostStore, line: bytes,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """The agent could never answer for it, and would silently not (issue 25):
    EINVAL, and the log names the providers there are."""
    assert await errno_of(c.write(f"alice/{CONTROL}/model", line)) == errno.EINVAL
    assert journal_records(store) == []
    said = [r.getMessage() for r in caplog.records if "unknown provider" in r.getMessage()]
    assert said and all(p in said[0] for p in ("anthropic", "gemini", "openai-chat", "openai-responses"))


async def test_control_model_takes_openai_as_the_responses_api(c: Client, store: HostStore) -> None:
    await c.write(f"alice/{CONTROL}/model", b"openai:gpt-5\n")  # docs/mount.md's example
    assert await c.read(f"alice/{CONTROL}/model") == b"openai-responses:gpt-5\n"
    (rec,) = journal_records(store)
    assert (rec.event.provider, rec.event.model) == ("openai-responses", "gpt-5")  # type: ignore[attr-defined]
    for provider in ("anthropic", "openai-chat", "openai-responses", "gemini"):
        await c.write(f"alice/{CONTROL}/model", f"{provider}:m\n".encode())
        assert await c.read(f"alice/{CONTROL}/model") == f"{provider}:m\n".encode()


async def test_control_writes_only_by_owner_and_move_is_reserved(c: Client) -> None:
    assert await errno_of(c.open(f"alice/{CONTROL}/model", os.O_WRONLY, Ctx(uid=1234))) == errno.EACCES
    assert await errno_of(c.open(f"alice/{CONTROL}/status", os.O_WRONLY)) == errno.EPERM
    fi = await c.open(f"alice/{CONTROL}/move", os.O_WRONLY)
    assert await errno_of(c.ops.write(fi.fh, 0, b"to hostb\n")) == errno.EOPNOTSUPP
    await c.ops.release(fi.fh)
    assert "not available" in json.loads(await c.read(f"alice/{CONTROL}/status"))["move"]["detail"]


async def test_snapshots_freeze_a_verifiable_state(c: Client, store: HostStore, tmp_path: Path) -> None:
    await c.mkdir(f"alice/{SNAPSHOTS}/before")
    assert await c.listdir(f"alice/{SNAPSHOTS}") == ["before"]
    await c.write("alice/memory/timeline_events.jsonl", b'{"kind":"note","text":"after"}\n', append=True)
    await c.write("alice/memory/working_memory.md", b"changed\n")
    await c.copy_tree(f"alice/{SNAPSHOTS}/before", tmp_path / "snap")
    manifest, problems = archive.verify_capsule(str(tmp_path / "snap"))
    assert problems == []
    assert (tmp_path / "snap" / fmt.WORKING_MEMORY).read_bytes() == b"# notes\nremember the milk\n"
    assert (tmp_path / "snap" / fmt.JOURNAL).read_bytes() == b""
    st = await c.stat(f"alice/{SNAPSHOTS}/before/manifest.json")
    assert st.attr_timeout == IMMUTABLE_TIMEOUT
    assert await errno_of(c.open(f"alice/{SNAPSHOTS}/before/{fmt.WORKING_MEMORY}", os.O_WRONLY)) == errno.EROFS
    assert await errno_of(c.mkdir(f"alice/{SNAPSHOTS}/before")) == errno.EEXIST
    await c.rmdir(f"alice/{SNAPSHOTS}/before")
    assert await c.listdir(f"alice/{SNAPSHOTS}") == []


async def test_xattrs(c: Client, store: HostStore) -> None:
    manifest = json.loads(await c.read("alice/manifest.json"))
    for path, entry in manifest["files"].items():
        assert (await c.getxattr(f"alice/{path}", XATTR_SHA256)).decode() == entry["sha256"]
    agent = store.find("alice")
    assert (await c.getxattr("alice", XATTR_AGENT_ID)).decode() == agent.agent_id
    assert await c.getxattr("alice", XATTR_EPOCH) == b"1"
    names = await c.ops.listxattr(await c.lookup("alice"), c.ctx)
    assert sorted(names) == [XATTR_AGENT_ID.encode(), XATTR_EPOCH.encode()]
    assert await errno_of(c.getxattr("alice", "user.other")) == errno.ENODATA
    assert await errno_of(c.ops.setxattr(await c.lookup("alice"), b"user.x", b"1", c.ctx)) == errno.EOPNOTSUPP


async def test_frozen_agent_refuses_writes_then_resumes(c: Client, store: HostStore) -> None:
    live = c.ops.live
    aid = store.find("alice").agent_id
    live.freeze(aid)
    assert await errno_of(c.write("alice/memory/working_memory.md", b"x")) == errno.EROFS
    assert await errno_of(c.write("alice/memory/timeline_events.jsonl", b'{"kind":"note","text":"x"}\n', append=True)) == errno.EROFS
    assert await errno_of(c.create("alice/memory/tmp", b"")) == errno.EROFS
    assert json.loads(await c.read(f"alice/{CONTROL}/status"))["state"] == "frozen"
    await c.mkdir(f"alice/{SNAPSHOTS}/during-move")  # reading is fine
    live.resume(aid)
    await c.write("alice/memory/working_memory.md", b"after\n")


async def test_retired_agent_disappears(c: Client, store: HostStore) -> None:
    aid = store.find("alice").agent_id
    c.ops.live.retire(aid)
    assert await c.listdir("") == []
    assert await errno_of(c.lookup("alice")) == errno.ENOENT
    assert c.ops.live.activate(aid) == "alice"
    assert await c.listdir("") == ["alice"]


@pytest.mark.expect_error_log
@pytest.mark.capsule_left_broken("the manifest is damaged on purpose to make an internal error")
async def test_internal_error_turns_the_mount_read_only(c: Client, store: HostStore) -> None:
    make_agent(store, "bob", workspace={})
    agent = store.find("alice")
    ino = await c.lookup("alice/manifest.json")
    Path(agent.dir, fmt.MANIFEST).write_bytes(b"{broken")
    assert await errno_of(c.ops.getattr(ino, c.ctx)) == errno.EIO
    assert c.ops.live.failsafe is not None
    # Listing fails loudly rather than showing a root without the agent
    # (a mirror tool would delete its copy); nothing unmounts.
    assert await errno_of(c.listdir("")) == errno.EIO
    assert await errno_of(c.mkdir("/dave")) == errno.EROFS
    assert await errno_of(c.write("bob/memory/working_memory.md", b"x")) == errno.EROFS
    status = json.loads(await c.read(f"bob/{CONTROL}/status"))
    assert status["mount"] == "read-only (failsafe)" and "not valid JSON" in status["last_error"]
    assert status["writable"] is False


async def test_forget_drops_inodes(c: Client) -> None:
    before = len(c.ops.inodes)
    ino = await c.lookup("alice/memory/working_memory.md")
    assert len(c.ops.inodes) == before + 3
    c.ops.forget([(ino, 1)])
    assert len(c.ops.inodes) == before + 2


async def test_changes_through_the_mount_invalidate_cached_attributes(c: Client, kernel: FakeKernel) -> None:
    wm = await c.lookup("alice/memory/working_memory.md")
    manifest = await c.lookup("alice/manifest.json")
    journal = await c.lookup("alice/memory/timeline_events.jsonl")
    await c.write("alice/memory/working_memory.md", b"changed\n")
    assert {wm, manifest, journal} <= set(kernel.attrs)
    kernel.attrs.clear()
    await c.write("alice/memory/timeline_events.jsonl", b'{"kind":"note","text":"x"}\n', append=True)
    assert {manifest, journal} <= set(kernel.attrs) and wm not in kernel.attrs


@pytest.mark.capsule_left_broken("the manifest is rewritten without its blobs, so that only the snapshot keeps them")
async def test_gc_keeps_the_blobs_of_snapshots(store: HostStore, tmp_path: Path) -> None:
    from ops_kit import _reply
    from capsulefs.core.fsutil import atomic_write
    make_agent(store, "alice")
    live = make_live(store, Path(store.root) / "mount")  # where the daemon keeps it
    c = Client(Operations(live, kernel=FakeKernel(), readdir_reply=_reply, uid=0, gid=0))
    await c.mkdir(f"alice/{SNAPSHOTS}/keep")
    agent = store.find("alice")
    old = agent.manifest()
    atomic_write(os.path.join(agent.dir, fmt.MANIFEST), fmt.Manifest(
        agent_id=old.agent_id, name=old.name, holder=old.holder,
        files={p: e for p, e in old.files.items() if fmt.blob_name(p) is None}).to_bytes())
    assert store.gc().removed == 0
    await c.copy_tree(f"alice/{SNAPSHOTS}/keep", tmp_path / "snap")
    assert archive.verify_capsule(str(tmp_path / "snap"))[1] == []
    await c.rmdir(f"alice/{SNAPSHOTS}/keep")
    assert store.gc().removed == 2


async def _live_with_snapshot(store: HostStore, *names: str) -> Client:
    """A view where the daemon keeps it, with a snapshot "keep" and a scratch file of each agent."""
    from ops_kit import _reply
    c = Client(Operations(make_live(store, Path(store.root) / "mount"), kernel=FakeKernel(),
                          readdir_reply=_reply, uid=0, gid=0))
    for name in names:
        await c.mkdir(f"{name}/{SNAPSHOTS}/keep")
        await c.create(f"{name}/memory/.notes.swp", b"swap\n")
    return c


def _kept(store: HostStore, area: str) -> list[str]:
    d = Path(store.root) / "mount" / area
    return sorted(os.listdir(d)) if d.exists() else []


async def test_an_agent_that_moved_away_leaves_no_snapshot_pinning_its_blobs(store: HostStore) -> None:
    make_agent(store, "alice", workspace={"a": b"alice's\n"})
    c = await _live_with_snapshot(store, "alice")
    aid = store.find("alice").agent_id
    assert _kept(store, "snapshots") == [aid] and _kept(store, "scratch") == [aid]
    c.ops.live.retire(aid)  # what a move's commit does here, then:
    store.remove_agent(aid)
    assert _kept(store, "snapshots") == [] and _kept(store, "scratch") == []
    assert store.gc().removed > 0 and list(store.all_blobs()) == []


async def test_leftovers_of_a_removal_cut_short_are_dropped_at_the_next_start(store: HostStore) -> None:
    make_agent(store, "alice", workspace={"a": b"alice's\n"})
    make_agent(store, "bob", workspace={"b": b"bob's\n"})
    await _live_with_snapshot(store, "alice", "bob")
    alice, bob = store.find("alice").agent_id, store.find("bob").agent_id
    store.remove_agent(alice)  # a crash here, before removal.discard_leftovers
    make_live(store, Path(store.root) / "mount")  # the next daemon's view
    assert _kept(store, "snapshots") == [bob] and _kept(store, "scratch") == [bob]
    assert store.gc().removed > 0
    c = await _live_with_snapshot(store)
    assert await c.listdir(f"bob/{SNAPSHOTS}") == ["keep"]
    assert await c.read("bob/memory/.notes.swp") == b"swap\n"


async def test_agent_removed_beside_the_mount_just_goes_away(c: Client, store: HostStore) -> None:
    ino = await c.lookup("alice/memory/working_memory.md")
    store.remove_agent(store.find("alice").agent_id)
    assert await c.listdir("") == []
    assert await errno_of(c.ops.getattr(ino, c.ctx)) == errno.ENOENT
    assert await errno_of(c.lookup("alice")) == errno.ENOENT
    assert c.ops.live.failsafe is None
    await c.mkdir("/alice")  # the name is free again
    assert await c.listdir("alice/memory") == ["timeline_events.jsonl", "vector_index", "working_memory.md"]


async def test_a_handle_opened_before_removal_never_writes_into_the_agent_imported_again(
        c: Client, store: HostStore, tmp_path: Path) -> None:
    """Handles belong to one incarnation of an agent: after it is removed (or
    moved away) and an agent of the same id is imported again, a journal or
    working-memory handle still open on the old one writes nothing."""
    agent = store.find("alice")
    tar = tmp_path / "alice.tar"
    archive.export_agent(agent, str(tar), mtime=0)
    journal = await c.open(f"alice/{fmt.JOURNAL}", os.O_WRONLY | os.O_APPEND)
    memory = await c.open("alice/memory/working_memory.md", os.O_WRONLY)
    line = b'{"kind":"note","text":"from the old handle"}\n'
    assert await c.ops.write(journal.fh, 0, line) == len(line)
    store.remove_agent(agent.agent_id)  # what Agents.remove does, without the daemon
    c.ops.live.forget(agent.agent_id)
    assert await errno_of(c.ops.write(journal.fh, 0, line)) == errno.ENOENT
    archive.import_tar(store, str(tar))
    assert await c.listdir("") == ["alice"]  # shown again: a new incarnation
    before = store.find("alice").read(fmt.JOURNAL)
    assert await errno_of(c.ops.write(journal.fh, 0, line)) == errno.ENOENT
    assert await errno_of(c.ops.write(memory.fh, 0, b"stale edit\n")) == errno.ENOENT
    for fi in (journal, memory):
        await errno_of(c.ops.flush(fi.fh))  # an edit saved at close must not land either
        await c.ops.release(fi.fh)
    assert store.find("alice").read(fmt.JOURNAL) == before
    assert b"stale edit" not in store.find("alice").read(fmt.WORKING_MEMORY)
    await c.write(f"alice/{fmt.JOURNAL}", b'{"kind":"note","text":"new handle"}\n', append=True)
    assert b"new handle" in store.find("alice").read(fmt.JOURNAL)


def test_a_crash_after_a_large_memory_edit_is_journaled_loses_no_blob(store: HostStore, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The journal names the edit's blob once it is appended: the manifest
    must list the blob by then, or a gc after a crash takes it."""
    from capsulefs.core.view.agent import LiveAgent

    agent = make_agent(store, "alice")
    live = make_live(store, tmp_path / "work")
    real = LiveAgent.append

    def append_then_die(self, events):  # type: ignore[no-untyped-def]
        real(self, events)
        raise KeyboardInterrupt  # the process dies once the event is durable

    monkeypatch.setattr(LiveAgent, "append", append_then_die)
    big = ("y" * 99 + "\n").encode() * 1000
    with pytest.raises(KeyboardInterrupt):
        live.agent(agent.agent_id).save(fmt.WORKING_MEMORY, big)
    monkeypatch.undo()
    sha = journal_records(store)[-1].event.blob  # type: ignore[attr-defined]
    store.gc()
    assert store.read_blob(sha) == big


@pytest.mark.expect_error_log
async def test_a_journal_write_after_a_failed_fdatasync_reopens_the_journal(
        c: Client, store: HostStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed fdatasync fails its append (EIO) and stops the Journal
    object, so that no later sync can pretend over pages that never reached
    the disk. The mount reopens it at the next write (which writes the
    ring's bytes again and syncs them) instead of failing every journal
    write of the agent until the daemon restarts."""
    import capsulefs.core.journal.append as J

    j = "alice/memory/timeline_events.jsonl"
    await c.write(j, b'{"kind":"note","text":"before"}\n', append=True)
    agent = c.ops.live.agent(store.find("alice").agent_id)
    monkeypatch.setattr(J, "fdatasync", lambda fd: (_ for _ in ()).throw(OSError(errno.EIO, "Input/output error")))
    agent.journal()._ring.forget()  # the next append checkpoints the journal itself: that fdatasync fails
    assert await errno_of(c.write(j, b'{"kind":"note","text":"lost"}\n', append=True)) == errno.EIO
    monkeypatch.undo()
    await c.write(j, b'{"kind":"note","text":"after"}\n', append=True)
    assert [r.event.text for r in journal_records(store)][-2:] == ["before", "after"]


async def test_a_spec_whose_argv_or_env_holds_a_nul_is_refused(c: Client, store: HostStore) -> None:
    """A NUL in an argv or env string cannot reach exec: before, such a spec
    was accepted, and the supervisor's start of it raised ValueError, which
    took the whole daemon down (leaving a dead mount)."""
    spec = "alice/environment/spec.json"
    old = store.find("alice").read(fmt.SPEC)
    for bad in ({"version": 1, "entrypoint": ["/bin/sleep\0", "100"]},
                {"version": 1, "entrypoint": ["true"], "env": {"MODE": "a\0b"}},
                {"version": 1, "entrypoint": ["true"], "setup": [["make", "a\0"]]}):
        assert await errno_of(c.write(spec, json.dumps(bad).encode())) == errno.EINVAL, bad
    assert store.find("alice").read(fmt.SPEC) == old


async def test_an_unlinked_editable_file_is_gone_only_for_the_thread_that_unlinked_it(c: Client, store: HostStore) -> None:
    wm = f"alice/{fmt.WORKING_MEMORY}"
    old = await c.read(wm)
    mv, other = Ctx(pid=os.getpid()), Ctx(pid=os.getppid())  # (threads that exist: see the next test)
    c.ctx = mv
    await c.unlink(wm)
    assert await errno_of(c.lookup(wm)) == errno.ENOENT
    assert await errno_of(c.unlink(wm)) == errno.ENOENT
    c.ctx = other
    assert await c.read(wm) == old and "working_memory.md" in await c.listdir("alice/memory")
    assert await errno_of(c.create(wm, b"x")) == errno.EEXIST  # O_EXCL: it is there for this thread
    c.ctx = Ctx(pid=0)  # outside the mount's pid namespace: the unlink is refused as before
    assert await errno_of(c.unlink(wm)) == errno.EPERM
    c.ctx = mv
    await c.create(wm, b"made anew\n")
    assert await c.read(wm) == b"made anew\n"
    assert [r.kind for r in journal_records(store)] == ["memory_edit"]
    c.ctx = other
    assert await c.read(wm) == b"made anew\n"


async def test_a_later_thread_given_the_unlinker_s_id_sees_the_file_and_cannot_replace_it(
        c: Client, store: HostStore) -> None:
    """Thread ids are reused. `rm working_memory.md` by a tool that then
    exited must not hide the file from, nor hand its recreation to, an
    unrelated later process that gets the same id: its `echo x >>` would
    have replaced the whole working memory with "x"."""
    wm = f"alice/{fmt.WORKING_MEMORY}"
    old = await c.read(wm)
    tool = subprocess.Popen(["sleep", "30"])
    try:
        c.ctx = Ctx(pid=tool.pid)
        await c.unlink(wm)
        assert await errno_of(c.lookup(wm)) == errno.ENOENT  # for the tool itself, while it runs
    finally:
        tool.kill()
        tool.wait()
    # The same id, now another thread's (or none): the file is there, and an append appends.
    assert await c.read(wm) == old
    await c.write(wm, b"- one more\n", append=True, trunc=False)
    assert await c.read(wm) == old + b"- one more\n"


async def _set_mtime(c: Client, path: str, mtime_ns: int, fh: int | None = None) -> None:
    import pyfuse3

    from ops_kit import Fields

    attr = pyfuse3.EntryAttributes()
    attr.st_mtime_ns = mtime_ns
    await c.ops.setattr(await c.lookup(path), attr, Fields(update_mtime=True), fh, c.ctx)  # type: ignore[arg-type]


async def test_times_set_on_an_open_edit_hold_at_its_commit_unless_written_after(c: Client) -> None:
    """`cp -p` sets the times through its descriptor before closing it: the
    commit at close replaces the file, and must keep them; a write after
    them moves the mtime, as on a disk."""
    wm = "alice/memory/working_memory.md"
    for write_after, kept in ((False, True), (True, False)):
        fi = await c.open(wm, os.O_WRONLY | os.O_TRUNC)
        await c.ops.write(fi.fh, 0, b"# copied %d\n" % write_after)
        await _set_mtime(c, wm, 1_100_000_000 * 10**9, fi.fh)
        if write_after:
            await c.ops.write(fi.fh, 0, b"# copied 2\n")
        await c.ops.flush(fi.fh)
        await c.ops.release(fi.fh)
        assert ((await c.stat(wm)).st_mtime_ns == 1_100_000_000 * 10**9) is kept
    assert await c.read(wm) == b"# copied 2\n"


async def test_scratch_files_keep_the_mode_asked_for_and_move_their_directorys_time(c: Client) -> None:
    memory = await c.lookup("alice/memory")
    before = (await c.stat("alice/memory")).st_mtime_ns
    # A directory's time comes from the kernel's coarse clock (a tick of up to
    # 10 ms): on a fast machine the agent was made within the tick of the
    # create, and no time could move. Wait until the clock has passed a tick.
    while time.time_ns() <= before + 20_000_000:
        await trio.sleep(0.005)
    fi, attr = await c.ops.create(memory, b"f", 0o666, os.O_WRONLY | os.O_CREAT | os.O_EXCL, Ctx(umask=0))
    await c.ops.release(fi.fh)
    assert attr.st_mode & 0o7777 == 0o666  # (the kernel applied the caller's umask; the daemon's is not applied)
    assert (await c.stat("alice/memory")).st_mtime_ns > before
    assert (await c.stat("alice/artifacts")).st_mtime_ns == before  # (no scratch files there)
    await c.unlink("alice/memory/f")


@pytest.mark.parametrize("path", ["alice/manifest.json", "alice/artifacts/snapshot.json", "alice/memory", "alice",
                                  f"alice/{CONTROL}/model"])
async def test_read_only_files_refuse_new_times_as_they_refuse_a_mode(c: Client, path: str) -> None:
    assert await errno_of(_set_mtime(c, path, 1_100_000_000 * 10**9)) == errno.EPERM
    await _set_mtime(c, path, (await c.stat(path)).st_mtime_ns)  # (a no-op is fine)
