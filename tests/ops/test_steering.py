"""A spec or grant change restarts a running agent at its step boundary (supervisor + steering, real processes)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import trio

from capsulefs.agents import grants
from capsulefs.agents.steering import Steering, spec_digest
from capsulefs.agents.supervisor import RunState, Supervisor
from capsulefs.core.capsule import format as fmt
from capsulefs.core.capsule.spec import default_spec, spec_bytes
from capsulefs.core.journal.events import Event, Note
from capsulefs.core.store.host_store import HostStore
from supervisor_kit import StoreHooks, agent_with_spec, wait_for

#: SIGTERM: "IGN" ignores it (only the grace period's SIGKILL ends it); "EXIT"
#: ends the process with status 0 at its step boundary, as the reference agent does.
AGENT = ("import os, signal, sys, time\nsignal.signal(signal.SIGTERM, {handler})\n"
         "open(f'ready-{{os.getpid()}}', 'w').close()\nwhile True: time.sleep(1)")
HANDLERS = {"ignores SIGTERM": ("signal.SIG_IGN", -9), "exits 0 on SIGTERM": ("lambda *a: sys.exit(0)", 0)}


class _Live:
    """The journal seam of the runtime (steering.Runtime.live): what it appended."""

    def __init__(self) -> None:
        self.appended: list[Event] = []

    def agent(self, agent_id: str) -> "_Live":
        return self

    def append(self, events: list[Event]) -> None:
        self.appended.extend(events)


class _Runtime:
    def __init__(self, sup: Supervisor, store: HostStore, hooks: StoreHooks) -> None:
        self.supervisor, self.store, self.live, self.spec = sup, store, _Live(), hooks.spec


@pytest.mark.parametrize("how", sorted(HANDLERS))
async def test_a_spec_change_restarts_the_agent_at_once_and_not_as_a_crash(store: HostStore, tmp_path: Path,
                                                                           how: str) -> None:
    """Also one that exits 0 when asked to stop (the reference agent): a
    finished agent is not restarted, a restarted one is."""
    handler, exit_status = HANDLERS[how]
    spec = default_spec([sys.executable, "-c", AGENT.format(handler=handler)])
    spec["secrets"] = ["TOKEN"]
    agent = agent_with_spec(store, spec)
    from capsulefs.agents import keychain

    keychain.store_secret(store.root, "TOKEN", "t")
    hooks = StoreHooks(store, str(tmp_path / "mnt"))
    sup = Supervisor(store.root, hooks, grace=0.5)
    rt = _Runtime(sup, store, hooks)
    steer = Steering(rt, store.root)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.serve)
        sup.want(agent.agent_id)
        await wait_for(lambda: sup.status(agent.agent_id).state is RunState.RUNNING, "the agent to run")
        first = sup.status(agent.agent_id).pid
        ready = Path(sup.sandbox(agent.agent_id)) / f"ready-{first}"
        await wait_for(ready.exists, "the agent to handle SIGTERM")
        assert sup.running_specs() == [(agent.agent_id, spec_digest(spec), ["TOKEN"])]
        steer.check()
        assert rt.live.appended == []  # nothing changed: nothing done

        spec["env"] = {"MODE": "new"}
        agent.write_files({fmt.SPEC: spec_bytes(spec)})
        steer.check()
        (note,) = rt.live.appended
        assert isinstance(note, Note) and "its spec changed" in note.text and spec_digest(spec) in note.text
        await wait_for(lambda: sup.status(agent.agent_id).state is RunState.RUNNING
                       and sup.status(agent.agent_id).pid not in (None, first), "the agent to run again")
        st = sup.status(agent.agent_id)
        assert st.spec_digest == spec_digest(spec) and st.restarts == 1 and st.last_exit == exit_status
        assert sup.last_error(agent.agent_id) is None  # not a crash
        with open(f"/proc/{st.pid}/environ", "rb") as f:
            assert b"MODE=new" in f.read().split(b"\0")

        grants.revoke(store.root, agent.agent_id, ["TOKEN"])
        steer.check()
        assert "TOKEN no longer granted" in rt.live.appended[-1].text
        await wait_for(lambda: sup.status(agent.agent_id).state is RunState.BLOCKED, "blocked without its grant")
        assert "capsulefs secret grant" in sup.last_error(agent.agent_id).fix
        nursery.cancel_scope.cancel()
    for pid in (first, st.pid):
        assert not os.path.exists(f"/proc/{pid}") or b") Z" in Path(f"/proc/{pid}/stat").read_bytes()
