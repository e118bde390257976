"""Capsule tars: bounded reading (for verify and import) and extraction.
Writing one (export) is :mod:`capsulefs.core.capsule.tar_export`'s.

Rules for reading, which distrusts every member and every byte count in it:
  * The manifest comes first: export writes manifest.json (and
    manifest.sig) before anything else. A compressed tar MUST start with it
    (only the tree's directories may precede it), as nothing else can bound
    what its stream inflates to. A plain tar may hold it anywhere: if files
    come before it, a first pass reads headers only, up to the manifest (the
    file's own size bounds every claim), and the real pass starts over.
  * Every member is judged from its header before a byte of its data is
    read, and the first one refused ends the scan: a name that is unsafe or
    not in the capsule's tree (``format.tree_kind``: so depth and path
    length are bounded), a link, device, fifo or sparse file, a duplicate,
    a file the manifest does not list, a size claim over the manifest's,
    over ``max_member`` or over the bytes left in a plain file. So the
    members are bounded by what the manifest lists.
  * The stream is read no further than the accepted members' claims, plus
    ``HEADER_ALLOWANCE`` for the header(s) of each (pax, GNU long names)
    and ``TRAILER_ALLOWANCE`` after the tar's end: a compression bomb stops
    there. A compressed stream is read to its end, so gzip's CRC and length
    (of every member) and zstd's checksum are checked.
  * Nothing outside the destination is ever written: import writes only
    into a fresh staging directory of the store, with O_EXCL|O_NOFOLLOW,
    and only members that passed the checks.
  * Compression is recognised by magic bytes: zstd, gzip, or plain.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
import zlib
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import BinaryIO

from . import format as fmt
from .verify import KEEP_BYTES, KEEP_LIMIT, Entry, Listing, Problem
from ..errors import CapsuleError, ImportRefused, UnsafePathError
from ..fsutil import makedirs_durable

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
GZIP_MAGIC = b"\x1f\x8b"
DEFAULT_MAX_MEMBER = 64 << 30
DEFAULT_MAX_TOTAL = 256 << 30
COPY_CHUNK = 1 << 20
#: Bytes an extraction leaves free on the file system it writes to.
FREE_MARGIN = 64 << 20
#: Bytes of the stream the header(s) of one member may take: its ustar
#: header and any pax or GNU header before it (a capsule's names need none).
HEADER_ALLOWANCE = 64 << 10
#: Bytes a compressed stream may hold after the tar's end (zero blocks,
#: padding to the tar's record size).
TRAILER_ALLOWANCE = 1 << 20
#: Members a plain tar may hold before its manifest: every file a manifest
#: may list, the manifest and its signature, the tree's directories and root.
MAX_MEMBERS = fmt.MAX_FILES + 2 + len(fmt.TREE_DIRS) + 1


def _block(n: int) -> int:
    """Bytes ``n`` bytes of member data take in a tar (512-byte blocks)."""
    return -(-n // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE


class _OverLimit(Exception):
    """The stream went on past what the members accepted so far allow."""


class _Bounded:
    """The (decompressed) bytes of a tar, read no further than ``limit``.

    It reads its source a chunk (COPY_CHUNK) at a time, though tarfile asks
    for 10 KiB at a time: so the source is read at most a chunk past ``limit``."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self._buf = b""
        self._at = 0  # in _buf
        self.pos = 0  # bytes handed out
        self.limit = HEADER_ALLOWANCE

    def allow(self, upto: int) -> None:
        self.limit = max(self.limit, upto)

    def _fill(self) -> bool:
        if self._at >= len(self._buf):
            self._buf, self._at = self._f.read(COPY_CHUNK), 0
        return self._at < len(self._buf)

    def read(self, n: int = COPY_CHUNK) -> bytes:
        room = self.limit - self.pos
        if n < 0 or n > room:
            if room <= 0:
                if self._fill():
                    raise _OverLimit()
                return b""
            n = room
        if not self._fill():
            return b""
        data = self._buf[self._at:self._at + n]
        self._at += len(data)
        self.pos += len(data)
        return data


class _Damaged(Exception):
    """Compressed bytes that do not decompress (words for a person)."""


#: zlib's words for a gzip trailer that does not match, and ours.
_GZIP_TRAILER = {"incorrect data check": "its CRC does not match its data",
                 "incorrect length check": "its length does not match its data"}


class _Gunzip:
    """The inflated bytes of every gzip member of a file. zlib in gzip mode
    checks each member's CRC and length as it reaches its end (tarfile's own
    gzip reader never read the trailer), in C: GzipFile's Python layers made
    verify of a .tar.gz 70% slower."""

    def __init__(self, raw: BinaryIO) -> None:
        self._raw = raw
        self._z = zlib.decompressobj(16 + zlib.MAX_WBITS)
        self._in = b""

    def read(self, n: int) -> bytes:
        while True:
            if not self._in:
                self._in = self._raw.read(COPY_CHUNK)
                if not self._in:
                    if not self._z.eof:
                        raise _Damaged("gzip: the stream ends before its end marker")
                    return b""
            if self._z.eof:  # another member, or the zeros some writers pad with
                if not self._in.strip(b"\0"):
                    self._in = b""
                    continue
                self._z = zlib.decompressobj(16 + zlib.MAX_WBITS)
            try:
                out = self._z.decompress(self._in, n)
            except zlib.error as exc:
                why = next((v for k, v in _GZIP_TRAILER.items() if k in str(exc)), str(exc))
                raise _Damaged(f"gzip: {why}") from None
            self._in = self._z.unused_data if self._z.eof else self._z.unconsumed_tail
            if out:
                return out


@contextmanager
def _open_stream(path: str) -> Iterator[tuple[str, BinaryIO, int]]:
    """(compression, decompressed stream, size of the file) of a capsule tar."""
    with ExitStack() as stack:
        raw = stack.enter_context(open(path, "rb"))
        size = os.fstat(raw.fileno()).st_size
        magic = raw.read(4)
        raw.seek(0)
        if magic.startswith(ZSTD_MAGIC):
            import zstandard

            reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True, closefd=False)
            yield "zstd", stack.enter_context(reader), size
        elif magic.startswith(GZIP_MAGIC):
            yield "gzip", _Gunzip(raw), size  # type: ignore[misc]
        else:
            yield "plain", raw, size


def _damage(kind: str) -> tuple[type[BaseException], ...]:
    """What the tar parser and the decompressors raise on bytes they cannot read."""
    errors: tuple[type[BaseException], ...] = (tarfile.TarError, EOFError, zlib.error, _Damaged)
    if kind == "zstd":
        import zstandard

        errors += (zstandard.ZstdError,)
    return errors


def _next(tf: tarfile.TarFile) -> tarfile.TarInfo | None:
    """The next member's header. tarfile's header parser raises ValueError
    (and OverflowError) on some fields it cannot read (GNU sparse maps, pax
    numbers): that is a damaged tar, not a fault of ours."""
    try:
        return tf.next()
    except (ValueError, OverflowError) as exc:
        raise tarfile.ReadError(f"unreadable header: {exc}") from None


def member_path(name: str) -> str | None:
    """The capsule path of a tar member name, None for the root ('.' or './')."""
    if not name:
        raise UnsafePathError("tar member '': an empty name")
    while name.startswith("./"):
        name = name[2:]
    name = name.rstrip("/")
    if name in ("", "."):
        return None
    return fmt.check_relpath(name, "tar member")


#: A sink receives each accepted regular file: (capsule path, size, stream)
#: and returns its sha256 after consuming exactly ``size`` bytes.
Sink = Callable[[str, int, BinaryIO], str]


def _hash_only(_path: str, _size: int, f: BinaryIO) -> str:
    h = hashlib.sha256()
    while chunk := f.read(COPY_CHUNK):
        h.update(chunk)
    return h.hexdigest()


class _Stop(Exception):
    """Ends a scan; what ended it is in the listing (or is for ``check`` to say)."""


def scan_tar(
    path: str,
    sink: Sink = _hash_only,
    *,
    max_member: int = DEFAULT_MAX_MEMBER,
    max_total: int = DEFAULT_MAX_TOTAL,
    on_manifest: Callable[[fmt.Manifest], None] | None = None,
    first_problem_ends: bool = False,
) -> Listing:
    """Walk a capsule tar, judging each member; hand good files to ``sink``.

    ``on_manifest`` is called with the manifest once it is read, before any
    file it lists reaches the sink (it may raise to refuse). With
    ``first_problem_ends`` (import), a file whose size or digest differs
    from the manifest's also ends the scan. A scan that ended early leaves
    ``listing.complete`` false: what it did not reach is not reported."""
    listing = Listing()
    scan = _Scan(path, sink, listing, max_member=max_member, max_total=max_total,
                 on_manifest=on_manifest, first_problem_ends=first_problem_ends)
    try:
        if scan.run() or scan.lenient:
            scan.run()
    except _Stop:
        listing.complete = False
    except OSError as exc:
        if exc.filename is None and isinstance(exc, (FileNotFoundError, PermissionError)):
            raise
        listing.problems.append(Problem("", "tar", f"cannot read the tar: {exc}"))
        listing.complete = False
    return listing


class _Scan:
    """One scan of a capsule tar: one pass, or two for a plain tar whose
    manifest comes after other files (see the module's rules)."""

    def __init__(self, path: str, sink: Sink, listing: Listing, *, max_member: int, max_total: int,
                 on_manifest: Callable[[fmt.Manifest], None] | None, first_problem_ends: bool) -> None:
        self.path, self.sink, self.listing = path, sink, listing
        self.max_member, self.max_total = max_member, max_total
        self.on_manifest, self.first_problem_ends = on_manifest, first_problem_ends
        self.manifest: fmt.Manifest | None = None
        self.manifest_raw: bytes | None = None
        self._ended = False  # this pass met the tar's end
        # A plain tar without a manifest is read once more, each file judged
        # from its header alone (the file's size bounds it): not a capsule,
        # but log, render and search read what it holds. Never for import.
        self.lenient = False

    def stop(self, path: str, what: str, detail: str) -> _Stop:
        if len(path) > 120:  # (one line, even for a name 2,000 directories deep)
            path = f"{path[:100]}...({len(path)} characters)"
        self.listing.problems.append(Problem(path, what, detail))
        return _Stop()

    def run(self) -> bool:
        """One pass over the tar; True if it must be read again from the start
        (files came before the manifest in a plain tar)."""
        with _open_stream(self.path) as (kind, raw, size):
            damage = _damage(kind) + (_OverLimit,)
            stream = _Bounded(raw)
            try:
                restart = self._members(kind, size, stream)
                if kind != "plain" and not restart:
                    stream.allow(stream.pos + TRAILER_ALLOWANCE)
                    while stream.read(COPY_CHUNK):  # to the end: gzip's CRC, zstd's checksum
                        pass
            except _OverLimit:
                raise self.stop("", "tar", self._overrun(stream)) from None
            except damage as exc:
                raise self.stop("", "tar", f"the tar is damaged or truncated: {str(exc) or type(exc).__name__}") from None
        return restart

    def _overrun(self, stream: _Bounded) -> str:
        if self._ended:
            return f"more than {TRAILER_ALLOWANCE} bytes follow the end of the tar"
        return (f"a member's headers take more than {HEADER_ALLOWANCE} bytes at offset {stream.pos} "
                f"(a capsule's names and sizes need one 512-byte header)")

    def _members(self, kind: str, size: int, stream: _Bounded) -> bool:
        self._ended = False
        try:
            tf = tarfile.open(fileobj=stream, mode="r|")  # type: ignore[call-overload]
        except (tarfile.ReadError, ValueError, OverflowError) as exc:
            raise self.stop("", "tar", f"not a readable tar: {exc}") from None
        seen: set[str] = set()
        skipped = False  # files passed over, before the manifest (a plain tar)
        count = 0
        with tf:
            while (m := _next(tf)) is not None:
                tf.members.clear()  # (a streaming pass needs no index of what it read)
                count += 1
                if count > MAX_MEMBERS:
                    raise self.stop("", "tar", f"holds more than {MAX_MEMBERS} members")
                rel = self._judge(m, seen, kind, size)
                if rel is None or m.isdir():
                    stream.allow(m.offset_data + HEADER_ALLOWANCE)
                    if rel is not None:
                        self.listing.entries[rel] = Entry("dir")
                    continue
                stream.allow(m.offset_data + _block(m.size) + HEADER_ALLOWANCE)
                if self.manifest is None and not self.lenient:
                    if rel == fmt.MANIFEST:
                        self._read_manifest(tf, m, keep=not skipped)
                        if skipped:
                            return True
                        continue
                    if kind != "plain":
                        raise self.stop(rel, "order", f"comes before {fmt.MANIFEST}: a compressed capsule tar must "
                                        f"start with {fmt.MANIFEST} (capsulefs export writes it first), or its size "
                                        f"cannot be bounded; decompress it to read it as a plain tar")
                    skipped = True
                    continue
                self._file(tf, m, rel)
            self._ended = True
        self.lenient = skipped and self.manifest is None and not self.lenient and not self.first_problem_ends
        return False

    def _judge(self, m: tarfile.TarInfo, seen: set[str], kind: str, size: int) -> str | None:
        """A member's capsule path, from its header alone; refuses what the format does not allow."""
        try:
            rel = member_path(m.name)
        except UnsafePathError as exc:
            raise self.stop(m.name, "unsafe", f"unsafe path: {str(exc)[:300]}") from None
        if rel is None:
            if not m.isdir():  # (tarfile would skip what it claims, unchecked)
                raise self.stop(m.name, "type", "names the capsule's root but is not a directory")
            return None
        if m.issym() or m.islnk():
            raise self.stop(rel, "type", f"is a {'symbolic' if m.issym() else 'hard'} link to {m.linkname[:200]!r}; "
                            f"links are not allowed")
        if m.type == tarfile.GNUTYPE_SPARSE or m.sparse is not None:
            raise self.stop(rel, "type", "is a sparse file; a capsule holds only plain files")
        if not (m.isreg() or m.isdir()):
            raise self.stop(rel, "type", "is a device, fifo or other special entry; not allowed")
        want = fmt.tree_kind(rel)
        if want is None:
            raise self.stop(rel, "unknown", "is not part of the capsule format (manifest.json, manifest.sig, "
                            "memory/..., artifacts/snapshot.json, artifacts/blobs/<sha256>, environment/spec.json)")
        have = "dir" if m.isdir() else "file"
        if have != want:
            raise self.stop(rel, "type", f"is a {'directory' if have == 'dir' else 'file'} where the format has a "
                            f"{'directory' if want == 'dir' else 'file'}")
        if rel in seen:
            raise self.stop(rel, "duplicate", "appears more than once in the tar")
        seen.add(rel)
        if have == "file":
            if m.size < 0:
                raise self.stop(rel, "size", f"claims a negative size ({m.size})")
            if m.size > self.max_member:
                raise self.stop(rel, "size", f"is {m.size} bytes, over the limit of {self.max_member}")
            if kind == "plain" and m.size > size - m.offset_data:
                raise self.stop(rel, "size", f"claims {m.size} bytes, but only {max(size - m.offset_data, 0)} "
                                f"are left in the file")
        return rel

    def _read_manifest(self, tf: tarfile.TarFile, m: tarfile.TarInfo, *, keep: bool) -> None:
        if m.size > fmt.MAX_MANIFEST_BYTES:
            raise self.stop(fmt.MANIFEST, "size", f"is {m.size} bytes, over the limit of {fmt.MAX_MANIFEST_BYTES}")
        f = tf.extractfile(m)
        assert f is not None
        raw = f.read()
        self.manifest_raw = self.listing.contents[fmt.MANIFEST] = raw
        try:
            manifest = fmt.Manifest.from_bytes(raw)
        except CapsuleError:
            raise _Stop() from None  # ``check`` names what is wrong with it
        if len(manifest.files) > fmt.MAX_FILES:
            raise self.stop(fmt.MANIFEST, "manifest", f"lists {len(manifest.files)} files, over the limit of "
                            f"{fmt.MAX_FILES}")
        total = sum(e.size for e in manifest.files.values())
        if total > self.max_total:
            raise self.stop(fmt.MANIFEST, "size", f"lists {total} bytes of files, over the limit of {self.max_total}")
        self.manifest = self.listing.manifest = manifest
        if self.on_manifest is not None:
            self.on_manifest(manifest)
        if keep:
            self._record(fmt.MANIFEST, len(raw), io.BytesIO(raw))

    def _file(self, tf: tarfile.TarFile, m: tarfile.TarInfo, rel: str) -> None:
        """A file member, once the manifest is known (or in a plain tar without one)."""
        if self.manifest is None:
            want = None
        elif rel == fmt.MANIFEST:  # (the second pass of a plain tar)
            f = tf.extractfile(m)
            assert f is not None
            if f.read() != self.manifest_raw:
                raise self.stop(rel, "tar", "changed while the tar was read")
            self._record(rel, m.size, io.BytesIO(self.manifest_raw))
            return
        elif rel == fmt.SIGNATURE:
            if m.size > fmt.MAX_SIGNATURE_BYTES:
                raise self.stop(rel, "size", f"is {m.size} bytes, over the limit of {fmt.MAX_SIGNATURE_BYTES}")
            want = None
        else:
            want = self.manifest.files.get(rel)
            if want is None:
                raise self.stop(rel, "unlisted", "present but not listed in the manifest")
            if m.size > want.size:
                raise self.stop(rel, "size", f"grown: the manifest says {want.size} bytes, its tar header claims "
                                f"{m.size} (not read)")
        f = tf.extractfile(m)
        assert f is not None
        entry = self._record(rel, m.size, f)  # type: ignore[arg-type]
        if self.first_problem_ends and want is not None and (entry.size, entry.sha256) != (want.size, want.sha256):
            raise _Stop()  # ``check`` names the difference

    def _record(self, rel: str, size: int, f: BinaryIO) -> Entry:
        if (rel in KEEP_BYTES or rel == fmt.MANIFEST) and size <= KEEP_LIMIT:
            data = f.read()
            self.listing.contents[rel] = data
            f = io.BytesIO(data)
        entry = self.listing.entries[rel] = Entry("file", size, self.sink(rel, size, f))
        return entry



def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still use on the file system of ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def check_room(root: str, manifest: fmt.Manifest, what: str, *, free: Callable[[str], int] = free_bytes) -> None:
    """Refuse (ImportRefused) to extract what ``manifest`` lists under
    ``root`` if it would leave less than ``FREE_MARGIN`` bytes free there:
    from the manifest, before a byte of it is written."""
    need = sum(e.size for e in manifest.files.values())
    left = free(root)
    if need > left - FREE_MARGIN:
        raise ImportRefused(f"{what} lists {need} bytes of files, but only {max(left, 0)} bytes are free in {root} "
                            f"(and {FREE_MARGIN} are kept free); nothing was kept")


def extract_into(root: str, *, free: Callable[[str], int] = free_bytes) -> Sink:
    """A sink that writes each file under ``root`` (a fresh, private directory).

    A file that would leave less than ``FREE_MARGIN`` bytes free on the file
    system is refused (ImportRefused) from its size, before any byte of it is
    written: a compressed tar expands without bound (a tar bomb), and the
    state directory's disk is the one every agent's journal appends to."""

    def sink(rel: str, size: int, f: BinaryIO) -> str:
        left = free(root)
        if size > left - FREE_MARGIN:
            raise ImportRefused(f"{rel} is {size} bytes, but only {max(left, 0)} bytes are free in {root} "
                                f"(and {FREE_MARGIN} are kept free); nothing was kept")
        dest = os.path.join(root, rel)
        makedirs_durable(os.path.dirname(dest))
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            while chunk := f.read(COPY_CHUNK):
                h.update(chunk)
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        return h.hexdigest()

    return sink
