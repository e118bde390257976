"""MNT/.control/metrics and mount --metrics-file, on a real mount: the series
a scraper or node_exporter's textfile collector reads move with what happens."""

from __future__ import annotations

import errno
import json
import os
import subprocess
from pathlib import Path

import pytest

from capsulefs.core.store.host_store import HostStore
from helpers import make_agent, wait_until
from mount_kit import capsulefs, mounted, needs_fuse
from prom_kit import Family, parse, value

pytestmark = [pytest.mark.fuse, needs_fuse]


@pytest.fixture
def mnt(tmp_path: Path) -> Path:
    return tmp_path / "mnt"


def read_metrics(path: Path) -> dict[str, Family]:
    return parse(path.read_bytes())


def file_metrics(path: Path) -> dict[str, Family] | None:
    """The metrics file's series, or None while it is not there (a reader
    never sees half a file: it is replaced whole, so any file there parses)."""
    try:
        return parse(path.read_bytes())
    except FileNotFoundError:
        return None


def test_metrics_move_with_appends_and_edits(store: HostStore, state_dir: Path, mnt: Path, tmp_path: Path) -> None:
    make_agent(store, "ada")
    textfile = tmp_path / "textfile"
    textfile.mkdir()
    prom = textfile / "capsulefs.prom"
    with mounted(state_dir, mnt, "--no-run", "--metrics-file", str(prom), "--metrics-interval", "0.2"):
        wait_until(prom.exists, "the metrics file")  # (written once the daemon's services start)
        first = file_metrics(prom)
        assert first is not None and value(first, "capsulefs_agents", state="active") == 1
        control = mnt / ".control"
        assert ".control" not in os.listdir(mnt) and os.listdir(control) == ["metrics"]
        assert oct(os.stat(control / "metrics").st_mode & 0o777) == oct(0o444)
        with pytest.raises(PermissionError) as refused:
            (control / "metrics").write_bytes(b"x\n")
        assert refused.value.errno == errno.EPERM
        before = read_metrics(control / "metrics")
        assert value(before, "capsulefs_agents", state="active") == 1
        assert value(before, "capsulefs_agents", state="frozen") == 0
        assert value(before, "capsulefs_failsafe") == 0

        journal = mnt / "ada" / "memory" / "timeline_events.jsonl"
        subprocess.run(["sh", "-c", f"echo '{json.dumps({'kind': 'note', 'text': 'hi'})}' >> '{journal}'"], check=True)
        (mnt / "ada" / "memory" / "working_memory.md").write_text("# notes\n- metrics are on\n")
        (mnt / "ada" / "memory" / "working_memory.md").write_text("# notes\n- metrics are on\n")  # unchanged: no edit

        after = read_metrics(control / "metrics")
        moved = {
            ("capsulefs_journal_events_appended_total", ("kind", "note")): 1,
            ("capsulefs_journal_events_appended_total", ("kind", "memory_edit")): 1,
            ("capsulefs_edits_total", ("file", "working_memory.md")): 1,
            ("capsulefs_edits_total", ("file", "spec.json")): 0,
            ("capsulefs_failsafe_entered_total", ()): 0,
        }
        for (name, label), delta in moved.items():
            labels = dict([label]) if label else {}
            assert value(after, name, **labels) - value(before, name, **labels) == delta, (name, labels)
        assert not any(".control" in f for f in json.loads((mnt / "ada" / "manifest.json").read_bytes())["files"])

        # The file follows: rewritten every 0.2 s, never half written.
        wait_until(lambda: (m := file_metrics(prom)) is not None and
                   value(m, "capsulefs_edits_total", file="working_memory.md") >= 1, "the metrics file to follow")
    final = file_metrics(prom)  # written once more as the daemon stopped
    assert final is not None and value(final, "capsulefs_journal_events_appended_total", kind="note") >= 1
    assert os.listdir(textfile) == ["capsulefs.prom"]  # no temp file left beside it
    assert oct(os.stat(prom).st_mode & 0o777) == oct(0o644)


def test_a_metrics_file_in_a_missing_directory_is_refused_before_mounting(state_dir: Path, mnt: Path,
                                                                          tmp_path: Path) -> None:
    mnt.mkdir(exist_ok=True)
    where = tmp_path / "nowhere" / "capsulefs.prom"
    proc = capsulefs("--state", str(state_dir), "mount", str(mnt), "--metrics-file", str(where), check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [f"capsulefs: error: --metrics-file {where}: no such directory "
                                                f"{where.parent}"]
    assert not os.path.ismount(mnt)
    bad = capsulefs("--state", str(state_dir), "mount", str(mnt), "--metrics-file", str(tmp_path / "m.prom"),
                    "--metrics-interval", "0", check=False)
    assert bad.returncode == 2 and "--metrics-interval" in bad.stderr and not os.path.ismount(mnt)

