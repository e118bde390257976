"""Fixtures shared by every test tier, and the tiers themselves.

Each test lives in the folder of its tier, and the marker of the tier's name
selects it (``pytest -m unit``, ``-m "not daemons"``); see :data:`TIERS`.
A real-mount test is marked ``fuse`` too: every one in ``tests/mount/``, by
its folder; elsewhere, by its module's ``pytestmark``.

An unexpected warning fails a test (pyproject: filterwarnings = error), as
in S3QL. Tests that log at ERROR without declaring it fail too: a test that
expects an error log uses the ``caplog`` fixture and asserts on it.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from capsulefs.core.fsutil import remove_tree
from capsulefs.core.store.host_store import HostStore

from cli_kit import run_cli


#: The directory a test run makes its own under (scripts/test.sh gives each
#: run one, and checks that no FUSE mount is left under it); default /tmp.
RUN_ROOT_ENV = "CAPSULEFS_TEST_ROOT"


@pytest.fixture(scope="session")
def _reachable_root() -> Iterator[Path]:
    """This session's directory that every user may pass through (0711):
    every test's directory as root, and every mount point, is under it."""
    root = Path(tempfile.mkdtemp(prefix="capsulefs-pytest-", dir=os.environ.get(RUN_ROOT_ENV) or "/tmp"))
    root.chmod(0o711)
    yield root
    with open("/proc/self/mountinfo") as f:
        mounted = any(f" {root}/" in line for line in f)
    if not mounted:  # (never delete through a mount a failed test left; however deep a tree it left)
        remove_tree(root, ignore_errors=True)


@pytest.fixture
def tmp_path(tmp_path: Path, request: pytest.FixtureRequest) -> Path:
    """As root, the supervisor runs every agent as a uid of its own
    (capsulefs/agents/isolation.py), which must reach the state directory, the mount
    and the test's scripts; pytest's own directories are under
    /tmp/pytest-of-root, mode 0700. So as root a test's directory is one
    every user may pass through (0711, not list), removed after the session."""
    if os.geteuid() != 0:
        return tmp_path
    d = Path(tempfile.mkdtemp(prefix=request.node.name[:40].replace("/", "_") + "-",
                              dir=request.getfixturevalue("_reachable_root")))
    d.chmod(0o711)
    return d


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "state"


@pytest.fixture
def store(state_dir: Path) -> HostStore:
    return HostStore.open(state_dir)


@pytest.fixture
def cli(state_dir: Path):
    def _run(*args: str, check: bool = False, **kw) -> subprocess.CompletedProcess:
        return run_cli(*args, state=state_dir, check=check, **kw)

    return _run


@pytest.fixture(autouse=True)
def _no_error_logs(caplog: pytest.LogCaptureFixture, request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "expect_error_log" in request.keywords:
        return
    errors = [r for r in caplog.get_records("call") if r.levelno >= 40]
    if errors:
        pytest.fail("unexpected error log: " + "; ".join(r.getMessage() for r in errors))


#: The test tiers: a folder of tests/ each, and the marker that selects it.
TIERS = {
    "unit": "pure code: no state directory, process, socket or mount",
    "ops": "one host's state directory on disk: store, journals, Operations without a kernel, "
           "the CLI and agent processes, no mount",
    "mount": "real FUSE mounts (needs /dev/fuse and root)",
    "daemons": "several real daemons or peers over TLS: moves, the peer link, the fleet engines",
    "fuzz": "the fuzz targets' short CI pass",
}
TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from mount_kit import needs_fuse

    for item in items:
        rel = item.path.resolve().relative_to(TESTS)
        tier = rel.parts[0] if len(rel.parts) > 1 else ""
        if tier not in TIERS:
            raise pytest.UsageError(f"tests/{rel}: every test lives in the folder of its tier ({', '.join(TIERS)})")
        item.add_marker(tier)
        if tier == "mount":
            item.add_marker(pytest.mark.fuse)
            item.add_marker(needs_fuse)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    """Each phase's report on the item (``item.rep_call``), for fixtures
    that act at teardown only if the test passed (capsule_check)."""
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report
