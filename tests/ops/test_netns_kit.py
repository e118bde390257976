"""tests/netns_kit.py: a partition cuts exactly one pair of nodes and heals,
and a test body that fails inside a network leaves no namespace and no
process behind."""

from __future__ import annotations

import errno
import os
import signal
import socket
from pathlib import Path

import pytest

from netns_kit import Node, leftovers, open_network, run_tag, unavailable

pytest_plugins = ["pytester"]

_NO_NETNS = unavailable()
pytestmark = pytest.mark.skipif(_NO_NETNS is not None, reason=_NO_NETNS or "")

PORT = 9000


def connects(node: Node, to: Node) -> int:
    """0 if ``node`` can open a TCP connection to ``to``'s listener, else the errno."""
    def attempt() -> int:
        try:
            socket.create_connection((to.address, PORT), timeout=2).close()
        except OSError as exc:
            return exc.errno or -1
        return 0

    return node.call(attempt)


def test_a_partition_cuts_one_pair_and_heals() -> None:
    with open_network("x", "y", "z") as net:
        x, y, z = net.nodes["x"], net.nodes["y"], net.nodes["z"]
        listeners = [n.call(socket.create_server, (n.address, PORT)) for n in (x, y, z)]
        try:
            assert connects(x, y) == 0 and connects(x, z) == 0 and connects(y, z) == 0
            net.partition(x, y)
            assert connects(x, y) == errno.EINVAL and connects(y, x) == errno.EINVAL
            assert connects(x, z) == 0 and connects(y, z) == 0  # (only the pair is cut)
            net.heal(x, y)
            assert connects(x, y) == 0
            net.isolate(z)
            assert connects(x, z) != 0 and connects(x, y) == 0  # (EHOSTUNREACH once ARP gives up, or a timeout)
            net.rejoin(z)
            assert connects(x, z) == 0
        finally:
            for s in listeners:
                s.close()
    assert leftovers(net.tag) == []


INNER = '''
import subprocess
from netns_kit import open_network


def test_fails_inside(request):
    with open_network("x", "y", tag={tag!r}) as net:
        proc = net.nodes["x"].popen(["sleep", "600"])
        request.addfinalizer(lambda: proc.wait(timeout=10))  # (reaped once the network's teardown killed it)
        with open({pidfile!r}, "w") as f:
            f.write(str(proc.pid))
        net.partition(net.nodes["x"], net.nodes["y"])
        assert False, "the body fails"
'''


def test_a_failing_body_leaves_no_namespace_and_no_process(pytester: pytest.Pytester, tmp_path: Path) -> None:
    tag, pidfile = run_tag(), tmp_path / "pid"
    pytester.syspathinsert(Path(__file__).parents[1])
    pytester.makepyfile(test_inner=INNER.format(tag=tag, pidfile=str(pidfile)))
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:randomly")
    pid = int(pidfile.read_text())
    if Path(f"/proc/{pid}").exists():  # (the check below fails: leave nothing behind meanwhile)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail(f"the process {pid} started in the network was still there after the test")
    result.assert_outcomes(failed=1)
    assert "the body fails" in result.stdout.str()
    assert leftovers(tag) == []
    assert not Path(f"/proc/{pid}").exists(), f"the process {pid} started in the network is still there"
