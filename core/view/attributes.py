"""Attributes and extended attributes of the view's nodes (``LiveHost``'s second part).

Modes, sizes and times follow the capsule: blobs and snapshots are immutable,
the manifest's time is that of the newest file it covers, directories show
one fixed time. With isolation, each agent's directory and files are its own uid's.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import replace

from ..capsule import format as fmt
from ..errors import NotFoundError
from .errors import NoAttribute
from .nodes import XATTR_AGENT_ID, XATTR_EPOCH, XATTR_SHA256, Attr, Kind, Node
from .tree import Tree


class Attributes(Tree):
    def attr(self, node: Node) -> Attr:
        a = self._attr(node)
        if self.owners is None or node.kind in (Kind.HOST_CONTROL, Kind.HOST_CONTROL_FILE):
            return a
        if node.kind is Kind.ROOT:
            return replace(a, perm=0o711)  # (agents pass through to their own; none lists the others)
        owner = self.owners.owner_of(node.agent)
        if node.kind is Kind.AGENT:
            a = replace(a, perm=0o700)
        if owner is None or node.kind in (Kind.CONTROL, Kind.CONTROL_FILE) or a.uid not in (None, self.owner_uid):
            return a
        return replace(a, uid=owner, gid=owner)

    def _attr(self, node: Node) -> Attr:
        match node.kind:
            case Kind.ROOT | Kind.HOST_CONTROL:
                return Attr(True, 0o755, 0, os.stat(self.store.agents_dir).st_mtime_ns)
            case Kind.HOST_CONTROL_FILE:  # (metrics: rendered when read; its size as of now)
                return Attr(False, 0o444, len(self.metrics_bytes()), self.now_ns())
            case Kind.AGENT | Kind.DIR | Kind.CONTROL | Kind.SNAPSHOTS:
                a = self.agent(node.agent)
                a.stored_manifest()
                if node.kind is Kind.DIR and node.rel not in a.tree():
                    raise NotFoundError(f"{node.rel}: no such directory")
                return a.dir_attr(node.rel) if node.kind is Kind.DIR else Attr(True, 0o755, 0, a.dir_mtime_ns)
            case Kind.FILE:
                return self.agent(node.agent).file_attr(node.rel)
            case Kind.BLOB:
                sha = fmt.blob_name(node.rel) or ""
                size = self.agent(node.agent).blobs().get(sha)
                if size is None and (pending := self.uploads.pending_size(node.agent, sha)) is not None:
                    return Attr(False, 0o644, pending, self.now_ns())  # being uploaded (uploads)
                if size is None:
                    raise NotFoundError(f"{node.rel}: no such blob in this agent")
                try:
                    mtime = os.stat(self.store.blob_file(sha)).st_mtime_ns
                except FileNotFoundError:  # quarantined (found damaged): listed still, and reading it is EIO
                    mtime = 0
                return Attr(False, 0o444, size, mtime, immutable=True)
            case Kind.MANIFEST:
                data, mtime = self.agent(node.agent).manifest_attr()
                return Attr(False, 0o444, len(data), mtime)
            case Kind.SCRATCH:
                d, _, n = node.rel.rpartition("/")
                st = self.scratch.stat(node.agent, d, n)
                return Attr(False, st.st_mode & 0o7777, st.st_size, st.st_mtime_ns, uid=st.st_uid, gid=st.st_gid,
                            atime_ns=st.st_atime_ns, ctime_ns=st.st_ctime_ns)
            case Kind.CONTROL_FILE:
                a = self.agent(node.agent)
                mtime = os.stat(a.handle.dir).st_mtime_ns
                if node.rel == "status":
                    return Attr(False, 0o444, len(a.status_bytes()), mtime)
                if node.rel == "model":
                    return Attr(False, 0o644, len(a.model_bytes()), mtime)
                return Attr(False, 0o644, 0, mtime)
            case Kind.SNAPSHOT | Kind.SNAP_DIR:
                self._snap(node.agent, node.snap)
                st = os.stat(self.snapshots.dir(node.agent, node.snap))
                # 0755 like the agent's own directories (writes are EROFS all
                # the same): `cp -a` keeps the mode, and a copy of 0555
                # directories cannot be copied into again or removed by its owner.
                return Attr(True, 0o755, 0, st.st_mtime_ns, immutable=True)
            case Kind.SNAP_FILE:
                c = self._snap(node.agent, node.snap)
                mtime = os.stat(self.snapshots.file_path(node.agent, node.snap, fmt.MANIFEST)).st_mtime_ns
                if node.rel == fmt.MANIFEST:
                    size = os.stat(self.snapshots.file_path(node.agent, node.snap, fmt.MANIFEST)).st_size
                else:
                    size = c.manifest.files[node.rel].size
                return Attr(False, 0o444, size, mtime, immutable=True)
        raise AssertionError(node)  # pragma: no cover

    def xattrs(self, node: Node) -> dict[str, bytes]:
        match node.kind:
            case Kind.AGENT:
                m = self.agent(node.agent).stored_manifest()
                return {XATTR_AGENT_ID: m.agent_id.encode(), XATTR_EPOCH: str(m.holder.epoch).encode()}
            case Kind.SNAPSHOT:
                m = self._snap(node.agent, node.snap).manifest
                return {XATTR_AGENT_ID: m.agent_id.encode(), XATTR_EPOCH: str(m.holder.epoch).encode()}
            case Kind.FILE:
                return {XATTR_SHA256: self.agent(node.agent).entry(node.rel).sha256.encode()}
            case Kind.BLOB:
                return {XATTR_SHA256: (fmt.blob_name(node.rel) or "").encode()}
            case Kind.MANIFEST:
                data = self.agent(node.agent).manifest_bytes()
                return {XATTR_SHA256: hashlib.sha256(data).hexdigest().encode()}
            case Kind.SNAP_FILE:
                c = self._snap(node.agent, node.snap)
                if node.rel == fmt.MANIFEST:
                    data = c.manifest.to_bytes()
                    with open(self.snapshots.file_path(node.agent, node.snap, fmt.MANIFEST), "rb") as f:
                        data = f.read()
                    return {XATTR_SHA256: hashlib.sha256(data).hexdigest().encode()}
                return {XATTR_SHA256: c.manifest.files[node.rel].sha256.encode()}
        return {}

    def getxattr(self, node: Node, name: str) -> bytes:
        value = self.xattrs(node).get(name)
        if value is None:
            raise NoAttribute(f"no attribute {name}")
        return value
