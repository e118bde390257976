"""The capsule format, version ``capsule/1``: the one canonical definition.

A capsule is a directory, or a tar of one (plain, gzip or zstd), holding only
regular files and directories::

    manifest.json                   identity, holder, a digest for every other file
    manifest.sig                    optional: Ed25519 signature over manifest.json
    memory/working_memory.md        the agent's own notes (UTF-8 markdown)
    memory/timeline_events.jsonl    the journal: one immutable event per line
    memory/vector_index/index.json  the local semantic index (derived data)
    artifacts/snapshot.json         the workspace: {"files": {path: sha256}}
    artifacts/blobs/<sha256>        file bodies; a blob's name is the sha256 of its bytes
    environment/spec.json           how to rebuild the sandbox (see spec.py)

Rules (MUST):
  * ``manifest.json`` lists every file of the capsule except itself and
    ``manifest.sig``, each with its sha256 (64 lowercase hex) and size.
  * The tree is closed: a capsule's files are the ones above and blobs
    named by their sha256 (:func:`in_tree`); a manifest listing any other
    path is refused.
  * JSON is strict (:func:`load_json`): UTF-8, no key twice, at most
    MAX_JSON_DEPTH deep; every integer field is 0 (or 1) to MAX_INT.
  * Paths are relative, '/'-separated, with no empty, ``.`` or ``..``
    component, no NUL and no backslash; nothing absolute.
  * ``agent_id`` is fixed for the agent's whole life. Every component keys the
    agent by ``agent_id``, never by ``name`` (which is for people and may be
    renamed).
  * ``holder.epoch`` only grows. The move protocol fences on it.
  * Every workspace sha256 in ``artifacts/snapshot.json`` has its blob in
    ``artifacts/blobs/``.
  * Nothing outside the tree above is part of a capsule (``tree_kind``);
    in a tar, ``manifest.json`` comes first (see tarball.py). The limits
    (``MAX_*``) are listed in docs/format.md, "Limits".
  * Readers keep manifest fields they do not know (forward compatibility).

See docs/format.md for the prose version of this module; they must agree.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Mapping
from typing import Any, TypeGuard

from ..errors import FormatError, NameTooLong, UnsafePathError
from ..frozen import Frozen

FORMAT = "capsule/1"

# Fixed paths inside a capsule.
MANIFEST = "manifest.json"
SIGNATURE = "manifest.sig"
WORKING_MEMORY = "memory/working_memory.md"
JOURNAL = "memory/timeline_events.jsonl"
VECTOR_INDEX = "memory/vector_index/index.json"
SNAPSHOT = "artifacts/snapshot.json"
BLOBS_DIR = "artifacts/blobs"
SPEC = "environment/spec.json"

#: Files every capsule must contain (besides blobs).
REQUIRED_FILES = (WORKING_MEMORY, JOURNAL, VECTOR_INDEX, SNAPSHOT, SPEC)
#: Files that are never listed in the manifest.
UNLISTED = frozenset({MANIFEST, SIGNATURE})
_BLOBS_PREFIX = BLOBS_DIR + "/"
_BLOB_PATH_LEN = len(_BLOBS_PREFIX) + 64

#: The capsule's tree: its directories (besides its root) and its files at
#: fixed paths; blobs are ``artifacts/blobs/<sha256>``. Nothing else is part
#: of a capsule, so its depth (3) and path length (80 bytes) are bounded.
TREE_DIRS = frozenset({"memory", "memory/vector_index", "artifacts", BLOBS_DIR, "environment"})
TREE_FILES = UNLISTED | frozenset(REQUIRED_FILES)

# Limits (docs/format.md, "Limits").
#: Files a manifest may list.
MAX_FILES = 1_000_000
#: Bytes of manifest.json (a listed file takes about 200).
MAX_MANIFEST_BYTES = 256 << 20
#: Bytes of manifest.sig (one is about 200).
MAX_SIGNATURE_BYTES = 64 << 10

_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_AGENT_ID_RE = re.compile(r"[0-9a-f]{32}")
_HOST_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MAX_PATH_BYTES = 4096
MAX_NAME_BYTES = 255


def is_sha256(value: object) -> TypeGuard[str]:
    return isinstance(value, str) and _SHA256_RE.fullmatch(value) is not None


def check_sha256(value: object, what: str) -> str:
    if not is_sha256(value):
        raise FormatError(f"{what}: {value!r} is not a sha256 (64 lowercase hex digits)")
    return value


def is_agent_id(value: object) -> TypeGuard[str]:
    return isinstance(value, str) and _AGENT_ID_RE.fullmatch(value) is not None


def check_agent_id(value: object) -> str:
    if not is_agent_id(value):
        raise FormatError(f"agent_id {value!r} is not 32 lowercase hex digits")
    return value


def check_host_id(value: object) -> str:
    if not isinstance(value, str) or not _HOST_ID_RE.fullmatch(value):
        raise FormatError(f"host id {value!r} is not 1-128 letters, digits, '.', '_' or '-'")
    return value


def has_control(text: str) -> bool:
    """Whether ``text`` holds a C0 control character (newline, tab, NUL, ESC...)."""
    return any(ord(c) < 32 for c in text)


def check_agent_name(value: object) -> str:
    """An agent's display name: one safe directory name, not hidden."""
    if not isinstance(value, str) or not value:
        raise FormatError("agent name must be a non-empty string")
    if "/" in value or "\0" in value or value in (".", ".."):
        raise FormatError(f"agent name {value!r} must not contain '/' or NUL, nor be '.' or '..'")
    if value.startswith("."):
        raise FormatError(f"agent name {value!r} must not start with '.'")
    try:
        encoded = value.encode("utf-8")
    except UnicodeEncodeError:  # a byte that is not UTF-8 (surrogate-escaped by os.fsdecode or argv), or a lone surrogate
        raise FormatError(f"agent name {value!r} is not valid UTF-8") from None
    if len(encoded) > MAX_NAME_BYTES:
        raise NameTooLong(f"agent name {value[:20]!r}... is longer than {MAX_NAME_BYTES} bytes")
    if has_control(value):
        raise FormatError(f"agent name {value!r} contains a control character")
    return value


def check_relpath(path: object, what: str = "path") -> str:
    """Return ``path`` if it is a safe capsule-relative path, else raise.

    Distrusts its input: used for tar members, manifest keys, snapshot keys
    and anything a user typed.
    """
    if not isinstance(path, str) or not path:
        raise UnsafePathError(f"{what} {path!r}: empty or not a string")
    if "\0" in path or "\\" in path:
        raise UnsafePathError(f"{what} {path!r}: contains NUL or backslash")
    if path.startswith("/"):
        raise UnsafePathError(f"{what} {path!r}: absolute paths are not allowed")
    if len(path.encode("utf-8", "surrogateescape")) > MAX_PATH_BYTES:
        raise UnsafePathError(f"{what} {path[:40]!r}...: longer than {MAX_PATH_BYTES} bytes")
    for part in path.split("/"):
        if part in ("", ".", ".."):
            raise UnsafePathError(f"{what} {path!r}: '..', '.' and empty components are not allowed")
    return path


def in_tree(path: str) -> bool:
    """Whether a manifest may list ``path``: a file of the capsule's tree
    (:func:`tree_kind`) other than manifest.json and manifest.sig. The tree
    is closed: nothing else is part of a capsule."""
    return tree_kind(path) == "file" and path not in UNLISTED


def blob_path(sha256: str) -> str:
    return f"{BLOBS_DIR}/{check_sha256(sha256, 'blob name')}"


def tree_kind(path: str) -> str | None:
    """"file" or "dir" where the capsule's tree has ``path`` (a checked
    relative path), None where the format has nothing."""
    if path in TREE_FILES:
        return "file"
    if path in TREE_DIRS:
        return "dir"
    is_blob = len(path) == _BLOB_PATH_LEN and path.startswith(_BLOBS_PREFIX) and \
        _SHA256_RE.fullmatch(path, len(_BLOBS_PREFIX)) is not None
    return "file" if is_blob else None


def blob_name(path: str) -> str | None:
    """The sha256 named by ``artifacts/blobs/<sha256>``, or None for other paths."""
    prefix = BLOBS_DIR + "/"
    if path.startswith(prefix):
        return path[len(prefix):]
    return None


# Frozen value classes (core/frozen.py): the fields are the __slots__, checked in __init__.


class FileEntry(Frozen):
    """One file a manifest lists."""

    __slots__ = ("sha256", "size")
    sha256: str  # 64 lowercase hex: sha256 of the file's exact bytes
    size: int  # the file's length in bytes

    def __init__(self, *, sha256: str, size: int) -> None:
        check_sha256(sha256, "file entry")
        check_int(size, "file entry size")
        object.__setattr__(self, "sha256", sha256)
        object.__setattr__(self, "size", size)


class Holder(Frozen):
    """Who holds an agent, at which epoch."""

    __slots__ = ("host", "epoch")
    host: str  # host id of the machine that holds (may run) the agent
    epoch: int  # fencing epoch; grows by one at every move

    def __init__(self, *, host: str, epoch: int) -> None:
        check_host_id(host)
        check_int(epoch, "holder epoch")
        object.__setattr__(self, "host", host)
        object.__setattr__(self, "epoch", epoch)


class Manifest(Frozen):
    """A capsule's manifest.json."""

    __slots__ = ("agent_id", "name", "holder", "files", "extra")
    agent_id: str  # 32 lowercase hex; stable for the agent's whole life
    name: str  # display name; the agent's directory name in a mount
    holder: Holder  # who holds the agent, at which epoch
    files: Mapping[str, FileEntry]  # every file but manifest.json and manifest.sig
    extra: Mapping[str, Any]  # unknown fields, kept verbatim (default: a new empty dict)

    def __init__(
        self, *, agent_id: str, name: str, holder: Holder, files: Mapping[str, FileEntry],
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        for field, value in (("agent_id", agent_id), ("name", name), ("holder", holder), ("files", files),
                             ("extra", {} if extra is None else extra)):
            object.__setattr__(self, field, value)
        check_agent_id(self.agent_id)
        check_agent_name(self.name)
        for path in self.files:
            if not in_tree(path):
                check_relpath(path, "manifest path")
                if path in UNLISTED:
                    raise FormatError(f"manifest lists {path}, which it must not list")
                raise FormatError(f"manifest lists {path!r}, which is not a file of a capsule (a {FORMAT} capsule "
                                  f"holds {', '.join(REQUIRED_FILES)} and {BLOBS_DIR}/<sha256>, nothing else)")

    def blob_entries(self) -> dict[str, FileEntry]:
        """The entries of the blobs it lists (``blobs/<sha256>``), in a new dict."""
        return {p: e for p, e in self.files.items() if blob_name(p) is not None}

    def with_files(self, files: Mapping[str, FileEntry]) -> "Manifest":
        """The same agent, name, holder and unknown fields, listing ``files``."""
        return Manifest(agent_id=self.agent_id, name=self.name, holder=self.holder, files=files, extra=self.extra)

    def with_holder(self, holder: Holder) -> "Manifest":
        return Manifest(agent_id=self.agent_id, name=self.name, holder=holder, files=self.files, extra=self.extra)

    # -- serialisation ---------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = dict(self.extra)
        doc.update(
            {
                "format": FORMAT,
                "agent_id": self.agent_id,
                "name": self.name,
                "holder": {"host": self.holder.host, "epoch": self.holder.epoch},
                "files": {
                    p: {"sha256": e.sha256, "size": e.size} for p, e in sorted(self.files.items())
                },
            }
        )
        return doc

    def to_bytes(self) -> bytes:
        """Deterministic bytes: sorted keys, two-space indent, trailing newline."""
        return (json.dumps(self.to_json(), sort_keys=True, indent=2, ensure_ascii=False) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "Manifest":
        doc = load_json_object(data, MANIFEST)
        fmt = doc.get("format")
        if fmt != FORMAT:
            raise FormatError(f"{MANIFEST}: format {fmt!r} is not {FORMAT!r}")
        for key in ("agent_id", "name", "holder", "files"):
            if key not in doc:
                raise FormatError(f"{MANIFEST}: missing field {key!r}")
        holder = doc["holder"]
        if not isinstance(holder, dict) or not {"host", "epoch"} <= set(holder):
            raise FormatError(f"{MANIFEST}: holder must be {{'host': ..., 'epoch': ...}}")
        files = doc["files"]
        if not isinstance(files, dict):
            raise FormatError(f"{MANIFEST}: files must be an object")
        entries = {}
        for path, entry in files.items():
            if not isinstance(entry, dict):
                raise FormatError(f"{MANIFEST}: entry for {path!r} must be an object")
            try:
                entries[path] = FileEntry(sha256=entry.get("sha256"), size=entry.get("size"))  # type: ignore[arg-type]  # FileEntry checks them
            except FormatError as exc:
                raise FormatError(f"{MANIFEST}: {path!r}: {exc}") from None
        extra = {k: v for k, v in doc.items() if k not in ("format", "agent_id", "name", "holder", "files")}
        return cls(
            agent_id=doc["agent_id"],
            name=doc["name"],
            holder=Holder(host=holder["host"], epoch=holder["epoch"]),
            files=entries,
            extra=extra,
        )

    def blobs(self) -> dict[str, int]:
        """sha256 -> size of every blob the manifest lists."""
        out = {}
        for path, entry in self.files.items():
            name = blob_name(path)
            if name is not None:
                out[name] = entry.size
        return out


# -- JSON documents ----------------------------------------------------------
#
# Every document and line that comes from outside (a capsule's files, a
# journal line, a draft, a holder record, a peer's message) is parsed here,
# and only one form of it is JSON text: UTF-8 without a byte order mark, no
# key twice in one object, at most MAX_JSON_DEPTH deep, no NaN or Infinity,
# no float that overflows, no lone UTF-16 surrogate, no integer longer than
# the interpreter converts (sys.get_int_max_str_digits(), 4300 digits). Any
# of these is the caller's ``error`` (a FormatError by default) naming the
# document: never a ValueError or RecursionError, which the mount would take
# for its own fault.

#: Deepest nesting of arrays and objects a document may have. Far beyond
#: anything the format or a provider's tool arguments use, and far below
#: Python's recursion limit, so that parsing, re-encoding and walking a
#: document cannot run out of stack whatever the caller's depth.
MAX_JSON_DEPTH = 64

#: A ``\\uD800``-``\\uDFFF`` escape: how JSON text can carry a lone surrogate,
#: which parses into a str that cannot be encoded as UTF-8 again.
_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")


class _NotJSON(ValueError):
    """What Python's parser accepts beyond JSON: NaN, Infinity, 1e999, a key twice."""


def _no_constant(name: str) -> Any:
    raise _NotJSON(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise _NotJSON(f"{text[:40]} is out of range")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    doc = dict(pairs)
    if len(doc) != len(pairs):
        seen: set[str] = set()
        for key, _value in pairs:
            if key in seen:
                raise _NotJSON(f"key {key[:64]!r} appears twice in one object")
            seen.add(key)
    return doc


_DECODER = json.JSONDecoder(object_pairs_hook=_unique_keys, parse_constant=_no_constant, parse_float=_finite_float)


def load_json(data: bytes | bytearray | memoryview | str, what: str, *, error: type[Exception] = FormatError) -> Any:
    """Parse one JSON document from outside, strictly (see above): any fault
    is ``error`` naming ``what``. Time and memory are linear in its size."""
    if isinstance(data, str):
        text = data
        try:
            text.encode()
        except UnicodeEncodeError:  # surrogate-escaped bytes from argv, or a lone surrogate
            raise error(f"{what} is not valid JSON text: it is not UTF-8 (or holds a lone UTF-16 surrogate)") from None
    else:
        try:
            text = bytes(data).decode()  # strict UTF-8: no guessing UTF-16/32, no encoded surrogates
        except UnicodeDecodeError as bad:
            raise error(f"{what} is not UTF-8 text: byte 0x{bad.object[bad.start]:02x} at offset {bad.start} "
                        "is not valid UTF-8") from None
    try:
        doc = _DECODER.decode(text)
    except RecursionError:
        raise error(f"{what} is not valid JSON: nested too deeply (more than {MAX_JSON_DEPTH} levels)") from None
    except ValueError as exc:  # JSONDecodeError, _NotJSON, and the int-digits limit's plain ValueError
        raise error(_not_json(text, what, exc)) from None
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH and _depth_over(doc):
        raise error(f"{what} is not valid JSON: nested too deeply (more than {MAX_JSON_DEPTH} levels)")
    if "\\u" in text and _SURROGATE.search(text):
        try:
            json.dumps(doc, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise error(f"{what} is not valid JSON text: it holds a lone UTF-16 surrogate (\\ud800-\\udfff)") from None
    return doc


def _depth_over(doc: Any) -> bool:
    """Whether a parsed document nests deeper than MAX_JSON_DEPTH, level by
    level (a container without containers in it costs one pass in C)."""
    level = [doc] if type(doc) is dict or type(doc) is list else []
    for _depth in range(MAX_JSON_DEPTH):
        deeper: list[Any] = []
        for node in level:
            values = node.values() if type(node) is dict else node
            kinds = set(map(type, values))
            if dict in kinds or list in kinds:
                deeper.extend(v for v in values if type(v) is dict or type(v) is list)
        if not deeper:
            return False
        level = deeper
    return True


def _not_json(text: str, what: str, exc: ValueError) -> str:
    """Why ``text`` did not parse, in words."""
    if text.startswith("\ufeff"):
        return f"{what} is not valid JSON: it starts with a byte order mark (JSON text here is UTF-8 without one)"
    if "\0" in text:
        return f"{what} is not valid JSON: it holds NUL bytes (UTF-16 or UTF-32 text? JSON text here is UTF-8)"
    if not isinstance(exc, _NotJSON) and "integer string conversion" in str(exc):
        return f"{what} is not valid JSON: a number has more than {sys.get_int_max_str_digits()} digits"
    return f"{what} is not valid JSON: {exc}"


def load_json_object(data: bytes | bytearray | memoryview | str, what: str, *,
                     error: type[Exception] = FormatError) -> dict[str, Any]:
    """:func:`load_json` of a document that must be a JSON object."""
    doc = load_json(data, what, error=error)
    if not isinstance(doc, dict):
        raise error(f"{what} must be a JSON object")
    return doc


# -- integer fields --------------------------------------------------------------

#: Largest value of every integer field the format defines (seq, clock, v,
#: epoch, size, counts): 2**53 - 1, the largest integer every JSON reader
#: (an IEEE double) holds exactly, and far beyond any real count.
MAX_INT = (1 << 53) - 1


def check_int(value: object, what: str, *, low: int = 0, error: type[Exception] = FormatError) -> int:
    """``value`` if it is an integer (not a bool) from ``low`` to MAX_INT, else ``error``."""
    if isinstance(value, int) and not isinstance(value, bool) and low <= value <= MAX_INT:
        return value
    raise error(f"{what} {_brief(value)} is not an integer from {low} to 2**53-1")


def _brief(value: object) -> str:
    """``value`` for a message, short whatever its size."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"(an integer of {value.bit_length()} bits)"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# -- the workspace snapshot -------------------------------------------------


def parse_snapshot(data: bytes) -> dict[str, str]:
    """Parse ``artifacts/snapshot.json`` into {workspace path: sha256}."""
    doc = load_json(data, SNAPSHOT)
    if not isinstance(doc, dict) or not isinstance(doc.get("files"), dict):
        raise FormatError(f'{SNAPSHOT} must be {{"files": {{path: sha256}}}}')
    files = doc["files"]
    for path, sha in files.items():
        check_relpath(path, "workspace path")
        check_sha256(sha, f"{SNAPSHOT}: {path}")
    return dict(files)


def snapshot_bytes(files: Mapping[str, str]) -> bytes:
    for path, sha in files.items():
        check_relpath(path, "workspace path")
        check_sha256(sha, f"workspace path {path}")
    return (json.dumps({"files": dict(sorted(files.items()))}, sort_keys=True, indent=2) + "\n").encode()


def empty_vector_index() -> bytes:
    """The index of an agent whose journal is empty (see capsulefs.core.semantic.vectors)."""
    doc: dict[str, Any] = {"format": "vector-index/1", "embedder": None, "journal": {"events": 0, "last": None}, "entries": []}
    return (json.dumps(doc, sort_keys=True) + "\n").encode()
