"""The view's vocabulary: the nodes a mount shows, their attributes, and the
states an agent is shown in (the rules of the view are in ``host``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from ..capsule import format as fmt

CONTROL = ".control"
SNAPSHOTS = ".snapshots"
CONTROL_FILES = ("abandon", "learn", "model", "move", "remove", "status")
HOST_CONTROL_FILES = ("metrics",)  # MNT/.control/: about the host, not one agent
EDITABLE = frozenset({fmt.WORKING_MEMORY, fmt.SPEC, fmt.VECTOR_INDEX})
XATTR_SHA256 = "user.capsule.sha256"
XATTR_AGENT_ID = "user.capsule.agent_id"
XATTR_EPOCH = "user.capsule.epoch"


class Kind(Enum):
    ROOT = "root"  # the mount's root: one directory per agent
    AGENT = "agent"  # an agent directory (the capsule's top)
    DIR = "dir"  # a directory inside a capsule (rel)
    FILE = "file"  # a non-blob capsule file (rel), on disk in the agent dir
    BLOB = "blob"  # artifacts/blobs/<sha256>, served from the store
    MANIFEST = "manifest"  # manifest.json, computed
    SCRATCH = "scratch"  # an editor's temp file (rel = "<dir>/<name>")
    CONTROL = "control"  # .control/
    CONTROL_FILE = "control_file"  # .control/<rel>
    SNAPSHOTS = "snapshots"  # .snapshots/
    SNAPSHOT = "snapshot"  # .snapshots/<snap>/ (a capsule's top)
    SNAP_DIR = "snap_dir"  # a directory inside a snapshot (rel)
    SNAP_FILE = "snap_file"  # a file inside a snapshot (rel), blobs included
    HOST_CONTROL = "host_control"  # MNT/.control/ (the root's, hidden like an agent's)
    HOST_CONTROL_FILE = "host_control_file"  # MNT/.control/<rel>: metrics


DIR_KINDS = frozenset({Kind.ROOT, Kind.AGENT, Kind.DIR, Kind.CONTROL, Kind.SNAPSHOTS, Kind.SNAPSHOT, Kind.SNAP_DIR,
                       Kind.HOST_CONTROL})


@dataclass(frozen=True, slots=True)
class Node:
    """What an inode stands for. Hashable: the adapter's inode table key."""

    kind: Kind
    agent: str = ""  # agent_id ("" for the root)
    rel: str = ""  # capsule-relative path, or the control file's name
    snap: str = ""  # snapshot name, for the SNAP* kinds

    @property
    def is_dir(self) -> bool:
        return self.kind in DIR_KINDS


ROOT = Node(Kind.ROOT)


def parent_dir(node: Node) -> Node:
    """The directory that holds the directory ``node`` (what its ``..`` is);
    the root is its own."""
    up = node.rel.rpartition("/")[0]
    match node.kind:
        case Kind.ROOT | Kind.AGENT | Kind.HOST_CONTROL:
            return ROOT
        case Kind.CONTROL | Kind.SNAPSHOTS:
            return Node(Kind.AGENT, node.agent)
        case Kind.DIR:
            return Node(Kind.DIR, node.agent, up) if up else Node(Kind.AGENT, node.agent)
        case Kind.SNAPSHOT:
            return Node(Kind.SNAPSHOTS, node.agent)
        case Kind.SNAP_DIR:
            return Node(Kind.SNAP_DIR, node.agent, up, node.snap) if up else Node(Kind.SNAPSHOT, node.agent, "", node.snap)
    raise ValueError(f"{node} is no directory")


@dataclass(frozen=True, slots=True)
class Attr:
    is_dir: bool
    perm: int  # permission bits
    size: int
    mtime_ns: int
    immutable: bool = False  # never changes: the kernel may cache it long
    uid: int | None = None  # None: the mounting user
    gid: int | None = None
    atime_ns: int | None = None  # None: mtime_ns
    ctime_ns: int | None = None  # None: mtime_ns


class AgentState(Enum):
    ACTIVE = "active"
    FROZEN = "frozen"  # a move is under way: every write fails with ReadOnly
    RETIRED = "retired"  # moved away (or being removed): not shown
    REMOVED = "removed"  # removed from the store (capsulefs rm): not shown until its id is back (an import)


def build_tree(files: Sequence[str], extra_dirs: Sequence[str], make: Callable[[str], Node],
          make_dir: Callable[[str], Node]) -> dict[str, dict[str, Node]]:
    """Directory -> {name: node} for a capsule's files."""
    dirs: dict[str, dict[str, Node]] = {"": {}}

    def ensure(d: str) -> None:
        if d in dirs:
            return
        parent, _, name = d.rpartition("/")
        ensure(parent)
        dirs[parent][name] = make_dir(d)
        dirs[d] = {}

    for d in extra_dirs:
        ensure(d)
    for rel in files:
        parent, _, name = rel.rpartition("/")
        ensure(parent)
        dirs[parent][name] = make(rel)
    return dirs


def stat_ident(st: os.stat_result) -> tuple[int, int, int, int]:
    """What tells a file's versions apart: inode, size, mtime, ctime."""
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
