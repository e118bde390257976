"""Every path of a host's state directory, named once.

The state directory (``capsulefs --state DIR``; default
``/var/lib/capsulefs`` as root) holds everything a host keeps. Each entry is
named here, and the module in the right column owns what is inside it; no
other module spells a name of this table.

  ========================= ==================================================
  entry                     what, and who owns it
  ========================= ==================================================
  ``store.json``            the store's layout version (core/store/host_store)
  ``objects/``              blobs by sha256, stored once (core/store/blobs)
  ``gc.lock``               the blob store's gc lock (core/store/blobs)
  ``agents/<id>/``          each agent's capsule files (core/store/agent)
  ``staging/``              areas being built before a rename installs them
  ``holders/<id>.json``     holder records and files locks (core/store/holder)
  ``recovery/<id>/``        what was set aside: torn tails, kept copies
                            (core/journal/recovery, core/store/kept)
  ``journal-tip/<id>``      each journal's checkable tip (core/journal/tip)
  ``timeline/``             the derived SQLite timelines (core/journal/timeline)
  ``tls/``                  this host's key and certificate, ``tls/peers/``
                            the pinned peers' (capsulefs/peer/identity, book)
  ``peers.json``            the peer book (capsulefs/peer/book)
  ``secrets.json``          the state-file keychain (capsulefs/agents/keychain)
  ``secret-grants.json``    which agent may read which secret, with
  ``.grants.lock``,         its lock and the marker that grants were set up
  ``.grants-made``          once (capsulefs/agents/grants)
  ``logs/<id>/``            agent processes' logs (capsulefs/agents/agent_log)
  ``sandboxes/<id>/``       each agent's sandbox: workspace, uid, home, pid
                            (capsulefs/agents/sandbox_dir, isolation, process)
  ``mount/``                the daemon's work: scratch/, snapshots/, its
                            runtime and lock files (capsulefs/daemon/daemon)
  ``fleet.json``            the fleet's directory this host is a member of,
                            if any (core/fleet/config)
  ========================= ==================================================
"""

from __future__ import annotations

__all__ = [
    "AGENTS_DIR", "FLEET_FILE", "GC_LOCK", "GRANTS_FILE", "GRANTS_LOCK", "GRANTS_MADE", "HOLDERS_DIR", "JOURNAL_TIP_DIR",
    "LOGS_DIR", "OBJECTS_DIR", "PEERS_FILE", "RECOVERY_DIR", "SANDBOXES_DIR", "SECRETS_FILE", "STAGING_DIR",
    "STORE_FILE", "TIMELINE_DIR", "TLS_DIR", "TLS_PEERS_DIR", "WORK_DIR",
]

STORE_FILE = "store.json"
OBJECTS_DIR = "objects"
GC_LOCK = "gc.lock"
AGENTS_DIR = "agents"
STAGING_DIR = "staging"
HOLDERS_DIR = "holders"
RECOVERY_DIR = "recovery"
JOURNAL_TIP_DIR = "journal-tip"
TIMELINE_DIR = "timeline"
TLS_DIR = "tls"
TLS_PEERS_DIR = "peers"  # under TLS_DIR
PEERS_FILE = "peers.json"
SECRETS_FILE = "secrets.json"
GRANTS_FILE = "secret-grants.json"
GRANTS_LOCK = ".grants.lock"
GRANTS_MADE = ".grants-made"
LOGS_DIR = "logs"
SANDBOXES_DIR = "sandboxes"
WORK_DIR = "mount"
FLEET_FILE = "fleet.json"
