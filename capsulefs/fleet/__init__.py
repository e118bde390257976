"""The fleet mode: its engine clients, etcd (the directory) and S3 (the blob
tier), and the components the daemon builds on them: the host lease keeper
(``keeper``), the directory authority (``authority``), the live hosts as the
move code's peers (``peers``) and the blob tier beside the host store
(``tier``).

These modules import httpx; the CLI imports them only inside fleet
commands, so other commands do not pay for it.
"""
