"""The move protocol, sans-IO: a source machine and a target machine.

Rules:
  * At most one host runs an agent, ever. A host runs an agent only while its
    holder record (:mod:`capsulefs.core.store.holder`) is HELD.
  * Fencing: the target accepts an offer only for an epoch greater than the
    highest it has seen for that agent_id, whether held, retired or refused.
    Epochs are compared, never waited on; no timer decides safety.
  * Every record change is returned as a :class:`Persist` command placed
    *before* any command that depends on it (a reply, a resume, a send).
    Drivers execute commands in order and stop at the first failure.
  * The point of no return is the source's COMMITTING record: activate is
    sent only after it is durable. Before it the source may roll back alone
    (no activate exists for its epoch); after it only the target's durable
    answer, or an operator's explicit abandon, ends the wait.
  * Every request is idempotent by (agent_id, epoch): a repeated activate
    returns the recorded outcome; "never activate" answers are recorded
    before they are sent, so a delayed or duplicated activate is refused.
  * A source never reuses an epoch it has offered: its record's ``epoch``
    keeps the highest epoch seen, and the next move offers one more.
  * An unknown (state, event) pair raises :class:`MoveProtocolError` naming
    both, and puts the source machine in ERROR. The durable record, not the
    machine, decides recovery: a new machine is built from it after a crash.

Theory of operation. The source machine lives for one move. It is built
from the host's record (HELD, or FROZEN/COMMITTING after a crash) and fed
the replies to the requests it asked the driver to send, one outstanding
phase at a time: the driver correlates replies with requests, so a late or
duplicated reply never reaches it (it reports Timeout or IoFailure instead).
The target machine is stateless between requests: the target's state *is*
its holder record, and the service builds a machine from the current record
for each request, so requests from any past attempt, duplicated, delayed or
reordered, are judged against what is durable now.

Both machines are tables: ``SOURCE_TABLE`` and ``TARGET_TABLE`` map
``(state, event type)`` to an ordered tuple of :class:`Edge`; the first edge
whose guard holds fires. :func:`describe` renders them for docs/move.md.
"""

from ._describe import describe, update_doc
from .cause import MEANING, Cause
from ._messages import *  # noqa: F403
from ._messages import __all__ as _message_names
from ._source import SOURCE_TABLE, TERMINAL_SOURCE_STATES, SourceMachine, SourceState
from ._target import TARGET_TABLE, TargetMachine

__all__ = [
    *_message_names,
    "MEANING",
    "Cause",
    "SOURCE_TABLE",
    "TARGET_TABLE",
    "TERMINAL_SOURCE_STATES",
    "SourceMachine",
    "SourceState",
    "TargetMachine",
    "describe",
    "update_doc",
]
