"""The serving process: one daemon per mount of the host store.

  * ``daemon``: ``Daemon`` (mounting, signals, the runtime file, the state
    lock, the agent hooks the move driver calls).
  * ``readahead``: the mount's readahead (its backing device info).
"""
