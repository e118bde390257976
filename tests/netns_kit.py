"""Network namespaces for tests: hosts that reach each other over a network a test can cut.

:func:`open_network` makes one namespace per node, each with one address on
a bridge that lives in a namespace of its own (the hub), so nothing is added
to the machine's own network: the subnet is the same in every run, and runs
side by side never meet (each run's namespaces are named after its pid and a
counter). Work is done in a node's namespace by :meth:`Node.call` (a thread
that enters it with setns(2), so a process it starts is in it too, and the
mount namespace stays the test's: a FUSE mount made there is seen by the
test; ``ip netns exec`` would hide it in a mount namespace of its own).

Faults, each one call:
  * :meth:`Network.partition` / :meth:`Network.heal` between two nodes: a
    blackhole route on each side, so packets already on their way are lost
    and an established connection hangs, as across a real partition (a new
    connection fails at once with EINVAL). They start no process (one
    rtnetlink message each): a test may call them while a daemon it stopped
    holds a FUSE request of the test's, when any fork would hang (the child
    closes the test's open files on that mount, and each close waits for
    the stopped daemon's answer to FLUSH);
  * :meth:`Network.isolate` / :meth:`Network.rejoin`: the node's port on the
    bridge down, so it reaches nobody (a new connection fails once ARP has
    given up, about 1 s).

Teardown, also after a failure: every process still in a namespace of the
network is killed (by its pid, from ``ip netns pids``: only the test's own
processes are in them), then every namespace is deleted, which deletes its
links. :func:`leftovers` names what a run left (a test checks it is nothing).
"""

from __future__ import annotations

import ctypes
import itertools
import os
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")

SUBNET = "10.77.0"  # /24, inside the run's own namespaces only
CLONE_NEWNET = 0x40000000
KILL_WAIT = 10.0  # seconds a killed process may take to go

_libc = ctypes.CDLL(None, use_errno=True)
_counter = itertools.count()


def unavailable() -> str | None:
    """Why network namespaces cannot be used here, or None if they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "network namespaces need iproute2's ip"
    probe = f"capsulefs-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add fails here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def run_tag() -> str:
    """A name part no other run (and no other network of this run) uses."""
    return f"{os.getpid()}-{next(_counter)}"


def leftovers(tag: str) -> list[str]:
    """Namespaces of the network tagged ``tag`` that still exist."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.split() and f"-{tag}-" in line.split()[0]]


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise AssertionError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def _setns(ns: str) -> None:
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {ns}: {os.strerror(err)}")
    finally:
        os.close(fd)


class Node:
    """One namespace on the network: its name, address and bridge port."""

    def __init__(self, network: Network, name: str, index: int) -> None:
        self.network, self.name = network, name
        self.ns = f"capsulefs-{network.tag}-{name}"
        self.address = f"{SUBNET}.{index}"
        self.port = f"p{index}"  # its veth's end on the bridge (in the hub)

    def call(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` in a thread inside this node's network namespace."""
        box: list[T] = []
        errors: list[BaseException] = []

        def run() -> None:
            try:
                _setns(self.ns)
                box.append(fn(*args))
            except BaseException as exc:  # (handed to the caller)
                errors.append(exc)

        t = threading.Thread(target=run, name=f"netns {self.name}")
        t.start()
        t.join()
        if errors:
            raise errors[0]
        return box[0]

    def popen(self, argv: list[str], **kwargs: object) -> subprocess.Popen:
        """A process started in this node's network namespace."""
        return self.call(lambda: subprocess.Popen(argv, **kwargs))  # type: ignore[call-overload]

    def __repr__(self) -> str:
        return f"Node({self.name} {self.address})"


class Network:
    """Nodes on one bridge; partitions made and healed by the test."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.hub = f"capsulefs-{tag}-hub"
        self.nodes: dict[str, Node] = {}
        self.cuts: set[frozenset[str]] = set()
        self._made: list[str] = []

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")

    def open(self) -> None:
        self._add_ns(self.hub)
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "up")

    def add(self, name: str) -> Node:
        node = Node(self, name, len(self.nodes) + 1)
        self._add_ns(node.ns)
        _ip("link", "add", "eth0", "netns", node.ns, "type", "veth", "peer", "name", node.port, "netns", self.hub)
        _ip("-n", self.hub, "link", "set", node.port, "master", "br0", "up")
        _ip("-n", node.ns, "addr", "add", f"{node.address}/24", "dev", "eth0")
        _ip("-n", node.ns, "link", "set", "eth0", "up")
        self.nodes[name] = node
        return node

    def partition(self, a: Node, b: Node) -> None:
        """Nothing passes between ``a`` and ``b`` from now on (each still reaches the others)."""
        a.call(_blackhole, RTM_NEWROUTE, b.address)
        b.call(_blackhole, RTM_NEWROUTE, a.address)
        self.cuts.add(frozenset((a.name, b.name)))

    def heal(self, a: Node, b: Node) -> None:
        a.call(_blackhole, RTM_DELROUTE, b.address)
        b.call(_blackhole, RTM_DELROUTE, a.address)
        self.cuts.discard(frozenset((a.name, b.name)))

    def isolate(self, node: Node) -> None:
        """``node`` reaches nobody: its port on the bridge is down."""
        _ip("-n", self.hub, "link", "set", node.port, "down")

    def rejoin(self, node: Node) -> None:
        _ip("-n", self.hub, "link", "set", node.port, "up")

    def close(self) -> None:
        """Kill every process still in a namespace of this network, then delete the namespaces."""
        pids = {pid for ns in self._made for pid in _ns_pids(ns)} - {os.getpid()}
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + KILL_WAIT
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.02)
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()


# rtnetlink (linux/rtnetlink.h): a blackhole route added or deleted with one message, no process started.
RTM_NEWROUTE, RTM_DELROUTE = 24, 25
_NLM_F_REQUEST, _NLM_F_ACK, _NLM_F_EXCL, _NLM_F_CREATE = 0x1, 0x4, 0x200, 0x400
_NLMSG_ERROR = 2
_RT_TABLE_MAIN, _RTPROT_BOOT, _RT_SCOPE_UNIVERSE, _RTN_BLACKHOLE, _RTA_DST = 254, 3, 0, 6, 1


def _blackhole(op: int, address: str) -> None:
    """Add (RTM_NEWROUTE) or delete (RTM_DELROUTE) a blackhole route to
    ``address``/32 in the calling thread's network namespace."""
    rtmsg = struct.pack("=BBBBBBBBI", socket.AF_INET, 32, 0, 0, _RT_TABLE_MAIN, _RTPROT_BOOT, _RT_SCOPE_UNIVERSE,
                        _RTN_BLACKHOLE, 0)
    dst = struct.pack("=HH", 8, _RTA_DST) + socket.inet_aton(address)
    flags = _NLM_F_REQUEST | _NLM_F_ACK | (_NLM_F_CREATE | _NLM_F_EXCL if op == RTM_NEWROUTE else 0)
    body = rtmsg + dst
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as s:
        s.bind((0, 0))
        s.send(struct.pack("=IHHII", 16 + len(body), op, flags, 1, 0) + body)
        reply = s.recv(65536)
    _len, kind, _flags, _seq, _pid = struct.unpack_from("=IHHII", reply)
    if kind != _NLMSG_ERROR:
        raise AssertionError(f"rtnetlink answered message type {kind}, not an acknowledgement")
    (error,) = struct.unpack_from("=i", reply, 16)
    if error:
        what = "add" if op == RTM_NEWROUTE else "delete"
        raise OSError(-error, f"{what} a blackhole route to {address}: {os.strerror(-error)}")


def _ns_pids(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


@contextmanager
def open_network(*names: str, tag: str | None = None) -> Iterator[Network]:
    """A network with one node per name; everything it made is gone on exit, whatever happened."""
    net = Network(tag or run_tag())
    try:
        net.open()
        for name in names:
            net.add(name)
        yield net
    finally:
        net.close()
