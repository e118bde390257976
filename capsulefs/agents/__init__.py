"""Running agents on this host.

  * ``supervisor``: building each agent's sandbox (its folder under
    ``STATE/sandboxes/``), running, restarting and stopping its process.
  * ``isolation``: a uid of its own, a locked state directory, a cgroup
    (what makes the sandbox a boundary when the daemon runs as root).
  * ``runtime``: the supervisor wired to the daemon; ``removal``: removing an agent.
  * ``keychain`` (the host's secrets) and ``grants`` (which agent may have which).
  * ``reference``: the reference agent, ``capsulefs agent``.

"Sandbox" names the folder an agent runs in; "isolation" what keeps it there.
"""
