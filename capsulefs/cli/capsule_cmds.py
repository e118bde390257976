"""Commands on capsules and the host store: new, verify, export, import, keygen, rm, ls."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:  # filled in below
    pass
