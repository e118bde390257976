"""A daemon's membership in a fleet: its etcd client, host lease keeper and directory authority.

Rules:
  * Built by the composition root (capsulefs/daemon/root.py) when the mount
    has a directory (``mount --directory``, or the state dir's fleet.json);
    peer-to-peer mounts never import this module (nor httpx).
  * The keeper's listener is the agents' lifecycle owner (through the
    root's upcalls): it stops every agent and makes it read-only when the
    lease cannot be renewed in time, and lets each run again after a new
    lease only once the directory confirms it (capsulefs/daemon/agents.py).
  * :meth:`FleetMember.serve` is a daemon service: the keeper's loop; the
    HTTP connection pool is closed when it ends.

Theory of operation: one object holding the three components; the
authority is kept for the moves through the directory (the next slice).
"""

from __future__ import annotations

import hashlib

import httpx
import trio

from capsulefs.core.fleet import directory as fd
from capsulefs.core.fleet.config import FleetConfig
from capsulefs.core.fleet.etcd._ops import parse_endpoints
from capsulefs.core.fleet.lease import DEFAULT_TIMING, LeaseTiming
from capsulefs.fleet.authority import DirectoryAuthority
from capsulefs.fleet.etcd import EtcdClient
from capsulefs.fleet.keeper import HostLeaseKeeper, LeaseListener

__all__ = ["FleetMember", "REQUEST_TIMEOUT"]

REQUEST_TIMEOUT = 5.0  # seconds one request to etcd may take (the keeper cuts keepalives shorter)


class FleetMember:
    """This host in the fleet: its lease (kept by a service) and the directory's Txns."""

    def __init__(self, cfg: FleetConfig, *, host_id: str, address: str, cert_der: bytes, listener: LeaseListener,
                 timing: LeaseTiming = DEFAULT_TIMING) -> None:
        self.config = cfg
        self._http = httpx.AsyncClient(timeout=REQUEST_TIMEOUT, trust_env=False)
        self.client = EtcdClient(parse_endpoints(cfg.directory), self._http)
        host = fd.HostEntry(host_id=host_id, address=address, cert_sha256=hashlib.sha256(cert_der).hexdigest())
        self.keeper = HostLeaseKeeper(self.client, cfg.layout, host, listener, timing)
        self.authority = DirectoryAuthority(self.client, cfg.layout, host_id, self.keeper)

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            await self.keeper.serve(task_status=task_status)
        finally:
            with trio.CancelScope(shield=True):
                await self._http.aclose()
