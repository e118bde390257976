"""Export, import, verify: whatever an agent holds survives the round trip."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capsulefs.core.capsule import archive
from capsulefs.core.capsule import format as fmt
from capsulefs.core.capsule.signing import generate_keypair
from capsulefs.core.store.host_store import HostStore

from helpers import extract_all, make_agent

segment = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_-.", min_size=1, max_size=12).filter(
    lambda s: s not in (".", "..")
)
wpath = st.lists(segment, min_size=1, max_size=3).map("/".join)
workspace = st.dictionaries(wpath, st.binary(max_size=3000), max_size=6).filter(
    # a path cannot be both a file and a directory
    lambda d: not any(a != b and b.startswith(a + "/") for a in d for b in d)
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ws=workspace, memory=st.text(max_size=2000), suffix=st.sampled_from([".tar", ".tar.gz", ".tar.zst"]))
def test_export_import_verify_round_trip(ws: dict[str, bytes], memory: str, suffix: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        src = HostStore.open(t / "src")
        agent = make_agent(src, "rt", workspace=ws, memory=memory)
        tar = t / f"rt{suffix}"
        archive.export_agent(agent, str(tar), mtime=0)
        manifest, probs = archive.verify_capsule(str(tar))
        assert probs == []
        dst = HostStore.open(t / "dst")
        got = archive.import_tar(dst, str(tar))
        assert got.agent_id == agent.agent_id
        assert got.read(fmt.WORKING_MEMORY).decode() == memory
        snap = fmt.parse_snapshot(got.read(fmt.SNAPSHOT))
        assert {p: dst.read_blob(s) for p, s in snap.items()} == ws
        assert got.current_manifest().files == manifest.files
        # and back out again: identical manifest
        again = t / "again.tar"
        archive.export_agent(got, str(again), mtime=0)
        assert archive.verify_capsule(str(again)) == (manifest, [])


def test_signed_export_verifies_only_with_its_key(store: HostStore, tmp_path: Path) -> None:
    agent = make_agent(store)
    key, pub = generate_keypair(str(tmp_path / "key"))
    other_key, other_pub = generate_keypair(str(tmp_path / "other"))
    tar = tmp_path / "signed.tar"
    archive.export_agent(agent, str(tar), mtime=0, sign_key=Path(key).read_bytes())
    assert archive.verify_capsule(str(tar), pubkey=Path(pub).read_bytes())[1] == []
    probs = archive.verify_capsule(str(tar), pubkey=Path(other_pub).read_bytes())[1]
    assert [p.what for p in probs] == ["signature"]
    assert "not by the given public key" in str(probs[0])
    assert oct(Path(key).stat().st_mode & 0o777) == "0o600"


def test_signature_breaks_when_manifest_changes(store: HostStore, tmp_path: Path) -> None:
    import tarfile

    agent = make_agent(store)
    key, pub = generate_keypair(str(tmp_path / "key"))
    tar = tmp_path / "signed.tar"
    archive.export_agent(agent, str(tar), mtime=0, sign_key=Path(key).read_bytes())
    out = tmp_path / "x"
    with tarfile.open(tar) as tf:
        extract_all(tf, out)
    m = out / fmt.MANIFEST
    m.write_bytes(m.read_bytes().replace(b'"epoch": 1', b'"epoch": 7'))
    probs = archive.verify_capsule(str(out), pubkey=Path(pub).read_bytes())[1]
    assert any("manifest was changed after signing" in str(p) for p in probs)
