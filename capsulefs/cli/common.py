"""Helpers shared by the CLI command modules."""

from __future__ import annotations

import argparse
import os
import secrets
import time

from capsulefs.core.store import AgentHandle, HostStore, default_state_dir


def state_dir(args: argparse.Namespace) -> str:
    return getattr(args, "state", None) or os.environ.get("CAPSULEFS_STATE") or default_state_dir()


def open_store(args: argparse.Namespace) -> HostStore:
    return HostStore.open(state_dir(args))


def host_id(args: argparse.Namespace) -> str:
    from capsulefs.identity import load_or_create_identity

    return load_or_create_identity(state_dir(args)).host_id


def find_agent(args: argparse.Namespace, name_or_id: str) -> AgentHandle:
    return open_store(args).find(name_or_id)


def new_agent_id() -> str:
    return secrets.token_hex(16)


def now_seconds() -> int:
    return int(time.time())
