"""The move protocol's wire vocabulary, beside the machines it carries (h11's
rule: everything that affects the state machine lives with its tables):
the names of the calls, and the JSON form of every answer, both ways.

Rules:
  * A call is named by :class:`Call`'s value, except two: the target takes
    many pieces in one ``blobs`` call (:data:`BLOBS_CALL`, answered with one
    result per piece) and answers a peer's batched ``holds`` question
    (:data:`HOLDS_CALL`, core/store/lifecycle.py's claims).
  * :func:`answer_to_result` writes an answer; :func:`result_to_answer` reads
    one as hostile: a malformed result is a FormatError naming the call,
    never an answer. docs/wire.md lists every form.
"""

from __future__ import annotations

from typing import Any

from ..errors import FormatError
from ..store.holder import HolderState
from ..store.learning import PeerView
from ._messages import (
    AbortReply,
    ActivateReply,
    BlobReply,
    Call,
    FenceReply,
    OfferReply,
    Outcome,
    PrepareReply,
    StatusReply,
    VerifyReply,
)

__all__ = ["BLOBS_CALL", "HOLDS_CALL", "answer_to_result", "result_to_answer"]

BLOBS_CALL = "blobs"  # the wire name of Call.BLOB: many pieces per call
HOLDS_CALL = "holds"  # a peer's batched question: which of these agents do you hold, at what epoch


def answer_to_result(answer: object) -> dict[str, Any]:
    match answer:
        case OfferReply():
            return {"accepted": answer.accepted, "missing": list(answer.missing), "highest": answer.highest,
                    "held_there": answer.held_there, "reason": answer.reason}
        case BlobReply():
            return {"sha": answer.sha, "ok": answer.ok, "reason": answer.reason}
        case VerifyReply():
            return {"ok": answer.ok, "bad": list(answer.bad), "reason": answer.reason}
        case PrepareReply():
            return {"ok": answer.ok, "reason": answer.reason}
        case ActivateReply() | StatusReply():
            return {"outcome": answer.outcome.value}
        case AbortReply():
            return {}
        case FenceReply():
            v = answer.view
            return {"host": v.host, "state": None if v.state is None else v.state.value, "epoch": v.epoch,
                    "held_epoch": v.held_epoch, "activated": list(v.activated)}
    raise TypeError(f"not an answer: {answer!r}")


def result_to_answer(call: Call, agent_id: str, epoch: int, r: dict[str, Any]) -> object:
    """Parse a reply's result; raise FormatError if it is malformed."""
    try:
        match call:
            case Call.OFFER:
                return OfferReply(agent_id=agent_id, epoch=epoch, accepted=r["accepted"], missing=tuple(r["missing"]),
                                     highest=r["highest"], held_there=r["held_there"], reason=r["reason"])
            case Call.BLOB:
                return BlobReply(agent_id=agent_id, epoch=epoch, sha=r["sha"], ok=r["ok"], reason=r["reason"])
            case Call.VERIFY:
                return VerifyReply(agent_id=agent_id, epoch=epoch, ok=r["ok"], bad=tuple(r["bad"]), reason=r["reason"])
            case Call.PREPARE:
                return PrepareReply(agent_id=agent_id, epoch=epoch, ok=r["ok"], reason=r["reason"])
            case Call.ACTIVATE:
                return ActivateReply(agent_id=agent_id, epoch=epoch, outcome=Outcome(r["outcome"]))
            case Call.STATUS:
                return StatusReply(agent_id=agent_id, epoch=epoch, outcome=Outcome(r["outcome"]))
            case Call.ABORT:
                return AbortReply(agent_id=agent_id, epoch=epoch)
            case Call.FENCE:
                view = PeerView(host=r["host"], state=None if r["state"] is None else HolderState(r["state"]),
                                epoch=r["epoch"], held_epoch=r["held_epoch"], activated=tuple(r["activated"]))
                return FenceReply(agent_id=agent_id, view=view)
    except (KeyError, TypeError, ValueError) as exc:
        raise FormatError(f"malformed {call.value} reply: {exc!r}") from None
    raise AssertionError(call)
