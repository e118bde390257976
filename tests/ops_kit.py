"""Driving ``capsulefs.mount.ops.Operations`` without a kernel (tier: Operations).

A :class:`Client` speaks to an ``Operations`` instance the way the kernel
would (lookup, open, setattr with the file handle, write, flush, release),
with fake request contexts and a fake kernel that records invalidations.
"""

from __future__ import annotations

import errno
import itertools
import os
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyfuse3

from capsulefs.core.view.control import Mover, NewAgents, Remover, TierCache
from capsulefs.core.view.host import LiveHost
from capsulefs.core.store.host_store import HostStore
from capsulefs.mount.ops import Operations

from helpers import HOST


@dataclass
class Ctx:
    uid: int = 0
    gid: int = 0
    pid: int = 1
    umask: int = 0o022


@dataclass
class Fields:
    update_size: bool = False
    update_mode: bool = False
    update_uid: bool = False
    update_gid: bool = False
    update_atime: bool = False
    update_mtime: bool = False


@dataclass
class FakeKernel:
    inodes: list[int] = field(default_factory=list)
    entries: list[tuple[int, bytes]] = field(default_factory=list)
    attrs: list[int] = field(default_factory=list)

    def invalidate_inode(self, ino: int) -> None:
        self.inodes.append(ino)

    def invalidate_entry(self, parent_ino: int, name: bytes) -> None:
        self.entries.append((parent_ino, name))

    def invalidate_attr(self, ino: int) -> None:
        self.attrs.append(ino)


def _reply(token: list[tuple[str, Any]], name: bytes, attr: pyfuse3.EntryAttributes, next_id: int) -> bool:
    token.append((os.fsdecode(name), attr))
    return True


def make_live(store: HostStore, work: Path, *, owner_uid: int = 0, mover: Mover | None = None,
              remover: Remover | None = None, new_agents: NewAgents | None = None,
              tier_cache: TierCache | None = None) -> LiveHost:
    ids = itertools.count(1)
    agents = itertools.count(1)
    clock = itertools.count(1_700_000_000_000_000_000, 1_000_000)
    return LiveHost(
        store,
        host_id=HOST,
        work_dir=str(work),
        new_agent_id=lambda: f"{next(agents):032x}",
        new_event_id=lambda: f"{next(ids):024x}",
        now_ns=lambda: next(clock),
        owner_uid=owner_uid,
        mover=mover,
        remover=remover,
        new_agents=new_agents,
        tier_cache=tier_cache,
    )


class Client:
    def __init__(self, ops: Operations) -> None:
        self.ops = ops
        self.ctx = Ctx()

    async def lookup(self, path: str) -> int:
        ino = pyfuse3.ROOT_INODE
        for part in [p for p in path.split("/") if p]:
            ino = (await self.ops.lookup(ino, os.fsencode(part), self.ctx)).st_ino
        return ino

    async def stat(self, path: str) -> pyfuse3.EntryAttributes:
        return await self.ops.getattr(await self.lookup(path), self.ctx)

    async def listdir(self, path: str) -> list[str]:
        fh = await self.ops.opendir(await self.lookup(path), self.ctx)
        token: list[tuple[str, Any]] = []
        await self.ops.readdir(fh, 0, token)  # type: ignore[arg-type]
        await self.ops.releasedir(fh)
        return [n for n, _ in token if n not in (".", "..")]  # as os.listdir

    async def open(self, path: str, flags: int = os.O_RDONLY, ctx: Ctx | None = None) -> pyfuse3.FileInfo:
        return await self.ops.open(await self.lookup(path), flags, ctx or self.ctx)

    async def read(self, path: str) -> bytes:
        fi = await self.open(path)
        out = b""
        try:
            while chunk := await self.ops.read(fi.fh, len(out), 1 << 16):
                out += chunk
        finally:
            await self.ops.release(fi.fh)
        return out

    async def write(self, path: str, data: bytes, *, append: bool = False, trunc: bool = True,
                    fsync: bool = False) -> None:
        """Like open(O_WRONLY|O_TRUNC or O_APPEND), write, [fsync,] close."""
        ino = await self.lookup(path)
        flags = os.O_WRONLY | (os.O_APPEND if append else 0)
        fi = await self.ops.open(ino, flags, self.ctx)
        try:
            if trunc and not append:
                attr = pyfuse3.EntryAttributes()
                attr.st_size = 0
                await self.ops.setattr(ino, attr, Fields(update_size=True), fi.fh, self.ctx)  # type: ignore[arg-type]
            off = 0
            if data:
                off += await self.ops.write(fi.fh, off, data)
            if fsync:
                await self.ops.fsync(fi.fh, False)
            await self.ops.flush(fi.fh)
        finally:
            await self.ops.release(fi.fh)

    async def create(self, path: str, data: bytes) -> None:
        parent, _, name = path.rpartition("/")
        fi, _attr = await self.ops.create(await self.lookup(parent), os.fsencode(name), 0o644,
                                          os.O_WRONLY | os.O_CREAT | os.O_EXCL, self.ctx)
        await self.ops.write(fi.fh, 0, data)
        await self.ops.flush(fi.fh)
        await self.ops.release(fi.fh)

    async def rename(self, old: str, new: str) -> None:
        po, _, no = old.rpartition("/")
        pn, _, nn = new.rpartition("/")
        await self.ops.rename(await self.lookup(po), os.fsencode(no), await self.lookup(pn), os.fsencode(nn), 0, self.ctx)

    async def mkdir(self, path: str) -> pyfuse3.EntryAttributes:
        parent, _, name = path.rpartition("/")
        return await self.ops.mkdir(await self.lookup(parent), os.fsencode(name), 0o755, self.ctx)

    async def rmdir(self, path: str) -> None:
        parent, _, name = path.rpartition("/")
        await self.ops.rmdir(await self.lookup(parent), os.fsencode(name), self.ctx)

    async def unlink(self, path: str) -> None:
        parent, _, name = path.rpartition("/")
        await self.ops.unlink(await self.lookup(parent), os.fsencode(name), self.ctx)

    async def getxattr(self, path: str, name: str) -> bytes:
        return await self.ops.getxattr(await self.lookup(path), name.encode(), self.ctx)

    async def copy_tree(self, path: str, dest: Path) -> None:
        """Copy a directory out through the Operations (like cp -r / tar)."""
        dest.mkdir(parents=True, exist_ok=True)
        for name in await self.listdir(path):
            sub = f"{path}/{name}"
            st = await self.stat(sub)
            if st.st_mode & 0o040000:
                await self.copy_tree(sub, dest / name)
            else:
                (dest / name).write_bytes(await self.read(sub))


async def errno_of(aw: Awaitable[Any]) -> int:
    """The errno a call fails with (0 if it succeeds)."""
    try:
        await aw
    except pyfuse3.FUSEError as exc:
        return exc.errno
    return 0


__all__ = ["Client", "Ctx", "FakeKernel", "Fields", "errno_of", "make_live", "errno"]
