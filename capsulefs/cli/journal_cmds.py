"""Commands on journals: log, append, merge.

``log`` and ``append`` take an agent of the host store (name or id); ``log``
also reads a capsule directory or tar. ``append`` is for scripts: it prints
the stamped line of each event it appended (after fsync). ``merge`` takes
two capsules (directories, tars, or agents of the store) of one agent and
writes a new capsule, a directory or a tar by the name of ``-o``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any, BinaryIO

from capsulefs.cli import UsageError
from capsulefs.cli.common import host_id, now_seconds, open_store, shown, state_dir
from capsulefs.core.capsule import format as fmt
from capsulefs.core.errors import CapsuleError, FormatError, NotFoundError
from capsulefs.core.journal.events import Attachment, MemoryEdit, WorkspaceUpdate, parse_draft
from capsulefs.core.journal.record import Record
from capsulefs.core.store.agent import AgentHandle

if TYPE_CHECKING:
    from capsulefs.core.capsule.merge import Side
    from capsulefs.core.store.holder import HolderBook
    from capsulefs.core.store.host_store import HostStore
    from capsulefs.core.journal.file import Journal
    from capsulefs.core.journal.query import Query

SUMMARY_CHARS = 100
#: Most bytes ``append --stdin`` reads in all (None: ``view.edit.MAX_EDIT_SIZE``):
#: its drafts are appended all or none, so they are held in memory until the
#: input ends (as big as a ``new --spec`` file or a working_memory.md edit may be).
MAX_STDIN_DRAFTS: int | None = None


def new_event_id() -> str:
    return os.urandom(12).hex()


def agent_journal(agent: AgentHandle, *, machine: str | None) -> "Journal":
    from capsulefs.core.journal.file import open_agent_journal

    return open_agent_journal(agent, machine=machine, now=time.time, new_id=new_event_id)


# -- log ---------------------------------------------------------------------------


def _one_line(text: str, limit: int = SUMMARY_CHARS) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def summary(rec: Record) -> str:
    """One line saying what an event was."""
    ev: Any = rec.event
    kind = rec.kind
    if kind in ("user_message", "assistant_message", "note", "system"):
        who = f"[{ev.model}] " if kind == "assistant_message" and ev.model else ""
        return who + _one_line(ev.text)
    if kind == "reasoning":
        shown = _one_line(ev.text) if ev.text else "(opaque payload)"
        return f"{ev.provider}/{ev.model} {ev.payload_format}: {shown}"
    if kind == "tool_call":
        return _one_line(f"{ev.name}({json.dumps(dict(ev.arguments), sort_keys=True, ensure_ascii=False)}) call {ev.call_id}")
    if kind == "tool_result":
        flag = "ERROR " if ev.is_error else ""
        return _one_line(f"{flag}call {ev.call_id}: {ev.content}")
    if kind == "memory_edit":
        if ev.text is not None:
            return f"working memory, {len(ev.text.encode())} bytes: " + _one_line(ev.text, 60)
        return f"working memory from blob {ev.blob[:12]}"
    if kind == "workspace_update":
        parts = [f"{p} deleted" if sha is None else f"{p} = {sha[:12]}" for p, sha in sorted(ev.changes.items())]
        return _one_line(", ".join(parts))
    if kind == "model_switch":
        return f"{ev.provider}:{ev.model}"
    keys = ", ".join(sorted(rec.event.payload()))
    return f"(a kind from a newer capsulefs; fields: {keys or 'none'})"


def _query(args: argparse.Namespace) -> "Query":
    from capsulefs.core.journal.query import Query, parse_when

    if args.tail is not None and args.tail < 0:
        raise UsageError("--tail takes a number of events, 0 or more")
    if args.grep is not None:
        try:
            args.grep.encode()
        except UnicodeEncodeError:
            raise UsageError("--grep is not valid UTF-8 text") from None
    return Query(kinds=tuple(args.kind or ()), grep=args.grep, failed=args.failed, tail=args.tail,
                 since_ms=None if args.since is None else parse_when(args.since),
                 until_ms=None if args.until is None else parse_when(args.until))


def _capsule_journal(target: str) -> bytes | None:
    """The journal of a capsule directory or tar, or None if ``target`` is neither."""
    if os.path.isdir(target) and os.path.isfile(os.path.join(target, fmt.MANIFEST)):
        with open(os.path.join(target, fmt.JOURNAL), "rb") as f:
            return f.read()
    if os.path.isfile(target):
        from capsulefs.core.capsule.tarball import scan_tar

        listing = scan_tar(target)
        if fmt.JOURNAL not in listing.contents:
            raise NotFoundError(f"{target} holds no {fmt.JOURNAL}")
        return listing.contents[fmt.JOURNAL]
    return None


def timeline_rows(store: "HostStore", agent: AgentHandle, q: "Query") -> list[tuple[int | None, bytes]]:
    """(line number if known, line) of what ``log`` shows of an agent of the
    store: the last ones read from the end (--tail alone), the whole journal
    (no filter), or the timeline index's answer (any filter)."""
    from capsulefs.core.journal import timeline
    from capsulefs.core.journal.recovery import read_journal_locked

    agent.recover_journal()  # a reader's replay (or, in a store it may not write, a check)
    path = agent.path(fmt.JOURNAL)
    if not q.filters and q.tail is None:
        return list(enumerate(_whole_lines(read_journal_locked(path, agent.ring_path)), 1))
    snap = timeline.open_snapshot(path)
    try:
        if not q.filters:
            assert q.tail is not None
            lines = timeline.last_lines(snap, q.tail)
            if lines is None:  # NUL bytes near the end: as a whole reader sees it
                lines = _whole_lines(read_journal_locked(path, agent.ring_path))[-q.tail:] if q.tail else []
            return [(None, line) for line in lines]
        index = timeline.TimelineIndex(os.path.join(timeline.timeline_dir(store.root, agent.agent_id),
                                                    timeline.INDEX_NAME), path)
        return list(timeline.answer(snap, q, index))
    finally:
        os.close(snap.fd)


def _whole_lines(data: bytes) -> list[bytes]:
    """The lines of a journal's bytes, without a line still being written."""
    data = data[: data.rfind(b"\n") + 1]
    return data[:-1].split(b"\n") if data else []


def log_line(no: int | None, line: bytes) -> str | None:
    """One journal line as ``log`` shows it (None: an unreadable line's
    message is for a person only, not for --json)."""
    try:
        rec = Record.from_line(line)
    except FormatError as exc:
        where = f"line {no}" if no is not None else "a line"
        return shown(f"{where}: unreadable: {exc}")
    when = rec.time.replace("T", " ").rstrip("Z")[:19]
    return shown(f"{when}  {rec.machine[:8]:<8} #{rec.seq:<5} {rec.kind:<17} {summary(rec)}")


def cmd_log(args: argparse.Namespace) -> int:
    q = _query(args)
    data = _capsule_journal(args.agent)
    if data is None:
        store = open_store(args)
        rows = timeline_rows(store, store.find(args.agent), q)
    elif q.filters or q.tail is not None:
        from capsulefs.core.journal.timeline import scan

        rows = list(scan(_whole_lines(data), q))
    else:
        rows = list(enumerate(_whole_lines(data), 1))
    out = sys.stdout
    for no, line in rows:
        if args.json:
            try:
                Record.from_line(line)
            except FormatError:
                continue
            out.write(line.decode() + "\n")
        else:
            out.write(f"{log_line(no, line)}\n")
    return 0


# -- append ------------------------------------------------------------------------


def _stdin_drafts(f: BinaryIO) -> list[Any]:
    """Draft events from ``f``, parsed line by line as they come, so that
    input that never ends a line (``/dev/zero``) or is not JSON stops at its
    first line instead of being read whole into memory; input that goes on
    (valid lines without end) stops at MAX_STDIN_DRAFTS bytes in all."""
    from capsulefs.core.journal.file import parse_draft_lines
    from capsulefs.core.view.edit import MAX_EDIT_SIZE
    from capsulefs.core.view.handles import MAX_PARTIAL_LINE

    limit = MAX_STDIN_DRAFTS if MAX_STDIN_DRAFTS is not None else MAX_EDIT_SIZE
    events: list[Any] = []
    no = total = 0
    while line := f.readline(min(MAX_PARTIAL_LINE, limit - total) + 1):
        no += 1
        total += len(line)
        if len(line) > MAX_PARTIAL_LINE:
            raise FormatError(f"draft line {no} is longer than {MAX_PARTIAL_LINE} bytes")
        if total > limit:
            raise UsageError(f"--stdin drafts are more than {limit} bytes in all; "
                             f"split them into several appends (each is all or none on its own)")
        events += parse_draft_lines(line, first=no)
    if not events:
        parse_draft_lines(b"")  # the error for no whole line
    return events


def _drafts(args: argparse.Namespace) -> list[Any]:
    if args.stdin:
        if args.kind or args.text is not None or args.json:
            raise UsageError("--stdin reads whole draft events; do not combine it with --kind, --text or --json")
        return _stdin_drafts(sys.stdin.buffer)
    if not args.kind:
        raise UsageError("append needs --kind KIND (or --stdin with one JSON event per line)")
    for opt, value in (("--kind", args.kind), ("--text", args.text), ("--json", args.json)):
        try:
            (value or "").encode()
        except UnicodeEncodeError:  # a byte that is not UTF-8, surrogate-escaped by Python's argv decoding
            raise UsageError(f"{opt} is not valid UTF-8 text") from None
    fields: dict[str, Any] = {}
    if args.json:
        extra = fmt.load_json(args.json, "--json", error=UsageError)
        if not isinstance(extra, dict):
            raise UsageError("--json must be a JSON object of the event's fields")
        fields.update(extra)
    if args.text is not None:
        fields["text"] = args.text
    if fields.get("kind", args.kind) != args.kind:
        raise UsageError(f"--kind {args.kind} but --json says kind {fields['kind']!r}")
    fields["kind"] = args.kind
    return [parse_draft(fields)]


def _check_blobs(agent: AgentHandle, events: list[Any]) -> list[str]:
    """Blobs the events name must be in the store; returns them."""
    shas = []
    for ev in events:
        if isinstance(ev, MemoryEdit) and ev.blob is not None:
            shas.append(ev.blob)
        elif isinstance(ev, WorkspaceUpdate):
            shas.extend(sha for sha in ev.changes.values() if sha is not None)
        elif isinstance(ev, Attachment):
            shas.append(ev.blob)
    missing = [sha for sha in shas if not agent.store.has_blob(sha)]
    if missing:
        raise NotFoundError(f"blob {missing[0]} is not in the store; put the file there first")
    for ev in events:
        if isinstance(ev, Attachment) and agent.store.blob_size(ev.blob) != ev.size:
            raise FormatError(f"attachment {ev.blob}: size {ev.size} but the blob has "
                              f"{agent.store.blob_size(ev.blob)} bytes")
    return shas


def _project(agent: AgentHandle, events: list[Any], blobs: list[str]) -> None:
    """Keep working_memory.md and snapshot.json equal to their projections."""
    from capsulefs.core.journal.projections import apply_workspace_changes

    files: dict[str, bytes] = {}
    snap = None
    for ev in events:
        if isinstance(ev, MemoryEdit):
            files[fmt.WORKING_MEMORY] = ev.text.encode() if ev.text is not None else agent.store.read_blob(ev.blob or "")
        elif isinstance(ev, WorkspaceUpdate):
            if snap is None:
                snap = fmt.parse_snapshot(agent.read(fmt.SNAPSHOT))
            apply_workspace_changes(snap, ev.changes)
    if snap is not None:
        files[fmt.SNAPSHOT] = fmt.snapshot_bytes(snap)
    if files:
        agent.write_files(files, add_blobs=blobs)


def _refuse_unless_held(holders: "HolderBook", agent_id: str, name: str) -> None:
    """CapsuleError unless this host holds the agent and no move of it is
    under way (an agent without a record, from before holder records, may
    be written)."""
    from capsulefs.core.store.holder import HolderState

    rec = holders.get(agent_id)
    if rec is None or rec.state is HolderState.HELD:
        return
    if rec.moving:
        why = (f"it is in a move ({rec.describe_move()}): events appended here now would be left behind; "
               f"append once the move has ended, on the host that holds it")
    elif rec.state is HolderState.UNKNOWN:
        why = (f"this host may not hold it ({rec.note or 'in doubt'}): "
               f"run 'capsulefs move {name} --learn' first")
    else:
        why = f"this host no longer holds it ({rec.state.value}{': ' + rec.note if rec.note else ''})"
    raise CapsuleError(f"cannot append to agent {name} ({agent_id}): {why}")


def append_events(state: str, store: "HostStore", agent: AgentHandle, events: list[Any], *,
                  machine: str) -> list[Record]:
    """Append validated draft events to an agent of the store from outside
    any daemon, as ``capsulefs append`` does (stamped, chained, durable; all
    or none), and keep its projections current. Refused (CapsuleError)
    unless this host holds the agent and no move of it is under way."""
    from capsulefs.core.store.holder import HolderBook
    from capsulefs.move.host import holders_dir

    holders = HolderBook(holders_dir(state))
    # The holder record is checked under the agent's files lock: a move of
    # the agent reads its files under the same lock once FROZEN is durable,
    # so these events are either whole in what it moves or refused here.
    with holders.files_lock(agent.agent_id, shared=False), store.writing():
        # (store.writing: blobs the events name stay put until the manifest lists them)
        _refuse_unless_held(holders, agent.agent_id, agent.name)
        blobs = _check_blobs(agent, events)
        agent.list_blobs(blobs)  # before the journal names them: a crash then leaves none to gc
        with agent_journal(agent, machine=machine) as journal:
            records = journal.append_many(events)
        _project(agent, events, blobs)
    return records


def cmd_append(args: argparse.Namespace) -> int:
    events = _drafts(args)
    store = open_store(args)
    agent = store.find(args.agent)
    records = append_events(state_dir(args), store, agent, events, machine=host_id(args))
    if not args.quiet:
        for rec in records:
            sys.stdout.write(rec.line.decode() + "\n")
    return 0


# -- merge -------------------------------------------------------------------------


def _load_side(args: argparse.Namespace, stack: ExitStack, target: str, scratch: str) -> "Side":
    from capsulefs.core.capsule.merge import side_from_agent, side_from_dir, side_from_tar

    if os.path.isdir(target):
        return side_from_dir(target)
    if os.path.isfile(target):
        return stack.enter_context(side_from_tar(target, scratch))
    return side_from_agent(open_store(args).find(target))


def cmd_merge(args: argparse.Namespace) -> int:
    from capsulefs.core.capsule.merge import merge_capsules

    if args.into:
        return _merge_into(args)
    out = args.output
    if not out:
        raise UsageError("merge: give -o C (a new capsule), or --into to merge B into the agent A held here")
    if os.path.lexists(out):
        raise UsageError(f"{out} already exists; merge writes a new capsule")
    scratch = os.path.dirname(os.path.abspath(out))
    with ExitStack() as stack:
        a = _load_side(args, stack, args.a, scratch)
        b = _load_side(args, stack, args.b, scratch)
        plan = merge_capsules(a, b, out, mtime=now_seconds())
    events = plan.files[fmt.JOURNAL].count(b"\n")
    for w in plan.warnings:
        print(f"capsulefs: warning: {w}", file=sys.stderr)
    print(f"merged {args.a} and {args.b} into {out}: {events} events, {len(plan.blobs)} blob(s)")
    return 0


def _merge_into(args: argparse.Namespace) -> int:
    """``merge AGENT OTHER --into``: OTHER (a capsule directory or tar: a copy
    another host kept, docs/move.md) merged into the agent held here, in place."""
    from capsulefs.core.capsule.merge import merge_into_agent
    from capsulefs.core.store.holder import HolderBook, HolderState
    from capsulefs.daemon.daemon import find_daemon, holding_state
    from capsulefs.move.host import holders_dir

    if args.output:
        raise UsageError("merge: --into merges into the agent A in place; -o does not go with it")
    state = state_dir(args)
    running = find_daemon(state)
    if running is not None:
        raise CapsuleError(f"merge --into writes the agent's files, so it runs without a daemon: unmount first "
                           f"('capsulefs umount {running['mountpoint']}'), merge, mount again")
    store = open_store(args)
    agent = store.find(args.a)
    with holding_state(state, doing=f"merging {args.b} into {agent.name}"), ExitStack() as stack:
        rec = HolderBook(holders_dir(state)).get(agent.agent_id)
        if rec is not None and rec.state is not HolderState.HELD:
            raise CapsuleError(f"merge --into: agent {agent.name} is {rec.state.value} here, not held: merge into "
                               f"its copy on the host that holds it")
        if os.path.isdir(args.b):
            from capsulefs.core.capsule.merge import side_from_dir
            other = side_from_dir(args.b)
        elif os.path.isfile(args.b):
            from capsulefs.core.capsule.merge import side_from_tar
            other = stack.enter_context(side_from_tar(args.b, os.path.dirname(os.path.abspath(args.b))))
        else:
            raise UsageError(f"merge --into: {args.b} is not a capsule directory or tar")
        before = agent.read(fmt.JOURNAL).count(b"\n")
        plan = merge_into_agent(agent, other)
    events = plan.files[fmt.JOURNAL].count(b"\n")
    for w in plan.warnings:
        print(f"capsulefs: warning: {w}", file=sys.stderr)
    print(f"merged {args.b} into agent {agent.name}: {events} events ({events - before} new), "
          f"{len(plan.blobs)} blob(s)")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("log", help="show an agent's journal as a readable timeline")
    p.add_argument("agent", help="agent name or id, or a capsule directory or tar")
    p.add_argument("--kind", action="append", metavar="K", help="only events of this kind (repeatable)")
    p.add_argument("--since", metavar="T", help="only events at or after T: 2026-12-07, 2026-12-07T14:00, 14:00, "
                   "today, yesterday, or a span ago (30m, 2h, 3d, 1w); without a zone, local time")
    p.add_argument("--until", metavar="T", help="only events before T (as --since)")
    p.add_argument("--grep", metavar="RE", help="only events whose text (every string field) matches this "
                   "regular expression (time-bounded)")
    p.add_argument("--failed", action="store_true", help="only failed tool calls (tool results with is_error)")
    p.add_argument("--tail", type=int, metavar="N", help="only the last N events (that match)")
    p.add_argument("--json", action="store_true", help="print the journal lines themselves")
    p.set_defaults(func=cmd_log)

    p = sub.add_parser("append", help="append an event to an agent's journal (for scripts)")
    p.add_argument("agent", help="agent name or id")
    p.add_argument("--kind", metavar="KIND", help="event kind, e.g. user_message, note, memory_edit")
    p.add_argument("--text", metavar="T", help="the event's text field")
    p.add_argument("--json", metavar="OBJ", help="the event's fields as a JSON object")
    p.add_argument("--stdin", action="store_true", help="read draft events, one JSON object per line, and append them all or none")
    p.add_argument("-q", "--quiet", action="store_true", help="do not print the stamped lines")
    p.set_defaults(func=cmd_append)

    p = sub.add_parser("merge", help="merge two diverged copies of one agent into a new capsule")
    p.add_argument("a", metavar="A", help="capsule directory, tar, or agent name/id")
    p.add_argument("b", metavar="B", help="capsule directory, tar, or agent name/id")
    p.add_argument("-o", "--output", metavar="C", help="new capsule: a directory, or FILE.tar[.gz|.zst]")
    p.add_argument("--into", action="store_true",
                   help="merge B into the agent A held here, in place (its journal only gains lines; no daemon)")
    p.set_defaults(func=cmd_merge)
