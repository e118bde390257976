"""Leaving UNKNOWN: a host whose holder record of an agent was lost or is
corrupt learns from its peers who holds it (:func:`learn_from_peers`), or an
operator forces it (:func:`force_hold`). See :mod:`.holder` for the states.

Rules:
  * Only every pinned peer's answer is evidence; a peer that did not answer
    leaves the record UNKNOWN.
  * A peer that holds the agent, or activated a newer epoch, makes this host
    RETIRED; a peer itself unknown leaves it UNKNOWN; otherwise HELD.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ..capsule.format import check_host_id
from ..errors import CapsuleError, FormatError
from .holder import HOLDING, PENDING, HolderRecord, HolderState, need_epoch

__all__ = ["PeerView", "force_hold", "learn_from_peers"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerView:
    """One peer's answer to ``fence(agent_id)``: its record, after it has
    durably refused any pending (not yet activated) move of the agent."""

    host: str  # the peer's host id
    state: HolderState | None  # its record's state; None if it has none
    epoch: int  # the highest epoch it has seen (0 if none)
    held_epoch: int | None = None  # the epoch it holds at, if it holds the agent
    activated: tuple[int, ...] = ()  # epochs it activated

    def __post_init__(self) -> None:
        check_host_id(self.host)
        need_epoch(self.epoch, "peer epoch")
        if self.state is not None and not isinstance(self.state, HolderState):
            raise FormatError(f"peer state {self.state!r} is not a HolderState")
        if self.state in PENDING:
            raise FormatError(f"peer {self.host} reports a pending move; fence() must have refused it")


def learn_from_peers(
    record: HolderRecord, *, local_epoch: int, views: Mapping[str, PeerView], peers: Iterable[str]
) -> HolderRecord:
    """Try to leave UNKNOWN with what the peers said.

    ``local_epoch`` is the epoch the agent's files here say they were held
    at (their manifest's holder epoch). Returns HELD if every peer answered
    and none holds the agent or activated a newer epoch; RETIRED if one
    did; otherwise the UNKNOWN record unchanged (some peer has not answered,
    or an answer is itself unknown).
    """
    if record.state is not HolderState.UNKNOWN:
        raise CapsuleError(f"agent {record.agent_id} is {record.state.value}, not unknown: nothing to learn")
    peers = set(peers)
    if not peers <= set(views):
        return record
    highest = max([local_epoch, record.epoch] + [v.epoch for v in views.values()])

    def moving_to_us(v: PeerView) -> bool:
        # A source in doubt about the very move that installed our files
        # (their epoch is the one it commits to: files are installed only at
        # activate): we are its target, and may have run the agent since.
        # Holding here, we answer its status question "active" and it
        # retires; retiring here, it would hear "never" and resume from its
        # old snapshot, losing every event acknowledged here.
        return v.state is HolderState.COMMITTING and v.epoch == local_epoch and v.held_epoch != local_epoch

    newer = [v for v in views.values()
             if any(e > local_epoch for e in v.activated) or (v.state in HOLDING and not moving_to_us(v))]
    if newer:
        who = max(newer, key=lambda v: max(v.activated, default=0))
        return HolderRecord(
            agent_id=record.agent_id, state=HolderState.RETIRED, epoch=highest, peer=who.host,
            note=f"learned that {who.host} holds a newer epoch",
        )
    if any(v.state is HolderState.UNKNOWN for v in views.values()):
        return record
    return HolderRecord(
        agent_id=record.agent_id, state=HolderState.HELD, epoch=highest, held_epoch=local_epoch,
        activated=(local_epoch,) if local_epoch <= highest else (), note="every peer agreed this host holds it",
    )


def force_hold(record: HolderRecord, *, local_epoch: int, why: str) -> HolderRecord:
    """An operator's override: hold the agent at ``local_epoch`` now.

    Risks two hosts running the agent if a peer does hold a newer epoch.
    """
    return HolderRecord(
        agent_id=record.agent_id, state=HolderState.HELD, epoch=max(record.epoch, local_epoch),
        held_epoch=local_epoch, activated=tuple(sorted(set(record.activated) | {local_epoch})),
        note=f"forced by operator: {why}", forced=True,
    )


