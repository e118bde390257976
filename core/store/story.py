"""The one story of an agent on this host: what its holder record means for a
person, in the words ``import``, ``.control/status``, ``capsulefs ls``,
``capsulefs status`` and the daemon's log all use.

Rules:
  * One word for the state (held, moving, incoming, in-doubt, retired,
    refused, removed), one line for why, and the command to run next ("" if
    none is needed).
  * Every place a user looks calls :func:`story`; none words a record itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from .holder import HolderRecord, HolderState

__all__ = ["Story", "story"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Story:
    """What this host's record of an agent means for a person, in the words
    ``import``, ``.control/status``, ``capsulefs ls`` and the daemon's log
    all use (:func:`story`)."""

    state: str  # one word: held, moving, incoming, in-doubt, retired, refused, removed
    reason: str  # one line: why
    next: str  # the command to run next, "" if none is needed

    def line(self) -> str:
        return f"{self.state}: {self.reason}" + (f"; next: {self.next}" if self.next else "")

    def as_json(self) -> dict[str, str]:
        return {"state": self.state, "reason": self.reason, "next": self.next}


def story(record: HolderRecord | None, name: str) -> Story:
    """The one story of an agent named ``name`` whose record here is ``record``."""
    learn = f"capsulefs move {name} --learn"
    if record is None:
        return Story(state="in-doubt", reason="this host has no holder record for it: another host may hold it; "
                     "read-only here", next=learn)
    kept = f"; what this host had is kept in {record.kept}" if record.kept else ""
    merge = (f"on the holder: capsulefs merge {name} COPY --into, COPY being this host's STATE/{record.kept} "
             f"copied there (docs/move.md)" if record.kept else "")
    match record.state:
        case HolderState.HELD:
            return Story(state="held", reason=f"this host holds it at epoch {record.held_epoch}", next="")
        case HolderState.FROZEN:
            return Story(state="moving", reason=record.describe_move(), next="")
        case HolderState.COMMITTING:
            return Story(state="moving", reason=record.describe_move(),
                         next=f"capsulefs move {name} --abandon --why REASON (only if the target never activated it)")
        case HolderState.OFFERED | HolderState.VERIFIED | HolderState.PREPARED:
            return Story(state="incoming", reason=record.describe_move(), next="")
        case HolderState.RETIRED:
            who = f"host {record.peer}" if record.peer else "another host"
            return Story(state="retired", reason=f"{who} holds it (epoch {record.epoch} seen){kept}", next=merge)
        case HolderState.REFUSED:
            return Story(state="refused", reason=f"epoch {record.epoch} never activates here"
                         + (f" ({record.note})" if record.note else ""), next="")
        case HolderState.REMOVED:
            return Story(state="removed", reason=f"removed from this host by an operator{kept}", next=merge)
    why = record.note or "holder record in doubt"
    return Story(state="in-doubt", reason=f"this host may not hold it ({why}): read-only here", next=learn)


