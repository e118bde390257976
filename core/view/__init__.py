"""The live view: every agent a host holds, as the file tree a mount shows.

The FUSE adapter (``capsulefs.mount``) turns inodes into nodes and file handles
into handles, and calls this package for everything else. The view's rules
and theory of operation are in ``host``.

  * ``nodes``: the vocabulary (node kinds, attributes, the states an agent is shown in).
  * ``LiveHost`` in four parts, each adding to the one before: ``tree`` (the
    agents shown and their states, names and lookup), ``attributes``
    (attributes and xattrs), ``changes`` (mkdir, create, unlink, rename,
    truncate...), ``host`` (opening files; the rules).
  * ``agent``: ``LiveAgent``, one agent as served (manifest, edits, journal, status).
  * ``handles``: open files (read, write, flush per kind of file); ``edit``: an
    edit's shared bytes; ``control``: the control files (``.control/``).
  * ``errors``: the refusals a file system must express (one errno each).
  * ``journal_tail``: the journal appended durably and followed as it grows.
  * The mount's own areas under ``STATE/mount/``: ``scratch`` (editors' temp
    files), ``snapshots`` (``.snapshots/``), ``uploads`` (blobs written through
    ``artifacts/blobs/``); ``blobcheck``: serving blobs never corrupt.
"""
