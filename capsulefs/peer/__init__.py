"""Talking to other hosts: mutual TLS with pinned host ids, framed calls.

  * ``identity``: this host's key and certificate (the host id is its digest).
  * ``book``: the peer book, ``STATE/peers.json`` (name, address, host id).
  * ``tls``: TLS over any trio stream, tuned for bulk transfers.
  * ``link``: the peer link: framing, the client (``open_peer``) and the
    server (``serve_peers``); the wire protocol is docs/wire.md.
"""
