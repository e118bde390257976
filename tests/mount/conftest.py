"""The mount tier: every test ends with a capsule check of the stores it left (tests/capsule_check.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from capsule_check import verify_after


@pytest.fixture(autouse=True)
def _capsules_verify(request: pytest.FixtureRequest) -> Iterator[None]:
    yield from verify_after(request)
