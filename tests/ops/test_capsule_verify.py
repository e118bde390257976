"""verify names every problem: changed, truncated, missing, unlisted, unsafe."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from capsulefs.core.capsule import archive
from capsulefs.core.capsule import format as fmt
from capsulefs.core.store.host_store import HostStore

from helpers import export_and_unpack, make_agent


@pytest.fixture
def capsule(store: HostStore, tmp_path: Path) -> Path:
    agent = make_agent(store)
    _tar, out = export_and_unpack(agent, tmp_path)
    return out


def _listed_files(capsule: Path) -> list[str]:
    m = fmt.Manifest.from_bytes((capsule / fmt.MANIFEST).read_bytes())
    return sorted(m.files)


def problems(path: Path) -> list[str]:
    _m, probs = archive.verify_capsule(str(path))
    return [str(p) for p in probs]


def test_fresh_export_verifies(capsule: Path) -> None:
    assert problems(capsule) == []
    listed = _listed_files(capsule)
    for required in fmt.REQUIRED_FILES:
        assert required in listed
    assert sum(1 for p in listed if p.startswith(fmt.BLOBS_DIR + "/")) == 2


def test_every_file_of_the_format_is_checked(capsule: Path) -> None:
    """For every listed file: one changed byte, truncation, deletion; each named."""
    for rel in _listed_files(capsule):
        p = capsule / rel
        original = p.read_bytes()
        if original:
            p.write_bytes(bytes([original[0] ^ 0x01]) + original[1:])
            msgs = problems(capsule)
            assert any(m.startswith(f"{rel}: changed") for m in msgs), (rel, msgs)
            p.write_bytes(original[:-1])
            msgs = problems(capsule)
            assert any(m.startswith(f"{rel}: truncated") for m in msgs), (rel, msgs)
        p.unlink()
        msgs = problems(capsule)
        assert any(m.startswith(f"{rel}: listed in the manifest but missing") for m in msgs), (rel, msgs)
        p.write_bytes(original)
        assert problems(capsule) == [], rel


def test_unlisted_file_anywhere_is_named(capsule: Path) -> None:
    for rel in ("stray.txt", "memory/extra.md", f"{fmt.BLOBS_DIR}/{'0' * 64}"):
        (capsule / rel).write_bytes(b"x")
        msgs = problems(capsule)
        assert f"{rel}: present but not listed in the manifest" in msgs
        (capsule / rel).unlink()


def test_manifest_tampering_and_missing_manifest(capsule: Path) -> None:
    m = capsule / fmt.MANIFEST
    raw = m.read_bytes()
    m.write_bytes(raw.replace(b'"format": "capsule/1"', b'"format": "capsule/9"'))
    assert any("format 'capsule/9'" in x for x in problems(capsule))
    m.unlink()
    assert any(x.startswith("manifest.json: missing") for x in problems(capsule))


def test_links_and_devices_are_problems(capsule: Path) -> None:
    os.symlink("/etc/passwd", capsule / "memory" / "link")
    os.mkfifo(capsule / "fifo")
    msgs = problems(capsule)
    assert any(m.startswith("memory/link: is a symbolic link") for m in msgs)
    assert any(m.startswith("fifo: is a device, fifo or socket") for m in msgs)


def test_manifest_with_unsafe_path_is_refused(capsule: Path) -> None:
    m = capsule / fmt.MANIFEST
    m.write_bytes(m.read_bytes().replace(b'"memory/working_memory.md"', b'"../working_memory.md"'))
    msgs = problems(capsule)
    assert any("'../working_memory.md'" in x and "not allowed" in x for x in msgs), msgs


def test_blob_whose_name_lies_is_named(capsule: Path) -> None:
    """A blob listed with its true digest but under another name is caught."""
    import json

    blobs = capsule / fmt.BLOBS_DIR
    victim = sorted(blobs.iterdir())[0]
    fake = "f" * 64
    victim.rename(blobs / fake)
    m = capsule / fmt.MANIFEST
    doc = json.loads(m.read_bytes())
    doc["files"][f"{fmt.BLOBS_DIR}/{fake}"] = doc["files"].pop(f"{fmt.BLOBS_DIR}/{victim.name}")
    m.write_text(json.dumps(doc))
    msgs = problems(capsule)
    assert f"{fmt.BLOBS_DIR}/{fake}: blob name does not match its content (sha256 {victim.name})" in msgs
    assert any("workspace file" in x and victim.name in x for x in msgs)


def test_spec_with_a_secret_value_fails_verify(capsule: Path) -> None:
    import hashlib
    import json

    spec = capsule / fmt.SPEC
    doc = json.loads(spec.read_bytes())
    doc["env"] = {"OPENAI_API_KEY": "sk-123"}
    data = json.dumps(doc).encode()
    spec.write_bytes(data)
    m = capsule / fmt.MANIFEST
    man = json.loads(m.read_bytes())
    man["files"][fmt.SPEC] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    m.write_text(json.dumps(man))
    msgs = problems(capsule)
    assert any(x.startswith(f"{fmt.SPEC}: spec: env OPENAI_API_KEY looks like a secret") for x in msgs), msgs


def test_tar_and_directory_are_judged_alike(store: HostStore, tmp_path: Path) -> None:
    agent = make_agent(store)
    tar, _out = export_and_unpack(agent, tmp_path)
    assert problems(tar) == []
    # Truncating the tar itself is a problem, not a crash.
    data = tar.read_bytes()
    cut = tmp_path / "cut.tar"
    cut.write_bytes(data[: len(data) // 2])
    assert problems(cut) != []


@pytest.mark.parametrize("holder", [{"host": "H"}, {"epoch": 1}, {"host": "H", "x": 1}, {"x": 1}])
def test_manifest_holder_without_host_or_epoch_is_a_problem(capsule: Path, holder: dict) -> None:
    import json

    m = capsule / fmt.MANIFEST
    doc = json.loads(m.read_bytes())
    doc["holder"] = holder
    m.write_text(json.dumps(doc))
    msgs = problems(capsule)
    assert any(x.startswith("manifest.json: manifest.json: holder must be") for x in msgs), msgs
