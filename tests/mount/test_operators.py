"""What an operator sees of a running agent that does not answer, and how
they steer it, without a remount: its log, its last error in
``.control/status``, ``capsulefs status`` and ``capsulefs logs``."""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

from mount_kit import capsulefs, mounted, needs_fuse, new_reference_agent
from mount_kit import status as agent_status

from capsulefs.core.journal.record import Record
from capsulefs.testing.stub_provider import serve

from helpers import wait_until

pytestmark = [needs_fuse]


def _say(agent_dir: Path, text: str) -> None:
    with open(agent_dir / "memory" / "timeline_events.jsonl", "a") as f:
        f.write(json.dumps({"kind": "user_message", "text": text}) + "\n")


def _replies(agent_dir: Path) -> list[str]:
    data = (agent_dir / "memory" / "timeline_events.jsonl").read_bytes()
    return [r.event.text for r in map(Record.from_line, data.splitlines()) if r.kind == "assistant_message"]


def _host_status(state: Path) -> dict[str, dict]:
    return {row["name"]: row for row in json.loads(capsulefs("--state", str(state), "status", "--json").stdout)}


def test_a_failed_step_is_in_the_status_with_its_fix_and_in_the_log(tmp_path: Path) -> None:
    """No model chosen: the agent stays up, and its status says what failed,
    when, the next retry, and the command that fixes it; that command fixes
    it. The log has the agent's own words, with or without a daemon."""
    with serve() as (url, _stub):
        state = new_reference_agent(tmp_path, url)
        mnt = tmp_path / "mnt"
        with mounted(state, mnt):
            agent = mnt / "pilot"
            wait_until(lambda: agent_status(agent)["run"]["state"] == "running", "the agent process to run")
            _say(agent, "hello")
            wait_until(lambda: agent_status(agent)["run"]["last_error"], "the failed step in the status")
            err = agent_status(agent)["run"]["last_error"]
            assert "no model chosen" in err["what"]
            assert err["at"] and err["next_retry"] and err["next_retry"] >= err["at"]
            assert err["by"] == "agent" and err["log"] == f"capsulefs logs {agent_status(agent)['agent_id']}"
            assert err["fix"].startswith("echo ") and err["fix"].endswith(f"> {agent}/.control/model")

            row = _host_status(state)["pilot"]
            assert row["source"] == "daemon" and row["run"] == "running" and row["state"] == "active"
            assert row["holder"]["state"] == "held" and row["holder"]["next"] == ""
            assert "no model chosen" in row["last_error"]["what"] and row["last_event"]
            table = capsulefs("--state", str(state), "status").stdout
            assert table.splitlines()[0].split()[:4] == ["NAME", "STATE", "HOLDER", "EPOCH"]
            assert "no model chosen" in table and "fix: echo" in table

            logs = capsulefs("--state", str(state), "logs", "pilot").stdout
            assert "step failed: no model chosen" in logs
            assert "capsulefs: started as pid" in logs  # the daemon's own line

            # The fix, as the status gives it, is a command that works.
            subprocess.run(err["fix"], shell=True, check=True)
            wait_until(lambda: _replies(agent), "the reply once a model is chosen")
            wait_until(lambda: agent_status(agent)["run"]["last_error"] is None, "the error to clear")
            model = agent_status(agent)["provider"] + ":" + agent_status(agent)["model"]
        # Without a daemon: from the store.
        row = _host_status(state)["pilot"]
        assert row["source"] == "store" and row["model"] == model and row["last_event"]
        assert row["run"] == "not running (no daemon)"
        assert "step failed: no model chosen" in capsulefs("--state", str(state), "logs", "pilot", "-n", "1000").stdout


def test_a_crash_shows_the_last_lines_of_its_log(tmp_path: Path) -> None:
    """Any agent program, not only the reference agent: one that exits
    non-zero shows its last output in ``run.last_error``; its log keeps
    its bytes as text only (a terminal escape is written as \\x1b)."""
    state = tmp_path / "state"
    spec = tmp_path / "spec.json"
    script = ('echo "token is $CRASH_TOKEN"; printf "loading\\n\\033[31mboom: cannot open config.yaml\\n" >&2; '
              'exit 3')
    spec.write_text(json.dumps({"version": 1, "entrypoint": ["sh", "-c", script], "secrets": ["CRASH_TOKEN"]}))
    capsulefs("--state", str(state), "new", "crashy", "--spec", str(spec))
    capsulefs("--state", str(state), "secret", "set", "CRASH_TOKEN", input="hunter2-value\n")
    mnt = tmp_path / "mnt"
    with mounted(state, mnt):
        agent = mnt / "crashy"
        seen: dict = {}

        def crashed() -> bool:  # (one status read: the agent restarts after its backoff, and runs again)
            st = agent_status(agent)["run"]
            out = (st.get("last_error") or {}).get("output") or []
            if out and out[-1].endswith("boom: cannot open config.yaml"):
                seen.update(st)
            return bool(seen)

        wait_until(crashed, "the crash in the status")
        st = seen
        err = st["last_error"]
        assert err["what"] == "the entrypoint exited with status 3" and err["by"] == "daemon"
        assert err["output"][-1].endswith("boom: cannot open config.yaml")
        assert "\\x1b[31m" in err["output"][-1] and "\x1b" not in json.dumps(err)
        assert err["next_retry"] is not None
        assert "token is [secret CRASH_TOKEN]" in err["output"] and "hunter2" not in json.dumps(st)
        assert "boom: cannot open config.yaml" in st["detail"]
        wait_until(lambda: "the entrypoint exited with status 3" in
                   ((_host_status(state)["crashy"].get("last_error") or {}).get("what") or ""),
                   "the crash in capsulefs status")
    logs = capsulefs("--state", str(state), "logs", "crashy").stdout
    assert "loading" in logs and "\\x1b[31mboom" in logs and "\x1b" not in logs
    assert "capsulefs: exited with status 3" in logs


def test_logs_of_an_agent_that_never_ran_say_so(tmp_path: Path) -> None:
    state = tmp_path / "state"
    capsulefs("--state", str(state), "new", "idle")
    proc = capsulefs("--state", str(state), "logs", "idle")
    assert proc.stdout == "" and "no log on this host yet" in proc.stderr
    proc = capsulefs("--state", str(state), "logs", "nobody", check=False)
    assert proc.returncode == 1 and len(proc.stderr.splitlines()) == 1
    assert shlex.split(capsulefs("--state", str(state), "status").stdout.splitlines()[1])[0] == "idle"


def _environ(pid: int) -> dict[str, str]:
    data = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.decode().partition("=")[::2] for item in data.split(b"\0") if item)


def test_a_spec_edit_and_a_grant_reach_the_running_agent_without_a_remount(tmp_path: Path) -> None:
    """Edit spec.json through the mount (a new endpoint variable and a new
    secret): the agent restarts at its next step boundary (journaled, the
    new spec digest in its status), is blocked until the secret is set and
    granted, then runs with the new environment. Revoking the grant stops it
    again. No remount."""
    from capsulefs.agents.steering import spec_digest

    with serve() as (url, _stub):
        state = new_reference_agent(tmp_path, url)
        mnt = tmp_path / "mnt"
        with mounted(state, mnt):
            agent = mnt / "pilot"
            wait_until(lambda: agent_status(agent)["run"]["state"] == "running", "the agent process to run")
            run = agent_status(agent)["run"]
            old_pid, old_digest = run["pid"], run["spec"]["digest"]
            assert old_digest == spec_digest(json.loads((agent / "environment" / "spec.json").read_bytes()))
            assert run["spec"]["secrets"] == ["ANTHROPIC_API_KEY", "OPENAI_API_KEY"]

            edited = json.loads((agent / "environment" / "spec.json").read_bytes())
            edited["env"]["EXTRA_SETTING"] = "on"
            edited["secrets"].append("NEW_TOKEN")
            (agent / "environment" / "spec.json").write_text(json.dumps(edited))
            new_digest = spec_digest(edited)

            def blocked_for_the_grant() -> bool:
                run = agent_status(agent)["run"]
                return run["state"] == "blocked" and "capsulefs secret grant" in run["detail"]

            wait_until(blocked_for_the_grant, "the restarted agent to wait for its new secret's grant")
            err = agent_status(agent)["run"]["last_error"]
            assert "NEW_TOKEN" in err["what"] and err["fix"].startswith("capsulefs secret grant ")
            notes = [r.event.text for r in map(Record.from_line, (agent / "memory" / "timeline_events.jsonl")
                                                .read_bytes().splitlines()) if r.kind == "note"]
            assert any("its spec changed" in n and old_digest in n and new_digest in n for n in notes), notes

            capsulefs("--state", str(state), "secret", "set", "NEW_TOKEN", input="tok-123\n")
            capsulefs("--state", str(state), "secret", "grant", "pilot", "NEW_TOKEN")

            def running_anew() -> bool:
                run = agent_status(agent)["run"]
                return run["state"] == "running" and run["pid"] != old_pid

            wait_until(running_anew, "the agent to run with its new spec")
            run = agent_status(agent)["run"]
            assert run["spec"] == {"digest": new_digest,
                                   "secrets": ["ANTHROPIC_API_KEY", "NEW_TOKEN", "OPENAI_API_KEY"]}
            env = _environ(run["pid"])
            assert env["EXTRA_SETTING"] == "on" and env["NEW_TOKEN"] == "tok-123"
            logs = capsulefs("--state", str(state), "logs", "pilot", "-n", "1000").stdout
            assert "restarting at its next step boundary: its spec changed" in logs
            assert "starting again: its spec changed" in logs

            # Revoked: the run that has it stops at its next step boundary, and waits for a grant.
            capsulefs("--state", str(state), "secret", "revoke", "pilot", "NEW_TOKEN")
            wait_until(blocked_for_the_grant, "the agent to stop once its secret is revoked")
