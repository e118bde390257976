"""An agent's lifecycle on one host (core/store/lifecycle.py): from its holder
record and the evidence about who else holds it, what the mount shows and
whether the agent runs; and the ``holds`` claims peers exchange."""

from __future__ import annotations

import pytest

from capsulefs.core.errors import FormatError
from capsulefs.core.store.holder import HolderRecord, HolderState, force_hold, new_held

AGENT = "a" * 32


def test_a_forced_hold_is_recorded_and_read_back() -> None:
    rec = force_hold(HolderRecord(agent_id=AGENT, state=HolderState.UNKNOWN, epoch=0), local_epoch=1, why="restored")
    assert rec.forced and rec.runnable
    assert HolderRecord.from_bytes(rec.to_bytes()) == rec
    plain = new_held(AGENT, 1)
    assert b"forced" not in plain.to_bytes()  # records from before the field read and write the same
    assert not HolderRecord.from_bytes(plain.to_bytes()).forced
    frozen = rec.with_(state=HolderState.FROZEN, epoch=2, peer="B" * 52)
    assert not frozen.forced  # the force ends with the hold
    with pytest.raises(FormatError):
        HolderRecord(agent_id=AGENT, state=HolderState.RETIRED, epoch=2, peer="B" * 52, forced=True)
