"""The capsule check every ops, mount and daemons test ends with (S3QL ends each test with fsck).

After a test (its other fixtures torn down: daemons stopped, mounts gone), the
check finds every host store under the test's directory (a ``store.json``
beside ``agents/``; mount points and the stores' own trees are not entered)
and, for each agent held there, checks what ``capsulefs export`` would write
as ``capsulefs verify`` checks a tar: the members export makes
(``archive.export_members``: the files read once under the agent's lock, the
manifest frozen over them, every blob re-hashed from the store) are listed
and judged by ``verify.check``: the journal verifies, every file matches the
manifest, every blob hashes to its name. (No tar is written: the container is
export's and verify's own tests' business, and writing it cost more than the
check.) A test that
deliberately leaves a broken capsule says so, and why::

    @pytest.mark.capsule_left_broken("the test truncates the journal on disk")

Each tier's conftest.py applies :func:`verify_after` as an autouse fixture.
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from capsulefs.core.capsule import archive, verify
from capsulefs.core.capsule import format as fmt
from capsulefs.core.errors import CapsuleError
from capsulefs.core.store.agent import AgentHandle
from capsulefs.core.store.host_store import HostStore
from capsulefs.core.store.layout import STORE_FILE

MARKER = "capsule_left_broken"
#: Levels below the test's directory searched for state directories (tests
#: put them at tmp_path/state, tmp_path/a/state, tmp_path/hosts/b/state ...).
DEPTH = 4


def find_stores(root: str, depth: int = DEPTH) -> Iterator[str]:
    """State directories under ``root``, at most ``depth`` levels down; never
    entering a mount point (a test that failed may leave one) nor a store's
    own tree."""
    try:
        entries = list(os.scandir(root))
    except OSError:
        return
    names = {e.name for e in entries}
    if STORE_FILE in names and "agents" in names:
        yield root
        return
    if depth == 0:
        return
    for e in sorted(entries, key=lambda e: e.name):
        if e.is_dir(follow_symlinks=False) and not os.path.ismount(e.path):
            yield from find_stores(e.path, depth - 1)


def check_store(root: str) -> list[str]:
    """Export and verify every agent of the store at ``root``: one line per problem."""
    store = HostStore(root)  # (not HostStore.open: the check sweeps and creates nothing)
    problems: list[str] = []
    try:
        agents = store.agents()
    except OSError as exc:
        return [f"{root}: cannot list its agents: {exc}"]
    for agent in agents:
        try:
            _, found = verify.check(_exported(agent))
        except (CapsuleError, OSError) as exc:
            problems.append(f"{agent.dir}: export failed: {exc}")
            continue
        problems += [f"{agent.dir}: {p}" for p in found]
    return problems


def _exported(agent: AgentHandle) -> verify.Listing:
    """The listing of the tar ``capsulefs export`` would write, as verify scans one."""
    listing = verify.Listing()
    for member in archive.export_members(agent):
        h = hashlib.sha256()
        kept = io.BytesIO() if member.path in verify.KEEP_BYTES or member.path == fmt.MANIFEST else None
        size = 0
        with member.open() as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
                size += len(chunk)
                if kept is not None:
                    kept.write(chunk)
        listing.entries[member.path] = verify.Entry("file", size, h.hexdigest())
        if kept is not None:
            listing.contents[member.path] = kept.getvalue()
    return listing


def verify_tree(root: str) -> tuple[int, list[str]]:
    """(agents checked, problems) for every store under ``root``."""
    checked = 0
    problems: list[str] = []
    for store_root in find_stores(root):
        checked += len(HostStore(store_root).agent_ids())
        problems += check_store(store_root)
    return checked, problems


def verify_after(request: pytest.FixtureRequest) -> Iterator[None]:
    """The autouse fixture's body (see the module): fails the test at
    teardown, naming each capsule that does not verify."""
    yield
    marker = request.node.get_closest_marker(MARKER)
    if marker is not None:
        if not marker.args or not str(marker.args[0]).strip():
            pytest.fail(f"@pytest.mark.{MARKER} needs the reason the test leaves a broken capsule")
        return
    call = getattr(request.node, "rep_call", None)
    if call is None or not call.passed:
        return  # (the test failed, or was skipped: its own report says what matters)
    root: Path | None = request.node.funcargs.get("tmp_path")
    if root is None:
        return  # the test made no directory of its own
    _, problems = verify_tree(str(root))
    if problems:
        pytest.fail("a capsule the test left does not verify (mark the test "
                    f"@pytest.mark.{MARKER}(why) if it means to):\n  " + "\n  ".join(problems), pytrace=False)
