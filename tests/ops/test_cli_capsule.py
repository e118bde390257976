"""The CLI as a user meets it: real subprocesses, exit codes, one-line errors."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from helpers import extract_all


def test_help_lists_the_commands(cli) -> None:
    out = cli("--help", check=True).stdout
    for cmd in ("new", "verify", "export", "import", "keygen", "gc", "rm"):
        assert cmd in out


def test_new_export_verify_import(cli, tmp_path: Path) -> None:
    assert "created agent demo" in cli("new", "demo", check=True).stdout
    tar = tmp_path / "demo.tar.zst"
    cli("keygen", "-o", str(tmp_path / "k"), check=True)
    cli("export", "demo", "-o", str(tar), "--sign", str(tmp_path / "k"), check=True)
    ok = cli("verify", str(tar), "--pubkey", str(tmp_path / "k.pub"))
    assert ok.returncode == 0 and ok.stdout.startswith("OK:") and "signature verified" in ok.stdout
    plain = cli("verify", str(tar))  # digests only: says that it did not check where the capsule came from
    assert plain.returncode == 0 and plain.stdout.startswith("OK:") and "not checked without --pubkey" in plain.stdout
    other = tmp_path / "other"
    from cli_kit import run_cli

    imp = run_cli("import", str(tar), state=other, check=True)
    assert "imported agent demo" in imp.stdout
    assert "demo" in run_cli("ls", state=other, check=True).stdout


def test_errors_are_one_clear_line_without_traceback(cli, tmp_path: Path) -> None:
    cases = [
        (("export", "ghost", "-o", str(tmp_path / "x.tar")), "no agent named 'ghost'"),
        (("verify", str(tmp_path / "nope")), "no such capsule directory or tar"),
        (("import", str(tmp_path / "nope.tar")), "no such file"),
        (("new", "bad/name"), "must not contain '/'"),
        (("new", ".hidden"), "must not start with '.'"),
        (("new", "a\udcffb"), "is not valid UTF-8"),  # argv bytes b"a\xffb"
    ]
    for argv, words in cases:
        proc = cli(*argv)
        assert proc.returncode != 0, argv
        assert "Traceback" not in proc.stderr, argv
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and words in lines[0], (argv, proc.stderr)


def test_export_names_the_path_given_and_writes_only_tar_names(cli, tmp_path: Path) -> None:
    """A missing directory is named as the user wrote it (not the export's
    temp file); a name whose ending is no tar form export writes (.zip...)
    is refused in one line and nothing is written; each tar form is what
    its name says (tar, gzip, zstd)."""
    cli("new", "ada", check=True)
    missing = tmp_path / "missing" / "dir" / "x.tar"
    proc = cli("export", "ada", "-o", str(missing))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == f"capsulefs: error: No such file or directory: {missing}"
    for name in ("x.zip", "x.tar.bz2", "x.gz", "x"):
        proc = cli("export", "ada", "-o", str(tmp_path / name))
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, name
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and f"{tmp_path / name}: not a tar name" in lines[0] and ".tar.zst" in lines[0], lines
    assert not list(tmp_path.glob("x*")) and not (tmp_path / "missing").exists()  # nothing written
    magic = {"x.tar": None, "x.TAR.GZ": b"\x1f\x8b", "x.tgz": b"\x1f\x8b", "x.tar.zst": b"\x28\xb5\x2f\xfd"}
    for name, head in magic.items():
        cli("export", "ada", "-o", str(tmp_path / name), check=True)
        data = (tmp_path / name).read_bytes()
        if head is None:
            assert data[257:262] == b"ustar", name  # a plain tar's header
        else:
            assert data.startswith(head), name
        assert cli("verify", str(tmp_path / name)).returncode == 0, name


def test_spec_with_secret_value_is_refused_by_new(cli, tmp_path: Path) -> None:
    spec = tmp_path / "spec.json"
    spec.write_text('{"version": 1, "entrypoint": ["true"], "env": {"GITHUB_TOKEN": "ghp_x"}}')
    proc = cli("new", "leaky", "--spec", str(spec))
    assert proc.returncode == 1
    assert "GITHUB_TOKEN looks like a secret" in proc.stderr and '"secrets"' in proc.stderr
    assert "leaky" not in cli("ls", check=True).stdout


def test_spec_file_that_is_not_a_small_regular_file_is_refused(cli, tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # nobody writes to it: must not wait forever
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(1 << 30)  # sparse: fast to make, far larger than any spec
    cases = [
        (fifo, "fifo: empty"),
        ("/dev/zero", "/dev/zero: not a regular file"),
        (tmp_path, ": is a directory"),
        (big, "big.json: larger than"),
        ("/proc/self/mem", "Input/output error: /proc/self/mem"),  # a read that fails names the file
    ]
    for spec, words in cases:
        proc = cli("new", "odd", "--spec", str(spec))
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, (spec, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and words in lines[0], (spec, proc.stderr)
    assert "odd" not in cli("ls", check=True).stdout
    # a pipe with a writer (`--spec <(...)`, /dev/stdin) still works
    good = '{"version": 1, "entrypoint": ["true"]}'
    assert "created agent piped" in cli("new", "piped", "--spec", "/dev/stdin", input=good, check=True).stdout


def test_spec_file_that_is_not_utf8_is_named_as_such(cli, tmp_path: Path) -> None:
    """Not a codec's message: the file, that it is not UTF-8 text, and its
    first byte that is not (bytes that json would read as UTF-16 too)."""
    cases = [
        (b"\xff\xfe\xfd", "byte 0xff at offset 0"),  # a UTF-16 byte order mark, then an odd byte
        (b"\xff\xfe\x00\x01", "byte 0xff at offset 0"),  # read as UTF-16: one character, not JSON
        (b'{"version": 1, "entrypoint": ["caf\xe9"]}', "byte 0xe9 at offset 34"),  # Latin-1
    ]
    for no, (data, words) in enumerate(cases):
        spec = tmp_path / f"spec{no}.json"
        spec.write_bytes(data)
        proc = cli("new", "odd", "--spec", str(spec))
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, (data, proc.stderr)
        assert proc.stderr.strip().splitlines() == [
            f"capsulefs: error: {spec}: spec is not UTF-8 text: {words} is not valid UTF-8"], (data, proc.stderr)
    assert "odd" not in cli("ls", check=True).stdout


def test_verify_exit_code_is_1_and_lists_every_problem(cli, tmp_path: Path) -> None:
    import tarfile

    cli("new", "v", check=True)
    tar = tmp_path / "v.tar"
    cli("export", "v", "-o", str(tar), check=True)
    d = tmp_path / "v"
    with tarfile.open(tar) as tf:
        extract_all(tf, d)
    (d / "memory" / "working_memory.md").write_text("changed")
    (d / "environment" / "spec.json").unlink()
    (d / "unlisted").write_text("x")
    proc = cli("verify", str(d))
    assert proc.returncode == 1
    assert "memory/working_memory.md: grown" in proc.stderr
    assert "environment/spec.json: listed in the manifest but missing" in proc.stderr
    assert "unlisted: present but not listed" in proc.stderr


def _holder(state: Path, agent_id: str):
    from capsulefs.core.store.holder import HolderBook
    from capsulefs.move.host import holders_dir

    return HolderBook(holders_dir(str(state))).get(agent_id)


def test_new_and_import_record_who_holds_the_agent(cli, state_dir: Path, tmp_path: Path) -> None:
    import json

    from cli_kit import run_cli

    cli("new", "held", check=True)
    agent_id = json.loads(cli("ls", "--json", check=True).stdout)[0]["agent_id"]
    rec = _holder(state_dir, agent_id)
    assert rec is not None and rec.runnable and rec.epoch == 1
    tar = tmp_path / "held.tar"
    cli("export", "held", "-o", str(tar), check=True)
    # Another host importing the copy does not get to run it.
    other = tmp_path / "other"
    out = run_cli("import", str(tar), state=other, check=True).stdout
    assert "held: in-doubt: this host may not hold it (imported from an export that says host" in out \
        and "next: capsulefs move held --learn" in out
    assert _holder(other, agent_id).state.value == "unknown"
    # The holder restoring its own export after removing the agent does not
    # simply hold it again (another host may have taken that export since):
    # it is in doubt until it asks its peers; with none to ask, it holds it.
    cli("rm", "held", check=True)
    out = cli("import", str(tar), check=True).stdout
    assert "--learn" in out and not _holder(state_dir, agent_id).runnable
    learned = cli("move", "held", "--learn", check=True).stdout
    assert "held: this host holds it at epoch 1" in learned
    assert _holder(state_dir, agent_id).runnable


def test_export_from_a_read_only_store(tmp_path: Path) -> None:
    """Reading an agent takes its files lock, which creates a lock file: a
    store mounted read-only (a backup, a snapshot of a disk) still exports,
    without the lock (nobody can be appending to it)."""
    import shutil

    from cli_kit import run_cli

    state = _store_with_ada(tmp_path)
    shutil.rmtree(state / "holders")  # a store from before holder records: no lock file, nor its directory
    with _read_only(state, tmp_path / "ro") as ro:
        out = run_cli("export", "ada", "-o", str(tmp_path / "ada.tar"), state=ro)
        assert out.returncode == 0, out.stderr
        assert run_cli("verify", str(tmp_path / "ada.tar")).returncode == 0


def _store_with_ada(tmp_path: Path) -> Path:
    from cli_kit import run_cli

    state = tmp_path / "state"
    run_cli("init", state=state, check=True)
    run_cli("new", "ada", state=state, check=True)
    return state


@contextmanager
def _read_only(state: Path, ro: Path) -> Iterator[Path]:
    """``state`` bind-mounted read-only on ``ro`` (root only, else skip)."""
    import os
    import shutil
    import subprocess

    import pytest

    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("needs root to bind-mount a store read-only")
    ro.mkdir()
    subprocess.run(["mount", "--bind", str(state), str(ro)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], check=True)
        yield ro
    finally:
        subprocess.run(["umount", str(ro)], check=True)


def test_import_installs_under_the_agents_files_lock(cli, tmp_path: Path) -> None:
    """From its files to its holder record, an import holds the agent's
    files lock, which a daemon starting meanwhile waits for (see
    HolderBook.reconcile): here the lock is held first, so the import waits
    before a file of the agent is in the store."""
    import json
    import subprocess
    import time

    from cli_kit import CAPSULEFS, REPO

    from capsulefs.core.store.holder import HolderBook
    from capsulefs.move.host import holders_dir

    cli("new", "ada", check=True)
    agent_id = json.loads(cli("ls", "--json", check=True).stdout)[0]["agent_id"]
    tar = tmp_path / "ada.tar"
    cli("export", "ada", "-o", str(tar), check=True)
    other = tmp_path / "other"
    other.mkdir()
    with HolderBook(holders_dir(other)).files_lock(agent_id, shared=True):
        proc = subprocess.Popen([*CAPSULEFS, "--state", str(other), "import", str(tar)], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            time.sleep(1.5)  # kept: a window in which the import must not get in (it waits for the lock by
            # polling flock with LOCK_NB: no blocked waiter to see in /proc/locks, and an absence has no event)
            assert proc.poll() is None, proc.communicate()
            assert not (other / "agents" / agent_id).exists()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert (other / "agents" / agent_id).is_dir() and "imported agent ada" in out


def test_a_read_only_store_with_a_write_ahead_ring(tmp_path: Path) -> None:
    """Appends leave a write-ahead ring beside the journal. A store mounted
    read-only still reads (export, log) when its journal holds everything
    the ring vouches for; when a crash kept acknowledged events from the
    journal, reading it read-only says so instead of serving it short, and
    the next read-write open replays them."""
    from cli_kit import run_cli

    state = _store_with_ada(tmp_path)
    for text in ("one", "two"):
        run_cli("append", "ada", "--kind", "note", "--text", text, state=state, check=True)
    assert [p.name for p in (state / "journal-wal").iterdir()]  # the ring is there
    journal = next((state / "agents").iterdir()) / "memory" / "timeline_events.jsonl"
    whole = journal.read_bytes()
    with _read_only(state, tmp_path / "ro") as ro:
        out = run_cli("export", "ada", "-o", str(tmp_path / "ada.tar"), state=ro)
        assert out.returncode == 0, out.stderr
        log = run_cli("log", "ada", state=ro)
        assert log.returncode == 0 and "one" in log.stdout and "two" in log.stdout, log.stderr
        # A crash kept the last event from the journal file; the ring has it.
        with open(journal, "r+b") as f:
            f.truncate(whole.rstrip(b"\n").rfind(b"\n") + 1)
        for argv in (["export", "ada", "-o", str(tmp_path / "short.tar")], ["log", "ada"]):
            out = run_cli(*argv, state=ro)
            assert out.returncode != 0 and "cannot be replayed here" in out.stderr, (argv, out.stdout, out.stderr)
        assert not (tmp_path / "short.tar").exists()
        run_cli("ls", state=state, check=True)  # opened read-write: replayed
        assert journal.read_bytes() == whole
        assert "two" in run_cli("log", "ada", state=ro, check=True).stdout


def test_the_command_table_names_what_each_module_registers() -> None:
    """``capsulefs CMD`` imports only CMD's module (cli.COMMANDS): the table
    must say which module registers each command."""
    import argparse
    import importlib

    from capsulefs import cli

    found = {}
    for name in cli.COMMAND_MODULES:
        sub = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(name).register(sub)
        found.update(dict.fromkeys(sub.choices, name))
    assert found == cli.COMMANDS
    assert cli._command(["--state", "log", "-v", "log", "x"]) == "log"
    assert cli._command(["-h", "log"]) is None and cli._command([]) is None


def test_rm_of_an_agent_in_doubt_keeps_what_this_host_had(cli, state_dir: Path, tmp_path: Path) -> None:
    """A host whose holder record of an agent was lost may have acknowledged
    events the holder lacks: rm keeps a whole copy first (a capsule that
    verifies, under recovery/), names it in the REMOVED record, the words of
    ls and the log; rm of a held agent keeps nothing (removed as asked)."""
    import json

    from capsulefs.core.store.holder import HolderState

    cli("new", "walker", check=True)
    cli("append", "walker", "--kind", "user_message", "--text", "only here", check=True)
    agent_id = json.loads(cli("ls", "--json", check=True).stdout)[0]["agent_id"]
    journal = (state_dir / "agents" / agent_id / "memory" / "timeline_events.jsonl").read_bytes()
    (state_dir / "holders" / f"{agent_id}.json").unlink()  # the record lost (a restore, a bad disk)
    cli("rm", "walker", check=True)
    rec = _holder(state_dir, agent_id)
    assert rec.state is HolderState.REMOVED and rec.kept and rec.kept.startswith(f"recovery/{agent_id}/kept-e1-")
    kept = state_dir / rec.kept
    assert "OK" in cli("verify", str(kept), check=True).stdout
    assert (kept / "memory" / "timeline_events.jsonl").read_bytes() == journal  # every acknowledged line
    listed = json.loads(cli("ls", "--json", check=True).stdout)
    assert [(r["name"], r["state"]) for r in listed] == [("walker", "removed")] and rec.kept in listed[0]["line"]
    # A held agent: removed as asked, nothing kept.
    cli("new", "other", check=True)
    other = next(r["agent_id"] for r in json.loads(cli("ls", "--json", check=True).stdout) if r["name"] == "other")
    cli("rm", "other", check=True)
    assert _holder(state_dir, other).kept is None and not (state_dir / "recovery" / other).exists()


def test_status_tells_each_agents_holder_story_and_what_to_run_next(cli, state_dir: Path, tmp_path: Path) -> None:
    """`capsulefs status` (no daemon) says what this host's record of each
    agent means, in the words import and ls use, and the command to run
    next for an agent in doubt; a held agent needs none."""
    import json

    cli("new", "held", check=True)
    cli("new", "doubted", check=True)
    tar = tmp_path / "doubted.tar"
    cli("export", "doubted", "-o", str(tar), check=True)
    cli("rm", "doubted", check=True)
    cli("import", str(tar), check=True)  # (restored from an export: in doubt until a peer answers)
    rows = {r["name"]: r for r in json.loads(cli("status", "--json", check=True).stdout)}
    assert rows["held"]["holder"] == {"state": "held", "reason": "this host holds it at epoch 1", "next": ""}
    assert rows["doubted"]["holder"]["state"] == "in-doubt"
    assert rows["doubted"]["holder"]["next"] == "capsulefs move doubted --learn"
    lines = cli("status", check=True).stdout.splitlines()
    assert lines[0].split()[:3] == ["NAME", "STATE", "HOLDER"]
    assert sorted(line.split()[2] for line in lines[1:3]) == ["held", "in-doubt"]
    nexts = lines[3:]
    assert len(nexts) == 1 and nexts[0].startswith("doubted: in-doubt: ") and \
        nexts[0].endswith("; next: capsulefs move doubted --learn")
    cli("move", "doubted", "--learn", check=True)  # (no peers to ask: this host holds it)
    rows = {r["name"]: r for r in json.loads(cli("status", "--json", check=True).stdout)}
    assert rows["doubted"]["holder"]["state"] == "held"
    assert len(cli("status", check=True).stdout.splitlines()) == 3  # (the table only: nothing to do next)
