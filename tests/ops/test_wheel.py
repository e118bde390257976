"""A wheel built from the tree holds every module of the package and its
py.typed marker (tests/unit/test_packaging.py checks pyproject's list; this
checks what setuptools makes of it)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from helpers import HANG
from package_kit import REPO, modules


def test_a_wheel_holds_every_module_and_py_typed(tmp_path: Path) -> None:
    # Built from a copy: setuptools reuses what a build/ folder holds, so a
    # build in the tree could find a module an earlier build put there.
    source = tmp_path / "src"
    source.mkdir()
    for part in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / part, source / part)
    for folder in ("capsulefs", "core", "mount"):
        shutil.copytree(REPO / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "-q", "-w", str(tmp_path / "out")],
        check=True, capture_output=True, timeout=HANG,
    )
    [wheel] = (tmp_path / "out").glob("capsulefs-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = {n for n in z.namelist() if ".dist-info/" not in n}
    want = {
        name.replace(".", "/") + ("/__init__.py" if path.name == "__init__.py" else ".py")
        for name, path in modules().items()
    }
    assert want - names == set(), "modules missing from the wheel"
    assert names - want == {"capsulefs/py.typed"}
