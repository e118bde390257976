"""capsulefs init / id / peer add, ls, rm through the real CLI."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from cli_kit import run_cli

from capsulefs.peer.identity import load_identity


def test_init_id_and_peers(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    out = run_cli("init", state=a, check=True).stdout
    run_cli("init", state=b, check=True)
    ida = run_cli("id", state=a, check=True).stdout.strip()
    idb = run_cli("id", state=b, check=True).stdout.strip()
    assert ida == load_identity(a).host_id and len(ida) == 52 and ida in out
    assert stat.S_IMODE(os.stat(a / "tls" / "host.pem").st_mode) == 0o600
    assert "already initialised" in run_cli("init", state=a, check=True).stdout

    run_cli("peer", "add", "bee", "127.0.0.1:7714", idb, state=a, check=True)
    assert run_cli("peer", "ls", state=a, check=True).stdout == f"bee\t127.0.0.1:7714\t{idb}\n"
    doc = json.loads((a / "peers.json").read_text(encoding="utf-8"))
    assert doc == {"format": "peers/1", "peers": {"bee": {"address": "127.0.0.1:7714", "host_id": idb}}}

    dup = run_cli("peer", "add", "bee2", "h:1", idb, state=a)
    assert dup.returncode == 1 and "already a peer" in dup.stderr
    bad = run_cli("peer", "add", "x", "h:1", "not-an-id", state=a)
    assert bad.returncode == 1 and "base32" in bad.stderr
    own = run_cli("peer", "add", "me", "h:1", ida, state=a)
    assert own.returncode == 1 and "own id" in own.stderr

    run_cli("peer", "rm", "bee", state=a, check=True)
    assert run_cli("peer", "ls", state=a, check=True).stdout == ""
    gone = run_cli("peer", "rm", "bee", state=a)
    assert gone.returncode == 1 and "no peer named" in gone.stderr


def test_id_without_init_says_what_to_do(tmp_path: Path) -> None:
    r = run_cli("id", state=tmp_path / "empty")
    assert r.returncode == 1 and "capsulefs init" in r.stderr
