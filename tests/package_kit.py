"""The package's modules as the source tree holds them, for the tests that
check the tree itself (import graph, packaging)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: Each top-level package and its folder (pyproject's package-dir).
ROOTS = {"capsulefs": REPO / "capsulefs", "capsulefs.core": REPO / "core", "capsulefs.mount": REPO / "mount"}


def modules() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its
    ``__init__.py``)."""
    found: dict[str, Path] = {}
    for package, folder in ROOTS.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found
