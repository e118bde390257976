"""Hostile tars cost time and memory in proportion to the bytes given, get
one line naming the problem, and leave nothing behind (issue 25: findings
3 to 6, and gzip's CRC). Each is run through the real CLI, under CPU and
file-size limits that only bound the damage of a regression (a bomb that is
read whole, a hang), as a person would run it."""

from __future__ import annotations

import gzip
import io
import os
import resource
import subprocess
import tarfile
from pathlib import Path

import pytest
import zstandard

from capsulefs.core.capsule import archive
from capsulefs.core.capsule import format as fmt
from capsulefs.core.errors import ImportRefused
from capsulefs.core.store.host_store import HostStore
from capsulefs.core.capsule.tarball import scan_tar

import tar_kit
from cli_kit import CAPSULEFS, REPO
from helpers import make_agent

GIB = 1 << 30


@pytest.fixture
def good(store: HostStore, tmp_path: Path) -> bytes:
    """A plain tar of a real export (manifest first), made by capsulefs export."""
    agent = make_agent(store, "source")
    tar = tmp_path / "good.tar"
    archive.export_agent(agent, str(tar), mtime=1_700_000_000)
    return tar.read_bytes()


def _limits() -> None:
    resource.setrlimit(resource.RLIMIT_CPU, (30, 30))  # a hang, or a bomb read whole, is killed
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 20, 256 << 20))  # so is one written to disk
    resource.setrlimit(resource.RLIMIT_AS, (2 * GIB, 2 * GIB))  # or held in memory


def bounded_cli(state: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CAPSULEFS, "--state", str(state), *args], capture_output=True, text=True, cwd=REPO,
                          timeout=120, preexec_fn=_limits)


def assert_refused(state: Path, tar: Path, *words: str) -> None:
    """verify says so in one problem, import in one line; nothing is left in the store."""
    v = bounded_cli(state, "verify", str(tar))
    assert v.returncode == 1, (v.returncode, v.stderr[-2000:])
    lines = v.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[1].startswith("FAILED: 1 problem"), v.stderr[-2000:]
    assert all(w in lines[0] for w in words), (words, lines[0])
    i = bounded_cli(state, "import", str(tar))
    assert i.returncode == 1, (i.returncode, i.stderr[-2000:])
    lines = i.stderr.strip().splitlines()
    assert len(lines) == 1 and "nothing imported" in lines[0], i.stderr[-2000:]
    assert all(w in lines[0] for w in words), (words, lines[0])
    store = HostStore.open(state)
    assert store.agent_ids() == [] and list(store.all_blobs()) == []
    assert os.listdir(store.staging_dir) == []


def _blob(tar: bytes) -> tar_kit.Member:
    return next(m for m in tar_kit.members(tar) if m.name.startswith(fmt.BLOBS_DIR + "/"))


def _claiming(tar: bytes, member: tar_kit.Member, size: int) -> bytes:
    """``tar`` cut after ``member``'s header, which now claims ``size`` bytes."""
    head = tar_kit.set_field(tar[member.header:member.header + 512], tar_kit.SIZE, tar_kit.size_field(size))
    return tar[:member.header] + head


# -- finding 3: depth ------------------------------------------------------------


def test_a_member_2040_directories_deep_is_refused_at_once(good: bytes, tmp_path: Path) -> None:
    """Its path is under 4,096 bytes, so it passed; extracting it made a tree
    the staging cleanup died on (RecursionError), and every later command
    that opened the store died sweeping it."""
    deep = "memory/" + "d/" * 2040 + "f"
    assert len(deep) < 4096
    end = tar_kit.end_of_members(good)
    extra = tar_kit.plain_tar([(deep, b"x")])
    tar = tmp_path / "deep.tar"
    tar.write_bytes(good[:end] + extra)
    assert_refused(tmp_path / "target", tar, "memory/d/d/", "is not part of the capsule format")


# -- finding 4: size claims ---------------------------------------------------------


@pytest.mark.parametrize("how, claim", [("gnu-base256", 2**63 - 1), ("pax", 10**30), ("octal", 10 * GIB)])
def test_a_size_claim_beyond_the_file_is_refused_at_once(how: str, claim: int, good: bytes, tmp_path: Path) -> None:
    """A header claiming 2**63-1 bytes (GNU base-256) or 10**30 (pax) in a
    20 KB file hung verify and import (tarfile skipped the claim a block at
    a time, past the end of the file); 100 GiB took 157 s."""
    wm = next(m for m in tar_kit.members(good) if m.name == fmt.WORKING_MEMORY)
    if how == "pax":
        tar = good[:wm.header] + tar_kit.pax_header({"size": str(claim)}) + good[wm.header:]
    else:
        tar = _claiming(good, wm, claim) + good[wm.data:]
    assert len(tar) <= 22 * 1024  # a 20 KB file
    path = tmp_path / "claim.tar"
    path.write_bytes(tar)
    words = ["left in the file"] if claim <= archive.DEFAULT_MAX_MEMBER else ["over the limit of"]
    assert_refused(tmp_path / "target", path, f"{fmt.WORKING_MEMORY}: ", f"{claim} bytes", *words)


# -- finding 5: compression bombs -------------------------------------------------------


def _bomb_tar(good: bytes, claim: int) -> tuple[bytes, list[bytes | int]]:
    """A blob's header claims ``claim`` bytes (the manifest says 6), and that
    many zero bytes follow, then the tar's end: the parts of a bomb."""
    blob = _blob(good)
    return _claiming(good, blob, claim), [claim, b"\0" * 1024]


def test_a_zstd_bomb_is_refused_at_its_header(good: bytes, tmp_path: Path) -> None:
    """512 KB of zstd that inflates to 16 GiB: verify hashed it all, import
    wrote it into staging until the disk was full."""
    head, rest = _bomb_tar(good, 16 * GIB)
    bomb = tmp_path / "bomb.tar.zst"
    bomb.write_bytes(tar_kit.zstd_frame([head, *rest]))
    assert bomb.stat().st_size < 600_000
    assert_refused(tmp_path / "target", bomb, "grown: the manifest says 6 bytes", f"claims {16 * GIB} (not read)")


def test_a_gzip_bomb_is_refused_at_its_header(good: bytes, tmp_path: Path) -> None:
    head, rest = _bomb_tar(good, 2 * GIB)
    bomb = tmp_path / "bomb.tar.gz"
    bomb.write_bytes(tar_kit.gzip_stream([head, *rest]))
    assert bomb.stat().st_size < 3_000_000
    assert_refused(tmp_path / "target", bomb, "grown: the manifest says 6 bytes", f"claims {2 * GIB} (not read)")


def test_a_pax_header_bomb_is_refused_past_the_header_allowance(good: bytes, tmp_path: Path) -> None:
    """A pax header that claims 16 GiB of its own: tarfile read it whole into memory."""
    wm = next(m for m in tar_kit.members(good) if m.name == fmt.WORKING_MEMORY)
    pax = tar_kit.header("././@PaxHeader", 16 * GIB, kind=tarfile.XHDTYPE)
    bomb = tmp_path / "pax.tar.zst"
    bomb.write_bytes(tar_kit.zstd_frame([good[:wm.header] + pax, 16 * GIB, good[wm.header:]]))
    assert_refused(tmp_path / "target", bomb, "headers take more than")


def test_a_bomb_after_the_tars_end_is_refused(good: bytes, tmp_path: Path) -> None:
    """Zeros after the end of the tar are read (to reach gzip's CRC, zstd's
    checksum) no further than a record's padding and a little more."""
    bomb = tmp_path / "tail.tar.zst"
    bomb.write_bytes(tar_kit.zstd_frame([good, 16 * GIB]))
    assert_refused(tmp_path / "target", bomb, "follow the end of the tar")


def test_a_compressed_tar_must_start_with_its_manifest(good: bytes, tmp_path: Path) -> None:
    """Nothing but the manifest can bound a compressed stream, so it comes
    first (export writes it first); a plain tar may have it anywhere."""
    ms = tar_kit.members(good)
    first, rest_at = ms[0], ms[1].header
    assert first.name == fmt.MANIFEST
    end = tar_kit.end_of_members(good)
    last = good[rest_at:end] + good[first.header:rest_at] + good[end:]  # the manifest moved to the end
    plain = tmp_path / "last.tar"
    plain.write_bytes(last)
    assert archive.verify_capsule(str(plain))[1] == []
    imported = archive.import_tar(HostStore.open(tmp_path / "plain-state"), str(plain))
    assert imported.name == "source"
    packed = tmp_path / "last.tar.zst"
    packed.write_bytes(zstandard.ZstdCompressor().compress(last))
    assert_refused(tmp_path / "target", packed, "comes before manifest.json", "must start with manifest.json")


def test_an_import_that_does_not_fit_on_the_disk_is_refused_from_its_manifest(good: bytes, tmp_path: Path) -> None:
    """The manifest's sizes are checked against the free space before a
    byte is written (a compressed tar expands beyond its own size)."""
    st = os.statvfs(tmp_path)
    huge = 2 * st.f_bavail * st.f_frsize + GIB
    ms = tar_kit.members(good)
    raw = good[ms[0].data:ms[0].data + ms[0].size]
    m = fmt.Manifest.from_bytes(raw)
    files = dict(m.files)
    files[fmt.blob_path("0" * 64)] = fmt.FileEntry(sha256="0" * 64, size=huge)
    raw = m.with_files(files).to_bytes()
    tar = tmp_path / "big.tar"
    tar.write_bytes(tar_kit.plain_tar([(fmt.MANIFEST, raw)]) )
    target = HostStore.open(tmp_path / "t")
    with pytest.raises(ImportRefused, match=f"lists {huge + sum(e.size for e in m.files.values())} bytes of files, "
                                            f"but only .* bytes are free"):
        archive.import_tar(target, str(tar), max_member=huge, max_total=2 * huge)
    assert target.agent_ids() == [] and list(target.all_blobs()) == []
    assert os.listdir(target.staging_dir) == []


# -- finding 6: many members ------------------------------------------------------------


@pytest.mark.parametrize("where", ["outside-the-tree", "unlisted-blobs"])
def test_many_members_are_refused_at_the_first(where: str, good: bytes, tmp_path: Path) -> None:
    """100,000 tiny members: verify took 43 s listing each, import 240 s."""
    n = 100_000
    if where == "outside-the-tree":
        names = [f"x{i}" for i in range(n)]
    else:
        names = [fmt.blob_path(f"{i:064x}") for i in range(n)]
    extra = b"".join(tar_kit.header(name, 0) for name in names)
    tar = tmp_path / "many.tar"
    tar.write_bytes(good[:tar_kit.end_of_members(good)] + extra + b"\0" * 1024)
    words = ["x0: is not part of the capsule format"] if where == "outside-the-tree" else \
        [f"{names[0]}: present but not listed in the manifest"]
    assert_refused(tmp_path / "target", tar, *words)


# -- gzip's CRC -----------------------------------------------------------------------


@pytest.mark.parametrize("field", ["crc", "length"])
def test_a_gzip_trailer_that_does_not_match_is_refused(field: str, store: HostStore, tmp_path: Path) -> None:
    """tarfile's own gzip reader never read the trailer; a gzip stream is now
    read to its end, so a CRC or length that does not match is refused."""
    agent = make_agent(store, "zipped")
    tar = tmp_path / "z.tar.gz"
    archive.export_agent(agent, str(tar), mtime=1_700_000_000)
    data = bytearray(tar.read_bytes())
    gzip.decompress(bytes(data))  # it is good
    at = len(data) - (8 if field == "crc" else 4)
    data[at] ^= 0xFF
    tar.write_bytes(bytes(data))
    with pytest.raises(gzip.BadGzipFile):
        gzip.decompress(bytes(data))
    assert_refused(tmp_path / "target", tar, "damaged", f"gzip: its {'CRC' if field == 'crc' else 'length'} does not "
                   f"match its data")


def test_an_export_is_read_whole_in_every_compression(store: HostStore, tmp_path: Path) -> None:
    """The bounds refuse nothing export writes: manifest first, zstd with its checksum."""
    agent = make_agent(store, "packed", workspace={"a.bin": os.urandom(300_000), "b.txt": b"b" * 5000})
    for name in ("p.tar", "p.tar.gz", "p.tar.zst"):
        tar = tmp_path / name
        archive.export_agent(agent, str(tar), mtime=1_700_000_000)
        manifest, problems = archive.verify_capsule(str(tar))
        assert problems == [] and manifest is not None, (name, problems)
        target = HostStore.open(tmp_path / f"into-{name}")
        assert archive.import_tar(target, str(tar)).agent_id == agent.agent_id
        assert os.listdir(target.staging_dir) == []
    with zstandard.ZstdDecompressor().stream_reader(io.BytesIO((tmp_path / "p.tar.zst").read_bytes())) as r:
        r.read()
    params = zstandard.get_frame_parameters((tmp_path / "p.tar.zst").read_bytes())
    assert params.has_checksum


# -- what the fuzz harness found ------------------------------------------------------


@pytest.mark.parametrize("records", [{"GNU.sparse.size": "abc"}, {"GNU.sparse.map": "0,1,x"},
                                     {"GNU.sparse.realsize": "9" * 5000}])
def test_a_pax_header_tarfile_cannot_read_is_a_damaged_tar(records: dict[str, str], good: bytes,
                                                           tmp_path: Path) -> None:
    """tarfile's header parser raised ValueError on these (a traceback)."""
    wm = next(m for m in tar_kit.members(good) if m.name == fmt.WORKING_MEMORY)
    tar = tmp_path / "sparse.tar"
    tar.write_bytes(good[:wm.header] + tar_kit.pax_header(records) + good[wm.header:])
    assert_refused(tmp_path / "target", tar, "damaged")


def test_a_member_name_with_a_newline_is_named_on_one_line(good: bytes, tmp_path: Path) -> None:
    """A name is printed escaped: a newline in it could forge a line of verify's output."""
    tar = tmp_path / "newline.tar"
    extra = tar_kit.plain_tar([("memory/x\nOK: forged \udce4", b"x")])
    tar.write_bytes(good[:tar_kit.end_of_members(good)] + extra)
    assert_refused(tmp_path / "target", tar, "memory/x\\nOK: forged \\udce4: is not part of the capsule format")


def test_gzip_in_several_members_reads_and_a_cut_one_is_refused(good: bytes, tmp_path: Path) -> None:
    """Every member of a multi-member gzip is read and checked (tarfile's
    own reader stopped after the first); a stream cut short is refused."""
    cut = len(good) // 3
    two = tmp_path / "two.tar.gz"
    two.write_bytes(gzip.compress(good[:cut]) + gzip.compress(good[cut:]) + b"\0" * 100)
    assert archive.verify_capsule(str(two))[1] == []
    short = tmp_path / "short.tar.gz"
    short.write_bytes(gzip.compress(good)[:-20])
    assert_refused(tmp_path / "target", short, "gzip: the stream ends before its end marker")


@pytest.mark.parametrize("name", ["", ".", "./"])
def test_a_file_named_as_the_root_is_refused_before_its_claim_is_skipped(name: str, good: bytes,
                                                                        tmp_path: Path) -> None:
    """A member named "" (or "." as a file) was taken for the root and passed
    over unchecked: tarfile then skipped its claim a block at a time (a fuzzed
    input of 33 KB claiming 64 GiB took 25 s; this one claims 1 TiB)."""
    end = tar_kit.end_of_members(good)
    tar = tmp_path / "root.tar.zst"
    tar.write_bytes(zstandard.ZstdCompressor().compress(good[:end] + tar_kit.header(name, 1 << 40)
                                                         + b"\0" * 20_000))
    assert_refused(tmp_path / "target", tar, "empty name" if not name else "names the capsule's root but is not a directory")


def test_a_tar_without_a_manifest(good: bytes, tmp_path: Path) -> None:
    """A plain one is read (its size bounds it: log, render and search read
    what it holds) and is no capsule; import writes nothing of it; a
    compressed one is refused at its first file."""
    ms = tar_kit.members(good)
    body = good[ms[1].header:]  # all but the manifest
    plain = tmp_path / "bare.tar"
    plain.write_bytes(body)
    listing = scan_tar(str(plain))
    assert fmt.JOURNAL in listing.contents and listing.complete
    assert [str(p) for p in archive.verify_capsule(str(plain))[1]] == ["manifest.json: missing: a capsule needs manifest.json"]
    given: list[str] = []
    scan_tar(str(plain), lambda rel, _size, _f: given.append(rel) or "", first_problem_ends=True)
    assert given == []  # (import's way of reading: no file reaches its sink)
    with pytest.raises(ImportRefused, match="manifest.json: missing"):
        archive.import_tar(HostStore.open(tmp_path / "t"), str(plain))
    packed = tmp_path / "bare.tar.zst"
    packed.write_bytes(zstandard.ZstdCompressor().compress(body))
    assert [p.what for p in archive.verify_capsule(str(packed))[1]] == ["order"]
    store = HostStore.open(tmp_path / "t")
    assert os.listdir(store.staging_dir) == [] and store.agent_ids() == []
