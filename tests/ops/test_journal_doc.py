"""docs/journal.md's drafts, appended as a person would (``echo … >>``),
through the mount's operations: the page cannot drift from the code."""

from __future__ import annotations

import json
import re
from pathlib import Path

from capsulefs.core.capsule import archive
from capsulefs.core.capsule import format as fmt
from capsulefs.core.journal.events import KINDS
from capsulefs.core.journal.record import Record
from capsulefs.core.store.host_store import HostStore
from capsulefs.mount.ops import Operations
from helpers import make_agent
from ops_kit import Client, FakeKernel, _reply, make_live

DOC = Path(__file__).resolve().parents[2] / "docs" / "journal.md"
SECTION = "## Appending by hand"


def doc_drafts() -> list[bytes]:
    """Every line of the ```jsonl blocks in the section on appending by hand."""
    text = DOC.read_text()
    start = text.index(SECTION)
    end = text.index("\n## ", start + 1)
    blocks = re.findall(r"^```jsonl\n(.*?)^```$", text[start:end], re.M | re.S)
    assert blocks, f"no ```jsonl block in {DOC.name}'s section {SECTION!r}"
    return [line.encode() for block in blocks for line in block.splitlines()]


def test_the_doc_shows_one_draft_of_every_kind() -> None:
    kinds = [json.loads(line)["kind"] for line in doc_drafts()]
    assert sorted(kinds) == sorted(KINDS), "docs/journal.md must show exactly one draft of every kind"


async def test_every_draft_in_the_doc_appends_through_the_mount(store: HostStore, tmp_path: Path) -> None:
    make_agent(store, "ada", workspace={"README": b"hello\n", "old.txt": b"old\n"})
    c = Client(Operations(make_live(store, tmp_path / "work"), kernel=FakeKernel(), readdir_reply=_reply, uid=0, gid=0))
    drafts = doc_drafts()
    for line in drafts:  # one `echo LINE >> timeline_events.jsonl` each
        await c.write(f"ada/{fmt.JOURNAL}", line + b"\n", append=True)
    records = [Record.from_line(raw) for raw in store.find("ada").read(fmt.JOURNAL).splitlines()]
    assert [r.event.kind for r in records] == [json.loads(d)["kind"] for d in drafts]
    for rec, draft in zip(records, drafts):  # stamped around exactly the fields given
        doc = rec.to_json()
        assert {k: doc[k] for k in json.loads(draft)} == json.loads(draft), draft
    await c.copy_tree("ada", tmp_path / "copy")
    assert archive.verify_capsule(str(tmp_path / "copy"))[1] == []
