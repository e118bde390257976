"""Merging two copies of one agent that diverged offline: ``capsulefs merge A B -o C``.

Rules:
  * Both sides must be the same agent (same ``agent_id``) and must verify:
    a capsule directory or tar by the full capsule check (journal chains
    included), an agent of the host store by its journal chains (its
    manifest may lag appends) and its blobs by re-hashing as they are read.
  * The journal of C is the union of both journals (:func:`merge_bytes`);
    the blobs of C are the union of both sides' blobs.
  * Projections are recomputed from the merged journal: working memory is
    the last ``memory_edit``, the snapshot the fold of ``workspace_update``.
    A projection the journal says nothing about (no such event at all) is
    kept from A; if B's differs, a warning says so. The same holds for the
    spec and any other plain file: A's copy wins, with a warning.
  * The holder with the greater epoch wins (A on a tie): epochs only grow.
  * The semantic index is rebuilt from both sides' indexes for the merged
    journal (it is derived data).
  * C is written whole or not at all: a directory staged beside it and
    renamed, or a tar written atomically. C must not exist yet.

Theory of operation: each side is loaded into a :class:`Side` (manifest,
plain files' bytes, a blob reader that re-hashes), the merged capsule is
planned as plain files plus blob names, checked, then written.
"""

from __future__ import annotations

import hashlib
import functools
import io
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

from . import format as fmt
from ..errors import CapsuleError, CorruptBlobError, FormatError, NotFoundError
from ..fsutil import atomic_write, fsync_dir, makedirs_durable
from ..journal.envelope_index import merge_bytes
from ..journal.lines import check_lines, split_lines
from ..journal.projections import has_workspace_updates, last_memory_edit, referenced_blobs, snapshot

log = logging.getLogger(__name__)


class MergeRefused(CapsuleError):
    """Two capsules cannot be merged; nothing was written."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Side:
    """One input of a merge, loaded and checked."""

    label: str  # how messages name it (its path or agent name)
    manifest: fmt.Manifest
    files: dict[str, bytes]  # every plain (non-blob) file but the manifest and signature
    blobs: dict[str, int]  # sha256 -> size of every blob it holds
    blob_path: Callable[[str], str]  # sha256 -> file to read it from


def _read_verified(path: str, sha: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise NotFoundError(f"blob {sha} is missing ({path})") from None
    if hashlib.sha256(data).hexdigest() != sha:
        raise CorruptBlobError(path, hashlib.sha256(data).hexdigest())
    return data


def side_from_dir(root: str, label: str | None = None) -> Side:
    """A capsule directory, after the full capsule check."""
    from .archive import verify_capsule

    label = label or root
    manifest, problems = verify_capsule(root)
    if problems or manifest is None:
        shown = "; ".join(str(p) for p in problems[:5])
        raise MergeRefused(f"{label} does not verify: {shown}")
    files = {}
    for rel in manifest.files:
        if fmt.blob_name(rel) is None:
            with open(os.path.join(root, rel), "rb") as f:
                files[rel] = f.read()
    return Side(
        label=label,
        manifest=manifest,
        files=files,
        blobs=manifest.blobs(),
        blob_path=lambda sha: os.path.join(root, fmt.blob_path(sha)),
    )


@contextmanager
def side_from_tar(path: str, scratch: str) -> Iterator[Side]:
    """A capsule tar, extracted into a private directory under ``scratch``."""
    from .verify import check
    from .tarball import extract_into, scan_tar

    with tempfile.TemporaryDirectory(prefix=".merge-", dir=scratch) as tmp:
        tree = os.path.join(tmp, "capsule")
        os.mkdir(tree)
        # (judged as verify judges a tar: the scan leaves a manifest it cannot
        # parse for check to name, and extracts nothing after it)
        _manifest, problems = check(scan_tar(path, extract_into(tree)))
        if problems:
            shown = "; ".join(str(p) for p in problems[:5])
            raise MergeRefused(f"{path} does not verify: {shown}")
        yield side_from_dir(tree, label=path)


def side_from_agent(agent: object) -> Side:
    """An agent of the host store (an AgentHandle): its files as they are now,
    the journal up to its last whole line."""
    from .archive import snapshot_files

    return _agent_side(agent, snapshot_files(agent))  # type: ignore[arg-type]


def _agent_side(agent: object, files: dict[str, bytes]) -> Side:
    """One side of a merge from an agent's ``files`` as read (its journal
    checked line by line: a line that does not parse refuses the merge)."""
    from .archive import frozen_manifest

    manifest = frozen_manifest(agent, files)  # type: ignore[arg-type]
    label = f"agent {manifest.name}"
    try:
        check_lines(split_lines(files.get(fmt.JOURNAL, b"")), f"{label}: journal")
    except FormatError as exc:
        raise MergeRefused(str(exc)) from None
    store = agent.store  # type: ignore[attr-defined]
    return Side(label=label, manifest=manifest, files=files, blobs=manifest.blobs(), blob_path=store.blob_file)


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """The merged capsule, before it is written."""

    manifest: fmt.Manifest
    files: dict[str, bytes]  # plain files
    blobs: dict[str, Callable[[], bytes]]  # sha256 -> reader (re-hashes)
    warnings: list[str]


def plan_merge(a: Side, b: Side) -> Plan:
    """Decide every file of the merged capsule. Raises MergeRefused or ChainError."""
    if a.manifest.agent_id != b.manifest.agent_id:
        raise MergeRefused(
            f"{a.label} is agent {a.manifest.agent_id} and {b.label} is agent {b.manifest.agent_id}: "
            "only two copies of the same agent can be merged"
        )
    warnings: list[str] = []
    journal = merge_bytes(a.files.get(fmt.JOURNAL, b""), b.files.get(fmt.JOURNAL, b""))
    lines = split_lines(journal)

    blob_src: dict[str, Callable[[], bytes]] = {}
    for side in (b, a):  # A's copy is read when both have it
        for sha in side.blobs:
            blob_src[sha] = functools.partial(_read_verified, side.blob_path(sha), sha)

    files: dict[str, bytes] = {}
    for rel in sorted(set(a.files) | set(b.files)):
        if rel in (fmt.JOURNAL, fmt.VECTOR_INDEX):
            continue
        if rel in a.files and rel in b.files and a.files[rel] != b.files[rel] and rel not in (fmt.WORKING_MEMORY, fmt.SNAPSHOT):
            warnings.append(f"{rel} differs between {a.label} and {b.label}; kept {a.label}'s")
        files[rel] = a.files[rel] if rel in a.files else b.files[rel]
    files[fmt.JOURNAL] = journal

    edit = last_memory_edit(lines)
    if edit is not None:
        if edit.text is not None:
            files[fmt.WORKING_MEMORY] = edit.text.encode()
        else:
            assert edit.blob is not None
            if edit.blob not in blob_src:
                raise MergeRefused(f"the last memory_edit names blob {edit.blob}, which neither capsule holds")
            files[fmt.WORKING_MEMORY] = blob_src[edit.blob]()
    elif a.files.get(fmt.WORKING_MEMORY) != b.files.get(fmt.WORKING_MEMORY):
        warnings.append(f"{fmt.WORKING_MEMORY} differs and no memory_edit decides; kept {a.label}'s")

    if has_workspace_updates(lines):
        snap = snapshot(lines)
        missing = sorted(sha for sha in snap.values() if sha not in blob_src)
        if missing:
            raise MergeRefused(f"the merged workspace needs {len(missing)} blob(s) neither capsule holds, e.g. {missing[0]}")
        files[fmt.SNAPSHOT] = fmt.snapshot_bytes(snap)
    elif a.files.get(fmt.SNAPSHOT) != b.files.get(fmt.SNAPSHOT):
        warnings.append(f"{fmt.SNAPSHOT} differs and no workspace_update decides; kept {a.label}'s")

    files[fmt.VECTOR_INDEX] = _merged_index(a, b, journal, blob_src)

    # Blobs: every blob either side held (history included).
    blobs = dict(sorted(blob_src.items()))
    unknown = referenced_blobs(lines) - set(blobs)
    if unknown:
        log.info("merged journal names %d blob(s) neither capsule holds (old versions)", len(unknown))

    if a.manifest.name != b.manifest.name:
        warnings.append(f"the agent is named {a.manifest.name!r} in {a.label} and {b.manifest.name!r} in {b.label}; "
                        f"kept {a.label}'s name")
    holder = max((a.manifest.holder, b.manifest.holder), key=lambda h: h.epoch)  # A on a tie
    extra = dict(b.manifest.extra)
    extra.update(a.manifest.extra)
    entries = {rel: fmt.FileEntry(sha256=hashlib.sha256(d).hexdigest(), size=len(d)) for rel, d in files.items()}
    for sha in blobs:
        size = a.blobs.get(sha, b.blobs.get(sha))
        assert size is not None
        entries[fmt.blob_path(sha)] = fmt.FileEntry(sha256=sha, size=size)
    manifest = fmt.Manifest(
        agent_id=a.manifest.agent_id, name=a.manifest.name, holder=holder, files=entries, extra=extra
    )
    for w in warnings:
        log.warning("merge: %s", w)
    return Plan(manifest=manifest, files=files, blobs=blobs, warnings=warnings)


def _merged_index(a: Side, b: Side, journal: bytes, blob_src: dict[str, Callable[[], bytes]]) -> bytes:
    from ..semantic.embedders import select_embedder
    from ..semantic.vectors import dump_index, parse_index
    from ..semantic.index import merge_indexes

    def load(side: Side):  # type: ignore[no-untyped-def]
        data = side.files.get(fmt.VECTOR_INDEX)
        if data is None:
            return None
        try:
            return parse_index(data)
        except FormatError:
            return None

    def read_blob(sha: str) -> bytes:
        if sha not in blob_src:
            raise NotFoundError(f"blob {sha} is in neither capsule")
        return blob_src[sha]()

    index, _report = merge_indexes(load(a), load(b), journal, select_embedder(), blobs=read_blob)
    return dump_index(index)


def write_plan(plan: Plan, dest: str, *, mtime: int) -> None:
    """Write the merged capsule at ``dest``: a tar if its name says so, else a directory."""
    if os.path.lexists(dest):
        raise MergeRefused(f"{dest} already exists; merge writes a new capsule")
    from .tar_export import tar_kind

    if tar_kind(dest) is not None:
        _write_tar(plan, dest, mtime=mtime)
    else:
        _write_dir(plan, dest)


def _write_tar(plan: Plan, dest: str, *, mtime: int) -> None:
    from .tar_export import Member, write_tar

    def members() -> Iterator[Member]:  # the manifest first, as export writes it (see tarball)
        raw = plan.manifest.to_bytes()
        yield Member(fmt.MANIFEST, len(raw), lambda: io.BytesIO(raw))
        for rel in sorted(plan.files):
            data = plan.files[rel]
            yield Member(rel, len(data), functools.partial(io.BytesIO, data))
        for sha, read in plan.blobs.items():
            size = plan.manifest.files[fmt.blob_path(sha)].size
            yield Member(fmt.blob_path(sha), size, lambda r=read: io.BytesIO(r()))  # type: ignore[misc]

    write_tar(dest, members(), mtime=mtime)


def _write_dir(plan: Plan, dest: str) -> None:
    dest = os.path.abspath(dest)
    parent = os.path.dirname(dest)
    makedirs_durable(parent)
    with ExitStack() as stack:
        stage = stack.enter_context(tempfile.TemporaryDirectory(prefix=".merge-out-", dir=parent))
        tree = os.path.join(stage, "capsule")
        os.mkdir(tree, 0o755)
        for rel, data in plan.files.items():
            path = os.path.join(tree, rel)
            makedirs_durable(os.path.dirname(path))
            atomic_write(path, data)
        for sha, read in plan.blobs.items():
            path = os.path.join(tree, fmt.blob_path(sha))
            makedirs_durable(os.path.dirname(path))
            atomic_write(path, read())
        atomic_write(os.path.join(tree, fmt.MANIFEST), plan.manifest.to_bytes())
        fsync_dir(tree)
        os.rename(tree, dest)
        fsync_dir(parent)


def merge_into_agent(agent: object, other: Side) -> Plan:
    """Merge ``other`` into ``agent``, an agent of the host store, in place:
    ``capsulefs merge AGENT OTHER --into``. The caller has checked that this
    host holds the agent and that nothing else writes it (no daemon, the
    state directory held). Under the agent's files lock (exclusive, as an
    append takes it): the agent is read, the merge planned with the agent as
    A (its holder, name, spec win), the blobs it lacks put in the store, then
    the journal, projections and index written (``write_files``: the blobs
    listed in the manifest before any file names them). The journal only
    gains lines: every line the agent had stays, byte for byte."""
    from .archive import _read_files
    from ..store.holder import agent_files_lock
    from ..store.layout import HOLDERS_DIR

    store = agent.store  # type: ignore[attr-defined]
    agent_id = agent.agent_id  # type: ignore[attr-defined]
    with agent_files_lock(os.path.join(store.root, HOLDERS_DIR), agent_id, shared=False), store.writing():
        files = _read_files(agent)  # type: ignore[arg-type]
        mine = _agent_side(agent, files)
        plan = plan_merge(mine, other)
        old = files.get(fmt.JOURNAL, b"")
        if not set(split_lines(old)) <= set(split_lines(plan.files[fmt.JOURNAL])):
            raise MergeRefused(f"the merge would drop lines of {mine.label}'s journal: nothing written")
        for sha, read in plan.blobs.items():
            if not store.has_blob(sha):
                store.put_blob(read(), expect=sha)
        changed = {rel: data for rel, data in plan.files.items() if files.get(rel) != data}
        agent.write_files(changed, add_blobs=list(plan.blobs))  # type: ignore[attr-defined]
    return plan


def merge_capsules(a: Side, b: Side, dest: str, *, mtime: int) -> Plan:
    """Merge two loaded sides into a new capsule at ``dest``; return the plan."""
    plan = plan_merge(a, b)
    write_plan(plan, dest, mtime=mtime)
    return plan


__all__ = [
    "MergeRefused",
    "Plan",
    "Side",
    "merge_capsules",
    "merge_into_agent",
    "plan_merge",
    "side_from_agent",
    "side_from_dir",
    "side_from_tar",
    "write_plan",
]
