"""The directory's records over etcd: register a host, claim an agent, read the fleet.

Rules:
  * The records and Txns are :mod:`capsulefs.core.fleet.directory`'s; this
    module only sends them with an :class:`~capsulefs.fleet.etcd.EtcdClient`.
  * Every record read back is parsed there; one that does not parse is
    reported in its row (``problem``), never skipped and never trusted.
  * Reads of a prefix go a page at a time (``PAGE`` keys), so a fleet of any
    size is read with replies of bounded size.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from capsulefs.core.fleet import directory as fd
from capsulefs.core.fleet.errors import DirectoryError
from capsulefs.core.fleet.etcd import KeyValue, Lease, prefix_end
from capsulefs.fleet.etcd import EtcdClient

log = logging.getLogger(__name__)

__all__ = ["AgentRow", "HostRow", "claim_agent", "read_agents", "read_hosts", "register_host", "scan"]

PAGE = 1000  # keys per range request


@dataclass(frozen=True, slots=True)
class AgentRow:
    agent_id: str
    entry: fd.AgentEntry | None  # None: the record does not parse (``problem`` says why)
    problem: str
    holder_alive: bool  # the holder's host key exists: its lease lives


@dataclass(frozen=True, slots=True)
class HostRow:
    host_id: str
    entry: fd.HostEntry | None
    problem: str
    lease_ttl: int | None  # seconds left on its lease (None: gone since the read)
    agents: int  # agents the directory names it the holder of


async def register_host(etcd: EtcdClient, layout: fd.Layout, host: fd.HostEntry, ttl: int) -> Lease:
    """A new lease of ``ttl`` seconds and the host's key under it."""
    lease = await etcd.grant(ttl)
    put = fd.register_ops(layout, host, lease.id)
    await etcd.put(put.key, put.value, lease=put.lease)
    return lease


async def claim_agent(etcd: EtcdClient, layout: fd.Layout, agent_id: str, entry: fd.AgentEntry) -> bool:
    """Write a new agent's entry if it has none; False if it had one."""
    t = fd.claim_txn(layout, agent_id, entry)
    return (await etcd.txn(t.compare, t.success, t.failure)).succeeded


async def scan(etcd: EtcdClient, prefix: bytes) -> list[KeyValue]:
    out: list[KeyValue] = []
    start, end = prefix, prefix_end(prefix)
    while True:
        page = await etcd.range(start, range_end=end, limit=PAGE)
        out.extend(page.kvs)
        if not page.more or not page.kvs:
            return out
        start = page.kvs[-1].key + b"\x00"


def _suffix(kv: KeyValue, prefix: bytes) -> str:
    return kv.key[len(prefix):].decode("utf-8", "replace")[:128]


async def read_hosts(etcd: EtcdClient, layout: fd.Layout, *, agents: list[AgentRow] | None = None) -> list[HostRow]:
    """Every host with a live lease, with its lease's TTL left and how many agents it holds."""
    if agents is None:
        agents = await read_agents(etcd, layout)
    held: dict[str, int] = {}
    for a in agents:
        if a.entry is not None and a.entry.state is fd.EntryState.HELD:
            held[a.entry.host_id] = held.get(a.entry.host_id, 0) + 1
    rows = []
    for kv in await scan(etcd, layout.hosts):
        name = _suffix(kv, layout.hosts)
        try:
            entry = fd.decode_host(kv.value)
            if layout.host(entry.host_id) != kv.key:
                raise fd.DirectoryRecordError(f"the record names host {entry.host_id!r}, its key {name!r}")
        except DirectoryError as exc:
            rows.append(HostRow(name, None, str(exc), None, 0))
            continue
        ttl = None
        if kv.lease:
            left = await etcd.time_to_live(kv.lease)
            ttl = None if left is None else left.ttl
        rows.append(HostRow(entry.host_id, entry, "", ttl, held.get(entry.host_id, 0)))
    return rows


async def read_agents(etcd: EtcdClient, layout: fd.Layout) -> list[AgentRow]:
    """Every agent in the directory: its holder, epoch and state, and whether the holder's lease lives."""
    alive = set()
    for kv in await scan(etcd, layout.hosts):
        alive.add(kv.key)
    rows = []
    for kv in await scan(etcd, layout.agents):
        try:
            agent_id = layout.agent_id_of(kv.key)
        except fd.DirectoryRecordError as exc:
            rows.append(AgentRow(_suffix(kv, layout.agents), None, str(exc), False))
            continue
        try:
            entry = fd.decode_agent(kv.value)
        except fd.DirectoryRecordError as exc:
            rows.append(AgentRow(agent_id, None, str(exc), False))
            continue
        rows.append(AgentRow(agent_id, entry, "", layout.host(entry.host_id) in alive))
    return rows
