"""Real mounts: editors on working memory, the journal, the spec, control files."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import stat
import subprocess
import time
from pathlib import Path

import pytest

from capsulefs.cli import main as cli_main
from capsulefs.core.capsule import format as fmt
from capsulefs.core.store.host_store import HostStore
from helpers import make_agent, wait_until
from mount_kit import capsulefs, check_chains, mounted, needs_fuse, status

pytestmark = [pytest.mark.fuse, needs_fuse]

MEMORY = "# notes\nremember the milk\n"


@pytest.fixture
def mnt(store: HostStore, state_dir: Path, tmp_path: Path):
    make_agent(store, "alice", memory=MEMORY)
    m = tmp_path / "mnt"
    with mounted(state_dir, m):
        yield m / "alice"


def kinds(agent: Path) -> list[str]:
    return [r.kind for r in check_chains((agent / fmt.JOURNAL).read_bytes())]


def verifies(agent: Path) -> None:
    out = capsulefs("verify", str(agent)).stdout
    assert out.startswith("OK:"), out
    listed = json.loads((agent / "manifest.json").read_bytes())["files"]
    assert not [p for p in listed if "swp" in p or "sed" in p or "tmp" in p or p.endswith("~")]


def test_sed_in_place(mnt: Path) -> None:
    subprocess.run(["sed", "-i", "s/milk/bread/", str(mnt / fmt.WORKING_MEMORY)], check=True)
    assert (mnt / fmt.WORKING_MEMORY).read_text() == "# notes\nremember the bread\n"
    assert kinds(mnt) == ["memory_edit"]
    assert os.listdir(mnt / "memory") == sorted(os.listdir(mnt / "memory"))
    assert sorted(os.listdir(mnt / "memory")) == ["timeline_events.jsonl", "vector_index", "working_memory.md"]
    verifies(mnt)


@pytest.mark.skipif(shutil.which("vim") is None, reason="vim is not installed (scripts/setup.sh installs it)")
def test_vim_ex_mode(mnt: Path, tmp_path: Path) -> None:
    env = dict(os.environ, HOME=str(tmp_path))  # no user vimrc
    subprocess.run(["vim", "-es", "-u", "NONE", "-c", "%s/milk/tea/", "-c", "wq", str(mnt / fmt.WORKING_MEMORY)],
                   check=True, env=env, timeout=60, stdin=subprocess.DEVNULL)
    assert (mnt / fmt.WORKING_MEMORY).read_text() == "# notes\nremember the tea\n"
    assert kinds(mnt) == ["memory_edit"]
    verifies(mnt)


@pytest.mark.skipif(shutil.which("vim") is None, reason="vim is not installed (scripts/setup.sh installs it)")
def test_vim_with_swap_and_backup(mnt: Path, tmp_path: Path) -> None:
    env = dict(os.environ, HOME=str(tmp_path))
    subprocess.run(["vim", "-es", "-u", "NONE", "-c", "set swapfile backup writebackup", "-c", "%s/milk/coffee/",
                    "-c", "wq", str(mnt / fmt.WORKING_MEMORY)], check=True, env=env, timeout=60,
                   stdin=subprocess.DEVNULL)
    assert (mnt / fmt.WORKING_MEMORY).read_text() == "# notes\nremember the coffee\n"
    assert kinds(mnt) == ["memory_edit"]
    verifies(mnt)


def test_os_replace_and_in_place_with_fsync(mnt: Path) -> None:
    tmp = mnt / "memory" / ".working_memory.md.tmp"
    tmp.write_text("replaced\n")
    os.replace(tmp, mnt / fmt.WORKING_MEMORY)
    assert (mnt / fmt.WORKING_MEMORY).read_text() == "replaced\n"
    with open(mnt / fmt.WORKING_MEMORY, "w") as f:
        f.write("in place\n")
        f.flush()
        os.fsync(f.fileno())
    assert (mnt / fmt.WORKING_MEMORY).read_text() == "in place\n"
    assert kinds(mnt) == ["memory_edit", "memory_edit"]
    verifies(mnt)


def test_echo_append_to_the_journal(mnt: Path) -> None:
    journal = mnt / fmt.JOURNAL
    sh = subprocess.run(["bash", "-c", f"echo '{{\"kind\":\"user_message\",\"text\":\"hi\"}}' >> {journal}"])
    assert sh.returncode == 0
    recs = check_chains(journal.read_bytes())
    assert [r.kind for r in recs] == ["user_message"] and recs[0].event.text == "hi"  # type: ignore[attr-defined]
    before = journal.read_bytes()
    bad = subprocess.run(["bash", "-c", f"echo '{{\"kind\":\"user_message\"}}' >> {journal}"], capture_output=True, text=True)
    assert bad.returncode != 0 and "Invalid argument" in bad.stderr
    assert journal.read_bytes() == before
    verifies(mnt)


def test_buffered_python_appends_many_events(mnt: Path) -> None:
    journal = mnt / fmt.JOURNAL
    with open(journal, "a") as f:  # an 8 KiB buffer: flushes cut lines anywhere
        for i in range(2000):
            f.write(json.dumps({"kind": "note", "text": f"event {i}"}) + "\n")
    recs = check_chains(journal.read_bytes())
    assert [r.event.text for r in recs] == [f"event {i}" for i in range(2000)]  # type: ignore[attr-defined]


def test_journal_refuses_overwrite_truncate_rename(mnt: Path) -> None:
    journal = mnt / fmt.JOURNAL
    for action in (lambda: open(journal, "w"), lambda: open(journal, "r+b"), lambda: os.truncate(journal, 0),
                   lambda: os.rename(journal, mnt / "memory" / "j"), lambda: os.unlink(journal)):
        with pytest.raises(OSError) as exc:
            action()
        assert exc.value.errno == errno.EPERM
    (mnt / "memory" / "fake").write_text("{}\n")
    with pytest.raises(OSError) as exc:
        os.replace(mnt / "memory" / "fake", journal)
    assert exc.value.errno == errno.EPERM


def test_spec_edit_is_validated(mnt: Path) -> None:
    spec = mnt / fmt.SPEC
    old = spec.read_bytes()
    with pytest.raises(OSError) as exc:
        with open(spec, "w") as f:
            json.dump({"version": 1, "env": {"GITHUB_TOKEN": "ghp_x"}}, f)
    assert exc.value.errno == errno.EINVAL
    assert spec.read_bytes() == old
    good = {"version": 1, "entrypoint": ["python", "main.py"], "env": {}, "secrets": ["GITHUB_TOKEN"]}
    tmp = mnt / "environment" / "spec.json.new"
    tmp.write_text(json.dumps(good))
    os.replace(tmp, spec)
    assert json.loads(spec.read_bytes()) == good
    verifies(mnt)


def test_control_model_and_move(mnt: Path) -> None:
    ctl = mnt / ".control"
    sh = subprocess.run(["bash", "-c", f"echo openai:gpt-5 > {ctl / 'model'}"], capture_output=True, text=True)
    assert sh.returncode == 0, sh.stderr
    assert (ctl / "model").read_text() == "openai-responses:gpt-5\n"  # (openai: the Responses API)
    assert kinds(mnt) == ["model_switch"]
    bad = subprocess.run(["bash", "-c", f"echo nonsense > {ctl / 'model'}"], capture_output=True, text=True)
    assert bad.returncode != 0 and "Invalid argument" in bad.stderr
    move = subprocess.run(["bash", "-c", f"echo hostb > {ctl / 'move'}"], capture_output=True, text=True)
    assert move.returncode != 0 and "Invalid argument" in move.stderr  # no peer of that name
    shown = status(mnt)
    assert (shown["provider"], shown["model"]) == ("openai-responses", "gpt-5")


def test_control_model_takes_one_short_line_or_nothing(mnt: Path) -> None:
    model = mnt / ".control" / "model"
    for data in [b"openai:" + b"m" * (3 << 20) + b"\n",  # the kernel splits it: no part may switch the model
                 b"openai:gpt\x00x\n", b"openai:\x1b[31mred\n", b"openai:gp\tt\n"]:
        fd = os.open(model, os.O_WRONLY)
        try:
            with pytest.raises(OSError) as exc:
                os.write(fd, data)
            assert exc.value.errno == errno.EINVAL, data[:20]
        finally:
            os.close(fd)
    assert model.read_bytes() == b""
    assert kinds(mnt) == []
    model.write_bytes(b" openai-chat:gpt-5 \r\n")
    assert model.read_text() == "openai-chat:gpt-5\n"
    assert kinds(mnt) == ["model_switch"]


def test_backup_by_rename_then_write_anew(mnt: Path) -> None:
    # emacs' default save: rename the file to its backup, write a new file, keep or drop the backup
    wm = mnt / fmt.WORKING_MEMORY
    backup = mnt / "memory" / "working_memory.md~"
    os.rename(wm, backup)
    assert backup.read_text() == MEMORY
    with open(wm, "w") as f:
        f.write("saved by an emacs-like editor\n")
    assert wm.read_text() == "saved by an emacs-like editor\n"
    assert backup.read_text() == MEMORY
    backup.unlink()
    assert kinds(mnt) == ["memory_edit"]
    verifies(mnt)


def test_a_shorter_write_replaces_the_whole_file(mnt: Path) -> None:
    # the shell's `>` opens with O_TRUNC; the kernel sends no separate truncate
    wm = mnt / fmt.WORKING_MEMORY
    subprocess.run(["bash", "-c", f"printf 'x\\n' > {wm}"], check=True)
    assert wm.read_text() == "x\n"
    recs = check_chains((mnt / fmt.JOURNAL).read_bytes())
    assert [(r.kind, r.event.text) for r in recs] == [("memory_edit", "x\n")]  # type: ignore[attr-defined]
    spec = mnt / fmt.SPEC
    short = {"version": 1, "entrypoint": ["sh"]}
    assert len(json.dumps(short)) < len(spec.read_bytes())
    with open(spec, "w") as f:
        json.dump(short, f)
    assert json.loads(spec.read_bytes()) == short
    subprocess.run(["bash", "-c", f": > {wm}"], check=True)
    assert wm.read_bytes() == b""
    with pytest.raises(OSError) as exc:
        os.open(mnt / fmt.JOURNAL, os.O_WRONLY | os.O_APPEND | os.O_TRUNC)
    assert exc.value.errno == errno.EPERM
    texts = [r.event.text for r in check_chains((mnt / fmt.JOURNAL).read_bytes())]  # type: ignore[attr-defined]
    assert texts == ["x\n", ""]  # the spec is not journaled; the refused open appended nothing
    verifies(mnt)


def _write_all(fd: int, data: bytes) -> None:
    while data:  # a short count (the kernel split a large write) is followed by the rest
        data = data[os.write(fd, data):]


def test_a_journal_line_too_long_fails_and_appends_nothing_of_it(mnt: Path) -> None:
    """A 50 MB line (issue 25): the kernel hands the daemon a large write in
    pieces, so write() takes what came before the line grew too long (a
    short count, as at a file size limit) and the write of the rest fails
    with EFBIG; no part of the line is ever appended, however it is cut."""
    journal = mnt / fmt.JOURNAL
    tail = b'{"kind":"note","text":"smuggled"}\n'  # a valid line, if anything after a cut were taken alone
    line = b'{"kind":"note","text":"' + b"x" * (50 << 20) + b'"}' + tail
    fd = os.open(journal, os.O_WRONLY | os.O_APPEND)
    try:
        taken = os.write(fd, line)
        assert taken < 17 << 20
        for piece in (line[taken:], line[taken + (1 << 20):], line[-len(tail):]):  # however the caller goes on
            with pytest.raises(OSError) as exc:
                os.write(fd, piece)
            assert exc.value.errno == errno.EFBIG
        _write_all(fd, b'{"kind":"note","text":"after"}\n')  # (the newline ended the long line)
    finally:
        os.close(fd)
    with pytest.raises(OSError) as exc:  # as Python's buffered writer does it: one error, nothing appended
        with open(journal, "ab") as f:
            f.write(line)
    assert exc.value.errno == errno.EFBIG
    sh = subprocess.run(["bash", "-c", f"head -c {40 << 20} /dev/zero | tr '\\0' x >> {journal}"],
                        capture_output=True, text=True)
    assert sh.returncode != 0 and "File too large" in sh.stderr
    texts = [r.event.text for r in check_chains(journal.read_bytes())]  # type: ignore[attr-defined]
    assert texts == ["after"] and status(mnt)["writable"]
    verifies(mnt)


def test_a_refused_journal_line_does_not_stop_the_next(mnt: Path) -> None:
    journal = mnt / fmt.JOURNAL
    good = b'{"kind":"note","text":"after"}\n'
    bad_writes = [
        [b'{"kind":"note","text":"\\ud800"}\n'],  # a lone surrogate: valid JSON, not encodable text
        [b"[" * 100_000 + b"\n"],  # deeper than the parser goes
        [b'{"kind":"note","text":"' + b"a" * (3 << 20) + b'","x":1}\n'],  # split by the kernel, refused at its end
        [b'{"kind":', b'"note","x":1}\n'],  # the start of the refused line came in an earlier write
    ]
    for i, writes in enumerate(bad_writes):
        fd = os.open(journal, os.O_WRONLY | os.O_APPEND)
        try:
            *before, last = writes
            for w in before:
                _write_all(fd, w)
            with pytest.raises(OSError) as exc:
                _write_all(fd, last)
            assert exc.value.errno == errno.EINVAL
            _write_all(fd, good)
        finally:
            os.close(fd)
        assert status(mnt)["writable"], f"bad line {i} sent the mount read-only"
        texts = [r.event.text for r in check_chains(journal.read_bytes())]  # type: ignore[attr-defined]
        assert texts == ["after"] * (i + 1), f"bad line {i}"
    verifies(mnt)


def _close_a_copy_in_a_child(fd: int) -> None:
    """A child process inherits ``fd`` and exits: the kernel flushes the file."""
    subprocess.run(["true"], pass_fds=(fd,), check=True)


def test_a_child_closing_an_inherited_descriptor_cuts_nothing(mnt: Path) -> None:
    journal = mnt / fmt.JOURNAL
    fd = os.open(journal, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, b'{"kind":"note",')
        _close_a_copy_in_a_child(fd)
        os.write(fd, b'"text":"whole"}\n')
    finally:
        os.close(fd)
    assert [r.event.text for r in check_chains(journal.read_bytes())] == ["whole"]  # type: ignore[attr-defined]
    spec = mnt / fmt.SPEC
    new = json.dumps({"version": 1, "entrypoint": ["python", "agent.py"]}).encode()
    fd = os.open(spec, os.O_WRONLY | os.O_TRUNC)
    try:
        os.write(fd, new[:10])  # not valid yet: the child's close is refused, the bytes stay
        _close_a_copy_in_a_child(fd)
        os.write(fd, new[10:])
    finally:
        os.close(fd)
    assert spec.read_bytes() == new
    verifies(mnt)


def test_a_refused_truncate_fails_the_close(mnt: Path, store: HostStore) -> None:
    # a truncate alone commits at the last close, but a close is still refused if it will be
    spec = mnt / fmt.SPEC
    old = spec.read_bytes()
    fd = os.open(spec, os.O_RDWR)
    os.ftruncate(fd, 0)  # an empty spec is not a spec
    with pytest.raises(OSError) as exc:
        os.close(fd)
    assert exc.value.errno == errno.EINVAL
    assert store.find("alice").read(fmt.SPEC) == old  # never saved
    # The mount drops the edit at the kernel's release, which may come just
    # after close returned: then the old spec shows again.
    wait_until(lambda: spec.read_bytes() == old, "the old spec to show again")
    verifies(mnt)


def test_working_memory_cannot_grow_without_bound(mnt: Path) -> None:
    wm = mnt / fmt.WORKING_MEMORY
    with pytest.raises(OSError) as exc:
        os.truncate(wm, 1 << 40)
    assert exc.value.errno == errno.EFBIG
    sh = subprocess.run(["truncate", "-s", "1T", str(wm)], capture_output=True, text=True)
    assert sh.returncode != 0 and "File too large" in sh.stderr
    with open(wm, "r+b", buffering=0) as f:  # (its close: nothing written was lost, no error)
        with pytest.raises(OSError) as exc:
            f.seek(1 << 30)
            f.write(b"x")
        assert exc.value.errno == errno.EFBIG
        with pytest.raises(OSError) as exc:
            f.truncate(1 << 40)
        assert exc.value.errno == errno.EFBIG
    assert wm.read_text() == MEMORY and status(mnt)["writable"]
    assert kinds(mnt) == []
    verifies(mnt)


def test_a_failed_write_leaves_working_memory_as_it_was(mnt: Path, tmp_path: Path) -> None:
    """70 MB written at once (issue 25): the kernel's first 64 MiB of pieces
    were taken when one went past the limit; the close must not commit
    that cut-off file. The edit is poisoned: every later write and the close
    fail, the file and the journal stay as they were, and the next open
    starts from the saved file."""
    wm = mnt / fmt.WORKING_MEMORY
    big = b"# big\n" + b"y" * (70 << 20)
    fd = os.open(wm, os.O_WRONLY | os.O_TRUNC)
    try:
        taken = os.write(fd, big)
        assert 0 < taken <= 64 << 20  # (the pieces before the limit)
        for write in (lambda: os.write(fd, big[taken:]), lambda: os.write(fd, b"small\n"),
                      lambda: os.ftruncate(fd, 10)):
            with pytest.raises(OSError) as exc:
                write()
            assert exc.value.errno == errno.EFBIG
        assert wm.read_text() == MEMORY  # readers see the file as saved meanwhile
    finally:
        with pytest.raises(OSError) as exc:
            os.close(fd)
        assert exc.value.errno == errno.EFBIG
    src = tmp_path / "big.md"
    src.write_bytes(big)
    for argv in (["cp", str(src), str(wm)], ["bash", "-c", f"cat {src} > {wm}"]):
        sh = subprocess.run(argv, capture_output=True, text=True)
        assert sh.returncode != 0 and "File too large" in sh.stderr, argv
    assert wm.read_text() == MEMORY and kinds(mnt) == [] and status(mnt)["writable"]
    wm.write_text("# small again\n")  # a new open starts anew from the saved file
    assert wm.read_text() == "# small again\n" and kinds(mnt) == ["memory_edit"]
    verifies(mnt)


def test_a_writer_open_across_a_replace_writes_to_the_file_replaced(mnt: Path) -> None:
    wm = mnt / fmt.WORKING_MEMORY
    with open(wm, "r+b", buffering=0) as old:
        old.write(b"# stale\n")
        tmp = mnt / "memory" / ".wm.tmp"
        tmp.write_text("replaced\n")
        os.replace(tmp, wm)  # what an editor's atomic save does
        old.seek(0, os.SEEK_END)
        old.write(b"more of the stale file\n")
    assert wm.read_text() == "replaced\n"
    recs = check_chains((mnt / fmt.JOURNAL).read_bytes())
    assert [(r.kind, r.event.text) for r in recs] == [("memory_edit", "replaced\n")]  # type: ignore[attr-defined]
    verifies(mnt)



def _edit_beside_the_mount(state_dir: Path, text: str) -> None:
    """`capsulefs append --kind memory_edit` (in this process: fast), which
    rewrites working_memory.md in the store, beside the mount."""
    assert cli_main(["--state", str(state_dir), "append", "alice", "-q", "--kind", "memory_edit", "--text", text]) == 0


def test_files_changed_beside_the_mount_read_whole(mnt: Path, state_dir: Path) -> None:
    # The kernel keeps a file's size for a second: a read right after a
    # change made beside the mount was cut at the size it had before.
    wm, manifest = mnt / fmt.WORKING_MEMORY, mnt / fmt.MANIFEST
    longer = MEMORY + "and the eggs, and the flour, and the sugar\n"
    assert os.stat(wm).st_size == len(MEMORY) and os.stat(manifest).st_size
    _edit_beside_the_mount(state_dir, longer)  # the journal grows from 0 bytes: so does the manifest
    assert wm.read_text() == longer
    data = manifest.read_bytes()
    assert json.loads(data)["files"][fmt.JOURNAL]["size"] == len((mnt / fmt.JOURNAL).read_bytes())
    assert hashlib.sha256(data).hexdigest().encode() == os.getxattr(manifest, "user.capsule.sha256")
    verifies(mnt)


def test_an_append_goes_at_the_end_of_memory_changed_beside_the_mount(mnt: Path, state_dir: Path) -> None:
    # O_APPEND writes came at the offset of the kernel's idea of the size: a
    # `>>` right after the memory changed beside the mount overwrote its middle.
    wm = mnt / fmt.WORKING_MEMORY
    longer = MEMORY + "and the eggs, and the flour, and the sugar\n"
    assert os.stat(wm).st_size == len(MEMORY)
    _edit_beside_the_mount(state_dir, longer)
    with open(wm, "ab", buffering=0) as f:
        f.write(b"- appended\n")
    assert wm.read_text() == longer + "- appended\n"
    assert kinds(mnt) == ["memory_edit", "memory_edit"]
    verifies(mnt)


def test_mv_install_cp_from_another_file_system_save_working_memory(mnt: Path, tmp_path: Path) -> None:
    # Across file systems `mv` (and `install`, `cp --remove-destination`)
    # unlink the target, then create it anew with O_EXCL: the unlink was EPERM.
    wm = mnt / fmt.WORKING_MEMORY
    saves = [(["mv"], "moved in\n"), (["install", "-m", "644"], "installed\n"),
             (["cp", "--remove-destination"], "copied in\n")]
    for argv, text in saves:
        src = tmp_path / "new.md"
        src.write_text(text)
        done = subprocess.run([*argv, str(src), str(wm)], capture_output=True, text=True)
        assert (done.returncode, done.stderr) == (0, ""), (argv, done.stderr)
        assert wm.read_text() == text, argv
    recs = check_chains((mnt / fmt.JOURNAL).read_bytes())
    assert [(r.kind, r.event.text) for r in recs] == [("memory_edit", t) for _, t in saves]  # type: ignore[attr-defined]
    spec = mnt / fmt.SPEC
    new = {"version": 1, "entrypoint": ["python", "main.py"]}
    (tmp_path / "spec.json").write_text(json.dumps(new))
    subprocess.run(["mv", str(tmp_path / "spec.json"), str(spec)], check=True)
    assert json.loads(spec.read_bytes()) == new
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    done = subprocess.run(["mv", str(bad), str(spec)], capture_output=True, text=True)
    assert done.returncode != 0 and "Invalid argument" in done.stderr
    assert json.loads(spec.read_bytes()) == new  # a refused spec leaves the old one, shown
    verifies(mnt)


def test_rm_of_working_memory_keeps_the_capsule_whole(mnt: Path) -> None:
    # An unlink only makes room for the process that asked; the capsule
    # keeps its file for everyone else, and nothing is journaled.
    wm = mnt / fmt.WORKING_MEMORY
    subprocess.run(["rm", str(wm)], check=True)
    assert subprocess.run(["cat", str(wm)], capture_output=True, text=True, check=True).stdout == MEMORY
    assert "working_memory.md" in os.listdir(mnt / "memory")
    os.unlink(wm)
    assert not wm.exists()  # for this thread, until it creates the file anew
    with open(wm, "x") as f:
        f.write("recreated\n")
    assert wm.read_text() == "recreated\n"
    assert kinds(mnt) == ["memory_edit"]
    verifies(mnt)


def test_mv_of_a_private_temp_file_saves_without_complaint(mnt: Path, tmp_path: Path) -> None:
    # `tmp=$(mktemp); ...; mv "$tmp" working_memory.md`: the temp file is
    # 0600, and mv sets that mode on the file it creates: refused, mv said
    # "preserving permissions ... Operation not permitted".
    wm = mnt / fmt.WORKING_MEMORY
    src = tmp_path / "tmp.XXXXXX"
    src.write_text("from mktemp\n")
    src.chmod(0o600)
    done = subprocess.run(["mv", str(src), str(wm)], capture_output=True, text=True)
    assert (done.returncode, done.stderr) == (0, "")
    assert wm.read_text() == "from mktemp\n" and stat.S_IMODE(os.stat(wm).st_mode) == 0o644
    with pytest.raises(OSError) as exc:
        os.chmod(wm, 0o600)  # the capsule's modes stay fixed once it is saved
    assert exc.value.errno == errno.EPERM
    assert kinds(mnt) == ["memory_edit"]
    verifies(mnt)


def _sh(script: str, cwd: Path) -> str:
    out = subprocess.run(["bash", "-c", script], cwd=cwd, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_scratch_files_take_the_callers_umask_once_and_have_their_own_times(mnt: Path) -> None:
    """issue 25: `umask 0; touch f` gave 0644 (the daemon's umask applied
    again); atime and ctime read back as mtime; the directory's mtime never
    moved when a scratch name came or went."""
    memory = mnt / "memory"
    assert _sh("umask 0; touch f0; umask 077; touch f77; umask 022; touch f22; stat -c %a f0 f77 f22", memory) \
        .split() == ["666", "600", "644"]
    _sh("touch -a -d '2001-02-03 04:05:06' f0; touch -m -d '2011-12-13 14:15:16' f0", memory)
    st = os.stat(memory / "f0")
    assert time.gmtime(st.st_atime)[:3] == (2001, 2, 3) and time.gmtime(st.st_mtime)[:3] == (2011, 12, 13)
    assert st.st_ctime > st.st_mtime  # (the change was made now)
    before = os.stat(memory).st_mtime_ns
    for step in ("touch newer", "mv newer newest", "rm newest"):
        _sh(step, memory)
        now = os.stat(memory).st_mtime_ns
        assert now > before, step
        before = now
    assert os.stat(mnt / "artifacts").st_mtime_ns < before  # (no scratch files there: its time is fixed)
    for name in ("f0", "f77", "f22"):
        os.unlink(memory / name)
    verifies(mnt)


def test_times_of_working_memory_are_kept_and_read_only_files_refuse_them(mnt: Path, tmp_path: Path) -> None:
    """`touch -d`, `cp -p` and `rsync -a` on working memory returned 0 and
    changed nothing (issue 25): the times are the saved file's now, until
    its content changes; read-only files refuse a change as chmod does."""
    wm = mnt / fmt.WORKING_MEMORY
    _sh(f"touch -d '2001-02-03 04:05:06' {wm}", tmp_path)
    assert time.gmtime(os.stat(wm).st_mtime)[:3] == (2001, 2, 3)
    assert wm.read_text() == MEMORY and kinds(mnt) == []
    src = tmp_path / "notes.md"
    src.write_text("# copied with its time\n")
    src.chmod(0o644)  # (cp -p and rsync -a keep modes and owners too: a capsule file's are fixed)
    os.chown(src, os.stat(wm).st_uid, os.stat(wm).st_gid)  # (the agent's uid, when it runs isolated)
    os.utime(src, (1_000_000_000, 1_100_000_000))
    runs = [["cp", "-p", str(src), str(wm)]]
    if shutil.which("rsync"):
        runs.append(["rsync", "-a", str(src), str(wm)])  # (a scratch temp file, timed, renamed over)
    for argv in runs:
        os.utime(wm, (1, 1))
        run = subprocess.run(argv, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        assert os.stat(wm).st_mtime == 1_100_000_000, argv
        assert wm.read_text() == "# copied with its time\n"
    wm.write_text("# edited\n")  # a new version: its own time
    assert os.stat(wm).st_mtime > 1_100_000_000
    for path in (mnt / "manifest.json", mnt / fmt.SNAPSHOT, mnt / "memory"):
        sh = subprocess.run(["touch", "-d", "2001-02-03", str(path)], capture_output=True, text=True)
        assert sh.returncode != 0 and "Operation not permitted" in sh.stderr, path
    verifies(mnt)


def test_recall_saves_the_semantic_index_through_the_mount(mnt: Path, tmp_path: Path) -> None:
    """The reference agent's recall, on its capsule directory in the mount,
    brings the index up to date and saves it: a temp file in
    memory/vector_index/ renamed over index.json, checked as an index, listed
    by the manifest; a file that is no index is EINVAL and changes nothing."""
    from capsulefs.agents.reference.loop import Toolbox
    from capsulefs.core.semantic.vectors import parse_index

    with open(mnt / fmt.JOURNAL, "a") as f:
        f.write(json.dumps({"kind": "user_message", "text": "The staging database lives on port 5433."}) + "\n")
        f.write(json.dumps({"kind": "user_message", "text": "Lunch is at noon on Fridays."}) + "\n")
    ids = [r.id for r in check_chains((mnt / fmt.JOURNAL).read_bytes())]
    (tmp_path / "ws").mkdir()
    out = Toolbox(str(tmp_path / "ws"), str(mnt)).run("recall", {"query": "which port does staging use", "k": 1})
    assert "5433" in out
    data = (mnt / fmt.VECTOR_INDEX).read_bytes()
    assert {e.event for e in parse_index(data).entries} == set(ids)
    listed = json.loads((mnt / "manifest.json").read_bytes())["files"][fmt.VECTOR_INDEX]
    assert listed["sha256"] == hashlib.sha256(data).hexdigest()
    assert os.listdir(mnt / "memory" / "vector_index") == ["index.json"]  # no temp file left
    verifies(mnt)
    with pytest.raises(OSError) as refused:
        (mnt / fmt.VECTOR_INDEX).write_bytes(b'{"format":"something else"}\n')
    assert refused.value.errno == errno.EINVAL
    assert (mnt / fmt.VECTOR_INDEX).read_bytes() == data
