"""Inode numbers for live-view nodes, with the kernel's lookup counts.

Rules:
  * The root is ``pyfuse3.ROOT_INODE``, always known.
  * A node keeps its inode number while the kernel knows it (lookup count
    above zero); once forgotten, the number is never handed out again, so
    two files seen by one ``tar`` run never share an inode number.
  * A rename moves the inode with the name, as the kernel believes
    (:meth:`InodeTable.move`); several inodes may then stand for one node
    until the kernel forgets the older ones.
"""

from __future__ import annotations

from collections.abc import Callable

import pyfuse3

from capsulefs.core.errors import NotFoundError
from capsulefs.core.view.nodes import ROOT, Node


class InodeTable:
    def __init__(self) -> None:
        self._by_node: dict[Node, int] = {ROOT: pyfuse3.ROOT_INODE}  # the newest inode of a node
        self._by_ino: dict[int, Node] = {pyfuse3.ROOT_INODE: ROOT}
        self._all: dict[Node, set[int]] = {}  # every inode standing for a node
        self._count: dict[int, int] = {}
        self._next = pyfuse3.ROOT_INODE + 1

    def __len__(self) -> int:
        return len(self._by_ino)

    def node(self, ino: int) -> Node:
        try:
            return self._by_ino[ino]
        except KeyError:
            raise NotFoundError(f"inode {ino} is not known (stale)") from None

    def peek(self, node: Node) -> int | None:
        """The inode of ``node`` if the kernel knows it, without a reference."""
        return self._by_node.get(node)

    def lookups(self, ino: int) -> int:
        """The kernel's lookup count of ``ino`` (0 for the root, never forgotten)."""
        return self._count.get(ino, 0)

    def all_of(self, node: Node) -> list[int]:
        """Every inode standing for ``node`` (after renames there may be several)."""
        return sorted(self._all.get(node, ()))

    def ref(self, node: Node) -> int:
        """The inode of ``node``, its lookup count raised by one."""
        ino = self._by_node.get(node)
        if ino is None:
            ino = self._next
            self._next += 1
            self._by_node[node] = ino
            self._by_ino[ino] = node
            self._all.setdefault(node, set()).add(ino)
        if ino != pyfuse3.ROOT_INODE:
            self._count[ino] = self._count.get(ino, 0) + 1
        return ino

    def find(self, pred: Callable[[Node], bool]) -> list[int]:
        return [ino for ino, node in self._by_ino.items() if pred(node)]

    def move(self, src: Node, dst: Node) -> None:
        """After a rename: the inode the kernel knows as ``src`` is now ``dst``.

        An inode that was ``dst`` keeps serving ``dst`` until forgotten (the
        kernel treats it as unlinked).
        """
        ino = self._by_node.pop(src, None)
        if ino is None:
            return
        self._discard(src, ino)
        self._by_ino[ino] = dst
        self._by_node[dst] = ino
        self._all.setdefault(dst, set()).add(ino)

    def _discard(self, node: Node, ino: int) -> None:
        inos = self._all.get(node)
        if inos is not None:
            inos.discard(ino)
            if not inos:
                del self._all[node]

    def forget(self, ino: int, n: int) -> None:
        if ino == pyfuse3.ROOT_INODE or ino not in self._count:
            return
        left = self._count[ino] - n
        if left > 0:
            self._count[ino] = left
            return
        del self._count[ino]
        node = self._by_ino.pop(ino)
        self._discard(node, ino)
        if self._by_node.get(node) == ino:
            del self._by_node[node]
