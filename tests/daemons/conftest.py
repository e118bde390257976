"""The daemons tier: every test ends with a capsule check of the stores it left (tests/capsule_check.py);
the blob tier's engine for the fleet tests that ask for it (``weed_server``, ``s3``)."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING

import pytest

from capsule_check import verify_after
from fleet_kit import EtcdServer, WeedServer, etcd_or_skip, weed_or_skip

if TYPE_CHECKING:
    from capsulefs.fleet.s3 import S3Client


@pytest.fixture(autouse=True)
def _capsules_verify(request: pytest.FixtureRequest) -> Iterator[None]:
    yield from verify_after(request)


@pytest.fixture(scope="module")
def etcd_server() -> Iterator[EtcdServer]:
    """One real etcd per test module (skipped, saying why, where the binary is missing); a module that kills
    etcd overrides it with a killable one (fleet_kit.killable_etcd)."""
    with etcd_or_skip() as server:
        yield server


@pytest.fixture(scope="module")
def weed_server() -> Iterator[WeedServer]:
    """One real `weed mini` per test module (skipped, saying why, where the binary is missing)."""
    with weed_or_skip() as server:
        yield server


@pytest.fixture
async def s3(weed_server: WeedServer) -> AsyncIterator[S3Client]:
    """A client of a new bucket on the module's `weed mini`, its tier prefix ``eu``."""
    from capsulefs.core.fleet.s3_wire import parse_tier_url  # (httpx only where a test asks for the tier)
    from capsulefs.core.fleet.sigv4 import Credentials
    from capsulefs.fleet.s3 import open_s3

    bucket = "tier-" + secrets.token_hex(4)
    creds = Credentials(weed_server.access_key, weed_server.secret_key)
    async with open_s3(parse_tier_url(weed_server.tier_url(bucket, "eu")), creds) as client:
        assert await client.create_bucket() is True
        yield client
