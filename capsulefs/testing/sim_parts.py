"""The parts of the fleet simulation (:mod:`.fleet_sim`): a host and what it
keeps (durable or not, as the model's rules say), a message between hosts,
a request to the directory, the faults a request can meet, and the figures a
run counts.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field

from capsulefs.core import move as mv
from capsulefs.core.fleet import directory as fd
from capsulefs.core.fleet.etcd import KeyValue
from capsulefs.core.fleet.lease import LeaseKeeper
from capsulefs.core.store.holder import HolderRecord

__all__ = ["DirRequest", "Fault", "Figures", "Host", "Message"]


class Fault(enum.Enum):
    OK = "ok"
    LOST = "lost"  # applied; the reply never arrives
    UNSENT = "unsent"  # never reached etcd
    DELAYED = "delayed"  # the reply is lost now; etcd applies it later


@dataclass
class Host:
    name: str
    rate: float  # its clock's rate against true time
    keeper: LeaseKeeper
    records: dict[str, HolderRecord] = field(default_factory=dict)  # durable
    files: dict[str, int] = field(default_factory=dict)  # durable: agent -> version of its installed copy
    up: bool = True
    cut_from_etcd: bool = False
    staging: dict[tuple[str, int], int] = field(default_factory=dict)  # (agent, epoch) -> version staged
    frozen: set[str] = field(default_factory=set)
    sources: dict[str, mv.SourceMachine] = field(default_factory=dict)
    awaiting: dict[str, set[int]] = field(default_factory=dict)  # agent -> ids of requests it waits for
    seen: dict[str, KeyValue] = field(default_factory=dict)  # agent -> its key as read at the move's start
    permits: dict[str, int] = field(default_factory=dict)  # agent -> epoch the directory named us at
    boot: int = 0  # incremented at each restart: replies to an earlier life are dropped
    renewing: bool = False

    def local(self, now: float) -> float:
        return now * self.rate


@dataclass
class Message:
    id: int
    to: str
    frm: str
    send: mv.Send
    version: int = 0  # the offer carries the frozen copy's version
    answer: object | None = None


@dataclass
class DirRequest:
    id: int
    host: str
    boot: int
    agent: str
    kind: str  # start_read, commit, status_read, fence, nudge_read, gate_read, gate_fence
    txn: fd.DirTxn | None = None
    epoch: int = 0
    target: str = ""


@dataclass
class Figures:
    moves_started: int = 0
    moves_done: int = 0
    moves_rolled_back: int = 0
    moves_in_doubt: int = 0  # moves that went through the in-doubt path (a lost commit reply)
    takeovers: int = 0
    crashes: int = 0
    lease_losses: int = 0
    acks: int = 0
    checks: int = 0
    seconds: float = 0.0  # simulated time, the drain at the end included
    dir_ops: Counter[str] = field(default_factory=Counter)

    def per_move(self) -> float:
        moves = self.moves_done + self.moves_rolled_back
        kinds = ("start_read", "commit", "status_read", "fence", "resume_read", "nudge_read", "gate_read", "gate_fence")
        move_ops = sum(self.dir_ops[k] for k in kinds)
        return move_ops / moves if moves else 0.0
