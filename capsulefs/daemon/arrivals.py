"""Fleet mode: where each agent that arrived while the daemon served stands
with the directory (capsulefs/daemon/agents.py's ``confirm_arrivals`` asks;
``.control/status`` shows it as ``record.directory``; docs/fleet.md)."""

from __future__ import annotations

import time
from dataclasses import dataclass

__all__ = ["ARRIVAL_QUESTIONS", "ARRIVAL_RETRY_FIRST", "ARRIVAL_RETRY_MAX", "Arrival", "one_line"]

#: Fleet mode: seconds before an arrival is asked about again after the
#: directory did not answer; doubled after each unanswered question, up to
#: ARRIVAL_RETRY_MAX.
ARRIVAL_RETRY_FIRST = 1.0
ARRIVAL_RETRY_MAX = 30.0
ARRIVAL_QUESTIONS = 8  # arrivals asked about at once (each in a task of its own)
_ERROR_CHARS = 300  # of a directory error kept for the status


@dataclass(eq=False)
class Arrival:
    """A held agent that arrived while the host had a lease, until
    the directory answered about it (:meth:`Agents.confirm_arrivals`)."""

    epoch: int  # the epoch this host's record holds it at
    state: str = "asking"  # asking; retrying (no answer: asked again after ``pause``); refused (final)
    tries: int = 0  # questions asked
    last_error: str | None = None  # the last question's failure, one line
    pause: float | None = None  # retrying: seconds between the last failure and the next question
    retry_at: float | None = None  # retrying: time.monotonic() of the next question

    def status(self, detail: str) -> dict[str, object]:
        """The ``directory`` part of the agent's ``.control/status`` record section."""
        retry_in = None if self.retry_at is None else round(max(0.0, self.retry_at - time.monotonic()), 1)
        return {"state": self.state, "epoch": self.epoch, "tries": self.tries, "last_error": self.last_error,
                "pause": self.pause, "retry_in": retry_in, "detail": detail}


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= _ERROR_CHARS else text[:_ERROR_CHARS - 3] + "..."
