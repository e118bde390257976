"""Trees deeper than Python's recursion and than PATH_MAX, as a hostile tar
or an agent can make them, are removed wherever capsulefs cleans up: the
store's staging sweep (every command that opens the store), a staging area's
own cleanup, an agent's sandbox. (Issue 25, finding 3.)"""

from __future__ import annotations

import os
from pathlib import Path

from capsulefs.core.capsule import archive
from capsulefs.core.fsutil import remove_tree
from capsulefs.core.store.host_store import HostStore
from capsulefs.agents.sandbox_dir import discard_sandbox, sandbox_root

from helpers import export_and_unpack, make_agent

DEPTH = 1100  # past the recursion limit (1,000): what shutil.rmtree and os.walk die of
#: As the issue found it: a tree whose path (2 bytes a level) is past PATH_MAX too.
VERY_DEEP = 3000


def make_deep(root: Path, depth: int = DEPTH) -> None:
    """``root/d/d/.../d/f``, ``depth`` directories deep, made through
    directory fds (its full path is too long for any path-based call)."""
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            sub = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = sub
        os.close(os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
        os.symlink("/etc", "link", dir_fd=fd)
    finally:
        os.close(fd)


def test_remove_tree_removes_a_tree_deeper_than_path_max_and_follows_no_link(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("kept")
    top = tmp_path / "top"
    make_deep(top, VERY_DEEP)
    os.symlink(outside, top / "to-outside")
    (top / "file").write_text("x")
    remove_tree(top)
    assert not top.exists()
    assert (outside / "keep").read_text() == "kept"


def test_remove_tree_of_a_missing_path(tmp_path: Path) -> None:
    remove_tree(tmp_path / "absent", ignore_errors=True)
    try:
        remove_tree(tmp_path / "absent")
    except FileNotFoundError:
        pass
    else:
        raise AssertionError("a missing tree is an error unless ignore_errors")


def test_a_store_whose_staging_holds_a_deep_tree_opens_and_sweeps_it(tmp_path: Path) -> None:
    """A crash (or, before the fix, an import of a deep tar) left a deep tree
    in staging: every command that opens the store used to die sweeping it."""
    state = tmp_path / "state"
    HostStore.open(state)
    make_deep(state / "staging" / "import-0123456789ab" / "capsule", VERY_DEEP)
    store = HostStore.open(state)
    assert os.listdir(store.staging_dir) == []


def test_a_staging_area_holding_a_deep_tree_is_removed_on_exit(tmp_path: Path) -> None:
    store = HostStore.open(tmp_path / "state")
    with store.staging("import") as area:
        make_deep(Path(area) / "capsule")
    assert os.listdir(store.staging_dir) == []


def test_a_sandbox_holding_a_deep_tree_is_discarded(tmp_path: Path) -> None:
    """An agent may make any tree in its workspace; removing its sandbox must not crash."""
    state = tmp_path / "state"
    agent_id = "a" * 32
    make_deep(Path(sandbox_root(str(state))) / agent_id / "workspace")
    discard_sandbox(str(state), agent_id)
    assert not (Path(sandbox_root(str(state))) / agent_id).exists()


def test_verify_of_a_directory_holding_a_deep_tree_names_it(store: HostStore, tmp_path: Path) -> None:
    """verify DIR walked every directory (os.walk: RecursionError); it now
    enters only the capsule's tree and names a directory the format does not have."""
    _tar, cap = export_and_unpack(make_agent(store), tmp_path)
    make_deep(cap / "memory" / "extra")
    _m, problems = archive.verify_capsule(str(cap))
    assert [str(p) for p in problems] == [
        "memory/extra: is a directory the capsule format does not have; what it holds was not read"]
    remove_tree(cap / "memory" / "extra")
    assert archive.verify_capsule(str(cap))[1] == []
