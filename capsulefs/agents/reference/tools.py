"""The reference agent's tools: what the model may call, run in the sandbox
(the working directory).

Rules:
  * Tools cannot reach outside the sandbox: paths are resolved and checked.
  * ``read_file`` on an image or a PDF (told by its first bytes, never its
    name) attaches it: the bytes are stored as a blob of the capsule
    (``artifacts/blobs/<sha256>``; through the mount, an upload checked at
    close), then an ``attachment`` event with the call's id is journaled
    with its result, in one append, so the next request shows it to the model.
  * The shell tool runs without the run's secrets.
"""

from __future__ import annotations


import logging
import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from capsulefs.core import render
from capsulefs.core.capsule.spec import SECRETS_ENV, redact_secrets, secrets_in

log = logging.getLogger(__name__)

MAX_TOOL_OUTPUT = 16_000
SHELL_TIMEOUT = 30.0

TOOLS = (
    render.ToolSpec(
        name="read_file",
        description="Read a text file of the workspace; an image or a PDF is attached for you to see.",
        parameters={"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    ),
    render.ToolSpec(
        name="write_file",
        description="Create or replace a file of the workspace.",
        parameters={
            "type": "object",
            "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
            "required": ["path", "content"],
        },
    ),
    render.ToolSpec(
        name="shell",
        description="Run a shell command in the workspace; its output is returned.",
        parameters={
            "type": "object",
            "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}},
            "required": ["command"],
        },
    ),
    render.ToolSpec(
        name="recall",
        description="Search this agent's own history and working memory.",
        parameters={
            "type": "object",
            "properties": {"query": {"type": "string"}, "k": {"type": "integer"}},
            "required": ["query"],
        },
    ),
)


#: The tools as the journal's ``tools`` event records them.
TOOL_DEFS: list[Mapping[str, Any]] = [{"name": t.name, "description": t.description, "parameters": dict(t.parameters)} for t in TOOLS]



class ToolError(Exception):
    pass


@dataclass(frozen=True)
class ToolOutput:
    """What a tool returns: its text, and files to show the model."""

    text: str
    files: tuple[tuple[str, str, bytes], ...] = ()  # (name, media type, bytes) to attach


@dataclass
class Toolbox:
    root: str  # the sandbox workspace
    capsule_dir: str
    shell_timeout: float = SHELL_TIMEOUT
    # name -> value of the run's secrets: kept from the shell, redacted from results
    secrets: dict[str, str] = field(default_factory=lambda: secrets_in(os.environ))

    def _path(self, rel: object) -> str:
        if not isinstance(rel, str) or not rel:
            raise ToolError("path must be a non-empty string")
        full = os.path.realpath(os.path.join(self.root, rel))
        root = os.path.realpath(self.root)
        if full != root and not full.startswith(root + os.sep):
            raise ToolError(f"{rel} is outside the workspace")
        return full

    def run(self, name: str, args: Mapping[str, Any]) -> str:
        return self.call(name, args).text

    def call(self, name: str, args: Mapping[str, Any]) -> ToolOutput:
        """Run a tool; its text has the run's secrets redacted (ToolError if it failed)."""
        fn = getattr(self, f"tool_{name}", None)
        if fn is None:
            raise ToolError(f"unknown tool {name!r}")
        try:
            out = fn(args)
        except ToolError as exc:
            raise ToolError(redact_secrets(str(exc), self.secrets)) from None
        if isinstance(out, str):
            out = ToolOutput(out)
        return ToolOutput(redact_secrets(out.text, self.secrets), out.files)

    def tool_read_file(self, args: Mapping[str, Any]) -> str | ToolOutput:
        path = self._path(args.get("path"))
        rel = str(args.get("path"))
        try:
            with open(path, "rb") as f:
                media_type = render.sniff_media_type(f.read(16))
                if media_type is not None:
                    f.seek(0)
                    data = f.read(render.MAX_ATTACHMENT + 1)
                    if len(data) > render.MAX_ATTACHMENT:
                        raise ToolError(f"{rel} is a {media_type} file larger than {render.MAX_ATTACHMENT} bytes, "
                                        f"the most any provider takes: not attached")
                    return ToolOutput(f"{rel}: {media_type}, {len(data)} bytes, attached",
                                      ((os.path.basename(path), media_type, data),))
            with open(path, encoding="utf-8", errors="replace") as f:
                return f.read(MAX_TOOL_OUTPUT)
        except OSError as exc:
            raise ToolError(f"cannot read {rel}: {exc.strerror}") from None

    def tool_write_file(self, args: Mapping[str, Any]) -> str:
        path = self._path(args.get("path"))
        content = args.get("content")
        if not isinstance(content, str):
            raise ToolError("content must be a string")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = path + ".tmp-agent"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return f"wrote {len(content.encode())} bytes to {args['path']}"

    def tool_shell(self, args: Mapping[str, Any]) -> str:
        cmd = args.get("command")
        if not isinstance(cmd, str) or not cmd:
            raise ToolError("command must be a non-empty string")
        timeout = float(args.get("timeout") or self.shell_timeout)
        try:
            env = {k: v for k, v in os.environ.items() if k not in self.secrets and k != SECRETS_ENV}
            proc = subprocess.run(["/bin/sh", "-c", cmd], cwd=self.root, env=env, capture_output=True,
                                  timeout=min(timeout, 600))
        except subprocess.TimeoutExpired:
            raise ToolError(f"the command timed out after {timeout:.0f} s") from None
        out = (proc.stdout + proc.stderr).decode(errors="replace")[-MAX_TOOL_OUTPUT:]
        return f"exit status {proc.returncode}\n{out}"

    def tool_recall(self, args: Mapping[str, Any]) -> str:
        from capsulefs.core.semantic.index import search_capsule

        query = args.get("query")
        if not isinstance(query, str) or not query:
            raise ToolError("query must be a non-empty string")
        k = int(args.get("k") or 5)
        try:  # the index brought up to date is saved (atomically, through the mount), so the next start has it
            hits = search_capsule(self.capsule_dir, query, k, save=True)
        except OSError as exc:  # (frozen by a move, read-only, or larger than the mount takes): searched unsaved
            log.warning("recall: the semantic index could not be saved (%s); searching without saving", exc)
            hits = search_capsule(self.capsule_dir, query, k, save=False)
        return "\n".join(f"[{h.kind} {h.event} {h.time}] {h.snippet}" for h in hits) or "no matches"
