"""``capsulefs render``: an agent of the store, a capsule directory, errors."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from capsulefs.cli import main
from capsulefs.core.capsule import format as fmt
from capsulefs.core.journal.events import ModelSwitch, ToolCall, UserMessage
from capsulefs.core.journal.file import open_journal
from capsulefs.core.render import INTERRUPTED
from helpers import HOST, export_and_unpack, make_agent


@pytest.fixture
def alice(store, tmp_path: Path):
    agent = make_agent(store, "alice", memory="remember the milk\n")
    ids = (f"{n:024x}" for n in itertools.count(1))
    with open_journal(agent.path(fmt.JOURNAL), machine=HOST, now=lambda: 1764684000.0, new_id=lambda: next(ids),
                      recovery_dir=tmp_path / "recovery", create=False) as journal:
        journal.append_many([
            ModelSwitch(provider="anthropic", model="claude-a"),
            UserMessage(text="list the files " + "word " * 400),
            ToolCall(call_id="c1", name="shell", arguments={"command": "ls"}),
        ])
    return agent


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_render_an_agent_for_its_current_model(alice, state_dir, capsys) -> None:
    rc, out, err = run(capsys, "--state", str(state_dir), "render", "alice")
    assert rc == 0, err
    body = json.loads(out)
    assert body["model"] == "claude-a" and "remember the milk" in body["system"]
    assert body["messages"][-1]["content"][0]["content"] == INTERRUPTED  # the dangling call, answered


def test_render_for_another_provider_with_a_budget(alice, state_dir, capsys) -> None:
    rc, out, err = run(capsys, "--state", str(state_dir), "render", alice.agent_id, "--provider", "openai-chat",
                       "--model", "gpt-x", "--budget", "300", "--compact", "--stats", "--no-memory")
    assert rc == 0, err
    assert out.count("\n") == 1
    assert int(err.split(", ")[-1].split()[0]) <= 300
    body = json.loads(out)
    assert body["model"] == "gpt-x" and body["messages"][0]["content"].startswith("[Earlier conversation omitted")
    assert "1 units kept, 1 dropped" in err and "remember the milk" not in out


def test_render_a_capsule_directory(alice, tmp_path, capsys) -> None:
    _, capsule = export_and_unpack(alice, tmp_path)
    rc, out, err = run(capsys, "render", str(capsule), "--provider", "gemini", "--model", "gem-a")
    assert rc == 0, err
    body = json.loads(out)
    assert body["contents"][0]["parts"][0]["text"].startswith("list the files")
    assert "remember the milk" in body["systemInstruction"]["parts"][0]["text"]


def test_render_errors_name_the_problem(alice, state_dir, capsys) -> None:
    rc, _, err = run(capsys, "--state", str(state_dir), "render", "nobody")
    assert rc == 1 and "nobody" in err
    rc, _, err = run(capsys, "--state", str(state_dir), "render", "alice", "--budget", "20")
    assert rc == 1 and "budget of 20 tokens" in err
    with pytest.raises(SystemExit):
        main(["render", "alice", "--provider", "nope"])


def test_render_tools_come_from_the_journal_or_a_file(alice, state_dir, tmp_path, capsys) -> None:
    rc, out, err = run(capsys, "--state", str(state_dir), "render", "alice")
    assert rc == 0 and "tools" not in json.loads(out)  # none journaled
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([{"name": "shell", "description": "run a command",
                                  "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}]))
    rc, out, err = run(capsys, "--state", str(state_dir), "render", "alice", "--tools", str(tools))
    assert rc == 0, err
    assert json.loads(out)["tools"] == [{"name": "shell", "description": "run a command", "input_schema": {
        "type": "object", "properties": {"command": {"type": "string"}}}}]
    # journaled, the last tools event goes with every render; --tools replaces it
    for name in ("old_tool", "grep"):
        rc, _, err = run(capsys, "--state", str(state_dir), "append", "alice", "--kind", "tools", "--json",
                         json.dumps({"tools": [{"name": name, "parameters": {"type": "object", "properties": {}}}]}))
        assert rc == 0, err
    rc, out, err = run(capsys, "--state", str(state_dir), "render", "alice")
    assert rc == 0, err
    assert [t["name"] for t in json.loads(out)["tools"]] == ["grep"]
    rc, out, err = run(capsys, "--state", str(state_dir), "render", "alice", "--tools", str(tools))
    assert [t["name"] for t in json.loads(out)["tools"]] == ["shell"]
    tools.write_text('[{"name": "shell", "parameters": "none"}]')
    rc, _, err = run(capsys, "--state", str(state_dir), "render", "alice", "--tools", str(tools))
    assert rc == 1 and "parameters must be a JSON schema object" in err and err.count("\n") == 1


@pytest.mark.capsule_left_broken("the journal names a blob the capsule lacks, for verify to name")
def test_verify_names_an_attachment_whose_blob_the_capsule_lacks(alice, tmp_path, capsys) -> None:
    from capsulefs.core.capsule.verify import check, scan_dir
    from capsulefs.core.journal.events import Attachment

    sha = alice.store.put_blob(b"\x89PNG picture")
    with open_journal(alice.path(fmt.JOURNAL), machine=HOST, now=lambda: 1764684001.0, new_id=lambda: "f" * 24,
                      recovery_dir=tmp_path / "recovery", create=False) as journal:
        journal.append_many([Attachment(blob=sha, media_type="image/png", size=13)])
    _, capsule = export_and_unpack(alice, tmp_path)
    problems = [str(p) for p in check(scan_dir(str(capsule)))[1]]
    assert any(f"attachment needs blob {sha}, which the capsule lacks" in p for p in problems)


def test_append_takes_an_attachment_only_for_a_blob_of_the_store_with_its_size(alice, store, tmp_path,
                                                                              capsys) -> None:
    import hashlib

    png = b"\x89PNG\r\n\x1a\n picture"
    sha = hashlib.sha256(png).hexdigest()
    draft = {"blob": sha, "media_type": "image/png", "size": len(png)}
    before = alice.read(fmt.JOURNAL)
    rc, _, err = run(capsys, "--state", str(store.root), "append", "alice", "--kind", "attachment", "--json",
                     json.dumps(draft))
    assert rc == 1 and f"blob {sha} is not in the store" in err
    store.put_blob(png)
    rc, _, err = run(capsys, "--state", str(store.root), "append", "alice", "--kind", "attachment", "--json",
                     json.dumps(draft | {"size": 3}))
    assert rc == 1 and f"size 3 but the blob has {len(png)} bytes" in err
    assert alice.read(fmt.JOURNAL) == before
    rc, _, err = run(capsys, "--state", str(store.root), "append", "alice", "--kind", "attachment", "--json",
                     json.dumps(draft))
    assert rc == 0, err
    assert alice.manifest().blobs()[sha] == len(png)  # listed: gc keeps it, export carries it
    _, capsule = export_and_unpack(alice, tmp_path)
    from capsulefs.core.capsule.verify import check, scan_dir

    assert check(scan_dir(str(capsule)))[1] == []
