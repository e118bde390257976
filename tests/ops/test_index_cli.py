"""`capsulefs search` / `reindex` and `recall` on store agents and capsule directories."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from capsulefs.core.capsule import archive
from capsulefs.core.capsule import format as fmt
from capsulefs.core.semantic.index import recall
from capsulefs.core.semantic.vectors import load_index
from capsulefs.core.store.host_store import HostStore
from helpers import export_and_unpack, make_agent
from index_helpers import corpus_records, event_id, journal_bytes


def _agent_with_history(store: HostStore):
    agent = make_agent(store, "alice")
    agent.write_files({fmt.JOURNAL: journal_bytes(corpus_records())})
    return agent


def test_search_a_store_agent_by_name(store: HostStore, cli) -> None:
    agent = _agent_with_history(store)
    proc = cli("search", "alice", "how big is the docker image now", "-k", "3", "--embedder", "hashed", check=True)
    lines = proc.stdout.splitlines()
    assert len(lines) == 6  # three hits, two lines each
    assert event_id("a09") in lines[0] and "assistant_message" in lines[0] and "2026-12-02T10:" in lines[0]
    assert "340 MB" in lines[1]
    # the index was saved through the store: the manifest lists its new digest
    data = Path(agent.path(fmt.VECTOR_INDEX)).read_bytes()
    assert agent.manifest().files[fmt.VECTOR_INDEX].sha256 == hashlib.sha256(data).hexdigest()
    index, why = load_index(agent.path(fmt.VECTOR_INDEX))
    assert why == "" and index is not None and index.position.events == len(corpus_records())


def test_search_json_and_kind_filter(store: HostStore, cli) -> None:
    _agent_with_history(store)
    proc = cli("search", "alice", "backups", "--kind", "tool_result", "--json", "--embedder", "hashed", check=True)
    hits = json.loads(proc.stdout)
    assert hits and all(h["kind"] == "tool_result" for h in hits)
    assert set(hits[0]) >= {"event", "kind", "time", "snippet", "score", "start", "end"}


def test_search_a_capsule_directory_read_only(store: HostStore, cli, tmp_path: Path) -> None:
    agent = _agent_with_history(store)
    _tar, cap = export_and_unpack(agent, tmp_path)
    before = (cap / fmt.VECTOR_INDEX).read_bytes()
    proc = cli("search", str(cap), "french locale translations", "--embedder", "hashed", check=True)
    assert event_id("a19") in proc.stdout.splitlines()[0]
    assert (cap / fmt.VECTOR_INDEX).read_bytes() == before
    assert archive.verify_capsule(str(cap))[1] == []


def test_reindex_reports_what_it_did(store: HostStore, cli) -> None:
    _agent_with_history(store)
    first = cli("reindex", "alice", "--embedder", "hashed", check=True).stdout
    assert first.startswith("append:") or first.startswith("rebuild:")
    assert "hashed-ngrams (512 dims" in first
    assert cli("reindex", "alice", "--embedder", "hashed", check=True).stdout.startswith("fresh:")
    assert cli("reindex", "alice", "--rebuild", "--embedder", "hashed", check=True).stdout.startswith("rebuild:")


def test_unknown_agent_is_one_clear_line(cli) -> None:
    proc = cli("search", "nobody", "anything")
    assert proc.returncode == 1
    assert proc.stderr.strip().count("\n") == 0 and "nobody" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_recall_on_an_agent_handle(store: HostStore) -> None:
    agent = _agent_with_history(store)
    hits = recall(agent, "who is on call this week", 5)
    assert hits and hits[0].event == event_id("m02") and "Priya" in hits[0].snippet


def test_search_a_capsule_tar(store: HostStore, cli, tmp_path: Path) -> None:
    agent = _agent_with_history(store)
    tar, _cap = export_and_unpack(agent, tmp_path)
    before = tar.read_bytes()
    proc = cli("search", str(tar), "who is on call this week", "-k", "1", "--embedder", "hashed", check=True)
    assert event_id("m02") in proc.stdout and "Priya" in proc.stdout
    assert tar.read_bytes() == before


def test_search_prints_control_characters_of_a_hit_as_escapes(store: HostStore, cli) -> None:
    """A hit's snippet is journal text, whatever was appended: search shows
    its control characters (and the bidi overrides that reorder text on
    screen) as escapes, two lines per hit; --json keeps the characters."""
    cli("new", "ada", check=True)
    text = "the backup \x1b[2Jfinished\r at \u202enoon\x9b ok"
    cli("append", "ada", "--kind", "user_message", "--text", text, "-q", check=True)
    out = cli("search", "ada", "backup finished", "--embedder", "hashed", check=True).stdout
    lines = out.splitlines()
    assert len(lines) == 2 and out.endswith("\n"), out
    assert not [c for c in out[:-1] if c != "\n" and (ord(c) < 32 or 0x7F <= ord(c) <= 0x9F or c == "\u202e")], out
    assert "\\x1b[2Jfinished at \\u202enoon\\u009b ok" in lines[1]  # (a snippet makes whitespace one space)
    hits = json.loads(cli("search", "ada", "backup finished", "--json", "--embedder", "hashed", check=True).stdout)
    assert "\x1b[2Jfinished at \u202enoon\x9b ok" in hits[0]["snippet"]
