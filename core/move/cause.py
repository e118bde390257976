"""Why a move ended: the one vocabulary every layer tells outcomes by.

The source's driver gives each finished move a :class:`Cause`. Each
outward face maps it in one table of its own: ``mount/errors.py`` to an
errno (``MOVE_ERRNO``), ``.control/status`` to its value (the word),
and the CLI and logs to :data:`MEANING` (the sentence). A new cause is added
here and in those tables; a test checks each table names every cause.
"""

from __future__ import annotations

import enum

__all__ = ["MEANING", "Cause"]


class Cause(enum.Enum):
    """What ended a move (its value is the word status and tests show)."""

    MOVED = "moved"
    REFUSED = "refused"
    STALE = "stale"
    CORRUPT = "corrupt"
    UNREACHABLE = "unreachable"
    CONNECTION_REFUSED = "connection-refused"
    TIMEOUT = "timeout"
    ABANDONED = "abandoned"
    NOT_HOLDER = "not-holder"

    @property
    def meaning(self) -> str:
        return MEANING[self]


#: Cause -> what it means for the user, in one sentence (CLI, logs, docs).
MEANING: dict[Cause, str] = {
    Cause.MOVED: "the agent is active on the target",
    Cause.REFUSED: "the target refused (the offer, the prepare, or decided never; or it refused our identity), "
                   "or could not do a call; or the agent is not held here",
    Cause.STALE: "the target has seen a newer epoch: another host may hold the agent",
    Cause.CORRUPT: "content arrived corrupt at the target, or could not be read here",
    Cause.UNREACHABLE: "the target (or the fleet's directory) could not be reached, or the link broke",
    Cause.CONNECTION_REFUSED: "nothing listens at the target's address",
    Cause.TIMEOUT: "the target did not answer in time",
    Cause.ABANDONED: "an operator abandoned the move",
    Cause.NOT_HOLDER: "the fleet's directory does not name this host as the agent's holder (or this host has no "
                      "live lease)",
}
