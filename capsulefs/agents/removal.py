"""Removing an agent from this host: ``capsulefs rm`` and ``.control/remove``.

Rules:
  * An agent in a move here (its holder record FROZEN, COMMITTING, OFFERED,
    VERIFIED or PREPARED) is never removed: removing it mid-move could lose
    it on both hosts. The refusal (MoveBusy) names the move; the same words
    come from the CLI without a daemon and from the daemon.
  * What the host keeps beside the capsule is removed by the class that owns
    each area, never by a path spelled here: the mount's snapshots
    (``core.view.snapshots``), editors' scratch files (``core.view.scratch``) and the
    sandbox (``capsulefs.agents.sandbox_dir``).
  * Without a daemon the CLI removes the agent itself
    (:func:`remove_offline`). While a daemon serves the state directory, the
    CLI asks it through the agent's ``.control/remove`` and the daemon
    removes it (``capsulefs.daemon.agents.Agents.remove``): it stops the agent's process first and
    drops it from the live mount, under the agent's move lock.
  * Nothing acknowledged is deleted: an agent in doubt here (UNKNOWN, or
    files without a record) is kept as a whole copy under recovery/ first
    (:func:`giving_up`, ``core.store.kept``), since another host may hold it
    and lack what this one has (docs/move.md).
  * The holder record stays, no longer HELD (:func:`capsulefs.core.store.holder.removed`):
    peers asking who holds the agent learn that this host does not, the
    epoch fence for the agent's id is kept, and a restarted daemon has no
    held agent without files to start. Importing the agent again here leaves
    it in doubt until ``capsulefs move AGENT --learn`` has asked the peers
    (``move.host.record_new_agent``): another host may have taken it meanwhile.

Theory of operation: both paths end in :func:`discard_leftovers` after the
store forgot the agent; blobs are left to the store's ``gc`` (the CLI runs
it unless ``--keep-blobs``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

from capsulefs.agents import grants
from capsulefs.core.fsutil import remove_tree
from capsulefs.core.store.holder import HolderBook, HolderState, removed, unknown
from capsulefs.core.store.kept import keep_copy
from capsulefs.core.view.errors import MoveBusy
from capsulefs.core.view.scratch import ScratchArea
from capsulefs.core.view.snapshots import Snapshots
from capsulefs.core.store.host_store import HostStore
from capsulefs.move.host import holders_dir
from capsulefs.agents.agent_log import log_dir
from capsulefs.agents.sandbox_dir import discard_sandbox

log = logging.getLogger(__name__)

__all__ = ["discard_leftovers", "giving_up", "refuse_if_moving", "remove_offline"]


def refuse_if_moving(holders: HolderBook, agent_id: str, name: str) -> None:
    """MoveBusy if the agent's holder record says a move of it is under way here."""
    rec = holders.get(agent_id)
    if rec is not None and rec.moving:
        raise MoveBusy(f"agent {name} ({agent_id}) is in a move ({rec.describe_move()}): removing it now could "
                       f"lose it on both hosts; let the move end, or end it with "
                       f"'capsulefs move {name} --abandon --why ...', then remove it")


@contextmanager
def giving_up(state_dir: str, store: HostStore, agent_id: str) -> Iterator[None]:
    """Around removing the agent's files: its holder record says "removed"
    (durably) before a file goes, so a crash in between never leaves a record
    that says held without files (peers would hear that this host holds an
    agent it no longer has). If the removal fails, the record is put back.

    An agent in doubt here (UNKNOWN, or files without a record) may be held
    elsewhere, by a host that lacks what this one has: a whole copy is kept
    first (core.store.kept), named in its REMOVED record; if it cannot be
    kept, nothing is removed."""
    holders = HolderBook(holders_dir(state_dir))
    before = holders.get(agent_id)
    restore = before
    if before is None or before.state is HolderState.UNKNOWN:
        restore = before or unknown(agent_id, "holder record lost")
        kept = keep_copy(store.agent(agent_id))
        holders.put(removed(restore, kept=os.path.relpath(kept, store.root)))
        log.warning("agent %s was in doubt here: before removing it, what this host had is kept in %s",
                    agent_id, kept)
    elif before.holding:
        holders.put(removed(before))
    else:
        restore = None
    try:
        yield
    except BaseException:
        if restore is not None:
            holders.put(restore)
        raise


def discard_leftovers(state_dir: str, work_dir: str, agent_id: str) -> None:
    """After the store forgot the agent: remove what the host kept beside its
    capsule: its snapshots and scratch files (under the mount's ``work_dir``),
    its sandbox, its secret grants and its process's log."""
    Snapshots.under(work_dir).remove_agent(agent_id)
    ScratchArea.under(work_dir).remove_agent(agent_id)
    discard_sandbox(state_dir, agent_id)
    grants.revoke(state_dir, agent_id)
    remove_tree(log_dir(state_dir, agent_id), ignore_errors=True)


def remove_offline(state_dir: str, work_dir: str, store: HostStore, holders: HolderBook, agent_id: str) -> None:
    """Remove an agent while no daemon serves the state directory."""
    refuse_if_moving(holders, agent_id, store.agent(agent_id).name)
    with giving_up(state_dir, store, agent_id):
        store.remove_agent(agent_id)
    discard_leftovers(state_dir, work_dir, agent_id)
