"""``capsulefs render``: print the request body a provider would get for an agent.

AGENT is an agent of the host store (name or id), a capsule directory, or a
capsule tar. The journal is read, never written: a line still being written
at the end of the file is left out. The working memory
(``memory/working_memory.md``) goes into the system prompt unless
``--no-memory``. Provider and model default to the journal's last
``model_switch``; the tools offered, to the journal's last ``tools`` event
(``--tools FILE`` replaces them).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

from capsulefs.cli.common import open_store
from capsulefs.core.capsule import format as fmt
from capsulefs.core.errors import FormatError, NotFoundError
from capsulefs.core.journal.events import ToolsOffered
from capsulefs.core.journal.record import Record
from capsulefs.core.render import PROVIDERS, ToolSpec, render

MAX_TOOLS_FILE = 1 << 20


def capsule_reader(args: argparse.Namespace, target: str) -> Callable[[str], bytes | None]:
    """A function reading one capsule file (None if absent) of an agent, directory or tar."""
    if os.path.isdir(target):
        if not os.path.isfile(os.path.join(target, fmt.MANIFEST)):
            raise NotFoundError(f"{target} is a directory but not a capsule (no {fmt.MANIFEST})")

        def from_dir(rel: str) -> bytes | None:
            try:
                with open(os.path.join(target, rel), "rb") as f:
                    return f.read()
            except FileNotFoundError:
                return None

        return from_dir
    if os.path.isfile(target):
        from capsulefs.core.capsule.tarball import scan_tar

        contents = scan_tar(target).contents
        return contents.get
    store = open_store(args)
    agent = store.find(target)

    def from_store(rel: str) -> bytes | None:
        name = fmt.blob_name(rel)
        if name is not None:  # blobs live once in the store, not in the agent's directory
            return store.read_blob(name) if store.has_blob(name) else None
        try:
            with open(agent.path(rel), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    return from_store


def read_records(data: bytes) -> list[Record]:
    """Records of a journal file's bytes; a torn last line (no newline yet) is skipped."""
    records = []
    for no, line in enumerate(data.split(b"\n")[:-1], 1):
        if not line:
            continue
        try:
            records.append(Record.from_line(line))
        except FormatError as exc:
            raise FormatError(f"{fmt.JOURNAL} line {no}: {exc}") from None
    return records


def read_tools(path: str) -> list[ToolSpec]:
    """Tool definitions from a JSON file: a list of ``{"name", "description",
    "parameters"}`` objects, checked as a ``tools`` event's are."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_TOOLS_FILE + 1)
    except OSError as exc:
        raise NotFoundError(f"--tools {path}: {exc.strerror}") from None
    if len(data) > MAX_TOOLS_FILE:
        raise FormatError(f"--tools {path} is larger than {MAX_TOOLS_FILE} bytes")
    doc = fmt.load_json(data, f"--tools {path}")
    try:
        event = ToolsOffered(tools=doc)
    except FormatError as exc:
        raise FormatError(f"--tools {path}: {exc}") from None
    return [ToolSpec(name=t["name"], description=t.get("description", ""),
                     parameters=t.get("parameters") or {"type": "object", "properties": {}}) for t in event.tools]


def _blob(read: Callable[[str], bytes | None], sha: str) -> bytes:
    data = read(fmt.blob_path(sha))
    if data is None:
        raise NotFoundError(f"attachment blob {sha} is not in the capsule")
    return data


def cmd_render(args: argparse.Namespace) -> int:
    read = capsule_reader(args, args.agent)
    data = read(fmt.JOURNAL)
    if data is None:
        raise NotFoundError(f"{args.agent} holds no {fmt.JOURNAL}")
    memory = None
    if not args.no_memory:
        raw = read(fmt.WORKING_MEMORY)
        memory = raw.decode("utf-8", errors="replace") if raw else None
    tools = read_tools(args.tools) if args.tools else None
    out = render(
        read_records(data),
        tools=tools,
        provider=args.provider,
        model=args.model,
        working_memory=memory,
        budget=args.budget,
        max_output=args.max_output,
        read_blob=lambda sha: _blob(read, sha),
    )
    if args.compact:
        sys.stdout.write(json.dumps(out.body, ensure_ascii=False, separators=(",", ":")) + "\n")
    else:
        sys.stdout.write(json.dumps(out.body, ensure_ascii=False, indent=2) + "\n")
    if args.stats:
        tokens = f", {out.tokens} tokens by the counter" if out.tokens is not None else ""
        print(f"{out.provider} {out.model}: {out.kept_units} units kept, {out.dropped_units} dropped{tokens}",
              file=sys.stderr)
    return 0


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "render",
        help="print the request body one provider would get for an agent",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("agent", metavar="AGENT", help="agent name or id, capsule directory, or capsule tar")
    p.add_argument("--provider", choices=sorted(PROVIDERS), help="target API (default: the last model_switch)")
    p.add_argument("--model", help="target model (default: the last model_switch, or with --provider "
                   "the last model_switch to that provider)")
    p.add_argument("--budget", type=_positive, metavar="TOKENS",
                   help="fit the conversation into this many input tokens (conservative count)")
    p.add_argument("--max-output", type=_positive, metavar="TOKENS", help="reply token limit to put in the body")
    p.add_argument("--tools", metavar="FILE", help="offer these tools (a JSON list of {name, description, "
                   "parameters}) instead of the journal's last tools event")
    p.add_argument("--no-memory", action="store_true", help="leave the working memory out of the system prompt")
    p.add_argument("--compact", action="store_true", help="one line of JSON instead of indented")
    p.add_argument("--stats", action="store_true", help="say on stderr how much was kept and counted")
    p.set_defaults(func=cmd_render)
