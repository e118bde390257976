"""Two capsulefs processes on loopback: one serving moves, one moving an agent to it."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

from cli_kit import CAPSULEFS, REPO, run_cli
from helpers import HANG

from capsulefs.core.store.holder import HolderBook, HolderState


def test_move_between_two_processes(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    run_cli("init", state=a, check=True)
    run_cli("init", state=b, check=True)
    ida = run_cli("id", state=a, check=True).stdout.strip()
    idb = run_cli("id", state=b, check=True).stdout.strip()
    run_cli("new", "walker", state=a, check=True)
    aid = run_cli("ls", "--json", state=a, check=True).stdout
    agent_id = re.search(r"[0-9a-f]{32}", aid).group(0)

    assert HolderBook(a / "holders").get(agent_id).state is HolderState.HELD  # `new` recorded it
    refused = run_cli("move", "walker", "b", state=a)  # b is no peer yet
    assert refused.returncode == 1 and "Traceback" not in refused.stderr

    run_cli("peer", "add", "a", "127.0.0.1:1", ida, state=b, check=True)
    with subprocess.Popen([*CAPSULEFS, "--state", str(b), "peer-serve", "--listen", "127.0.0.1:0"],
                          cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as server:
        try:
            line = server.stdout.readline()
            found = re.search(r":(\d+) as ", line)
            assert found, f"peer-serve did not start: {line!r}"
            run_cli("peer", "add", "b", f"127.0.0.1:{found.group(1)}", idb, state=a, check=True)
            moved = run_cli("move", "walker", "b", state=a, check=True)
            assert "moved to b at epoch 2" in moved.stdout
        finally:
            server.terminate()
            server.wait(timeout=HANG)
    assert HolderBook(b / "holders").get(agent_id).state is HolderState.HELD
    assert HolderBook(a / "holders").get(agent_id).state is HolderState.RETIRED
    assert "walker" in run_cli("ls", state=b, check=True).stdout
    assert "walker" not in run_cli("ls", state=a, check=True).stdout  # moved away whole: nothing kept
    exported = tmp_path / "walker.tar"
    run_cli("export", "walker", "-o", str(exported), state=b, check=True)
    assert "OK" in run_cli("verify", str(exported), state=b, check=True).stdout


def test_abandon_needs_a_reason_and_a_move(tmp_path: Path) -> None:
    a = tmp_path / "a"
    run_cli("init", state=a, check=True)
    run_cli("new", "stay", state=a, check=True)
    r = run_cli("move", "stay", "--abandon", state=a)
    assert r.returncode == 1 and "--why" in r.stderr
    r = run_cli("move", "stay", "--abandon", "--why", "x", state=a)
    assert r.returncode == 1 and "no move in progress" in r.stderr


def _serve(state: Path) -> tuple[subprocess.Popen, str]:
    server = subprocess.Popen([*CAPSULEFS, "--state", str(state), "peer-serve", "--listen", "127.0.0.1:0"],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = server.stdout.readline()
    found = re.search(r":(\d+) as ", line)
    assert found, f"peer-serve did not start: {line!r}"
    return server, found.group(1)


def _stop(server: subprocess.Popen) -> None:
    server.terminate()
    server.wait(timeout=HANG)
    assert server.stdout is not None
    server.stdout.close()


def test_export_rm_import_elsewhere_then_here_never_gives_two_holders(tmp_path: Path) -> None:
    """A exports an agent and removes it; B imports the export and learns from A
    that A no longer holds it, so B holds it. A imports the same export again:
    it must not simply hold it too; it is in doubt until it asks, and asking
    finds B holding it, so A retires its copy."""
    a, b = tmp_path / "a", tmp_path / "b"
    for s in (a, b):
        run_cli("init", state=s, check=True)
    ida = run_cli("id", state=a, check=True).stdout.strip()
    idb = run_cli("id", state=b, check=True).stdout.strip()
    run_cli("new", "walker", state=a, check=True)
    agent_id = re.search(r"[0-9a-f]{32}", run_cli("ls", "--json", state=a, check=True).stdout).group(0)
    tar = tmp_path / "walker.tar"
    run_cli("export", "walker", "-o", str(tar), state=a, check=True)
    run_cli("rm", "walker", state=a, check=True)
    assert HolderBook(a / "holders").get(agent_id).removed_here

    imported = run_cli("import", str(tar), state=b, check=True)
    assert "walker: in-doubt: " in imported.stdout and "next: capsulefs move walker --learn" in imported.stdout
    server, port_a = _serve(a)
    try:
        run_cli("peer", "add", "b", "127.0.0.1:1", idb, state=a, check=True)  # pinned, so b's calls are accepted
        run_cli("peer", "add", "a", f"127.0.0.1:{port_a}", ida, state=b, check=True)
        learned = run_cli("move", "walker", "--learn", state=b, check=True)
        assert "held: this host holds it at epoch 1" in learned.stdout
    finally:
        _stop(server)
    assert HolderBook(b / "holders").get(agent_id).state is HolderState.HELD

    again = run_cli("import", str(tar), state=a, check=True)
    assert "--learn" in again.stdout
    assert HolderBook(a / "holders").get(agent_id).state is HolderState.UNKNOWN  # not held: B may hold it
    server, port_b = _serve(b)
    try:
        run_cli("peer", "rm", "b", state=a, check=True)
        run_cli("peer", "add", "b", f"127.0.0.1:{port_b}", idb, state=a, check=True)
        learned = run_cli("move", "walker", "--learn", state=a, check=True)
        assert f"walker: retired: host {idb} holds it" in learned.stdout
    finally:
        _stop(server)
    rec = HolderBook(a / "holders").get(agent_id)
    assert rec.state is HolderState.RETIRED
    # What A had is kept (it may have taken writes B lacks), as a capsule that verifies, named in the record.
    assert rec.kept and rec.kept.startswith(f"recovery/{agent_id}/kept-e1-") and rec.kept in learned.stdout
    assert "OK" in run_cli("verify", str(a / rec.kept), state=a, check=True).stdout
    listed = json.loads(run_cli("ls", "--json", state=a, check=True).stdout)  # not held: shown with its kept copy
    assert [(r["name"], r["state"]) for r in listed] == [("walker", "retired")]
    assert f"walker: {listed[0]['line']}\n" == learned.stdout
    assert HolderBook(b / "holders").get(agent_id).state is HolderState.HELD


def test_offline_move_commands_refuse_while_another_holds_the_state(tmp_path: Path) -> None:
    """Without a daemon, a move, --resume, --learn, --abandon, --force-hold
    and peer-serve each hold the state directory, as a daemon does: a second
    one (or a daemon starting) could otherwise freeze, move or hold the same
    agent from the same records twice. Here another process holds it: each
    is refused, names what it was refused, and changes no record."""
    from capsulefs.daemon.daemon import holding_state

    a = tmp_path / "a"
    run_cli("init", state=a, check=True)
    run_cli("new", "walker", state=a, check=True)
    run_cli("peer", "add", "b", "127.0.0.1:1", "B" * 52, state=a, check=True)
    agent_id = re.search(r"[0-9a-f]{32}", run_cli("ls", "--json", state=a, check=True).stdout).group(0)
    before = (a / "holders" / f"{agent_id}.json").read_bytes()
    commands = {
        "moving walker": ["move", "walker", "b"],
        "resuming interrupted moves": ["move", "-", "--resume"],
        "learning who holds walker": ["move", "walker", "--learn"],
        "abandoning the move of walker": ["move", "walker", "--abandon", "--why", "test"],
        "forcing the hold of walker": ["move", "walker", "--force-hold", "--why", "test"],
        "serving moves on 127.0.0.1:0": ["peer-serve", "--listen", "127.0.0.1:0"],
    }
    with holding_state(str(a), doing="the test"):
        for doing, argv in commands.items():
            r = run_cli(*argv, state=a)
            assert r.returncode == 1, (argv, r.stdout, r.stderr)
            assert f"already holds {a}: {doing}" in r.stderr and "Traceback" not in r.stderr, r.stderr
            # The refusal names who holds it and what they are doing.
            assert f"capsulefs (pid {os.getpid()}, 'the test') already holds" in r.stderr, r.stderr
    assert (a / "holders" / f"{agent_id}.json").read_bytes() == before
    assert not (a / "mount" / "holder.json").exists()  # the note goes with the hold
    # Once the state is free, the offline commands run again (here: refused for their own reasons).
    r = run_cli("move", "walker", "--abandon", "--why", "test", state=a)
    assert r.returncode == 1 and "no move in progress" in r.stderr


def test_the_holders_note_is_only_words(tmp_path: Path) -> None:
    """The note beside the state lock only words a refusal: a hand-edited or
    foreign note gives the generic words (no traceback), and a note that
    cannot be written (here: its path is a directory; in life a full disk)
    does not keep anyone from holding the state."""
    from capsulefs.core.errors import CapsuleError
    from capsulefs.daemon.daemon import HOLDER_FILE, holding_state, work_dir

    state = str(tmp_path / "state")
    note = os.path.join(work_dir(state), HOLDER_FILE)
    with holding_state(state, doing="the test"):
        for text in ('{"pid": 1e400, "doing": "x"}', '{"pid": 1099511627776, "doing": "x"}',
                     '{"pid": 0, "doing": "x"}', '{"pid": -1, "doing": "x"}', "not json", '["a"]'):
            with open(note, "w") as f:
                f.write(text)
            try:
                with holding_state(state, doing="a second holder"):
                    raise AssertionError("held twice")
            except CapsuleError as exc:
                assert str(exc).startswith("another capsulefs daemon or command already holds"), (text, exc)
    os.makedirs(note)
    with holding_state(state, doing="holding without a note"):
        pass
    assert os.path.isdir(note)
