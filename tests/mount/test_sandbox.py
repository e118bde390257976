"""The sandbox as an isolation boundary (capsulefs/agents/isolation.py), with real
processes: as root, an agent runs as a uid of its own that cannot read the
host's keychain or TLS key, and a run ends with everything it started, a
process that left the process group (setsid) included."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from capsulefs.agents import keychain
from capsulefs.core.capsule.spec import default_spec
from capsulefs.core.store.host_store import HostStore
from capsulefs.peer.identity import load_or_create_identity
from capsulefs.agents.isolation import Isolation
from capsulefs.agents.supervisor import RunState, Supervisor

from capsulefs.testing.stub_provider import serve
from helpers import wait_until
from mount_kit import mounted, needs_fuse, new_reference_agent
from mount_kit import status as agent_status
from supervisor_kit import StoreHooks, agent_with_spec, wait_for

needs_root = pytest.mark.skipif(
    os.geteuid() != 0,
    reason="sandbox isolation needs the daemon to run as root (not root: agents run as the daemon's user)")

SECRET = "s3cr3t-keychain-value"

# Tries to read the keychain and the host's TLS key, and writes what it got
# into its workspace (which the daemon syncs into the capsule).
SNOOP = r"""
import errno, json, os, sys
state = sys.argv[1]
got = {"uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(), "home": os.environ["HOME"]}
for rel in ("secrets.json", "tls/host.pem", "store.json"):
    try:
        with open(os.path.join(state, rel), "rb") as f:
            got[rel] = f.read().decode(errors="replace")
    except OSError as exc:
        got[rel] = errno.errorcode[exc.errno]
with open("loot.json", "w") as f:
    json.dump(got, f)
"""


@needs_root
async def test_an_agent_cannot_read_the_keychain_or_the_host_key(store: HostStore, tmp_path: Path) -> None:
    pem = load_or_create_identity(store.root).pem_path
    keychain.store_secret(store.root, "API_TOKEN", SECRET)
    spec = default_spec([sys.executable, "-c", SNOOP, store.root])
    spec["secrets"] = ["API_TOKEN"]  # (the run gets it in its env, as it should; not the keychain's file)
    agent = agent_with_spec(store, spec)
    hooks = StoreHooks(store, str(tmp_path / "mnt"))
    sup = Supervisor(store.root, hooks)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.serve)
        sup.want(agent.agent_id)
        await wait_for(lambda: sup.status(agent.agent_id).state is RunState.FINISHED, "the agent to finish")
        await sup.unwant(agent.agent_id)  # (syncs its workspace into the capsule)
        nursery.cancel_scope.cancel()
    loot = json.loads((Path(sup.sandbox(agent.agent_id)) / "loot.json").read_text())
    ids = sup.isolation.ids_for(agent.agent_id)
    assert loot["uid"] == loot["gid"] == ids.uid != 0 and loot["groups"] == []
    assert loot["secrets.json"] == loot["tls/host.pem"] == loot["store.json"] == "EACCES"
    assert loot["home"] == sup.isolation.home(agent.agent_id)
    assert os.stat(Path(sup.sandbox(agent.agent_id)) / "loot.json").st_uid == ids.uid
    # Nothing of the keychain or the key reached the capsule: journal, snapshot, blobs.
    key = pem.read_bytes().split(b"-----")[2][:64]  # a piece of the key's base64 body
    assert "loot.json" in hooks.snapshot(agent.agent_id)
    for f in [*Path(agent.dir).rglob("*"), *Path(store.objects_dir).rglob("*")]:
        if f.is_file():
            data = f.read_bytes()
            assert SECRET.encode() not in data and key not in data, f
    for rel in ("", "secrets.json", "tls", "agents", "objects"):  # modes the daemon checked or set
        mode = os.stat(os.path.join(store.root, rel)).st_mode & 0o777
        assert mode & 0o066 == 0 and (rel == "" or mode & 0o077 == 0), (rel, oct(mode))


# Starts a process that leaves the agent's process group and session
# (setsid), records its pid, and waits to be stopped.
ESCAPER = r"""
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import os, time; os.setsid(); time.sleep(300)"])
while os.getsid(child.pid) == os.getsid(0):  # until its setsid is done (however slow the machine)
    time.sleep(0.01)
with open("escaper.pid", "w") as f:
    f.write(str(child.pid))
while True:
    time.sleep(1)  # (pacing: the agent idles until it is stopped)
"""


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for a reaper."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@needs_root
async def test_a_process_that_left_the_process_group_dies_with_its_agent(store: HostStore, tmp_path: Path) -> None:
    agent = agent_with_spec(store, default_spec([sys.executable, "-c", ESCAPER]))
    sup = Supervisor(store.root, StoreHooks(store, str(tmp_path / "mnt")), grace=1.0)
    if sup.isolation.cgroups is None:
        pytest.skip(f"no writable cgroup v2 here: {sup.isolation.why_no_cgroup}")
    pid_file = Path(sup.sandbox(agent.agent_id)) / "escaper.pid"
    escaper = None
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(sup.serve)
            sup.want(agent.agent_id)
            await wait_for(lambda: pid_file.exists() and pid_file.stat().st_size > 0, "the escaper to start")
            escaper = int(pid_file.read_text())
            leader = sup.status(agent.agent_id).pid
            assert os.getpgid(escaper) != leader and _alive(escaper)
            await sup.unwant(agent.agent_id, sync=False)
            assert not _alive(escaper), "a setsid() child outlived its agent's stop"
            assert not os.path.exists(sup.isolation.cgroups.path(agent.agent_id))
            nursery.cancel_scope.cancel()
    finally:
        if escaper is not None and _alive(escaper):
            os.kill(escaper, signal.SIGKILL)


def test_not_root_isolation_is_off_and_says_so(tmp_path: Path, caplog) -> None:
    iso = Isolation.detect(str(tmp_path / "state"), euid=lambda: 1000)
    assert not iso.enabled and iso.cgroups is None
    assert iso.describe("a" * 32).startswith("off: the daemon does not run as root")
    iso.announce()
    assert "sandbox isolation is off" in caplog.text


@needs_root
@needs_fuse
def test_the_reference_agents_shell_cannot_cat_the_keychain_or_the_host_key(tmp_path: Path) -> None:
    """What the security review did: a model drives the reference agent's
    shell to cat the keychain and tls/host.pem. It gets EACCES, and the
    journal holds the refusal, never the bytes."""
    with serve() as (url, _stub):
        state = new_reference_agent(tmp_path, url)
        mnt = tmp_path / "mnt"
        with mounted(state, mnt):
            agent = mnt / "pilot"
            wait_until(lambda: agent_status(agent)["run"]["state"] == "running", "the agent process to run")
            assert agent_status(agent)["run"]["isolation"].startswith("on: uid 2")
            (agent / ".control" / "model").write_text("anthropic:claude-a\n")
            command = f"id -u; cat {state}/secrets.json {state}/tls/host.pem"
            with open(agent / "memory" / "timeline_events.jsonl", "a") as f:
                f.write(json.dumps({"kind": "user_message", "text": "call shell " + json.dumps({"command": command})}) + "\n")
            journal = agent / "memory" / "timeline_events.jsonl"
            wait_until(lambda: b'"kind":"tool_result"' in journal.read_bytes().replace(b": ", b":"),
                       "the shell's result")
            data = journal.read_bytes()
            if shutil.which("setpriv"):  # another uid (another agent's, a local user) sees no agent
                other = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                                        "cat", str(agent / ".control" / "status")], capture_output=True, text=True)
                assert other.returncode != 0 and "Permission denied" in other.stderr
            key = (state / "tls" / "host.pem").read_bytes().split(b"-----")[2][:64]
    assert b"secrets.json: Permission denied" in data and b"host.pem: Permission denied" in data, data
    assert b"stub-key" not in data and key not in data


# -- the sandbox's files and uids (Isolation itself, no process) -------------------------------


def _isolation(state: Path) -> Isolation:
    return Isolation(str(state), uids=range(300_000, 300_010))


@needs_root
def test_a_hard_link_to_a_file_outside_the_sandbox_keeps_its_owner(tmp_path: Path) -> None:
    """An earlier run (another uid, e.g. a daemon not run as root) hard-linked
    a file of that uid from outside into its workspace. Giving the
    workspace to the agent's new uid must not give the outside file too."""
    state = tmp_path / "state"
    iso = _isolation(state)
    workspace = state / "sandboxes" / ("a" * 32) / "workspace"
    (workspace / "sub").mkdir(parents=True)
    outside = tmp_path / "operator-key"
    outside.write_text("private\n")
    os.chown(outside, 1000, 1000)
    os.link(outside, workspace / "sub" / "key")
    (workspace / "own.txt").write_text("mine\n")
    os.link(workspace / "own.txt", workspace / "sub" / "own-again.txt")  # both names inside: its own
    ids = iso.prepare("a" * 32, str(workspace), reach=[])
    assert (os.stat(outside).st_uid, os.stat(outside).st_gid) == (1000, 1000)
    assert os.stat(workspace / "own.txt").st_uid == ids.uid
    assert os.stat(workspace / "sub").st_uid == ids.uid


@needs_root
def test_a_uid_is_never_given_twice(tmp_path: Path) -> None:
    """What an agent left in /tmp, shared memory or IPC (or a process of it
    that survived without a cgroup) would be the next holder of its uid's."""
    state = tmp_path / "state"
    iso = _isolation(state)
    first = iso.ids_for("a" * 32).uid
    shutil.rmtree(state / "sandboxes" / ("a" * 32))  # it left (retire, remove)
    iso.forget("a" * 32)
    again = _isolation(state)  # (and a restarted daemon)
    assert again.ids_for("b" * 32).uid == first + 1
    assert again.ids_for("c" * 32).uid == first + 2


@needs_root
def test_hardening_closes_every_agent_s_sandbox_not_only_those_that_start(tmp_path: Path) -> None:
    state = tmp_path / "state"
    for agent_id in ("a" * 32, "b" * 32):
        (state / "sandboxes" / agent_id / "workspace").mkdir(parents=True, mode=0o755)
        (state / "sandboxes" / agent_id).chmod(0o755)
    iso = _isolation(state)
    uid = iso.ids_for("a" * 32).uid
    iso.harden_state_dir()
    a, b = os.stat(state / "sandboxes" / ("a" * 32)), os.stat(state / "sandboxes" / ("b" * 32))
    assert (a.st_uid, a.st_gid, a.st_mode & 0o777) == (0, uid, 0o710)
    assert (b.st_uid, b.st_mode & 0o777) == (0, 0o700)
