"""The fleet mode's engine clients: etcd (the directory) and S3 (the blob tier).

These modules import httpx; the CLI imports them only inside fleet
commands, so other commands do not pay for it.
"""
