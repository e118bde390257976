"""The serving process: one daemon per mount of the host store.

  * ``root``: ``compose()``, the composition root: every component of a
    mount's daemon, built through its constructor, in one function.
  * ``agents``: ``Agents``, the one owner of an agent's lifecycle on this
    host (what the mount shows, whether it runs; the move hooks, removal).
  * ``daemon``: ``Daemon`` (mounting, signals, the runtime file, the state lock).
  * ``readahead``: the mount's readahead (its backing device info).
  * ``metrics_file``: ``mount --metrics-file``.
"""
