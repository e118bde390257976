"""Code planted beside the daemon or in an agent's workspace is never imported (issue 25, finding 7).

A module named like a standard one (``json.py``, ``concurrent.py``) in the
directory root started the daemon from, or written by an agent's tool into
its workspace, must not run in any Python process the daemon starts: the
move's slab helper (root), the reference agent (``capsulefs agent``, which
holds the agent's secrets). Each planted module records the process that
imported it, then hands over to the real module, so that a process that
imports it goes on working and the test fails on the record, not on a
broken move.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from helpers import reference_agent_spec
import pytest
from mount_kit import capsulefs, needs_fuse
from test_move_daemons import Host, hosts, start_all, wait_for, write_move  # noqa: F401 (hosts is a fixture)

from capsulefs.testing.stub_provider import serve
from capsulefs.agents.process import ours_isolated

pytestmark = [pytest.mark.fuse, needs_fuse]

PLANTED = ("json", "concurrent", "capsulefs")

PLANT = '''\
import importlib, os, runpy, sys
_name = os.path.splitext(os.path.basename(__file__))[0]
with open(os.path.join({markers!r}, "%s-%d" % (_name, os.getpid())), "w") as _f:
    _f.write(" ".join(sys.argv))
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
if __name__ == "__main__":  # `python -m NAME` ran this file: run the real NAME
    sys.modules.pop(_name, None)
    runpy.run_module(_name, run_name="__main__", alter_sys=True)
else:  # imported: the importer gets the real module
    del sys.modules[__name__]
    sys.modules[__name__] = importlib.import_module(__name__)
'''


def _markers(d: Path) -> list[str]:
    return sorted(f"{m.name}: {m.read_text()}" for m in d.iterdir())


def _say(h: Host, name: str, text: str) -> None:
    with open(h.mnt / name / "memory" / "timeline_events.jsonl", "a") as f:
        f.write(json.dumps({"kind": "user_message", "text": text}) + "\n")


def _text(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


def _replies(h: Host, name: str) -> int:
    data = (h.mnt / name / "memory" / "timeline_events.jsonl").read_bytes()
    return sum(json.loads(line)["kind"] == "assistant_message" for line in data.splitlines())


def test_capsulefs_entrypoints_and_setup_steps_run_isolated() -> None:
    py = "/usr/bin/python3.11"
    assert ours_isolated(["capsulefs", "agent"])[1:] == ["-I", "-m", "capsulefs", "agent"]
    script = os.path.join(os.path.dirname(sys.executable), "capsulefs")  # (its shebang has no -I)
    assert ours_isolated([script, "agent"])[1:] == ["-I", "-m", "capsulefs", "agent"]
    assert ours_isolated([py, "-m", "capsulefs", "agent"]) == [py, "-I", "-m", "capsulefs", "agent"]
    assert ours_isolated(["python3", "-m", "capsulefs.testing.stub_provider"]) == ["python3", "-I", "-m", "capsulefs.testing.stub_provider"]
    # The spec's own programs run as it says (-I would hide a script's own modules from it).
    assert ours_isolated([py, "agent.py"]) == [py, "agent.py"]
    assert ours_isolated([py, "-m", "capsulefsx"]) == [py, "-m", "capsulefsx"]
    assert ours_isolated(["/bin/sh", "-m", "capsulefs"]) == ["/bin/sh", "-m", "capsulefs"]


def test_modules_planted_beside_the_daemon_or_in_a_workspace_are_never_imported(
        hosts: tuple[Host, Host], tmp_path: Path) -> None:
    a, b = hosts
    markers = tmp_path / "markers"
    markers.mkdir()
    markers.chmod(0o777)  # (the agents' own uids write here too, if a plant runs)
    plant = PLANT.format(markers=str(markers))
    beside = tmp_path / "cwd"  # where root starts the daemons
    beside.mkdir()
    for mod in PLANTED:
        (beside / f"{mod}.py").write_text(plant)
    try:
        _scenario(a, b, tmp_path, plant, beside)
    finally:  # (checked first, also when the scenario failed: a plant that ran may be why)
        assert _markers(markers) == []


def _scenario(a: Host, b: Host, tmp_path: Path, plant: str, beside: Path) -> None:
    with serve() as (url, stub):
        spec = reference_agent_spec(tmp_path / "spec.json", url)
        doc = json.loads(spec.read_text())
        doc["env"]["PYTHONPATH"] = "."  # -I ignores it too
        spec.write_text(json.dumps(doc))
        for h in (a, b):
            for key in ("ANTHROPIC_API_KEY", "OPENAI_API_KEY"):
                capsulefs("--state", str(h.state), "secret", "set", key, input="stub-key\n")
        a.cli("new", "pilot", "--spec", str(spec))
        a.spawn(run=True, cwd=beside)  # --listen: each keeps a slab helper started ahead
        b.spawn(run=True, cwd=beside)
        start_all(a, b)
        wait_for(lambda: a.status("pilot")["run"]["state"] == "running", "the agent to run on A")
        (a.mnt / "pilot" / ".control" / "model").write_text("anthropic:claude-a\n")
        # The agent's own tool plants the modules in its workspace (a model told to, say).
        sandbox_a = a.state / "sandboxes" / a.status("pilot")["agent_id"] / "workspace"
        # (One message, three calls: a message said while a tool runs would be
        # journaled before its result, and answered as the result is.)
        _say(a, "pilot", " ".join("call write_file " + json.dumps({"path": f"{mod}.py", "content": plant})
                                  for mod in PLANTED))
        for mod in PLANTED:
            wait_for(lambda mod=mod: _text(sandbox_a / f"{mod}.py") == plant, f"the agent to write {mod}.py")
        # A move: B's slab helper writes the blobs; the agent starts again on B, in a
        # workspace that holds the planted modules.
        assert write_move(a.mnt, "pilot", "b\n") == 0
        agent_id = b.status("pilot")["agent_id"]
        b.cli("secret", "grant", "pilot", "ANTHROPIC_API_KEY", "OPENAI_API_KEY")
        wait_for(lambda: b.status("pilot")["run"]["state"] == "running", "the agent to run on B")
        workspace = b.state / "sandboxes" / agent_id / "workspace"
        assert sorted(p.name for p in workspace.glob("*.py")) == sorted(f"{m}.py" for m in PLANTED)
        before = _replies(b, "pilot")
        _say(b, "pilot", "still there?")
        wait_for(lambda: _replies(b, "pilot") > before, "a reply on B (its process started and imported all it does)")
        assert stub.refused == []
        a.stop()
        b.stop()
