"""The journal: one immutable, hash-chained event per line, and what is derived from it.

  * ``events``: the event kinds and the envelope (``Record``), canonical JSON.
  * ``lines``: the lines as bytes (split, join, verify, the reference merge);
    ``envelope_index``: the vectorised envelope index and the fast merge on it.
  * ``chain``: stamping the next events; ``file``: the journal file (``held``: its
    fields; ``follow``: catching up; ``append``: group commit, durable appends), with ``ring`` (the write-ahead ring),
    ``recovery`` (replaying it after a crash, torn tails), ``lease`` (keeping the
    flock between appends) and ``tip`` (opening without reading the history).
  * ``projections``: the capsule files that are pure functions of the journal;
    ``timeline``: the derived index behind ``capsulefs log``'s filters.

The rules and theory of operation are in ``file`` and docs/journal.md.
"""
