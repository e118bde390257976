"""Outside JSON is read one strict way (issue 25, findings 1, 2 and 8).

A document or line from outside (a capsule's files, a journal line, a draft
written through the mount or given to ``capsulefs append``, a spec, a holder
record, a peer's header) that holds an integer of thousands of digits, a key
twice, UTF-16 text, nesting past ``MAX_JSON_DEPTH`` or a field out of its
range is the caller's domain error naming the document: EINVAL through the
mount (never failsafe, never another agent's business), one line and exit 1
from the CLI. Journal verification costs memory by lines, not by the value
of a seq. A manifest lists only the capsule's own tree.
"""

from __future__ import annotations

import errno
import hashlib
import json
import tarfile
import tracemalloc
from pathlib import Path

import pytest

from capsulefs.core.capsule import format as fmt
from capsulefs.core.errors import FormatError, SpecError, StoreError
from capsulefs.core.journal.events import Note
from capsulefs.core.journal.record import Record
from capsulefs.core.store.holder import HolderRecord, HolderState
from capsulefs.core.journal.lines import envelope, verify_lines
from capsulefs.core.move import OfferReply
from capsulefs.core.capsule.spec import parse_spec
from capsulefs.core.store.host_store import HostStore
from capsulefs.mount.ops import Operations
from helpers import HOST, export_and_unpack, make_agent
from ops_kit import Client, FakeKernel, _reply, errno_of, make_live
from capsulefs.core.store import layout

HUGE = b"9" * 5000  # past Python's int-digits limit: json.loads raises a plain ValueError
LIMIT = 2**53 - 1

# -- the loader ------------------------------------------------------------------

#: (document, words its refusal must hold)
HOSTILE = [
    (b'{"a":' + HUGE + b"}", "more than 4300 digits"),
    (b'{"a":[1,{"b":-' + HUGE + b"}]}", "more than 4300 digits"),
    (b'{"a":1,"a":2}', "key 'a' appears twice"),
    (b'{"x":{"a":1,"b":2,"a":3}}', "key 'a' appears twice"),
    (json.dumps({"format": "capsule/1"}).encode("utf-16"), "not UTF-8"),  # with its byte order mark
    (json.dumps({"format": "capsule/1"}).encode("utf-16-le"), "NUL bytes"),
    (json.dumps({"format": "capsule/1"}).encode("utf-32"), "not UTF-8"),
    (b'\xef\xbb\xbf{"a":1}', "byte order mark"),
    (b'{"a":"\xed\xa0\x80"}', "not UTF-8"),  # an encoded surrogate
    (b'{"a":"\\ud800"}', "lone UTF-16 surrogate"),
    (b"[" * 65 + b"]" * 65, "nested too deeply"),
    (b'{"a":' * 65 + b"1" + b"}" * 65, "nested too deeply"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"a":NaN}', "NaN is not a JSON number"),
    (b'{"a":1e999}', "1e999 is out of range"),
    (b"{broken", "not valid JSON"),
]


@pytest.mark.parametrize(("data", "words"), HOSTILE, ids=range(len(HOSTILE)))
def test_every_fault_of_outside_json_is_the_callers_error_naming_the_document(data: bytes, words: str) -> None:
    with pytest.raises(FormatError, match=f"^the doc is .*{words}"):
        fmt.load_json(data, "the doc")
    with pytest.raises(SpecError, match=words):  # the caller's class
        fmt.load_json(data, "spec", error=SpecError)


def test_what_the_strict_loader_still_takes() -> None:
    deepest: list = []  # type: ignore[type-arg]
    for _ in range(63):
        deepest = [deepest]
    assert fmt.load_json(b"[" * 64 + b"]" * 64, "x") == deepest
    assert fmt.load_json(b'{"a":"' + b"[{" * 500 + b'"}', "x") == {"a": "[{" * 500}  # brackets in a string
    assert fmt.load_json(b'{"a":"\\ud83d\\ude00","b":' + b"9" * 4300 + b"}", "x") == {"a": "\U0001f600", "b": int("9" * 4300)}
    assert fmt.load_json(' {"a": [1.5, -2e10, true, null]}\n', "x") == {"a": [1.5, -2e10, True, None]}
    wide = {"files": {f"f{i}": {"n": i} for i in range(1000)}}  # many brackets, shallow
    assert fmt.load_json(json.dumps(wide).encode(), "x") == wide


def test_integer_fields_hold_0_to_2_53_minus_1_and_no_bool() -> None:
    assert fmt.FileEntry(sha256="0" * 64, size=LIMIT).size == LIMIT
    assert fmt.Holder(host=HOST, epoch=LIMIT).epoch == LIMIT
    for bad in (LIMIT + 1, -1, True, 1.0, int("9" * 4000)):
        with pytest.raises(FormatError, match="file entry size .* is not an integer from 0 to 2\\*\\*53-1"):
            fmt.FileEntry(sha256="0" * 64, size=bad)  # type: ignore[arg-type]
        with pytest.raises(FormatError, match="holder epoch"):
            fmt.Holder(host=HOST, epoch=bad)  # type: ignore[arg-type]
        with pytest.raises(FormatError, match="epoch"):
            HolderRecord(agent_id="a" * 32, state=HolderState.UNKNOWN, epoch=bad)  # type: ignore[arg-type]
        with pytest.raises(FormatError, match="epoch"):
            OfferReply(agent_id="a" * 32, epoch=bad, accepted=True)  # type: ignore[arg-type]
    with pytest.raises(FormatError, match="n \\(an integer of 13288 bits\\) is not"):  # named briefly, whatever its size
        fmt.check_int(int("9" * 4000), "n")


def _line(seq: int = 1, clock: int = 1, prev: str | None = None, text: str = "x") -> bytes:
    return Record(id="0" * 24, machine="host-a", seq=seq, clock=clock, prev=prev, time="t", event=Note(text=text)).line


def test_journal_envelopes_hold_seq_clock_and_v_to_2_53_minus_1_on_every_path() -> None:
    assert envelope(_line(seq=LIMIT, clock=LIMIT))[0] == (LIMIT, "host-a", LIMIT)
    over = _line(seq=LIMIT, clock=LIMIT).replace(b'"seq":9007199254740991', b'"seq":9007199254740992')
    nested = over.replace(b'"kind"', b'"x":{"y":[{"z":1}]},"kind"')  # deeper than the fast grammar reads
    for line in (over, nested, over.replace(b'"seq":9007199254740992', b'"seq":' + HUGE)):
        with pytest.raises(FormatError):
            envelope(line)
        with pytest.raises(FormatError):
            Record.from_line(line)
        assert verify_lines([line])[0].startswith("line 1: ")
    for v in (b"true", b"9007199254740992"):
        with pytest.raises(FormatError, match="version v"):
            Record.from_line(_line().replace(b'"v":1', b'"v":' + v))


# -- verification costs memory by lines, not by seq values (finding 2) ---------------------


@pytest.mark.parametrize("seq", [10**12, 2 * 10**8])
def test_a_huge_seq_costs_verification_no_memory(seq: int) -> None:
    first = _line()
    lines = [first, _line(seq=seq, clock=2, prev=hashlib.sha256(first).hexdigest()), _line(seq=seq, clock=3)]
    tracemalloc.start()
    try:
        problems = verify_lines(lines)
        _now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
    assert problems[0] == f"line 2: machine host-a seq {seq}: gap, the machine's previous line is seq 1 (line 1)"
    assert problems[1].startswith(f"line 3: machine host-a seq {seq}: differs from line 2")


def test_forks_and_duplicates_are_named_after_a_gap_as_before() -> None:
    first = _line()
    p1 = hashlib.sha256(first).hexdigest()
    second = _line(seq=2, clock=2, prev=p1)
    fifth = _line(seq=5, clock=5, prev=p1)
    problems = verify_lines([first, fifth, second, fifth])
    assert any("line 4: machine host-a seq 5: duplicates line 2" in p for p in problems), problems


# -- through the mount: EINVAL, never failsafe (finding 1) ----------------------------------


@pytest.fixture
def c(store: HostStore, tmp_path: Path) -> Client:
    make_agent(store, "alice")
    make_agent(store, "bob")
    return Client(Operations(make_live(store, tmp_path / "work"), kernel=FakeKernel(), readdir_reply=_reply,
                             uid=0, gid=0))


async def test_hostile_json_an_agent_writes_through_the_mount_is_einval_and_never_failsafe(
        c: Client, store: HostStore) -> None:
    journal, spec = "alice/memory/timeline_events.jsonl", "alice/environment/spec.json"
    lines = [b'{"kind":"note","text":"x","n":' + HUGE + b"}",
             b'{"kind":"tool_call","call_id":"c","name":"t","arguments":{"n":' + HUGE + b"}}",
             b'{"kind":"note","text":"x","text":"y"}',
             json.dumps({"kind": "note", "text": "x"}).encode("utf-16"),
             b'{"kind":"tool_call","call_id":"c","name":"t","arguments":' + b'{"a":' * 70 + b"1" + b"}" * 71]
    specs = [b'{"version":' + HUGE + b"}", b'{"version":1,"version":1}', b'{"version":1,"env":{"A":"1","A":"2"}}',
             json.dumps({"version": 1}).encode("utf-16"), b'{"version":1,"x-a":' + b"[" * 70 + b"]" * 70 + b"}"]
    journal_before, spec_before = (store.find("alice").read(r) for r in (fmt.JOURNAL, fmt.SPEC))
    for line in lines:
        assert await errno_of(c.write(journal, line + b"\n", append=True)) == errno.EINVAL, line[:60]
        assert c.ops.live.failsafe is None, line[:60]
    for doc in specs:
        assert await errno_of(c.write(spec, doc)) == errno.EINVAL, doc[:60]
        assert c.ops.live.failsafe is None, doc[:60]
    await c.create("alice/environment/spec.json.tmp", specs[0])  # an editor's save: write a copy, rename it over
    assert await errno_of(c.rename("alice/environment/spec.json.tmp", spec)) == errno.EINVAL
    assert c.ops.live.failsafe is None
    assert (store.find("alice").read(fmt.JOURNAL), store.find("alice").read(fmt.SPEC)) == (journal_before, spec_before)
    # Every agent's writes still work, the writer's own included.
    for name in ("bob", "alice"):
        await c.write(f"{name}/memory/timeline_events.jsonl", b'{"kind":"note","text":"still here"}\n', append=True)
        assert Record.from_line(store.find(name).read(fmt.JOURNAL).splitlines()[-1]).event == Note(text="still here")
    await c.write(spec, b'{"version":1,"entrypoint":null}')
    assert parse_spec(store.find("alice").read(fmt.SPEC))["entrypoint"] is None


# -- manifests: one form, the capsule's tree only (finding 8) ---------------------


def _forge(capsule: Path, edit: "object") -> None:
    """Rewrite the capsule's manifest.json with ``edit(doc) -> bytes``."""
    doc = json.loads((capsule / fmt.MANIFEST).read_bytes())
    (capsule / fmt.MANIFEST).write_bytes(edit(doc))  # type: ignore[operator]


def _tar(capsule: Path, dest: Path) -> Path:
    with tarfile.open(dest, "w") as tf:
        for p in sorted(capsule.rglob("*")):
            tf.add(p, arcname=str(p.relative_to(capsule)), recursive=False)
    return dest


def _with_extra(doc: dict) -> bytes:  # type: ignore[type-arg]
    doc["files"]["extra/evil.sh"] = {"sha256": hashlib.sha256(b"#!/bin/sh\nrm -rf ~\n").hexdigest(), "size": 19}
    return json.dumps(doc, sort_keys=True, indent=2).encode()


def _size_over(doc: dict) -> bytes:  # type: ignore[type-arg]
    next(iter(doc["files"].values()))["size"] = 2**53
    return json.dumps(doc).encode()


MANIFESTS = {
    "huge size": (lambda d: json.dumps(d).replace('"size": ', '"size": ' + "9" * 5000, 1).encode(), "4300 digits"),
    "size 2**53": (_size_over, "file entry size 9007199254740992 is not an integer from 0 to 2**53-1"),
    "epoch true": (lambda d: json.dumps({**d, "holder": {**d["holder"], "epoch": True}}).encode(), "holder epoch True"),
    "key twice": (lambda d: json.dumps(d)[:-1].encode() + b', "name": "mallory"}', "key 'name' appears twice"),
    "UTF-16": (lambda d: json.dumps(d, indent=2).encode("utf-16"), "not UTF-8"),
    # (refused as what the manifest lists, or, in a tar, as a member the tree has not: the first refusal wins)
    "outside the tree": (_with_extra, "extra"),
}


def _main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str]]:
    """The CLI in this process (the real one, in a subprocess, is the test below)."""
    from capsulefs.cli import main

    capsys.readouterr()
    rc = main(list(argv))
    return rc, capsys.readouterr().err.splitlines()


def _forged_capsule(store: HostStore, tmp_path: Path, case: str) -> tuple[Path, Path, Path]:
    """(a good tar, the forged capsule directory, its tar)."""
    agent = make_agent(store, "alice")
    good_tar, capsule = export_and_unpack(agent, tmp_path)
    _forge(capsule, MANIFESTS[case][0])
    if case == "outside the tree":
        (capsule / "extra").mkdir()
        (capsule / "extra" / "evil.sh").write_bytes(b"#!/bin/sh\nrm -rf ~\n")
    return good_tar, capsule, _tar(capsule, tmp_path / "forged.tar")


@pytest.mark.parametrize("case", list(MANIFESTS))
def test_a_forged_manifest_is_refused_by_verify_import_and_merge_in_one_line(
        case: str, capsys: pytest.CaptureFixture[str], store: HostStore, tmp_path: Path) -> None:
    words = MANIFESTS[case][1]
    good_tar, capsule, tar = _forged_capsule(store, tmp_path, case)
    for path in (capsule, tar):
        rc, err = _main(capsys, "verify", str(path))
        assert rc == 1 and err[-1].startswith("FAILED: ") and len(err) >= 2, err
        if case == "outside the tree":
            # the extra files are refused, as what the manifest lists or as
            # what the tree has not (a tar: the first refused member ends the scan)
            assert all(f"{path}: " in line and "extra" in line for line in err[:-1]), err
        else:
            assert len(err) == 2, err  # the one problem, and the count
            assert err[0].startswith(f"{path}: manifest.json: ") and words in err[0], err
            assert err[1] == f"FAILED: 1 problem(s) in {path}"
    other = tmp_path / "other"
    rc, err = _main(capsys, "--state", str(other), "import", str(tar))
    assert rc == 1 and len(err) == 1 and words in err[0] and "nothing imported" in err[0], err
    assert not list((other / "agents").iterdir()) and not list((other / "staging").iterdir())
    rc, err = _main(capsys, "merge", str(good_tar), str(tar), "-o", str(tmp_path / "merged"))
    assert rc == 1 and len(err) == 1 and words in err[0], err
    assert not (tmp_path / "merged").exists()


def test_the_real_cli_refuses_a_manifest_with_a_huge_number_in_one_line(
        cli, store: HostStore, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    _good, _capsule, tar = _forged_capsule(store, tmp_path, "huge size")
    p = cli("verify", str(tar))
    assert p.returncode == 1 and "Traceback" not in p.stderr and "4300 digits" in p.stderr, p.stderr
    assert len(p.stderr.splitlines()) == 2
    from cli_kit import run_cli

    p = run_cli("import", str(tar), state=tmp_path / "other")
    assert p.returncode == 1 and "Traceback" not in p.stderr and "4300 digits" in p.stderr, p.stderr
    assert len(p.stderr.splitlines()) == 1


def test_a_stored_agent_is_only_its_capsules_files(store: HostStore, tmp_path: Path) -> None:
    agent = make_agent(store, "alice")
    (Path(agent.dir) / "extra").mkdir()
    (Path(agent.dir) / "extra" / "evil.sh").write_bytes(b"#!/bin/sh\n")  # dropped beside the store's files
    assert agent.local_files() == sorted(fmt.REQUIRED_FILES)
    _tar_path, capsule = export_and_unpack(agent, tmp_path)
    assert not (capsule / "extra").exists()
    assert all(fmt.in_tree(p) for p in fmt.Manifest.from_bytes((capsule / fmt.MANIFEST).read_bytes()).files)


@pytest.mark.parametrize(("rel", "edit", "words"), [
    (fmt.SPEC, lambda b: b.replace(b'"version": 1', b'"version": ' + HUGE), "spec is not valid JSON: a number has"),
    (fmt.SNAPSHOT, lambda b: b.replace(b'"files": {', b'"files": {"a": 1, "a": 2, '), "key 'a' appears twice"),
    (fmt.JOURNAL, lambda b: b.replace(b'"seq":1,', b'"seq":' + HUGE + b",", 1), "line 1: journal line is not valid JSON"),
    (fmt.JOURNAL, lambda b: b.replace(b'"seq":1,', b'"seq":9007199254740992,', 1), "event seq 9007199254740992"),
])
def test_hostile_json_in_a_capsules_other_files_is_a_problem_named_by_verify(
        rel: str, edit: "object", words: str, store: HostStore, tmp_path: Path) -> None:
    from capsulefs.core.capsule import archive
    from capsulefs.core.journal.file import open_agent_journal

    agent = make_agent(store, "alice")
    with open_agent_journal(agent, machine=HOST, now=lambda: 1.7e9, new_id=lambda: "0" * 24) as j:
        j.append(Note(text="one"))
    _tar, capsule = export_and_unpack(agent, tmp_path)
    data = edit((capsule / rel).read_bytes())  # type: ignore[operator]
    (capsule / rel).write_bytes(data)
    _forge(capsule, lambda d: json.dumps({**d, "files": {**d["files"], rel: {
        "sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}}}).encode())  # the digest made to match
    _m, problems = archive.verify_capsule(str(capsule))
    assert [p.path for p in problems] == [rel] and words in str(problems[0]), problems


async def test_a_peer_header_with_a_key_twice_or_a_huge_number_is_a_protocol_error() -> None:
    import struct

    import trio.testing

    from capsulefs.peer.errors import PeerProtocolError
    from capsulefs.peer.framing import Framer

    for head, words in [(b'{"type":"call","type":"reply"}', "key 'type' appears twice"),
                        (b'{"type":"call","id":' + HUGE + b"}", "more than 4300 digits")]:
        a, b = trio.testing.memory_stream_pair()
        await a.send_all(struct.pack("!IQ", len(head), 0) + head)
        with pytest.raises(PeerProtocolError, match=f"header is not valid JSON: .*{words}"):
            await Framer(b, "test").receive()


@pytest.mark.capsule_left_broken("the stored manifest is hostile on purpose")
def test_a_stored_manifest_is_read_as_strictly_as_an_imported_one(store: HostStore) -> None:
    agent = make_agent(store, "alice")
    raw = (Path(agent.dir) / fmt.MANIFEST).read_bytes()
    for forged, words in [(raw[:-2] + b',\n  "name": "mallory"\n}\n', "appears twice"),
                          (raw.decode().encode("utf-16"), "not UTF-8")]:
        (Path(agent.dir) / fmt.MANIFEST).write_bytes(forged)
        with pytest.raises(StoreError, match=f"agent {agent.agent_id}: .*{words}"):
            agent.manifest()


# -- the CLI: one line, exit 1 ----------------------------------------------------------------


def test_append_json_with_a_huge_number_is_one_line_and_exit_1(
        cli, store: HostStore, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    make_agent(store, "ada")
    p = cli("append", "ada", "--kind", "note", "--json", '{"text":"x","n":' + "9" * 5000 + "}")  # the real CLI
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[:300]
    assert p.stderr.splitlines() == ["capsulefs: error: --json is not valid JSON: a number has more than 4300 digits"]
    state = str(store.root)
    for extra, words in [('{"text":"x","text":"y"}', "--json is not valid JSON: key 'text' appears twice"),
                         ('{"text":' + '{"a":' * 70 + "1" + "}" * 71, "--json is not valid JSON: nested too deeply")]:
        rc, err = _main(capsys, "--state", state, "append", "ada", "--kind", "note", "--json", extra)
        assert rc == 1 and len(err) == 1 and words in err[0], err
    import io
    import sys

    drafts = b'{"kind":"note","text":"x","n":' + b"9" * 5000 + b"}\n"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(drafts)))
    rc, err = _main(capsys, "--state", state, "append", "ada", "--stdin")
    assert rc == 1 and len(err) == 1 and "line 1 is not valid JSON: a number has more than 4300" in err[0], err
    assert store.find("ada").read(fmt.JOURNAL) == b""


def test_a_manifest_listing_a_file_outside_the_tree_is_refused_by_its_parser(store: HostStore, tmp_path: Path) -> None:
    agent = make_agent(store, "alice")
    _tar_path, capsule = export_and_unpack(agent, tmp_path)
    doc = json.loads((capsule / "manifest.json").read_bytes())
    with pytest.raises(FormatError, match="manifest lists 'extra/evil.sh', which is not a file of a capsule"):
        fmt.Manifest.from_bytes(_with_extra(doc))


# -- host-local files: read with the same strict loader ------------------------------------------

@pytest.mark.parametrize(("doc", "words"), [
    (b'{"layout": 1, "layout": 1}', "key 'layout' appears twice"),
    (b'{"layout": ' + HUGE + b"}", "more than 4300 digits"),
    (b'{"layout": true}', "store layout True is not supported"),
    (b'[1]', "must be a JSON object"),
    (b'\xff{"layout": 1}', "not UTF-8"),
])
def test_a_damaged_store_json_is_one_line_naming_it(tmp_path: Path, doc: bytes, words: str) -> None:
    state = tmp_path / "state"
    HostStore.open(state)
    (state / "store.json").write_bytes(doc)
    with pytest.raises(StoreError) as refused:
        HostStore.open(state)
    assert words in str(refused.value) and "store.json" in str(refused.value) and "\n" not in str(refused.value)


def test_a_grants_file_with_a_key_twice_is_refused_in_one_line(cli, state_dir: Path) -> None:

    cli("new", "ada", check=True)
    agent_id = json.loads(cli("ls", "--json", check=True).stdout)[0]["agent_id"]
    (state_dir / layout.GRANTS_FILE).write_text(
        '{"format": 1, "grants": {"%s": ["A"], "%s": ["B"]}}' % (agent_id, agent_id))
    proc = cli("secret", "grants")
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert "secret-grants.json" in proc.stderr and "appears twice" in proc.stderr


@pytest.mark.parametrize(("doc", "words"), [
    (b'{"capsulefs": "not an object"}', "is not a secrets file"),
    (b'{"capsulefs": {"TOKEN": 7}}', "is not a secrets file"),
    (b'{"capsulefs": {"TOKEN": "a", "TOKEN": "b"}}', "key 'TOKEN' appears twice"),
    (b'["TOKEN"]', "must be a JSON object"),
])
def test_a_damaged_secrets_file_is_one_error_naming_it_and_no_value(tmp_path: Path, doc: bytes, words: str) -> None:
    from capsulefs.agents.keychain import StateFileKeyring
    from capsulefs.core.store.layout import SECRETS_FILE
    from capsulefs.core.errors import CapsuleError

    path = tmp_path / SECRETS_FILE
    path.write_bytes(doc)
    path.chmod(0o600)
    with pytest.raises(CapsuleError) as refused:
        StateFileKeyring(str(tmp_path)).get_password("capsulefs", "TOKEN")
    said = str(refused.value)
    assert words in said and SECRETS_FILE in said and "\n" not in said and '"a"' not in said and "'b'" not in said
