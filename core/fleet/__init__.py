"""The fleet mode, sans-IO: etcd's v3 JSON gateway, AWS SigV4, S3 replies, and the
directory as the holder authority (``directory``: records, the move's Txns and
their judgement) with its lease timing (``lease``).

Rules:
  * Nothing here does I/O or reads a clock: requests are built into plain
    values, replies are parsed from the bytes the network gave, and the time
    of a signature is a parameter. The httpx clients in ``capsulefs.fleet``
    drive these codecs.
  * Every reply is hostile: a parser takes bytes, checks every field it uses
    (type, range, encoding) and raises a :mod:`.errors` type naming what is
    wrong; nothing else escapes it (a fuzz target checks that).
"""
