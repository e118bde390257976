"""The index follows the journal: appends, merges, embedder changes, disk, corruption."""

from __future__ import annotations

import hashlib
import json
import logging
import tarfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capsulefs.core.capsule import format as fmt
from capsulefs.core.semantic.embedders import HashedEmbedder
from capsulefs.core.semantic.index import merge_indexes, recall, refresh_index, search_capsule, update_index
from capsulefs.core.semantic.access import CapsuleFiles
from capsulefs.core.semantic.text import chunk_spans
from capsulefs.core.semantic.vectors import dump_index, load_index
from index_helpers import CountingEmbedder, Writer, corpus_records, event_id, journal_bytes, merged, same_rows


def _rebuild(records, emb=None):
    index, report = update_index(None, journal_bytes(records), emb or HashedEmbedder())
    assert report.mode == "rebuild"
    return index


def _capsule(tmp_path: Path, records) -> Path:
    root = tmp_path / "cap"
    (root / "memory" / "vector_index").mkdir(parents=True)
    (root / fmt.JOURNAL).write_bytes(journal_bytes(records))
    (root / fmt.VECTOR_INDEX).write_bytes(fmt.empty_vector_index())
    return root


# -- incremental ---------------------------------------------------------------


def test_incremental_updates_equal_a_full_rebuild() -> None:
    records = corpus_records()
    emb = CountingEmbedder()
    index = None
    for cut in (7, 19, 20, 33, 50, len(records)):
        index, report = update_index(index, journal_bytes(records[:cut]), emb)
        assert report.mode in ("rebuild", "append")
    embedded_incrementally = emb.count
    full = CountingEmbedder()
    rebuilt = _rebuild(records, full)
    assert same_rows(index, rebuilt)
    assert index.position == rebuilt.position
    # each chunk was embedded once; the superseded memory m01 (two chunks) only incrementally
    assert records[49].id == event_id("m01")
    assert embedded_incrementally - full.count == len(chunk_spans(records[49].event.text))


def test_up_to_date_index_does_nothing() -> None:
    records = corpus_records()
    index = _rebuild(records)
    emb = CountingEmbedder()
    index2, report = update_index(index, journal_bytes(records), emb)
    assert report.mode == "fresh" and emb.count == 0 and index2 is index


def test_append_indexes_only_the_new_events() -> None:
    records = corpus_records()
    index = _rebuild(records[:40])
    emb = CountingEmbedder()
    index, report = update_index(index, journal_bytes(records), emb)
    assert report.mode == "append"
    assert report.events == len(records) - 40
    assert emb.count == report.added
    assert index.position.events == len(records)


def test_a_half_written_last_line_waits() -> None:
    records = corpus_records()[:5]
    data = journal_bytes(records)
    partial = data + records[0].line[:30]  # a writer is mid-append
    index, _ = update_index(None, partial, HashedEmbedder())
    assert index.position.bytes == len(data) and index.position.events == 5


# -- merges and rewrites ---------------------------------------------------------


def _two_sides():
    base = corpus_records()[:20]
    a, b = Writer("hostA"), Writer("hostB")
    a.seq, a.clock, a.prev = 20, base[-1].clock, base[-1].digest
    b.see(base)
    side_a = base + [a.write(f"a{i}", "user_message", text=f"on host A we tuned the frobnicator step {i}") for i in range(5)]
    side_b = base + [b.write(f"b{i}", "assistant_message", text=f"host B found a flaky quux test number {i}") for i in range(4)]
    return side_a, side_b


def test_merge_is_detected_and_unioned() -> None:
    side_a, side_b = _two_sides()
    union = merged(side_a, side_b)
    index = _rebuild(side_a)
    emb = CountingEmbedder()
    index, report = update_index(index, journal_bytes(union), emb)
    assert report.mode == "union"
    assert emb.count == 4  # only B's four events
    assert same_rows(index, _rebuild(union))
    assert set(index.position.heads) == {"hostA", "hostB"}


def test_merge_indexes_reuses_both_sides() -> None:
    side_a, side_b = _two_sides()
    union = merged(side_a, side_b)
    emb = CountingEmbedder()
    index, report = merge_indexes(_rebuild(side_a), _rebuild(side_b), journal_bytes(union), emb)
    assert report.mode == "union" and emb.count == 0
    assert same_rows(index, _rebuild(union))


def test_a_journal_that_lost_a_head_is_rebuilt() -> None:
    records = corpus_records()
    index = _rebuild(records)
    other = Writer("hostA")  # same machine, different history
    forked = [other.write(f"f{i}", "user_message", text=f"forked history line {i}") for i in range(12)]
    index2, report = update_index(index, journal_bytes(forked), HashedEmbedder())
    assert report.mode == "rebuild" and "hostA" in report.reason
    assert same_rows(index2, _rebuild(forked))


def test_truncated_journal_is_rebuilt() -> None:
    records = corpus_records()
    index = _rebuild(records)
    index2, report = update_index(index, journal_bytes(records[:30]), HashedEmbedder())
    assert report.mode == "rebuild"
    assert same_rows(index2, _rebuild(records[:30]))


# -- embedders -------------------------------------------------------------------


def test_embedder_change_triggers_a_rebuild() -> None:
    records = corpus_records()
    index = _rebuild(records)
    small = HashedEmbedder(dims=256)
    index2, report = update_index(index, journal_bytes(records), small)
    assert report.mode == "rebuild" and "hashed-ngrams/512d" in report.reason
    assert index2.embedder == small.spec and index2.codes.shape[1] == 256


def test_embedder_version_bump_triggers_a_rebuild() -> None:
    class Bumped(HashedEmbedder):
        VERSION = "2"

    records = corpus_records()
    index2, report = update_index(_rebuild(records), journal_bytes(records), Bumped())
    assert report.mode == "rebuild" and index2.embedder.version == "2"


def test_hashed_embedder_is_deterministic_and_normalised() -> None:
    texts = ["Deploy the invoice service", "", "the of and", "ünïcødé ΣΊΣΥΦΟΣ 東京 snake_case_name"]
    a = HashedEmbedder().embed(texts)
    b = HashedEmbedder().embed(texts)
    assert (a == b).all()
    norms = (a.astype("float64") ** 2).sum(axis=1)
    assert norms[0] == pytest.approx(1.0, abs=1e-5) and norms[3] == pytest.approx(1.0, abs=1e-5)
    assert norms[1] == 0 and norms[2] == 0  # nothing but stopwords: no features


# -- on disk ----------------------------------------------------------------------


def test_round_trip_through_disk(tmp_path: Path) -> None:
    records = corpus_records()
    index = _rebuild(records)
    path = tmp_path / "index.json"
    path.write_bytes(dump_index(index))
    loaded, why = load_index(path)
    assert why == "" and loaded is not None
    assert same_rows(loaded, index) and loaded.position == index.position
    assert dump_index(loaded) == dump_index(index)
    doc = json.loads(path.read_bytes())
    assert doc["format"] == "vector-index/1"
    assert doc["embedder"] == {"name": "hashed-ngrams", "dims": 512, "version": HashedEmbedder.VERSION}
    assert doc["journal"]["events"] == len(records)
    assert doc["journal"]["last"] == hashlib.sha256(records[-1].line).hexdigest()


def test_refresh_saves_then_is_fresh(tmp_path: Path) -> None:
    records = corpus_records()
    cap = _capsule(tmp_path, records[:30])
    emb = HashedEmbedder()
    _, _, report = refresh_index(cap, emb)
    assert report.mode == "append"  # the empty index of a new capsule is accepted
    _, _, report = refresh_index(cap, emb)
    assert report.mode == "fresh"
    (cap / fmt.JOURNAL).write_bytes(journal_bytes(records))
    index, _, report = refresh_index(cap, emb)
    assert report.mode == "append"
    assert same_rows(index, _rebuild(records))


@pytest.mark.parametrize(
    "damage",
    ["flip_vector_byte", "flip_entry", "truncate", "garbage", "rows_without_digest", "empty_file"],
)
def test_a_corrupt_index_is_rebuilt_not_trusted(tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str) -> None:
    records = corpus_records()
    cap = _capsule(tmp_path, records)
    emb = HashedEmbedder()
    good, _, _ = refresh_index(cap, emb)
    path = cap / fmt.VECTOR_INDEX
    data = path.read_bytes()
    match damage:
        case "flip_vector_byte":
            i = data.index(b'"data":"') + 100
            bad = data[:i] + (b"A" if data[i : i + 1] != b"A" else b"B") + data[i + 1 :]
        case "flip_entry":
            bad = data.replace(b'"user_message"', b'"tool_result"', 1)
        case "truncate":
            bad = data[: len(data) // 2]
        case "garbage":
            bad = b"\x00\xffnot json"
        case "rows_without_digest":
            doc = json.loads(data)
            del doc["digest"]
            bad = json.dumps(doc).encode()
        case _:
            bad = b""
    path.write_bytes(bad)
    assert load_index(path)[0] is None
    with caplog.at_level(logging.WARNING):
        index, _, report = refresh_index(cap, emb)
    assert report.mode == "rebuild"
    assert "not trusted" in caplog.text
    assert same_rows(index, good)
    assert load_index(path)[0] is not None  # the rebuilt index was saved


def test_memory_in_a_blob_is_read_from_the_capsule(tmp_path: Path) -> None:
    memory = b"# Facts\n\nThe staging database lives on host pg-stage-3.\n"
    sha = hashlib.sha256(memory).hexdigest()
    w = Writer("hostA")
    records = [w.write("u", "user_message", text="hello"), w.write("m", "memory_edit", blob=sha)]
    cap = _capsule(tmp_path, records)
    (cap / "artifacts" / "blobs").mkdir(parents=True)
    (cap / "artifacts" / "blobs" / sha).write_bytes(memory)
    hits = recall(cap, "which host runs the staging database", 1)
    assert hits[0].event == event_id("m") and hits[0].kind == "memory_edit"
    assert "pg-stage-3" in hits[0].snippet
    tar = tmp_path / "cap.tar"
    with tarfile.open(tar, "w") as tf:
        tf.add(cap, arcname=".")
    hits = search_capsule(tar, "which host runs the staging database", 1, embedder=HashedEmbedder())
    assert hits[0].event == event_id("m") and "pg-stage-3" in hits[0].snippet


def test_search_hits_carry_id_kind_time_and_snippet(tmp_path: Path) -> None:
    records = corpus_records()
    cap = _capsule(tmp_path, records)
    hits = search_capsule(cap, "how big is the docker image", 3, embedder=HashedEmbedder(), save=False)
    top = hits[0]
    assert top.event == event_id("a09") and top.kind == "assistant_message"
    assert top.time == records[[r.id for r in records].index(top.event)].time
    assert "340 MB" in top.snippet
    assert (cap / fmt.VECTOR_INDEX).read_bytes() == fmt.empty_vector_index()  # save=False
    assert CapsuleFiles.of(cap).label.endswith("memory/vector_index/index.json")


# -- chunking ---------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from("ab .\n#\t"), max_size=3000), st.integers(min_value=20, max_value=700))
def test_chunks_cover_the_text_in_order(text: str, limit: int) -> None:
    spans = chunk_spans(text, limit)
    last = 0
    for s, e in spans:
        assert last <= s < e <= len(text)
        assert e - s <= limit
        assert not text[s].isspace() and not text[e - 1].isspace()
        last = e
    covered = "".join(text[s:e] for s, e in spans)
    assert "".join(covered.split()) == "".join(text.split())


def test_a_missing_memory_blob_is_skipped_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    w = Writer("hostA")
    records = [w.write("u", "user_message", text="hello there"), w.write("m", "memory_edit", blob="ab" * 32)]
    cap = _capsule(tmp_path, records)
    with caplog.at_level(logging.WARNING):
        hits = recall(cap, "hello", 5)
    assert [h.event for h in hits] == [event_id("u")]
    assert "cannot read blob" in caplog.text


def test_repeated_searches_only_embed_what_is_new(tmp_path: Path) -> None:
    records = corpus_records()
    cap = _capsule(tmp_path, records[:45])
    emb = CountingEmbedder()
    search_capsule(cap, "docker image", 3, embedder=emb, save=False)
    first = emb.count
    search_capsule(cap, "docker image", 3, embedder=emb, save=False)
    assert emb.count == first + 1  # just the query: the unsaved index was kept in memory
    (cap / fmt.JOURNAL).write_bytes(journal_bytes(records))
    search_capsule(cap, "docker image", 3, embedder=emb, save=False)
    added = emb.count - first - 2
    assert added == len(_rebuild(records)) - len(_rebuild(records[:45]))  # the new rows, nothing else


_WORDS = "deploy staging invoice migration backup redis cache tls certificate docker latency flag".split()
_op = st.tuples(
    st.sampled_from(["A", "B"]),
    st.sampled_from(["user_message", "assistant_message", "tool_result", "memory_edit", "reasoning"]),
    st.lists(st.sampled_from(_WORDS), min_size=1, max_size=8),
)


@settings(max_examples=40, deadline=None)
@given(
    base=st.lists(_op, max_size=6),
    ops=st.lists(_op, max_size=14),
    cuts=st.lists(st.integers(min_value=0, max_value=20), max_size=3),
)
def test_any_history_incremental_union_and_merge_equal_a_rebuild(base, ops, cuts) -> None:
    a, b = Writer("hostA"), Writer("hostB")
    n = 0

    def write(w: Writer, kind: str, words: list[str]) -> object:
        nonlocal n
        n += 1
        text = " ".join(words) + f" n{n}"
        if kind == "tool_result":
            return w.write(f"e{n}", kind, call_id="c", content=text)
        return w.write(f"e{n}", kind, text=text)

    shared = [write(a, kind, words) for _who, kind, words in base]
    b.see(shared)
    b.seq, b.prev = 0, None
    side = {"A": list(shared), "B": list(shared)}
    for who, kind, words in ops:
        side[who].append(write(a if who == "A" else b, kind, words))
    union = merged(side["A"], side["B"])
    emb = HashedEmbedder(dims=64)
    expected = _rebuild(union, emb)

    index = None
    for cut in sorted(cuts) + [len(side["A"])]:
        index, _ = update_index(index, journal_bytes(side["A"][:cut]), emb)
    index, report = update_index(index, journal_bytes(union), emb)
    assert same_rows(index, expected)
    assert report.mode in ("fresh", "append", "union")

    ia, ib = _rebuild(side["A"], emb), _rebuild(side["B"], emb)
    counting = CountingEmbedder(emb)
    both, _ = merge_indexes(ia, ib, journal_bytes(union), counting)
    assert same_rows(both, expected)
    assert counting.count == 0  # everything came from one side or the other
