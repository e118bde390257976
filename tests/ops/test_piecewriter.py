"""The piece writer of a move's target: cutting a ``blobs`` payload into
pieces, writing and checking each, and never leaving a partial or corrupt
file under a piece's name."""

from __future__ import annotations

import errno
import hashlib
import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capsulefs.move import pieces as piecewriter
from capsulefs.move.pieces import ALIGN, BUFFER, Outcome, Piece, PieceWriter


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def is_direct(fd: int) -> bool:
    with open(f"/proc/self/fdinfo/{fd}") as f:
        return bool(int(f.read().split("flags:")[1].split()[0], 8) & os.O_DIRECT)


def chunked(data: bytes, sizes: list[int]) -> list[bytes]:
    """``data`` cut at the given chunk sizes (the last chunk takes the rest)."""
    out, at = [], 0
    for n in sizes:
        if at >= len(data):
            break
        out.append(data[at : at + n])
        at += n
    if at < len(data):
        out.append(data[at:])
    return out


def run(tmp_path, blobs: list[bytes], chunk_sizes: list[int], *, keep=None, buffer=None) -> list[Outcome]:
    pieces = [
        Piece(sha(b), len(b), str(tmp_path / f"p{i}") if keep is None or keep[i] else None)
        for i, b in enumerate(blobs)
    ]
    writer = PieceWriter(pieces, buffer=buffer)
    writer.feed(chunked(b"".join(blobs), chunk_sizes))
    return writer.close()


SIZES = [0, 1, ALIGN - 1, ALIGN, ALIGN + 1, 3 * ALIGN, BUFFER - 1, BUFFER, BUFFER + ALIGN + 7, 2 * BUFFER + 1]


def test_every_size_round_trips_whatever_the_chunking(tmp_path):
    rng = random.Random(7)
    blobs = [rng.randbytes(n) for n in SIZES]
    outcomes = run(tmp_path, blobs, [rng.choice([1, 100, 16384, 65536, 1 << 20]) for _ in range(4000)])
    assert [o.sha for o in outcomes] == [sha(b) for b in blobs]
    assert all(o.written and o.intact for o in outcomes)
    for i, b in enumerate(blobs):
        assert (tmp_path / f"p{i}").read_bytes() == b


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.sampled_from([0, 1, 5, ALIGN - 1, ALIGN, ALIGN + 3, 2 * ALIGN]), min_size=1, max_size=6),
    cuts=st.lists(st.integers(1, 3 * ALIGN), max_size=40),
    buffer=st.sampled_from([ALIGN, 2 * ALIGN, BUFFER]),
    data=st.data(),
)
def test_pieces_are_cut_at_their_sizes(tmp_path_factory, sizes, cuts, buffer, data):
    tmp = tmp_path_factory.mktemp("cut")
    blobs = [bytes([i + 1]) * n for i, n in enumerate(sizes)]
    keep = data.draw(st.lists(st.booleans(), min_size=len(blobs), max_size=len(blobs)))
    outcomes = run(tmp, blobs, cuts, keep=keep, buffer=buffer)
    assert [o.written for o in outcomes] == keep
    for i, b in enumerate(blobs):
        path = tmp / f"p{i}"
        if keep[i]:
            assert path.read_bytes() == b and outcomes[i].intact
        else:
            assert not path.exists()


@settings(max_examples=200, deadline=None)
@given(
    pieces=st.lists(st.tuples(st.sampled_from([0, 1, 100, ALIGN - 1, ALIGN, ALIGN + 1, 5 * ALIGN + 3]), st.booleans()),
                    max_size=12),
    buffer=st.sampled_from([ALIGN, 2 * ALIGN, 4 * ALIGN]),
)
def test_the_layout_puts_every_byte_once_and_kept_pieces_on_block_boundaries(pieces, buffer):
    """What write_slab relies on to write a piece straight from the buffer
    with O_DIRECT, and what the receiver relies on to fill the buffer."""
    plan = [Piece(str(i), n, "f" if kept else None) for i, (n, kept) in enumerate(pieces)]
    slabs = piecewriter.layout(plan, buffer)
    segments = [seg for slab in slabs for seg in slab]
    assert all(slabs)
    # in payload order, every piece's bytes once: first..last, sizes adding up
    assert [seg.piece for seg in segments] == sorted(seg.piece for seg in segments)
    for i, piece in enumerate(plan):
        mine = [seg for seg in segments if seg.piece == i]
        assert mine and mine[0].first and mine[-1].last
        assert not any(seg.first for seg in mine[1:]) and not any(seg.last for seg in mine[:-1])
        assert sum(seg.size for seg in mine) == piece.size
        if piece.path is not None:
            assert all(seg.offset % ALIGN == 0 for seg in mine)
            assert all(seg.size % ALIGN == 0 for seg in mine[:-1])
            assert len(mine) == 1 or piece.size > buffer  # a piece that fits a buffer is not split
    for slab in slabs:  # within the buffer, in order, never overlapping
        end = 0
        for seg in slab:
            assert seg.offset >= end and seg.offset + seg.size <= buffer
            end = seg.offset + seg.size


def test_large_pieces_bypass_the_page_cache(tmp_path):
    """While a piece streams in, its file is open with O_DIRECT (ext4 takes
    it): the bytes go to the device instead of waiting in the page cache."""
    blob = os.urandom(3 * BUFFER)
    writer = PieceWriter([Piece(sha(blob), len(blob), str(tmp_path / "big"))])
    writer.feed([blob[: 2 * BUFFER]])
    assert is_direct(writer._file.fd)
    writer.feed([blob[2 * BUFFER :]])
    assert writer.close() == [Outcome(sha(blob), written=True, intact=True)]
    assert (tmp_path / "big").read_bytes() == blob
    assert not writer.direct_refused


def test_a_file_system_that_refuses_o_direct_gets_buffered_writes(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, mode=0o777):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode)

    monkeypatch.setattr(piecewriter.os, "open", no_direct)
    blobs = [os.urandom(BUFFER + 5), os.urandom(ALIGN)]
    assert all(o.intact for o in run(tmp_path, blobs, [65536] * 200))
    assert [(tmp_path / f"p{i}").read_bytes() for i in range(2)] == blobs


def test_a_direct_write_refused_midway_continues_buffered(tmp_path, monkeypatch):
    real_write = os.write
    refused = []

    def write(fd, data):
        if is_direct(fd) and not refused:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(piecewriter.os, "write", write)
    blob = os.urandom(2 * BUFFER + 123)
    writer = PieceWriter([Piece(sha(blob), len(blob), str(tmp_path / "p"))])
    writer.feed([blob])
    assert writer.close()[0].intact and refused and writer.direct_refused
    assert (tmp_path / "p").read_bytes() == blob


def test_a_piece_that_does_not_hash_to_its_name_is_removed(tmp_path):
    good, bad = os.urandom(10_000), os.urandom(BUFFER + 1)
    pieces = [Piece(sha(good), len(good), str(tmp_path / "good")), Piece("0" * 64, len(bad), str(tmp_path / "bad"))]
    writer = PieceWriter(pieces)
    writer.feed([good + bad])
    assert writer.close() == [Outcome(sha(good), True, True), Outcome("0" * 64, True, False)]
    assert (tmp_path / "good").read_bytes() == good
    assert not (tmp_path / "bad").exists()


def test_abandon_leaves_no_partial_file(tmp_path):
    first, second = os.urandom(ALIGN), os.urandom(BUFFER + ALIGN)
    writer = PieceWriter([Piece(sha(first), len(first), str(tmp_path / "a")), Piece(sha(second), len(second), str(tmp_path / "b"))])
    writer.feed([first + second[: BUFFER + 10]])  # a whole buffer of b is already on disk
    assert (tmp_path / "b").exists()
    writer.abandon()
    writer.abandon()  # idempotent
    assert (tmp_path / "a").read_bytes() == first  # whole and checked: it stays
    assert not (tmp_path / "b").exists()


def test_a_payload_shorter_than_its_pieces_is_an_error_that_removes_the_partial_piece(tmp_path):
    blob = os.urandom(3 * ALIGN)
    writer = PieceWriter([Piece(sha(blob), len(blob), str(tmp_path / "p")), Piece(sha(b""), 0, str(tmp_path / "e"))])
    writer.feed([blob[:-1]])
    with pytest.raises(ValueError, match="1 bytes before"):
        writer.close()
    assert not (tmp_path / "p").exists() and not (tmp_path / "e").exists()


def test_empty_pieces_at_either_end_are_written(tmp_path):
    blobs = [b"", os.urandom(100), b""]
    outcomes = run(tmp_path, blobs, [7] * 20)
    assert all(o.written and o.intact for o in outcomes)
    assert [(tmp_path / f"p{i}").read_bytes() for i in range(3)] == blobs


def test_a_write_error_leaves_no_partial_file(tmp_path, monkeypatch):
    calls = []

    def write(fd, data):
        calls.append(len(data))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(piecewriter.os, "write", write)
    blob = os.urandom(ALIGN + 1)
    writer = PieceWriter([Piece(sha(blob), len(blob), str(tmp_path / "p"))])
    with pytest.raises(OSError) as info:  # writes happen behind the feeder: the error comes by close at the latest
        writer.feed([blob])
        writer.close()
    assert info.value.errno == errno.ENOSPC and calls
    writer.abandon()
    assert not (tmp_path / "p").exists()


def test_a_write_error_is_raised_by_the_slab_it_hit_and_nothing_is_left(tmp_path, monkeypatch):
    """A slab is hashed and written before write_slab (or the feed that
    filled it) returns: a write error is raised there, not later and not
    lost, the slabs after it are never written, and abandon leaves nothing."""
    real = os.write
    written = []

    def write(fd, data):
        if written:
            raise OSError(errno.EIO, "Input/output error")
        written.append(len(data))
        return real(fd, data)

    monkeypatch.setattr(piecewriter.os, "write", write)
    blob = os.urandom(40 * ALIGN)
    writer = PieceWriter([Piece(sha(blob), len(blob), str(tmp_path / "p"))], buffer=4 * ALIGN)
    fed = 0
    with pytest.raises(OSError) as info:
        for at in range(0, len(blob), ALIGN):
            writer.feed([blob[at : at + ALIGN]])
            fed += ALIGN
    assert info.value.errno == errno.EIO
    assert fed == 7 * ALIGN  # raised by the feed that filled the second slab
    assert written == [4 * ALIGN]
    writer.abandon()
    assert os.listdir(tmp_path) == []


# -- files made ahead of the writer (precreate, from another thread) ------------


def test_precreate_makes_the_files_ahead_and_the_writer_fills_them(tmp_path):
    blobs = [os.urandom(n) for n in (5000, 0, ALIGN, 3)]
    pieces = [Piece(sha(b), len(b), str(tmp_path / f"p{i}")) for i, b in enumerate(blobs)]
    writer = PieceWriter(pieces)
    writer.precreate()
    assert sorted(os.listdir(tmp_path)) == [f"p{i}" for i in range(4)]
    writer.feed([b"".join(blobs)])
    assert all(o.written and o.intact for o in writer.close())
    assert [(tmp_path / f"p{i}").read_bytes() for i in range(4)] == blobs


def test_precreate_never_brings_back_a_piece_the_writer_removed(tmp_path):
    """A piece that did not hash to its name is removed by the writer; a
    precreate running behind it must not leave an empty file under that
    name (the writer has reached it: precreate leaves it alone)."""
    good, bad = os.urandom(100), os.urandom(100)
    pieces = [Piece(sha(b"other"), len(bad), str(tmp_path / "bad")), Piece(sha(good), len(good), str(tmp_path / "good"))]
    writer = PieceWriter(pieces, buffer=ALIGN)  # a slab each
    writer.feed([bad])
    writer.precreate()  # late: the first piece is done and gone
    assert sorted(os.listdir(tmp_path)) == ["good"]
    writer.feed([good])
    assert [o.intact for o in writer.close()] == [False, True]
    assert sorted(os.listdir(tmp_path)) == ["good"]


def test_abandon_removes_the_files_made_for_pieces_never_reached(tmp_path):
    blobs = [os.urandom(3000) for _ in range(4)]
    pieces = [Piece(sha(b), len(b), str(tmp_path / f"p{i}")) for i, b in enumerate(blobs)]
    writer = PieceWriter(pieces, buffer=ALIGN)  # a slab each
    writer.precreate()
    writer.feed([blobs[0] + blobs[1][:10]])  # the first piece whole, the second begun
    writer.abandon()
    assert os.listdir(tmp_path) == ["p0"]
    writer.precreate()  # after abandon: does nothing
    assert os.listdir(tmp_path) == ["p0"]


def test_precreate_and_the_writer_in_two_threads_leave_exactly_the_good_pieces(tmp_path):
    """Run together many times: whatever the interleaving, every good piece
    is whole under its name and nothing else is left (bad pieces removed)."""
    import threading

    for attempt in range(30):
        d = tmp_path / str(attempt)
        d.mkdir()
        blobs = [os.urandom(n) for n in (0, 10, 4096, 100, 0, 7000, 1)] * 3
        pieces = []
        for i, b in enumerate(blobs):
            name = sha(b) if i % 4 else sha(b + b"x")  # every fourth piece lies about its digest
            pieces.append(Piece(name, len(b), str(d / f"p{i}")))
        writer = PieceWriter(pieces)
        ahead = threading.Thread(target=writer.precreate)
        ahead.start()
        writer.feed([b"".join(blobs)])
        outcomes = writer.close()
        ahead.join()
        assert [o.intact for o in outcomes] == [bool(i % 4) for i in range(len(blobs))]
        assert sorted(os.listdir(d)) == sorted(f"p{i}" for i in range(len(blobs)) if i % 4)
        for i, b in enumerate(blobs):
            if i % 4:
                assert (d / f"p{i}").read_bytes() == b


def test_abandon_while_precreate_runs_leaves_nothing_behind(tmp_path):
    """abandon in one thread, precreate in another, many times: abandon
    waits for a file being created, so none is left after it."""
    import threading

    for attempt in range(30):
        d = tmp_path / str(attempt)
        d.mkdir()
        blobs = [os.urandom(10) for _ in range(40)]
        writer = PieceWriter([Piece(sha(b), len(b), str(d / f"p{i}")) for i, b in enumerate(blobs)])
        ahead = threading.Thread(target=writer.precreate)
        ahead.start()
        writer.abandon()
        ahead.join()
        assert os.listdir(d) == []
