"""Verifying a capsule, whether a directory or a tar (plain, gzip or zstd).

Theory of operation: a *scan* walks the capsule once and produces a
:class:`Listing`: for every entry its kind, size and sha256, plus the bytes
of the small structured files (manifest, snapshot, spec, journal...) and
every problem the walk itself found (unsafe paths, links, devices,
duplicates). :func:`check` then compares the listing with the manifest and
runs the content checks, so a directory and a tar are judged by the same
rules. Verification lists every problem; it never stops at the first.

Content checks are a table (``CONTENT_CHECKS``: capsule path -> function of
the file's bytes returning problems), so the journal can add its chain
check without this module knowing the journal.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field

from . import format as fmt
from ..errors import CapsuleError, FormatError
from ..hashing import hash_file, parallel_map
from .spec import parse_spec

#: Files whose bytes a scan keeps for content checks (besides the manifest).
KEEP_BYTES = frozenset({fmt.SIGNATURE, fmt.SNAPSHOT, fmt.SPEC, fmt.JOURNAL, fmt.VECTOR_INDEX})
#: Largest file whose bytes a scan keeps in memory.
KEEP_LIMIT = 1 << 30


@dataclass(frozen=True, slots=True)
class Problem:
    path: str  # the capsule path at fault ("" for the capsule as a whole)
    what: str  # kind of problem: digest, size, missing, unlisted, unsafe, type, ...
    detail: str  # words for a person

    def __str__(self) -> str:
        where = self.path or "capsule"
        text = f"{where}: {self.detail}"
        # One line, whatever a tar's names hold (a newline could forge an "OK:" line).
        return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


@dataclass(slots=True)
class Entry:
    kind: str  # "file" or "dir"
    size: int = 0
    sha256: str = ""


@dataclass(slots=True)
class Listing:
    entries: dict[str, Entry] = field(default_factory=dict)
    contents: dict[str, bytes] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)
    complete: bool = True  # False: the scan stopped early (at a problem), so absent files are not reported
    manifest: fmt.Manifest | None = None  # contents[MANIFEST] parsed, if the scan parsed it


def _check_spec(data: bytes) -> list[str]:
    try:
        parse_spec(data)
    except CapsuleError as exc:
        return [str(exc)]
    return []


def _check_snapshot(data: bytes) -> list[str]:
    try:
        fmt.parse_snapshot(data)
    except CapsuleError as exc:
        return [str(exc)]
    return []


def _check_journal(data: bytes) -> list[str]:
    from ..journal.lines import check_journal_bytes  # chains, seqs, order, forks; every line parsed

    return check_journal_bytes(data)


CONTENT_CHECKS: dict[str, Callable[[bytes], list[str]]] = {
    fmt.SPEC: _check_spec,
    fmt.SNAPSHOT: _check_snapshot,
    fmt.JOURNAL: _check_journal,
}


# -- scanning a directory ------------------------------------------------------


def _holds_anything(path: str) -> bool:
    try:
        with os.scandir(path) as it:
            return next(it, None) is not None
    except OSError:
        return True  # (unreadable: say so rather than guess it empty)


def scan_dir(root: str) -> Listing:
    """Walk a capsule directory without following links, and without
    recursion: only the capsule's tree (``format.TREE_DIRS``) is entered, so a
    directory the format does not have, however deep, is one problem."""
    listing = Listing()
    files: list[str] = []
    root = os.path.abspath(root)
    if not os.path.isdir(root):
        raise FormatError(f"{root} is not a directory")
    todo = [""]
    while todo:
        reldir = todo.pop(0)
        with os.scandir(os.path.join(root, reldir)) as it:
            found = sorted(it, key=lambda e: e.name)
        for e in found:
            rel = f"{reldir}/{e.name}" if reldir else e.name
            st = e.stat(follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                listing.entries[rel] = Entry("dir")
                if rel in fmt.TREE_DIRS:
                    todo.append(rel)
                elif _holds_anything(e.path):
                    listing.problems.append(Problem(rel, "unknown", "is a directory the capsule format does not "
                                                    "have; what it holds was not read"))
            elif stat.S_ISREG(st.st_mode):
                files.append(rel)
            elif stat.S_ISLNK(st.st_mode):
                listing.problems.append(Problem(rel, "type", "is a symbolic link; a capsule holds only files and directories"))
            else:
                listing.problems.append(Problem(rel, "type", "is a device, fifo or socket; a capsule holds only files and directories"))

    def digest(rel: str) -> tuple[str, str, int]:
        sha, size = hash_file(os.path.join(root, rel))
        return rel, sha, size

    for rel, sha, size in parallel_map(digest, files):
        listing.entries[rel] = Entry("file", size, sha)
        if (rel in KEEP_BYTES or rel == fmt.MANIFEST) and size <= KEEP_LIMIT:
            with open(os.path.join(root, rel), "rb") as f:
                listing.contents[rel] = f.read()
    return listing


# -- judging a listing -----------------------------------------------------------


def check(listing: Listing, *, pubkey: bytes | None = None) -> tuple[fmt.Manifest | None, list[Problem]]:
    """Judge a scanned capsule. Returns (manifest if parsable, problems)."""
    problems = list(listing.problems)
    raw = listing.contents.get(fmt.MANIFEST)
    if raw is None:
        if listing.complete:
            problems.append(Problem(fmt.MANIFEST, "missing", "missing: a capsule needs manifest.json"))
        return None, problems
    try:
        manifest = listing.manifest or fmt.Manifest.from_bytes(raw)
    except CapsuleError as exc:
        problems.append(Problem(fmt.MANIFEST, "manifest", str(exc)))
        return None, problems

    for path in fmt.REQUIRED_FILES:
        if path not in manifest.files:
            problems.append(Problem(path, "missing", "not listed in the manifest; every capsule has this file"))

    for path, want in sorted(manifest.files.items()):
        got = listing.entries.get(path)
        if got is None:
            if listing.complete:
                problems.append(Problem(path, "missing", "listed in the manifest but missing"))
            continue
        if got.kind != "file":
            problems.append(Problem(path, "type", "listed as a file but is a directory"))
            continue
        if got.size != want.size:
            word = "truncated" if got.size < want.size else "grown"
            problems.append(Problem(path, "size", f"{word}: the manifest says {want.size} bytes, found {got.size}"))
        elif got.sha256 != want.sha256:
            problems.append(Problem(path, "digest", f"changed: sha256 is {got.sha256}, the manifest says {want.sha256}"))
        name = fmt.blob_name(path)
        if name is not None and (not fmt.is_sha256(name) or name != got.sha256):
            problems.append(Problem(path, "blob", f"blob name does not match its content (sha256 {got.sha256})"))

    for path, entry in sorted(listing.entries.items()):
        if entry.kind == "file" and path not in manifest.files and path not in fmt.UNLISTED:
            problems.append(Problem(path, "unlisted", "present but not listed in the manifest"))

    # Every workspace file of the snapshot has its blob.
    snap = listing.contents.get(fmt.SNAPSHOT)
    if snap is not None:
        try:
            for wpath, sha in sorted(fmt.parse_snapshot(snap).items()):
                if fmt.blob_path(sha) not in manifest.files:
                    problems.append(Problem(fmt.SNAPSHOT, "snapshot", f"workspace file {wpath} needs blob {sha}, which the capsule lacks"))
        except CapsuleError:
            pass  # reported by its content check below

    # Every blob an attachment in the journal names is in the capsule.
    journal = listing.contents.get(fmt.JOURNAL)
    if journal is not None:
        from ..journal.projections import attachment_blobs

        for sha, no in sorted(attachment_blobs(journal.split(b"\n")).items(), key=lambda x: x[1]):
            if fmt.blob_path(sha) not in manifest.files:
                problems.append(Problem(fmt.JOURNAL, "attachment",
                                        f"line {no}: attachment needs blob {sha}, which the capsule lacks"))

    for path, fn in CONTENT_CHECKS.items():
        data = listing.contents.get(path)
        if data is None or path not in manifest.files:
            continue
        for msg in fn(data):
            problems.append(Problem(path, "content", msg))

    if pubkey is not None:
        from .signing import verify_manifest_signature

        sig = listing.contents.get(fmt.SIGNATURE)
        if sig is None:
            problems.append(Problem(fmt.SIGNATURE, "signature", "missing: --pubkey was given but the capsule is not signed"))
        else:
            try:
                verify_manifest_signature(raw, sig, pubkey)
            except CapsuleError as exc:
                problems.append(Problem(fmt.SIGNATURE, "signature", str(exc)))
    return manifest, problems
