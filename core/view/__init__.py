"""The live view: every agent a host holds, as the file tree a mount shows.

The FUSE adapter (``capsulefs.mount``) turns inodes into nodes and file handles
into handles, and calls this package for everything else.

  * ``host``: ``LiveHost`` (the tree, attributes, changes, opening) and
    ``LiveAgent`` (one agent as served: manifest, edits, status).
  * ``handles``: open files (read, write, flush per kind of file), control files.
  * ``errors``: the refusals a file system must express (one errno each).
  * ``journal_tail``: the journal appended durably and followed as it grows.
  * The mount's own areas under ``STATE/mount/``: ``scratch`` (editors' temp
    files), ``snapshots`` (``.snapshots/``), ``uploads`` (blobs written through
    ``artifacts/blobs/``); ``blobcheck``: serving blobs never corrupt.
"""
