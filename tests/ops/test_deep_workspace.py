"""Workspaces as deep as an agent likes (issue 25, finding 3: "sweeping and
cleanup never crash on what they find, however deep"): the walk behind the
workspace scan and the sandbox's ownership walk (walk.walk_tree) never
recurses, never follows a symlink, keeps few fds open; a synced path of up
to 4096 bytes is committed and materialised though the sandbox's path
before it is past PATH_MAX; a directory too deep for any path a capsule
can hold is skipped and named. Before, os.fwalk raised RecursionError at
about 1,000 levels, so a freeze (and a move) of such an agent failed."""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

from capsulefs.core.capsule import format as fmt
from capsulefs.core.capsule import workspace
from capsulefs.core.walk import TooDeep, open_beneath, walk_tree
from capsulefs.core.capsule.spec import default_spec, spec_bytes
from capsulefs.core.store.host_store import HostStore
from capsulefs.daemon.root import MountConfig, compose
from capsulefs.agents.isolation import Isolation
from capsulefs.agents.supervisor import RunState, Supervisor

from helpers import make_agent
from supervisor_kit import StoreHooks, wait_for

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a tree to an agent's uid needs root")

DEEP = 2000  # levels: past the recursion limit (1,000) and, below any real directory, past PATH_MAX
#: A file 2,000 directories deep: a 4,001-byte workspace path, which a capsule holds (at most 4096).
DEEP_FILE = "d/" * DEEP + "f"
#: The first directory of ``TOO_DEEP_FILE`` in which no path a capsule holds fits (its path is
#: 4,095 bytes: a file in it, 4,097 at least).
TOO_DEEP_DIR = "d/" * DEEP + "/".join(["x"] * 48)
TOO_DEEP_FILE = "d/" * DEEP + "x/" * 60 + "h"


def _descend(top: int, rel_dir: str, *, create: bool) -> int:
    """An fd on ``rel_dir`` under the directory open on ``top``, one name at a time."""
    fd = os.dup(top)
    for name in rel_dir.split("/") if rel_dir else ():
        if create:
            try:
                os.mkdir(name, dir_fd=fd)
            except FileExistsError:
                pass
        sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
        os.close(fd)
        fd = sub
    return fd


def put(top: str | Path, rel: str, data: bytes) -> None:
    """Write ``top/rel``, making its directories, through directory fds
    (the whole path is too long for any path-based call)."""
    os.makedirs(top, exist_ok=True)
    root = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    parent, _, name = rel.rpartition("/")
    fd = _descend(root, parent, create=True)
    os.close(root)
    try:
        f = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644, dir_fd=fd)
        os.write(f, data)
        os.close(f)
    finally:
        os.close(fd)


def get(top: str | Path, rel: str) -> bytes:
    root = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    parent, _, name = rel.rpartition("/")
    fd = _descend(root, parent, create=False)
    os.close(root)
    try:
        f = os.open(name, os.O_RDONLY, dir_fd=fd)
        try:
            return os.read(f, 1 << 20)
        finally:
            os.close(f)
    finally:
        os.close(fd)


def owners(top: str | Path, rel: str) -> set[int]:
    """The owners of every directory on the way to ``top/rel`` and of it."""
    root = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    fd, seen = root, set()
    try:
        for name in rel.split("/"):
            seen.add(os.stat(name, dir_fd=fd, follow_symlinks=False).st_uid)
            if name != rel.rsplit("/", 1)[-1]:
                sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                os.close(fd)
                fd = sub
    finally:
        os.close(fd)
    return seen


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# -- the walk ----------------------------------------------------------------------------------


def test_a_walk_goes_deep_and_back_keeping_few_fds_open(tmp_path: Path) -> None:
    """A comb: a chain of 'd' directories, each also holding a leaf 'e'. The
    leaves are entered on the way back up, so ancestors whose fds the walk
    closed are opened again; it never has more than its fds open."""
    depth, fds = 300, 8
    top = tmp_path / "comb"
    top.mkdir()
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    for _level in range(depth):
        os.mkdir("e", dir_fd=fd)
        os.mkdir("d", dir_fd=fd)
        sub = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = sub
    os.close(os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
    os.close(fd)
    before = open_fds()
    most = 0
    walked = []
    for d in walk_tree(top, max_fds=fds):
        most = max(most, open_fds() - before)
        walked.append(d.rel)
        names = [n for n, _st in d.entries]
        assert names == ([] if d.rel.endswith("e") else ["f"] if d.rel.count("d") == depth else ["d", "e"])
    chain = ["/".join(["d"] * level) for level in range(depth + 1)]
    assert walked == chain + [c + "/e" if c else "e" for c in reversed(chain[:-1])]
    assert most <= fds
    assert open_fds() == before


def test_a_walk_reports_what_is_deeper_than_its_bound(tmp_path: Path) -> None:
    put(tmp_path / "t", "a/b/c/d/e/f", b"x")
    errors: list[tuple[str, OSError]] = []
    walked = [d.rel for d in walk_tree(tmp_path / "t", max_depth=3, onerror=lambda rel, exc: errors.append((rel, exc)))]
    assert walked == ["", "a", "a/b", "a/b/c"]
    assert [(rel, type(exc)) for rel, exc in errors] == [("a/b/c/d", TooDeep)]
    with pytest.raises(TooDeep):  # (without onerror: raised)
        list(walk_tree(tmp_path / "t", max_depth=3))


@pytest.mark.parametrize("swap", ["symlink", "directory"])
def test_a_directory_swapped_during_the_walk_is_never_entered(tmp_path: Path, swap: str) -> None:
    """The walk is paused in a/b/c (two fds: a's and b's are closed by then);
    the agent swaps 'a' for a symlink to a host directory of the same shape,
    or for another directory. Going back for a/b's next entry, the walk
    must open 'a' again by its name: it refuses what it finds, names it, and
    never yields anything of the host's."""
    top, host = tmp_path / "ws", tmp_path / "host"
    for base in (top, host):
        put(base, "a/b/c/f", b"mine")
        put(base, "a/b/x/f", b"mine")
    host_dirs = {(os.stat(p).st_dev, os.stat(p).st_ino) for p in [host, *host.rglob("*")] if p.is_dir()}
    errors: list[str] = []
    walked = []
    for d in walk_tree(top, max_fds=2, onerror=lambda rel, exc: errors.append(rel)):
        walked.append(d.rel)
        assert (os.fstat(d.fd).st_dev, os.fstat(d.fd).st_ino) not in host_dirs
        if d.rel == "a/b/c":
            os.rename(top / "a", tmp_path / "a.old")
            if swap == "symlink":
                os.symlink(host, top / "a")
            else:
                os.rename(host, top / "a")
    assert walked == ["", "a", "a/b", "a/b/c"]
    assert errors == ["a", "a/b"]


def test_a_directory_swapped_before_it_is_entered_is_never_entered(tmp_path: Path) -> None:
    top, host = tmp_path / "ws", tmp_path / "host"
    put(top, "a/b/f", b"mine")
    put(host, "f", b"HOST")
    errors: list[tuple[str, int]] = []
    walked = []
    for d in walk_tree(top, onerror=lambda rel, exc: errors.append((rel, exc.errno))):
        walked.append(d.rel)
        if d.rel == "a":  # listed: 'b' is a directory; now a symlink to the host's
            os.rename(top / "a" / "b", tmp_path / "b.old")
            os.symlink(host, top / "a" / "b")
    assert walked == ["", "a"]
    assert [rel for rel, _e in errors] == ["a/b"] and errors[0][1] in (errno.ELOOP, errno.ENOTDIR)


def test_open_beneath_takes_a_path_past_path_max_and_follows_no_symlink(tmp_path: Path) -> None:
    top = tmp_path / "ws"
    put(top, DEEP_FILE, b"deep\n")
    fd = open_beneath(top, DEEP_FILE, os.O_RDONLY)
    try:
        assert os.read(fd, 100) == b"deep\n"
    finally:
        os.close(fd)
    put(tmp_path / "host", "d/f", b"HOST")
    os.symlink(tmp_path / "host", top / "link")
    for rel in ("link/d/f", "link", "../host/d/f", "d/../link/d/f"):
        with pytest.raises(OSError):
            os.close(open_beneath(top, rel, os.O_RDONLY))


# -- the workspace: sync, build, ownership -----------------------------------------------------


async def test_a_workspace_2000_deep_is_synced_and_built_again(store: HostStore, state_dir: Path, tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """The agent made a file 2,000 directories deep (a 4,001-byte path) and
    one deeper than any path a capsule holds. The sync (the freeze before a
    move) commits the first and skips the second with one warning naming
    its directory; the sandbox built again from the snapshot (a start, on
    this host or after the move) holds the first."""
    agent = make_agent(store, "alice")
    rt = compose(MountConfig(state_dir=str(state_dir), mountpoint=str(tmp_path / "mnt"))).runtime
    assert rt is not None
    try:
        sandbox = rt.supervisor.sandbox(agent.agent_id)
        workspace.materialize(rt.snapshot(agent.agent_id), rt.read_blob, sandbox)
        put(sandbox, DEEP_FILE, b"deep\n")
        put(sandbox, TOO_DEEP_FILE, b"too deep\n")
        with caplog.at_level(logging.WARNING, logger="capsulefs.core.capsule.workspace"):
            scan = await rt.supervisor.sync_workspace(agent.agent_id)
        assert scan is not None and list(scan.changes) == [DEEP_FILE]
        assert scan.skipped == [TOO_DEEP_DIR]
        [line] = [r.getMessage() for r in caplog.records if "too deep" in r.getMessage()]
        assert "1 directories too deep for a capsule" in line and "(4095 bytes)" in line and len(line) < 500
        snap = rt.snapshot(agent.agent_id)
        assert store.read_blob(snap[DEEP_FILE]) == b"deep\n"
        rebuilt = str(tmp_path / "rebuilt")
        workspace.materialize(snap, rt.read_blob, rebuilt)
        assert get(rebuilt, DEEP_FILE) == b"deep\n"
        assert workspace.scan(rebuilt, snap).changes == {}
    finally:
        rt.live.close()


@needs_root
def test_a_workspace_2000_deep_is_given_to_the_agent(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Every directory of a 2,000-deep workspace (made by root, as a build
    from the snapshot makes it) goes to the agent's uid; a home an earlier
    uid made 2,100 deep keeps that owner past 2,048 levels, and says so."""
    state = tmp_path / "state"
    iso = Isolation(str(state), uids=range(300_000, 300_010))
    agent_id = "a" * 32
    ws = state / "sandboxes" / agent_id / "workspace"
    ws.mkdir(parents=True)
    put(ws, DEEP_FILE, b"deep\n")
    home = Path(iso.home(agent_id))
    home.mkdir()
    put(home, "d/" * 2100 + "f", b"x")
    with caplog.at_level(logging.WARNING, logger="capsulefs.agents.isolation"):
        ids = iso.prepare(agent_id, str(ws), reach=[])
    assert owners(ws, DEEP_FILE) == {ids.uid}
    assert owners(home, "d/" * workspace.MAX_DEPTH + "d") == {ids.uid}
    assert owners(home, "d/" * 2100 + "f") == {ids.uid, 0}
    assert any("were not given to uid" in r.getMessage() for r in caplog.records)


# An agent that reads the file 2,000 directories deep its snapshot holds,
# writes another beside it and one too deep for a capsule, then waits.
DEEP_AGENT = r"""
import os, sys, time
def descend(fd, names, create):
    for name in names:
        if create:
            try:
                os.mkdir(name, dir_fd=fd)
            except FileExistsError:
                pass
        sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
        os.close(fd)
        fd = sub
    return fd
def write(fd, name, data):
    f = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644, dir_fd=fd)
    os.write(f, data)
    os.close(f)
fd = descend(os.open(".", os.O_RDONLY | os.O_DIRECTORY), ["d"] * 2000, False)
f = os.open("f", os.O_RDONLY, dir_fd=fd)
data = os.read(f, 100)
os.close(f)
write(fd, "g", data.upper())
write(descend(fd, ["x"] * 60, True), "h", b"too deep\n")
with open("ready", "w") as f:
    f.write("ready\n")
while True:
    time.sleep(1)  # (pacing: the agent idles until it is stopped)
"""


async def test_the_freeze_of_a_running_agent_with_a_2000_deep_workspace(store: HostStore, tmp_path: Path) -> None:
    """End to end through the supervisor: build (and, as root, give to the
    agent's uid) a sandbox holding a file 2,000 directories deep, run the
    agent in it, freeze it for a move: what it wrote there is committed."""
    agent = make_agent(store, "deep", workspace={DEEP_FILE: b"deep\n"})
    agent.write_files({fmt.SPEC: spec_bytes(default_spec([sys.executable, "-c", DEEP_AGENT]))})
    hooks = StoreHooks(store, str(tmp_path / "mnt"))
    sup = Supervisor(store.root, hooks, grace=5)
    ready = Path(sup.sandbox(agent.agent_id)) / "ready"
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.serve)
        sup.want(agent.agent_id)
        await wait_for(lambda: ready.exists() and ready.stat().st_size > 0 or sup.status(agent.agent_id).state
                        in (RunState.BLOCKED, RunState.FINISHED), "the agent to write its deep files")
        assert sup.status(agent.agent_id).state is RunState.RUNNING, sup.status(agent.agent_id).detail
        await sup.freeze(agent.agent_id)
        assert sup.status(agent.agent_id).state is RunState.FROZEN
        nursery.cancel_scope.cancel()
    snap = hooks.snapshot(agent.agent_id)
    assert set(snap) == {DEEP_FILE, "d/" * DEEP + "g", "ready"}
    assert store.read_blob(snap["d/" * DEEP + "g"]) == b"DEEP\n"


# An escaped child of the agent: swaps a workspace directory between a real
# one and a symlink to a host directory, forever.
DIR_SWAPPER = r"""
import os, sys
ws, host = sys.argv[1], sys.argv[2]
sub, real, link = (os.path.join(ws, n) for n in ("sub", ".real", ".link"))
os.makedirs(os.path.join(sub, "deeper"))
with open(os.path.join(sub, "deeper", "f"), "w") as g:
    g.write("mine\n")
os.symlink(host, link)
print("ready", flush=True)
while True:
    os.rename(sub, real)
    os.rename(link, sub)
    os.rename(sub, link)
    os.rename(real, sub)
"""


def test_a_directory_swapped_for_a_symlink_during_scans_and_ownership_walks_is_never_followed(tmp_path: Path) -> None:
    """As root, each round also gives the workspace to an agent's uid again
    (Isolation.prepare, after the workspace went back to root): the host's
    files keep their owner."""
    host = tmp_path / "host"
    (host / "deeper").mkdir(parents=True)
    (host / "deeper" / "f").write_text("HOST-SECRET\n")
    (host / "f").write_text("HOST-SECRET\n")
    host_sha = hashlib.sha256(b"HOST-SECRET\n").hexdigest()
    owned = {p: os.stat(p).st_uid for p in (host, host / "f", host / "deeper", host / "deeper" / "f")}
    state, agent_id = tmp_path / "state", "a" * 32
    ws = state / "sandboxes" / agent_id / "workspace"
    ws.mkdir(parents=True)
    iso = Isolation(str(state), uids=range(300_000, 300_010)) if os.geteuid() == 0 else None
    with subprocess.Popen([sys.executable, "-c", DIR_SWAPPER, str(ws), str(host)], stdout=subprocess.PIPE) as swapper:
        try:
            assert swapper.stdout is not None and swapper.stdout.readline() == b"ready\n"
            rounds = 0
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                result = workspace.scan(str(ws), {})
                assert host_sha not in result.new_files, f"scan {rounds} read a host file through the workspace"
                if iso is not None:
                    os.chown(ws, 0, 0)
                    iso.prepare(agent_id, str(ws), reach=[])
                rounds += 1
        finally:
            swapper.kill()
    assert rounds > 10
    assert {p: os.stat(p).st_uid for p in owned} == owned
