"""Fuzz targets: a capsule tar given to ``verify`` and to ``import``.

The input is the tar file's bytes. A ``-gz``/``-zst`` target compresses
input that is not already compressed (so tar-level mutations reach the
tar reader through the decompressor), and passes compressed input as it is
(so byte-level mutations reach the decompressor, its CRC and checksum).

What every run checks besides "only CapsuleError escapes":
  * verify: each problem is one line without control characters;
  * import (into a fresh state directory): a refused tar leaves the store as
    it was (no agent, no blob, nothing in staging/); an accepted one is no
    tampered capsule: every file the store now holds for it hashes to its
    manifest, the manifest is the tar's, and verify accepts the same tar.
"""

from __future__ import annotations

import functools
import gzip
import os
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from capsulefs.core.capsule import archive
from capsulefs.core.capsule import format as fmt
from capsulefs.core.errors import CapsuleError, FormatError
from capsulefs.core.hashing import hash_file
from capsulefs.core.store.host_store import HostStore
from capsulefs.core.capsule.tarball import GZIP_MAGIC, ZSTD_MAGIC

from . import Target

Wrap = Callable[[bytes], bytes]


def _plain(data: bytes) -> bytes:
    return data


def _gz(data: bytes) -> bytes:
    return data if data.startswith(GZIP_MAGIC) else gzip.compress(data, compresslevel=1, mtime=0)


def _zst(data: bytes) -> bytes:
    if data.startswith(ZSTD_MAGIC):
        return data
    import zstandard

    return zstandard.ZstdCompressor(level=1, write_checksum=True).compress(data)


class Refused(FormatError):
    """verify listed problems (the target's way to say "bad input")."""


# -- seeds -----------------------------------------------------------------------------


@functools.cache
def _exports() -> dict[str, bytes]:
    """Real exports of a few agents, in each compression, plus a tar GNU tar
    made of an unpacked capsule (./ names, the manifest wherever readdir put it)."""
    from helpers import export_and_unpack, make_agent  # (tests/ is on sys.path)
    from journal_helpers import Replica, note

    from capsulefs.core.capsule import signing

    out: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory(prefix="capsulefs-fuzz-seeds-") as tmp:
        root = Path(tmp)
        store = HostStore.open(root / "state")
        plain = make_agent(store, "plain")
        busy = make_agent(store, "busy", workspace={"src/a.py": b"print(1)\n" * 20, "data/b.bin": bytes(range(256)),
                                                    "empty": b""}, memory="# notes\n- one\n- two\n")
        journal = Replica("TESTHOST")
        journal.append(note("hello"), note("second thought"), note("é ünïcode"))
        busy.write_files({fmt.JOURNAL: journal.data()})
        key, _pub = signing.generate_keypair(str(root / "key"))
        for agent in (plain, busy):
            for ext in ("tar", "tar.gz", "tar.zst"):
                path = root / f"{agent.name}.{ext}"
                archive.export_agent(agent, str(path), mtime=1_700_000_000,
                                     sign_key=Path(key).read_bytes() if agent is busy else None)
                out[f"{agent.name}.{ext}"] = path.read_bytes()
        _tar, unpacked = export_and_unpack(plain, root, "unpacked")
        gnu = root / "gnu.tar"
        subprocess.run(["tar", "-C", str(unpacked), "-cf", str(gnu), "."], check=True)
        out["gnu.tar"] = gnu.read_bytes()
    return out


def _seeds(*exts: str) -> Callable[[], list[bytes]]:
    def seeds() -> list[bytes]:
        return [data for name, data in sorted(_exports().items()) if name.endswith(exts)]

    return seeds


# -- runs ----------------------------------------------------------------------------------


def _one_line(problems: list[archive.Problem]) -> None:
    for p in problems:
        text = str(p)
        assert not fmt.has_control(text), f"a problem is not one clean line: {text[:200]!r}"


def _verify(wrap: Wrap) -> Callable[[bytes, Path], None]:
    def run(data: bytes, scratch: Path) -> None:
        path = scratch / "in.tar"
        path.write_bytes(wrap(data))
        manifest, problems = archive.verify_capsule(str(path))
        _one_line(problems)
        if problems:
            raise Refused(str(problems[0]))
        assert manifest is not None, "verify found no problem and no manifest"

    return run


def _untouched(store: HostStore) -> None:
    assert os.listdir(store.staging_dir) == [], f"left in staging: {os.listdir(store.staging_dir)}"
    assert store.agent_ids() == [], "a refused import left an agent"
    assert list(store.all_blobs()) == [], "a refused import left blobs"


def _import(wrap: Wrap) -> Callable[[bytes, Path], None]:
    def run(data: bytes, scratch: Path) -> None:
        path = scratch / "in.tar"
        path.write_bytes(wrap(data))
        store = HostStore.open(scratch / "state")
        try:
            agent = archive.import_tar(store, str(path))
        except CapsuleError:
            _untouched(store)
            raise
        assert os.listdir(store.staging_dir) == [], f"left in staging: {os.listdir(store.staging_dir)}"
        manifest = agent.manifest()
        for rel, entry in manifest.files.items():
            sha, size = hash_file(agent.path(rel))
            assert (sha, size) == (entry.sha256, entry.size), f"tampered capsule accepted: {rel} differs"
        on_disk = set(agent.local_files())
        listed = {p for p in manifest.files if fmt.blob_name(p) is None}
        assert on_disk == listed, f"imported files not in the manifest: {sorted(on_disk ^ listed)[:5]}"
        shown, problems = archive.verify_capsule(str(path))
        assert problems == [], f"import accepted what verify refuses: {problems[:2]}"
        assert shown == manifest, "import kept another manifest than the tar's"

    return run


TARGETS = [
    Target("archive.verify-tar", _seeds("tar"), _verify(_plain)),
    Target("archive.verify-tar-gz", _seeds("tar", "tar.gz"), _verify(_gz)),
    Target("archive.verify-tar-zst", _seeds("tar", "tar.zst"), _verify(_zst)),
    Target("archive.import-tar", _seeds("tar"), _import(_plain)),
    Target("archive.import-tar-zst", _seeds("tar", "tar.zst"), _import(_zst)),
]
