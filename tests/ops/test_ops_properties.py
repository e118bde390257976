"""Properties of the live view's writes, without a kernel (hypothesis)."""

from __future__ import annotations

import itertools
import json
import os
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capsulefs.core.capsule import format as fmt
from capsulefs.core.journal.record import Record
from capsulefs.core.view.nodes import Kind, Node
from capsulefs.core.store.host_store import HostStore
from helpers import make_agent
from ops_kit import make_live

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

writes = st.lists(st.tuples(st.integers(0, 300), st.text(alphabet="abc\n", max_size=80)), max_size=12)


@SETTINGS
@given(ops=writes, trunc=st.one_of(st.none(), st.integers(0, 200)))
def test_in_place_writes_behave_like_a_file(ops: list[tuple[int, str]], trunc: int | None) -> None:
    with tempfile.TemporaryDirectory() as d:
        store = HostStore.open(Path(d) / "state")
        agent = make_agent(store, "alice", memory="start\n")
        live = make_live(store, Path(d) / "work")
        node = live.lookup(Node(Kind.DIR, agent.agent_id, "memory"), "working_memory.md")
        assert node == Node(Kind.FILE, agent.agent_id, fmt.WORKING_MEMORY)
        model = bytearray(b"start\n")
        h = live.open(node, os.O_WRONLY, 0)
        for off, text in ops:
            data = text.encode()
            if off > len(model):
                model.extend(b"\0" * (off - len(model)))
            model[off:off + len(data)] = data
            h.write(off, data)
        if trunc is not None:
            h.truncate(trunc)
            model = model[:trunc] + b"\0" * max(0, trunc - len(model))
        assert live.open(node, os.O_RDONLY, 0).read(0, 1 << 20) == bytes(model)  # readers see the edit
        h.flush()
        h.release()
        assert store.find("alice").read(fmt.WORKING_MEMORY) == bytes(model)
        events = store.find("alice").read(fmt.JOURNAL).splitlines()
        assert len(events) == (0 if bytes(model) == b"start\n" else 1)


@SETTINGS
@given(texts=st.lists(st.text(max_size=30), min_size=1, max_size=8), cuts=st.lists(st.integers(0, 2000), max_size=6))
def test_journal_lines_split_anywhere_append_in_order(texts: list[str], cuts: list[int]) -> None:
    payload = b"".join(json.dumps({"kind": "note", "text": t}).encode() + b"\n" for t in texts)
    points = sorted({min(c, len(payload)) for c in cuts} | {0, len(payload)})
    with tempfile.TemporaryDirectory() as d:
        store = HostStore.open(Path(d) / "state")
        agent = make_agent(store, "alice")
        live = make_live(store, Path(d) / "work")
        node = Node(Kind.FILE, agent.agent_id, fmt.JOURNAL)
        h = live.open(node, os.O_WRONLY | os.O_APPEND, 0)
        for a, b in itertools.pairwise(points):
            assert h.write(0, payload[a:b]) == b - a
        h.flush()
        h.release()
        recs = [Record.from_line(line) for line in agent.read(fmt.JOURNAL).splitlines()]
        assert [r.event.text for r in recs] == texts  # type: ignore[attr-defined]
        assert [r.seq for r in recs] == list(range(1, len(texts) + 1))


@SETTINGS
@given(lines=st.lists(st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"")), max_size=20),
       tail=st.binary(max_size=20).map(lambda b: b.replace(b"\n", b"")), chunk=st.integers(1, 64))
def test_journal_tail_hashes_whole_lines_only(lines: list[bytes], tail: bytes, chunk: int) -> None:
    import hashlib

    from capsulefs.core.view.journal_tail import JournalTail

    whole = b"".join(line + b"\n" for line in lines)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "j"
        path.write_bytes(whole[: len(whole) // 2])
        t = JournalTail(str(path), chunk=chunk)
        t.refresh()
        with open(path, "r+b") as f:  # grows in place (same inode)
            f.write(whole + tail)
        t.refresh()
        assert (t.size, t.sha256(), t.events) == (len(whole), hashlib.sha256(whole).hexdigest(), len(lines))
