"""The fuzz harness's shared vocabulary: a target is a parser of hostile bytes.

Rules:
  * ``run(data, scratch)`` feeds ``data`` to one parser the way outside input
    reaches it (a tar to verify or import, a manifest, a journal line, a
    control-file write...). Bad input raises a ``CapsuleError``; anything else
    that escapes is a finding. ``scratch`` is a fresh empty directory the
    target may use (a state directory, a file to parse); the harness checks it
    holds nothing the target left behind that it should not (e.g. staging).
  * ``seeds()`` returns valid inputs the mutators start from.
  * A target's module is ``tests/fuzz/targets_<area>.py`` and defines
    ``TARGETS: list[Target]``; :func:`all_targets` finds every one.

The CI pass (tests/fuzz/test_fuzz.py) runs each target briefly; scripts/fuzz.sh
runs a long pass and reports inputs/s, distinct foreign exceptions and peak
memory.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Target:
    name: str
    seeds: Callable[[], list[bytes]]
    run: Callable[[bytes, Path], None]


def all_targets() -> list[Target]:
    found: list[Target] = []
    for mod in pkgutil.iter_modules(__path__):
        if mod.name.startswith("targets_"):
            found += importlib.import_module(f"{__name__}.{mod.name}").TARGETS
    return found
