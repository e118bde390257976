"""The journal commands: log, append, merge. One test runs the real CLI in a
subprocess; the others call ``capsulefs.cli.main`` in this process (fast)."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from capsulefs.cli import main

from capsulefs.core.capsule import format as fmt
from capsulefs.core.capsule.archive import verify_capsule
from capsulefs.core.journal.lines import split_lines, verify_lines
from capsulefs.core.store.host_store import HostStore
from helpers import extract_all


@pytest.fixture
def cli(state_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Run ``capsulefs --state STATE ARGS`` in this process; like subprocess.run's result."""

    def run(*args: str, check: bool = False, input: str | None = None) -> SimpleNamespace:
        argv = list(args)
        if "--state" not in argv[:1]:
            argv = ["--state", str(state_dir)] + argv
        capsys.readouterr()
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO((input or "").encode())))
        rc = main(argv)
        out, err = capsys.readouterr()
        if check and rc != 0:
            raise AssertionError(f"capsulefs {' '.join(args)} failed ({rc}): {out}{err}")
        return SimpleNamespace(returncode=rc, stdout=out, stderr=err)

    return run


def test_the_real_cli(state_dir: Path) -> None:
    def run(*args: str, input: str | None = None) -> str:
        argv = [sys.executable, "-m", "capsulefs", "--state", str(state_dir), *args]
        return subprocess.run(argv, capture_output=True, text=True, check=True, input=input, timeout=120).stdout

    run("new", "ada")
    run("append", "ada", "--stdin", "-q", input='{"kind":"user_message","text":"hi"}\n{"kind":"note","text":"n"}\n')
    assert [json.loads(x)["seq"] for x in run("log", "ada", "--json").splitlines()] == [1, 2]


def test_append_and_log(cli, store: HostStore) -> None:  # type: ignore[no-untyped-def]
    cli("new", "ada", check=True)
    p = cli("append", "ada", "--kind", "user_message", "--text", "hello there", check=True)
    first = json.loads(p.stdout)
    assert (first["kind"], first["seq"], first["clock"], first["prev"]) == ("user_message", 1, 1, None)
    cli("append", "ada", "--kind", "tool_call", "--json", '{"call_id":"c1","name":"ls","arguments":{"p":"/"}}', check=True)
    drafts = '{"kind":"tool_result","call_id":"c1","content":"a b c"}\n{"kind":"note","text":"done"}\n'
    p = cli("append", "ada", "--stdin", "-q", input=drafts, check=True)
    assert p.stdout == ""

    log = cli("log", "ada", check=True).stdout.splitlines()
    assert len(log) == 4
    assert "#1" in log[0] and "user_message" in log[0] and "hello there" in log[0]
    assert "ls(" in log[1] and "call c1" in log[1]
    assert "call c1: a b c" in log[2] and "note" in log[3]

    only = cli("log", "ada", "--kind", "note", "--json", check=True).stdout.splitlines()
    assert [json.loads(x)["text"] for x in only] == ["done"]
    journal = store.find("ada").read(fmt.JOURNAL)
    assert verify_lines(split_lines(journal)) == []


def test_log_shows_control_characters_escaped_one_line_per_event(cli, store: HostStore) -> None:  # type: ignore[no-untyped-def]
    """Text in a journal is whatever was appended (or imported): log prints
    its C0 and C1 controls and DEL as escapes, so no event clears the screen,
    rewrites an earlier line or spans two; --json stays the journal's bytes."""
    cli("new", "ada", check=True)
    drafts = [
        {"kind": "note", "text": "a\x1b[2Jb\rc\x9bd\x08e\x7ff\nnext"},
        {"kind": "assistant_message", "text": "hi", "model": "m\x1b]0;title\x07\r"},
        {"kind": "tool_call", "call_id": "c\x1b[1A", "name": "n\x9b", "arguments": {"k": "v\r"}},
    ]
    cli("append", "ada", "--stdin", "-q", input="".join(json.dumps(d) + "\n" for d in drafts), check=True)
    log = cli("log", "ada", check=True).stdout
    assert log.endswith("\n") and len(log.splitlines()) == 3, log
    assert not [c for c in log[:-1] if ord(c) < 32 and c != "\n" or 0x7F <= ord(c) <= 0x9F], log
    assert "a\\x1b[2Jb c\\u009bd\\x08e\\x7ff next" in log  # (whitespace in a text is one space)
    assert "[m\\x1b]0;title\\x07\\x0d] hi" in log
    assert "n\\u009b(" in log and "call c\\x1b[1A" in log
    journal = store.find("ada").read(fmt.JOURNAL)
    assert cli("log", "ada", "--json", check=True).stdout.encode() == journal


def test_append_errors_are_one_line(cli) -> None:  # type: ignore[no-untyped-def]
    cli("new", "ada", check=True)
    for args, word in [
        (["--kind", "nonsense", "--text", "x"], "unknown event kind"),
        (["--kind", "note"], "missing field"),
        (["--kind", "note", "--json", "[1]"], "JSON object"),
        (["--kind", "note", "--text", "x", "--json", '{"seq":4}'], "stamped"),
        (["--kind", "note", "--text", "x", "--json", '{"n":NaN}'], "NaN is not a JSON number"),
        (["--kind", "note", "--json", '{"text":1e999}'], "1e999 is out of range"),
        ([], "--kind"),
        (["--kind", "note\udcff", "--text", "x"], "--kind is not valid UTF-8"),  # argv byte 0xff, as Python decodes it
        (["--kind", "note", "--text", "\udcff"], "--text is not valid UTF-8"),
        (["--kind", "note", "--json", '{"text": "\udcff"}'], "--json is not valid UTF-8"),
    ]:
        p = cli("append", "ada", *args)
        assert p.returncode == 1 and word in p.stderr and "Traceback" not in p.stderr, (args, p.stderr)
        assert len(p.stderr.strip().splitlines()) == 1
    assert cli("log", "ada", check=True).stdout == ""
    p = cli("append", "nobody", "--kind", "note", "--text", "x")
    assert p.returncode == 1 and "nobody" in p.stderr


def test_append_stdin_without_end_is_one_line_error(state_dir: Path) -> None:
    from cli_kit import run_cli
    import resource

    def cap_memory() -> None:  # without a bound the read of /dev/zero ends in MemoryError (or the OOM killer)
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    run_cli("new", "ada", state=state_dir, check=True)
    with open("/dev/zero", "rb") as zero:
        p = run_cli("append", "ada", "--stdin", state=state_dir, stdin=zero, preexec_fn=cap_memory)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert p.stderr.strip().splitlines() == [f"capsulefs: error: draft line 1 is longer than {16 << 20} bytes"]
    assert run_cli("log", "ada", state=state_dir, check=True).stdout == ""


def test_append_stdin_is_capped_in_all_not_only_per_line(cli, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """The drafts are appended all or none, so they are held in memory until
    the input ends: an endless stream of valid lines stops at the cap, with
    nothing appended."""
    from capsulefs.cli import journal_cmds

    cli("new", "ada", check=True)
    line = '{"kind":"note","text":"n"}\n'
    monkeypatch.setattr(journal_cmds, "MAX_STDIN_DRAFTS", 3 * len(line))
    p = cli("append", "ada", "--stdin", "-q", input=line * 4)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip().splitlines() == [
        f"capsulefs: error: --stdin drafts are more than {3 * len(line)} bytes in all; "
        "split them into several appends (each is all or none on its own)"]
    assert cli("log", "ada", check=True).stdout == ""
    cli("append", "ada", "--stdin", "-q", input=line * 3, check=True)  # up to the cap: appended
    assert len(cli("log", "ada", check=True).stdout.splitlines()) == 3


def test_append_keeps_projections_current(cli, store: HostStore) -> None:  # type: ignore[no-untyped-def]
    cli("new", "ada", check=True)
    body = b"print('hi')\n"
    h = store.put_blob(body)
    cli("append", "ada", "--kind", "memory_edit", "--text", "remember the milk", "-q", check=True)
    cli("append", "ada", "--kind", "workspace_update", "--json", json.dumps({"changes": {"src/x.py": h}}), "-q", check=True)
    agent = store.find("ada")
    assert agent.read(fmt.WORKING_MEMORY) == b"remember the milk"
    assert fmt.parse_snapshot(agent.read(fmt.SNAPSHOT)) == {"src/x.py": h}
    assert fmt.blob_path(h) in agent.manifest().files
    missing = hashlib.sha256(b"not stored").hexdigest()
    p = cli("append", "ada", "--kind", "workspace_update", "--json", json.dumps({"changes": {"y": missing}}))
    assert p.returncode == 1 and "not in the store" in p.stderr


@pytest.mark.parametrize("state, says", [
    ("frozen", "is in a move (frozen, moving to"),
    ("committing", "in doubt: the target may have activated it"),
    ("unknown", "--learn"),
    ("retired", "no longer holds it (retired"),
])
def test_append_is_refused_unless_this_host_holds_the_agent(cli, store: HostStore, state_dir: Path,
                                                            state: str, says: str) -> None:  # type: ignore[no-untyped-def]
    """Events appended while the agent moves away would stay behind on the
    source; appended to an agent this host may not hold, they could be
    dropped with its files. The record is checked under the agent's files
    lock and again under the journal's flock; nothing is written."""
    from capsulefs.core.store.holder import HolderBook, HolderState
    from capsulefs.move.host import holders_dir

    cli("new", "ada", check=True)
    agent = store.find("ada")
    holders = HolderBook(holders_dir(str(state_dir)))
    held = holders.get(agent.agent_id)
    assert held is not None and held.runnable
    cli("append", "ada", "--kind", "note", "--text", "while held", "-q", check=True)
    before = agent.read(fmt.JOURNAL)
    peer = "P" * 52 if state in ("frozen", "committing", "retired") else None
    holding = HolderState(state) in (HolderState.FROZEN, HolderState.COMMITTING)
    holders.put(held.with_(state=HolderState(state), epoch=held.epoch + 1, peer=peer, note="a test",
                           held_epoch=held.held_epoch if holding else None))
    p = cli("append", "ada", "--kind", "note", "--text", "lost?")
    assert p.returncode == 1 and "cannot append to agent ada" in p.stderr and says in p.stderr, p.stderr
    assert agent.read(fmt.JOURNAL) == before
    holders.put(held)
    cli("append", "ada", "--kind", "note", "--text", "held again", "-q", check=True)


def _diverged(cli, tmp_path: Path, state_b: Path) -> tuple[Path, Path]:  # type: ignore[no-untyped-def]
    """Agent ada exported, imported on a second host, both sides go on."""
    cli("new", "ada", check=True)
    cli("append", "ada", "--kind", "user_message", "--text", "shared", "-q", check=True)
    base = tmp_path / "base.tar"
    cli("export", "ada", "-o", str(base), check=True)
    other = ["--state", str(state_b)]
    cli(*other, "import", str(base), check=True)
    # (an imported copy is in doubt: an operator decides the second host goes on with it)
    cli(*other, "move", "ada", "--force-hold", "--why", "diverge on purpose", check=True)
    cli("append", "ada", "--kind", "memory_edit", "--text", "alpha memory", "-q", check=True)
    cli(*other, "append", "ada", "--kind", "note", "--text", "bravo was here", "-q", check=True)
    cli(*other, "append", "ada", "--kind", "memory_edit", "--text", "bravo memory", "-q", check=True)
    a_tar, b_tar = tmp_path / "a.tar", tmp_path / "b.tar.zst"
    cli("export", "ada", "-o", str(a_tar), check=True)
    cli(*other, "export", "ada", "-o", str(b_tar), check=True)
    return a_tar, b_tar


def test_merge_two_diverged_capsules(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    a_tar, b_tar = _diverged(cli, tmp_path, tmp_path / "state-b")
    out_dir, out_tar = tmp_path / "merged", tmp_path / "merged.tar"
    p = cli("merge", str(a_tar), str(b_tar), "-o", str(out_dir), check=True)
    assert "4 events" in p.stdout
    assert verify_capsule(str(out_dir))[1] == []
    lines = split_lines((out_dir / fmt.JOURNAL).read_bytes())
    assert len(lines) == 4 and verify_lines(lines) == []
    # Both edits have clock 2 + 1...; the later one by (clock, machine) is the working memory.
    edits = [json.loads(x) for x in lines if b"memory_edit" in x]
    last = max(edits, key=lambda d: (d["clock"], d["machine"], d["seq"]))
    assert (out_dir / fmt.WORKING_MEMORY).read_text() == last["text"]
    # Same result the other way round, and as a tar; the store agent works as an input too.
    cli("merge", "ada", str(b_tar), "-o", str(out_tar), check=True)
    assert verify_capsule(str(out_tar))[1] == []
    p = cli("log", str(out_tar), check=True)
    assert len(p.stdout.splitlines()) == 4


def test_merge_into_the_agent_held_here(cli, store: HostStore, state_dir: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """merge AGENT COPY --into: the copy's lines the agent lacked are added,
    byte for byte; every line the agent had stays as it was; working memory
    follows the merged journal; the agent still verifies and appends chain on.
    Refused (nothing written) for an agent this host does not hold, or with -o."""
    from capsulefs.core.store.holder import HolderBook

    _a_tar, b_tar = _diverged(cli, tmp_path, tmp_path / "state-b")
    agent = store.find("ada")
    mine = agent.read(fmt.JOURNAL)
    had = set(split_lines(mine))
    p = cli("merge", "ada", str(b_tar), "--into", "-o", str(tmp_path / "z"))
    assert p.returncode == 1 and "-o does not go with it" in p.stderr
    p = cli("merge", "ada", str(b_tar), "--into", check=True)
    assert "4 events (2 new)" in p.stdout, p.stdout
    merged = agent.read(fmt.JOURNAL)
    lines = split_lines(merged)
    assert had <= set(lines) and len(lines) == 4 and verify_lines(lines) == []
    assert b"bravo was here" in merged
    edits = [json.loads(x) for x in lines if b"memory_edit" in x]
    last = max(edits, key=lambda d: (d["clock"], d["machine"], d["seq"]))
    assert agent.read(fmt.WORKING_MEMORY).decode() == last["text"]
    assert verify_capsule(str(state_dir / "agents" / agent.agent_id))[1] == []
    cli("append", "ada", "--kind", "note", "--text", "after the merge", "-q", check=True)
    assert verify_lines(split_lines(agent.read(fmt.JOURNAL))) == []
    # Not held here: refused, nothing written.
    book = HolderBook(state_dir / "holders")
    held = book.get(agent.agent_id)
    book.put(held.with_(state=held.state.__class__.RETIRED, held_epoch=None, peer="B" * 52))
    before = agent.read(fmt.JOURNAL)
    p = cli("merge", "ada", str(b_tar), "--into")
    assert p.returncode == 1 and "not held" in p.stderr and agent.read(fmt.JOURNAL) == before


def test_merge_refusals(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    a_tar, _ = _diverged(cli, tmp_path, tmp_path / "state-b")
    cli("new", "bob", check=True)
    p = cli("merge", "ada", "bob", "-o", str(tmp_path / "x"))
    assert p.returncode == 1 and "same agent" in p.stderr and not (tmp_path / "x").exists()
    p = cli("merge", str(a_tar), str(a_tar), "-o", str(a_tar))
    assert p.returncode == 1 and "already exists" in p.stderr
    broken = tmp_path / "broken.tar"
    broken.write_bytes(a_tar.read_bytes()[:2000])
    p = cli("merge", str(a_tar), str(broken), "-o", str(tmp_path / "y"))
    assert p.returncode == 1 and "does not verify" in p.stderr and not (tmp_path / "y").exists()


def test_torn_tail_of_a_store_agent_goes_outside_the_capsule(cli, store: HostStore, state_dir: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cli("new", "ada", check=True)
    cli("append", "ada", "--kind", "note", "--text", "before", "-q", check=True)
    agent = store.find("ada")
    with open(agent.path(fmt.JOURNAL), "ab") as f:
        f.write(b'{"clock":2,"id":"ab')  # an append that crashed half way
    cli("append", "ada", "--kind", "note", "--text", "after", "-q", check=True)
    torn = state_dir / "recovery" / agent.agent_id / "timeline_events.jsonl.torn-1"
    assert torn.read_bytes() == b'{"clock":2,"id":"ab'
    lines = split_lines(agent.read(fmt.JOURNAL))
    assert [json.loads(x)["text"] for x in lines] == ["before", "after"]
    cli("export", "ada", "-o", str(tmp_path / "ada.tar"), check=True)
    assert verify_capsule(str(tmp_path / "ada.tar"))[1] == []


def test_a_snapshot_or_export_sees_an_append_whole_or_not_at_all(cli, store: HostStore, state_dir: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """An append from another process writes the journal, then the
    projections and the manifest. A reader of the agent (a snapshot through
    the mount, an export, a merge, a move) takes the agent's files lock
    shared: it waits for the append, and sees its journal line together with
    the working memory it set. A reader that cannot wait says FilesBusy."""
    import threading

    from capsulefs.cli import journal_cmds
    from capsulefs.core.capsule.archive import snapshot_files
    from capsulefs.core.errors import FilesBusy
    from capsulefs.core.view.snapshots import Snapshots

    cli("new", "ada", check=True)
    journal_written, go_on = threading.Event(), threading.Event()
    project = journal_cmds._project

    def slow_project(*args):  # type: ignore[no-untyped-def]
        journal_written.set()  # the event is in the journal, the projections not yet
        assert go_on.wait(10)
        return project(*args)

    monkeypatch.setattr(journal_cmds, "_project", slow_project)
    appender = threading.Thread(target=main, args=(["--state", str(state_dir), "append", "ada", "--kind", "memory_edit",
                                                    "--text", "remember the milk", "-q"],))
    appender.start()
    try:
        assert journal_written.wait(10)
        agent = store.find("ada")
        with pytest.raises(FilesBusy, match="has held its files"):
            Snapshots(str(state_dir / "snaps")).create(agent, "now", wait=0.2)
        seen: list[dict[str, bytes]] = []
        reader = threading.Thread(target=lambda: seen.append(snapshot_files(agent, wait=10)))
        reader.start()
        reader.join(0.3)
        assert reader.is_alive() and seen == []  # waiting for the append
    finally:
        go_on.set()
        appender.join(10)
    reader.join(10)
    assert b"remember the milk" in seen[0][fmt.JOURNAL] and seen[0][fmt.WORKING_MEMORY] == b"remember the milk"


def test_merge_of_copies_named_differently_says_which_name_it_kept(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Two copies of one agent, renamed on one host: merge keeps A's name, and
    now says so instead of dropping B's silently."""
    a_tar, b_tar = _diverged(cli, tmp_path, tmp_path / "state-b")
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    with tarfile.open(a_tar) as tf:
        extract_all(tf, renamed)
    manifest = json.loads((renamed / fmt.MANIFEST).read_text())
    manifest["name"] = "ada-renamed"
    (renamed / fmt.MANIFEST).write_text(json.dumps(manifest))
    p = cli("merge", str(renamed), str(b_tar), "-o", str(tmp_path / "merged"), check=True)
    assert "'ada-renamed'" in p.stderr and "'ada'" in p.stderr and "kept" in p.stderr, p.stderr
    assert json.loads((tmp_path / "merged" / fmt.MANIFEST).read_text())["name"] == "ada-renamed"


def test_reading_a_store_agent_writes_nothing(cli, store: HostStore, state_dir: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """log, verify, export and the store's own open are readers: they replay
    acknowledged bytes from the ring if a crash kept them from the journal,
    but leave what was never acknowledged (a torn tail, a crash's unwritten
    pages past the ring's chain) to a writer's open. log shows whole lines."""
    cli("new", "ada", check=True)
    cli("append", "ada", "--kind", "note", "--text", "before", "-q", check=True)
    agent = store.find("ada")
    garbage = bytes(5000) + b'the end of a line"}\n{"clock":3,"id":"ab'
    with open(agent.path(fmt.JOURNAL), "ab") as f:
        f.write(garbage)
    before = agent.read(fmt.JOURNAL)
    recovery = state_dir / "recovery" / agent.agent_id
    HostStore.open(state_dir)
    log = cli("log", "ada", check=True).stdout.splitlines()
    assert len(log) == 1 and "before" in log[0]
    cli("verify", agent.dir)
    cli("export", "ada", "-o", str(tmp_path / "ada.tar"), check=True)
    assert agent.read(fmt.JOURNAL) == before
    assert not recovery.exists() or list(recovery.iterdir()) == []
    assert verify_capsule(str(tmp_path / "ada.tar"))[1] == []  # the export holds the whole lines only
    cli("append", "ada", "--kind", "note", "--text", "after", "-q", check=True)  # a writer repairs
    lines = split_lines(agent.read(fmt.JOURNAL))
    assert [json.loads(x)["text"] for x in lines] == ["before", "after"]
    assert len(list(recovery.iterdir())) == 1


@pytest.mark.parametrize("columns", [50, 120])
def test_help_fits_the_terminal(columns: int) -> None:
    """Help is wrapped to the terminal's width less 2, as argparse's own
    formatter does (COLUMNS, else the terminal, else 80), for a command and
    its subcommands."""
    env = {"PATH": "/usr/bin:/bin", "COLUMNS": str(columns)}
    for args in (["--help"], ["log", "--help"], ["append", "--help"]):
        p = subprocess.run([sys.executable, "-m", "capsulefs", *args], capture_output=True, text=True, env=env,
                           timeout=120, check=True)
        widths = [len(line) for line in p.stdout.splitlines()]
        assert max(widths) <= columns - 2 and (columns > 100 or max(widths) > columns - 12), (args, p.stdout)
    p = subprocess.run([sys.executable, "-m", "capsulefs", "log", "--help"], capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin"}, timeout=120, check=True)  # a pipe: 80
    assert max(len(line) for line in p.stdout.splitlines()) <= 78
