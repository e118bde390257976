"""CI's short pass of every fuzz target (tests/fuzz/targets_*.py): a few
seconds each, from a fixed seed (CAPSULEFS_FUZZ_SEED picks another). An
exception that is not a CapsuleError, a run's own failed check (a tampered
capsule accepted, a problem that is not one line) or anything left in a
staging directory fails it. scripts/fuzz.sh runs the long pass."""

from __future__ import annotations

import os

import pytest

from fuzz import Target, all_targets
from fuzz.harness import fuzz_target

TARGETS = all_targets()
#: Seconds per target: the whole file stays under a minute however many there are.
SECONDS = min(4.0, 48.0 / max(len(TARGETS), 1))


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.name)
def test_fuzz_target_short_pass(target: Target) -> None:
    report = fuzz_target(target, seconds=SECONDS, seed=int(os.environ.get("CAPSULEFS_FUZZ_SEED", "0")))
    assert report.inputs > len(target.seeds()), "not one mutated input ran"
    found = [f"{f.count} x {f.key}: {f.message} (input of {len(f.example)} bytes, first 200: {f.example[:200]!r})"
             for f in report.findings.values()]
    assert not found, "\n".join(found)
    assert report.leftovers == 0, f"{report.leftovers} inputs left something in staging/"
