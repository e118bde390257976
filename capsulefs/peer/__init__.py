"""Talking to other hosts: mutual TLS with pinned host ids, framed calls.

  * ``identity``: this host's key and certificate (the host id is its digest).
  * ``book``: the peer book, ``STATE/peers.json`` (name, address, host id).
  * ``finder``: who the peers are (``PeerFinder``): the book, or in the fleet
    mode the directory's live hosts (capsulefs/fleet/peers.py).
  * ``tls``: TLS over any trio stream, tuned for bulk transfers.
  * ``errors``: the link's errors (``PeerError`` and kin), mapped at one boundary.
  * ``framing``: frames (prefix, JSON header, payload) over a stream.
  * ``client``: connect and make calls (``open_peer``).
  * ``server``: answer calls (``serve_peers``); the wire protocol is docs/wire.md.
"""
