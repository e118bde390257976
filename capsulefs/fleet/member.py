"""A daemon's membership in a fleet: its etcd client, host lease keeper and directory authority,
and its blob tier (``mount --blobs``): the uploader and the move target's fetch.

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
  * With a blob tier, :meth:`FleetMember.serve_tier` is another: the
    uploader (capsulefs/fleet/uploader.py), which the store tells of every
    blob it places (through the root's upcalls); ``tier_offers`` is the
    move service's fetch from the tier for the offers this host receives
    (capsulefs/fleet/tier_moves.py); ``tier_cache`` gets blobs evicted by
    ``gc --tier-cache`` back for their readers (capsulefs/fleet/cache.py);
    the live set's publisher (capsulefs/fleet/live.py) runs beside the
    uploader, nudged by the same notices, for the fleet's gc of the tier.
    The uploader, the moves and the readers each have
    their own bound on requests (a backlog of puts never holds up a move's
    fetch), over one connection pool, closed when the uploader ends.

Theory of operation: one object holding the components; the authority is
kept for the moves through the directory (the next slice).
"""

from __future__ import annotations

import hashlib

import httpx
import trio

from capsulefs.core.fleet import directory as fd
from capsulefs.core.fleet.config import FleetConfig
from capsulefs.core.fleet.etcd._ops import parse_endpoints
from capsulefs.core.fleet.lease import DEFAULT_TIMING, LeaseTiming
from capsulefs.core.store.host_store import HostStore
from capsulefs.fleet.authority import DirectoryAuthority
from capsulefs.fleet.cache import TierCache
from capsulefs.fleet.credentials import tier_credentials, tier_region
from capsulefs.fleet.etcd import EtcdClient
from capsulefs.fleet.keeper import HostLeaseKeeper, LeaseListener
from capsulefs.fleet.live import REFRESH, EvictionRecord, LivePublisher, Marks
from capsulefs.fleet.s3 import BlobTier, S3Client
from capsulefs.fleet.tier import TierBlobs
from capsulefs.fleet.tier_moves import TierOffers
from capsulefs.fleet.uploader import TierRecord, TierUploader

__all__ = ["FleetMember", "REQUEST_TIMEOUT"]

REQUEST_TIMEOUT = 5.0  # seconds one request to etcd may take (the keeper cuts keepalives shorter)
TIER_TIMEOUT = 60.0  # seconds the blob tier may be silent within one request
TIER_CONCURRENCY = 8  # requests at once to the tier: the uploader's, and again the moves'


class FleetMember:
    """This host in the fleet: its lease (kept by a service) and the directory's Txns."""

    def __init__(self, cfg: FleetConfig, *, host_id: str, address: str, cert_der: bytes, listener: LeaseListener,
                 store: HostStore, timing: LeaseTiming = DEFAULT_TIMING, live_refresh: float = REFRESH) -> None:
        self.config = cfg
        self._http = httpx.AsyncClient(timeout=REQUEST_TIMEOUT, trust_env=False)
        self.client = EtcdClient(parse_endpoints(cfg.directory), self._http)
        host = fd.HostEntry(host_id=host_id, address=address, cert_sha256=hashlib.sha256(cert_der).hexdigest())
        self.keeper = HostLeaseKeeper(self.client, cfg.layout, host, listener, timing)
        self.authority = DirectoryAuthority(self.client, cfg.layout, host_id, self.keeper)
        self.uploader: TierUploader | None = None
        self.tier_offers: TierOffers | None = None
        self.tier_cache: TierCache | None = None
        self.live: LivePublisher | None = None
        self._tier_http: httpx.AsyncClient | None = None
        if cfg.tier is not None:
            creds = tier_credentials(store.root)  # (TierCredentialsError: one line, before the mount)
            pool = 3 * TIER_CONCURRENCY  # (the uploader's, the moves', the readers')
            self._tier_http = httpx.AsyncClient(timeout=TIER_TIMEOUT, trust_env=False,
                                                limits=httpx.Limits(max_connections=pool,
                                                                    max_keepalive_connections=pool),
                                                headers={"accept-encoding": "identity"})
            tier = BlobTier(S3Client(cfg.tier, creds, self._tier_http, region=tier_region()))
            record = TierRecord(store.root, str(cfg.tier))
            marks = Marks(tier, self.client, cfg.layout)
            self.uploader = TierUploader(TierBlobs(tier, store, concurrency=TIER_CONCURRENCY), store, record,
                                         marks=marks)
            self.tier_offers = TierOffers(TierBlobs(tier, store, concurrency=TIER_CONCURRENCY), store, self.uploader)
            # The readers' (the mount, the sandbox build, a move's source) fetch of evicted blobs.
            evictable = EvictionRecord(store.root, str(cfg.tier))
            self.tier_cache = TierCache(TierBlobs(tier, store, concurrency=TIER_CONCURRENCY), store, record,
                                        evictable, known=self.uploader)
            self.live = LivePublisher(store, tier, self.client, cfg.layout, host_id, evictable, self.uploader, marks,
                                      refresh=live_refresh)

    def blob_stored(self, sha256: str) -> None:
        """The store placed a blob (any thread): the uploader puts it to the tier."""
        if self.uploader is not None:
            self.uploader.notice(sha256)
        if self.live is not None:
            self.live.nudge()

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            await self.keeper.serve(task_status=task_status)
        finally:
            with trio.CancelScope(shield=True):
                await self._http.aclose()

    async def serve_tier(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The uploader and the live set's publisher (a daemon service when the mount has a blob tier)."""
        assert self.uploader is not None and self.live is not None and self._tier_http is not None
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.uploader.serve)
                await nursery.start(self.live.serve)
                task_status.started()
        finally:
            with trio.CancelScope(shield=True):
                await self._tier_http.aclose()
