"""What a move needs of the fleet's directory (``mount --directory``): the
holder authority that answers the source's point of no return instead of
the target. docs/fleet.md, "A move through the directory".

Rules:
  * The moves take a :class:`Fleet` in their constructor, None in
    peer-to-peer mode (the moves then run exactly as without a fleet).
  * The source reads the agent's key after the freeze (``begin``); its
    ``activate`` is the directory's commit Txn and its ``status`` the
    settle (a read, then the fence); after a verdict "active" it nudges the
    target (the target's ``activate`` call), which activates only once it
    reads that the directory names it at the new epoch (``confirm``).
  * A prepared target asks ``gate`` before it ever refuses (idle, restarted,
    asked for status): named -> activate; else refuse only once no commit
    of the move can apply.
  * After its commit was sent, a source whose move rolled back runs the
    agent again only once the directory names it (``confirm``, under a
    live lease): the entry may have moved on meanwhile.

Theory of operation: the real objects are capsulefs/fleet/authority.py's
``DirectoryAuthority`` and capsulefs/fleet/keeper.py's ``HostLeaseKeeper``,
built by the composition root; the simulation (capsulefs/testing/fleet_sim.py)
drives the same machines through the same calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from capsulefs.core.move import Outcome

if TYPE_CHECKING:  # (the fleet's modules load only in the fleet mode)
    from capsulefs.fleet.authority import Ticket, Verdict

__all__ = ["Fleet", "LeaseWait", "MoveDirectory"]


class MoveDirectory(Protocol):
    """The directory's calls a move makes (``DirectoryAuthority``)."""

    async def begin(self, agent_id: str, held_epoch: int, target: str, epoch: int) -> Ticket: ...

    async def commit(self, ticket: Ticket) -> Verdict: ...

    async def settle(self, ticket: Ticket) -> Verdict: ...

    def ticket(self, agent_id: str, held_epoch: int, target: str, epoch: int) -> Ticket: ...

    async def confirm(self, agent_id: str, epoch: int) -> bool: ...

    async def gate(self, agent_id: str, epoch: int, source: str) -> Outcome: ...

    async def claim(self, agent_id: str, epoch: int) -> bool: ...


class LeaseWait(Protocol):
    """The host's lease, as a move waits for it (``HostLeaseKeeper``)."""

    def may_run(self) -> bool: ...

    async def wait_alive(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Fleet:
    """The moves' view of the fleet: its directory and this host's lease."""

    directory: MoveDirectory
    lease: LeaseWait
