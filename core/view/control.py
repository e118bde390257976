"""The control files, ``AGENT/.control/``: status, model, move, abandon, learn, remove.

Rules:
  * Only the mounting user and root may write them (the view checks it at open).
  * A write is one line: ``control_line`` reads it (UTF-8, one line, at most
    :data:`MAX_CONTROL_LINE` bytes); anything else is a FormatError and changes nothing.
  * ``move``/``abandon``/``learn`` and ``remove`` are carried out by the daemon
    (:class:`Mover`, :class:`Remover`); without one they fail with NotSupported.
    Each is refused with ReadOnly while the view's :class:`WriteGuard` refuses
    writes (the fleet mode's lease), as every write is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from ..errors import FormatError
from ..render import PROVIDER_ALIASES, PROVIDERS
from .agent import MOVE_UNAVAILABLE, LiveAgent
from .errors import NotSupported
from .handles import Handle
from .nodes import AgentState

#: Longest line accepted by ``.control/model``, ``.control/move``, ``.control/abandon`` and ``.control/remove``.
MAX_CONTROL_LINE = 1024
REMOVE_UNAVAILABLE = "removing agents through this mount is not available (.control/remove is reserved)"


class Mover(Protocol):
    """Who carries out ``.control/move`` and ``.control/abandon`` (the daemon).

    ``move`` returns once the agent moved and raises a domain error (see
    ``view.errors``: MoveBusy, or MoveFailed with its Cause) if the move
    rolled back or was refused; ``abandon`` ends an in-doubt move; ``learn``
    asks the peers who holds an agent in doubt here (``capsulefs move --learn``)
    and returns once this host holds it or gave it up (its copy kept)."""

    async def move(self, agent_id: str, target: str) -> None: ...

    async def abandon(self, agent_id: str, why: str) -> None: ...

    async def learn(self, agent_id: str) -> None: ...


class Remover(Protocol):
    """Who carries out ``.control/remove`` (the daemon).

    ``remove`` returns once the agent is gone from this host (its process
    stopped, its files and the areas beside them removed) and raises a
    domain error if it was refused: MoveBusy while a move of it is under
    way, ReadOnly in failsafe, NotFoundError if it is gone already."""

    async def remove(self, agent_id: str) -> None: ...


class NewAgents(Protocol):
    """Who is told of an agent made by ``mkdir`` at the root, right after
    (the daemon records that this host holds it: without a holder record
    an agent never runs and cannot move)."""

    def created(self, agent_id: str, epoch: int) -> None: ...


class WriteGuard(Protocol):
    """Whether this host may acknowledge a write now: asked before every
    write the view takes and every control command that changes state (the
    daemon's, in the fleet mode: the host lease's deadline by its keeper,
    docs/fleet.md, "The lease timing argument"). It must be cheap: a
    monotonic clock read and a compare while all is well."""

    def refuses_writes(self) -> str | None:
        """None while writes may be acknowledged; else why not (ReadOnly's message)."""


class Arrivals(Protocol):
    """Who decides how an agent the view has not been told about is shown,
    the first time a request sees it (the daemon's lifecycle owner): one
    another process put in the store while the mount serves (``capsulefs
    import``), or a move installed before activating it. ``arrived`` returns
    what its holder record and the lifecycle say, or None while it has no
    record yet (an import is installing it): shown read-only, asked again."""

    def arrived(self, agent_id: str) -> AgentState | None: ...


class TierCache(Protocol):
    """The local store as a cache of the fleet's blob tier (capsulefs/fleet/cache.py;
    None without a tier): which missing blobs were evicted (the tier holds
    them), and getting them back before a reader reads them."""

    def evicted(self, sha256: str) -> bool:
        """Missing here and named by the tier record (quick, any thread)."""

    async def ensure_local(self, sizes: Mapping[str, int]) -> None:
        """Fetch back the evicted blobs of ``sizes`` (digest -> size), verified;
        BlobUnavailable naming the blob and why if one could not be."""


class Owners(Protocol):
    """With sandbox isolation (agents run as uids of their own): the uid an
    agent's processes run as, or None before it has one."""

    def owner_of(self, agent_id: str) -> int | None: ...


class ModelHandle(Handle):
    """.control/model: reads ``provider:model``; a write switches the model."""

    direct_io = True

    def __init__(self, agent: "LiveAgent", writable: bool) -> None:
        self.agent = agent
        self.writable = writable
        self.data = agent.model_bytes()

    def read(self, offset: int, size: int) -> bytes:
        return self.data[offset: offset + size]

    def write(self, offset: int, data: bytes) -> int:
        # One short line, whole: a long write comes in pieces, none of which may switch the model.
        self.agent.switch_model(*parse_model_line(bytes(data)))
        return len(data)

    def truncate(self, size: int) -> None:
        pass  # `echo x > model` truncates first; the write that follows is what counts


class MoveHandle(Handle):
    """.control/move (a peer's name or host id: move the agent there) and
    .control/abandon (a reason: end an in-doubt move here), .control/learn
    (any line: ask the peers who holds an agent in doubt here). A write blocks
    until the mover is done; its outcome is the write's error."""

    direct_io = True

    def __init__(self, agent: "LiveAgent", what: str, mover: Mover | None) -> None:
        self.agent = agent
        self.what = what  # "move", "abandon" or "learn"
        self.mover = mover

    def read(self, offset: int, size: int) -> bytes:
        return b""

    def write(self, offset: int, data: bytes) -> int:
        raise NotSupported(MOVE_UNAVAILABLE)

    async def write_async(self, offset: int, data: bytes) -> int:
        if self.mover is None:
            raise NotSupported(MOVE_UNAVAILABLE)
        line = control_line(bytes(data), f".control/{self.what}")
        self.agent.host.check_lease()
        if self.what == "move":
            await self.mover.move(self.agent.agent_id, line)
        elif self.what == "learn":
            await self.mover.learn(self.agent.agent_id)
        else:
            await self.mover.abandon(self.agent.agent_id, line)
        return len(data)

    def truncate(self, size: int) -> None:
        pass  # `echo x > move` truncates first; the write that follows is what counts


class RemoveHandle(Handle):
    """.control/remove: the agent's id, exactly, removes the agent from this
    host. Anything else (its name, ``yes``, an empty line) is refused with
    FormatError and removes nothing, so a stray write cannot delete an agent.
    A write blocks until the remover is done; its outcome is the write's error."""

    direct_io = True

    def __init__(self, agent: "LiveAgent", remover: Remover | None) -> None:
        self.agent = agent
        self.remover = remover

    def read(self, offset: int, size: int) -> bytes:
        return b""

    def write(self, offset: int, data: bytes) -> int:
        raise NotSupported(REMOVE_UNAVAILABLE)

    async def write_async(self, offset: int, data: bytes) -> int:
        if self.remover is None:
            raise NotSupported(REMOVE_UNAVAILABLE)
        check_removal(bytes(data), self.agent.agent_id)
        self.agent.host.check_lease()
        await self.remover.remove(self.agent.agent_id)
        return len(data)

    def truncate(self, size: int) -> None:
        pass  # `echo ID > remove` truncates first; the write that follows is what counts


def control_line(data: bytes, what: str, *, example: str = "laptop", strip: bool = True) -> str:
    """The one line of text a control file write may carry, or FormatError:
    UTF-8 without control characters (C0, DEL, C1), one trailing newline
    allowed (as ``echo`` writes). ``strip``: spaces around it and a CRLF
    line end are dropped (a peer's name, a model); else they are part of
    the text."""
    if len(data) > MAX_CONTROL_LINE:
        raise FormatError(f"{what}: write one line of at most {MAX_CONTROL_LINE} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise FormatError(f"{what}: not UTF-8 text") from None
    text = text[:-1] if text.endswith("\n") else text
    if strip and text.endswith("\r"):  # (a CRLF line end)
        text = text[:-1]
    if not text.strip(" ") or any(ord(c) < 32 or 0x7F <= ord(c) < 0xA0 for c in text):  # (another newline is one)
        raise FormatError(f"{what}: write exactly one non-empty line (e.g. `echo {example} > {what}`)")
    return text.strip(" ") if strip else text


def parse_model_line(data: bytes) -> tuple[str, str]:
    """What a write to ``.control/model`` switches to: (provider id, model), or
    FormatError. The provider must be one the renderers know, or a short
    name for one (``render.PROVIDER_ALIASES``): the agent could never answer
    for another."""
    line = control_line(data, ".control/model", example="anthropic:claude-sonnet-4-5")
    provider, sep, model = line.partition(":")
    provider, model = provider.strip(" "), model.strip(" ")
    if not sep or not provider or not model:
        raise FormatError(f"model {line[:80]!r} is not provider:model (e.g. anthropic:claude-sonnet-4-5)")
    provider = PROVIDER_ALIASES.get(provider, provider)
    if provider not in PROVIDERS:
        known = ", ".join(sorted(PROVIDERS)) + "; " + ", ".join(f"{a} means {p}" for a, p in
                                                              sorted(PROVIDER_ALIASES.items()))
        raise FormatError(f"unknown provider {provider[:80]!r} in .control/model; known: {known}")
    return provider, model


def check_removal(data: bytes, agent_id: str) -> None:
    """FormatError unless a write to ``.control/remove`` is exactly ``agent_id``
    (with at most the newline ``echo`` adds): a stray write removes nothing."""
    token = control_line(data, ".control/remove", example="AGENT_ID", strip=False)
    if token != agent_id:
        raise FormatError(f".control/remove: {token[:64]!r} is not this agent's id; write exactly its id, "
                          f"nothing around it (\"agent_id\" in .control/status) to remove it")
