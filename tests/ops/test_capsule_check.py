"""The capsule check every ops, mount and daemons test ends with (tests/capsule_check.py)
can fail: a capsule damaged after the test's body fails the test at teardown,
naming it; one left whole passes; a test that means to leave one broken says
why with the marker, and one that gives no reason fails."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from capsule_check import verify_tree
from capsulefs.core.capsule import format as fmt
from capsulefs.core.store.host_store import HostStore
from helpers import make_agent

pytest_plugins = ["pytester"]

INNER = '''
import os
import pytest
from capsulefs.core.capsule import format as fmt
from capsulefs.core.store.host_store import HostStore
from helpers import make_agent


def _damage_journal(agent):
    def damage():
        with open(agent.path(fmt.JOURNAL), "ab") as f:
            f.write(b'{"kind": "note", "not": "a stamped line"}\\n')  # (as a process outside the rules might)
    return damage


def test_whole(tmp_path):
    make_agent(HostStore.open(tmp_path / "hosts" / "a" / "state"), "alice")


def test_damaged_after_the_body(tmp_path, request):
    agent = make_agent(HostStore.open(tmp_path / "state"), "alice")
    request.addfinalizer(_damage_journal(agent))  # (runs at teardown, before the check)


@pytest.mark.capsule_left_broken("the test damages the journal on purpose")
def test_damaged_on_purpose(tmp_path, request):
    agent = make_agent(HostStore.open(tmp_path / "state"), "alice")
    request.addfinalizer(_damage_journal(agent))


@pytest.mark.capsule_left_broken("")
def test_marked_without_a_reason(tmp_path):
    pass
'''

CONFTEST = '''
import pytest
from capsule_check import verify_after

def pytest_configure(config):
    config.addinivalue_line("markers", "capsule_left_broken(why): see tests/capsule_check.py")

@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report

@pytest.fixture(autouse=True)
def _capsules_verify(request):
    yield from verify_after(request)
'''


def test_the_check_fails_a_test_that_leaves_a_damaged_capsule(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:randomly")
    result.assert_outcomes(passed=4, errors=2)
    out = result.stdout.str()
    assert "ERROR at teardown of test_damaged_after_the_body" in out
    assert "a capsule the test left does not verify" in out and fmt.JOURNAL in out
    assert "ERROR at teardown of test_marked_without_a_reason" in out and "needs the reason" in out
    assert "test_whole" not in out.split("short test summary")[-1]
    assert "test_damaged_on_purpose" not in out.split("short test summary")[-1]


@pytest.mark.capsule_left_broken("the test damages a blob to see the check find it")
def test_every_agent_of_every_store_under_the_directory_is_checked(tmp_path: Path) -> None:
    a = make_agent(HostStore.open(tmp_path / "hosts" / "a" / "state"), "alice")
    make_agent(HostStore.open(tmp_path / "hosts" / "b" / "state"), "bob")
    make_agent(HostStore.open(tmp_path / "hosts" / "b" / "state"), "carol")
    assert verify_tree(str(tmp_path)) == (3, [])
    blob = next(iter(a.manifest().blobs()))
    path = a.store.blob_file(blob)
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.write(b"X")
    checked, problems = verify_tree(str(tmp_path))
    assert checked == 3 and len(problems) == 1 and a.dir in problems[0] and blob in problems[0], problems


