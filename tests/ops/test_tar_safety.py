"""Hostile tars are refused by import and verify, and nothing lands anywhere."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from capsulefs.core.capsule import archive
from capsulefs.core.errors import ImportRefused
from capsulefs.core.store.host_store import HostStore

from helpers import export_and_unpack, files_under, make_agent


def _good_members(store: HostStore, tmp_path: Path) -> list[tuple[tarfile.TarInfo, bytes | None]]:
    agent = make_agent(store, "source")
    tar, _ = export_and_unpack(agent, tmp_path, "good")
    out = []
    with tarfile.open(tar) as tf:
        for m in tf.getmembers():
            data = tf.extractfile(m).read() if m.isfile() else None
            out.append((m, data))
    return out


def _write(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> Path:
    with tarfile.open(path, "w") as tf:
        for info, data in members:
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def _extra(name: str, *, kind: bytes = tarfile.REGTYPE, data: bytes = b"evil\n", link: str = "") -> tuple[tarfile.TarInfo, bytes | None]:
    ti = tarfile.TarInfo(name)
    ti.type = kind
    ti.linkname = link
    if kind == tarfile.REGTYPE:
        ti.size = len(data)
        return ti, data
    return ti, None


HOSTILE = {
    "dotdot": [_extra("../../escape")],
    "dotdot-inside": [_extra("memory/../../escape")],
    "absolute": [_extra("/tmp/capsulefs-escape-abs")],
    "symlink": [_extra("memory/evil", kind=tarfile.SYMTYPE, link="/etc/passwd")],
    "symlink-dir": [_extra("artifacts/evil", kind=tarfile.SYMTYPE, link="../../..")],
    "hardlink": [_extra("memory/evil", kind=tarfile.LNKTYPE, link="/etc/passwd")],
    "chardev": [_extra("dev-null", kind=tarfile.CHRTYPE)],
    "blockdev": [_extra("dev-sda", kind=tarfile.BLKTYPE)],
    "fifo": [_extra("fifo", kind=tarfile.FIFOTYPE)],
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_member_is_refused(case: str, store: HostStore, tmp_path: Path) -> None:
    good = _good_members(store, tmp_path)
    jail = tmp_path / "jail"
    jail.mkdir()
    tar = _write(jail / "hostile.tar", good + HOSTILE[case])
    before_outside = files_under(tmp_path)

    _m, probs = archive.verify_capsule(str(tar))
    assert probs, case

    target = HostStore.open(tmp_path / "target")
    before = files_under(tmp_path / "target")
    with pytest.raises(ImportRefused) as exc:
        archive.import_tar(target, str(tar))
    assert "nothing imported" in str(exc.value)
    assert target.agent_ids() == []
    assert files_under(tmp_path / "target") == before  # nothing half-imported, no staging left
    after_outside = {k: v for k, v in files_under(tmp_path).items() if not k.startswith("target/")}
    assert after_outside == before_outside
    assert not os.path.exists("/tmp/capsulefs-escape-abs")
    assert not (tmp_path.parent / "escape").exists()


def test_duplicate_member_is_refused(store: HostStore, tmp_path: Path) -> None:
    good = _good_members(store, tmp_path)
    dup = [(m, d) for m, d in good if m.name.endswith("working_memory.md")]
    tar = _write(tmp_path / "dup.tar", good + dup)
    _m, probs = archive.verify_capsule(str(tar))
    assert any(p.what == "duplicate" for p in probs)
    with pytest.raises(ImportRefused):
        archive.import_tar(HostStore.open(tmp_path / "t"), str(tar))


def test_oversized_member_is_refused(store: HostStore, tmp_path: Path) -> None:
    agent = make_agent(store, "big", workspace={"big.bin": b"x" * 10_000})
    tar, _ = export_and_unpack(agent, tmp_path)
    target = HostStore.open(tmp_path / "t")
    with pytest.raises(ImportRefused, match="over the limit of 4096"):
        archive.import_tar(target, str(tar), max_member=4096)
    assert target.agent_ids() == [] and list(target.all_blobs()) == []


def test_tampered_tar_is_refused_and_store_unchanged(store: HostStore, tmp_path: Path) -> None:
    good = _good_members(store, tmp_path)
    bad = []
    for m, d in good:
        if m.name.endswith("working_memory.md"):
            d = d.replace(b"milk", b"MILK")
        bad.append((m, d))
    tar = _write(tmp_path / "tampered.tar", bad)
    target = HostStore.open(tmp_path / "t")
    with pytest.raises(ImportRefused, match="working_memory.md: changed"):
        archive.import_tar(target, str(tar))
    assert target.agent_ids() == [] and list(target.all_blobs()) == []


def test_tar_made_by_gnu_tar_with_dot_prefix_imports(store: HostStore, tmp_path: Path) -> None:
    import subprocess

    agent = make_agent(store, "dotted")
    _tar, unpacked = export_and_unpack(agent, tmp_path)
    gnu = tmp_path / "gnu.tar"
    subprocess.run(["tar", "-C", str(unpacked), "-cf", str(gnu), "."], check=True)
    assert archive.verify_capsule(str(gnu))[1] == []
    target = HostStore.open(tmp_path / "t")
    imported = archive.import_tar(target, str(gnu))
    assert imported.agent_id == agent.agent_id


def test_member_claiming_more_than_the_file_holds_is_refused_before_its_bytes(store: HostStore, tmp_path: Path) -> None:
    """A header's size claim is checked against the bytes left in a plain
    tar before anything is read or written (a claim a file cannot back is
    how a hostile tar made verify and import hang)."""
    good = _good_members(store, tmp_path)
    st = os.statvfs(tmp_path)
    huge = 2 * st.f_bavail * st.f_frsize + (1 << 30)
    tar = _write(tmp_path / "bomb.tar", good)
    info = tarfile.TarInfo("artifacts/blobs/" + "0" * 64)
    info.size = huge
    with open(tar, "r+b") as f:  # the bomb's header, then a little of its (never ending) data
        data = f.read()
        end = data.rstrip(b"\0")
        end += b"\0" * (-len(end) % 512)
        f.seek(len(end))
        f.write(info.tobuf(tarfile.GNU_FORMAT) + b"\0" * 4096)
        f.truncate()
    target = HostStore.open(tmp_path / "t")
    with pytest.raises(ImportRefused, match=f"claims {huge} bytes, but only 4096 are left in the file"):
        archive.import_tar(target, str(tar), max_member=huge, max_total=2 * huge)
    assert target.agent_ids() == [] and list(target.all_blobs()) == []
    assert os.listdir(target.staging_dir) == []
