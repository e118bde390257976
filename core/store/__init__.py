"""The host store: this host's agents, their blobs, and what it knows of who holds each.

  * ``host_store``: ``HostStore`` (agents, blobs stored once, staging, gc)
    and ``AgentHandle`` (one agent's files).
  * ``holder``: holder records, what this host knows about who holds each agent.
"""
