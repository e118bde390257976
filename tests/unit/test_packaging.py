"""pyproject.toml lists every package of the tree (setuptools installs only
those listed: a package left out is missing from a wheel though an editable
install still finds it). tests/ops/test_packaging.py builds a wheel and looks."""

from __future__ import annotations

import tomllib

from package_kit import REPO, modules


def test_pyproject_lists_every_package() -> None:
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = sorted(name for name, path in modules().items() if path.name == "__init__.py")
    assert sorted(setuptools["packages"]) == packages
    assert setuptools["package-data"]["capsulefs"] == ["py.typed"]
