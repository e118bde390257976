"""``.control/move`` and ``.control/abandon`` through ``Operations``, without a kernel.

The mover is a fake: these tests check the adapter's part only (input
checks, the errno of each outcome, waiting without holding up other
requests, mkdir's holder hook). Real moves: tests/daemons/test_move_daemons.py.
"""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import trio
import trio.testing

from capsulefs.core.move.cause import Cause
from capsulefs.core.view import errors as le
from capsulefs.core.errors import FormatError
from capsulefs.core.view.nodes import CONTROL
from capsulefs.core.store.host_store import HostStore
from capsulefs.mount.ops import Operations
from helpers import make_agent
from ops_kit import Client, FakeKernel, errno_of, make_live


class FakeMover:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []
        self.fail: Exception | None = None
        self.gate: trio.Event | None = None

    async def move(self, agent_id: str, target: str) -> None:
        self.calls.append(("move", agent_id, target))
        if target != "laptop":
            raise FormatError(f"{target!r} is not a known peer")
        if self.gate is not None:
            await self.gate.wait()
        if self.fail is not None:
            raise self.fail

    async def abandon(self, agent_id: str, why: str) -> None:
        self.calls.append(("abandon", agent_id, why))


@pytest.fixture
def mover() -> FakeMover:
    return FakeMover()


class FakeRemover:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.fail: Exception | None = None

    async def remove(self, agent_id: str) -> None:
        self.calls.append(agent_id)
        if self.fail is not None:
            raise self.fail


class NewAgentsSeen:
    def __init__(self) -> None:
        self.made: list[tuple[str, int]] = []

    def created(self, agent_id: str, epoch: int) -> None:
        self.made.append((agent_id, epoch))


@pytest.fixture
def remover() -> FakeRemover:
    return FakeRemover()


@pytest.fixture
def made() -> NewAgentsSeen:
    return NewAgentsSeen()


@pytest.fixture
def c(store: HostStore, tmp_path: Path, mover: FakeMover, remover: FakeRemover, made: NewAgentsSeen) -> Client:
    make_agent(store, "alice")
    from ops_kit import _reply
    live = make_live(store, tmp_path / "work", mover=mover, remover=remover, new_agents=made)
    return Client(Operations(live, kernel=FakeKernel(), readdir_reply=_reply, uid=0, gid=0))


MOVE = f"alice/{CONTROL}/move"


async def test_one_line_naming_a_peer_is_passed_on(c: Client, mover: FakeMover) -> None:
    await c.write(MOVE, b"laptop\n")
    await c.write(f"alice/{CONTROL}/abandon", b"the target burned down\n")
    agent_id = json.loads(await c.read(f"alice/{CONTROL}/status"))["agent_id"]
    assert mover.calls == [("move", agent_id, "laptop"), ("abandon", agent_id, "the target burned down")]
    assert json.loads(await c.read(f"alice/{CONTROL}/status"))["move"] == {"available": True, "phase": "idle"}


@pytest.mark.parametrize("data", [b"\n", b"a\nb\n", b"\xff\n", b"x" * 2000, b"a\tb\n", b"laptop\n\n", b"\nlaptop\n",
                                  b"lap\rtop\n", b"laptop\x7f\n", "laptop\x85\n".encode()])
async def test_bad_input_is_einval_and_reaches_no_mover(c: Client, mover: FakeMover, data: bytes) -> None:
    assert await errno_of(c.write(MOVE, data)) == errno.EINVAL
    assert mover.calls == []


async def test_an_unknown_peer_is_einval(c: Client, mover: FakeMover) -> None:
    assert await errno_of(c.write(MOVE, b"nowhere\n")) == errno.EINVAL


@pytest.mark.parametrize(("error", "code"), [
    (le.MoveBusy("why"), errno.EBUSY),
    (le.MoveFailed(Cause.UNREACHABLE, "why"), errno.EHOSTUNREACH),
    (le.MoveFailed(Cause.CONNECTION_REFUSED, "why"), errno.ECONNREFUSED),
    (le.MoveFailed(Cause.REFUSED, "why"), errno.EPERM),
    (le.MoveFailed(Cause.STALE, "why"), errno.EEXIST),
    (le.MoveFailed(Cause.CORRUPT, "why"), errno.EIO),
    (le.MoveFailed(Cause.TIMEOUT, "why"), errno.ETIMEDOUT),
    (le.MoveFailed(Cause.ABANDONED, "why"), errno.ECANCELED),
])
async def test_each_outcome_has_its_errno(c: Client, mover: FakeMover, error: Exception, code: int) -> None:
    mover.fail = error
    assert await errno_of(c.write(MOVE, b"laptop\n")) == code


def test_every_cause_has_its_errno_and_its_meaning() -> None:
    """One vocabulary: each face's table names every cause a failed move can have."""
    from capsulefs.core.move.cause import MEANING
    from capsulefs.mount.errors import MOVE_ERRNO

    assert set(MEANING) == set(Cause)
    assert set(MOVE_ERRNO) == set(Cause) - {Cause.MOVED}


async def test_a_waiting_move_holds_up_no_other_request(c: Client, mover: FakeMover) -> None:
    mover.gate = trio.Event()
    done = trio.Event()

    async def write() -> None:
        await c.write(MOVE, b"laptop\n")
        done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(write)
        await trio.testing.wait_all_tasks_blocked()
        assert not done.is_set()
        assert json.loads(await c.read(f"alice/{CONTROL}/status"))["name"] == "alice"  # served meanwhile
        mover.gate.set()
    assert done.is_set()


async def test_mkdir_tells_who_records_the_holder(c: Client, made: NewAgentsSeen) -> None:
    await c.mkdir("bob")
    assert made.made == [(json.loads(await c.read(f"bob/{CONTROL}/status"))["agent_id"], 1)]


# -- .control/remove ---------------------------------------------------------------------

REMOVE = f"alice/{CONTROL}/remove"




async def _agent_id(c: Client) -> str:
    return json.loads(await c.read(f"alice/{CONTROL}/status"))["agent_id"]


async def test_remove_takes_exactly_the_agents_id(c: Client, remover: FakeRemover) -> None:
    agent_id = await _agent_id(c)
    await c.write(REMOVE, agent_id.encode() + b"\n")
    assert remover.calls == [agent_id]


@pytest.mark.parametrize("data", [b"\n", b"yes\n", b"alice\n", b"ALICE-ID\n", b"x" * 2000])
async def test_remove_refuses_anything_but_the_id_with_einval(c: Client, remover: FakeRemover, data: bytes) -> None:
    assert await errno_of(c.write(REMOVE, data)) == errno.EINVAL
    agent_id = await _agent_id(c)
    assert await errno_of(c.write(REMOVE, agent_id.upper().encode() + b"\n")) == errno.EINVAL
    assert await errno_of(c.write(REMOVE, (agent_id + " " + agent_id).encode() + b"\n")) == errno.EINVAL
    assert remover.calls == []


async def test_remove_takes_the_id_without_a_newline_too(c: Client, remover: FakeRemover) -> None:
    agent_id = await _agent_id(c)
    await c.write(REMOVE, agent_id.encode())  # (printf ID > remove)
    assert remover.calls == [agent_id]


@pytest.mark.parametrize("around", [(b"", b" \n"), (b" ", b"\n"), (b"", b"\t\n"), (b"", b" "), (b"", b"\n\n"),
                                    (b"\n", b"\n"), (b"", b"\r\n"), (b"", "\u00a0\n".encode())])
async def test_remove_takes_exactly_the_id_and_nothing_around_it(c: Client, remover: FakeRemover,
                                                                 around: tuple[bytes, bytes]) -> None:
    """Exactly the id, as docs/mount.md says: a trailing newline (as echo
    writes) is the one thing allowed beside it, not a space (issue 25)."""
    agent_id = await _agent_id(c)
    assert await errno_of(c.write(REMOVE, around[0] + agent_id.encode() + around[1])) == errno.EINVAL
    assert remover.calls == []


@pytest.mark.parametrize(("error", "code"), [(le.MoveBusy, errno.EBUSY), (le.ReadOnly, errno.EROFS)])
async def test_a_refused_removal_has_its_errno(c: Client, remover: FakeRemover, error: type[Exception],
                                              code: int) -> None:
    remover.fail = error("why")
    assert await errno_of(c.write(REMOVE, (await _agent_id(c)).encode() + b"\n")) == code


async def test_remove_without_a_remover_is_eopnotsupp(store: HostStore, tmp_path: Path) -> None:
    from ops_kit import _reply
    make_agent(store, "alice")
    c = Client(Operations(make_live(store, tmp_path / "work"), kernel=FakeKernel(), readdir_reply=_reply, uid=0, gid=0))
    assert await errno_of(c.write(REMOVE, (await _agent_id(c)).encode() + b"\n")) == errno.EOPNOTSUPP
