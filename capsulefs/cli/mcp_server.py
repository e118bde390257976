"""``capsulefs mcp AGENT``: one agent of this host's store, served to any MCP
client over stdio, on the official ``mcp`` SDK (the ``mcp`` extra).

Rules:
  * Reads are what the CLI reads: the timeline (``capsulefs log``'s
    filters, from the same derived index), the semantic index (``search``),
    working memory and workspace files (blobs checked against their names),
    and a status built from the manifest, the holder record and the
    journal's tip.
  * Writes go through the journal as ``capsulefs append`` writes: drafts
    validated (a kind and its fields), stamped by this host, appended
    durably under the journal's locks (so a running daemon's appender and
    this one never interleave), the projections kept current, and all of it
    refused unless this host holds the agent and no move of it is under way
    (checked under the agent's files lock, as a move reads it). Only the
    kinds a client should write are offered: a user message, a note, and
    working memory (a ``memory_edit``).
  * The agent is the one named at start (by id from then on): if it leaves
    this host (moved, removed), every tool says so instead of answering for
    another agent of the same name.

Theory of operation: ``MCPServer`` (the SDK) runs the protocol on anyio's
asyncio backend in this process and calls each tool, a plain function, in
a worker thread; the tools are small wrappers over the CLI's own functions.
Nothing here writes to stdout (it carries the protocol): logs go to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Callable
from typing import Any

from capsulefs.cli.common import host_id, open_store, state_dir
from capsulefs.cli.journal_cmds import append_events, log_line, timeline_rows
from capsulefs.core.capsule import format as fmt
from capsulefs.core.errors import CapsuleError, FormatError, NotFoundError
from capsulefs.core.journal.events import MemoryEdit, Note, UserMessage
from capsulefs.core.store.holder import HolderBook
from capsulefs.core.store.agent import AgentHandle
from capsulefs.core.store.host_store import HostStore

log = logging.getLogger(__name__)

#: Most events one timeline call returns (a client asks again, narrower).
MAX_EVENTS = 1000
#: Largest workspace file or working memory returned whole, in bytes.
MAX_READ = 1 << 20
#: Largest text a client may write in one event.
MAX_TEXT = 1 << 20


class AgentGone(CapsuleError):
    """The agent this server was started for is no longer held here."""


class AgentService:
    """The tools' work, on one agent of one store (kept by id)."""

    def __init__(self, state: str, store: HostStore, agent: AgentHandle, machine: str) -> None:
        self.state = state
        self.store = store
        self.agent_id = agent.agent_id
        self.name = agent.name
        self.machine = machine

    def agent(self) -> AgentHandle:
        a = AgentHandle(self.store, self.agent_id)
        if not os.path.isfile(a.path(fmt.MANIFEST)):
            raise AgentGone(f"agent {self.name} ({self.agent_id}) is no longer held here")
        return a

    # -- reading -------------------------------------------------------------
    def timeline(self, *, kind: list[str] | None = None, since: str | None = None, until: str | None = None,
                 grep: str | None = None, failed: bool = False, tail: int = 50, raw: bool = False) -> str:
        from capsulefs.core.journal.query import Query, parse_when

        if not 1 <= tail <= MAX_EVENTS:
            raise FormatError(f"tail must be between 1 and {MAX_EVENTS}")
        q = Query(kinds=tuple(kind or ()), grep=grep, failed=failed, tail=tail,
                  since_ms=None if since is None else parse_when(since),
                  until_ms=None if until is None else parse_when(until))
        rows = timeline_rows(self.store, self.agent(), q)
        if raw:
            return "".join(line.decode() + "\n" for _no, line in rows)
        return "".join(f"{log_line(no, line)}\n" for no, line in rows) or "(no events)\n"

    def search(self, query: str, k: int = 5) -> list[dict[str, Any]]:
        import dataclasses

        from capsulefs.core.semantic.index import search_capsule

        if not 1 <= k <= 100:
            raise FormatError("k must be between 1 and 100")
        return [dataclasses.asdict(h) for h in search_capsule(self.agent(), query, k)]

    def read_memory(self) -> str:
        data = self._read_limited(self.agent().path(fmt.WORKING_MEMORY), "working memory")
        return data.decode("utf-8", "replace")

    def list_files(self) -> dict[str, str]:
        return fmt.parse_snapshot(self.agent().read(fmt.SNAPSHOT))

    def read_file(self, path: str) -> str:
        files = self.list_files()
        sha = files.get(path)
        if sha is None:
            raise NotFoundError(f"the workspace has no file {path!r}")
        if self.store.blob_size(sha) > MAX_READ:
            raise FormatError(f"{path} is larger than {MAX_READ} bytes")
        data = self.store.read_blob(sha)  # checked against its name
        try:
            return data.decode()
        except UnicodeDecodeError:
            raise FormatError(f"{path} is not UTF-8 text ({len(data)} bytes)") from None

    def status(self) -> dict[str, Any]:
        from capsulefs.core.journal.tip import journal_tip_path
        from capsulefs.core.view.journal_tail import JournalTail
        from capsulefs.move.host import holders_dir

        agent = self.agent()
        manifest = agent.manifest()
        record = HolderBook(holders_dir(self.state)).get(self.agent_id)
        tail = JournalTail(agent.path(fmt.JOURNAL), tip_path=journal_tip_path(self.store.root, self.agent_id))
        tail.refresh()
        return {
            "agent_id": self.agent_id,
            "name": manifest.name,
            "holder": manifest.holder.host,
            "epoch": manifest.holder.epoch,
            "this_host": self.machine,
            "state": record.state.value if record is not None else "held",
            "moving": bool(record is not None and record.moving),
            "events": tail.events,
            "provider": tail.model[0] if tail.model else None,
            "model": tail.model[1] if tail.model else None,
            "workspace_files": len(self.list_files()),
        }

    def _read_limited(self, path: str, what: str) -> bytes:
        with open(path, "rb") as f:
            data = f.read(MAX_READ + 1)
        if len(data) > MAX_READ:
            raise FormatError(f"{what} is larger than {MAX_READ} bytes")
        return data

    # -- writing -------------------------------------------------------------
    def append(self, kind: str, text: str) -> str:
        if kind not in ("user_message", "note"):
            raise FormatError("kind must be user_message or note")
        return self._append(UserMessage(text=self._text(text)) if kind == "user_message" else Note(text=self._text(text)))

    def edit_memory(self, text: str) -> str:
        return self._append(MemoryEdit(text=self._text(text)))

    @staticmethod
    def _text(text: str) -> str:
        if len(text.encode("utf-8", "surrogatepass")) > MAX_TEXT:
            raise FormatError(f"the text is larger than {MAX_TEXT} bytes")
        return text

    def _append(self, event: Any) -> str:
        agent = self.agent()
        [rec] = append_events(self.state, self.store, agent, [event], machine=self.machine)
        return rec.line.decode()


def _answer(call: Callable[[], Any]) -> Any:
    """A tool's answer; what goes wrong as users and their data can make it
    (a CapsuleError, an OSError) is the SDK's ToolError: the client gets the
    one-line message as an error result, the server logs no crash."""
    from mcp.server.mcpserver.exceptions import ToolError

    try:
        return call()
    except CapsuleError as exc:
        raise ToolError(str(exc)) from None
    except OSError as exc:
        where = f": {exc.filename}" if exc.filename else ""
        raise ToolError(f"{exc.strerror or exc}{where}") from None


def build_server(service: AgentService) -> Any:
    """The MCP server (the SDK's ``MCPServer``) with a tool for each of the service's calls."""
    from mcp.server.mcpserver import MCPServer

    server = MCPServer(
        name="capsulefs",
        instructions=(f"The capsulefs agent {service.name} ({service.agent_id}): its timeline (journal), semantic "
                      f"search over its history, its working memory, its workspace files and its status. Writes "
                      f"are appended to its journal, stamped by this host, and refused where this host does not "
                      f"hold the agent."),
    )

    @server.tool()
    def timeline(kind: list[str] | None = None, since: str | None = None, until: str | None = None,
                 grep: str | None = None, failed: bool = False, tail: int = 50, raw: bool = False) -> str:
        """The agent's journal, one event a line, oldest first: the last `tail` events (at most 1000) that
        match every filter given. kind: event kinds (user_message, assistant_message, tool_call,
        tool_result, note, memory_edit, model_switch, ...). since/until: 2026-12-07, 2026-12-07T14:00,
        14:00, today, yesterday, or a span ago (30m, 2h, 3d). grep: a regular expression over the event's
        text (time-bounded). failed: only failed tool results. raw: the journal's JSON lines."""
        return _answer(lambda: service.timeline(kind=kind, since=since, until=until, grep=grep, failed=failed,
                                                tail=tail, raw=raw))

    @server.tool()
    def search(query: str, k: int = 5) -> str:
        """The k passages of the agent's history (messages, tool calls and results, working memory) that
        best match the query, from its semantic index, as JSON."""
        return json.dumps(_answer(lambda: service.search(query, k)), ensure_ascii=False, indent=1)

    @server.tool()
    def read_memory() -> str:
        """The agent's working memory (memory/working_memory.md)."""
        return _answer(service.read_memory)

    @server.tool()
    def edit_memory(text: str) -> str:
        """Replace the agent's working memory with `text` (journaled as a memory_edit event); returns the
        stamped journal line."""
        return _answer(lambda: service.edit_memory(text))

    @server.tool()
    def append(text: str, kind: str = "user_message") -> str:
        """Append a user_message (the agent answers it if it runs) or a note to the agent's journal;
        returns the stamped journal line."""
        return _answer(lambda: service.append(kind, text))

    @server.tool()
    def list_files() -> str:
        """The agent's workspace files: path -> sha256, as JSON."""
        return json.dumps(_answer(service.list_files), indent=1, sort_keys=True)

    @server.tool()
    def read_file(path: str) -> str:
        """One workspace file's text (UTF-8, at most 1 MiB), by its workspace path."""
        return _answer(lambda: service.read_file(path))

    @server.tool()
    def status() -> str:
        """The agent's identity, holder, state (held, or in a move), event count and current model, as JSON."""
        return json.dumps(_answer(service.status), indent=1, sort_keys=True)

    return server


def serve(args: argparse.Namespace) -> int:
    """``capsulefs mcp AGENT``: serve until the client closes stdin."""
    state = state_dir(args)
    store = open_store(args)
    agent = store.find(args.agent)
    service = AgentService(state, store, agent, host_id(args))
    log.info("serving agent %s (%s) over MCP on stdio", service.name, service.agent_id)
    build_server(service).run("stdio")
    return 0


__all__ = ["AgentGone", "AgentService", "build_server", "serve"]
