"""The host store: this host's agents, their blobs, and what it knows of who holds each.

  * ``host_store``: ``HostStore`` (opening the state directory, agents, staging, gc),
    a ``BlobStore`` (``blobs``: objects/, blobs stored once) with agents; each
    agent's files are an ``AgentHandle`` (``agent``).
  * ``holder``: holder records, what this host knows about who holds each agent.
"""
