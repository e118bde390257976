"""A running agent in a real mount: the reference agent talks to stub providers
through the official SDKs while a person edits its memory and switches its model
through the mount's files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from mount_kit import capsulefs, mounted, needs_fuse, new_reference_agent
from mount_kit import status as agent_status

from capsulefs.core.capsule import format as fmt
from capsulefs.core.journal.record import Record
from capsulefs.core.journal.lines import verify_lines
from capsulefs.testing.stub_provider import serve

from helpers import HANG, reference_agent_spec, wait_until

pytestmark = [needs_fuse]


def _records(agent_dir: Path) -> list[Record]:
    data = (agent_dir / "memory" / "timeline_events.jsonl").read_bytes()
    return [Record.from_line(line) for line in data.splitlines()]


def _say(agent_dir: Path, text: str) -> None:
    with open(agent_dir / "memory" / "timeline_events.jsonl", "a") as f:
        f.write(json.dumps({"kind": "user_message", "text": text}) + "\n")


def _replies(agent_dir: Path) -> list[str]:
    return [r.event.text for r in _records(agent_dir) if r.kind == "assistant_message"]


def test_running_agent_converses_through_the_mount(tmp_path: Path) -> None:
    with serve() as (url, stub):
        state = new_reference_agent(tmp_path, url)
        mnt = tmp_path / "mnt"
        with mounted(state, mnt):
            agent = mnt / "pilot"
            status = lambda: agent_status(agent)  # noqa: E731
            wait_until(lambda: status()["run"]["state"] == "running", "the agent process to run")
            pid = status()["run"]["pid"]

            (agent / ".control" / "model").write_text("anthropic:claude-a\n")
            _say(agent, "hello")
            wait_until(lambda: len(_replies(agent)) >= 1, "the first reply")
            assert _replies(agent)[0] == "echo: hello"

            # A person edits working memory the way editors do: temp file, rename.
            tmp = agent / "memory" / ".working_memory.md.swp"
            tmp.write_text("# notes\nthe user's favourite colour is blue\n")
            os.replace(tmp, agent / "memory" / "working_memory.md")
            _say(agent, "what do you remember?")
            wait_until(lambda: len(_replies(agent)) >= 2, "the second reply")
            assert "favourite colour is blue" in json.dumps(stub.requests[-1][2])

            # Switch provider mid-conversation and back.
            (agent / ".control" / "model").write_text("openai-chat:gpt-c\n")
            _say(agent, "now on chat completions, call write_file")
            wait_until(lambda: len(_replies(agent)) >= 3, "the reply on openai-chat")
            (agent / ".control" / "model").write_text("anthropic:claude-a\n")
            _say(agent, "and back")
            wait_until(lambda: len(_replies(agent)) >= 4, "the reply after switching back")
            assert stub.refused == []
            assert [p for p, _m, _b in stub.requests][-1] == "anthropic"
            assert status()["model"] == "claude-a"

            recs = _records(agent)
            assert verify_lines([r.line for r in recs]) == []
            assert len({r.id for r in recs}) == len(recs)
            kinds = [r.kind for r in recs]
            assert kinds.count("memory_edit") == 1 and kinds.count("model_switch") == 3
            assert kinds.count("tool_call") == kinds.count("tool_result") == 1
        with pytest.raises(ProcessLookupError):  # unmounting stopped the agent
            os.kill(pid, 0)
        for f in tmp_path.rglob("*"):  # the store, the daemon's log, the sandbox
            if f.is_file() and f.name != "secrets.json":
                assert b"stub-key" not in f.read_bytes(), f


def test_running_agent_attaches_an_image_it_reads_through_the_mount(tmp_path: Path) -> None:
    """read_file on a PNG: the agent (its own uid) uploads it through the
    mount's artifacts/blobs/, journals the attachment, and the next request
    to the provider carries the image."""
    import base64
    import hashlib

    state = tmp_path / "state"
    png = base64.b64decode("iVBORw0KGgo=") + b"0123456789"
    with serve() as (url, stub):
        spec = reference_agent_spec(tmp_path / "spec.json", url)
        capsulefs("--state", str(state), "new", "pilot", "--spec", str(spec))
        for name in ("ANTHROPIC_API_KEY", "OPENAI_API_KEY"):
            capsulefs("--state", str(state), "secret", "set", name, input="stub-key\n")
        mnt = tmp_path / "mnt"
        with mounted(state, mnt):
            agent = mnt / "pilot"
            wait_until(lambda: agent_status(agent)["run"]["state"] == "running", "the agent process to run")
            (agent / ".control" / "model").write_text("anthropic:claude-a\n")
            _say(agent, 'call shell {"command": "printf iVBORw0KGgo= | base64 -d > pic; printf 0123456789 >> pic"}')
            wait_until(lambda: len(_replies(agent)) >= 1, "the shell step")
            _say(agent, 'call read_file {"path": "pic"}')
            wait_until(lambda: len(_replies(agent)) >= 2, "the read_file step")
            assert stub.refused == []
            assert base64.b64encode(png).decode() in json.dumps(stub.requests[-1][2])
            sha = hashlib.sha256(png).hexdigest()
            (attachment,) = [r.event for r in _records(agent) if r.kind == "attachment"]
            assert (attachment.blob, attachment.media_type, attachment.size) == (sha, "image/png", len(png))
            assert (agent / fmt.blob_path(sha)).read_bytes() == png
            assert capsulefs("verify", str(agent)).stdout.startswith("OK:")


# An agent that, asked to stop, journals that it stopped (through its mount)
# and exits 0: what a step boundary looks like from the outside.
_STOPPING_AGENT = """
import json, os, signal, sys, time
journal = os.path.join(os.environ["CAPSULE_DIR"], "memory", "timeline_events.jsonl")
def stop(signum, frame):
    with open(journal, "a") as f:
        f.write(json.dumps({"kind": "note", "text": "stopped at a step boundary"}) + "\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
with open(journal, "a") as f:
    f.write(json.dumps({"kind": "note", "text": "started"}) + "\\n")
while True:
    time.sleep(0.05)  # (pacing: a step every 50 ms until SIGTERM)
"""


def _script_agent(tmp_path: Path, name: str, script_text: str) -> Path:
    """A new agent of a store under ``tmp_path`` whose entrypoint runs
    ``script_text``; returns the state directory."""
    state = tmp_path / "state"
    script = tmp_path / f"{name}.py"
    script.write_text(script_text)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"version": 1, "entrypoint": [os.sys.executable, str(script)]}))
    capsulefs("--state", str(state), "new", name, "--spec", str(spec))
    return state


def _started(agent: Path) -> int:
    """Wait for the script agent to say it started; its pid."""
    wait_until(lambda: "started" in [getattr(r.event, "text", "") for r in _records(agent)], "the agent to start")
    return agent_status(agent)["run"]["pid"]


@pytest.mark.parametrize("how", ["capsulefs umount", "SIGTERM to the daemon"])
def test_stopping_the_mount_stops_its_agents_first_while_they_still_have_it(tmp_path: Path, how: str) -> None:
    """Unmounting stops the agents while the mount still serves them, then
    unmounts: an agent's last step (here a note) reaches its journal. Before,
    the mount went first and the agent, cut off, lost its last step."""
    state = _script_agent(tmp_path, "quitter", _STOPPING_AGENT)
    mnt = tmp_path / "mnt"
    with mounted(state, mnt) as daemon:
        pid = _started(mnt / "quitter")
        pid_note = os.getxattr(mnt, "user.capsulefs.pid").split()  # whom umount asks
        assert [int(x) for x in pid_note] == [daemon.pid, os.stat("/proc/self/ns/pid").st_ino]
        if how == "capsulefs umount":
            capsulefs("umount", str(mnt))
        else:
            daemon.terminate()
        assert daemon.wait(timeout=HANG) == 0
        assert not os.path.ismount(mnt)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    journal = next(state.rglob("timeline_events.jsonl")).read_bytes()
    texts = [getattr(Record.from_line(line).event, "text", "") for line in journal.splitlines()]
    assert texts[-1] == "stopped at a step boundary", texts


def test_a_second_signal_does_not_wait_for_a_stubborn_agent(tmp_path: Path) -> None:
    """An agent that ignores SIGTERM holds the first, graceful stop for the
    whole grace period (5 s); a second signal kills it and unmounts now:
    the daemon's log shows it, not the grace period's kill (timing the exit
    against the grace period failed whenever the machine was busy)."""
    state = _script_agent(tmp_path, "mule", _STOPPING_AGENT.replace("signal.signal(signal.SIGTERM, stop)",
                                                                    "signal.signal(signal.SIGTERM, signal.SIG_IGN)"))
    mnt = tmp_path / "mnt"
    with mounted(state, mnt) as daemon:
        pid = _started(mnt / "mule")
        daemon.terminate()
        wait_until(lambda: "stopping the agents" in (state.parent / "daemon-mnt.log").read_text(), "the first signal")
        assert os.path.ismount(mnt)  # still serving: waiting for the agent
        daemon.terminate()
        assert daemon.wait(timeout=HANG) == 0
        assert not os.path.ismount(mnt)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    log = (state.parent / "daemon-mnt.log").read_text()
    assert "unmounting now" in log
    assert "ignored SIGTERM" not in log  # killed by the second signal, not at the grace period's end


def test_a_signal_during_the_clean_up_after_an_unmount_from_outside_waits_for_it(tmp_path: Path) -> None:
    """Unmounted from outside, the daemon stops its agents (a stubborn one
    for the whole grace period) and cleans up; a SIGTERM meanwhile is
    logged and the clean-up finishes. Before, it killed the daemon midway."""
    from capsulefs.daemon.daemon import runtime_path
    from mount_kit import force_unmount

    # The agent notes its SIGTERM (in its sandbox: the mount is gone by then) and goes on.
    noting = "signal.signal(signal.SIGTERM, lambda *_: open('sigterm-seen', 'a').close())"
    state = _script_agent(tmp_path, "mule", _STOPPING_AGENT.replace("signal.signal(signal.SIGTERM, stop)", noting))
    mnt = tmp_path / "mnt"
    log = state.parent / "daemon-mnt.log"
    with mounted(state, mnt) as daemon:
        pid = _started(mnt / "mule")
        assert os.path.exists(runtime_path(str(state)))
        force_unmount(mnt)  # fusermount3 -u -z, from outside
        # The mount point is free at once, but the daemon learns of it later:
        # a signal before that is a plain first signal. Once it stops the
        # agent, it has (up to its 5 s grace period).
        wait_until(lambda: any(state.glob("sandboxes/*/workspace/sigterm-seen")), "the daemon to stop the agent")
        assert daemon.poll() is None
        os.kill(pid, 0)  # the agent is still there
        daemon.terminate()
        assert daemon.wait(timeout=HANG) == 0
    assert "already unmounting; the clean-up finishes first" in log.read_text()
    assert not os.path.exists(runtime_path(str(state)))  # its last step ran
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.parametrize("bad", [b"[]", b"{not json"])
@pytest.mark.capsule_left_broken("the agent's spec breaks the rules on purpose")
def test_an_agent_whose_spec_breaks_the_rules_blocks_alone(tmp_path: Path, bad: bytes) -> None:
    """A spec that came with a move or an import is whatever its sender
    wrote. One that was not a JSON object stopped the daemon's reconcile at
    that agent, every second, so the agents after it never started. Now it
    is blocked with the reason in its status, and the others run."""
    state = tmp_path / "state"
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"version": 1, "entrypoint": ["sleep", "600"]}))
    for name in ("one", "two"):
        capsulefs("--state", str(state), "new", name, "--spec", str(spec))
    from capsulefs.core.store.host_store import HostStore

    store = HostStore.open(state)
    first = store.agent(min(store.agent_ids()))  # reconciled first
    Path(first.path(fmt.SPEC)).write_bytes(bad)  # (as a move or an import could leave it)
    first.refresh_manifest()
    other = "two" if first.manifest().name == "one" else "one"
    mnt = tmp_path / "mnt"
    with mounted(state, mnt):
        wait_until(lambda: agent_status(mnt / other)["run"]["state"] == "running", "the other agent to run")
        wait_until(lambda: agent_status(mnt / first.manifest().name)["run"]["state"] == "blocked", "blocked")
        assert "spec" in agent_status(mnt / first.manifest().name)["run"]["detail"]
