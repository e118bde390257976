"""What a move's caller holds: its control while it runs, and its result.

:class:`MoveControl` lets another task (the daemon's ``.control/status``
and ``.control/abandon``, the CLI's progress line) watch a move and abandon
it while it is in doubt; :class:`MoveResult` is what
:func:`capsulefs.move.source.move_agent` and ``resume_moves`` return.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from capsulefs.core import move as mv


@dataclass
class MoveControl:
    """Lets another task watch a move and abandon it while it is in doubt."""

    on_progress: Callable[[str, int, int, int], None] | None = None  # (phase, blobs done, blobs total, bytes)
    abandon_reason: str | None = None
    _abandoned: trio.Event = field(default_factory=trio.Event)

    def abandon(self, why: str) -> None:
        self.abandon_reason = why
        self._abandoned.set()


@dataclass(frozen=True, slots=True, kw_only=True)
class MoveResult:
    agent_id: str
    target: str  # host id
    epoch: int  # the epoch moved to (or tried)
    state: mv.SourceState  # DONE, ROLLED_BACK, STALE or ABANDONED
    reason: str  # the record's note: why it ended so
    bytes_sent: int  # on the wire, framing and TLS payload included
    contents_sent: int  # blobs and capsule files the target lacked
    cause: mv.Cause = mv.Cause.REFUSED  # why it ended so: core/move/cause.py

    @property
    def moved(self) -> bool:
        return self.state is mv.SourceState.DONE
