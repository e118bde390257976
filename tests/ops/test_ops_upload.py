"""Operations without a kernel: blobs uploaded through ``AGENT/artifacts/blobs/``."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import tempfile
from pathlib import Path

import pyfuse3
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capsulefs.core.capsule import archive
from capsulefs.core.capsule import format as fmt
from capsulefs.core.journal.record import Record
from capsulefs.core.view.uploads import MAX_OPEN_UPLOADS, MAX_UPLOAD
from capsulefs.core.store.host_store import HostStore
from capsulefs.mount.ops import Operations
from capsulefs.core.view.nodes import Kind, Node
from helpers import agent_id_for, make_agent
from ops_kit import Client, FakeKernel, Fields, _reply, errno_of, make_live

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4
SHA = hashlib.sha256(PNG).hexdigest()
BLOBS = f"alice/{fmt.BLOBS_DIR}"


def make_ops(store: HostStore, work: Path) -> Operations:
    return Operations(make_live(store, work), kernel=FakeKernel(), readdir_reply=_reply, uid=0, gid=0)


@pytest.fixture
def ops(store: HostStore, tmp_path: Path) -> Operations:
    make_agent(store, "alice")
    return make_ops(store, tmp_path / "work")


@pytest.fixture
def c(ops: Operations) -> Client:
    return Client(ops)


async def create(c: Client, name: str, flags: int = os.O_WRONLY | os.O_CREAT | os.O_EXCL) -> int:
    fi, _ = await c.ops.create(await c.lookup(BLOBS), os.fsencode(name), 0o644, flags, c.ctx)
    return fi.fh


async def upload(c: Client, name: str, data: bytes, *, chunk: int = 100_000) -> int:
    """create + write (in order, in chunks) + close, like cp; the close's errno."""
    fh = await create(c, name)
    try:
        for off in range(0, len(data), chunk):
            await c.ops.write(fh, off, data[off:off + chunk])
        return await errno_of(c.ops.flush(fh))
    finally:
        await c.ops.release(fh)


async def append(c: Client, draft: dict) -> int:
    fi = await c.open(f"alice/{fmt.JOURNAL}", os.O_WRONLY | os.O_APPEND)
    try:
        return await errno_of(c.ops.write(fi.fh, 0, json.dumps(draft).encode() + b"\n"))
    finally:
        await c.ops.release(fi.fh)


def listed(store: HostStore, name: str = "alice") -> dict[str, int]:
    return store.find(name).manifest().blobs()


def uploads_left(ops: Operations) -> list[str]:
    root = ops.live.uploads.root
    return os.listdir(root) if os.path.isdir(root) else []


async def test_an_uploaded_blob_is_stored_listed_and_attachable(c: Client, ops: Operations, store: HostStore,
                                                                 tmp_path: Path) -> None:
    assert await upload(c, SHA, PNG, chunk=300) == 0
    assert store.read_blob(SHA) == PNG and listed(store)[SHA] == len(PNG)
    assert SHA in await c.listdir(BLOBS) and await c.read(f"{BLOBS}/{SHA}") == PNG
    assert (await c.stat(f"{BLOBS}/{SHA}")).st_mode & 0o777 == 0o444
    # gc keeps it before any event names it: the manifest lists it
    store.gc()
    assert store.has_blob(SHA)
    assert await append(c, {"kind": "attachment", "blob": SHA, "media_type": "image/png", "size": len(PNG),
                            "name": "pic.png"}) == 0
    recs = [Record.from_line(x) for x in store.find("alice").read(fmt.JOURNAL).splitlines()]
    assert [r.kind for r in recs] == ["attachment"]
    assert uploads_left(ops) == [] and ops.live.failsafe is None
    await c.copy_tree("alice", tmp_path / "copy")
    assert archive.verify_capsule(str(tmp_path / "copy"))[1] == []


async def test_bytes_that_do_not_hash_to_the_name_are_refused_and_leave_nothing(
        c: Client, ops: Operations, store: HostStore) -> None:
    before = listed(store)
    wrong = PNG[:-1] + b"X"
    assert await upload(c, SHA, wrong) == errno.EINVAL
    assert not store.has_blob(SHA) and not store.has_blob(hashlib.sha256(wrong).hexdigest())
    assert listed(store) == before and SHA not in await c.listdir(BLOBS)
    assert await errno_of(c.lookup(f"{BLOBS}/{SHA}")) == errno.ENOENT
    assert uploads_left(ops) == [] and ops.live.failsafe is None


async def test_a_blob_the_store_has_is_not_rewritten_and_needs_its_bytes(
        c: Client, store: HostStore) -> None:
    make_agent(store, "bob", workspace={"pic.png": PNG})  # the store has it, for bob
    ino = os.stat(store.blob_file(SHA)).st_ino
    # naming it is not enough: alice gets it only by writing its bytes
    assert await upload(c, SHA, b"guess") == errno.EINVAL
    assert SHA not in listed(store)
    assert await upload(c, SHA, PNG) == 0
    assert SHA in listed(store) and os.stat(store.blob_file(SHA)).st_ino == ino
    # the name exists now: O_EXCL says so; cp's open of it (O_TRUNC) and the same bytes succeed
    assert await errno_of(create(c, SHA)) == errno.EEXIST
    fi = await c.open(f"{BLOBS}/{SHA}", os.O_WRONLY | os.O_TRUNC)
    await c.ops.write(fi.fh, 0, PNG)
    assert await errno_of(c.ops.flush(fi.fh)) == 0
    await c.ops.release(fi.fh)
    fi = await c.open(f"{BLOBS}/{SHA}", os.O_WRONLY | os.O_TRUNC)
    await c.ops.write(fi.fh, 0, b"changed")
    assert await errno_of(c.ops.flush(fi.fh)) == errno.EINVAL
    await c.ops.release(fi.fh)
    assert store.read_blob(SHA) == PNG and os.stat(store.blob_file(SHA)).st_ino == ino
    assert SHA in listed(store, "bob")


async def test_an_attachment_names_a_blob_the_agent_has_with_its_size(c: Client, store: HostStore) -> None:
    draft = {"kind": "attachment", "blob": SHA, "media_type": "image/png", "size": len(PNG)}
    make_agent(store, "bob", workspace={"pic.png": PNG})  # in the store, not alice's
    assert await append(c, draft) == errno.EINVAL
    assert await upload(c, SHA, PNG) == 0
    assert await append(c, draft | {"size": 5}) == errno.EINVAL
    assert store.find("alice").read(fmt.JOURNAL) == b""
    assert await append(c, draft) == 0


async def test_names_sizes_and_limits(c: Client, ops: Operations, store: HostStore) -> None:
    for bad in ("pic.png", SHA.upper(), SHA[:-1], SHA + "0", ".tmp-" + SHA):
        assert await errno_of(create(c, bad)) == errno.EINVAL, bad
    fh = await create(c, SHA)
    assert await errno_of(c.ops.write(fh, MAX_UPLOAD, b"x")) == errno.EFBIG
    attr = pyfuse3.EntryAttributes()
    attr.st_size = MAX_UPLOAD + 1
    assert await errno_of(c.ops.setattr(fh_inode(ops, SHA), attr, Fields(update_size=True), fh,  # type: ignore[arg-type]
                                        c.ctx)) == errno.EFBIG
    await c.ops.release(fh)
    handles = [await create(c, SHA) for _ in range(MAX_OPEN_UPLOADS)]
    assert await errno_of(create(c, SHA)) == errno.EBUSY
    for fh in handles:
        await c.ops.release(fh)
    assert uploads_left(ops) == [] and ops.live.failsafe is None and SHA not in listed(store)


def fh_inode(ops: Operations, sha: str) -> int:
    """The inode the kernel was given for an upload of ``sha`` by alice."""
    (ino,) = ops.inodes.all_of(Node(Kind.BLOB, agent_id_for("alice"), f"{fmt.BLOBS_DIR}/{sha}"))
    return ino


async def test_a_frozen_agent_takes_no_upload(c: Client, ops: Operations, store: HostStore) -> None:
    fh = await create(c, SHA)
    await c.ops.write(fh, 0, PNG)
    ops.live.freeze(agent_id_for("alice"))
    assert await errno_of(c.ops.flush(fh)) == errno.EROFS
    await c.ops.release(fh)
    assert await errno_of(create(c, SHA)) == errno.EROFS
    assert not store.has_blob(SHA) and uploads_left(ops) == []


async def test_leftovers_of_a_killed_daemon_are_removed(store: HostStore, tmp_path: Path) -> None:
    make_agent(store, "alice")
    ops = make_ops(store, tmp_path / "work")
    c = Client(ops)
    fh = await create(c, SHA)
    await c.ops.write(fh, 0, PNG)
    assert uploads_left(ops)  # the daemon dies here, the upload open
    again = make_ops(store, tmp_path / "work")
    assert uploads_left(again) == [] and not store.has_blob(SHA)
    os.close(ops._handles[fh].fd)  # type: ignore[attr-defined]


# -- hostile names and sizes never reach failsafe ---------------------------------------------------

names = st.one_of(st.just(SHA), st.text(min_size=1, max_size=80).filter(lambda s: "/" not in s and "\0" not in s),
                  st.binary(min_size=1, max_size=255).filter(lambda b: b"/" not in b and b"\0" not in b)
                  .map(os.fsdecode), st.sampled_from([SHA.upper(), SHA[:63], "." + SHA[1:], "a" * 64]))
steps = st.lists(st.one_of(
    st.tuples(st.just("write"), st.one_of(st.integers(0, 2000), st.sampled_from([MAX_UPLOAD - 8, MAX_UPLOAD + 1, 2**62])),
              st.binary(max_size=64)),
    st.tuples(st.just("write_png"), st.just(0), st.just(b"")),
    st.tuples(st.just("truncate"), st.sampled_from([0, 1, len(PNG), MAX_UPLOAD, MAX_UPLOAD + 1, 2**62]), st.just(b"")),
    st.tuples(st.just("flush"), st.just(0), st.just(b"")),
), max_size=8)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=names, steps=steps, flags=st.sampled_from([os.O_WRONLY | os.O_CREAT, os.O_RDWR | os.O_CREAT | os.O_EXCL,
                                                      os.O_WRONLY | os.O_CREAT | os.O_TRUNC]))
async def test_hostile_uploads_never_reach_failsafe(name: str, steps: list, flags: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        store = HostStore.open(Path(d) / "state")
        make_agent(store, "alice")
        ops = make_ops(store, Path(d) / "work")
        c = Client(ops)
        try:
            fh = await create(c, name, flags)
        except pyfuse3.FUSEError as exc:
            assert exc.errno in (errno.EINVAL, errno.ENAMETOOLONG) and name != SHA
            assert ops.live.failsafe is None
            return
        model = bytearray()
        ino = fh_inode(ops, name)
        for op, n, data in steps:
            if op == "write" or op == "write_png":
                data = PNG if op == "write_png" else data
                code = await errno_of(c.ops.write(fh, n, data))
                assert code in (0, errno.EFBIG, errno.EPERM)
                if code == 0 and data:
                    model.extend(bytes(max(0, n - len(model))))
                    model[n:n + len(data)] = data
            elif op == "truncate":
                attr = pyfuse3.EntryAttributes()
                attr.st_size = n
                code = await errno_of(c.ops.setattr(ino, attr, Fields(update_size=True), fh, c.ctx))  # type: ignore[arg-type]
                assert code in (0, errno.EFBIG, errno.EPERM)
                if code == 0:
                    del model[n:]
                    model.extend(bytes(n - len(model)))
            else:
                code = await errno_of(c.ops.flush(fh))
                good = hashlib.sha256(model).hexdigest() == name
                assert code == (0 if good else errno.EINVAL)
        await c.ops.release(fh)
        stored = SHA in listed(store)
        assert stored == store.has_blob(SHA)
        if stored:
            assert store.read_blob(SHA) == PNG
        assert uploads_left(ops) == [] and ops.live.failsafe is None
