"""Commands on the agent's semantic index: search, reindex.

AGENT is an agent held in the host store (by name or id), the path of a
capsule directory, or a capsule tar. A store agent's index is brought up to
date and saved through the store (so its manifest stays in step). A capsule
directory is searched read-only unless ``--save-index`` is given, since
rewriting index.json would no longer match the digest its manifest lists; a
tar is always read-only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from typing import Any

from capsulefs.cli.common import find_agent, shown
from capsulefs.core.capsule import format as fmt
from capsulefs.core.semantic.embedders import select_embedder
from capsulefs.core.semantic.index import refresh_index, search_capsule, update_index
from capsulefs.core.semantic.text import INDEXED_KINDS

log = logging.getLogger(__name__)


def _is_capsule_dir(path: str) -> bool:
    return os.path.isdir(path) and (
        os.path.isfile(os.path.join(path, fmt.MANIFEST)) or os.path.isfile(os.path.join(path, fmt.JOURNAL))
    )


def _target(args: argparse.Namespace) -> tuple[Any, bool]:
    """(capsule dir or agent handle, whether to save the index)."""
    if _is_capsule_dir(args.agent):
        return args.agent, args.save_index
    if os.path.isfile(args.agent):
        return args.agent, False
    return find_agent(args, args.agent), True


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def cmd_search(args: argparse.Namespace) -> int:
    capsule, save = _target(args)
    embedder = select_embedder(args.embedder)
    hits = search_capsule(capsule, args.query, args.k, embedder=embedder, save=save, kinds=args.kind or None)
    if args.json:
        print(json.dumps([dataclasses.asdict(h) for h in hits], indent=2, ensure_ascii=False))
        return 0
    if not hits:
        print("no matches (the agent's journal has nothing indexed yet)")
        return 0
    for n, h in enumerate(hits, 1):
        where = f" [{h.start}:{h.end}]" if h.kind == "memory_edit" else ""
        print(shown(f"{n:>2}. {h.score:.3f}  {h.event}  {h.kind}{where}  {h.time}"))
        print(shown(f"    {h.snippet}"))
    return 0


def cmd_reindex(args: argparse.Namespace) -> int:
    capsule, save = _target(args)
    embedder = select_embedder(args.embedder)
    if args.rebuild:
        from capsulefs.core.semantic.access import CapsuleFiles
        from capsulefs.core.semantic.vectors import dump_index

        files = CapsuleFiles.of(capsule)
        index, report = update_index(None, files.read_journal(), embedder, blobs=files.read_blob)
        save = save and files.write_index is not None
        if save:
            assert files.write_index is not None
            files.write_index(dump_index(index))
    else:
        index, _journal, report = refresh_index(capsule, embedder, save=save)
    spec = index.embedder
    made_by = f"{spec.name} ({spec.dims} dims, v{spec.version})" if spec else "no embedder"
    print(
        f"{report.mode}: {report.reason}; {len(index)} chunk(s) from {index.position.events} event(s), "
        f"+{report.added} -{report.removed}; embedder {made_by}{'' if save else ' (not saved)'}"
    )
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("agent", metavar="AGENT", help="agent name or id in the host store, a capsule directory, or a capsule tar")
    p.add_argument(
        "--embedder",
        choices=("auto", "hashed", "model"),
        default="auto",
        help="auto: a locally installed sentence model if any, else hashed n-grams (default: auto)",
    )
    p.add_argument(
        "--save-index",
        action="store_true",
        help="for a capsule directory: write the updated index.json back (its manifest digest will then differ)",
    )


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "search",
        help="search an agent's history (messages, tool calls and results, working memory)",
        description="Print the best matches for QUERY in the agent's semantic index, each with its "
        "event id, kind, time and a snippet. The index is brought up to date first.",
    )
    _common(p)
    p.add_argument("query", metavar="QUERY", help="what to look for, in plain words")
    p.add_argument("-k", type=_positive, default=5, metavar="N", help="how many matches to print (default 5)")
    p.add_argument("--kind", action="append", choices=INDEXED_KINDS, help="only events of this kind (repeatable)")
    p.add_argument("--json", action="store_true", help="print the hits as JSON")
    p.set_defaults(func=cmd_search)

    p = sub.add_parser(
        "reindex",
        help="bring an agent's semantic index up to date (or rebuild it)",
        description="Update memory/vector_index/index.json from the journal: incremental unless "
        "--rebuild, or unless the index is stale, corrupt or made by another embedder.",
    )
    _common(p)
    p.add_argument("--rebuild", action="store_true", help="rebuild from the whole journal")
    p.set_defaults(func=cmd_reindex)
