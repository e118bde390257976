"""Secret grants through the CLI (real subprocesses): which agents this host
lets have which of its secrets. The supervisor's side (no start without a
grant) is in test_supervisor; a move's in test_run_move."""

from __future__ import annotations

import json
import os
from pathlib import Path

from capsulefs.core.capsule import format as fmt
from capsulefs.core.capsule.spec import default_spec, spec_bytes
from capsulefs.core.store.host_store import HostStore
from cli_kit import run_cli
from helpers import make_agent
from capsulefs.core.store import layout

KEYS = ["ANTHROPIC_API_KEY", "OPENAI_API_KEY"]


def _spec_file(tmp_path: Path, secrets: list[str]) -> Path:
    spec = default_spec()
    spec["secrets"] = secrets
    path = tmp_path / "spec.json"
    path.write_bytes(spec_bytes(spec))
    return path


def _grants(state: Path) -> dict[str, list[str]]:
    out = run_cli("secret", "grants", state=state, check=True).stdout
    return {line.split()[0]: line.split()[1:] for line in out.splitlines()}


def test_new_grants_what_its_spec_asks_and_an_import_grants_nothing(cli, state_dir: Path, tmp_path: Path) -> None:
    cli("new", "scout", "--spec", str(_spec_file(tmp_path, KEYS)), check=True)
    agent_id = HostStore.open(state_dir).find("scout").agent_id
    assert _grants(state_dir) == {agent_id: KEYS}
    assert os.stat(state_dir / layout.GRANTS_FILE).st_mode & 0o077 == 0
    tar = tmp_path / "scout.tar"
    cli("export", "scout", "-o", str(tar), check=True)
    other = tmp_path / "other"
    run_cli("import", str(tar), state=other, check=True)  # whoever wrote the tar chose its spec
    assert _grants(other) == {}


def test_grant_and_revoke_by_name_or_by_the_id_of_an_agent_still_to_come(cli, state_dir: Path,
                                                                        tmp_path: Path) -> None:
    cli("new", "scout", check=True)
    out = cli("secret", "grant", "scout", "OPENAI_API_KEY", check=True).stdout
    assert "may now be given: OPENAI_API_KEY" in out
    coming = "ab" * 16  # a move will bring it: its grant can be ready before it arrives
    out = cli("secret", "grant", coming, *KEYS, check=True).stdout
    assert f"agent {coming} (not on this host yet)" in out
    scout = HostStore.open(state_dir).find("scout").agent_id
    assert _grants(state_dir) == {scout: ["OPENAI_API_KEY"], coming: KEYS}
    assert "may now be given: no secret" in cli("secret", "revoke", "scout", check=True).stdout
    cli("secret", "revoke", coming, "OPENAI_API_KEY", check=True)
    assert _grants(state_dir) == {coming: ["ANTHROPIC_API_KEY"]}


def test_bad_grants_are_refused_with_a_clear_error(cli, state_dir: Path) -> None:
    for argv, words in [(("secret", "grant", "ghost", "KEY"), "no agent named 'ghost'"),
                        (("secret", "grant", "ab" * 16, "NOT-A-NAME"), "not a secret name: 'NOT-A-NAME'")]:
        proc = cli(*argv)
        assert proc.returncode != 0 and words in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    (state_dir / layout.GRANTS_FILE).write_text('{"format": 1, "grants": {"x": "ALL"}}')
    proc = cli("secret", "grants")
    assert proc.returncode != 0 and "secret-grants.json is not a grants file" in proc.stderr


def test_rm_drops_the_agent_s_grants(cli, state_dir: Path, tmp_path: Path) -> None:
    cli("new", "scout", "--spec", str(_spec_file(tmp_path, KEYS)), check=True)
    cli("rm", "scout", check=True)
    assert _grants(state_dir) == {}


def test_a_state_directory_older_than_grants_keeps_what_its_agents_used(store: HostStore, state_dir: Path) -> None:
    """Made by a capsulefs without grants: no grants file. The first command
    grants every agent there what its spec asks today, once; an agent that
    arrives later gets nothing on its own."""
    old = make_agent(store, "veteran")
    spec = default_spec()
    spec["secrets"] = KEYS
    old.write_files({fmt.SPEC: spec_bytes(spec)})
    make_agent(store, "plain")  # asks for nothing: nothing to grant
    assert not (state_dir / layout.GRANTS_FILE).exists()
    assert _grants(state_dir) == {old.agent_id: KEYS}
    late = make_agent(store, "late")
    late.write_files({fmt.SPEC: spec_bytes(spec)})
    assert _grants(state_dir) == {old.agent_id: KEYS}
    doc = json.loads((state_dir / layout.GRANTS_FILE).read_text())
    assert doc == {"format": 1, "grants": {old.agent_id: KEYS}}


def test_removing_the_grants_file_grants_nothing(cli, state_dir: Path, tmp_path: Path) -> None:
    """Only a state directory older than grants is migrated: a grants file
    removed later (by hand, or as an old error message advised) comes back
    empty, so an imported agent's spec does not get what it names."""
    cli("new", "scout", "--spec", str(_spec_file(tmp_path, KEYS)), check=True)
    tar = tmp_path / "scout.tar"
    cli("export", "scout", "-o", str(tar), check=True)
    other = tmp_path / "other"
    run_cli("import", str(tar), state=other, check=True)
    assert _grants(other) == {}
    (other / layout.GRANTS_FILE).unlink()
    assert _grants(other) == {}
