"""Commands that say how this host's agents run: status, logs.

``capsulefs status`` lists every agent with its state, its holder story
(``story.story``: the one word, reason and next command that ``import``,
``ls``, ``.control/status`` and the daemon's log use too), epoch, model, run
state, last error and last event time: from the running daemon (each
agent's ``.control/status`` through its mount) if one serves the state
directory, else from the store (no agent runs then). Under the table, each
agent whose story has a next step gets one line saying it. ``capsulefs logs
AGENT`` prints the agent's log (``STATE/logs/<agent_id>/``, written by the
daemon; capsulefs/agents/agent_log.py), ``-f`` follows it; it needs no daemon.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from capsulefs.cli.common import find_agent, open_store, shown, state_dir

TAIL_BYTES = 64 * 1024  # how much of a journal's end is read for its last event


def _last_event_time(journal: str) -> str | None:
    """The ``time`` of the journal's last whole line (read from its end only)."""
    from capsulefs.core.errors import CapsuleError
    from capsulefs.core.journal.record import Record

    try:
        with open(journal, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(max(0, size - TAIL_BYTES))
            data = f.read(TAIL_BYTES)
    except OSError:
        return None
    lines = data.split(b"\n")[:-1]  # (only whole lines; the last may be one being written)
    for line in reversed(lines[1:] if size > TAIL_BYTES else lines):  # (the first may be cut)
        if line.strip():
            try:
                return Record.from_line(line).time
            except (CapsuleError, ValueError):
                return None
    return None


def _row_from_daemon(mnt: str, name: str, agent_id: str) -> dict[str, Any] | None:
    from capsulefs.core.capsule import format as fmt

    path = os.path.join(mnt, name)
    try:
        with open(os.path.join(path, ".control", "status"), "rb") as f:
            st = json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return None  # (removed or moved meanwhile)
    run = st.get("run") if isinstance(st.get("run"), dict) else None
    err = run.get("last_error") if run else None
    record = st.get("record") if isinstance(st.get("record"), dict) else {}
    told = record.get("story") if isinstance(record.get("story"), dict) else None
    return {
        "name": name, "agent_id": agent_id, "state": st.get("state"), "holder": told, "epoch": st.get("epoch"),
        "model": f"{st['provider']}:{st['model']}" if st.get("provider") else None,
        "run": run.get("state") if run else "not run (mount --no-run)",
        "spec_digest": (run.get("spec") or {}).get("digest") if run else None,
        # why it does not run (e.g. "fleet lease lost: ..."), while stopped or frozen
        "not_running": str(run.get("detail") or "") or None
        if run and run.get("state") in ("stopped", "frozen") else None,
        "last_error": err if err else ({"what": st["last_error"]} if st.get("last_error") else None),
        "last_event": _last_event_time(os.path.join(path, fmt.JOURNAL)),
        "source": "daemon",
    }


def _row_from_store(state: str, agent: Any, holders: Any) -> dict[str, Any]:
    from capsulefs.core.capsule import format as fmt
    from capsulefs.core.store.story import story
    from capsulefs.core.journal.tip import journal_tip_path
    from capsulefs.core.view.journal_tail import JournalTail

    m = agent.manifest()
    journal = agent.path(fmt.JOURNAL)
    tail = JournalTail(journal, tip_path=journal_tip_path(state, agent.agent_id))
    tail.refresh()
    rec = holders.get(agent.agent_id)
    return {
        "name": m.name, "agent_id": agent.agent_id,
        "state": rec.state.value if rec is not None else "no holder record",
        "holder": story(rec, m.name).as_json(), "epoch": m.holder.epoch,
        "model": f"{tail.model[0]}:{tail.model[1]}" if tail.model else None,
        "run": "not running (no daemon)", "spec_digest": None, "not_running": None, "last_error": None,
        "last_event": _last_event_time(journal), "source": "store",
    }


def host_status(args: argparse.Namespace) -> list[dict[str, Any]]:
    from capsulefs.core.store.holder import HolderBook
    from capsulefs.daemon.daemon import find_daemon
    from capsulefs.move.host import holders_dir

    state = state_dir(args)
    store = open_store(args)
    running = find_daemon(state)
    holders = HolderBook(holders_dir(state))
    rows = []
    for agent in store.agents():
        row = None
        if running is not None:
            row = _row_from_daemon(str(running["mountpoint"]), agent.name, agent.agent_id)
        rows.append(row if row is not None else _row_from_store(state, agent, holders))
    return rows


def _error_text(err: dict[str, Any] | None) -> str:
    if not err:
        return "-"
    text = str(err.get("what") or "")
    if err.get("fix"):
        text += f" -- fix: {err['fix']}"
    return shown(text)


def cmd_status(args: argparse.Namespace) -> int:
    rows = host_status(args)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    cols = ("NAME", "STATE", "HOLDER", "EPOCH", "MODEL", "RUN", "LAST EVENT", "LAST ERROR")
    table = [(shown(r["name"]), str(r["state"]), shown((r["holder"] or {}).get("state") or "-"), str(r["epoch"]),
              shown(r["model"] or "-"), str(r["run"]), r["last_event"] or "-", _error_text(r["last_error"]))
             for r in rows]
    widths = [max([len(c)] + [len(t[i]) for t in table]) for i, c in enumerate(cols[:-1])]
    for line in [cols, *table]:
        print("  ".join(f"{v:<{w}}" for v, w in zip(line, widths)) + "  " + line[-1])
    for r in rows:  # (what to do next, in the story's own words)
        told = r["holder"] or {}
        if told.get("next"):
            print(shown(f"{r['name']}: {told.get('state')}: {told.get('reason')}; next: {told['next']}"))
        elif r.get("not_running"):
            print(shown(f"{r['name']}: not running: {r['not_running']}"))
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    from capsulefs.agents import agent_log
    from capsulefs.core.errors import CapsuleError

    if args.n < 0:
        raise CapsuleError("-n must be 0 or more")
    agent = find_agent(args, args.agent)
    state = state_dir(args)
    lines, end = agent_log.tail(state, agent.agent_id, args.n)
    if not lines and not args.follow and not agent_log.log_files(state, agent.agent_id):
        print(f"capsulefs: agent {agent.name} has no log on this host yet (its process never ran here)",
              file=sys.stderr)
        return 0
    for line in lines:
        print(line)
    if args.follow:
        sys.stdout.flush()
        path = os.path.join(agent_log.log_dir(state, agent.agent_id), agent_log.LOG_NAME)
        for line in agent_log.follow(path, end if end is not None else (-1, 0)):
            print(line, flush=True)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="every agent of this host: state, epoch, model, run, last event, last error")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("logs", help="an agent process's log on this host (its stdout and stderr)")
    p.add_argument("agent", help="name or id")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing lines as they are written")
    p.add_argument("-n", type=int, default=20, metavar="N", help="how many of the last lines (default 20)")
    p.set_defaults(func=cmd_logs)
