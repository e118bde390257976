"""Moving agents between hosts: the I/O around the sans-IO machines of ``capsulefs.core.move``.

  * ``host``: what both sides share on one host (holder records, agent hooks,
    the wire form of answers).
  * ``source``: the source side, driving ``SourceMachine`` over the peer link.
  * ``target``: the target side, the peer-link handler running ``TargetMachine``;
    ``intake``: where a move's pieces go once received; ``pieces``: writing
    them into the staging area; ``writers``: in worker threads or a helper
    process, ``writer_process`` (``python -I -m capsulefs.move.writer_process``).
  * ``mount_moves``: moves in the mount daemon (``.control/move``, serving peers).
"""
