"""The README tells a new user what setup installs and which commands steer a host."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def command_table() -> str:
    text = (REPO / "README.md").read_text()
    start = text.index("## Commands")
    return text[start:text.index("\n## ", start + 1)]


def test_readme_names_every_package_setup_installs() -> None:
    setup = (REPO / "scripts" / "setup.sh").read_text()
    debs = re.search(r"^debs=\((.*?)\)$", setup, re.M)
    assert debs is not None, "scripts/setup.sh has no debs=(...) line"
    readme = " ".join((REPO / "README.md").read_text().split())  # (the list wraps)
    listed = re.search(r"installs missing Debian packages \(`([^`]*)`", readme)
    assert listed is not None, "README does not list what setup installs"
    assert listed.group(1).split() == debs.group(1).split()


def test_the_command_table_shows_how_to_steer_a_host() -> None:
    rows = {cmd: " ".join(line for line in command_table().splitlines() if f"`capsulefs {cmd} " in line)
            for cmd in ("mount", "move")}
    for cmd, flag in (("mount", "--no-run"), ("mount", "--listen"), ("move", "--force-hold"), ("move", "--abandon"),
                      ("move", "--learn")):
        assert flag in rows[cmd], f"README's row for 'capsulefs {cmd}' does not name {flag}"
