"""core/ is pure domain code: no trio, pyfuse3, socket, ssl or subprocess."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "core"
FORBIDDEN = {"trio", "pyfuse3", "socket", "ssl", "subprocess"}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_core_sources_import_nothing_forbidden() -> None:
    files = sorted(CORE.rglob("*.py"))
    assert files, "core/ has no modules?"
    bad = {str(p.relative_to(CORE)): sorted(_imports(p) & FORBIDDEN) for p in files}
    assert {k: v for k, v in bad.items() if v} == {}


def test_importing_all_of_core_loads_nothing_forbidden() -> None:
    code = (
        "import importlib, pkgutil, sys, capsulefs.core as c\n"
        "for m in pkgutil.walk_packages(c.__path__, 'capsulefs.core.'):\n"
        "    importlib.import_module(m.name)\n"
        f"print(sorted(m for m in {sorted(FORBIDDEN)!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
