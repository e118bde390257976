"""Supervision with real processes: env and secrets, sandbox, restarts, freeze."""

from __future__ import annotations

import copy
import json
import logging
import os
import sys
from pathlib import Path

import pytest
import trio
import trio.testing

from capsulefs.agents import grants, keychain
from capsulefs.core.capsule import format as fmt
from capsulefs.core.capsule import workspace
from capsulefs.core.capsule.spec import default_spec
from capsulefs.core.store.host_store import HostStore
from capsulefs.agents.supervisor import RunState, RunStatus, Supervisor

from helpers import HANG, make_agent, wait_until
from supervisor_kit import StoreHooks, agent_with_spec, wait_for
from capsulefs.core.store import layout

PROBE = r"""
import json, os, signal, sys, time
if len(sys.argv) > 1 and sys.argv[1] == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # (before it says it is ready)
out = {"cwd": os.getcwd(), "env": {k: os.environ.get(k) for k in ("CAPSULE_DIR", "GREETING", "API_TOKEN", "DEPLOY_KEY", "HOME")},
       "files": sorted(os.listdir("."))}
with open("probe.json", "w") as f:
    json.dump(out, f)
with open("made-by-agent.txt", "w") as f:
    f.write("new work\n")
print("ready", flush=True)
while True:
    time.sleep(1)  # (pacing: the agent idles until it is stopped)
"""


def _home(sup: Supervisor, agent_id: str) -> str:
    """The agent's HOME: a directory of its own beside its workspace when it
    runs isolated (as root), else the sandbox's directory (as before)."""
    if sup.isolation.enabled:
        return sup.isolation.home(agent_id)
    return os.path.dirname(sup.sandbox(agent_id))


async def _serve_and_start(sup: Supervisor, nursery: trio.Nursery, agent_id: str) -> int:
    """Serve ``sup`` in ``nursery``, run the agent, wait for its probe; its pid."""
    await nursery.start(sup.serve)
    sup.want(agent_id)
    probe = Path(sup.sandbox(agent_id)) / "probe.json"
    await wait_for(lambda: probe.exists() and probe.stat().st_size > 0, "the agent process to start")
    return sup.status(agent_id).pid


async def test_agent_runs_in_its_sandbox_with_env_and_secrets(store: HostStore, tmp_path: Path, caplog) -> None:
    spec = default_spec([sys.executable, "-c", PROBE])
    spec["env"] = {"GREETING": "hello"}
    spec["secrets"] = ["API_TOKEN"]
    agent = agent_with_spec(store, spec)
    keychain.store_secret(store.root, "API_TOKEN", "s3cr3t-value")
    hooks = StoreHooks(store, str(tmp_path / "mnt"))
    sup = Supervisor(store.root, hooks, grace=5)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.serve)
        sup.want(agent.agent_id)
        probe = Path(sup.sandbox(agent.agent_id)) / "probe.json"
        await wait_for(probe.exists, "the agent process to start")
        await wait_for(lambda: probe.stat().st_size > 0, "probe output")
        seen = json.loads(probe.read_text())
        assert sup.status(agent.agent_id).state is RunState.RUNNING
        pid = sup.status(agent.agent_id).pid
        assert seen["cwd"] == sup.sandbox(agent.agent_id)
        assert seen["files"] == ["notes"]  # the workspace came from the snapshot
        assert seen["env"] == {"CAPSULE_DIR": str(tmp_path / "mnt" / "runner"), "GREETING": "hello",
                               "API_TOKEN": "s3cr3t-value", "DEPLOY_KEY": None, "HOME": _home(sup, agent.agent_id)}
        await sup.freeze(agent.agent_id)
        assert sup.status(agent.agent_id).state is RunState.FROZEN
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        nursery.cancel_scope.cancel()
    # Freezing synced the agent's new files into the capsule.
    snap = hooks.snapshot(agent.agent_id)
    assert store.read_blob(snap["made-by-agent.txt"]) == b"new work\n"
    assert "probe.json" in snap and snap["notes/todo.txt"]
    assert "s3cr3t-value" not in caplog.text
    for f in Path(agent.dir).rglob("*"):
        if f.is_file():
            assert b"s3cr3t-value" not in f.read_bytes()
    assert oct(os.stat(os.path.join(store.root, layout.SECRETS_FILE)).st_mode & 0o777) == "0o600"


async def test_crash_is_restarted_with_backoff(store: HostStore, tmp_path: Path, autojump_clock) -> None:
    st = await _failed(store, tmp_path, default_spec([sys.executable, "-c", "import sys; sys.exit(3)"]), starts=4)
    assert st.last_exit == 3
    assert "exited with status 3" in st.detail
    assert st.next_start_in is not None and st.next_start_in >= 8  # 1, 2, 4, 8...


async def test_stubborn_process_is_killed_after_the_grace_period(store: HostStore, tmp_path: Path, caplog) -> None:
    spec = default_spec([sys.executable, "-c", PROBE, "stubborn"])
    agent = agent_with_spec(store, spec)
    sup = Supervisor(store.root, StoreHooks(store, str(tmp_path)), grace=0.5)
    async with trio.open_nursery() as nursery:
        pid = await _serve_and_start(sup, nursery, agent.agent_id)
        await sup.unwant(agent.agent_id)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        nursery.cancel_scope.cancel()
    assert "ignored SIGTERM for 0 s; killing it" in caplog.text  # killed by the grace period's end


async def test_stop_all_stops_every_agent_and_starts_none_again(store: HostStore, tmp_path: Path) -> None:
    spec = default_spec([sys.executable, "-c", PROBE])
    agent = agent_with_spec(store, spec)
    sup = Supervisor(store.root, StoreHooks(store, str(tmp_path)), grace=10 * HANG)
    async with trio.open_nursery() as nursery:
        pid = await _serve_and_start(sup, nursery, agent.agent_id)
        with trio.fail_after(HANG):  # SIGTERM suffices: well within the (long) grace period
            await sup.stop_all()
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        assert sup.status(agent.agent_id).state is RunState.STOPPED
        sup.want(agent.agent_id)  # the runtime's reconcile loop, during the shutdown
        await trio.sleep(0.3)  # kept: a window in which no process may start (an absence has no event to wait for;
        # wait_all_tasks_blocked is not one: a runner blocks in a thread before its state changes)
        assert sup.status(agent.agent_id).state is RunState.STOPPED and sup.status(agent.agent_id).pid is None
        nursery.cancel_scope.cancel()


async def test_an_agent_wanted_just_before_stop_all_never_starts(store: HostStore, tmp_path: Path) -> None:
    # The runtime's reconcile may want an agent in the same step as the stop
    # signal: its runner exists, its task has not run yet. stop_all must not
    # wait on it, and it must not start the process after all.
    # (trio shuffles each batch of runnable tasks: which of the runner and
    # the stop runs first varies, so try it many times.)
    spec = default_spec([sys.executable, "-c", PROBE])
    agent = agent_with_spec(store, spec)
    for _ in range(24):
        sup = Supervisor(store.root, StoreHooks(store, str(tmp_path)), grace=10 * HANG)
        async with trio.open_nursery() as nursery:
            await nursery.start(sup.serve)
            sup.want(agent.agent_id)
            with trio.fail_after(HANG):  # (no grace period waited: nothing started)
                await sup.stop_all()
            assert sup.status(agent.agent_id).pid is None
            nursery.cancel_scope.cancel()
    assert not (Path(sup.sandbox(agent.agent_id)) / "probe.json").exists()  # no run ever got that far


async def test_an_agent_unwanted_before_its_runner_ran_never_starts(store: HostStore, tmp_path: Path, caplog) -> None:
    # A freeze (a move) or a removal right after the reconcile loop wanted it.
    spec = default_spec([sys.executable, "-c", PROBE])
    agent = agent_with_spec(store, spec)
    sup = Supervisor(store.root, StoreHooks(store, str(tmp_path)), grace=10 * HANG)
    caplog.set_level(logging.INFO, logger="capsulefs.agents.supervisor")
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.serve)
        for _ in range(10):
            sup.want(agent.agent_id)
            with trio.fail_after(HANG):  # (no grace period waited: nothing started)
                await sup.unwant(agent.agent_id, sync=False)
        nursery.cancel_scope.cancel()
    assert "started as pid" not in caplog.text


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


DAEMON_LIKE = r"""
import json, sys, trio
sys.path.insert(0, sys.argv[3])
from supervisor_kit import StoreHooks
from capsulefs.core.store.host_store import HostStore
from capsulefs.agents.supervisor import Supervisor

async def main():
    store = HostStore.open(sys.argv[1])
    sup = Supervisor(store.root, StoreHooks(store, "/nonexistent"))
    async with trio.open_nursery() as n:
        await n.start(sup.serve)
        sup.want(sys.argv[2])
        while sup.status(sys.argv[2]).pid is None:
            await trio.sleep(0.01)
        print(sup.status(sys.argv[2]).pid, flush=True)
        await trio.sleep_forever()

trio.run(main)
"""


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_agents_die_with_a_killed_daemon_and_leftovers_are_reaped(store: HostStore, tmp_path: Path) -> None:
    import signal
    import subprocess

    spec = default_spec([sys.executable, "-c", PROBE])
    agent = agent_with_spec(store, spec)
    tests_dir = str(Path(__file__).parents[1])  # (its kits)
    with subprocess.Popen([sys.executable, "-c", DAEMON_LIKE, store.root, agent.agent_id, tests_dir],
                          stdout=subprocess.PIPE, text=True) as daemon:
        pid = int(daemon.stdout.readline())
        os.kill(pid, 0)  # the agent runs
        daemon.send_signal(signal.SIGKILL)
        daemon.wait()
    wait_until(lambda: not _exists(pid), "the agent to go with its killed daemon (PDEATHSIG)")

    # A leftover pid file is reaped only if the process is that agent's.
    with subprocess.Popen(["sleep", "60"], env={"CAPSULE_AGENT_ID": agent.agent_id}, start_new_session=True) as mine, \
            subprocess.Popen(["sleep", "60"], start_new_session=True) as stranger:
        sup = Supervisor(store.root, StoreHooks(store, str(tmp_path)))
        Path(sup._pidfile(agent.agent_id)).write_text(f"{mine.pid}\n")
        other = Path(sup.sandbox_root) / ("f" * 32)
        other.mkdir()
        (other / "pid").write_text(f"{stranger.pid}\n")
        assert sup.reap_orphans() == [mine.pid]
        assert mine.wait(timeout=HANG) == -signal.SIGKILL
        assert stranger.poll() is None
        stranger.kill()


FORKING_AGENT = r"""
import os, subprocess, sys, time
child = subprocess.Popen(["sleep", "300"])  # a tool: same process group, same env
with open("child.pid", "w") as f:
    f.write(str(child.pid))
print("ready", flush=True)
while True:
    time.sleep(1)  # (pacing: the agent idles until it is stopped)
"""


def test_a_restarted_daemon_reaps_the_tools_of_an_agent_its_killed_daemon_left(store: HostStore, tmp_path: Path) -> None:
    """The daemon is SIGKILLed: PDEATHSIG takes the agent (the group's leader)
    but not its tool subprocesses. Before, the next daemon's reap looked only
    at the leader, found it gone, and left the tools running for ever."""
    import signal
    import subprocess

    agent = agent_with_spec(store, default_spec([sys.executable, "-c", FORKING_AGENT]))
    tests_dir = str(Path(__file__).parents[1])  # (its kits)
    with subprocess.Popen([sys.executable, "-c", DAEMON_LIKE, store.root, agent.agent_id, tests_dir],
                          stdout=subprocess.PIPE, text=True) as daemon:
        leader = int(daemon.stdout.readline())
        sup = Supervisor(store.root, StoreHooks(store, str(tmp_path)))
        child_pid_file = Path(sup.sandbox(agent.agent_id)) / "child.pid"
        wait_until(lambda: child_pid_file.exists() and child_pid_file.read_text(), "the agent's tool")
        child = int(child_pid_file.read_text())
        daemon.send_signal(signal.SIGKILL)
        daemon.wait()
    wait_until(lambda: not os.path.exists(f"/proc/{leader}"), "the leader to go with its daemon (PDEATHSIG)")
    try:
        assert os.path.exists(f"/proc/{child}")  # the tool outlived it
        assert sup.reap_orphans() == [leader]
        wait_until(lambda: not os.path.exists(f"/proc/{child}") or Path(f"/proc/{child}/stat").read_text().split()[2] == "Z",
                   "the agent's tool to go with the reap")
    finally:
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass


CRASHING_FORKER = r"""
import subprocess, sys
child = subprocess.Popen(["sleep", "300"])  # a tool still running when the agent crashes
with open("child-%d.pid" % child.pid, "w") as f:
    f.write(str(child.pid))
sys.exit(3)
"""


async def test_the_tools_of_an_agent_that_exits_go_with_it(store: HostStore, tmp_path: Path) -> None:
    """An agent that crashes (or finishes) while a tool it started still
    runs: before, the tool was left running, outside any supervision (the
    restart's new process group replaced it in the pid file, and the
    daemon's stop never reached it); now it goes with its agent."""
    agent = agent_with_spec(store, default_spec([sys.executable, "-c", CRASHING_FORKER]))
    sup = Supervisor(store.root, StoreHooks(store, str(tmp_path)))
    sandbox = Path(sup.sandbox(agent.agent_id))
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(sup.serve)
            sup.want(agent.agent_id)
            await wait_for(lambda: sup.status(agent.agent_id).last_exit == 3, "the agent to crash")
            [tool] = [int(p.read_text()) for p in sandbox.glob("child-*.pid")]
            await wait_for(lambda: not os.path.exists(f"/proc/{tool}")
                            or Path(f"/proc/{tool}/stat").read_text().split()[2] == "Z", "the tool to go")
            nursery.cancel_scope.cancel()
    finally:
        for p in sandbox.glob("child-*.pid"):
            try:
                os.kill(int(p.read_text()), 9)
            except ProcessLookupError:
                pass


async def _blocked(store: HostStore, tmp_path: Path, nursery: trio.Nursery, agent_id: str) -> Supervisor:
    """A supervisor serving in ``nursery`` that was asked to run the agent
    and found it cannot (its status says BLOCKED)."""
    sup = Supervisor(store.root, StoreHooks(store, str(tmp_path)))
    await nursery.start(sup.serve)
    sup.want(agent_id)
    await wait_for(lambda: sup.status(agent_id).state is RunState.BLOCKED, "blocked state")
    return sup


async def test_a_missing_secret_blocks_the_start_until_it_is_set(
        store: HostStore, tmp_path: Path, autojump_clock, caplog) -> None:
    """A missing secret blocks the start, and the status names it. The status
    says to set it with 'capsulefs secret set'; before, doing so changed
    nothing until the daemon restarted (a blocked agent was never tried
    again). Now it starts within seconds, and the wait is logged once, not
    at every try."""
    spec = default_spec([sys.executable, "-c", PROBE])
    spec["secrets"] = ["API_TOKEN"]
    agent = agent_with_spec(store, spec)
    async with trio.open_nursery() as nursery:
        sup = await _blocked(store, tmp_path, nursery, agent.agent_id)
        assert "API_TOKEN" in sup.status(agent.agent_id).detail
        assert sup.status(agent.agent_id).pid is None
        await trio.sleep(600)
        assert not os.path.exists(Path(sup.sandbox(agent.agent_id)) / "probe.json")
        keychain.store_secret(store.root, "API_TOKEN", "now-set")
        await wait_for(lambda: sup.status(agent.agent_id).state is RunState.RUNNING, "the agent to start")
        nursery.cancel_scope.cancel()
    assert caplog.text.count("not started") == 1


async def test_a_secret_the_host_did_not_grant_is_never_given(store: HostStore, tmp_path: Path, autojump_clock) -> None:
    """A spec only asks: an agent that arrived by a move or a tar could name
    any secret of this host's keychain. Without a grant it does not start,
    its status says which grant is missing and how to give it; once given,
    it starts without a restart, and a revoke keeps the next start from it."""
    spec = default_spec([sys.executable, "-c", PROBE])
    spec["secrets"] = ["API_TOKEN", "DEPLOY_KEY"]
    agent = agent_with_spec(store, spec, granted=False)
    keychain.store_secret(store.root, "API_TOKEN", "s3cr3t-value")
    keychain.store_secret(store.root, "DEPLOY_KEY", "d3pl0y-value")
    grants.grant(store.root, agent.agent_id, ["API_TOKEN"])
    async with trio.open_nursery() as nursery:
        sup = await _blocked(store, tmp_path, nursery, agent.agent_id)
        detail = sup.status(agent.agent_id).detail
        assert "DEPLOY_KEY" in detail and "API_TOKEN" not in detail
        assert f"capsulefs secret grant {agent.agent_id} DEPLOY_KEY" in detail
        await trio.sleep(60)
        probe = Path(sup.sandbox(agent.agent_id)) / "probe.json"
        assert not probe.exists()
        grants.grant(store.root, agent.agent_id, ["DEPLOY_KEY"])
        await wait_for(lambda: probe.exists() and probe.stat().st_size > 0, "the agent to start")
        assert json.loads(probe.read_text())["env"]["DEPLOY_KEY"] == "d3pl0y-value"
        nursery.cancel_scope.cancel()
    assert grants.revoke(store.root, agent.agent_id, ["DEPLOY_KEY"]) == ["API_TOKEN"]
    with pytest.raises(grants.UngrantedSecret, match="DEPLOY_KEY"):
        grants.check(store.root, agent.agent_id, spec["secrets"])


async def test_the_status_of_a_crashed_agent_names_no_dead_pid(store: HostStore, tmp_path: Path, autojump_clock) -> None:
    """Waiting to restart, the status showed the pid of the process that had
    exited (a pid the system may give to another process)."""
    agent = agent_with_spec(store, default_spec([sys.executable, "-c", "import sys; sys.exit(3)"]))
    sup = Supervisor(store.root, StoreHooks(store, str(tmp_path)))
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.serve)
        sup.want(agent.agent_id)
        await wait_for(lambda: sup.status(agent.agent_id).last_exit == 3, "the crash")
        st = sup.status(agent.agent_id)
        assert (st.state, st.pid) == (RunState.BACKOFF, None)
        nursery.cancel_scope.cancel()


async def test_an_entrypoint_that_cannot_start_says_why(store: HostStore, tmp_path: Path, autojump_clock) -> None:
    """A spec whose entrypoint does not exist: the status said 'the
    entrypoint exited with status 127', hiding the reason."""
    detail = (await _failed(store, tmp_path, default_spec(["/nonexistent/agent-binary"]))).detail
    assert "/nonexistent/agent-binary could not start: No such file or directory" in detail, detail
    assert "restarting in" in detail


async def test_a_crash_after_a_healthy_run_waits_the_first_delay_again(
        store: HostStore, tmp_path: Path, autojump_clock) -> None:
    """Crashes build the restart delay up (1, 2, 4, 8 s...). Before, it never
    came down: an agent that then ran well for days still waited the long
    delay after its next crash. A run that lasted long enough starts it over."""
    script = ("import os, sys, time\n"
              "n = len([f for f in os.listdir('.') if f.startswith('run')])\n"
              "open(f'run{n}', 'w').close()\n"
              "if n == 4: time.sleep(1.0)  # the fifth run: a healthy one (here, a second)\n"
              "sys.exit(3)\n")
    st = await _failed(store, tmp_path, default_spec([sys.executable, "-c", script]), starts=5, healthy=0.5)
    assert st.next_start_in == 1  # not 16


async def _failed(store: HostStore, tmp_path: Path, spec: dict, *, starts: int = 1, healthy: float = 60.0) -> RunStatus:
    """A copy of the status of an agent of ``spec`` once ``starts`` of its
    starts have failed (it waits to try again)."""
    agent = agent_with_spec(store, spec)
    sup = Supervisor(store.root, StoreHooks(store, str(tmp_path)), healthy=healthy)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.serve)
        sup.want(agent.agent_id)
        await wait_for(lambda: sup.status(agent.agent_id).restarts >= starts, "failed starts")
        st = copy.copy(sup.status(agent.agent_id))
        nursery.cancel_scope.cancel()
    assert st.state is RunState.BACKOFF
    return st


async def test_a_secret_exec_cannot_take_blocks_the_agent_not_the_daemon(store: HostStore, tmp_path: Path) -> None:
    """A secret value holding a NUL byte: before, the start raised
    ValueError out of the supervisor, and the daemon died with it."""
    spec = default_spec([sys.executable, "-c", PROBE])
    spec["secrets"] = ["API_TOKEN"]
    keychain.store_secret(store.root, "API_TOKEN", "pasted\0badly")
    st = await _failed(store, tmp_path, spec)
    assert "could not start" in st.detail, st.detail
    assert "pasted" not in st.detail


async def test_a_sandbox_that_cannot_be_built_blocks_the_agent_not_the_daemon(
        store: HostStore, tmp_path: Path, autojump_clock, monkeypatch: pytest.MonkeyPatch) -> None:
    """A snapshot naming both 'a' and 'a/b' (a file and a directory: a
    journalled workspace_update can make one) cannot be materialised: before,
    the OSError left the supervisor and the daemon died with it (and the
    half-built workspace would have been run, then synced as deletions).
    Tries back off as after crashes: each writes a workspace (on a full
    disk, filling it again), and came every 2 s."""
    from capsulefs.agents import supervisor as S

    agent = agent_with_spec(store, default_spec([sys.executable, "-c", PROBE]))
    sha = store.put_blob(b"x\n")
    with store.writing():
        agent.write_files({fmt.SNAPSHOT: fmt.snapshot_bytes({"a": sha, "a/b": sha})}, add_blobs={sha})
    tries = []
    materialize = S.workspace.materialize
    monkeypatch.setattr(S.workspace, "materialize", lambda *a, **kw: (tries.append(1), materialize(*a, **kw)))
    async with trio.open_nursery() as nursery:
        sup = await _blocked(store, tmp_path, nursery, agent.agent_id)
        assert "sandbox" in sup.status(agent.agent_id).detail
        assert not os.path.exists(sup.sandbox(agent.agent_id))  # no half-built workspace to run in
        # 1, 2, 4 ... 60 s apart, not every 2 s. (The build runs in a worker
        # thread, and the autojump clock may jump ahead while one works: so
        # the time of the eighth try is a lower bound.)
        t0 = trio.current_time()
        await wait_for(lambda: len(tries) >= 8, "eight tries")
        assert trio.current_time() - t0 >= 1 + 2 + 4 + 8 + 16 + 32 + 60 - 1
        await wait_for(lambda: sup.status(agent.agent_id).detail.endswith("trying again in 60 s"), "the last backoff")
        nursery.cancel_scope.cancel()


async def test_stopping_an_agent_during_setup_leaves_nothing_of_it_running(store: HostStore, tmp_path: Path) -> None:
    """A setup step (pip install, make...) runs its own subprocesses: before,
    a stop during setup signalled only the step itself, and what it had
    started ran on, outside any supervision."""
    spec = default_spec([sys.executable, "-c", PROBE])
    spec["setup"] = [["sh", "-c", "sleep 300 & echo $! > setup-tool.pid; echo started; wait"]]
    agent = agent_with_spec(store, spec)
    sup = Supervisor(store.root, StoreHooks(store, str(tmp_path)), grace=1.0)
    tool_pid = Path(sup.sandbox(agent.agent_id)) / "setup-tool.pid"
    tool = None
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(sup.serve)
            sup.want(agent.agent_id)
            await wait_for(lambda: tool_pid.exists() and tool_pid.read_text().strip(), "the setup step's tool")
            tool = int(tool_pid.read_text())
            assert sup.status(agent.agent_id).state is RunState.BUILDING
            with trio.fail_after(HANG):
                await sup.unwant(agent.agent_id, sync=False)
            await wait_for(lambda: not os.path.exists(f"/proc/{tool}")
                            or Path(f"/proc/{tool}/stat").read_text().split()[2] == "Z", "the tool to go")
            nursery.cancel_scope.cancel()
    finally:
        if tool is not None:
            try:
                os.kill(tool, 9)
            except ProcessLookupError:
                pass


async def test_a_failed_setup_step_is_named_with_its_last_words(store: HostStore, tmp_path: Path, autojump_clock) -> None:
    spec = default_spec([sys.executable, "-c", PROBE])
    spec["setup"] = [["true"], ["sh", "-c", "echo building; echo 'no such package: frobnicate' >&2; exit 2"]]
    detail = (await _failed(store, tmp_path, spec)).detail
    assert "setup step 2 (sh) failed with status 2: no such package: frobnicate" in detail, detail


async def test_freezing_an_agent_not_run_by_this_daemon_still_syncs_its_sandbox(store: HostStore, tmp_path: Path) -> None:
    """The sandbox holds work from an earlier daemon's run (the agent has
    not run since: its spec's entrypoint was set to null, say). Before, a
    freeze found no process and synced nothing, so a move carried the old
    snapshot and the retire then discarded the sandbox with the work."""
    agent = agent_with_spec(store, default_spec(None))
    hooks = StoreHooks(store, str(tmp_path))
    sup = Supervisor(store.root, hooks)
    sandbox = sup.sandbox(agent.agent_id)
    workspace.materialize(hooks.snapshot(agent.agent_id), hooks.read_blob, sandbox)
    Path(sandbox, "results.csv").write_text("a,b\n1,2\n")
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.serve)
        await sup.freeze(agent.agent_id)
        nursery.cancel_scope.cancel()
    assert store.read_blob(hooks.snapshot(agent.agent_id)["results.csv"]) == b"a,b\n1,2\n"


@pytest.mark.expect_error_log
async def test_a_failed_setup_step_never_shows_a_secret_in_status_or_log(store: HostStore, tmp_path: Path, caplog) -> None:
    # A setup step that fails and prints a secret (a verbose curl, a traceback
    # showing its env) must not put the value in .control/status or the log.
    spec = default_spec([sys.executable, "-c", PROBE])
    spec["secrets"] = ["API_TOKEN"]
    spec["setup"] = [["/bin/sh", "-c", 'echo "401 for token $API_TOKEN" >&2; exit 3']]
    keychain.store_secret(store.root, "API_TOKEN", "s3cr3t-value")
    detail = (await _failed(store, tmp_path, spec)).detail
    assert "401 for token [secret API_TOKEN]" in detail
    assert "s3cr3t-value" not in caplog.text


async def test_the_agent_process_is_told_which_env_names_are_secrets(store: HostStore, tmp_path: Path) -> None:
    spec = default_spec([sys.executable, "-c", PROBE.replace('"HOME")', '"HOME", "CAPSULE_SECRETS")')])
    spec["secrets"] = ["API_TOKEN"]
    agent = agent_with_spec(store, spec)
    keychain.store_secret(store.root, "API_TOKEN", "s3cr3t-value")
    sup = Supervisor(store.root, StoreHooks(store, str(tmp_path)))
    async with trio.open_nursery() as nursery:
        await _serve_and_start(sup, nursery, agent.agent_id)
        seen = json.loads((Path(sup.sandbox(agent.agent_id)) / "probe.json").read_text())
        nursery.cancel_scope.cancel()
    assert seen["env"]["CAPSULE_SECRETS"] == "API_TOKEN"


@pytest.mark.parametrize("bad", [
    {"env": ["GREETING"]},  # not an object
    {"secrets": 5},
    {"setup": "make"},
])
@pytest.mark.capsule_left_broken("the agent's spec is malformed on purpose")
async def test_a_malformed_spec_blocks_its_agent_and_nothing_else(store: HostStore, tmp_path: Path, bad: dict, caplog) -> None:
    # A spec that arrived with a move (peers' files are outside input; only
    # writes through the mount are validated) must not bring the supervisor,
    # and with it the daemon and every other agent, down.
    spec = {**default_spec([sys.executable, "-c", PROBE]), **bad}
    agent = make_agent(store, "broken", workspace={})
    agent.write_files({fmt.SPEC: json.dumps(spec).encode()})
    good = agent_with_spec(store, default_spec([sys.executable, "-c", PROBE]))
    sup = Supervisor(store.root, StoreHooks(store, str(tmp_path)))
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.serve)
        sup.want(agent.agent_id)
        await wait_for(lambda: sup.status(agent.agent_id).state is RunState.BLOCKED, "the broken agent to be blocked")
        assert "spec" in sup.status(agent.agent_id).detail
        sup.want(good.agent_id)
        probe = Path(sup.sandbox(good.agent_id)) / "probe.json"
        await wait_for(lambda: probe.exists() and probe.stat().st_size > 0, "the other agent to run")
        nursery.cancel_scope.cancel()


REPORTER = r"""
import json, os, sys, time
path = os.environ["CAPSULE_STATUS"]
if sys.argv[1] == "link":
    os.symlink(os.path.abspath("secret.txt"), path)
    with open("secret.txt", "w") as f:
        json.dump({"problem": "read through a link"}, f)
else:
    with open(path, "w") as f:
        json.dump({"problem": "the newest user message alone is 9000 tokens,\nover the budget"}, f)
with open("probe.json", "w") as f:
    f.write("{}")
while True:
    time.sleep(1)  # (pacing: the agent idles until it is stopped)
"""


@pytest.mark.parametrize("how", ["file", "link"])
async def test_a_running_agent_s_reported_problem_is_in_its_status(store: HostStore, tmp_path: Path, how: str) -> None:
    agent = agent_with_spec(store, default_spec([sys.executable, "-c", REPORTER, how]))
    sup = Supervisor(store.root, StoreHooks(store, str(tmp_path / "mnt")), grace=5)
    async with trio.open_nursery() as nursery:
        await _serve_and_start(sup, nursery, agent.agent_id)
        if how == "file":
            assert sup.agent_problem(agent.agent_id) == "the newest user message alone is 9000 tokens, over the budget"
        else:  # the agent's file is hostile: a link is never followed
            assert sup.agent_problem(agent.agent_id) is None
        await sup.freeze(agent.agent_id)
        assert sup.agent_problem(agent.agent_id) is None  # not running: nothing to report
        nursery.cancel_scope.cancel()
