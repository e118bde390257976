"""Hostile tars, made byte by byte: for the tests of tar reading and the fuzz harness.

A tar is 512-byte blocks: each member a header block (its fields at fixed
offsets, its checksum the byte sum of the header with the checksum field as
spaces), then its data padded to a block, and two zero blocks at the end.
These helpers rewrite headers with valid checksums, claim sizes the bytes
do not back (octal, GNU base-256, pax), and build compression bombs whose
compressed form is tiny: a zstd frame of RLE blocks, a deflate stream that
repeats one full-flushed run of zeros.
"""

from __future__ import annotations

import io
import struct
import tarfile
import zlib
from dataclasses import dataclass

BLOCK = 512
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
ZSTD_MAX_BLOCK = 128 << 10

# Header fields: (offset, length).
NAME = (0, 100)
MODE = (100, 8)
UID = (108, 8)
SIZE = (124, 12)
MTIME = (136, 12)
CHKSUM = (148, 8)
TYPE = (156, 1)
LINKNAME = (157, 100)
MAGIC = (257, 8)
FIELDS = {"name": NAME, "mode": MODE, "uid": UID, "size": SIZE, "mtime": MTIME, "type": TYPE,
          "linkname": LINKNAME, "magic": MAGIC}


@dataclass(frozen=True)
class Member:
    name: str
    header: int  # offset of its (first) header block
    data: int  # offset of its data
    size: int


def members(tar: bytes) -> list[Member]:
    """The members of a plain tar as tarfile reads them, with their offsets."""
    out = []
    with tarfile.open(fileobj=io.BytesIO(tar), mode="r:") as tf:
        for m in tf.getmembers():
            out.append(Member(m.name, m.offset, m.offset_data, m.size))
    return out


def end_of_members(tar: bytes) -> int:
    """Offset where the end-of-archive zero blocks start."""
    ms = members(tar)
    last = ms[-1]
    return last.data + -(-last.size // BLOCK) * BLOCK


def with_checksum(header: bytes | bytearray) -> bytes:
    """A header block with its checksum field recomputed."""
    h = bytearray(header[:BLOCK].ljust(BLOCK, b"\0"))
    h[CHKSUM[0]:CHKSUM[0] + CHKSUM[1]] = b" " * CHKSUM[1]
    h[CHKSUM[0]:CHKSUM[0] + CHKSUM[1]] = b"%06o\0 " % sum(h)
    return bytes(h)


def set_field(header: bytes, field: tuple[int, int], value: bytes) -> bytes:
    """A header with one field replaced (padded with NULs or cut), checksum fixed."""
    off, n = field
    h = bytearray(header[:BLOCK])
    h[off:off + n] = value[:n].ljust(n, b"\0")
    return with_checksum(h)


def octal(n: int, width: int = 12) -> bytes:
    return b"%0*o\0" % (width - 1, n)


def base256(n: int, width: int = 12) -> bytes:
    """GNU's base-256 number field: 0x80, then the number big-endian."""
    return b"\x80" + n.to_bytes(width - 1, "big")


def size_field(n: int) -> bytes:
    return octal(n) if n < 8 ** 11 else base256(n)


def header(name: str, size: int = 0, *, kind: bytes = tarfile.REGTYPE, linkname: str = "") -> bytes:
    """A ustar header block, or GNU base-256 for a size octal cannot hold."""
    ti = tarfile.TarInfo(name)
    ti.type, ti.linkname, ti.mtime, ti.mode = kind, linkname, 1_700_000_000, 0o644
    h = ti.tobuf(tarfile.GNU_FORMAT)  # (a GNU long-name member first, if the name needs one)
    return h[:-BLOCK] + set_field(h[-BLOCK:], SIZE, size_field(size))


def pax_header(records: dict[str, str], name: str = "././@PaxHeader") -> bytes:
    """A pax extended header (type x) and its data, which apply to the next member."""
    data = b""
    for key, value in records.items():
        rec = f" {key}={value}\n".encode()
        n = p = 0
        while True:  # the length counts its own digits (as tarfile writes it)
            n = len(rec) + len(str(p))
            if n == p:
                break
            p = n
        data += str(n).encode() + rec
    h = header(name, len(data), kind=tarfile.XHDTYPE)
    return h + data + b"\0" * (-len(data) % BLOCK)


def plain_tar(entries: list[tuple[str, bytes | None]]) -> bytes:
    """A plain tar of (name, data) files and (name, None) directories."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, data in entries:
            ti = tarfile.TarInfo(name)
            ti.mtime = 1_700_000_000
            if data is None:
                ti.type, ti.mode = tarfile.DIRTYPE, 0o755
                tf.addfile(ti)
            else:
                ti.size, ti.mode = len(data), 0o644
                tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


# -- compression bombs ------------------------------------------------------------


def zstd_frame(parts: list[bytes | int], *, rle_byte: int = 0) -> bytes:
    """One zstd frame of ``parts``: bytes as raw blocks, an int n as n bytes
    of ``rle_byte`` in RLE blocks (4 bytes per 128 KiB: 16 GiB in 512 KiB)."""
    blocks: list[bytes] = []

    def block(kind: int, size: int, body: bytes) -> None:
        blocks.append(struct.pack("<I", (kind << 1) | (size << 3))[:3] + body)

    for part in parts:
        if isinstance(part, int):
            left = part
            while left:
                n = min(left, ZSTD_MAX_BLOCK)
                block(1, n, bytes([rle_byte]))
                left -= n
        else:
            for i in range(0, len(part), ZSTD_MAX_BLOCK):
                chunk = part[i:i + ZSTD_MAX_BLOCK]
                block(0, len(chunk), chunk)
    if not blocks:
        block(0, 0, b"")
    last = bytearray(blocks[-1])
    last[0] |= 1
    blocks[-1] = bytes(last)
    # Frame header: no content size, not single-segment, no checksum; window 128 KiB.
    return ZSTD_MAGIC + bytes([0x00, 0x38]) + b"".join(blocks)


def gzip_stream(parts: list[bytes | int], *, chunk: int = 16 << 20) -> bytes:
    """One gzip member of ``parts``: bytes as they are, an int n as n zero
    bytes (a multiple of ``chunk``), deflated once and repeated: about 1 KB
    per MiB. CRC and length are right."""
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    body = bytearray()
    crc = 0
    length = 0
    zeros = b"\0" * chunk
    run = b""
    for part in parts:
        if isinstance(part, int):
            assert part % chunk == 0, "whole chunks only"
            if not run:
                body += c.flush(zlib.Z_FULL_FLUSH)
                run = c.compress(zeros) + c.flush(zlib.Z_FULL_FLUSH)  # references nothing before it
            for _ in range(part // chunk):
                body += run
                crc = zlib.crc32(zeros, crc)
            length += part
        else:
            body += c.compress(part) + c.flush(zlib.Z_FULL_FLUSH)
            crc = zlib.crc32(part, crc)
            length += len(part)
    body += c.flush()
    return (b"\x1f\x8b\x08\x00" + struct.pack("<I", 1_700_000_000) + b"\x00\xff" + bytes(body)
            + struct.pack("<II", crc, length & 0xFFFFFFFF))
